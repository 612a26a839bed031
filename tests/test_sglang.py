"""vskipper inside real SGLang 0.5.23 on CPU: continuous batching, paged KV, radix cache.
Greedy tokens must equal the eager reference (full recompute, no cache)."""
from __future__ import annotations

import pytest
import torch

import vskipper
from vskipper.models.hf_loader import save_checkpoint

from sglang_util import calibrated_cache, check_against_reference, engine, greedy, prompt_set, run_script
from tiny import VOCAB, flexidepth_for, tiny_llama, tiny_qwen3

pytestmark = pytest.mark.sglang


@pytest.mark.parametrize("family, execution", [("llama", "routed"), ("llama", "routed-mlp"), ("llama", "auto"),
                                               ("qwen3", "dense"), ("qwen3", "routed")])
def test_skip_aware_checkpoint(tmp_path, capfd, family, execution):
    base = tiny_llama() if family == "llama" else tiny_qwen3()
    sk = flexidepth_for(base, [1, 3, 4, 5], gate="soft" if family == "llama" else "hard")
    # as FlexiDepth publishes it: its own model_type and an auto_map to remote code (never run)
    path = save_checkpoint(tmp_path / "ckpt", base, sk, model_type="dd" + family,
                           auto_map={"AutoModelForCausalLM": "modeling_dd.DDForCausalLM"})
    env = calibrated_cache(tmp_path, base) if execution == "auto" else {}
    with engine(path, log_level="info" if env else "warning", VSKIPPER_EXECUTION=execution, **env) as eng:
        check_against_reference(eng, base, sk)
    if env:  # auto ran with the calibration (both bodies), not dense for want of one
        err = capfd.readouterr().err
        assert "layer 1: auto: dense-masked (" in err, err[-3000:]
        assert "calibration 'cpu: " in err, err[-3000:]


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
    # by phase: the two prompts' tokens as prefill, two generated tokens per decode step as decode
    n = sum(len(p) for p in prompt_set()[0][:2])
    assert f"(prefill 1.000 over {n}, decode 1.000 over 8)" in err, err[-2000:]


def test_graph_safe_body_has_no_host_sync_at_decode(tmp_path):
    """VSKIPPER_STATIC_SHAPES=1: the body SGLang would capture in a CUDA graph (fixed shapes,
    device-side counts, masked paged decode attention). VSKIPPER_CHECK_SYNC=1 makes any host sync
    inside a routed layer during decode fail the request."""
    base = tiny_llama()
    sk = flexidepth_for(base, [1, 3, 4, 5], gate="soft")
    path = save_checkpoint(tmp_path / "ckpt", base, sk)
    with engine(path, VSKIPPER_EXECUTION="routed", VSKIPPER_STATIC_SHAPES="1", VSKIPPER_CHECK_SYNC="1") as eng:
        check_against_reference(eng, base, sk)


def test_rate_0_is_upstream_on_the_bundled_model():
    """Only routed layers change, and a routed layer that runs every token computes the layer: with
    RandomSkip at rate 0 (routed body), SGLang serves upstream SGLang's greedy tokens on
    SmolLM2-135M for 16 prompts of mixed length sent together."""
    from vskipper.models.smollm2 import smollm2_dir

    path = smollm2_dir()
    g = torch.Generator().manual_seed(21)
    lengths = (1, 3, 5, 8, 13, 17, 24, 31, 40, 2, 7, 11, 19, 27, 36, 50)
    prompts = [torch.randint(1, 49152, (n,), generator=g) for n in lengths]
    with engine(path) as eng:
        upstream, _ = greedy(eng, prompts, 48)
    with engine(path, VSKIPPER_SKIPPER="random:rate=0,layers=15-29,seed=0", VSKIPPER_EXECUTION="routed") as eng:
        ours, _ = greedy(eng, prompts, 48)
    same = sum(a == b for a, b in zip(ours, upstream))
    assert same == len(prompts), f"{same}/{len(prompts)} completions equal upstream's"


def test_valid_rows_come_from_sglangs_count_of_real_tokens():
    from types import SimpleNamespace

    from vskipper.engines.sglang_layer import valid_rows

    padded = SimpleNamespace(num_token_non_padded=torch.tensor(3, dtype=torch.int32))  # the graph runner's
    assert valid_rows(padded, 5, "cpu").tolist() == [True, True, True, False, False]
    slots = SimpleNamespace(num_token_non_padded=None, out_cache_loc=torch.tensor([7, 3, 9, 0, 0]))
    assert valid_rows(slots, 5, "cpu").tolist() == [True] * 3 + [False] * 2  # padding writes to slot 0
    assert valid_rows(SimpleNamespace(), 2, "cpu").tolist() == [True, True]


