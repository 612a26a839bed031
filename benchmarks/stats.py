"""Paired rounds and what they give: per-round ratios, their median, a bootstrap 95% CI or a rerun interval.

A round runs every system once on the same requests, in a fresh random order, so a slow spell
of a shared machine lands on all systems of that round rather than on one system's whole
measurement. A system's delta against the baseline is the median over rounds of
`value(system, round) / value(baseline, round)`, minus 1; its 95% confidence interval is the
percentile interval of that median over bootstrap resamples of the rounds. A delta whose
interval contains 0 is "not resolved": the run cannot tell it from no change.

When the rounds ran on several server lifetimes (every server restarted between them), rounds of
one lifetime share that lifetime's offset: a server process is a few percent faster or slower than
another of the same configuration for its whole life. Resampling rounds cannot see that, so the
interval is widened to hold median +- t * s_L / sqrt(L) as well (`lifetime_half_width`): s_L, the
spread of per-lifetime mean ratios, pooled over the systems compared, L lifetimes, Student's t at
the pooled degrees of freedom.

The quick run (`make demo`) reports a *rerun interval* instead (`rerun`): where another run of the
same job would put its median, 95% of the time. A user reruns the demo and compares; a confidence
interval for the true median is the wrong yardstick for that, since the rerun's median carries
noise of its own (the two differ by sqrt(2) standard errors, so a rerun's median falls outside a
right 95% CI about 17% of the time), and at 3-6 rounds the percentile bootstrap is no 95% interval
at all (at 5 rounds it is [min, max]). Half-width sqrt(2) * t975(n - 1) * sqrt(pi/2) * s / sqrt(n):
s the rounds' standard deviation, sqrt(pi/2) a median's standard error over a mean's (normal
rounds), Student's t for the few rounds; with several lifetimes, sqrt(2) times the lifetime
half-width where that is wider. The runs and the simulation (benchmarks/interval_sim.py) that chose
these intervals: benchmarks/README.md, "Measurements behind the settings".
"""
from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass

__all__ = ["Delta", "bootstrap_ci", "lifetime_half_width", "paired_delta", "rerun", "rerun_half_width", "round_orders",
           "t975", "timed_rounds"]


def round_orders(names: list[str], rounds: int, seed: int) -> list[list[str]]:
    """One fresh random order of `names` per round, seeded: the same seed gives the same orders."""
    if rounds < 1:
        raise ValueError(f"rounds={rounds} must be >= 1")
    if len(set(names)) != len(names) or not names:
        raise ValueError(f"names={names!r} must be distinct and non-empty")
    r = random.Random(seed)
    orders = []
    for _ in range(rounds):
        order = list(names)
        r.shuffle(order)
        orders.append(order)
    return orders


def timed_rounds(names: list[str], rounds: int, seed: int, step, repeats: int = 1, best=min) -> dict[str, list[float]]:
    """rounds + 1 rounds, each calling step(name) `repeats` times for every name, each time in a fresh
    random order (round_orders); step returns what it measured (seconds, a speed). {name: one value
    per round}: the best of its repeats (`best`: min for times, max for speeds), round 0 left out: it
    warms every system up. A shared machine's interference only ever slows a step down, so the
    fastest of a few interleaved repeats is a far steadier measure of the step itself than any one
    call (benchmarks/README.md, "Measurements behind the settings")."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    values = {n: [] for n in names}
    orders = round_orders(names, (rounds + 1) * repeats, seed)
    for r in range(rounds + 1):
        got = {n: [] for n in names}
        for order in orders[r * repeats:(r + 1) * repeats]:
            for n in order:
                got[n].append(step(n))
        if r:
            for n in names:
                values[n].append(best(got[n]))
    return values


def bootstrap_ci(xs: list[float], level: float = 0.95, resamples: int = 4000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the median of `xs` (resampling the rounds)."""
    if not xs:
        raise ValueError("bootstrap_ci: no values")
    if not 0 < level < 1:
        raise ValueError(f"level={level} must be in (0, 1)")
    r = random.Random(seed)
    n = len(xs)
    meds = sorted(statistics.median(r.choices(xs, k=n)) for _ in range(resamples))
    tail = (1 - level) / 2
    lo = meds[int(math.floor(tail * (resamples - 1)))]
    hi = meds[int(math.ceil((1 - tail) * (resamples - 1)))]
    return lo, hi


