"""The decode step inside SGLang, side by side in one process: upstream SGLang's own layers against
vskipper's routed layers on the same model, the same batch and the same KV pool.

One SGLang ModelRunner is loaded the way `sglang.benchmark.one_batch` loads it (SGLang's
scheduler is bypassed; the vskipper_cpu platform on a machine without a GPU). Each system is a
set of decoder layers: upstream's own, or the ones `vskipper.transform` made for a skipper (only
routed layers differ). A round puts each system's layers in place, in a fresh random order, and
times one decode step of the batch; ratios are paired within rounds (median, bootstrap 95% CI).
The batch's sequences grow by one token per step, alike for every system of a round.

    python bench/sglang_step.py                        # SmolLM2-135M, batch 1 8 32, 128-token prompts
    python bench/sglang_step.py --batch 32 --rounds 40 --threads 1

Each skipping system is also compared with the rate-0 system of the same execution, paired in the
same rounds: what skipping saves, apart from what vskipper's path costs. Also prints what the
per-layer routing work (router, decisions, counter, the routed bodies' rows and route maps, the row gathers and
scatters) costs, timed alone at T = 1, 32, 256 and the batch sizes, so the overhead is a number per
routed layer.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

SYSTEMS = {  # name -> (skipper spec or None for upstream, execution)
    "upstream": (None, None),
    "rate0-dense": ("random:rate=0,layers=15-29,seed=0", "dense"),
    "rate0-routed": ("random:rate=0,layers=15-29,seed=0", "routed"),
    "rate0-auto": ("random:rate=0,layers=15-29,seed=0", "auto"),
    "rate0-routed-mlp": ("random:rate=0,layers=15-29,seed=0", "routed-mlp"),
    "skip0.5-routed": ("random:rate=0.5,layers=15-29,seed=0", "routed"),
    "skip0.5-routed-mlp": ("random:rate=0.5,layers=15-29,seed=0", "routed-mlp"),
    "skip0.5-auto": ("random:rate=0.5,layers=15-29,seed=0", "auto"),
}
ROUTING_TS = (1, 32, 256)  # row counts the routing work is timed at, besides the batch sizes


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=30, help="paired rounds per batch size")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    a = ap.parse_args(argv)
    if min(a.batch) < 1 or a.rounds < 2 or a.input_len < 1 or a.threads < 1:
        ap.error("--batch, --input-len and --threads must be >= 1, --rounds >= 2")
    if "upstream" not in a.systems:
        ap.error("--systems must include upstream (the baseline)")
    return a


def layer_sets(model, systems):
    """{system: (decoder layers, vskipper state or None)}: each system's layers over one model."""
    import vskipper
    from vskipper.bench.runner import use

    inner = model.model
    upstream = list(inner.layers)
    out = {}
    for name in systems:
        spec, execution = SYSTEMS[name]
        use(model, upstream, None)
        if spec is None:
            out[name] = (upstream, None)
            continue
        vskipper.transform(model, vskipper.parse_skipper(spec), vskipper.Config(execution=execution))
        out[name] = (list(inner.layers), model.vskipper)
    return out


def routing_cost_us(state, hidden: int, T: int, reps: int = 200) -> dict[str, float]:
    """us per routed layer of the routing work alone at T rows: router, decisions, counter, the
    dynamic routed body's row finding (the RUN count; with half the rows RUN also their indices),
    the fixed-shape body's route maps, and the dynamic body's gathers (RUN and PROJECT rows of h,
    half each) and scatters back into a copy of h."""
    import torch

    from vskipper import ops
    from vskipper.skippers.base import sanitize_gate

    sk = state.skipper
    layer = sk.layers[0]
    router, counter = sk.router(layer), state.counters[str(layer)]
    x = torch.randn(T, hidden)
    pos, ids, valid = torch.arange(T), torch.randint(1, 1000, (T,)), torch.ones(T, dtype=torch.bool)
    with torch.no_grad():
        g = router(x, pos, ids)
        gate, run, bad = sanitize_gate(g, sk.threshold)
        half = torch.arange(T) % 2 == 0
        rr, pr = half.nonzero().squeeze(1), (~half).nonzero().squeeze(1)

        def rows():  # RoutedBody: the count, then (some rows skip) the RUN rows
            ran = (half & valid).reshape(-1)
            if int(ran.sum()) < T:
                ran.nonzero().squeeze(1)

        def gathers():
            out = x.clone()
            out.index_copy_(0, rr, x.index_select(0, rr))
            out.index_copy_(0, pr, x.index_select(0, pr))

        parts = {"router": lambda: router(x, pos, ids), "decide": lambda: sanitize_gate(g, sk.threshold),
                 "counter": lambda: counter(run, valid, bad), "rows (dynamic)": rows,
                 "route_maps (fixed)": lambda: ops.route_maps(run, valid, impl="torch"), "gathers": gathers}
        out = {}
        for name, fn in parts.items():
            fn()
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            out[name] = (time.perf_counter() - t0) / reps * 1e6
    counter.counts.zero_()
    return out


