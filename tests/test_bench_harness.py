"""The serving benchmark's arithmetic, without servers: arrivals, throughput, knee search, table."""
import math

import pytest

from vskipper.bench import serving
from vskipper.bench.load import Result, poisson_schedule, throughput
from vskipper.bench.servers import System


def test_poisson_schedule_is_seeded_and_has_the_rate():
    ps = [f"p{i}" for i in range(7)]
    a = poisson_schedule(ps, 2.0, 4000, 16, seed=3)
    assert a == poisson_schedule(ps, 2.0, 4000, 16, seed=3)
    assert a != poisson_schedule(ps, 2.0, 4000, 16, seed=4)
    assert sorted(r.prompt for r in a) == sorted(ps[i % 7] for i in range(4000))  # every prompt, cycled
    assert a[-1].arrival / 4000 == pytest.approx(0.5, rel=0.05)  # mean gap 1 / rate
    assert all(r.arrival == 0 and r.max_new_tokens == 16 for r in poisson_schedule(ps, math.inf, 5, 16, 0))


def _res(start, end, n=10, ok=True):
    return Result(ok, 0.1, 0.01, end - start, n, start, end)


def test_throughput_counts_completed_tokens_over_the_span():
    assert throughput([_res(0, 2), _res(1, 4)]) == pytest.approx(20 / 4)
    assert throughput([_res(0, 2), _res(1, 9, ok=False)]) == pytest.approx(10 / 2)  # failed: not counted
    assert throughput([_res(0, 2, ok=False)]) == 0.0


def test_knee_is_the_last_rate_that_still_grows(monkeypatch):
    """Fake server: output tok/s = min(rate, 3 req/s) * tokens; saturation gives 3 req/s."""
    s = serving.Settings(requests=8, max_new_tokens=10, repeats=1, seed=0)

    def fake_load(url, reqs):
        gaps = reqs[-1].arrival
        rate = (len(reqs) - 1) / gaps if gaps > 0 else math.inf
        tp = min(rate, 3.0) * 10  # tok/s
        return [_res(0.0, 10 * len(reqs) / tp, n=10)] * len(reqs)

    monkeypatch.setattr(serving, "run_load", fake_load)
    monkeypatch.setattr(serving, "poisson_schedule", lambda ps, rate, n, t, seed: _even(rate, n, t))
    knee, curve = serving.find_knee(type("S", (), {"url": "x"})(), ["p"], s)
    rates = [r for r, _ in curve]
    assert rates == pytest.approx([f * 3.0 for f in serving.KNEE_FRACTIONS[:len(rates)]])
    assert knee == pytest.approx(3.0)  # 1.0x capacity: the next step (1.15x) no longer grows


def _even(rate, n, t):
    from vskipper.bench.load import Request

    return [Request("p", i / rate if math.isfinite(rate) else 0.0, t) for i in range(n)]


def test_table_has_deltas_against_upstream():
    systems = [System("upstream", "m"), System("vskipper", "m", "random:rate=0.5,layers=1")]
    loads = [("1.0x knee (2.00/s)", 2.0)]
    results = {loads[0][0]: {"upstream": [[_res(0, 2.0), _res(0, 2.0)]], "vskipper": [[_res(0, 1.5), _res(0, 1.5)]]}}
    table = serving.summarize(results, systems, loads)
    row = next(line for line in table.splitlines() if "| vskipper |" in line)
    assert "1.50 ± 0.00" in row and "-25.0%" in row and "+33.3%" in row