def test_stats_are_read_after_a_step_never_while_capturing(monkeypatch, caplog):
    """The reporter runs after each model-runner step (outside the model's forward); while SGLang
    captures a graph it reads nothing. The decode steps run under the host-sync guard."""
    from types import SimpleNamespace

    from sglang.srt.model_executor.runner_utils import capture_mode

    from vskipper.integrations.sglang.runtime import StatsReporter

    from tiny import transformed

    m = transformed(tiny_llama(), vskipper.RandomSkip(0.5, [1, 2]), "routed", static_shapes=True, check_sync=True)
    with torch.no_grad():
        m.generate(torch.randint(1, VOCAB, (2, 5)), max_new_tokens=4, do_sample=False, pad_token_id=0)
    reporter = StatsReporter(m, interval=2)
    decode = SimpleNamespace(forward_mode=SimpleNamespace(is_decode=lambda: True))
    prefill = SimpleNamespace(forward_mode=SimpleNamespace(is_decode=lambda: False))
    reads = []
    counts = dict(tokens=4, run=2, project=2, nonfinite=0)
    monkeypatch.setattr(vskipper, "stats", lambda model, by_setting=False: {} if by_setting else reads.append(1) or {
        1: counts | {f"prefill_{k}": 0 for k in counts} | {f"decode_{k}": v for k, v in counts.items()}})
    monkeypatch.setattr(capture_mode, "is_capture_mode", True)
    for _ in range(4):
        reporter.after_step(decode)
    assert reads == [] and reporter.steps == 0  # capturing: not a step, nothing read
    monkeypatch.setattr(capture_mode, "is_capture_mode", False)
    with caplog.at_level("INFO", logger="vskipper"):
        for fb in (decode, prefill, decode, decode, None):
            reporter.after_step(fb)
    assert reporter.steps == 3 and reads == [1]
    assert "after 2 decode steps: skip ratio 0.500" in caplog.text


def test_draft_runner_is_left_untransformed_and_quantized_layers_fail_early(monkeypatch, caplog):
    from types import SimpleNamespace

    from torch import nn

    from vskipper.integrations.sglang import runtime

    monkeypatch.setenv("VSKIPPER_SKIPPER", "random:rate=0.5,layers=1")
    draft = SimpleNamespace(is_draft_worker=True, model=tiny_llama())
    with caplog.at_level("INFO", logger="vskipper"):
        runtime.transform_loaded(draft)
    assert not hasattr(draft.model, "vskipper") and "draft model runner" in caplog.text

    class Fp8LinearMethod:
        pass

    layer = nn.Module()
    layer.qkv_proj = nn.Linear(2, 2)
    layer.qkv_proj.quant_method = Fp8LinearMethod()
    model = SimpleNamespace(model=SimpleNamespace(layers=[nn.Module(), layer]))
    runner = SimpleNamespace(model=model, server_args=SimpleNamespace(kv_cache_dtype="auto"))
    with pytest.raises(NotImplementedError, match=r"model.layers.1.qkv_proj is quantized \(Fp8LinearMethod\)"):
        runtime.check_supported(runner, [1])
    runtime.check_supported(runner, [0])  # an unrouted quantized layer is SGLang's business
    runner.server_args.kv_cache_dtype = "fp8_e4m3"
    with pytest.raises(NotImplementedError, match=r"--kv-cache-dtype fp8_e4m3 is not supported"):
        runtime.check_supported(runner, [0])


@pytest.mark.parametrize("static", ["0", "1"])
def test_padding_rows_are_never_routed_counted_or_mixed_in(tmp_path, static):
    """A decode batch padded by one row as the CUDA-graph runner pads it: the real rows' logits are
    the unpadded step's, and stats count the real rows only, from SGLang's num_token_non_padded or,
    without it, from its padding slot; the control (neither) counts the pad row."""
    base = tiny_llama()
    path = save_checkpoint(tmp_path / "ckpt", base, flexidepth_for(base, [1, 3, 4, 5], gate="soft"))
    res = run_script("padded_decode.py", path, tmp_path / "padded.json", VSKIPPER_EXECUTION="routed",
                     VSKIPPER_STATIC_SHAPES=static)
    assert res["rows"] == 4
    assert res["max_abs_diff_real_rows"] < 1e-4, res
    assert res["padded"] == res["real"] and all(s["tokens"] == 3 for s in res["real"].values()), res
    assert res["padded_without_count"] == res["real"], res
    assert all(s["tokens"] == 4 for s in res["control"].values()), res
    # what explain says runs is what ran: the routed body's attention for the RUN rows only
    assert any(s["project"] for s in res["real"].values()), "the step skipped nothing: no routed attention to see"
    shapes = "fixed shapes (torch ops" if static == "1" else "dynamic shapes"
    assert f"routed (attention, MLP and adapter for their rows only), {shapes}" in res["explain"], res["explain"]
    assert res["attention_calls"] == ["attend_masked" if static == "1" else "attend_rows"], res["attention_calls"]
