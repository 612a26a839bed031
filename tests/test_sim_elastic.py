"""Elastic depth in the simulator (vskipper/sim/elastic.py): the server's controller driven unchanged by the
simulated scheduler, a level priced as its rows' budgets, the candidate rule, and the rules' benchmark."""
import json
import math
import time

import numpy as np
import pytest

from vskipper.elastic import Controller, Target, ladder
from vskipper.sim import Host, Request, ServerConfig, StepModel, StepTables, Workload, poisson, simulate
from vskipper.sim.elastic import Capacity, LevelSteps, Pinned, Predictive, simulate_elastic, stream_tpot_p90
from vskipper.sim.plan import TABLES_DIR

L = 4  # routed layers
BUDGETS = ladder(L)  # (0, 1, 2, 3, 4)


def flat(name: str, decode_ms: float, per_token: float = 1.0, run_fraction: float = 1.0) -> StepModel:
    return StepModel(name, {1: (decode_ms, 0.0)}, {"e0": 0.0, "per_token": per_token, "per_pair": 0.0, "per_row": 0.0},
                     {"decode": run_fraction, "extend": run_fraction})


# upstream's decode step 100 ms, the skipper alone's 50 ms (it RUNs half the routed-layer work)
LEVELS = LevelSteps(flat("upstream", 100.0), flat("skipper", 50.0, 0.5, run_fraction=0.5), L, Host(), Host())


class Fixed:
    """A rule that admits at one level from `at` s on (level 0 before), and records what it is fed."""

    def __init__(self, level: int, at: float = 0.0):
        self.budgets, self.want, self.at = BUDGETS, level, at
        self.level, self.calls = (level if at <= 0 else 0), []

    def admit(self):
        return self.level

    def decode_step(self, now, budgets, prefill=False, context=0):
        self.calls.append(("decode", now, list(budgets), context))

    def prefill(self):
        self.calls.append(("prefill",))

    def first_token(self, seconds):
        self.calls.append(("first", seconds))

    def idle(self):
        self.calls.append(("idle",))

    def tick(self, now, running, waiting):
        self.calls.append(("tick", now, len(running), waiting))
        new = self.want if now >= self.at else 0
        changed, self.level = new != self.level, new
        return changed


def reqs(n=6, gap=0.05, prompt=10, out=9):
    return [Request(i * gap, prompt, out, out, True) for i in range(n)]


def test_level_0_is_upstream_exactly_and_the_top_is_the_skipper_alone():
    cfg = ServerConfig()
    w = Workload("uniform:5-40", "uniform:2-30", ignore_eos=True)
    trace = w.requests(poisson(8.0, n=60, seed=1), seed=1)
    up = simulate(trace, LEVELS.base, Host(), cfg)
    at0 = simulate_elastic(trace, LEVELS, Fixed(0), cfg).result
    assert np.array_equal(up.e2e, at0.e2e) and np.array_equal(up.ttft, at0.ttft)
    sk = simulate(trace, LEVELS.skipper, Host(), cfg)
    top = simulate_elastic(trace, LEVELS, Fixed(len(BUDGETS) - 1), cfg)
    assert np.allclose(sk.e2e, top.result.e2e) and np.allclose(sk.ttft, top.result.ttft)
    assert top.skipped()["all"] == pytest.approx(0.5) and simulate_elastic(trace, LEVELS, Fixed(0), cfg).skipped() == {
        "all": 0.0, "decode": 0.0}


def test_a_level_prices_its_rows_budgets_and_counts_what_they_skip():
    """One request at level 2 (budget 2 of 4): every decode step 100 - 2/4 x 50 = 75 ms, its prefill of 10
    tokens 10 - 2/4 x 5 = 7.5 ms; it skips 2/4 x 0.5 = 25% of its routed-layer work."""
    er = simulate_elastic([Request(0.0, 10, 5, 5, True)], LEVELS, Fixed(2), ServerConfig())
    steps = er.result.steps
    assert np.allclose(steps[steps[:, 2] == 0][:, 1], 0.075)
    assert np.allclose(steps[steps[:, 2] == 1][:, 1], 0.0075)
    assert er.budgets.tolist() == [2.0]
    assert er.skipped() == pytest.approx({"all": 0.25, "decode": 0.25})


