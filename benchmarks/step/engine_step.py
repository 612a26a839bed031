"""One step inside SGLang, side by side in one process: upstream SGLang's own layers against
vskipper's routed layers on the same model, the same batch and the same KV pool; the decode step,
the prefill (extend) step, or both.

One SGLang ModelRunner is loaded the way `sglang.benchmark.one_batch` loads it (SGLang's
scheduler is bypassed; the vskipper_cpu platform on a machine without a GPU). Each system is a
set of decoder layers: upstream's own, or the ones `vskipper.transform` made for a skipper (only
routed layers differ). A round puts each system's layers in place, in a fresh random order, and
times one step of the batch, `--repeats` times interleaved (each time in a fresh order), keeping each
system's fastest; ratios are paired within rounds (median, bootstrap 95% CI). Decode: the batch's
sequences grow by one token per step, alike for every system of a round. Prefill: one extend of the
batch's prompts per system, the pool cleared before each.

Prompts: random token ids (`--prompts random`, the default: what `sglang.benchmark.one_batch` times),
or the held-out everyday prompts in the chat template (`--prompts everyday`), whose greedy answers
the decode steps then continue. A trained skipper skips by what it reads: on random ids it skips
far less than on text, so measure a trained skipper on text. Each table gives the share of
routed-layer work every skipping system skipped in the steps timed.

    python -m benchmarks.step.engine_step                   # decode: SmolLM2-135M, batch 1 8 32, 128-token prompts
    python -m benchmarks.step.engine_step --batch 32 --rounds 40 --threads 1
    python -m benchmarks.step.engine_step --batch 8 32 --rounds 10 30      # rounds per batch size
    python -m benchmarks.step.engine_step --phase prefill   # one 1024-token prompt
    python -m benchmarks.step.engine_step --phase both
    python -m benchmarks.step.engine_step --systems upstream rate0-auto trained-auto --prompts everyday
    python -m benchmarks.step.engine_step --batch 32 --systems upstream sub-rate0-routed sub-attn0.5-routed \
        sub-mlp0.5-routed                                  # a sublayer skipper: attention or MLP skipped

Each skipping system is also compared with the rate-0 system of the same execution (a sublayer
skipper's, `sub-...`, with its own at rates 0), paired in the same rounds: what skipping saves, apart
from what vskipper's path costs. The decode phase also
prints what the per-layer routing work (router, decisions, counter, the routed bodies' rows and
route maps, the row gathers and scatters) costs, timed alone at T = 1, 32, 256 and the batch sizes,
so the overhead is a number per routed layer.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from benchmarks import results as R
from benchmarks.results import log

RATE0, HALF = "random:rate=0,layers=15-29,seed=0", "random:rate=0.5,layers=15-29,seed=0"
SUB = "random:attn_rate={},mlp_rate={},layers=15-29,seed=0"  # a sublayer skipper: attention and MLP apart
TRAINED = "flexidepth:name=smollm2-135m-flexidepth"  # the skipper shipped for the bundled model
SYSTEMS = {  # name -> (skipper spec or None for upstream, execution, extend attention for the RUN rows only)
    "upstream": (None, None, True),
    "rate0-dense": (RATE0, "dense", True),
    "rate0-routed": (RATE0, "routed", True),
    "rate0-auto": (RATE0, "auto", True),
    "rate0-routed-mlp": (RATE0, "routed-mlp", True),
    "skip0.5-routed": (HALF, "routed", True),
    "skip0.5-routed-mlp": (HALF, "routed-mlp", True),
    "skip0.5-auto": (HALF, "auto", True),
    "skip0.5-mlp-only": (HALF, "routed", False),  # extend attention for every row (as before routed prefill)
    "trained-routed": (TRAINED, "routed", True),
    "trained-auto": (TRAINED, "auto", True),
    "sub-rate0-routed": (SUB.format(0, 0), "routed", True),
    "sub-attn0.5-routed": (SUB.format(0.5, 0), "routed", True),  # attention skipped for half the rows
    "sub-mlp0.5-routed": (SUB.format(0, 0.5), "routed", True),  # the MLP skipped for half the rows
    "sub-both0.5-routed": (SUB.format(0.5, 0.5), "routed", True),
    # the fixed-shape body: vskipper's masked attention at rates 0 too, so against its own rate 0 only the
    # skipping differs (the dynamic body at rates 0 attends through SGLang's own attention)
    "sub-rate0-fixed": (SUB.format(0, 0), "routed", True),
    "sub-attn0.5-fixed": (SUB.format(0.5, 0), "routed", True),
    "sub-mlp0.5-fixed": (SUB.format(0, 0.5), "routed", True),
}
FIXED_SHAPES = {n for n in SYSTEMS if n.endswith("-fixed")}  # run with static_shapes=True
PHASES = {  # phase -> default systems, batch sizes, prompt tokens, paired rounds
    "decode": (["upstream", "rate0-dense", "rate0-routed", "rate0-auto", "rate0-routed-mlp", "skip0.5-routed",
                "skip0.5-routed-mlp", "skip0.5-auto"], [1, 8, 32], 128, 30),
    "prefill": (["upstream", "rate0-routed", "skip0.5-mlp-only", "skip0.5-routed"], [1], 1024, 5),
}
ROUTING_TS = (1, 32, 256)  # row counts the routing work is timed at, besides the batch sizes


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.step.engine_step", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phase", choices=["decode", "prefill", "both"], default="decode")
    ap.add_argument("--model", help="model directory (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--batch", type=int, nargs="+", help="batch sizes (default: decode 1 8 32, prefill 1)")
    ap.add_argument("--input-len", type=int, help="prompt tokens (default: decode 128, prefill 1024)")
    ap.add_argument("--rounds", type=int, nargs="+",
                    help="paired rounds: one number, or one per --batch (default: decode 30, prefill 5)")
    ap.add_argument("--prefill-len", type=int, help="with --phase both: the prefill's prompt tokens (default 1024)")
    ap.add_argument("--prefill-rounds", type=int, help="with --phase both: the prefill's rounds (default 5)")
    ap.add_argument("--prefill-repeats", type=int,
                    help="with --phase both: the prefill's --repeats (default: the same as decode's)")
    ap.add_argument("--routing", action=argparse.BooleanOptionalAction, default=True,
                    help="decode: time the routing work per routed layer too (default on)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="interleaved steps per system and round, the fastest kept (default 3)")
    ap.add_argument("--prompts", choices=["random", "everyday"], default="random",
                    help="random token ids (default) or the held-out everyday prompts (chat template)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--systems", nargs="+", choices=list(SYSTEMS), help="default: the phase's own (SYSTEMS)")
    ap.add_argument("--name", help="the results' name: docs/results/NAME.md (default engine-step-PHASE)")
    R.add_arguments(ap, None)
    a = ap.parse_args(argv)
    if (min(a.batch or [1]) < 1 or min(a.rounds or [2]) < 2 or (a.input_len or 1) < 1 or a.threads < 1
            or a.repeats < 1 or (a.prefill_repeats or 1) < 1):
        ap.error("--batch, --input-len, --repeats, --prefill-repeats and --threads must be >= 1, --rounds >= 2")
    if a.rounds and len(a.rounds) not in (1, len(a.batch or PHASES["decode"][1])):
        ap.error(f"--rounds: give one number or one per batch size ({len(a.batch or PHASES['decode'][1])}), "
                 f"got {len(a.rounds)}")
    if a.systems and "upstream" not in a.systems:
        ap.error("--systems must include upstream (the baseline)")
    a.phases = ["decode", "prefill"] if a.phase == "both" else [a.phase]
    a.out = a.out or Path("out") / f"engine-step-{a.phase}"
    return a


def settings(args, phase: str) -> tuple[list[str], list[int], int, dict[int, int]]:
    """(systems, batch sizes, prompt tokens, {batch size: rounds}) of a phase: the flags given, else
    its defaults. With --phase both, --batch, --input-len and --rounds are decode's, --prefill-len
    and --prefill-rounds prefill's (one prompt)."""
    systems, batch, input_len, rounds = PHASES[phase]
    if phase == "prefill" and len(args.phases) == 2:
        return args.systems or systems, batch, args.prefill_len or input_len, {B: args.prefill_rounds or rounds
                                                                              for B in batch}
    batch = args.batch or batch
    given = args.rounds or [rounds]
    return args.systems or systems, batch, args.input_len or input_len, dict(zip(batch, given * len(batch)
                                                                             if len(given) == 1 else given))


