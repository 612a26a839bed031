"""benchmarks/oracle.py and quality_oracle.py: the forward is the model's under given decisions, the oracle's
figures are those of an exact forward under its decisions, which skip generated tokens only and keep every
token's own next token, more with a larger budget; the scores read right."""
from __future__ import annotations

import pytest
import torch

import vskipper
from benchmarks.oracle import Oracle, Stack, fixed, kl_rows, score
from benchmarks.quality_oracle import router_decide, static_decide
from vskipper.reference import reference_forward

from helpers import assert_close
from tiny import flexidepth_for, tiny_llama

LAYERS = [2, 3, 4, 5]


def _seqs(stack, n=3, seed=4):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        S = int(torch.randint(9, 16, (1,), generator=g))
        out.append(stack.prepare(torch.randint(1, 101, (S,), generator=g).tolist(), S // 2))
    return out


def test_forward_under_decisions_is_the_reference():
    base = tiny_llama()
    plain = Stack(base, LAYERS)
    seqs = _seqs(plain)
    for s in seqs:  # every row RUN: the base model
        with torch.no_grad():
            want = torch.log_softmax(base(s.ids[None]).logits[0, s.scored], -1)
        assert_close(s.base_logp, want, "all RUN vs the base model")
    sk = vskipper.RandomSkip(0.5, LAYERS, seed=3)
    hard = flexidepth_for(base, LAYERS, gate="hard")
    for skipper, stack in ((sk, plain), (hard, Stack(base, LAYERS, hard))):
        for s in seqs:
            lp, runs, _ = stack.run(s, router_decide(skipper)(s))
            logits, dec, _ = reference_forward(base, skipper, s.ids)
            assert_close(lp, torch.log_softmax(logits[s.scored], -1), f"{type(skipper).__name__} vs the reference")
            assert all(torch.equal(runs[l], dec[l]) for l in LAYERS)


@pytest.mark.parametrize("adapters", [False, True])
def test_the_oracle_is_an_exact_forward_under_its_decisions(adapters):
    base = tiny_llama()
    hard = flexidepth_for(base, LAYERS, gate="hard")
    stack = Stack(base, LAYERS, hard if adapters else None)
    seqs = _seqs(stack, 4)
    taus = [0.0, 0.05, 0.3, 1e9]
    oracle = Oracle(stack, seqs, log=lambda m: None)
    got = oracle.run(taus)
    skips = [g["skip_generated"] for g in got]
    assert skips[0] == 0.0 and skips == sorted(skips) and skips[-1] > skips[1], skips
    assert all(g["skip_prompt"] == 0.0 for g in got)
    for k, g in enumerate(got):
        logps, runs = [], []
        for j, s in enumerate(seqs):
            rn = oracle.decisions[k * len(seqs) + j]
            assert all(r[~s.gen].all() for r in rn.values())  # the prompt and the last answer token run
            lp, _, _ = stack.run(s, fixed(rn))
            logps.append(lp)
            runs.append(rn)
            # a generated token that skipped a layer is within budget and keeps the base's next token
            skipped = torch.stack([~r[s.n:-1] for r in rn.values()]).any(0)  # [A - 1]: scored positions n..S-2
            assert (kl_rows(s.base_logp, lp)[1:][skipped] <= taus[k] + 1e-5).all()
            assert (lp.argmax(-1)[1:][skipped] == s.base_top[1:][skipped]).all()
        exact = score(seqs, logps, runs)
        for key in ("top1", "kl", "prefix", "skip_generated"):
            assert abs(exact[key] - g[key]) < 1e-4, (key, exact[key], g[key])


def test_scores_read_the_first_disagreement_and_the_skip_by_phase():
    base = tiny_llama()
    plain = Stack(base, LAYERS)
    s = _seqs(plain, 1)[0]
    A = s.base_logp.shape[0]
    lp = s.base_logp.clone()
    lp[2] = lp[2].roll(1)  # position 2's most likely token moves: the prefix is 2
    runs = static_decide([3])(s)
    sc = score([s], [lp], [{l: runs(l, None) for l in LAYERS}])
    assert sc["prefix"] == 2 and sc["identical"] == 0.0 and abs(sc["top1"] - (A - 1) / A) < 1e-6
    assert sc["skip_generated"] == 0.25 and sc["skip_prompt"] == 0.0
    assert score([s], [s.base_logp], [{l: torch.ones(len(s.ids), dtype=torch.bool) for l in LAYERS}])["prefix"] == A