def test_the_rule_is_fed_what_the_server_feeds_it():
    """Each decode step's end with one budget per row and the rows' context; a prefill before the gap it
    lengthens; each first token once; ticks after every step with the running rows and the queue; idle at the end."""
    rule = Fixed(3, at=0.001)
    er = simulate_elastic(reqs(), LEVELS, rule, ServerConfig())
    decodes = [c for c in rule.calls if c[0] == "decode"]
    steps = er.result.steps
    dec = steps[steps[:, 2] == 0]
    assert len(decodes) == len(dec)
    ends = dec[:, 0] + dec[:, 1]
    assert np.allclose([c[1] for c in decodes], ends)
    assert [len(c[2]) for c in decodes] == [int(r) for r in dec[:, 3]]
    assert all(c[3] > 0 for c in decodes)
    assert sum(c[0] == "first" for c in rule.calls) == 6
    assert sum(c[0] == "prefill" for c in rule.calls) == int((steps[:, 2] == 1).sum())
    assert sum(c[0] == "tick" for c in rule.calls) == len(steps)
    assert rule.calls[-2][0] == "idle" and rule.calls[-1][:1] == ("tick",) and rule.calls[-1][2:] == (0, 0)
    # the first request is admitted before the rule's first tick: level 0; the later ones at level 3
    assert er.budgets[0] == 0 and set(er.budgets[1:].tolist()) == {3.0}


def test_a_request_keeps_the_level_it_was_admitted_at():
    rule = Fixed(4, at=0.2)
    er = simulate_elastic(reqs(n=8, gap=0.1), LEVELS, rule, ServerConfig())
    first = {}
    for t0, b in zip(er.result.arrival, er.budgets):
        first.setdefault(b, t0)
    assert set(er.budgets.tolist()) == {0.0, 4.0} and first[4.0] > first[0.0]
    assert np.all(np.diff(er.budgets) >= 0)  # FCFS: once the level rose, every later request has it


def overload(rate=30.0, n=400, seed=0):
    return Workload("fixed:1", "fixed:40", ignore_eos=True).requests(poisson(rate, n=n, seed=seed), seed=seed)


def test_the_servers_controller_rises_under_overload_and_returns_to_level_0_when_idle():
    """The real vskipper.elastic.Controller: with upstream's steps at 100 ms over a 70 ms target it goes up
    (the skipper alone runs 50 ms), its later requests skip, and the idle end takes it back to level 0."""
    c = Controller(Target(70.0), BUDGETS, LEVELS.prior(30.0), 0.0)
    er = simulate_elastic(overload(), LEVELS, c, ServerConfig())
    assert er.changes and er.changes[0][1] > 0 and er.changes[-1][1] == 0 and c.level == 0
    assert er.budgets[:5].tolist() == [0.0] * 5 and er.budgets.max() == 4.0
    assert 0.25 < er.skipped()["all"] <= 0.5
    assert stream_tpot_p90(er.result) < stream_tpot_p90(simulate(overload(), LEVELS.base, Host(), ServerConfig()))


def test_the_predictive_rule_takes_the_lowest_level_predicted_within_the_band():
    """Flat steps: level j's step is 100 - 12.5 j ms; target 80 x margin 0.9 = 72 ms -> level 3 (62.5 ms)."""
    p = Predictive(Target(80.0), BUDGETS, LEVELS.decode_ms, 0.0, margin=0.9, hysteresis=0.9)
    er = simulate_elastic(overload(), LEVELS, p, ServerConfig())
    assert er.changes[0][1] == 3 and er.changes[-1][1] == 0
    assert set(er.budgets.tolist()) <= {0.0, 3.0}
    # down only to a level predicted within hysteresis x the band: 0.9 x 72 = 64.8 ms -> level 3, not 2
    q = Predictive(Target(80.0), BUDGETS, LEVELS.decode_ms, 0.0, margin=0.9, hysteresis=0.9)
    q.level = 4
    q.decode_step(0.0, [4] * 8, context=80)
    q.decode_step(0.05, [4] * 8, context=80)
    assert q.tick(2.0, [4] * 8, 0) and q.level == 3
    with pytest.raises(ValueError, match="hysteresis"):
        Predictive(Target(80.0), BUDGETS, LEVELS.decode_ms, 0.0, hysteresis=1.5)