_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    """Student's t, 97.5th percentile (a two-sided 95% interval), at df degrees of freedom."""
    if df < 1:
        raise ValueError(f"df={df} must be >= 1")
    return _T975[df - 1] if df <= len(_T975) else 1.96 + 2.5 / df  # (within 0.002 of the exact value past 30)


def lifetime_half_width(ratios: dict[str, list[float]], lives: list[int]) -> float | None:
    """How far a median of per-round ratios can move with the servers' lifetime offsets: t975(df) *
    s_L / sqrt(L), where s_L^2 pools, over the systems in `ratios`, the squared deviations of each
    lifetime's mean ratio from that system's mean of them, df = the pooled degrees of freedom and L
    the number of lifetimes. lives[r]: the lifetime round r ran on. None with a single lifetime."""
    L = sorted(set(lives))
    if len(L) < 2:
        return None
    ss, df = 0.0, 0
    for name, xs in ratios.items():
        if len(xs) != len(lives):
            raise ValueError(f"lifetime_half_width: {name} has {len(xs)} rounds, lives has {len(lives)}")
        means = [statistics.fmean(x for x, l in zip(xs, lives) if l == k) for k in L]
        c = statistics.fmean(means)
        ss += sum((m - c) ** 2 for m in means)
        df += len(means) - 1
    if df < 1:
        return None
    return t975(df) * math.sqrt(ss / df / len(L))


@dataclass(frozen=True)
class Delta:
    """A relative change against the baseline: median of per-round ratios minus 1, with its CI."""

    median: float
    lo: float
    hi: float
    ratios: tuple[float, ...]

    def text(self) -> str:
        s = f"{self.median:+.1%} [{self.lo:+.1%}, {self.hi:+.1%}]"
        return s if self.resolved else s + " not resolved"

    def ratio_text(self, digits: int = 3) -> str:
        """As a ratio with its interval: `1.120 [1.080, 1.150]`."""
        return f"{1 + self.median:.{digits}f} [{1 + self.lo:.{digits}f}, {1 + self.hi:.{digits}f}]"

    @property
    def resolved(self) -> bool:
        """False when the 95% CI spans 0 (the change cannot be told from none)."""
        return not (self.lo <= 0.0 <= self.hi)


def paired_delta(values: list[float], baseline: list[float], seed: int = 0) -> Delta:
    """`values[r]` and `baseline[r]` measured in the same round r; both positive and finite."""
    if len(values) != len(baseline):
        raise ValueError(f"paired_delta: {len(values)} values but {len(baseline)} baseline values (one per round each)")
    if not values:
        raise ValueError("paired_delta: no rounds")
    for name, xs in (("values", values), ("baseline", baseline)):
        bad = [x for x in xs if not (math.isfinite(x) and x > 0)]
        if bad:
            raise ValueError(f"paired_delta: {name} must be positive and finite, got {bad[0]!r}")
    ratios = [v / b - 1.0 for v, b in zip(values, baseline)]
    lo, hi = bootstrap_ci(ratios, seed=seed)
    return Delta(statistics.median(ratios), lo, hi, tuple(ratios))


def rerun_half_width(ratios: list[float] | tuple[float, ...]) -> float:
    """How far another run's median of as many rounds may fall from this run's median of `ratios`,
    95% of the time: sqrt(2) * t975(n - 1) * sqrt(pi / 2) * stdev / sqrt(n) (see the module
    docstring). 0 for a single round (nothing to say how far a rerun moves: the caller asks for
    at least 3)."""
    n = len(ratios)
    if n < 2:
        return 0.0
    return math.sqrt(2) * t975(n - 1) * math.sqrt(math.pi / 2) * statistics.stdev(ratios) / math.sqrt(n)


def rerun(d: Delta, lifetime_hw: float | None = None) -> Delta:
    """d with its interval replaced by where a rerun's median would fall (95%): d.median +-
    max(rerun_half_width(d.ratios), sqrt(2) * lifetime_hw), never narrower than d's own interval."""
    hw = max(rerun_half_width(d.ratios), 0.0 if lifetime_hw is None else math.sqrt(2) * lifetime_hw)
    return Delta(d.median, min(d.lo, d.median - hw), max(d.hi, d.median + hw), d.ratios)
