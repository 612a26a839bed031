"""The simulator's H200 step tables, derived from the GPU pages (their results.json files are not kept):
every decode cell of docs/results/gpu-decode.md, and where that grid has no cell, the bytes/FLOPs model of
benchmarks/gpu/decode.py (step_time) scaled by the nearest measured cell's measured / modelled time; prefill
was never measured on a GPU: it is modelled from FLOPs, at the efficiency cuBLAS reached on 768 rows of the
8B MLP in docs/results/gpu-kernels.md. Each cell names its source.

    python -m benchmarks.sim.gpu_tables          # writes vskipper/sim/tables/h200-llama3-8b.json and the page

Systems (Llama-3-8B shape, bf16; routed layers 16-31 of 32):
    upstream       the base model (gpu-decode's "base" column; its measured ms)
    random0.5      vskipper, RandomSkip 0.5, the `auto` body (gpu-decode's "auto" tok/s); prefill: the routed
                   layers' MLP on half the rows through the grouped GEMM at its measured cost over torch on the
                   same rows (gpu-kernels, T=1024), attention for every row (the transformers path)
    flexidepth0.5  a FlexiDepth-like skipper at RUN fraction 0.5 over 16 of 32 layers: random0.5's steps plus its
                   router (every row) and adapter (PROJECT rows) per routed layer, modelled (bytes in decode,
                   FLOPs in prefill)
    ideal0.5       RandomSkip 0.5 at the bytes/FLOPs ideal (q/o, attention and MLP skipped for skipped rows;
                   gpu-decode's "ideal" column): what the step could reach, not what it does
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from benchmarks import results as R

ROOT = Path(__file__).resolve().parents[2]
DECODE_PAGE = ROOT / "docs" / "results" / "gpu-decode.md"
KERNELS_PAGE = ROOT / "docs" / "results" / "gpu-kernels.md"
TABLES = ROOT / "vskipper" / "sim" / "tables" / "h200-llama3-8b.json"
MODELLED_B = (512, 1024, 2048, 4096)  # past the grid's largest batch (SGLang's default here runs up to 4096)
RUN = 0.5
# The server: SGLang 0.5.23's defaults for one H200 (arg_groups/memory_hook.py: chunked prefill 8192 for
# 80-160 GB; mem_fraction_static (GPU memory - ~13 GB reserved) / GPU memory, about 0.9; max_running_requests
# max(min(KV tokens / context 8192 x 512, 4096), 2048) = 4096): a KV pool of 0.9 x 141 GB less 16 GB of
# weights over 128 KiB per token, about 850k tokens; 800k taken.
SERVER = ["--max-total-tokens", "800000", "--max-running-requests", "4096", "--chunked-prefill-size", "8192"]


def md_table(path: Path, first: str) -> list[dict]:
    """The rows of the markdown table whose header starts with `first`, as {header: cell}."""
    lines = path.read_text().splitlines()
    start = next(i for i, x in enumerate(lines) if x.startswith(f"| {first} |"))
    head = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = []
    for x in lines[start + 2:]:
        if not x.startswith("|"):
            break
        cells = [c.strip() for c in x.strip("|").split("|")]
        if len(cells) == len(head):
            rows.append(dict(zip(head, cells)))
    return rows


def decode_cells(page: Path) -> list[dict]:
    """gpu-decode's measured cells: B, C, base ms (measured), auto ms (B / auto tok/s), ideal speed-up, RUN."""
    out = []
    for r in md_table(page, "B"):
        model_ms, meas_ms = (float(x) for x in r["base: model ms / measured ms"].split("/"))
        B, C = int(r["B"]), int(r["context"])
        out.append({"B": B, "C": C, "base_ms": meas_ms, "model_ms": model_ms,
                    "auto_ms": B / float(r["auto tok/s"]) * 1e3, "ideal": float(r["ideal"]),
                    "run": float(r["RUN fraction"])})
    if not out:
        raise ValueError(f"{page}: no decode cells read")
    return out


def kernel_efficiency(page: Path) -> tuple[float, float, str]:
    """(cuBLAS efficiency on the gathered rows, grouped/torch time), from grouped_swiglu_ at T=1024."""
    row = next(r for r in md_table(page, "op") if r["op"] == "grouped_swiglu_" and r["T"] == "1024")
    n, us = int(row["n"]), float(row["base: torch on n rows (us)"])
    m = re.search(r"H=(\d+), I=(\d+)", page.read_text())
    H, I = int(m.group(1)), int(m.group(2))
    flops = 2 * n * 3 * H * I
    where = f"{page.relative_to(ROOT)}, grouped_swiglu_ T=1024"
    return flops / (us * 1e-6) / 989e12, float(row["triton / base"]), where


