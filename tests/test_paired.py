"""Paired rounds and their intervals (benchmarks/stats.py): fresh orders, per-round ratios,
the bootstrap CI, the rerun interval, the lifetimes' spread, and the "not resolved" rule, on
synthetic numbers."""
import math
import random
import statistics

import pytest

from benchmarks import stats


def test_round_orders_hold_every_system_once_in_fresh_seeded_orders():
    names = ["upstream", "rate0", "random", "trained"]
    orders = stats.round_orders(names, 40, seed=5)
    assert orders == stats.round_orders(names, 40, seed=5)
    assert orders != stats.round_orders(names, 40, seed=6)
    assert all(sorted(o) == sorted(names) for o in orders)
    assert len({tuple(o) for o in orders}) > 10  # fresh orders, not one rotation
    firsts = [o[0] for o in orders]
    assert all(firsts.count(n) >= 3 for n in names)  # nobody always runs first (or last)
    with pytest.raises(ValueError, match="rounds=0"):
        stats.round_orders(names, 0, 0)
    with pytest.raises(ValueError, match="distinct"):
        stats.round_orders(["a", "a"], 3, 0)


def test_paired_delta_cancels_a_slow_spell_that_hits_the_whole_round():
    """Round r runs at speed s_r (the machine's mood, x3 between rounds); the system is 10% faster
    than the baseline within every round. Per-round ratios see exactly +10%; means over rounds
    compared unpaired would see noise of the order of the spread."""
    speeds = [1.0, 0.4, 1.2, 0.35, 0.9, 1.1, 0.5, 1.0]
    base = [100 * s for s in speeds]
    d = stats.paired_delta([1.1 * b for b in base], base)
    assert d.median == pytest.approx(0.10) and d.lo == pytest.approx(0.10) and d.hi == pytest.approx(0.10)
    assert d.resolved and d.text() == "+10.0% [+10.0%, +10.0%]"
    assert d.ratios == pytest.approx([0.1] * len(speeds))