def layer_sets(model, systems):
    """{system: (decoder layers, vskipper state or None)}: each system's layers over one model."""
    import vskipper
    from benchmarks.step.runner import use
    from vskipper.engines.sglang_layer import SGLangRoutedLayer

    inner = model.model
    upstream = list(inner.layers)
    out = {}
    for name in systems:
        spec, execution, routed_extend = SYSTEMS[name]
        use(model, upstream, None)
        if spec is None:
            out[name] = (upstream, None)
            continue
        vskipper.transform(model, vskipper.parse_skipper(spec),
                           vskipper.Config(execution=execution, static_shapes=True if name in FIXED_SHAPES else None))
        layers = list(inner.layers)
        if not routed_extend:  # this system's attention parts attend for all rows in extend batches
            for layer in layers:
                if isinstance(layer, SGLangRoutedLayer):
                    attention = layer.graph.get_submodule(f"routed.{layer.layer_id}").attention
                    attention._routes_extend = lambda fb: False
        out[name] = (layers, model.vskipper)
    return out


def ratio_tables(times: dict[int, dict[str, list[float]]], systems: list[str]) -> str:
    """Per batch size: upstream's median step and every system's paired ratio to it; then each
    skipping system against the rate-0 system of the same execution, paired in the same rounds."""
    from benchmarks.stats import paired_delta

    rows, saved = [], []
    for B, t in times.items():
        up = t["upstream"]
        rows.append([B, f"{statistics.median(up) * 1e3:.1f}"]
                    + [paired_delta(t[n], up).ratio_text() for n in systems[1:]])
        for n in systems:
            zero = rate0_of(n)
            if zero in t:
                saved.append([B, f"{n} / {zero}", paired_delta(t[n], t[zero]).ratio_text()])
    text = R.table(["batch", "upstream ms"] + [f"{n} / upstream (95% CI)" for n in systems[1:]], rows)
    if saved:
        text += ("\n\nWhat skipping saves (each skipper against rate 0, same execution, paired in the same "
                 "rounds):\n\n" + R.table(["batch", "skipping / nothing skipped", "ratio (95% CI)"], saved))
    return text