def test_elastic_simulation_of_ten_minutes_at_50_per_second_is_fast():
    """The simulator's speed target holds with the server's controller in the loop (H200 tables, GSM8K-like)."""
    t = StepTables.load(TABLES_DIR / "h200-llama3-8b.json")
    lv = LevelSteps.from_tables(t, "ideal0.5", 16)
    w = Workload("normal:mean=492,sd=32,min=450,max=644", "lognormal:mean=150,sd=70,min=16,max=512", max_new_tokens=512)
    trace = w.requests(poisson(50.0, duration=600.0, seed=0), seed=0)
    c = Controller(Target(40.0), ladder(16), lv.prior(560.0), 0.0)
    t0 = time.process_time()
    er = simulate_elastic(trace, lv, c, ServerConfig.from_flags(t.server), record_batches=False)
    took = time.process_time() - t0
    assert er.result.summary()["completed"] == len(trace) > 29_000
    assert took < 10.0, f"{took:.1f} s of CPU"


def test_rules_benchmark_smoke(tmp_path):
    from benchmarks.sim import elastic_rules

    elastic_rules.main(["--smoke", "--out", str(tmp_path), "--models", "cpu"])
    first = json.loads((tmp_path / "results.json").read_text())["results"]["results"]["cpu"]
    elastic_rules.main(["--smoke", "--out", str(tmp_path), "--resume"])  # keeps cpu, runs the others
    rec = json.loads((tmp_path / "results.json").read_text())
    assert rec["results"]["resumed"] == ["cpu"] and rec["results"]["results"]["cpu"] == first
    assert rec["name"] == "sim-elastic-rules" and "Simulated, not measured" in rec["table"]
    for key in ("cpu", "h200"):
        res = rec["results"]["results"][key]
        assert res["calibration"]["R"] > 0 and res["calibration"]["target_ms"] > 0
        assert set(res["verdicts"]) == set(elastic_rules.RULES)
        assert res["cells"]["upstream"]["1.0"]["skip"][0] == 0.0
        assert res["cells"]["fixed"]["1.0"]["skip"][0] > 0.3
        caps = res["capacity"]
        assert len(caps) == 5 and caps[0] == res["calibration"]["R"]


def feed(p: Predictive, now: float, n: int, gap_ms: float, budgets) -> float:
    for _ in range(n):
        now += gap_ms / 1e3
        p.decode_step(now, budgets, context=80)
    return now


def test_the_adaptive_band_tightens_while_the_streams_miss_and_loosens_while_they_meet():
    """Steps of 100 ms priced at 100 (ratio 1) over a target of 80: the streams miss, so the band shrinks (to no
    less than SCALE's floor); then 40 ms steps: it grows again."""
    p = Predictive(Target(80.0), BUDGETS, LEVELS.decode_ms, 0.0, margin=1.0, adapt=True)
    now = feed(p, 0.0, 1, 100.0, [0] * 8)
    now = feed(p, now, 64, 100.0, [0] * 8)
    scales = []
    for _ in range(5):
        now = feed(p, now, 10, 100.0, [0] * 8)
        p.tick(now, [0] * 8, 0)
        scales.append(p.scale)
    assert scales == sorted(scales, reverse=True) and Predictive.SCALE[0] <= scales[-1] < 1.0
    assert scales[0] == pytest.approx((0.95 * 80 / 100) ** Predictive.GAIN)
    p.level = 0
    now = feed(p, now, Predictive.WINDOW, 40.0, [0] * 8)
    p.tick(now + 1.0, [0] * 8, 0)
    assert p.scale > scales[-1]


