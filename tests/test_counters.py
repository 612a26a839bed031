"""Route counts by phase: prompt tokens (prefill) apart from generated tokens (decode), in
vskipper.stats, the SGLang stats line and the hook that tells the counters the phase."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import vskipper
from vskipper.counters import DECODE, PREFILL, Phase, RouteCounter, SublayerRouteCounter, skipped_share

from helpers import greedy, left_pad, prompts
from tiny import tiny_llama, transformed


@pytest.mark.parametrize("body", ["dense", "routed"])
def test_generate_counts_the_prompt_as_prefill_and_fed_back_tokens_as_decode(body):
    """A padded batch of three prompts, 6 new tokens: per layer the prefill rows are the prompts' real
    tokens, the decode rows the 5 generated tokens fed back per sequence; their decisions are the
    reference's (RandomSkip is a pure function of layer, position and token id)."""
    from vskipper.reference import reference_generate

    base = tiny_llama()
    sk = vskipper.RandomSkip(0.5, [1, 3, 4], seed=2)
    m = transformed(base, sk, body)
    seqs = prompts((5, 11, 1))
    one = greedy(m, seqs[0][None], None, 6)  # one sequence: no padding, positions as the reference's
    st = vskipper.stats(m, reset=True)
    _, dec = reference_generate(base, sk, seqs[0], 6)
    assert one.shape[1] == 11
    n = len(seqs[0])
    for l in sk.layers:
        s, d = st[l], dec[l]
        assert s["prefill_tokens"] == n and s["decode_tokens"] == 5 and s["tokens"] == n + 5, s
        assert s["prefill_project"] == int((~d[:n]).sum()) and s["decode_project"] == int((~d[n:]).sum()), s
        assert s["project"] == s["prefill_project"] + s["decode_project"]
        assert s["run"] == s["prefill_run"] + s["decode_run"]
    ids, mask = left_pad(seqs)
    greedy(m, ids, mask, 6)
    for s in vskipper.stats(m).values():
        assert s["prefill_tokens"] == sum(len(p) for p in seqs) and s["decode_tokens"] == 3 * 5, s
    with torch.no_grad():  # a forward over whole sequences is a prefill, whatever came before
        m(ids, attention_mask=mask)
    for s in vskipper.stats(m).values():
        assert s["prefill_tokens"] == 2 * sum(len(p) for p in seqs) and s["decode_tokens"] == 3 * 5, s


def test_counters_share_the_models_phase_and_sublayer_counts_split_too():
    m = transformed(tiny_llama(), vskipper.RandomSkip(0.5, [1, 2]), "dense")
    state = m.vskipper
    assert all(c.phase is state.phase for c in state.counters.values())
    phase = Phase()
    c = SublayerRouteCounter(phase)
    run = torch.tensor([[True, False], [False, False], [True, True]])
    valid = torch.tensor([True, True, False])
    c(run, valid, None)
    phase.set(DECODE)
    c(run, valid, torch.tensor([[False, True], [False, False], [True, True]]))
    r = c.read()
    assert (r["prefill_tokens"], r["prefill_attention_run"], r["prefill_mlp_skip"]) == (2, 1, 2)
    assert r["prefill_nonfinite"] == 0
    assert (r["decode_tokens"], r["decode_run"], r["decode_project"], r["decode_nonfinite"]) == (2, 1, 3, 1)
    assert r["tokens"] == 4 and r["project"] == 6 and r["nonfinite"] == 1
    with pytest.raises(ValueError, match="phase=2"):
        phase.set(2)


def test_skipped_share_per_phase():
    c = RouteCounter()
    c(torch.tensor([True, False, False, False]), torch.ones(4, dtype=torch.bool), None)
    st = {7: c.read()}
    assert skipped_share(st) == 0.75 and skipped_share(st, "prefill") == 0.75
    assert skipped_share(st, "decode") is None  # no generated token counted
    c.phase.set(DECODE)
    c(torch.tensor([True, True]), torch.ones(2, dtype=torch.bool), None)
    st = {7: c.read()}
    assert skipped_share(st) == 0.5 and skipped_share(st, "decode") == 0.0
    c.phase.set(PREFILL)
    with pytest.raises(ValueError, match="phase='answer'"):
        skipped_share(st, "answer")


def test_stats_line_says_each_phase():
    from vskipper.integrations.sglang.runtime import format_stats

    c = RouteCounter()
    c(torch.tensor([True, False, False, False]), torch.ones(4, dtype=torch.bool), None)
    line = format_stats({3: c.read()})
    assert line.startswith("skip ratio 0.750 over 4 routed-layer tokens (prefill 0.750 over 4, decode - over 0)"), line


def test_the_batch_hook_sets_the_phase_from_the_forward_mode():
    pytest.importorskip("sglang")
    from vskipper.integrations.sglang.requests import after_forward_batch_init

    class Runner:  # the budgets' registry holds runners by weak reference
        model = transformed(tiny_llama(), vskipper.RandomSkip(0.5, [1, 2]), "dense")

    runner, m = Runner(), Runner.model
    for decode, want in ((True, [0, 1]), (False, [1, 0])):
        fb = SimpleNamespace(forward_mode=SimpleNamespace(is_decode=lambda d=decode: d))
        assert after_forward_batch_init(fb, None, SimpleNamespace(), runner) is fb
        assert m.vskipper.phase.onehot.tolist() == want
