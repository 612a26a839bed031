"""The CPU step tables of the simulator: SGLang's own decode and extend steps over a grid of batch sizes,
contexts and prompt lengths, upstream beside vskipper's systems, in one process (one ModelRunner, as
benchmarks/step/engine_step.py times them; its systems and step functions).

    python -m benchmarks.sim.step_sweep                  # SmolLM2-135M, upstream, RandomSkip 0.5, the shipped skipper
    python -m benchmarks.sim.step_sweep --smoke          # a tiny grid, no page

Decode: per (B, C), B random prompts of C tokens prefilled once, then `--rounds` paired rounds (systems in a
fresh random order, `--repeats` interleaved steps each, the fastest kept; the sequences grow a token a step);
a cell is the median over the rounds, at the mean context of its steps. Extend: one extend of the prompts
per system and repeat (the pool cleared before each), single prompts of several lengths and batches of
several prompts, the same way. Steps are timed in the process's CPU time (torch on one thread): the step's
own work, which a neighbour on the shared machine stretches in wall time but not here; what a server adds
is fitted from served steps (benchmarks/sim/validate.py fit). RUN fraction: the share
of routed-layer rows that ran in each phase's timed steps (random ids, as the serving runs send).

Writes results.json and docs/results/sim-steps-cpu.md, and the step table file the simulator reads
(`--tables`, default vskipper/sim/tables/cpu-smollm2-135m.json; the host work per step is added to it by
benchmarks/sim/validate.py --fit, from served steps).
"""
from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

from benchmarks import results as R
from benchmarks.results import log

SYSTEMS = {"upstream": "upstream", "random0.5": "skip0.5-routed", "trained": "trained-routed"}  # ours -> engine_step's
LABELS = {"upstream": "upstream SGLang", "random0.5": "RandomSkip 0.5 (layers 15-29, routed)",
          "trained": "shipped FlexiDepth skipper (routed)"}
