"""Paired rounds and what they give: per-round ratios, their median, a bootstrap 95% CI.

A round runs every system once on the same requests, in a fresh random order, so a slow spell
of a shared machine lands on all systems of that round rather than on one system's whole
measurement. A system's delta against the baseline is the median over rounds of
`value(system, round) / value(baseline, round)`, minus 1; its 95% confidence interval is the
percentile interval of that median over bootstrap resamples of the rounds. A delta whose
interval contains 0 is "not resolved": the run cannot tell it from no change.
"""
from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass

__all__ = ["Delta", "bootstrap_ci", "paired_delta", "round_orders"]


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


@dataclass(frozen=True)
class Delta:
    """A relative change against the baseline: median of per-round ratios minus 1, with its CI."""

    median: float
    lo: float
    hi: float
    ratios: tuple[float, ...]

    @property
    def resolved(self) -> bool:
        """False when the 95% CI spans 0 (the change cannot be told from none)."""
        return not (self.lo <= 0.0 <= self.hi)

    def text(self) -> str:
        s = f"{self.median:+.1%} [{self.lo:+.1%}, {self.hi:+.1%}]"
        return s if self.resolved else s + " not resolved"


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
