"""Training towards a skip on generated tokens: the penalty and target over the answer's generated tokens,
the prompt's tokens a term (or target) of their own; resumable as before."""
from __future__ import annotations

import json
import math

import pytest
import torch

from vskipper.training import TrainConfig, skip_forward
from vskipper.training.data import build_targets, generated

from training_util import LAYERS, sequences, tiny_base, trainer


@pytest.fixture(scope="module")
def base():
    return tiny_base()


@pytest.fixture(scope="module")
def data(base):
    seqs = sequences()
    d = build_targets(base, seqs, start_layer=min(LAYERS), topk=16)
    d.n_prompt = torch.tensor([len(s) // 2 for s in seqs])  # the first half of each sequence is its prompt
    return d


def test_generated_positions_are_the_answer_tokens_fed_back():
    assert generated(3, 7).tolist() == [False, False, False, True, True, True, False]
    assert not generated(5, 5).any() and not generated(4, 5).any()  # no answer, or one token never fed back


def test_the_generated_penalty_counts_the_answer_and_the_prompt_apart(base, data):
    t = trainer(base, data, target_tokens="generated", penalty=1.0, prompt_penalty=0.5)
    idx = [0, 1, 2, 3]
    with torch.no_grad():
        total, parts = t.losses(idx, 1.0, 0.5)
        ids, valid, hidden, rows = t.batch(idx)
        out = skip_forward(base, t.skipper, ids, start_hidden=hidden, start_layer=min(LAYERS))
    gen = torch.cat([generated(int(data.n_prompt[i]), len(data.ids[data.rows(i)])) for i in idx])
    usage = torch.stack([out.gates[l][valid] for l in LAYERS]).float().mean(0)
    run = torch.stack([out.run[l][valid] for l in LAYERS]).float()
    assert math.isclose(parts["penalty"], float(usage[gen].pow(2).mean()), rel_tol=1e-5)
    assert math.isclose(parts["penalty_prompt"], float(usage[~gen].pow(2).mean()), rel_tol=1e-5)
    assert math.isclose(float(total), parts["main"] + parts["penalty"] + 0.5 * parts["penalty_prompt"], rel_tol=1e-5)
    assert parts["tokens_generated"] == int(gen.sum()) and parts["tokens_prompt"] == int((~gen).sum())
    assert math.isclose(parts["skip_generated"], 1 - float(run[:, gen].mean()), abs_tol=1e-6)
    assert math.isclose(parts["skip_prompt"], 1 - float(run[:, ~gen].mean()), abs_tol=1e-6)
    whole = trainer(base, data, penalty=1.0)  # target_tokens "all": one term over every token, kinds still logged
    with torch.no_grad():
        total, parts = whole.losses(idx, 1.0)
    assert math.isclose(parts["penalty"], float(usage.pow(2).mean()), rel_tol=1e-5) and "penalty_prompt" not in parts
    assert parts["skip_generated"] is not None


def test_targets_steer_each_weight_by_its_own_tokens(base, data):
    t = trainer(base, data, target_tokens="generated", penalty=1.0, target_skip=0.6, prompt_penalty=1.0,
                prompt_target_skip=0.01, target_rate=0.5, steps=6)
    t.run(log=lambda s: None)
    assert t.penalty_weight > 1.0  # the answer skips less than 0.6: its weight grows
    assert t.prompt_penalty_weight < 1.0  # the prompt skips more than 1%: its weight falls
    assert [h["prompt_penalty_weight"] for h in t.history][0] == 1.0
    assert all(h["skip_generated"] is not None for h in t.history)


def test_resume_keeps_the_prompt_weight_and_reads_states_saved_before_it(base, data, tmp_path):
    kw = dict(target_tokens="generated", penalty=0.5, target_skip=0.3, prompt_penalty=0.2, prompt_target_skip=0.1,
              steps=6)
    straight = trainer(base, data, **kw)
    straight.run(log=lambda s: None)
    first = trainer(base, data, **kw)
    first.run(until=3, log=lambda s: None)
    first.save_state(tmp_path / "state")
    resumed = trainer(base, data, **kw)
    resumed.load_state(tmp_path / "state")
    resumed.run(log=lambda s: None)
    assert resumed.prompt_penalty_weight == straight.prompt_penalty_weight
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in straight.history]
    old = trainer(base, data, penalty=0.5, steps=6)  # a state written before target_tokens and prompt_* existed
    old.run(until=2, log=lambda s: None)
    old.save_state(tmp_path / "old")
    meta = json.loads((tmp_path / "old" / "state.json").read_text())
    for k in ("target_tokens", "prompt_penalty", "prompt_target_skip"):
        del meta["config"][k]
    del meta["prompt_penalty_weight"]
    (tmp_path / "old" / "state.json").write_text(json.dumps(meta))
    again = trainer(base, data, penalty=0.5, steps=6)
    again.load_state(tmp_path / "old")
    assert again.step == 2
    with pytest.raises(ValueError, match="different settings.*target_tokens"):
        trainer(base, data, target_tokens="generated", penalty=0.5, steps=6).load_state(tmp_path / "old")


def test_bad_settings_name_the_field(base):
    for kw, msg in ((dict(target_tokens="answers"), "target_tokens='answers' must be one of"),
                    (dict(prompt_penalty=0.3), "prompt_penalty and prompt_target_skip are the prompt tokens' own"),
                    (dict(target_tokens="generated", prompt_target_skip=0.2), "needs a starting prompt_penalty > 0"),
                    (dict(target_tokens="generated", prompt_penalty=float("nan")), "prompt_penalty=nan must be a"),
                    (dict(target_tokens="generated", prompt_penalty=-1.0, prompt_target_skip=0.1),
                     "needs a starting prompt_penalty > 0"),
                    (dict(target_tokens="generated", prompt_penalty=1.0, prompt_target_skip=1.5),
                     r"prompt_target_skip=1.5 must be a number in \(0, 1\)")):
        with pytest.raises(ValueError, match=msg):
            TrainConfig(layers=LAYERS, **kw)
    no_lengths = build_targets(base, sequences(4), start_layer=min(LAYERS), topk=8)
    with pytest.raises(ValueError, match="needs the data's prompt lengths"):
        trainer(base, no_lengths, target_tokens="generated")
