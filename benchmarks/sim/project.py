"""The GPU projection: the paper's serving table, projected by the simulator (vskipper/sim) from our H200
steps (vskipper/sim/tables/h200-llama3-8b.json, made by benchmarks/sim/gpu_tables.py from the GPU pages).
A projection, not a measurement: SGLang has not run on a GPU here.

    python -m benchmarks.sim.project                 # both workloads, every system, 5 seeds
    python -m benchmarks.sim.project --smoke         # a small sweep, no page

Per workload: upstream's knee Q* by the paper's definition (the last integer rate whose output tok/s beats
the running maximum of the lower rates by at least 1%, each rate a run of `--requests` Poisson arrivals),
then every system at 0.75, 0.95 and 1.25 x Q*: mean and p90 e2e and TTFT; and each system's saturation
throughput (all the requests at once). Each figure is the median over `--seeds` seeds (arrivals and
lengths), with the range over the seeds in brackets; the knee per seed too.
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from benchmarks import results as R
from benchmarks.results import log

TABLES = Path(__file__).resolve().parents[2] / "vskipper" / "sim" / "tables" / "h200-llama3-8b.json"
# Lengths in tokens at 4 characters a token (OpenAI's rule of thumb for English; Llama-3's 128k vocabulary
# is no less efficient). Prompts from evalscope's published prompt statistics (evalscope.readthedocs.io,
# benchmarks/gsm8k.html and bbh.html, v1.6.0): GSM8K 4-shot CoT, 1319 test prompts, mean 1966.87 chars,
# min/max 1800/2575; BBH 3-shot CoT, 6511 prompts, mean 3307.29 chars, min/max 1060/7885, subset means
# 1550-5270. Outputs: no statistics are published for these prompts; GSM8K's, between the 4-shot exemplars'
# answers (about 1967 / 4 chars an exemplar less a question: ~60 tokens), chain-of-thought answers of 72-99
# words from Llama-2 chat models (Nayab et al. 2024, arXiv 2407.19825, ~95-130 tokens) and 235 tokens an
# answer of a reasoning model (vLLM's gsm8k eval, PR #28594: 310,429 tokens for 1319 questions); BBH's, half of
# an exemplar of its 3-shot prompt (3307 / 3 / 2 chars). Both end at EOS, capped at 512 new tokens.
WORKLOADS = {
    "gsm8k": {"label": "GSM8K-like", "prompt": "normal:mean=492,sd=32,min=450,max=644",
              "output": "lognormal:mean=150,sd=70,min=16,max=512", "max_new": 512},
    "bbh": {"label": "BBH-like", "prompt": "normal:mean=827,sd=220,min=265,max=1971",
            "output": "lognormal:mean=140,sd=70,min=16,max=512", "max_new": 512},
}
SYSTEMS = ("upstream", "random0.5", "flexidepth0.5", "ideal0.5")
LOADS = (0.75, 0.95, 1.25)
SHOWN = (("e2e_mean", "mean e2e"), ("e2e_p90", "p90 e2e"), ("ttft_mean", "mean TTFT"), ("ttft_p90", "p90 TTFT"))


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.sim.project", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tables", type=Path, default=TABLES)
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS))
    ap.add_argument("--requests", type=int, default=1200, help="requests per run (default 1200)")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--max-rate", type=int, default=120, help="the knee sweep's last integer rate")
    ap.add_argument("--smoke", action="store_true")
    R.add_arguments(ap, "sim-projection-h200")
    a = ap.parse_args(argv)
    if a.smoke:
        a.requests, a.seeds, a.max_rate = 200, 2, 40
    if "upstream" not in a.systems:
        ap.error("--systems must include upstream")
    return a


def run(tables, name: str, wl: dict, rate: float, n: int, seed: int) -> dict:
    from vskipper.sim import ServerConfig, Workload, poisson, simulate

    w = Workload(wl["prompt"], wl["output"], wl["max_new"])
    arr = [0.0] * n if rate == float("inf") else poisson(rate, n=n, seed=seed)
    res = simulate(w.requests(arr, seed), tables.model(name), tables.host_for(name),
                   ServerConfig.from_flags(tables.server))
    s = res.summary()
    total = sum(res.priced.values())
    s["priced"] = {k: v / total for k, v in res.priced.items()}
    return s


def knee_of(tables, wl: dict, args, seed: int) -> tuple[float, list[tuple[int, float]]]:
    """The knee of upstream's curve for one seed: integer rates until 5 in a row bring no new 1% maximum."""
    from vskipper.sim import knee

    curve, best, since = [], 0.0, 0
    for rate in range(1, args.max_rate + 1):
        tps = run(tables, "upstream", wl, rate, args.requests, seed)["output_tps"]
        curve.append((rate, tps))
        since = 0 if tps >= best * 1.01 else since + 1
        best = max(best, tps)
        if since >= 5:
            break
    return knee([r for r, _ in curve], [t for _, t in curve]), curve


def med(xs: list[float]) -> tuple[float, float, float]:
    return statistics.median(xs), min(xs), max(xs)


