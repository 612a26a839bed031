"""vskipper.training: the training forward, the loss, the loop, checkpoints, the shipped skipper, the CLI.

Tiny random models built here; every test runs in seconds."""
from __future__ import annotations

import json
import math

import pytest
import torch

import vskipper
from vskipper.models.hf_loader import save_checkpoint
from vskipper.reference import reference_forward
from vskipper.training import (
    TrainConfig,
    greedy,
    logits_of,
    skip_forward,
    write_skipper_dir,
)
from vskipper.training.data import Batcher, build_targets, split_prompts

from helpers import assert_close, assert_equal
from tiny import VOCAB, record_routes
from training_util import LAYERS, sequences, targets, tiny_base, trainer


@pytest.fixture(scope="module")
def base():
    return tiny_base()


@pytest.fixture(scope="module")
def data(base):
    return targets(base)


# --- the training forward ---------------------------------------------------------------------
@pytest.mark.parametrize("gate", ["soft", "hard"])
def test_training_forward_matches_the_reference(base, gate):
    t = trainer(base, build_targets(base, sequences(), 0, 8), gate=gate, init="random", layers=(0, 2, 5))
    with torch.no_grad():
        for p in t.skipper.parameters():  # spread the gates away from 0.5, as in tests/tiny.py
            p.normal_(0, 0.5)
    for s in sequences(3, seed=9):
        ids = torch.tensor(s)
        logits, decisions, gates = reference_forward(base, t.skipper, ids)
        out = skip_forward(base, t.skipper, ids[None], straight_through=False)
        assert_close(logits_of(base, out.hidden[0]), logits, "logits vs vskipper.reference")
        for l in t.skipper.layers:
            assert_equal(out.run[l][0], decisions[l], f"decisions of layer {l}")


def test_batched_right_padding_matches_one_by_one(base, data):
    t = trainer(base, data)
    seqs = [torch.tensor(s) for s in sequences(3, seed=11)]
    ids = torch.zeros(3, max(len(s) for s in seqs), dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, :len(s)] = s
    with torch.no_grad():
        batched = skip_forward(base, t.skipper, ids)
        for b, s in enumerate(seqs):
            one = skip_forward(base, t.skipper, s[None])
            assert_close(batched.hidden[b, :len(s)], one.hidden[0], f"sequence {b}")
            for l in LAYERS:
                assert_equal(batched.run[l][b, :len(s)], one.run[l][0], f"decisions of sequence {b}, layer {l}")


@pytest.mark.parametrize("gate", ["soft", "hard"])
def test_gate_is_straight_through(base, data, gate):
    """Training sees the inference decisions (g > 0.5) and the inference values, bit for bit; the
    router still gets a gradient through the hard decision (the only one it gets with a hard gate)."""
    t = trainer(base, data, gate=gate)
    ids, valid, hidden, _ = t.batch([0, 1, 2])
    with torch.no_grad():
        ref = skip_forward(base, t.skipper, ids, start_hidden=hidden, start_layer=2, straight_through=False)
    st = skip_forward(base, t.skipper, ids, start_hidden=hidden, start_layer=2, straight_through=True)
    assert_equal(st.hidden.detach(), ref.hidden, "straight-through forward vs inference forward")
    for l in LAYERS:
        assert_equal(st.run[l], st.gates[l].detach() > 0.5, f"decisions of layer {l} vs threshold 0.5")
        assert_equal(st.run[l], ref.run[l], f"decisions of layer {l}")
    runs = torch.stack([st.run[l][valid] for l in LAYERS])
    assert runs.any() and not runs.all()  # both routes are exercised
    grads = {}
    for straight in (True, False):
        t.skipper.zero_grad(set_to_none=True)
        out = skip_forward(base, t.skipper, ids, start_hidden=hidden, start_layer=2, straight_through=straight)
        logits_of(base, out.hidden[valid]).logsumexp(-1).mean().backward()
        grads[straight] = t.skipper.router(3).router_head.weight.grad
    assert grads[True] is not None and grads[True].abs().sum() > 0
    if gate == "hard":  # without the straight-through term the hard gate gives the router nothing
        assert grads[False] is None or grads[False].abs().sum() == 0
    else:
        assert not torch.equal(grads[True], grads[False])