TABLES = Path(__file__).resolve().parents[2] / "vskipper" / "sim" / "tables" / "cpu-smollm2-135m.json"


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.sim.step_sweep", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 16, 24, 32],
                    help="decode batch sizes; the default holds the fit's concurrencies (benchmarks/sim/validate.py: "
                         "1, 4, 12, 24), whose residuals would otherwise carry the interpolation's error into the host")
    ap.add_argument("--context", type=int, nargs="+", default=[32, 256])
    ap.add_argument("--extend", nargs="+", default=["1x16", "1x64", "1x128", "1x256", "1x512", "4x64", "8x32"],
                    help="extend cells, ROWSxTOKENS (ROWS prompts of TOKENS each)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--extend-rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2, help="interleaved steps per system and round, the fastest kept")
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tables", type=Path, default=TABLES, help="the step table file to write ('none': none)")
    ap.add_argument("--smoke", action="store_true", help="a tiny grid (batch 1 2, context 16, extend 1x8 2x8)")
    R.add_arguments(ap, "sim-steps-cpu")
    a = ap.parse_args(argv)
    if a.smoke:
        a.batch, a.context, a.extend, a.rounds, a.extend_rounds = [1, 2], [16], ["1x8", "2x8"], 2, 1
        a.tables = Path("none") if a.tables == TABLES else a.tables
    try:
        a.extend_cells = [tuple(int(x) for x in e.split("x")) for e in a.extend]
    except ValueError:
        ap.error(f"--extend: {a.extend}: expected ROWSxTOKENS, e.g. 4x64")
    if "upstream" not in a.systems or min(a.batch) < 1 or min(a.context) < 1 or a.rounds < 1:
        ap.error("--systems must include upstream; --batch, --context, --rounds must be >= 1")
    return a


def decode_step(runner, sets, B: int, C: int):
    """engine_step.decode_step's step, timed in CPU time: B random prompts of C tokens prefilled by upstream,
    then step(system) times one decode step of the batch with that system's layers."""
    import time

    from sglang.benchmark import one_batch

    from benchmarks.step.runner import use

    model = runner.torch_runner.model
    runner.clear()
    use(model, *sets["upstream"])
    ids, _, batch = runner.extend(one_batch.prepare_synthetic_inputs_for_latency_test(B, C))
    state = {"ids": ids}

    def step(n: str) -> float:
        use(model, *sets[n])
        t0 = time.process_time()
        state["ids"], _ = runner.decode(state["ids"], batch)
        return time.process_time() - t0

    return step


def prefill_step(runner, sets, rows: int, tokens: int):
    """engine_step.prefill_step's step, timed in CPU time: one extend of the same prompts, the pool cleared."""
    import time

    import numpy as np
    from sglang.benchmark import one_batch

    from benchmarks.step.runner import use

    model = runner.torch_runner.model
    ids = np.random.default_rng(0).integers(1, 10000, (rows, tokens), dtype=np.int32).tolist()

    def step(n: str) -> float:
        use(model, *sets[n])
        runner.clear()
        reqs = one_batch.prepare_synthetic_inputs_for_latency_test(rows, tokens, custom_inputs=ids)
        t0 = time.process_time()
        runner.extend(reqs)
        return time.process_time() - t0

    return step


def sweep(args, runner) -> dict:
    import torch

    from benchmarks.stats import timed_rounds
    from benchmarks.step.engine_step import layer_sets, skip_fractions
    from benchmarks.step.runner import use

    torch.set_num_threads(args.threads)
    names = [SYSTEMS[s] for s in args.systems]
    sets = layer_sets(runner.torch_runner.model, names)
    back = {v: k for k, v in SYSTEMS.items()}
    out = {"decode": [], "extend": [], "run_fraction": {}}
    skip_fractions(sets, names)
    for C in args.context:
        for B in args.batch:
            step = decode_step(runner, sets, B, C)
            n = len(names) * (args.rounds + 1) * args.repeats
            t = timed_rounds(names, args.rounds, B * 1000 + C, step, repeats=args.repeats)
            for name, xs in t.items():
                out["decode"].append({"system": back[name], "B": B, "C": C + n / 2, "ms": statistics.median(xs) * 1e3,
                                      "samples_ms": [x * 1e3 for x in xs]})
            log(f"decode B={B} C={C}: " + ", ".join(f"{back[k]} {statistics.median(v) * 1e3:.1f} ms"
                                                    for k, v in t.items()))
    dec_skip, _ = skip_fractions(sets, names)
    for rows, tokens in args.extend_cells:
        step = prefill_step(runner, sets, rows, tokens)
        t = timed_rounds(names, args.extend_rounds, rows * 1000 + tokens, step, repeats=args.repeats)
        for name, xs in t.items():
            n = rows * tokens
            out["extend"].append({"system": back[name], "rows": rows, "tokens": n,
                                  "pairs": rows * tokens * (tokens + 1) / 2, "ms": statistics.median(xs) * 1e3,
                                  "samples_ms": [x * 1e3 for x in xs]})
        log(f"extend {rows}x{tokens}: " + ", ".join(f"{back[k]} {statistics.median(v) * 1e3:.0f} ms"
                                                    for k, v in t.items()))
    ext_skip, _ = skip_fractions(sets, names)
    use(runner.torch_runner.model, *sets["upstream"])
    for s in args.systems:
        n = SYSTEMS[s]
        out["run_fraction"][s] = {"decode": 1 - dec_skip.get(n, 0.0), "extend": 1 - ext_skip.get(n, 0.0)}
    return out


def step_tables(args, res: dict, page: str) -> dict:
    from vskipper.sim.steps import FORMAT

    systems = {}
    for s in args.systems:
        dec = [[c["B"], round(c["C"], 1), round(c["ms"], 3), "measured", f"{page}, decode table"]
               for c in res["decode"] if c["system"] == s]
        ext = [[c["tokens"], c["rows"], c["pairs"], round(c["ms"], 3), "measured", f"{page}, extend table"]
               for c in res["extend"] if c["system"] == s]
        systems[s] = {"label": LABELS[s], "run_fraction": res["run_fraction"][s], "decode": dec,
                      "extend": {"cells": ext}}
    return {"format": FORMAT, "device": R.machine(), "engine": "SGLang 0.5.23 (torch_native attention, fp32, CPU)",
            "model": "SmolLM2-135M-Instruct", "source": f"{page} (python -m benchmarks.sim.step_sweep)",
            "host": {"decode_ms": [0.0, 0.0], "extend_ms": [0.0, 0.0], "ingress_ms": 0.0, "egress_ms": 0.0,
                     "serial": True, "source": "not fitted yet: python -m benchmarks.sim.validate --fit"},
            "server": [], "systems": systems}


def page_text(args, res: dict) -> str:
    from vskipper.sim.steps import fit_extend

    head = (f"SGLang's own steps in one process (one ModelRunner, SmolLM2-135M-Instruct, fp32, {args.threads} "
            f"thread(s), random token ids), CPU time, the median over {args.rounds} paired rounds (decode) and "
            f"{args.extend_rounds} (extend) of the fastest of {args.repeats} interleaved steps; systems: "
            + ", ".join(f"{s} = {LABELS[s]}" for s in args.systems))
    dec = {}
    for c in res["decode"]:
        dec.setdefault((c["B"], c["C"]), {})[c["system"]] = c["ms"]
    rows = [[B, f"{C:.0f}"] + [f"{v.get(s, float('nan')):.1f}" for s in args.systems]
            + [f"{v[s] / v['upstream']:.3f}" for s in args.systems[1:]] for (B, C), v in sorted(dec.items())]
    text = head + "\n\nDecode table (ms per step; B rows attending C tokens each):\n\n" + R.table(
        ["B", "C"] + [f"{s} ms" for s in args.systems] + [f"{s} / upstream" for s in args.systems[1:]], rows)
    ext = {}
    for c in res["extend"]:
        ext.setdefault((c["rows"], c["tokens"]), {})[c["system"]] = c["ms"]
    rows = [[r, n] + [f"{v.get(s, float('nan')):.0f}" for s in args.systems]
            + [f"{v[s] / v['upstream']:.3f}" for s in args.systems[1:]] for (r, n), v in sorted(ext.items())]
    text += "\n\nExtend table (ms per step; rows prompts of tokens / rows tokens each):\n\n" + R.table(
        ["rows", "tokens"] + [f"{s} ms" for s in args.systems] + [f"{s} / upstream" for s in args.systems[1:]], rows)
    fits = []
    for s in args.systems:
        cells = [(c["tokens"], c["rows"], c["pairs"], c["ms"]) for c in res["extend"] if c["system"] == s]
        if len(cells) >= 2:
            f = fit_extend(cells)
            fits.append([s, f"{f['e0']:.1f}", f"{f['per_token']:.3f}", f"{f['per_pair'] * 1e3:.3f}",
                         f"{f['per_row']:.1f}"])
    text += ("\n\nExtend model fitted to that table (non-negative least squares; t = e0 + per_token N + per_pair A + "
             "per_row R):\n\n"
             + R.table(["system", "e0 ms", "ms per token", "us per attention pair", "ms per row"], fits))
    text += "\n\nRUN fraction of routed-layer rows in the timed steps: " + "; ".join(
        f"{s}: decode {v['decode']:.3f}, extend {v['extend']:.3f}" for s, v in res["run_fraction"].items())
    return text


def main(argv=None) -> None:
    args = parse(argv)
    os.environ.pop("VSKIPPER_SKIPPER", None)
    from benchmarks.step.runner import with_model_runner
    from vskipper.models.smollm2 import smollm2_dir

    steps = (args.rounds + 1) * len(args.systems) + 16
    pool = max(max(args.batch) * (max(args.context) + steps), max(r * n for r, n in args.extend_cells)) + 256
    res = {}
    with_model_runner(str(smollm2_dir()), lambda runner: res.update(sweep(args, runner)), max_total_tokens=pool)
    text = page_text(args, res)
    print(text)
    docs = R.docs_dir(args)
    R.write_results("sim-steps-cpu", {"args": {k: str(v) for k, v in vars(args).items()}, **res}, text, args.out, docs)
    if str(args.tables) != "none":
        import json

        args.tables.parent.mkdir(parents=True, exist_ok=True)
        t = step_tables(args, res, "docs/results/sim-steps-cpu.md")
        if args.tables.is_file():  # keep the host work already fitted to served steps
            old = json.loads(args.tables.read_text())
            t["host"], t["server"] = old.get("host", t["host"]), old.get("server", [])
        args.tables.write_text(json.dumps(t, indent=1) + "\n")
        log(f"step tables: {args.tables}")


if __name__ == "__main__":
    main()