def rate0_of(n: str) -> str | None:
    """The rate-0 system a skipping system is compared with: the same execution, the same kind of skipper."""
    if n.startswith(("skip", "trained")):
        return "rate0-" + n.split("-", 1)[1]
    if n.startswith("sub-") and not n.startswith("sub-rate0"):
        return "sub-rate0-" + n.split("-", 2)[2]
    return None


def run_phase(args, runner, sets, phase: str, prompts) -> tuple[str, dict, dict]:
    """One phase over its batch sizes: its tables, its step times {batch: {system: seconds per round}}
    and the share of routed-layer work each skipping system skipped {batch: {system: fraction}}."""
    from benchmarks.stats import timed_rounds
    from benchmarks.step.runner import use

    systems, batches, input_len, rounds = settings(args, phase)
    repeats = args.prefill_repeats or args.repeats if phase == "prefill" else args.repeats
    model = runner.torch_runner.model
    times, skipped, sublayers = {}, {}, {}
    for B in batches:
        step = (decode_step if phase == "decode" else prefill_step)(runner, sets, B, input_len,
                                                                    prompts(phase, B, input_len))
        skip_fractions(sets, systems)  # counts from the prefill and earlier batches left out
        times[B] = timed_rounds(systems, rounds[B], B, step, repeats=repeats)
        skipped[B], sublayers[B] = skip_fractions(sets, systems)
        log(f"{phase}, batch {B} done")
    use(model, *sets["upstream"])
    what = (f"prompts of {input_len} tokens" if args.prompts == "random" else
            f"the held-out everyday prompts{'' if phase == 'decode' else f' run together into {input_len} tokens'}"
            f" (chat template)")
    head = (f"SGLang {'decode' if phase == 'decode' else 'extend'} step, {type(model).__name__} "
            f"({len(model.model.layers)} layers), {what}, {'/'.join(str(rounds[B]) for B in batches)} paired rounds "
            f"{'' if len(set(rounds.values())) == 1 else '(by batch size) '}in random order (the fastest of "
            f"{repeats} interleaved steps per system and round), {args.threads} thread(s); systems: "
            f"{describe(systems)}")
    text = f"{head}\n\n{ratio_tables(times, systems)}"
    if any(skipped[B] for B in batches):
        text += "\n\nShare of routed-layer work skipped in the steps timed: " + "; ".join(
            f"batch {B}: " + ", ".join(f"{n} {f:.1%}" + (" (attention {:.1%}, MLP {:.1%})".format(*sublayers[B][n])
                                                       if n in sublayers[B] else "")
                                       for n, f in skipped[B].items()) for B in batches)
        if any(sublayers[B] for B in batches):
            text += " (a sublayer skipper's share is of its routed sublayers, attention and MLP counted alike)"
    if phase == "decode" and args.routing:
        text += "\n\n" + routing_table(model, sets, batches)
    return text, times, skipped


