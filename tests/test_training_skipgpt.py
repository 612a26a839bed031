"""vskipper.training --family skipgpt: SkipGPT's attention and MLP routers, trained, saved, resumed,
round-tripped through from_pretrained; the CLI's refusals. Tiny random models; every test runs in seconds."""
from __future__ import annotations

import json
import math

import pytest
import torch

import vskipper
from vskipper.reference import reference_forward
from vskipper.training import TrainConfig, greedy, logits_of, skip_forward
from vskipper.training.data import build_targets

from helpers import assert_close, assert_equal
from tiny import record_routes
from training_util import LAYERS, sequences, targets, tiny_base, trainer


@pytest.fixture(scope="module")
def base():
    return tiny_base()


@pytest.fixture(scope="module")
def data(base):
    return targets(base)


@pytest.fixture
def model_dir(base, tmp_path):
    base.save_pretrained(tmp_path / "tiny")
    return tmp_path / "tiny"


def skipgpt_trainer(base, data, init="warm", **kw):
    return trainer(base, data, init=init, **{"family": "skipgpt", "gate": "hard", **kw})


def spread_skipgpt(sk, seed=4):
    """Random routers whose logits differ by O(1) or more: both decisions occur, none by last-bit noise."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in sk.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def test_sublayer_work_is_the_linear_flops_of_each_sublayer(base):
    from transformers import LlamaConfig

    smol = LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3)
    attn, mlp = vskipper.training.sublayer_work(smol)  # q, k, v, o: 884,736 weights; the MLP 2,654,208
    assert math.isclose(attn, 884_736 / 3_538_944) and math.isclose(attn + mlp, 1.0) and math.isclose(attn, 0.25)
    a, m = vskipper.training.sublayer_work(base.config)  # H 40, I 72, 4 heads of 10, 2 KV heads
    assert math.isclose(a, 40 * 10 * 12 / (40 * 10 * 12 + 3 * 40 * 72))


def test_skipgpt_training_forward_matches_the_reference(base):
    t = skipgpt_trainer(base, build_targets(base, sequences(), 0, 8), init="random", layers=(0, 2, 5))
    spread_skipgpt(t.skipper)
    both = torch.zeros(2, dtype=torch.bool)
    for s in sequences(3, seed=9):
        ids = torch.tensor(s)
        logits, decisions, _ = reference_forward(base, t.skipper, ids)
        out = skip_forward(base, t.skipper, ids[None], straight_through=False)
        assert_close(logits_of(base, out.hidden[0]), logits, "logits vs vskipper.reference")
        for l in t.skipper.layers:
            assert_equal(out.run[l][0], decisions[l], f"decisions [S, 2] of layer {l}")
            both |= ~decisions[l].all(0)
        with torch.no_grad():  # the decisions are SkipGPT's router's own, its gates p_run those logits'
            h = torch.randn(5, base.config.hidden_size)
            for col, tr in enumerate((t.skipper.router(2).router_attention, t.skipper.router(2).router_mlp)):
                assert_equal(tr(h), tr.logits(h).argmax(-1) == 0, "TokenRouter decisions vs argmax")
    assert both.all()  # attention and MLP are each skipped somewhere


def test_skipgpt_straight_through_changes_no_value_and_trains_both_routers(base, data):
    t = skipgpt_trainer(base, data, init="random")
    spread_skipgpt(t.skipper)
    ids, valid, hidden, _ = t.batch([0, 1, 2])
    with torch.no_grad():
        ref = skip_forward(base, t.skipper, ids, start_hidden=hidden, start_layer=2, straight_through=False)
    st = skip_forward(base, t.skipper, ids, start_hidden=hidden, start_layer=2, straight_through=True)
    assert_equal(st.hidden.detach(), ref.hidden, "straight-through forward vs inference forward")
    for l in LAYERS:
        assert_equal(st.run[l], ref.run[l], f"decisions of layer {l}")
        assert_equal(st.run[l], st.gates[l].detach() >= 0.5, f"decisions vs p_run >= 0.5, layer {l}")
    logits_of(base, st.hidden[valid]).logsumexp(-1).mean().backward()
    for name in ("router_attention", "router_mlp"):
        grad = getattr(t.skipper.router(3), name).weight_predictor.weight.grad
        assert grad is not None and grad.abs().sum() > 0, name


def test_skipgpt_warm_start_runs_everything_then_training_skips_work(base, data):
    t = skipgpt_trainer(base, data, penalty=1.0, target_skip=0.4, target_rate=0.3, steps=12, lr=3e-2)
    before = t.evaluate()
    assert before["skip"] == 0.0 and before["main"] < 1e-6  # the warm start is the base model (KL ~ 0)
    t.run(log=lambda s: None)
    after = t.evaluate()
    assert 0.05 < after["skip"] < 0.9, after
    assert math.isclose(after["skip"], sum(w * after[k] for w, k in zip(t.work.tolist(),
                                                                         ("skip_attention", "skip_mlp"))),
                        rel_tol=1e-6)  # skip is the work-weighted share of the sublayers' skips


def test_skipgpt_training_reduces_the_loss(base, data):
    t = skipgpt_trainer(base, data, init="random", penalty=0.0, steps=12, lr=1e-2)
    spread_skipgpt(t.skipper)
    before = t.evaluate()
    t.run(log=lambda s: None)
    after = t.evaluate()
    assert after["main"] < 0.7 * before["main"], (before, after)


def test_skipgpt_save_and_resume_give_identical_results(base, data, tmp_path):
    kw = dict(penalty=0.5, target_skip=0.3, steps=6)
    straight = skipgpt_trainer(base, data, **kw)
    straight.run(log=lambda s: None)
    first = skipgpt_trainer(base, data, **kw)
    first.run(until=3, log=lambda s: None)
    first.save_state(tmp_path / "state")
    resumed = skipgpt_trainer(base, data, **kw)
    resumed.load_state(tmp_path / "state")
    resumed.run(log=lambda s: None)
    for (n, p), q in zip(straight.skipper.named_parameters(), resumed.skipper.parameters()):
        assert_equal(q, p, f"parameter {n} after save/resume")
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in straight.history]
    with pytest.raises(ValueError, match="different settings.*family"):
        trainer(base, data, **kw).load_state(tmp_path / "state")  # a FlexiDepth run cannot continue it


def test_skipgpt_checkpoint_round_trip_through_from_pretrained(base, data, tmp_path):
    from vskipper.skippers.skipgpt import SkipGPT
    from vskipper.training import write_skipgpt_checkpoint

    t = skipgpt_trainer(base, data, init="random")
    spread_skipgpt(t.skipper, seed=6)
    sk = t.skipper.eval()
    path = write_skipgpt_checkpoint(tmp_path / "ckpt", base, sk, vskipper_training={"steps": 0})
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["SkipGPTLlamaForCausalLM"] and cfg["skipgpt"] == {"layers": list(LAYERS)}
    model = vskipper.from_pretrained(path)
    assert isinstance(model.vskipper.skipper, SkipGPT) and model.vskipper.skipper.layers == LAYERS
    calls = record_routes(model)
    skipped = torch.zeros(2, dtype=torch.bool)
    for s in sequences(2, seed=21):
        ids = torch.tensor(s)
        tokens, decisions = greedy(base, sk, ids, 8)
        with torch.no_grad():
            gen = model.generate(ids[None], max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert_equal(gen[0], tokens, "greedy tokens: from_pretrained vs the training forward")
        for l in calls:
            calls[l].clear()
        with torch.no_grad():
            model(tokens[None, :-1])
        for l in sk.layers:
            assert_equal(calls[l][0].reshape(-1, 2), decisions[l], f"route decisions of layer {l}")
            skipped |= ~decisions[l].all(0)
    assert skipped.all()  # both sublayers are skipped somewhere: the decisions are tested, not all-RUN


@pytest.mark.parametrize("flags, message", [
    (["--gate", "soft"], r"--gate soft: --family skipgpt is hard-gated .* drop --gate or pass --gate hard"),
    (["--no-full-checkpoint"], r"--no-full-checkpoint: --family skipgpt writes only its full checkpoint"),
    (["--layers", "2-7"], r"--layers: layer\(s\) \[6, 7\] do not exist"),
])
def test_cli_rejects_bad_skipgpt_input(model_dir, tmp_path, capsys, flags, message):
    from vskipper.cli import main

    with pytest.raises(SystemExit) as e:
        main(["train", "--family", "skipgpt", "--out", str(tmp_path / "out"), "--model-path", str(model_dir), *flags])
    assert e.value.code == 2
    assert __import__("re").search(message, capsys.readouterr().err)
    with pytest.raises(ValueError, match="family='skipgpt' is hard-gated"):
        TrainConfig(layers=LAYERS, family="skipgpt", gate="soft")
    with pytest.raises(ValueError, match="family='lora' must be one of"):
        TrainConfig(layers=LAYERS, family="lora")