def run(args, runner) -> None:
    import torch

    from sglang.benchmark import one_batch

    from vskipper.bench.paired import paired_delta
    from vskipper.bench.runner import use

    torch.set_num_threads(args.threads)
    model = runner.torch_runner.model
    sets = layer_sets(model, args.systems)
    rng = random.Random(0)
    print(f"SGLang decode step, {type(model).__name__} ({len(model.model.layers)} layers), prompts of "
          f"{args.input_len} tokens, {args.rounds} paired rounds in random order, {args.threads} thread(s); "
          f"systems: " + ", ".join(f"{n} = {SYSTEMS[n][0] or 'SGLang alone'}"
                                   + (f" ({SYSTEMS[n][1]})" if SYSTEMS[n][1] else "") for n in args.systems) + "\n")
    head = "| batch | upstream ms | " + " | ".join(f"{n} / upstream (95% CI)" for n in args.systems[1:]) + " |"
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    against_rate0 = ["| batch | skipping / nothing skipped | ratio (95% CI) |", "|---|---|---|"]
    for B in args.batch:
        runner.clear()
        reqs = one_batch.prepare_synthetic_inputs_for_latency_test(B, args.input_len)
        use(model, *sets["upstream"])
        next_ids, _, batch = runner.extend(reqs)
        times = {n: [] for n in args.systems}
        for r in range(args.rounds + 1):
            order = list(args.systems)
            rng.shuffle(order)
            for n in order:
                use(model, *sets[n])
                t0 = time.perf_counter()
                next_ids, _ = runner.decode(next_ids, batch)
                dt = time.perf_counter() - t0
                if r:  # round 0 warms every system up
                    times[n].append(dt)
        up = times["upstream"]
        cells = [paired_delta(times[n], up) for n in args.systems[1:]]
        rows.append(f"| {B} | {statistics.median(up) * 1e3:.1f} | "
                    + " | ".join(f"{1 + d.median:.3f} [{1 + d.lo:.3f}, {1 + d.hi:.3f}]" for d in cells) + " |")
        for n in args.systems:
            zero = n.replace("skip0.5-", "rate0-")
            if n.startswith("skip") and zero in times:
                d = paired_delta(times[n], times[zero])
                against_rate0.append(f"| {B} | {n} / {zero} | {1 + d.median:.3f} [{1 + d.lo:.3f}, {1 + d.hi:.3f}] |")
        print(f"  batch {B} done", file=sys.stderr, flush=True)
    use(model, *sets["upstream"])
    print("\n".join(rows))
    if len(against_rate0) > 2:
        print("\nWhat skipping saves (RandomSkip 0.5 against rate 0, same execution, paired in the same rounds):\n")
        print("\n".join(against_rate0))
    state = next(v[1] for v in sets.values() if v[1] is not None)
    n_routed = len(state.skipper.layers)
    print(f"\nRouting work per routed layer ({n_routed} routed layers), timed alone, us:\n")
    print("(rate 0 pays router, decide, counter and the dynamic body's count; a skipping step of the dynamic\n"
          "body adds its row indices and gathers; the fixed-shape body takes route maps instead of rows)\n")
    for T in sorted(set(ROUTING_TS) | set(args.batch)):
        c = routing_cost_us(state, model.config.hidden_size, T)
        if T == min(set(ROUTING_TS) | set(args.batch)):
            print("| T | " + " | ".join(c) + " | dynamic total | x routed layers, ms |\n|" + "---|" * (len(c) + 3))
        total = sum(v for k, v in c.items() if k != "route_maps (fixed)")
        print(f"| {T} | " + " | ".join(f"{v:.1f}" for v in c.values()) + f" | {total:.1f} | {total * n_routed / 1e3:.2f} |")


def main(argv=None) -> None:
    args = parse(argv)
    os.environ.pop("VSKIPPER_SKIPPER", None)  # the model loads as upstream's; systems are made here
    from vskipper.bench.runner import with_model_runner
    from vskipper.models.smollm2 import smollm2_dir

    with_model_runner(args.model or str(smollm2_dir()), lambda runner: run(args, runner),
                      max_total_tokens=max(4096, max(args.batch) * (args.input_len + (args.rounds + 1) * len(args.systems) + 16)))


if __name__ == "__main__":
    main()