def test_kl_with_every_token_kept_is_the_exact_kl(base):
    data = build_targets(base, sequences(4), start_layer=2, topk=VOCAB)
    t = trainer(base, data, init="random", topk=VOCAB)
    with torch.no_grad():
        total, parts = t.losses([0, 1, 2, 3], penalty=0.0)
        ids, valid, _, _ = t.batch([0, 1, 2, 3])
        p = torch.log_softmax(base(ids).logits[valid], -1)
        out = skip_forward(base, t.skipper, ids)
        q = torch.log_softmax(logits_of(base, out.hidden[valid]), -1)
        exact = (p.exp() * (p - q)).sum(-1).mean()
    assert math.isclose(parts["main"], float(exact), rel_tol=1e-4, abs_tol=1e-6)
    data8 = build_targets(base, sequences(4), start_layer=2, topk=8)
    t8 = trainer(base, data8, init="random", topk=8)
    t8.skipper.load_state_dict(t.skipper.state_dict())
    _, parts8 = t8.losses([0, 1, 2, 3], penalty=0.0)
    assert parts8["main"] <= parts["main"] + 1e-6  # top-k + rest is a coarse-graining: never more


# --- the loop -----------------------------------------------------------------------------------
def test_training_reduces_the_loss(base, data):
    t = trainer(base, data, init="random", penalty=0.0, steps=12, lr=1e-2)
    before = t.evaluate()
    t.run(log=lambda s: None)
    after = t.evaluate()
    assert after["main"] < 0.7 * before["main"], (before, after)


def test_penalty_moves_the_skip_ratio(base, data):
    skip = {}
    for pen in (0.0, 20.0):
        t = trainer(base, data, penalty=pen, steps=12, lr=2e-2)
        t.run(log=lambda s: None)
        skip[pen] = t.evaluate()["skip"]
    assert skip[20.0] > skip[0.0] + 0.1, skip


def test_target_skip_steers_the_penalty_weight(base, data):
    t = trainer(base, data, penalty=1.0, target_skip=0.6, target_rate=0.5, steps=6)
    t.run(log=lambda s: None)
    assert t.penalty_weight > 1.0  # below the target: the weight grows
    weights = [h["penalty_weight"] for h in t.history]
    assert weights == sorted(weights) and weights[0] == 1.0


def test_batches_are_a_function_of_seed_and_step():
    lengths = [5, 9, 3, 7, 11, 2, 8, 6, 4, 10]
    a, b = Batcher(lengths, 3, seed=1), Batcher(lengths, 3, seed=1)
    seq = [a.batch(s) for s in range(9)]
    assert seq == [b.batch(s) for s in reversed(range(9))][::-1]
    assert Batcher(lengths, 3, seed=2).epoch(0) != a.epoch(0)
    for e in range(3):
        flat = sum(a.epoch(e), [])
        assert len(flat) == len(set(flat)) == 9


def test_save_and_resume_give_identical_results(base, data, tmp_path):
    straight = trainer(base, data, penalty=0.5, target_skip=0.3, steps=6)
    straight.run(log=lambda s: None)
    first = trainer(base, data, penalty=0.5, target_skip=0.3, steps=6)
    first.run(until=3, log=lambda s: None)
    first.save_state(tmp_path / "state")
    resumed = trainer(base, data, penalty=0.5, target_skip=0.3, steps=6)  # fresh weights, then the saved ones
    resumed.load_state(tmp_path / "state")
    assert resumed.step == 3
    resumed.run(log=lambda s: None)
    for (n, p), q in zip(straight.skipper.named_parameters(), resumed.skipper.parameters()):
        assert_equal(q, p, f"parameter {n} after save/resume")
    assert resumed.penalty_weight == straight.penalty_weight
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in straight.history]
    other = trainer(base, data, penalty=0.7, target_skip=0.3, steps=6)
    with pytest.raises(ValueError, match="different settings.*penalty"):
        other.load_state(tmp_path / "state")


def test_export_state_writes_the_saved_skipper(base, data, tmp_path):
    from vskipper.training.run import export_state
    from vskipper.training.shipped import load_skipper

    t = trainer(base, data, steps=2)
    t.run(log=lambda s: None)
    t.save_state(tmp_path / "run" / "state")
    base.save_pretrained(tmp_path / "base")
    skdir = export_state(tmp_path / "run", model_dir=tmp_path / "base")
    assert skdir.name == "skipper-step2"
    loaded = load_skipper(skdir)
    for k, v in t.skipper.flexidepth_state_dict().items():
        assert_equal(loaded.flexidepth_state_dict()[k], v, k)


# --- checkpoints ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(base, data):
    t = trainer(base, data, penalty=5.0, steps=8, lr=1e-2)
    t.run(log=lambda s: None)
    skip = t.evaluate()["skip"]
    assert 0.05 < skip < 0.95, skip  # a skipper that really routes
    return t.skipper.eval()


