"""Elastic depth's forecast (vskipper/elastic.py, Controller.forecast): the arrival rate, and the batch a
burst builds seen before its steps miss, on a simulated server (fake clock, steps priced by a known
truth, every request's TPOT measured)."""
from __future__ import annotations

import pytest

from vskipper.elastic import DWELL, STREAM, Controller, Target, ladder

from test_elastic import L, step_model

TARGET = 250.0


def burst(rate: float, seconds: float = 60.0, tell: bool = True, tokens: int = 32):
    """A server whose decode step costs 100 ms + 10 ms per row, less 1 ms per row and routed layer of
    budget (level 0's TPOT meets the 250 ms target up to about 1.9 req/s of 32-token requests, the top's
    up to 3.1), under arrivals every 1/rate s for `seconds`; new requests join the next step at the level
    `admit()` gives them. `tell`: the scheduler reports arrivals (without, the rule sees only steps).
    Returns the controller, each request's TPOT (ms), and (time, level, reason) at each change."""
    c = Controller(Target(tpot_ms=TARGET, period_s=1.0), ladder(L), step_model(), now=0.0)
    now, nxt, reqs, tpots, changes = 0.0, 0.0, [], [], []
    while now < seconds or reqs:
        while nxt <= now and nxt < seconds:
            if tell:
                c.arrive(nxt, tokens)
            reqs.append({"budget": c.budgets[c.admit()], "left": tokens, "steps": []})
            nxt += 1 / rate
        if not reqs:
            c.tick(now, [], 0)
            c.idle()
            now = nxt
            continue
        ms = 100.0 + sum(10.0 - q["budget"] for q in reqs)
        now += ms / 1e3
        c.decode_step(now, [q["budget"] for q in reqs])
        for q in reqs:
            q["left"] -= 1
            q["steps"].append(ms)
        tpots += [sum(q["steps"]) / len(q["steps"]) for q in reqs if not q["left"]]
        reqs = [q for q in reqs if q["left"]]
        before = c.level
        if c.tick(now, [q["budget"] for q in reqs], 0, [q["left"] for q in reqs]) and now < seconds:
            changes.append((now, before, c.level, c.reason))
    return c, tpots, changes


def test_rate_counts_the_arrivals_of_the_busy_spell_then_of_the_last_seconds():
    c = Controller(Target(tpot_ms=TARGET), ladder(L), step_model(), now=0.0)
    for i in range(80):  # 4 per second from t = 100 s, after a long idle
        c.arrive(100.0 + 0.25 * i, 32)
    assert c.rate(100.5) is None  # under a second of this spell
    assert c.rate(103.0) == pytest.approx(4.0)  # the spell's first arrival not counted: 12 in 3 s
    assert c.rate(119.9) == pytest.approx(4.0)  # the last 10 s: 40 arrivals
    assert c.rate(125.0) == pytest.approx(1.9)  # the last 10 s: 19 arrivals, then none
    c.tick(131.0, [], 0)  # idle: the next arrival starts a new spell
    c.arrive(200.0, 32)
    c.arrive(200.5, 32)
    assert c.rate(201.0) == pytest.approx(1.0)


def test_at_a_rate_level_0_can_hold_the_forecast_keeps_level_0():
    c, tpots, changes = burst(rate=1.0)
    assert not changes and max(tpots) < TARGET
    assert c.forecasts is None or c.forecasts[0] < TARGET


def test_the_forecast_rises_before_a_burst_misses_and_holds_while_it_lasts():
    """At 2.5 req/s level 0 cannot hold the target once the batch has built. With arrivals reported the
    rule rises while the steps still meet it, to a level that holds, and every request meets the target;
    seeing only the steps, it rises after they miss and the requests admitted meanwhile miss it."""
    c, tpots, changes = burst(rate=2.5)
    assert changes, "never rose"
    t, before, after, reason = changes[0]
    assert before == 0 and after > 0 and "forecast at " in reason, reason
    seen = float(reason.split("stream p90 TPOT ")[1].split(" ms")[0])
    assert seen < TARGET, reason  # the steps kept were still under the target
    assert changes[-1][2] > 0  # still up when the arrivals stop
    assert max(tpots) <= TARGET, max(tpots)
    _, blind, blind_changes = burst(rate=2.5, tell=False)
    assert blind_changes[0][0] > t + 2 * DWELL * 0.1  # later, by more than two decisions' worth of steps
    assert sum(x > TARGET for x in blind) > len(blind) // 10


def test_the_forecast_of_a_steady_load_is_its_measured_step():
    """Arrivals at a steady 1.5 req/s for a minute at level 0: the forecast of level 0 is the step the server
    runs now (the batch neither builds nor drains); deeper levels are cheaper."""
    c2 = Controller(Target(tpot_ms=TARGET, period_s=1.0), ladder(L), step_model(), now=0.0)
    # the server of burst(), at level 0, stopped inside its load: the forecast at 59 s
    now, reqs = 0.0, []
    for i in range(int(59 * 1.5)):
        t = i / 1.5
        while now < t and reqs:
            ms = 100.0 + 10.0 * len(reqs)
            now += ms / 1e3
            c2.decode_step(now, [0] * len(reqs))
            for q in reqs:
                q[0] -= 1
            reqs = [q for q in reqs if q[0]]
        c2.arrive(t, 32)
        reqs.append([32])
        now = max(now, t)
    recent = [ms for ms, *_ in list(c2.steps)[-STREAM:]]
    c2.saving.fit()
    fc = c2.forecast(now, [0] * len(reqs), [q[0] for q in reqs], 0)
    assert fc[0] == pytest.approx(sum(recent) / len(recent), rel=0.15)
    assert fc == sorted(fc, reverse=True) and fc[-1] < fc[0]
