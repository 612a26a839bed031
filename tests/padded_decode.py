"""Run by test_sglang.py in its own process: one decode step of a transformed SGLang model, then the
same step padded by one row the way the CUDA-graph runner pads a batch up to a captured size
(dummy token and position, request slot 0, sequence length 1, KV written to the pool's padding
slot 0, the real count in `num_token_non_padded`), once without that count (as for a dense model,
where SGLang does not enable it), and a control: no count and the pad row given a real KV slot.
    python tests/padded_decode.py CHECKPOINT OUT.json"""
from __future__ import annotations

import copy
import json
import sys

import torch


def main(path: str, out: str) -> None:
    import os

    if not torch.cuda.is_available():
        os.environ.setdefault("SGLANG_PLATFORM", "vskipper_cpu")  # before SGLang is imported
    from sglang.benchmark import one_batch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    import vskipper
    from benchmarks.step.runner import with_model_runner

    result = {}

    def work(runner):
        mr = runner.torch_runner
        model = mr.model
        reqs = one_batch.prepare_synthetic_inputs_for_latency_test(3, 0, custom_inputs=[[5, 9, 2, 7], [3] * 6, [11, 4]])
        next_ids, _, batch = runner.extend(reqs)
        batch.input_ids = next_ids.to(torch.int64)
        batch.prepare_for_decode()
        fb = ForwardBatch.init_new(batch, mr, return_hidden_states_before_norm=False)
        vskipper.stats(model, reset=True)
        from vskipper.engines.sglang import SGLangAttention

        calls = set()  # which of the attention part's methods the real step calls
        for name in ("attend_all", "attend_rows", "attend_masked"):
            method = getattr(SGLangAttention, name)
            setattr(SGLangAttention, name, lambda self, *a, _n=name, _m=method: calls.add(_n) or _m(self, *a))
        with torch.no_grad():
            real = mr.forward(fb).logits_output.next_token_logits.clone()
        result["real"] = vskipper.stats(model, reset=True)
        result["attention_calls"] = sorted(calls)
        result["explain"] = vskipper.explain(model)

        def padded(count, pad_slot=0):
            p = copy.copy(fb)
            one = lambda t, v: torch.cat([t, t.new_full((1,), v)])  # noqa: E731
            p.batch_size = fb.batch_size + 1
            p.input_ids, p.positions = one(fb.input_ids, 0), one(fb.positions, 0)
            p.req_pool_indices, p.out_cache_loc = one(fb.req_pool_indices, 0), one(fb.out_cache_loc, pad_slot)
            p.seq_lens = one(fb.seq_lens, 1)
            if fb.seq_lens_cpu is not None:
                p.seq_lens_cpu = one(fb.seq_lens_cpu, 1)
            p.seq_lens_sum = fb.seq_lens_sum + 1
            p.num_token_non_padded = None if count is None else torch.tensor(count, dtype=torch.int32)
            p.global_num_token_non_padded_cpu = None
            with torch.no_grad():
                logits = mr.forward(p).logits_output.next_token_logits
            return logits, vskipper.stats(model, reset=True)

        logits, result["padded"] = padded(3)
        result["max_abs_diff_real_rows"] = (logits[:3] - real).abs().max().item()
        result["rows"] = logits.shape[0]
        _, result["padded_without_count"] = padded(None)
        _, result["control"] = padded(None, pad_slot=int(fb.out_cache_loc[0]))

    from vskipper.models.smollm2 import smollm2_dir

    with_model_runner(path, work, tokenizer_path=str(smollm2_dir()))  # (one_batch loads a tokenizer; any will do)
    json.dump({k: {str(l): s for l, s in v.items()} if isinstance(v, dict) else v for k, v in result.items()},
              open(out, "w"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