def test_round_trip_through_from_pretrained(base, trained, tmp_path):
    sk = trained
    path = save_checkpoint(tmp_path / "ckpt", base, sk)
    model = vskipper.from_pretrained(path)
    calls = record_routes(model)
    for s in sequences(2, seed=21):
        ids = torch.tensor(s)
        for l in calls:
            calls[l].clear()
        with torch.no_grad():
            model(ids[None])
            out = skip_forward(base, sk, ids[None], straight_through=False)
        for l in sk.layers:
            assert_equal(calls[l][0].reshape(-1) > 0.5, out.run[l][0], f"route decisions of layer {l}")
        tokens, _ = greedy(base, sk, ids, 8)
        with torch.no_grad():
            gen = model.generate(ids[None], max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert_equal(gen[0], tokens, "greedy tokens: from_pretrained vs the training forward")


def test_skipper_dir_and_build_checkpoint(base, trained, tmp_path):
    from vskipper.training.shipped import build_checkpoint, load_skipper

    sk = trained
    skdir = write_skipper_dir(tmp_path / "skipper", sk, base.config, vskipper_training={"steps": 10})
    cfg = json.loads((skdir / "config.json").read_text())
    assert cfg["architectures"] == ["DDLlamaForCausalLM"] and cfg["routing_layers"] == list(LAYERS)
    loaded = load_skipper(skdir)
    for k, v in sk.flexidepth_state_dict().items():
        assert_equal(loaded.flexidepth_state_dict()[k], v, k)
    assert vskipper.parse_skipper(f"flexidepth:path={skdir}").layers == LAYERS
    base_dir = tmp_path / "base"
    base.save_pretrained(base_dir)
    ckpt = build_checkpoint(tmp_path / "ckpt", skipper=skdir, base_dir=base_dir)
    assert build_checkpoint(tmp_path / "ckpt", skipper=skdir, base_dir=base_dir) == ckpt  # reused
    model = vskipper.from_pretrained(ckpt)
    ids = torch.tensor(sequences(1, seed=4)[0])
    tokens, _ = greedy(base, sk, ids, 10)
    with torch.no_grad():
        gen = model.generate(ids[None], max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert_equal(gen[0], tokens, "greedy tokens of the built checkpoint")


# --- the shipped skipper ----------------------------------------------------------------------------
def test_shipped_skipper_loads_with_the_expected_layers_and_shapes():
    from vskipper.training.shipped import load_skipper, shipped_dir

    d = shipped_dir()
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["DDLlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (30, 576, 1536)
    sk = load_skipper()
    assert sk.layers == tuple(range(15, 30)) and sk.gate == cfg["gate_mode"]
    shapes = sk.expected_shapes()
    assert shapes["model.layers.15.router.router_enc.weight"] == (36, 576)
    assert shapes["model.layers.29.router_proj.up_proj.weight"] == (576, 96)
    for k, v in sk.flexidepth_state_dict().items():
        assert torch.isfinite(v).all(), k
    assert sk.router(20).router_head.weight.abs().sum() > 0  # trained, not empty
    assert (d / "skipper.safetensors").stat().st_size < 16 << 20
    with pytest.raises(ValueError, match="no shipped skipper 'nope'"):
        shipped_dir("nope")


# --- data split and the CLI --------------------------------------------------------------------------
def test_prompt_split_is_by_id_and_disjoint():
    from vskipper.data import load

    train, held = split_prompts(load("prompts"))
    assert len(held) == 80 and len(train) == 320
    assert not {r["id"] for r in train} & {r["id"] for r in held}
    assert all(int(r["id"][1:]) % 5 == 0 for r in held)


class CharTokenizer:
    """Enough of a tokenizer for self_distillation: the chat template as text, one id per character."""

    pad_token_id, eos_token_id = 0, 1

    def apply_chat_template(self, turns, tokenize, add_generation_prompt):
        return "".join(f"<{t['role']}>{t['content']}" for t in turns) + "<assistant>"

    def __call__(self, text, add_special_tokens=False):
        return type("Enc", (), {"input_ids": [2 + ord(c) % (VOCAB - 2) for c in text]})()


def test_self_distillation_keeps_the_answers_of_an_interrupted_run(base, tmp_path):
    """Answers are kept batch by batch in a .partial file; a restart generates only the missing ones
    (a line cut short is generated again) and gives what an uninterrupted run gives."""
    from vskipper.training.data import generate_greedy, self_distillation

    tok = CharTokenizer()
    records = [{"id": f"p{i:03d}", "prompt": "abcdefghij"[: 3 + i % 7] * (1 + i % 2)} for i in range(10)]
    whole = self_distillation(base, tok, records, 5, tmp_path / "a", "tiny", batch_size=3)
    assert not list((tmp_path / "a").glob("*.partial"))
    prompts = [r["ids"][: r["n_prompt"]] for r in whole]
    seen = []
    generate_greedy(base, prompts, 5, 1, 0, 3, done={i: whole[i]["ids"][whole[i]["n_prompt"]:] for i in range(6)},
                    on_batch=lambda b: seen.extend(b))
    assert sorted(seen) == [6, 7, 8, 9]  # only what was not done
    path = next((tmp_path / "a").glob("generations-*.jsonl"))
    (tmp_path / "b").mkdir()
    partial = tmp_path / "b" / path.with_suffix(".partial").name
    lines = [json.dumps({"i": i, "new": whole[i]["ids"][whole[i]["n_prompt"]:]}) for i in (0, 4, 7)]
    partial.write_text("\n".join(lines) + '\n{"i": 9, "new": [3, 4')  # the last line cut short
    again = self_distillation(base, tok, records, 5, tmp_path / "b", "tiny", batch_size=3)
    assert again == whole and not partial.exists()


def test_max_prompts_keeps_every_kind_of_prompt():
    from vskipper.training.run import evenly_spaced

    items = [("chat", i) for i in range(60)] + [("fact", i) for i in range(30)] + [("arith", i) for i in range(10)]
    picked = evenly_spaced(items, 20)
    assert len(picked) == 20 and len(set(picked)) == 20 and picked[0] == items[0]
    assert [k for k, _ in picked].count("fact") == 6 and [k for k, _ in picked].count("arith") == 2
    assert evenly_spaced(items, 100) == items
    with pytest.raises(ValueError, match="max_prompts=0 must be a positive integer"):
        TrainConfig(layers=LAYERS, max_prompts=0)


@pytest.fixture
def model_dir(base, tmp_path):
    base.save_pretrained(tmp_path / "tiny")
    return tmp_path / "tiny"


@pytest.mark.parametrize("flags, message", [
    (["--layers", "4-9"], r"--layers: layer\(s\) \[6, 7, 8, 9\] do not exist in a model with 6 layers"),
    (["--layers", "x"], r"--layers='x': expected indices"),
    (["--penalty", "-1"], r"--penalty='-1' must be a finite number >= 0"),
    (["--penalty", "nan"], r"--penalty='nan' must be a finite number >= 0"),
    (["--penalty", "lots"], r"--penalty='lots' is not a number"),
    (["--target-skip", "1.5"], r"target_skip=1.5 must be a number in \(0, 1\)"),
    (["--steps", "0"], r"steps=0 must be a positive integer"),
    (["--resume"], r"--resume: .* has no saved training state"),
    (["--max-prompts", "0"], r"--max-prompts=0: expected a positive number of prompts"),
])
def test_cli_rejects_bad_input(model_dir, tmp_path, capsys, flags, message):
    from vskipper.cli import main

    with pytest.raises(SystemExit) as e:
        main(["train", "--out", str(tmp_path / "out"), "--model-path", str(model_dir), *flags])
    assert e.value.code == 2
    assert __import__("re").search(message, capsys.readouterr().err)


@pytest.mark.sglang
@pytest.mark.slow
def test_shipped_checkpoint_serves_in_sglang(tmp_path):
    """The shipped skipper joined with SmolLM2 by build_checkpoint: SGLang (DDLlamaForCausalLM)
    gives the greedy tokens of vskipper.from_pretrained + generate."""
    from transformers import AutoTokenizer

    from vskipper.data import load
    from vskipper.training.data import chat_ids
    from vskipper.training.shipped import build_checkpoint

    from sglang_util import engine
    from sglang_util import greedy as sgl_greedy

    path = build_checkpoint()
    tok = AutoTokenizer.from_pretrained(str(path))
    prompts = [torch.tensor(chat_ids(tok, r["prompt"])) for r in load("arithmetic")[:3]]
    hf = vskipper.from_pretrained(path)
    expected = []
    for p in prompts:
        with torch.no_grad():
            out = hf.generate(p[None], max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
        expected.append(out[0, len(p):].tolist())
    with engine(path) as eng:
        got, _ = sgl_greedy(eng, prompts, 12)
    assert got == expected