def test_paired_delta_rejects_bad_input_naming_it():
    with pytest.raises(ValueError, match="3 values but 2 baseline"):
        stats.paired_delta([1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match="no rounds"):
        stats.paired_delta([], [])
    with pytest.raises(ValueError, match="baseline must be positive and finite, got 0"):
        stats.paired_delta([1, 2], [1, 0])
    with pytest.raises(ValueError, match="values must be positive and finite, got nan"):
        stats.paired_delta([1, math.nan], [1, 1])


def test_bootstrap_ci_brackets_the_median_and_is_seeded():
    xs = [0.03, -0.01, 0.05, 0.02, 0.04, 0.00, 0.06, 0.02, 0.03]
    lo, hi = stats.bootstrap_ci(xs)
    assert lo <= statistics.median(xs) <= hi and lo < hi
    assert (lo, hi) == stats.bootstrap_ci(xs)
    assert min(xs) <= lo and hi <= max(xs)  # a percentile interval of medians stays inside the data
    assert stats.bootstrap_ci([0.07] * 5) == (0.07, 0.07)
    with pytest.raises(ValueError, match="no values"):
        stats.bootstrap_ci([])


def test_bootstrap_ci_covers_the_true_median_about_95_percent_of_the_time():
    """Synthetic experiments of 12 rounds each, per-round ratio ~ N(+5%, 4%): the 95% interval
    contains the true median (+5%) in roughly 95% of them (a percentile bootstrap of a median over
    few rounds is approximate: 85-99% accepted), and is not so wide that it contains everything."""
    r = random.Random(1)
    hits = far = 0
    trials = 200
    for t in range(trials):
        xs = [r.gauss(0.05, 0.04) for _ in range(12)]
        lo, hi = stats.bootstrap_ci(xs, resamples=800, seed=t)
        hits += lo <= 0.05 <= hi
        far += lo <= 0.05 + 0.08 <= hi  # two sigmas off: should rarely be inside
    assert 0.85 * trials <= hits <= 0.99 * trials, hits
    assert far <= 0.05 * trials, far


def test_rerun_half_width_is_students_t_on_a_medians_standard_error_times_sqrt2():
    xs = [0.02, 0.10, 0.03, 0.09, 0.06]
    sd = statistics.stdev(xs)
    assert stats.rerun_half_width(xs) == pytest.approx(2 ** 0.5 * 2.776 * (math.pi / 2) ** 0.5 * sd / 5 ** 0.5)
    assert stats.rerun_half_width(xs[:3]) > stats.rerun_half_width(xs)  # fewer rounds, wider (t at 2 df)
    assert stats.rerun_half_width([0.05]) == 0.0 and stats.rerun_half_width([0.05] * 4) == 0.0
    # the bootstrap interval [0.02, 0.10] excludes 0; a rerun could land below it: not resolved
    d = stats.paired_delta([1 + x for x in xs], [1.0] * 5)
    assert d.resolved and d.lo == pytest.approx(0.02)
    r = stats.rerun(d)
    assert not r.resolved and r.lo == pytest.approx(0.06 - stats.rerun_half_width(xs)) and r.median == d.median
    assert r.text().endswith("not resolved")


def test_rerun_interval_holds_another_runs_median_about_95_percent_of_the_time():
    """Pairs of synthetic runs of 5 rounds, per-round ratio ~ N(+10%, 10%): the first run's rerun
    interval holds the second run's median in about 95% of pairs (sqrt(pi/2) overstates a median of
    5's standard error a little: up to 99% accepted); the percentile bootstrap interval of the
    median, about [min, max] at 5 rounds, in about 83% (exactly 5/6 for [min, max])."""
    r = random.Random(3)
    trials, rerun_hits, boot_hits = 300, 0, 0
    for t in range(trials):
        a, b = ([r.gauss(0.10, 0.10) for _ in range(5)] for _ in range(2))
        d = stats.paired_delta([1 + x for x in a], [1.0] * 5, seed=t)
        w, other = stats.rerun(d), statistics.median(b)
        rerun_hits += w.lo <= other <= w.hi
        boot_hits += d.lo <= other <= d.hi
    assert 0.92 * trials <= rerun_hits <= 0.99 * trials, rerun_hits
    assert boot_hits <= 0.88 * trials, boot_hits


def test_not_resolved_when_the_ci_spans_zero():
    assert not stats.Delta(0.02, -0.01, 0.05, ()).resolved
    assert not stats.Delta(0.0, 0.0, 0.03, ()).resolved  # touching 0 counts as spanning it
    assert stats.Delta(-0.05, -0.08, -0.02, ()).resolved
    assert stats.Delta(0.05, 0.01, 0.08, ()).resolved
    assert stats.Delta(0.02, -0.01, 0.05, ()).text() == "+2.0% [-1.0%, +5.0%] not resolved"
    # from synthetic rounds: a symmetric scatter around no change is not resolved, a clear shift is
    noise = [0.04, -0.03, 0.01, -0.02, 0.03, -0.04, 0.02, -0.01]
    base = [50.0] * len(noise)
    assert not stats.paired_delta([50 * (1 + x) for x in noise], base).resolved
    assert stats.paired_delta([50 * (1.15 + x) for x in noise], base).resolved


def test_t975_is_students_t():
    assert stats.t975(1) == 12.706 and stats.t975(3) == 3.182 and stats.t975(30) == 2.042
    assert stats.t975(120) == pytest.approx(1.980, abs=2e-3) and stats.t975(10**6) == pytest.approx(1.96, abs=1e-5)
    with pytest.raises(ValueError, match="df=0"):
        stats.t975(0)


def test_lifetime_half_width_pools_the_spread_of_lifetime_means_over_systems():
    lives = [0, 0, 1, 1]
    # a: lifetime means 0.10 and 0.14 (deviations +-0.02); b: 0.00 and 0.00; 2 systems x (2 - 1) = 2 df
    hw = stats.lifetime_half_width({"a": [0.09, 0.11, 0.13, 0.15], "b": [0.01, -0.01, 0.0, 0.0]}, lives)
    assert hw == pytest.approx(stats.t975(2) * ((2 * 0.02 ** 2) / 2 / 2) ** 0.5)
    assert stats.lifetime_half_width({"a": [0.1, 0.2, 0.3]}, [0, 0, 0]) is None  # one lifetime: nothing to add
    d = stats.Delta(0.12, 0.11, 0.13, (0.12,))
    w = stats.rerun(d, 0.05)
    assert stats.rerun(d, None) == d
    assert (w.median, w.lo, w.hi) == pytest.approx((0.12, 0.12 - 0.05 * 2 ** 0.5, 0.12 + 0.05 * 2 ** 0.5))
    assert stats.rerun(d, 0.001) == d  # never narrower than the rounds' own interval
    with pytest.raises(ValueError, match="3 rounds, lives has 4"):
        stats.lifetime_half_width({"a": [0.1, 0.2, 0.3]}, lives)


@pytest.mark.slow
def test_rerun_interval_covers_the_true_ratio_despite_lifetime_offsets():
    """Simulated runs: 5 rounds on 2 lifetimes, every server 3% off for its whole life (upstream's too),
    1% noise per round. Resampling rounds alone covers the true +10% in about 2 of 3 runs; with the
    lifetimes' spread added, in about 19 of 20."""

    r = random.Random(0)
    lives, runs, plain, wide = [0, 0, 1, 1, 1], 300, 0, 0
    for k in range(runs):
        up = [r.gauss(0, 0.03) for _ in range(2)]
        base = [100 * (1 + up[l]) * (1 + r.gauss(0, 0.01)) for l in lives]
        ds = {}
        for name, effect in (("a", 0.10), ("b", 0.0), ("c", 0.02)):
            off = [r.gauss(0, 0.03) for _ in range(2)]
            ds[name] = stats.paired_delta([100 * (1 + effect) * (1 + off[l]) * (1 + r.gauss(0, 0.01)) for l in lives],
                                           base, seed=k)
        w = stats.rerun(ds["a"], stats.lifetime_half_width({n: list(d.ratios) for n, d in ds.items()}, lives))
        plain += ds["a"].lo <= 0.10 <= ds["a"].hi
        wide += w.lo <= 0.10 <= w.hi
    assert plain / runs < 0.75 and wide / runs > 0.88, (plain / runs, wide / runs)


def test_timed_rounds_runs_every_system_once_a_round_in_fresh_orders_and_drops_the_warm_up():
    seen = []
    values = stats.timed_rounds(["a", "b", "c"], 4, seed=2, step=lambda n: seen.append(n) or len(seen))
    assert len(seen) == 5 * 3 and all(sorted(seen[3 * r: 3 * r + 3]) == ["a", "b", "c"] for r in range(5))
    assert {n: len(v) for n, v in values.items()} == {"a": 4, "b": 4, "c": 4}
    assert all(seen[v - 1] == n for n, vs in values.items() for v in vs)  # each value is that system's own call
    assert min(v for vs in values.values() for v in vs) > 3  # round 0's three calls left out
    assert [seen[3 * r: 3 * r + 3] for r in range(5)] == stats.round_orders(["a", "b", "c"], 5, 2)


def test_ratio_text_shows_the_delta_as_a_ratio_with_its_interval():
    assert stats.Delta(0.12, 0.08, 0.155, (0.12,)).ratio_text() == "1.120 [1.080, 1.155]"
    assert stats.Delta(-0.5, -0.6, -0.4, (-0.5,)).ratio_text(2) == "0.50 [0.40, 0.60]"


def test_timed_rounds_with_repeats_interleaves_them_and_keeps_each_systems_best():
    seen = []
    values = stats.timed_rounds(["a", "b"], 3, seed=1, step=lambda n: seen.append(n) or len(seen), repeats=3)
    assert len(seen) == 4 * 3 * 2  # (rounds + 1) x repeats x systems
    assert all(sorted(seen[2 * k: 2 * k + 2]) == ["a", "b"] for k in range(12))  # every system once per repeat
    for n, vs in values.items():  # each round keeps the smallest (the earliest, here) of that system's 3 calls
        assert vs == [min(i + 1 for i in range(6 * r, 6 * r + 6) if seen[i] == n) for r in (1, 2, 3)]
    fastest = stats.timed_rounds(["a", "b"], 2, seed=1, step=lambda n: seen.append(n) or len(seen), repeats=2,
                                 best=max)
    assert all(v % 4 in (3, 0) for vs in fastest.values() for v in vs)  # the later of a round's two repeats
    with pytest.raises(ValueError, match="repeats=0"):
        stats.timed_rounds(["a"], 2, 0, lambda n: 1.0, repeats=0)
