"""Run by test_prefill.py in its own process: one extend batch of a transformed SGLang model (three
prompts, RUN and PROJECT rows at every routed layer), with every routed layer's query projection
watched: how many rows it projected, and its q (RUN rows), k and v against SGLang's own
forward_prepare_native of the same input.
    python tests/prefill_queries.py CHECKPOINT OUT.json"""
from __future__ import annotations

import json
import sys

import torch


def main(path: str, out: str) -> None:
    import os

    if not torch.cuda.is_available():
        os.environ.setdefault("SGLANG_PLATFORM", "vskipper_cpu")  # before SGLang is imported
    from sglang.benchmark import one_batch

    import vskipper
    from benchmarks.step.runner import with_model_runner
    from vskipper.engines.sglang import SGLangAttention

    seen = []
    prepare = SGLangAttention._prepare_rows

    def watched(self, positions, x, rows):
        q, k, v = prepare(self, positions, x, rows)
        rq, rk, rv = self.self_attn.forward_prepare_native(positions, x)
        diff = lambda a, b: (a.reshape(b.shape) - b).abs().max().item()  # noqa: E731
        seen.append({"layer": self.self_attn.attn.layer_id, "rows": rows.numel(), "T": x.shape[0],
                     "q": diff(q[rows], rq[rows]), "k": diff(k, rk), "v": diff(v, rv),
                     "q_off_rows_zero": bool((q.reshape(x.shape[0], -1).abs().sum(-1) == 0).sum()
                                             == x.shape[0] - rows.numel())})
        return q, k, v

    SGLangAttention._prepare_rows = watched
    result = {}

    def work(runner):
        g = torch.Generator().manual_seed(3)
        prompts = [torch.randint(1, 64, (n,), generator=g).tolist() for n in (40, 25, 61)]
        reqs = one_batch.prepare_synthetic_inputs_for_latency_test(3, 0, custom_inputs=prompts)
        vskipper.stats(runner.torch_runner.model, reset=True)
        runner.extend(reqs)
        result["stats"] = {str(l): s for l, s in vskipper.stats(runner.torch_runner.model).items()}

    from vskipper.models.smollm2 import smollm2_dir

    with_model_runner(path, work, tokenizer_path=str(smollm2_dir()))  # (one_batch loads a tokenizer; any will do)
    result["calls"] = seen
    json.dump(result, open(out, "w"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