def skip_fractions(sets, systems) -> tuple[dict[str, float], dict[str, tuple[float, float]]]:
    """{system: share of its routed-layer work that skipped (rows of routed layers; a sublayer
    skipper's routed sublayers)} since the last call (its route counters zeroed; rate-0 systems left
    out), and for a sublayer skipper {system: (share of rows that skipped the attention, the MLP)}."""
    out, parts = {}, {}
    for n in systems:
        state = sets[n][1]
        if state is None:
            continue
        counts = [c.read() for c in state.counters.values()]
        for c in state.counters.values():
            c.counts.zero_()
        if "rate0" not in n:
            out[n] = sum(c["project"] for c in counts) / max(sum(c["run"] + c["project"] for c in counts), 1)
            if "mlp_skip" in counts[0]:
                tokens = max(sum(c["tokens"] for c in counts), 1)
                parts[n] = tuple(sum(c[k] for c in counts) / tokens for k in ("attention_skip", "mlp_skip"))
    return out, parts


def text_prompts(tok_dir: str, phase: str, B: int, input_len: int) -> list[list[int]]:
    """The held-out everyday prompts in the chat template: decode, B of them as they are (cycled past
    the set's size); prefill, B prompts of input_len tokens, each the set run together from its own
    starting prompt into one user turn and cut at input_len tokens."""
    from transformers import AutoTokenizer

    from vskipper.eval.agreement import heldout_prompts
    from vskipper.training.data import chat_ids

    tok = AutoTokenizer.from_pretrained(tok_dir)
    texts = [r["prompt"] for r in heldout_prompts(["everyday"])]
    if phase == "decode":
        return [chat_ids(tok, texts[b % len(texts)]) for b in range(B)]
    out = []
    for b in range(B):
        ids = chat_ids(tok, "\n".join(texts[b % len(texts):] + texts[:b % len(texts)]))
        if len(ids) < input_len:
            raise ValueError(f"prefill prompts of {input_len} tokens: the everyday prompts run together make only "
                             f"{len(ids)}; give a prompt length of at most that")
        out.append(ids[:input_len])
    return out


def decode_step(runner, sets, B: int, input_len: int, prompt_ids: list[list[int]] | None = None):
    """B prompts (prompt_ids, else random ones of input_len tokens) prefilled by upstream; then
    step(system) times one decode step of the batch with that system's layers, the sequences growing
    by a token each step."""
    from sglang.benchmark import one_batch

    from benchmarks.step.runner import use

    model = runner.torch_runner.model
    runner.clear()
    use(model, *sets["upstream"])
    ids, _, batch = runner.extend(one_batch.prepare_synthetic_inputs_for_latency_test(B, input_len, prompt_ids))
    state = {"ids": ids}

    def step(n: str) -> float:
        use(model, *sets[n])
        t0 = time.perf_counter()
        state["ids"], _ = runner.decode(state["ids"], batch)
        return time.perf_counter() - t0

    return step


