"""SGLang + vskipper with --tp-size 1 and 2 on one checkpoint: a closed batch's decode step time and
whether both give the same greedy tokens. On CPU a correctness run (gloo, one core per rank),
not a speed claim.

    python -m benchmarks.step.tp_decode CHECKPOINT [--batch 8] [--new 32] [--execution routed]

The decode step time is (time to generate 1 + new tokens - time to generate 1 token) / new, the
median of --repeats closed batches."""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from benchmarks import results as R


def measure(path: str, tp: int, args) -> tuple[float, list[list[int]]]:
    import sglang as sgl

    eng = sgl.Engine(model_path=path, tp_size=tp, device="cpu", dtype="float32", skip_tokenizer_init=True,
                     max_total_tokens=4096, attention_backend="torch_native", disable_cuda_graph=True,
                     log_level="error", mem_fraction_static=0.5)
    try:
        prompts = [[(7 * b + 3 * i) % 90 + 1 for i in range(5 + 3 * b)] for b in range(args.batch)]

        def run(n):
            t0 = time.perf_counter()
            out = eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": n, "temperature": 0,
                                                                   "ignore_eos": True})
            return time.perf_counter() - t0, [o["output_ids"] for o in out]

        run(2)  # warm up
        steps, tokens = [], None
        for _ in range(args.repeats):
            t1, _ = run(1)
            tn, tokens = run(1 + args.new)
            steps.append((tn - t1) / args.new)
        return statistics.median(steps), tokens
    finally:
        eng.shutdown()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.step.tp_decode", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--execution", default="routed", choices=["auto", "dense", "routed"])
    R.add_arguments(ap, "tp-decode")
    args = ap.parse_args(argv)
    os.environ.setdefault("SGLANG_PLATFORM", "vskipper_cpu")
    os.environ.setdefault("SGLANG_CPU_OMP_THREADS_BIND", "0|1" if (os.cpu_count() or 1) >= 2 else "0|0")
    os.environ["VSKIPPER_EXECUTION"] = args.execution
    res = {tp: measure(args.checkpoint, tp, args) for tp in (1, 2)}
    same = sum(a == b for a, b in zip(res[1][1], res[2][1]))
    text = (f"{args.checkpoint}, batch {args.batch}, {args.new} new tokens, execution {args.execution}, "
            f"median of {args.repeats}\n\n"
            + R.table(["tp", "decode step ms", "greedy sequences equal to tp=1"],
                      [[tp, f"{step * 1e3:.1f}", f"{same if tp == 2 else args.batch}/{args.batch}"]
                       for tp, (step, _) in res.items()]) + "\n")
    print(text)
    R.write_results("tp-decode", {"args": vars(args), "step_s": {tp: step for tp, (step, _) in res.items()},
                                  "equal": same}, text, args.out, R.docs_dir(args))
    sys.exit(0 if same == args.batch else 1)


if __name__ == "__main__":
    main()