def test_the_smoothed_rows_move_by_a_streams_lifetime_not_a_spike():
    """A spike from 8 to 80 rows for one period barely moves the smoothed rows (a lifetime of 32 x 100 ms)."""
    p = Predictive(Target(80.0), BUDGETS, LEVELS.decode_ms, 0.0, margin=1.0, smooth=True)
    now = feed(p, 0.0, 20, 100.0, [0] * 8)
    p.tick(now, [0] * 8, 0)
    p.tick(now + 1.0, [0] * 8, 72)
    assert 8 < p.rows < 8 + 72 * (1 - math.exp(-1.0 / 3.2)) + 1e-9


CAPS = (10.0, 11.0, 12.0, 13.0, 14.0)  # req/s each level holds the target to


def arrive(rule: Capacity, rate: float, seconds: float, now: float = 0.0, queued: int = 0) -> tuple[float, list[int]]:
    """Requests every 1 / rate s from `now`, each admitted as it comes, a tick halfway to the next (where the
    decaying count of evenly spaced arrivals reads their rate); returns (the last arrival, their levels)."""
    levels = []
    for _ in range(round(rate * seconds)):
        now += 1.0 / rate
        levels.append(rule.admit())
        rule.tick(now + 0.5 / rate, [], queued)
    return now, levels


def test_the_rate_is_what_arrived_admitted_or_queued():
    """Admitted requests and the queue's growth both count; the first seconds read the rate, not a low one."""
    rule = Capacity(Target(80.0), BUDGETS, CAPS, 0.0, tau_s=5.0)
    now, _ = arrive(rule, 8.0, 2.0)
    assert rule.rate() == pytest.approx(8.0, rel=0.02)
    for k in range(1, 41):  # 20 a second that wait: the queue grows by one every 0.05 s
        rule.tick(now + 0.05 * k, [], k)
    assert 12.0 < rule.rate() < 20.0
    arrive(rule, 20.0, 30.0, now + 2.0, queued=40)  # as many admitted as arrive: the queue holds at 40
    assert rule.rate() == pytest.approx(20.0, rel=0.02)


def test_the_rate_keyed_rule_reads_the_level_off_the_capacity_table_and_mixes_the_two_around_it():
    """z 0, slope 1: 11.5 req/s is halfway from level 1's capacity to level 2's: half the requests at each.
    (The arrivals are counted at the ticks: the rate reads 0.5 / tau_s high, 0.005 here.)"""
    rule = Capacity(Target(80.0), BUDGETS, CAPS, 0.0, tau_s=100.0, z=0.0, slope=1.0)
    _, levels = arrive(rule, 11.5, 600.0)
    tail = levels[-200:]
    assert rule.level == 1 and set(tail) == {1, 2} and tail.count(2) == pytest.approx(100, abs=3)
    _, levels = arrive(Capacity(Target(80.0), BUDGETS, CAPS, 0.0, tau_s=5.0, z=0.0, slope=1.0), 9.0, 30.0)
    assert set(levels) == {0}
    top = Capacity(Target(80.0), BUDGETS, CAPS, 0.0, tau_s=5.0, z=0.0, slope=1.0)
    _, levels = arrive(top, 30.0, 20.0)
    assert top.level == 4 and set(levels[-100:]) == {4}
    # slope 3: 10.5 req/s is level 0.5 on the table, 1.5 after it
    steep = Capacity(Target(80.0), BUDGETS, CAPS, 0.0, tau_s=100.0, z=0.0, slope=3.0)
    _, levels = arrive(steep, 10.5, 600.0)
    assert steep.level == 1 and levels[-200:].count(2) == pytest.approx(100, abs=5)
    assert steep.read(10.5) == pytest.approx(0.5) and steep.read(13.25) == pytest.approx(3.25)