def build(args) -> tuple[dict, str]:
    from benchmarks.gpu.decode import Machine, step_time
    from benchmarks.gpu.harness import LLAMA3_8B as S
    from vskipper.sim.steps import FORMAT

    m = Machine(args.bw, args.peak)
    cells = decode_cells(args.decode_page)
    src = str(args.decode_page.relative_to(ROOT))
    eff, grouped, ksrc = kernel_efficiency(args.kernels_page)
    H, I, nh, kvh, d, L = S.hidden, S.intermediate, S.heads, S.kv_heads, S.head_dim, S.layers
    nr = len(S.routed)
    measured = {(c["B"], c["C"]): c for c in cells}
    contexts = sorted({c["C"] for c in cells})
    want = sorted({(B, C) for B in sorted({c["B"] for c in cells}) + list(MODELLED_B) for C in contexts})
    # router (2 H x H/16) and adapter (3 H x I/16) of one FlexiDepth routed layer (FACTS: the checkpoint's shapes)
    router_w, adapter_w = 2 * H * (H // 16), 3 * H * (I // 16)
    extra_ms = nr * (router_w + adapter_w) * m.elem / m.bw * 1e3  # their weights stream once a step
    systems = {k: [] for k in ("upstream", "random0.5", "flexidepth0.5", "ideal0.5")}
    for B, C in want:
        if (B, C) in measured:
            c = measured[(B, C)]
            where = f"{src}, B={B} context={C}"
            up, auto, ideal = c["base_ms"], c["auto_ms"], c["ideal"]
            systems["upstream"].append([B, C, up, "measured", f"{where}, base measured ms"])
            systems["random0.5"].append([B, C, round(auto, 3), "measured", f"{where}, B / auto tok/s"])
            systems["flexidepth0.5"].append([B, C, round(auto + extra_ms, 3), "measured + modelled",
                                             f"{where}, auto, + router and adapter bytes {extra_ms:.3f} ms"])
            systems["ideal0.5"].append([B, C, round(up / ideal, 3), "modelled: measured base / ideal",
                                        f"{where}, base / ideal"])
            continue
        near = max((c for c in cells if c["C"] == C and c["B"] < B), key=lambda c: c["B"], default=None) or \
            max(cells, key=lambda c: (c["B"], -abs(c["C"] - C)))
        scale = near["base_ms"] / near["model_ms"]
        model = step_time(S, B, C, m) * 1e3
        up = model * scale
        auto = up * near["auto_ms"] / near["base_ms"]
        tag = (f"modelled: bytes/FLOPs {model:.2f} ms x {scale:.2f} (measured / modelled at B={near['B']} "
               f"context={near['C']})")
        ideal = step_time(S, B, C, m) / step_time(S, B, C, m, RUN)
        systems["upstream"].append([B, C, round(up, 3), tag, src])
        systems["random0.5"].append([B, C, round(auto, 3), tag + f", x auto / base there "
                                     f"{near['auto_ms'] / near['base_ms']:.3f}", src])
        systems["flexidepth0.5"].append([B, C, round(auto + extra_ms, 3), tag + " (random0.5's) + router and adapter",
                                         src])
        systems["ideal0.5"].append([B, C, round(up / ideal, 3), tag + f" / ideal {ideal:.3f}", src])
    # prefill, from FLOPs (never measured on a GPU)
    w_layer = 2 * H * nh * d + 2 * H * kvh * d + 3 * H * I
    mlp_share = 3 * H * I / w_layer
    kv_share = 2 * H * kvh * d / w_layer
    per_tok = 2 * L * w_layer / (args.peak * eff) * 1e3
    per_pair = 4 * nh * d * L / (args.peak * eff) * 1e3
    e0 = measured[min(measured)]["base_ms"] - measured[min(measured)]["model_ms"]
    routed = nr / L
    ext = {"upstream": (per_tok, per_pair),
           "random0.5": (per_tok * (1 - routed * mlp_share * (1 - RUN * grouped)), per_pair),
           "ideal0.5": (per_tok * (1 - routed * (1 - kv_share) * (1 - RUN)), per_pair * (1 - routed * (1 - RUN)))}
    fd_extra = nr * (2 * router_w + 2 * adapter_w * (1 - RUN) * grouped) / (args.peak * eff) * 1e3
    ext["flexidepth0.5"] = (ext["random0.5"][0] + fd_extra, per_pair)
    b1 = min(measured)
    note = (f"modelled from FLOPs (prefill was never measured on a GPU): 2 x {L} x {w_layer / 1e6:.1f}M FLOPs a token "
            f"and 4 x {nh * d} x {L} a pair of attention at {eff:.2f} of {args.peak / 1e12:.0f} TFLOP/s (cuBLAS's "
            f"efficiency in {ksrc}), plus the eager overhead a step measured at B={b1[0]} context={b1[1]} "
            f"({e0:.2f} ms: measured less modelled, {src})")
    how = {"upstream": "", "random0.5": f"; routed layers' MLP ({mlp_share:.0%} of a layer's weights) on {RUN:g} of "
                                        f"the rows at {grouped:.2f}x torch's time ({ksrc}), attention for every row",
           "flexidepth0.5": "; random0.5's, plus router FLOPs (every row) and adapter FLOPs (PROJECT rows, grouped)",
           "ideal0.5": "; q/o, attention and MLP of skipped rows saved (K/V for every row)"}
    labels = {"upstream": "base model (transformers under CUDA graphs)",
              "random0.5": "vskipper RandomSkip 0.5, auto body (measured steps)",
              "flexidepth0.5": "FlexiDepth-like, RUN 0.5 over 16 of 32 layers (measured steps + router/adapter)",
              "ideal0.5": "RandomSkip 0.5 at the bytes/FLOPs ideal (modelled)"}
    runs = [c["run"] for c in cells]
    data = {"format": FORMAT, "device": "NVIDIA H200", "engine": "transformers + vskipper under CUDA graphs "
            "(benchmarks/gpu), priced as SGLang would schedule it", "model": "Llama-3-8B shape, bf16",
            "source": f"{src}, {ksrc}; python -m benchmarks.sim.gpu_tables",
            "host": {"decode_ms": [0.0, 0.0], "extend_ms": [0.0, 0.0], "ingress_ms": 0.0, "egress_ms": 0.0,
                     "serial": False, "source": "not measured (no SGLang on the GPU machines): taken as hidden "
                                                "behind the forward by SGLang's overlap scheduler"},
            "server": SERVER, "systems": {}}
    for n, dec in systems.items():
        pt, pp = ext[n]
        data["systems"][n] = {"label": labels[n],
                              "run_fraction": {"decode": 1.0 if n == "upstream" else
                                               (round(sum(runs) / len(runs), 3) if n == "random0.5" else RUN),
                                               "extend": 1.0 if n == "upstream" else RUN},
                              "decode": dec,
                              "extend": {"coef": {"e0": round(e0, 4), "per_token": pt, "per_pair": pp, "per_row": 0.0},
                                         "source": note + how[n]}}
    rows = []
    for n, s in data["systems"].items():
        for B, C, ms, tag, _ in s["decode"]:
            rows.append([n, B, C, f"{ms:.2f}", tag])
    text = ("Step tables of the simulator for one NVIDIA H200 (Llama-3-8B shape, bf16, routed layers 16-31), derived "
            "from the GPU pages by this command. Decode cells, ms per step (B rows of `context` tokens):\n\n"
            + R.table(["system", "B", "context", "ms", "where it comes from"], rows)
            + "\n\nPrefill (extend), ms = e0 + per_token N + per_pair A, every system "
            + note + ":\n\n"
            + R.table(["system", "e0 ms", "us per token", "ns per attention pair", "how"],
                      [[n, f"{e0:.2f}", f"{ext[n][0] * 1e3:.2f}", f"{ext[n][1] * 1e6:.3f}",
                        how[n].lstrip("; ") or "base"] for n in systems])
            + f"\n\nServer flags the projection runs with: `{' '.join(SERVER)}` (SGLang 0.5.23's defaults for one "
              "H200, see this script's SERVER). Host work: " + data["host"]["source"] + ".")
    return data, text


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.sim.gpu_tables", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decode-page", type=Path, default=DECODE_PAGE)
    ap.add_argument("--kernels-page", type=Path, default=KERNELS_PAGE)
    ap.add_argument("--bw", type=float, default=4.8e12, help="memory bandwidth of the bytes/FLOPs model (H200)")
    ap.add_argument("--peak", type=float, default=989e12, help="dense bf16 FLOP/s of the model (H200)")
    ap.add_argument("--tables", type=Path, default=TABLES)
    R.add_arguments(ap, "sim-steps-h200")
    args = ap.parse_args(argv)
    data, text = build(args)
    print(text)
    args.tables.parent.mkdir(parents=True, exist_ok=True)
    args.tables.write_text(json.dumps(data, indent=1) + "\n")
    R.write_results("sim-steps-h200", data, text, args.out, R.docs_dir(args))


if __name__ == "__main__":
    main()
