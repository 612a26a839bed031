"""The prefill (extend) step inside SGLang, side by side in one process: upstream SGLang's own layers
against vskipper's routed layers on the same model, the same prompts and the same KV pool.

As bench/sglang_step.py does for decode: one ModelRunner (SGLang's scheduler bypassed; the
vskipper_cpu platform without a GPU), each system a set of decoder layers, a round times one
extend of the batch's prompts per system in a fresh random order (the pool cleared before each),
ratios paired within rounds (median, bootstrap 95% CI). Systems:

    upstream             SGLang alone
    rate0-routed         RandomSkip(0) over layers 15-29, routed body (the engine-path overhead)
    skip0.5-mlp-only     RandomSkip(0.5), routed body, extend attention for all rows (before routed prefill)
    skip0.5-routed       RandomSkip(0.5), routed body: PROJECT rows skip attention, o_proj and the MLP

    python bench/prefill.py                        # SmolLM2-135M, one 1024-token prompt
    python bench/prefill.py --batch 4 --input-len 256 --rounds 6
    python bench/prefill.py --hf --input-len 256 --rate 0.25   # transformers: the forward of one prompt

With --hf: transformers' forward of the prompt(s) (generate's prefill), RandomSkip(--rate) over
layers 15-29, the dense body, the routed body with attention for all rows (before routed prefill)
and the routed body, paired against dense.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

SYSTEMS = {  # name -> (skipper spec or None for upstream, routed extend attention)
    "upstream": (None, None),
    "rate0-routed": ("random:rate=0,layers=15-29,seed=0", True),
    "skip0.5-mlp-only": ("random:rate=0.5,layers=15-29,seed=0", False),
    "skip0.5-routed": ("random:rate=0.5,layers=15-29,seed=0", True),
}


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5, help="paired rounds")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hf", action="store_true", help="transformers' forward instead of SGLang's extend")
    ap.add_argument("--rate", type=float, default=0.5, help="--hf: RandomSkip's rate (0.25: 75%% of rows RUN)")
    a = ap.parse_args(argv)
    if min(a.batch, a.input_len, a.threads) < 1 or a.rounds < 2:
        ap.error("--batch, --input-len and --threads must be >= 1, --rounds >= 2")
    return a


def layer_sets(model):
    """{system: (decoder layers, vskipper state or None)} over one model."""
    import vskipper
    from vskipper.bench.runner import use
    from vskipper.models.sglang import SGLangRoutedLayer

    inner = model.model
    upstream = list(inner.layers)
    out = {}
    for name, (spec, routed_extend) in SYSTEMS.items():
        use(model, upstream, None)
        if spec is None:
            out[name] = (upstream, None)
            continue
        vskipper.transform(model, vskipper.parse_skipper(spec), vskipper.Config(execution="routed"))
        layers = list(inner.layers)
        if not routed_extend:  # this system's attention parts attend for all rows in extend batches
            for layer in layers:
                if isinstance(layer, SGLangRoutedLayer):
                    layer._vskipper_layer.get_submodule(f"routed.{layer.layer_id}").attention._routes_extend = \
                        lambda fb: False
        out[name] = (layers, model.vskipper)
    return out


def run(args, runner) -> None:
    import numpy as np
    import torch

    from sglang.benchmark import one_batch

    from vskipper.bench.paired import paired_delta
    from vskipper.bench.runner import use

    torch.set_num_threads(args.threads)
    model = runner.torch_runner.model
    sets = layer_sets(model)
    rng = random.Random(0)
    ids = np.random.default_rng(0).integers(1, 10000, (args.batch, args.input_len), dtype=np.int32).tolist()
    print(f"SGLang extend step, {type(model).__name__} ({len(model.model.layers)} layers), {args.batch} prompt(s) of "
          f"{args.input_len} tokens, {args.rounds} paired rounds in random order, {args.threads} thread(s)\n")
    times = {n: [] for n in SYSTEMS}
    for r in range(args.rounds + 1):
        order = list(SYSTEMS)
        rng.shuffle(order)
        for n in order:
            use(model, *sets[n])
            runner.clear()
            reqs = one_batch.prepare_synthetic_inputs_for_latency_test(args.batch, args.input_len, custom_inputs=ids)
            t0 = time.perf_counter()
            runner.extend(reqs)
            dt = time.perf_counter() - t0
            if r:  # round 0 warms every system up
                times[n].append(dt)
        print(f"  round {r} done", file=sys.stderr, flush=True)
    use(model, *sets["upstream"])
    up = times["upstream"]
    print("| system | median ms | / upstream (95% CI) |\n|---|---|---|")
    for n in SYSTEMS:
        d = paired_delta(times[n], up)
        print(f"| {n} | {statistics.median(times[n]) * 1e3:.0f} | "
              + ("1" if n == "upstream" else f"{1 + d.median:.3f} [{1 + d.lo:.3f}, {1 + d.hi:.3f}]") + " |")


def run_hf(args) -> None:
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    import vskipper
    import vskipper.models.hf as hf
    from vskipper.bench.paired import paired_delta
    from vskipper.models.smollm2 import smollm2_dir

    torch.set_num_threads(args.threads)
    base = AutoModelForCausalLM.from_pretrained(args.model or str(smollm2_dir()), dtype=torch.float32).eval()
    sk = vskipper.RandomSkip(args.rate, list(range(15, 30)), seed=0)
    models = {b: vskipper.transform(copy.deepcopy(base), copy.deepcopy(sk), vskipper.Config(execution=b))
              for b in ("dense", "routed")}
    ids = torch.randint(1, 10000, (args.batch, args.input_len), generator=torch.Generator().manual_seed(0))
    every_row = lambda mask, B, S, Skv: 0  # noqa: E731  (n < 0 never: attention for all rows, as before)
    systems = {"dense": (models["dense"], hf._query_rows), "routed-mlp-only": (models["routed"], every_row),
               "routed": (models["routed"], hf._query_rows)}
    rng, times = random.Random(0), {n: [] for n in systems}
    print(f"transformers forward, {type(base).__name__}, {args.batch} prompt(s) of {args.input_len} tokens, "
          f"RandomSkip({args.rate}) over layers 15-29, {args.rounds} paired rounds in random order, {args.threads} thread(s)\n")
    with torch.no_grad():
        for r in range(args.rounds + 1):
            order = list(systems)
            rng.shuffle(order)
            for n in order:
                m, hf._query_rows = systems[n]
                t0 = time.perf_counter()
                m(ids)
                if r:
                    times[n].append(time.perf_counter() - t0)
    hf._query_rows = systems["dense"][1]
    print("| system | median ms | / dense (95% CI) |\n|---|---|---|")
    for n in systems:
        d = paired_delta(times[n], times["dense"])
        print(f"| {n} | {statistics.median(times[n]) * 1e3:.0f} | "
              + ("1" if n == "dense" else f"{1 + d.median:.3f} [{1 + d.lo:.3f}, {1 + d.hi:.3f}]") + " |")


def main(argv=None) -> None:
    args = parse(argv)
    if args.hf:
        return run_hf(args)
    os.environ.pop("VSKIPPER_SKIPPER", None)  # the model loads as upstream's; systems are made here
    from vskipper.bench.runner import with_model_runner
    from vskipper.models.smollm2 import smollm2_dir

    with_model_runner(args.model or str(smollm2_dir()), lambda runner: run(args, runner),
                      max_total_tokens=max(4096, args.batch * args.input_len + 64))


if __name__ == "__main__":
    main()