def prefill_step(runner, sets, B: int, input_len: int, prompt_ids: list[list[int]] | None = None):
    """step(system) times one extend of the same B prompts (prompt_ids, else random ones of input_len
    tokens) with that system's layers, the pool cleared first."""
    import numpy as np
    from sglang.benchmark import one_batch

    from benchmarks.step.runner import use

    model = runner.torch_runner.model
    ids = prompt_ids or np.random.default_rng(0).integers(1, 10000, (B, input_len), dtype=np.int32).tolist()

    def step(n: str) -> float:
        use(model, *sets[n])
        runner.clear()
        reqs = one_batch.prepare_synthetic_inputs_for_latency_test(B, input_len, custom_inputs=ids)
        t0 = time.perf_counter()
        runner.extend(reqs)
        return time.perf_counter() - t0

    return step


def describe(systems: list[str]) -> str:
    """What each system is, for a table's header."""
    parts = []
    for n in systems:
        spec, execution, routed_extend = SYSTEMS[n]
        parts.append(f"{n} = SGLang alone" if spec is None else
                     f"{n} = {spec} ({execution}{', fixed shapes' if n in FIXED_SHAPES else ''}"
                     f"{'' if routed_extend else ', extend attention for every row'})")
    return ", ".join(parts)


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


def routing_table(model, sets, batches: list[int]) -> str:
    state = next((v[1] for v in sets.values() if v[1] is not None and not v[1].skipper.sublayers), None)
    if state is None:
        return "(no whole-layer vskipper system: no routing work timed)"
    n_routed = len(state.skipper.layers)
    rows, names = [], None
    for T in sorted(set(ROUTING_TS) | set(batches)):
        c = routing_cost_us(state, model.config.hidden_size, T)
        names = list(c)
        total = sum(v for k, v in c.items() if k != "route_maps (fixed)")
        rows.append([T] + [f"{v:.1f}" for v in c.values()] + [f"{total:.1f}", f"{total * n_routed / 1e3:.2f}"])
    return (f"Routing work per routed layer ({n_routed} routed layers), timed alone, us (rate 0 pays router, "
            "decide, counter and the dynamic body's count; a skipping step of the dynamic body adds its row "
            "indices and gathers; the fixed-shape body takes route maps instead of rows):\n\n"
            + R.table(["T"] + names + ["dynamic total", "x routed layers, ms"], rows))


def main(argv=None) -> None:
    args = parse(argv)
    os.environ.pop("VSKIPPER_SKIPPER", None)  # the model loads as upstream's; systems are made here
    from benchmarks.step.runner import with_model_runner
    from vskipper.models.smollm2 import smollm2_dir

    model_dir = args.model or str(smollm2_dir())
    prompts = {}  # (phase, B, input_len) -> token ids of the batch's prompts, None: random ones

    def prompts_of(phase: str, B: int, input_len: int):
        key = (phase, B, input_len)
        if key not in prompts:
            prompts[key] = None if args.prompts == "random" else text_prompts(model_dir, phase, B, input_len)
        return prompts[key]

    pool = 4096  # KV pool tokens: decode grows every sequence by a token per system, repeat and round
    for phase in args.phases:
        systems, batches, input_len, rounds = settings(args, phase)
        steps = (max(rounds.values()) + 1) * args.repeats * len(systems)  # a decode step per system, repeat, round
        grow = max(batches) * (steps + 16) if phase == "decode" else 64
        longest = max(max(map(len, prompts_of(phase, B, input_len) or [[0] * input_len])) for B in batches)
        pool = max(pool, max(batches) * longest + grow)
    sections, times, skipped = [], {}, {}

    def work(runner) -> None:
        import torch

        torch.set_num_threads(args.threads)
        systems = sorted({n for p in args.phases for n in settings(args, p)[0]}, key=list(SYSTEMS).index)
        sets = layer_sets(runner.torch_runner.model, systems)
        for phase in args.phases:
            text, times[phase], skipped[phase] = run_phase(args, runner, sets, phase, prompts_of)
            sections.append(text)

    with_model_runner(model_dir, work, max_total_tokens=pool)
    text = "\n\n".join(sections) + "\n"
    print(text)
    R.write_results(args.name or f"engine-step-{args.phase}", {"args": vars(args), "step_s": times,
                                                                "skipped": skipped}, text, args.out, R.docs_dir(args))


if __name__ == "__main__":
    main()
