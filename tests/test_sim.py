"""The scheduler simulator (vskipper/sim) against small cases computed by hand from SGLang 0.5.23's
scheduler (scheduler.py, schedule_policy.py, schedule_batch.py), and its metrics' definitions."""
import math

import numpy as np
import pytest

from vskipper.sim import Host, Request, ServerConfig, SimResult, StepModel, knee, simulate


def flat(decode_ms=10.0, e0=0.0, per_token=10.0, per_pair=0.0, per_row=0.0, per_ctx=0.0):
    """A step model with round numbers: decode `decode_ms` at any batch, extend e0 + per_token N + ..."""
    return StepModel("flat", {1: (decode_ms, per_ctx)}, {"e0": e0, "per_token": per_token, "per_pair": per_pair,
                                                         "per_row": per_row})


SERIAL, HIDDEN = Host(serial=True), Host(serial=False)


def test_one_request_serial_host_emits_a_step_late():
    """prompt 10, 5 tokens: prefill 100 ms, then 4 decode steps of 10 ms. With the host on the forward's core
    (a CPU) each step's tokens leave when the next step ends; the last two together."""
    r = simulate([Request(0.0, 10, 5, 5, True)], flat(per_token=10.0), SERIAL)
    assert r.ttft[0] == pytest.approx(0.11)
    assert r.e2e[0] == pytest.approx(0.14)
    assert np.allclose(sorted(r.itl), [0.0, 0.01, 0.01, 0.01])
    assert [int(k) for k in r.steps[:, 2]] == [1, 0, 0, 0, 0]
    assert r.tpot[0] == pytest.approx(0.03 / 4)


def test_one_request_hidden_host_and_ingress_egress():
    """On a GPU the host work hides behind the forward: tokens leave as their step ends; ingress and egress
    add to TTFT and e2e, not to the gaps."""
    r = simulate([Request(1.0, 10, 5, 5, True)], flat(), Host(serial=False, ingress_ms=5, egress_ms=2))
    assert r.ttft[0] == pytest.approx(0.005 + 0.1 + 0.002)
    assert r.e2e[0] == pytest.approx(0.005 + 0.14 + 0.002)
    assert np.allclose(r.itl, [0.01] * 4)


def test_two_requests_with_chunked_prefill():
    """--chunked-prefill-size 8, prompts 12 and 4 at once, 3 tokens each. Pass 1: A's first 8 tokens (its chunk
    ends the pass's budget). Pass 2: A's last 4 (prefix 8), then B's 4. Then both decode together."""
    cfg = ServerConfig(chunked_prefill_size=8)
    m = flat(per_token=10.0, per_pair=1.0)
    r = simulate([Request(0.0, 12, 3, 3, True), Request(0.0, 4, 3, 3, True)], m, SERIAL, cfg)
    pre = r.steps[r.steps[:, 2] == 1]
    assert [(int(rows), int(tok)) for rows, tok in pre[:, 3:5]] == [(1, 8), (2, 8)]
    # attention pairs: 8 * (0 + 4.5) = 36; then 4 * (8 + 2.5) + 4 * (0 + 2.5) = 52
    assert pre[:, 1] == pytest.approx([0.08 + 0.036, 0.08 + 0.052])
    end_p2 = 0.116 + 0.132
    assert r.ttft == pytest.approx([end_p2 + 0.01] * 2)  # emitted as the first decode step ends
    assert r.e2e == pytest.approx([end_p2 + 0.02] * 2)
    dec = r.steps[r.steps[:, 2] == 0]
    assert list(dec[:, 3]) == [2, 2]


def test_chunked_request_holds_decode_back():
    """A long prompt chunked over several passes runs ahead of decode: the running request gets no token
    while the chunks run (no mixed chunks, SGLang's default)."""
    cfg = ServerConfig(chunked_prefill_size=16)
    reqs = [Request(0.0, 4, 20, 20, True), Request(0.05, 64, 2, 2, True)]
    r = simulate(reqs, flat(per_token=1.0), HIDDEN, cfg)
    kinds = [int(k) for k in r.steps[:, 2]]
    first = kinds.index(1, 1)  # the long prompt's first chunk
    assert kinds[first:first + 4] == [1, 1, 1, 1]  # 64 tokens in 4 chunks of 16, back to back
    assert r.itl.max() == pytest.approx(4 * 0.016 + 0.01)


def test_kv_full_retracts_the_request_with_fewest_tokens():
    """--max-total-tokens 100, two requests of prompt 10 and 60 tokens ending by length but sent without
    ignore_eos (so the running ones reserve ratio x their rest; ratio 0.1 here): both are admitted, and at
    decode step 40 the pool (20 + 2 x 40 tokens) has no room for the step's 2 tokens: B (admitted last, as
    many tokens as A, retracted first by SGLang's order) is retracted and waits until A finishes."""
    cfg = ServerConfig(max_total_tokens=100, init_new_token_ratio=0.1)
    a, b = Request(0.0, 10, 60, 60, False), Request(0.0, 10, 60, 60, False)
    r = simulate([a, b], flat(per_token=1.0), HIDDEN, cfg)
    assert r.retractions == 1
    dec = r.steps[r.steps[:, 2] == 0]
    assert list(dec[:40, 3]) == [2] * 40 and dec[40, 3] == 1
    pre = r.steps[r.steps[:, 2] == 1]
    assert [int(x) for x in pre[:, 4]] == [10, 10, 10 + 41]  # B again: its prompt and its 41 tokens so far
    assert r.e2e[0] < r.e2e[1]
    assert pre[2, 0] >= r.e2e[0] - 1e-9  # B's second prefill only after A is done
    check_token_accounting(r)


