"""vskipper inside real SGLang 0.5.23 on CPU: continuous batching, paged KV, radix cache.
Greedy tokens must equal the eager reference (full recompute, no cache)."""
from __future__ import annotations

import pytest
import torch

import vskipper
from vskipper.models.hf_loader import save_checkpoint
from vskipper.reference import reference_generate

from sglang_util import engine, greedy
from tiny import VOCAB, flexidepth_for, tiny_llama, tiny_qwen3

pytestmark = pytest.mark.sglang
NEW = 16


def prompt_set(seed=5):
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(1, VOCAB, (9,), generator=g)
    first = [torch.randint(1, VOCAB, (n,), generator=g) for n in (3, 17, 1, 8)] + [shared]
    # second wave: prompts that extend earlier ones, so the radix cache has their prefixes
    second = [torch.cat([shared, torch.randint(1, VOCAB, (n,), generator=g)]) for n in (2, 6)]
    second += [torch.cat([first[1], torch.randint(1, VOCAB, (4,), generator=g)]), torch.randint(1, VOCAB, (12,), generator=g)]
    return first, second


def check_against_reference(eng, base, skipper):
    first, second = prompt_set()
    out1, _ = greedy(eng, first, NEW)
    out2, cached = greedy(eng, second, NEW)
    assert sum(cached) > 0, "the second wave should hit the radix cache"
    for p, out in zip(first + second, out1 + out2):
        ref, _ = reference_generate(base, skipper, p, NEW)
        assert out == ref[len(p):].tolist(), f"prompt of {len(p)} tokens: sglang {out} != reference {ref[len(p):].tolist()}"


@pytest.mark.parametrize("family, execution", [("llama", "routed"), ("qwen3", "dense")])
def test_skip_aware_checkpoint(tmp_path, family, execution):
    base = tiny_llama() if family == "llama" else tiny_qwen3()
    sk = flexidepth_for(base, [1, 3, 4, 5], gate="soft" if family == "llama" else "hard")
    # as FlexiDepth publishes it: its own model_type and an auto_map to remote code (never run)
    path = save_checkpoint(tmp_path / "ckpt", base, sk, model_type="dd" + family,
                           auto_map={"AutoModelForCausalLM": "modeling_dd.DDForCausalLM"})
    with engine(path, VSKIPPER_EXECUTION=execution) as eng:
        check_against_reference(eng, base, sk)


def test_stock_model_with_random_skip_through_the_hook(tmp_path):
    base = tiny_llama()
    base.save_pretrained(tmp_path / "stock", safe_serialization=True)
    spec = "random:rate=0.5,layers=1-5,seed=3"
    with engine(tmp_path / "stock", VSKIPPER_SKIPPER=spec) as eng:
        check_against_reference(eng, base, vskipper.parse_skipper(spec))


def test_stats_are_logged_every_n_decode_steps(tmp_path, capfd):
    base = tiny_llama()
    base.save_pretrained(tmp_path / "stock", safe_serialization=True)
    with engine(tmp_path / "stock", log_level="info", VSKIPPER_SKIPPER="static:layers=2",
                VSKIPPER_STATS_INTERVAL="4") as eng:
        greedy(eng, prompt_set()[0][:2], 9)
    err = capfd.readouterr().err
    assert "vskipper: after 4 decode steps: skip ratio 1.000" in err and "per layer 2:1.00" in err, err[-2000:]


def test_graph_safe_body_has_no_host_sync_at_decode(tmp_path):
    """VSKIPPER_STATIC_SHAPES=1: the body SGLang would capture in a CUDA graph (fixed shapes,
    device-side counts, masked paged decode attention). VSKIPPER_CHECK_SYNC=1 makes any host sync
    inside a routed layer during decode fail the request."""
    base = tiny_llama()
    sk = flexidepth_for(base, [1, 3, 4, 5], gate="soft")
    path = save_checkpoint(tmp_path / "ckpt", base, sk)
    with engine(path, VSKIPPER_EXECUTION="routed", VSKIPPER_STATIC_SHAPES="1", VSKIPPER_CHECK_SYNC="1") as eng:
        check_against_reference(eng, base, sk)