def test_the_rate_is_discounted_by_its_standard_errors():
    """n weighted arrivals: the rate is read as rate / (1 + z / sqrt(n))."""
    rule = Capacity(Target(80.0), BUDGETS, CAPS, 0.0, tau_s=1e6, z=1.0)
    arrive(rule, 12.0, 100 / 12.0)
    assert rule.count == pytest.approx(100.0, rel=1e-3) and rule.need() == pytest.approx(rule.rate() / 1.1, rel=1e-3)


def test_a_level_that_holds_no_more_than_a_lower_one_is_never_taken():
    """A skipper that slows the step (capacities not above level 0's): level 0 under any load."""
    rule = Capacity(Target(80.0), BUDGETS, (10.0, 10.0, 9.0, 9.5, 9.0), 0.0, tau_s=2.0, z=0.0)
    _, levels = arrive(rule, 30.0, 20.0)
    assert set(levels) == {0} and rule.used == [0]
    stepped = Capacity(Target(80.0), BUDGETS, (10.0, 10.0, 9.0, 12.0, 9.0), 0.0, tau_s=2.0, z=0.0, mix=False)
    arrive(stepped, 30.0, 20.0)
    assert stepped.used == [0, 3] and stepped.level == 3


def test_the_stepped_rule_goes_up_at_once_and_down_past_a_band_after_a_hold():
    """tau 5 s: the rate reads 0.1 req/s high (arrivals counted at the ticks)."""
    rule = Capacity(Target(80.0), BUDGETS, CAPS, 0.0, tau_s=5.0, z=0.0, mix=False, band=0.05, hold_s=10.0)
    now, _ = arrive(rule, 11.3, 20.0)
    assert rule.level == 2  # the lowest level holding 11.4: level 2 (12)
    now, _ = arrive(rule, 10.8, 20.0, now)
    assert rule.level == 2  # 10.9 fits level 1 (11), but 1.05 x 10.9 = 11.45 does not: within the band
    now, _ = arrive(rule, 10.2, 10.0, now)
    assert rule.level == 1  # 1.05 x 10.3 = 10.8 fits level 1
    down = rule.since
    now, levels = arrive(rule, 30.0, 3.0, now)
    assert rule.level == 4 and levels[-1] == 4 and rule.since - down < 10.0  # up at once, hold or not
    up = rule.since
    _, levels = arrive(rule, 9.0, 30.0, now)
    first = next(i for i, j in enumerate(levels) if j < 4)
    assert set(levels[:first]) == {4} and up + 10.0 <= now + (first + 1) / 9.0 < up + 12.0  # down after the hold
    assert levels[-1] == 0


def test_the_rate_keyed_rule_in_the_simulator_rises_under_overload_and_stays_at_0_under_light_load():
    """Flat steps of 100 ms at level 0: capacities from 2 to 6 req/s; 30 req/s takes it to the top, 1 req/s
    never leaves level 0 (the same requests pinned at level 0 give the same times)."""
    caps = (2.0, 3.0, 4.0, 5.0, 6.0)
    rule = Capacity(Target(80.0), BUDGETS, caps, 0.0, tau_s=2.0)
    er = simulate_elastic(overload(), LEVELS, rule, ServerConfig())
    assert er.budgets[:3].tolist() == [0.0] * 3 and er.budgets[-100:].tolist() == [4.0] * 100
    light = Workload("fixed:1", "fixed:10", ignore_eos=True).requests(poisson(1.0, n=60, seed=2), seed=2)
    er = simulate_elastic(light, LEVELS, Capacity(Target(80.0), BUDGETS, caps, 0.0, tau_s=2.0), ServerConfig())
    pinned = simulate_elastic(light, LEVELS, Pinned(BUDGETS, 0), ServerConfig())
    assert set(er.budgets.tolist()) == {0.0} and np.array_equal(er.result.e2e, pinned.result.e2e)
    with pytest.raises(ValueError, match="capacities"):
        Capacity(Target(80.0), BUDGETS, caps[:4], 0.0)