def test_max_running_requests_caps_the_batch():
    cfg = ServerConfig(max_running_requests=2)
    reqs = [Request(0.0, 4, 3, 3, True) for _ in range(4)]
    r = simulate(reqs, flat(per_token=1.0), HIDDEN, cfg)
    assert r.steps[:, 3].max() == 2
    pre = r.steps[r.steps[:, 2] == 1]
    assert list(pre[:, 3]) == [2, 2]
    assert min(r.ttft[2:]) > max(r.e2e[:2]) - 1e-9  # the next two start once the first two are done


def test_fcfs_order():
    """With room for one request at a time, first tokens come in arrival order, shorter prompts later
    included."""
    cfg = ServerConfig(max_running_requests=1)
    reqs = [Request(0.0, 50, 4, 4, True), Request(0.001, 5, 4, 4, True), Request(0.002, 40, 4, 4, True),
            Request(0.003, 2, 4, 4, True)]
    r = simulate(reqs, flat(per_token=1.0), HIDDEN, cfg)
    first = r.arrival + r.ttft
    assert list(np.argsort(first)) == [0, 1, 2, 3]


def test_prefill_runs_ahead_of_decode_and_budget_admits_several():
    """A request arriving while another decodes is prefilled before the next decode step; requests arriving
    together share one prefill step within --max-prefill-tokens and the chunk budget."""
    reqs = [Request(0.0, 10, 10, 10, True), Request(0.035, 10, 2, 2, True)] + [Request(0.2, 10, 2, 2, True)] * 3
    r = simulate(reqs, flat(per_token=1.0), HIDDEN)
    kinds = [int(k) for k in r.steps[:, 2]]
    starts = r.steps[:, 0]
    second = next(i for i in range(1, len(kinds)) if kinds[i] == 1)
    assert starts[second] == pytest.approx(0.04)  # the first decode step after its arrival is a prefill
    assert r.steps[-1 if kinds[-1] == 1 else [i for i, k in enumerate(kinds) if k == 1][-1], 3] == 3


def check_token_accounting(r: SimResult):
    """Every gap of every request is in ITL once: counts and sums match TTFT / e2e."""
    assert len(r.itl) == int((r.output - 1).sum())
    assert r.itl.sum() == pytest.approx((r.e2e - r.ttft).sum())
    assert (r.itl >= -1e-12).all()


def test_metrics_definitions_on_a_busy_trace():
    from vskipper.sim import Workload, poisson

    w = Workload("uniform:5-60", "uniform:2-40", ignore_eos=True)
    reqs = w.requests(poisson(30.0, n=400, seed=3), seed=3)
    m = StepModel("m", {1: (5.0, 1e-3), 8: (8.0, 1e-3), 64: (20.0, 5e-4)},
                  {"e0": 3.0, "per_token": 0.05, "per_pair": 1e-4, "per_row": 0.5})
    for host in (Host(serial=True, decode_ms=(1.0, 0.05), egress_ms=1.0), HIDDEN):
        r = simulate(reqs, m, host)
        check_token_accounting(r)
        s = r.summary()
        assert s["completed"] == 400
        assert s["output_tps"] == pytest.approx(sum(q.output for q in reqs) / r.duration)
        assert r.duration == pytest.approx(max(q.arrival + e for q, e in zip(sorted(reqs, key=lambda q: q.arrival),
                                                                          r.e2e)))
        tp = [(e - t) / (o - 1) for e, t, o in zip(r.e2e, r.ttft, r.output) if o > 1]
        assert s["tpot_mean"] == pytest.approx(np.mean(tp) * 1e3)
        assert s["ttft_p90"] == pytest.approx(np.percentile(r.ttft, 90) * 1e3)
        assert 1 <= s["mean_batch"] <= 64
        assert math.isfinite(s["itl_p99"])


def test_requests_sorted_and_outputs_in_arrival_order():
    reqs = [Request(0.5, 10, 3, 3, True), Request(0.0, 10, 7, 7, True)]
    r = simulate(reqs, flat(), HIDDEN)
    assert list(r.arrival) == [0.0, 0.5] and list(r.output) == [7, 3]


def test_knee_definition():
    assert knee([1, 2, 3, 4, 5], [100, 200, 205, 202, 300]) == 5
    assert knee([1, 2, 3, 4], [100, 200, 201, 201.5]) == 2  # 201 beats 200 by 0.5% only
    assert knee([1, 2, 3], [100, 99, 101]) == 3  # 101 >= 1.01 x 100, the running maximum
    with pytest.raises(ValueError, match="increase"):
        knee([2, 1], [1, 2])


def test_bad_input():
    with pytest.raises(ValueError, match="no requests"):
        simulate([], flat())
    with pytest.raises(ValueError, match="never be admitted"):
        simulate([Request(0.0, 90, 20, 20, True)], flat(), HIDDEN, ServerConfig(max_total_tokens=100))
    with pytest.raises(ValueError, match="output=5 is over max_new_tokens=4"):
        Request(0.0, 3, 5, 4)
    with pytest.raises(ValueError, match="ignore_eos"):
        Request(0.0, 3, 3, 4, True)
    with pytest.raises(ValueError, match="arrival"):
        Request(-1.0, 3, 3, 4)