def project(args) -> tuple[dict, str]:
    from vskipper.sim import StepTables

    tables = StepTables.load(args.tables)
    out, parts = {}, []
    for key in args.workloads:
        wl = WORKLOADS[key]
        knees, curves = [], []
        for seed in range(args.seeds):
            q, c = knee_of(tables, wl, args, seed)
            knees.append(q)
            curves.append(c)
        q_star = statistics.median(knees)
        log(f"{wl['label']}: upstream's knee {q_star:g} req/s (seeds: {knees})")
        rows, res = [], {"knee": q_star, "knees": knees, "curves": curves, "loads": {}, "saturation": {}}
        for load in LOADS:
            rate = load * q_star
            per = {n: [run(tables, n, wl, rate, args.requests, s) for s in range(args.seeds)] for n in args.systems}
            res["loads"][load] = per
            up = per["upstream"]
            for n in args.systems:
                cells = [f"{load:g} x Q* = {rate:g}", tables.model(n).label]
                for k, _ in SHOWN:
                    m, lo, hi = med([x[k] for x in per[n]])
                    cells.append(f"{m / 1e3:.2f} [{lo / 1e3:.2f}, {hi / 1e3:.2f}]")
                    if n != "upstream":
                        d = med([x[k] / u[k] - 1 for x, u in zip(per[n], up)])
                        cells[-1] += f" ({d[0]:+.1%})"
                rows.append(cells)
        priced = []
        for load in LOADS:
            for n in args.systems:
                p = res["loads"][load][n]
                share = {k: med([x["priced"].get(k, 0.0) for x in p])[0]
                         for k in ("decode within measured B", "decode past measured B", "extend")}
                priced.append([f"{load:g} x Q*", n] + [f"{v:.0%}" for v in share.values()])
        sat_rows = []
        for n in args.systems:
            sat = [run(tables, n, wl, float("inf"), args.requests, s) for s in range(args.seeds)]
            res["saturation"][n] = sat
            up = res["saturation"]["upstream"]
            r, lo, hi = med([x["request_tps"] for x in sat])
            t, tlo, thi = med([x["output_tps"] for x in sat])
            gain = med([x["request_tps"] / u["request_tps"] - 1 for x, u in zip(sat, up)])[0]
            d = "" if n == "upstream" else f" ({gain:+.1%})"
            past = med([x["priced"].get("decode past measured B", 0.0) for x in sat])[0]
            sat_rows.append([tables.model(n).label, f"{r:.1f} [{lo:.1f}, {hi:.1f}]{d}",
                             f"{t:.0f} [{tlo:.0f}, {thi:.0f}]", f"{med([x['mean_batch'] for x in sat])[0]:.0f}",
                             f"{past:.0%}"])
        out[key] = res
        parts.append(f"### {wl['label']} (prompts `{wl['prompt']}`, outputs `{wl['output']}`, EOS, at most "
                     f"{wl['max_new']} new tokens)\n\nUpstream's knee Q* = **{q_star:g} req/s** (per seed: "
                     f"{', '.join(f'{k:g}' for k in knees)}).\n\n"
                     + R.table(["offered load", "system"] + [f"{h} s, median [range] (vs upstream)" for _, h in SHOWN],
                               rows)
                     + "\n\nWhere the simulated busy time was priced (share of it; decode past the measured batch "
                       "sizes is the bytes/FLOPs model, prefill is modelled from FLOPs throughout):\n\n"
                     + R.table(["offered load", "system", "decode within measured B", "decode past measured B",
                                "prefill (FLOPs model)"], priced)
                     + "\n\nSaturation (all requests at once), projected:\n\n"
                     + R.table(["system", "req/s [range] (vs upstream)", "output tok/s", "mean decode batch",
                                "busy time in decode steps past the measured B"], sat_rows))
    m = tables.meta
    text = ("**Projection, not a measurement.** SGLang 0.5.23's scheduler simulated (vskipper/sim) with its default "
            f"server flags for one H200 (`{' '.join(tables.server)}`), each step priced from the H200 step tables "
            f"(docs/results/sim-steps-h200.md: {m['source']}): decode from the measured CUDA-graph steps of "
            "docs/results/gpu-decode.md where the grid has the batch, interpolated between its batch sizes, and the "
            "bytes/FLOPs model scaled to the nearest measured cell past it; prefill modelled from FLOPs (never "
            "measured on a GPU); the host's work taken as hidden by the overlap scheduler. "
            f"{args.requests} requests a run, {args.seeds} seeds (arrivals and lengths); each cell the median over "
            "the seeds [their range], and in brackets the change against upstream on the same seeds (median). "
            "Systems: " + "; ".join(f"{n}: {tables.model(n).label}" for n in args.systems) + ". Lengths and where "
            "they come from: benchmarks/sim/project.py, WORKLOADS.\n\n" + "\n\n".join(parts))
    return out, text


def main(argv=None) -> None:
    args = parse(argv)
    out, text = project(args)
    print(text)
    R.write_results("sim-projection-h200", {"args": {k: str(v) for k, v in vars(args).items()},
                                            "workloads": WORKLOADS, "results": out}, text, args.out, R.docs_dir(args))


if __name__ == "__main__":
    main()
