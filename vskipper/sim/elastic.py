"""Elastic depth in the simulator: the server's own controller (vskipper/elastic.py: Controller), unchanged,
driven by the simulated scheduler as SGLang's drives it (vskipper/integrations/sglang/elastic.py), and its
level applied to the step model as each row's budget.

What the controller is fed, and when (the server's hook in brackets):
    admit()                   a request's level, read when it first leaves the waiting queue (the level stamped
                              on the queue at the last hand-on; a retracted request keeps its own)
    decode_step(now, ...)     each decode step's end: its rows' budgets and context tokens (process_batch_result)
    prefill(), first_token()  each prefill step; a request's first token, sent to emitted (process_batch_result)
    idle()                    nothing running, nothing queued (on_idle)
    tick(now, running, queued) after every step and at idle: the running rows' budgets, the queue's length
The period clock is the controller's own (`Target.period_s` against the `now` it is given), the simulated
time standing in for time.monotonic().

How a level prices a step (LevelSteps): a row at budget k of the L routed layers may skip at its k shallowest
routed layers and RUNs the others (vskipper/control.py), so it skips a share k / L of what the skipper alone
skips: its step is upstream's moved toward the skipper's by k / L, linear in the RUN fraction as
StepModel.scaled is. A batch's step, decode or prefill, is moved by its rows' mean k / L (a prefill's
weighted by its tokens); the host work of the two systems' servers alike (on a serial host it is folded into
the step). At budget 0 everywhere a step is upstream's exactly.

Predictive (model-predictive) and Capacity (keyed on the arrival rate against each level's SLO capacity) are
candidate rules with the controller's interface (host arithmetic only), judged beside the server's own by
benchmarks/sim/elastic_rules.py; neither is what the server runs. Pinned holds one level (a level's capacity).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from vskipper.elastic import HISTORY, STREAM, Target, p90
from vskipper.sim.engine import _Sim
from vskipper.sim.metrics import SimResult
from vskipper.sim.server import ServerConfig
from vskipper.sim.steps import Host, StepModel, StepTables
from vskipper.sim.workload import Request

__all__ = ["Capacity", "ElasticResult", "LevelSteps", "Pinned", "Predictive", "simulate_elastic"]


@dataclass
class LevelSteps:
    """Upstream's and a skipper's steps on one device, and the rows' budgets between them (module docstring).
    n_routed: the skipper's routed layers L (budgets run 0..L)."""

    base: StepModel
    skipper: StepModel
    n_routed: int
    base_host: Host = field(default_factory=Host)
    skipper_host: Host = field(default_factory=Host)

    def __post_init__(self):
        if self.n_routed < 1:
            raise ValueError(f"LevelSteps.n_routed={self.n_routed!r}: expected an integer >= 1")
        self.serial = self.base_host.serial
        # the scheduler's host: on a serial host the work per step is priced here, in decode_ms / extend_ms
        self.host = (Host(ingress_ms=self.base_host.ingress_ms, egress_ms=self.base_host.egress_ms, serial=True,
                          source="folded into the step by LevelSteps") if self.serial else self.base_host)
        self.f = (self.skipper.run_fraction["decode"], self.skipper.run_fraction["extend"])

    @classmethod
    def from_tables(cls, tables: StepTables, skipper: str, n_routed: int) -> LevelSteps:
        return cls(tables.model("upstream"), tables.model(skipper), n_routed, tables.host_for("upstream"),
                   tables.host_for(skipper))

    def decode_ms(self, rows: int, context: float, budget_sum: float = 0.0) -> float:
        """A decode step of `rows` rows attending `context` tokens in all, their budgets summing to `budget_sum`."""
        w = budget_sum / (rows * self.n_routed) if rows else 0.0
        ms = self.base.decode_ms(rows, context)
        if w:
            ms += w * (self.skipper.decode_ms(rows, context) - ms)
        if self.serial:
            (a, b), (c, d) = self.base_host.decode_ms, self.skipper_host.decode_ms
            ms += a + b * rows + w * (c + d * rows - a - b * rows)
        return ms

    def extend_ms(self, tokens: int, rows: int, pairs: float, w: float = 0.0) -> float:
        """A prefill step; w: its tokens' mean budget share k / L."""
        ms = self.base.extend_ms(tokens, rows, pairs)
        if w:
            ms += w * (self.skipper.extend_ms(tokens, rows, pairs) - ms)
        if self.serial:
            (a, b), (c, d) = self.base_host.extend_ms, self.skipper_host.extend_ms
            ms += a + b * rows + w * (c + d * rows - a - b * rows)
        return ms

    def prior(self, context_per_row: float):
        """The controller's step model (vskipper.elastic.StepModel's slot: budgets -> ms of a decode step of
        those rows), from these steps at `context_per_row` tokens a row: in the server the calibration prices
        layers only; here the step model is the whole step."""
        def price(budgets) -> float:
            T = max(1, len(budgets))
            return self.decode_ms(T, T * context_per_row, sum(budgets))
        return price


class _Priced:
    """The engine's step model for one run: the batch being formed, priced at its rows' budgets."""

    def __init__(self, sim: _ElasticSim, levels: LevelSteps):
        self.sim, self.levels = sim, levels
        self.measured_max = levels.base.measured_max

    def decode_ms(self, rows: int, context: float) -> float:
        return self.levels.decode_ms(rows, context, self.sim.dec_B)

    def extend_ms(self, tokens: int, rows: int, pairs: float) -> float:
        return self.levels.extend_ms(tokens, rows, pairs, self.sim.ext_w)


@dataclass
class ElasticResult:
    """A run with a rule: the run's SimResult, each request's budget (in arrival order), the level changes
    (simulated s, new level) and the skipper's RUN fractions, so the share of work skipped can be counted."""

    result: SimResult
    budgets: np.ndarray
    changes: list[tuple[float, int]]
    n_routed: int
    run_fraction: tuple[float, float]  # the skipper alone's (decode, extend)
    prompts: np.ndarray

    def skipped(self, since: float = 0.0) -> dict:
        """Share of routed-layer work skipped by the requests sent at `since` s or later: token-layers (each
        prompt token once, each generated token after the first once), a row at budget k skipping k / L of what
        the skipper alone skips. {"all": ..., "decode": ...}."""
        r = self.result
        m = r.arrival >= since
        w = self.budgets[m] / self.n_routed
        dec, pre = np.maximum(r.output[m] - 1, 0), self.prompts[m]
        fd, fe = self.run_fraction
        sk_dec = float((w * dec).sum()) * (1 - fd)
        sk_pre = float((w * pre).sum()) * (1 - fe)
        return {"all": (sk_dec + sk_pre) / max(1.0, float(dec.sum() + pre.sum())),
                "decode": sk_dec / max(1.0, float(dec.sum()))}


class _ElasticSim(_Sim):
    """engine._Sim with a rule: each request's budget fixed when it first leaves the queue, steps priced at
    their rows' budgets, the rule fed the scheduler's events (module docstring)."""

    def __init__(self, requests, levels: LevelSteps, rule, cfg, record):
        super().__init__(requests, None, levels.host, cfg, record)
        self.m = _Priced(self, levels)
        self.levels, self.rule = levels, rule
        self.budget_of: list[int | None] = [None] * len(self.reqs)
        self.count = {b: 0 for b in rule.budgets}  # running rows per budget
        self.dec_B, self.ext_w = 0, 0.0  # the batch being formed: its budget sum (decode), token share (prefill)
        self.dec_info: dict[int, tuple[list[int], float]] = {}  # decode index -> (rows' budgets, context)
        self.changes: list[tuple[float, int]] = []

    def _join(self, r) -> None:
        super()._join(r)
        self.count[self.budget_of[r.i]] += 1

    def _leave(self, r) -> None:
        super()._leave(r)
        self.count[self.budget_of[r.i]] -= 1

    def _running(self) -> list[int]:
        out: list[int] = []
        for b, c in self.count.items():
            out += [b] * c
        return out

    def _prefill(self):
        pieces = super()._prefill()
        if pieces is not None:
            tokens, skip = 0, 0.0
            for r, ext, _, _ in pieces:
                if self.budget_of[r.i] is None:  # leaves the queue for the first time: the level of now
                    self.budget_of[r.i] = self.rule.budgets[self.rule.admit()]
                tokens += ext
                skip += ext * self.budget_of[r.i]
            self.ext_w = skip / (tokens * self.levels.n_routed) if tokens else 0.0
        return pieces

    def _decode(self, pending):
        D = self.D
        if pending is not None and pending[0] == 1:
            candidates = list(pending[2])
        else:
            candidates = [r for r, _ in self.finish.get(D - 1, ())]
        dec = super()._decode(pending)
        if dec is None:
            return None
        rows, ctx, _, gone = dec
        count = dict(self.count)
        for r in candidates:
            if id(r) in gone:
                count[self.budget_of[r.i]] -= 1
        budgets: list[int] = []
        for b, c in count.items():
            budgets += [b] * c
        self.dec_B = sum(budgets)
        self.dec_info[D] = (budgets, ctx)
        return dec

    def _process(self, batch, t: float, result_only: bool = False) -> int:
        finished = super()._process(batch, t, result_only)
        if result_only:
            return finished
        rule = self.rule
        if batch[0] == 1:
            rule.prefill()
            for r in batch[2]:
                if len(r.segs) == 1:
                    rule.first_token(r.segs[0][0] - r.arrival)
        else:
            budgets, ctx = self.dec_info.pop(batch[1])
            rule.decode_step(batch[2], budgets, context=ctx)
        queued = len(self.waiting) + (self.chunked is not None)
        if self.n == 0 and queued == 0:
            rule.idle()
        if rule.tick(t, self._running(), queued):
            self.changes.append((t, rule.level))
        return finished


def simulate_elastic(requests: list[Request], levels: LevelSteps, rule, server: ServerConfig | None = None,
                     record_batches: bool = True) -> ElasticResult:
    """Run the trace through the simulated server with `rule` choosing the level (a vskipper.elastic.Controller
    made at time 0, or anything with its interface: admit, decode_step, prefill, first_token, idle, tick,
    level, budgets); the budgets must run 0..levels.n_routed."""
    if max(rule.budgets) > levels.n_routed:
        raise ValueError(f"simulate_elastic: budgets {rule.budgets} exceed the {levels.n_routed} routed layers")
    sim = _ElasticSim(requests, levels, rule, server or ServerConfig(), record_batches)
    res = sim.run()
    budgets = np.array([b if b is not None else 0 for b in sim.budget_of], dtype=float)
    prompts = np.array([r.prompt for r in sim.reqs], dtype=float)
    return ElasticResult(res, budgets, sim.changes, levels.n_routed, levels.f, prompts)


class Predictive:
    """A candidate rule (the issue's model-predictive one): each period, the lowest level whose predicted TPOT
    for the rows running and queued now is within `margin` x the target, from the step model. Predicted: a
    decode step of those n rows at the mean context per row of the last step, every row at level j, priced by
    `price(rows, context, budget_sum)` (ms), times the ratio of the measured gaps between decode steps to their
    own prices over the last HISTORY steps (what the prefills between them add, and the model's error here).
    Up at once to the lowest level that fits (if none, the level predicted fastest); down only to a level
    predicted within `hysteresis` x margin x target. Nothing running or queued: level 0. `smooth`: the rows are
    not those of the
    moment but their moving average over a stream's lifetime (STREAM gaps of the last HISTORY steps' mean): a
    stream's TPOT is the mean of its gaps over that lifetime, so a spike of arrivals shorter than it moves it little.
    `adapt`: an outer loop sets the band from what the streams saw: each tick the band is scaled by
    (AIM x target / observed) ** GAIN, the observed being the p90 over the last WINDOW steps of their STREAM-step
    means (the recent streams' p90 TPOT), the scale kept within SCALE: the p90 is held at the target whatever the
    prediction's error and the streams' spread about their mean. `hold`: down only after a stream's length of
    decode steps (STREAM) at the level: a level reaches only the requests admitted at it, and they reach the batch
    over a lifetime, so a fall judged sooner reads a batch still full of rows admitted lower."""

    AIM, GAIN, WINDOW, SCALE = 0.95, 0.1, 8 * STREAM, (0.5, 1.5)

    def __init__(self, target: Target, budgets: tuple[int, ...], price, now: float, margin: float = 0.9,
                 hysteresis: float = 0.9, smooth: bool = False, adapt: bool = False, hold: bool = False) -> None:
        if not (0 < margin and 0 < hysteresis <= 1):
            raise ValueError(f"Predictive: margin={margin!r} must be > 0 and hysteresis={hysteresis!r} in (0, 1]")
        self.target, self.budgets, self.price = target, tuple(budgets), price
        self.margin, self.hysteresis, self.smooth = margin, hysteresis, smooth
        self.rows: float | None = None  # the moving average of the rows running and queued (smooth)
        self.adapt, self.scale = adapt, 1.0
        self.hold, self.fresh = hold, 0  # hold: down only after STREAM decode steps at the level (fresh counts them)
        self.gaps: deque[float] = deque(maxlen=STREAM)  # the last STREAM gaps (ms), and their sum
        self.gap_sum = 0.0
        self.means: deque[float] = deque(maxlen=self.WINDOW)  # STREAM-step means of the gaps (adapt)
        self.top = len(self.budgets) - 1
        self.level = 0
        self.steps: deque[tuple[float, float]] = deque(maxlen=HISTORY)  # (measured gap ms, its price ms)
        self.last_step: float | None = None
        self.context = 0.0  # per row, of the last decode step
        self.last_tick = self.since = now
        self.seconds = [0.0] * len(self.budgets)
        self.reason = "idle"

    def admit(self) -> int:
        return self.level

    def decode_step(self, now: float, budgets, prefill: bool = False, context: int = 0) -> None:
        budgets = list(budgets)
        T = len(budgets)
        if T:
            self.context = context / T
        if self.last_step is not None and T:
            gap = (now - self.last_step) * 1e3
            self.steps.append((gap, self.price(T, context, sum(budgets))))
            self.fresh += 1
            if self.adapt:
                if len(self.gaps) == STREAM:
                    self.gap_sum -= self.gaps[0]
                self.gaps.append(gap)
                self.gap_sum += gap
                if len(self.gaps) == STREAM:
                    self.means.append(self.gap_sum / STREAM)
        self.last_step = now

    def prefill(self) -> None:
        pass

    def first_token(self, seconds: float) -> None:
        pass

    def idle(self) -> None:
        self.last_step = None

    def _set(self, level: int, now: float) -> bool:
        if level == self.level:
            return False
        self.seconds[self.level] += now - self.since
        self.level, self.since, self.fresh = level, now, 0
        return True

    def predicted(self, n: int) -> list[float]:
        """The predicted TPOT (ms) of every level for n rows."""
        gap, priced = sum(g for g, _ in self.steps), sum(p for _, p in self.steps)
        ratio = gap / priced if self.steps and priced > 0 else 1.0
        return [ratio * self.price(n, n * self.context, n * k) for k in self.budgets]

    def tick(self, now: float, running: list[int], waiting: int) -> bool:
        n = len(running) + waiting
        if n == 0:
            self.reason, self.rows = "idle", None
            return self._set(0, now)
        if now - self.last_tick < self.target.period_s:
            return False
        dt, self.last_tick = now - self.last_tick, now
        if self.smooth:
            gap = sum(g for g, _ in self.steps) / len(self.steps) if self.steps else 0.0
            life = STREAM * gap / 1e3  # s
            a = 1.0 if self.rows is None or life <= 0 else 1.0 - math.exp(-dt / life)
            self.rows = n if self.rows is None else self.rows + a * (n - self.rows)
            n = max(1, round(self.rows))
        if self.adapt and len(self.means) >= STREAM:
            seen = p90(self.means)
            lo, hi = self.SCALE
            self.scale = min(hi, max(lo, self.scale * (self.AIM * self.target.tpot_ms / seen) ** self.GAIN))
        pred = self.predicted(n)
        bound = self.margin * self.scale * self.target.tpot_ms
        # none within the band: the level predicted fastest (the top, unless skipping costs more than it saves)
        want = next((j for j, p in enumerate(pred) if p <= bound), min(range(len(pred)), key=pred.__getitem__))
        if want > self.level:
            self.reason = f"predicted {pred[self.level]:.1f} ms for {n} rows at level {self.level}: up"
            return self._set(want, now)
        low = next((j for j, p in enumerate(pred) if p <= self.hysteresis * bound), self.level)
        if low < self.level and (not self.hold or self.fresh >= STREAM):
            self.reason = f"level {low} predicted {pred[low]:.1f} ms for {n} rows: down"
            return self._set(low, now)
        return False

    def time_per_level(self, now: float) -> list[float]:
        out = list(self.seconds)
        out[self.level] += now - self.since
        return out


class Capacity:
    """A candidate rule keyed on the arrival rate. `capacity[j]`: level j's SLO capacity in requests/s, the
    highest Poisson rate at which that level alone meets the target (found offline from the step model, by the
    bisection that finds upstream's R). Once per period:
        rate = the arrivals counted at each tick (the requests admitted since the last plus the queue's growth),
               averaged with weights decaying with time constant `tau_s` (their weighted count n over the
               weighted seconds, so the first seconds are not read as a low rate)
        need = margin x rate / (1 + z / sqrt(n)): the rate less about z of its standard errors (a rate counted
               over n arrivals is known to 1 / sqrt(n) of itself), so a count that is high by chance moves less
    `mix` (the rule judged): x = min(top, slope x x0), x0 the level of `need` read off the capacity table
        (0 at or below capacity[0], linear between two levels' capacities, the top above the last), and each
        request admitted at floor(x) or the level above, a share x - floor(x) of them above (error diffusion):
        the fractional levels a ladder of five lacks; slope > 1 because a level set by a load above R must do
        more than that load's stationary level (the mean over seeds of p90 TPOT is convex in the realized rate).
    Else (stepped, the first candidate): the lowest level whose capacity is at least `need` (none: the level
        of the highest capacity); up at once; down only to a level whose capacity is at least (1 + band) x
        need, and only `hold_s` after the level last changed.
    A level whose capacity is not above every lower level's is never chosen (a skipper that slows the step)."""

    def __init__(self, target: Target, budgets: tuple[int, ...], capacity, now: float, tau_s: float = 120.0,
                 z: float = 0.6, slope: float = 3.0, mix: bool = True, margin: float = 1.0, band: float = 0.05,
                 hold_s: float = 10.0) -> None:
        capacity = tuple(float(c) for c in capacity)
        if len(capacity) != len(budgets):
            raise ValueError(f"Capacity: {len(capacity)} capacities for {len(budgets)} levels")
        if not (tau_s > 0 and z >= 0 and slope > 0 and margin > 0 and band >= 0 and hold_s >= 0):
            raise ValueError(f"Capacity: tau_s={tau_s!r}, slope={slope!r} and margin={margin!r} must be > 0, "
                             f"z={z!r}, band={band!r} and hold_s={hold_s!r} >= 0")
        self.target, self.budgets, self.capacity = target, tuple(budgets), capacity
        self.tau_s, self.z, self.slope, self.mix = tau_s, z, slope, mix
        self.margin, self.band, self.hold_s = margin, band, hold_s
        self.used = [0]  # the levels that can be chosen: each above every lower level's capacity
        for j in range(1, len(capacity)):
            if capacity[j] > capacity[self.used[-1]]:
                self.used.append(j)
        self.level, self.hi, self.frac, self.carry, self.reason = 0, 0, 0.0, 0.0, "starting"  # mix: hi, frac
        self.admitted = self.queued = 0  # admitted since the last tick; the queue at the last tick
        self.count = self.span = 0.0  # weighted arrivals n, weighted seconds
        self.last = self.last_tick = self.since = now
        self.seconds = [0.0] * len(self.budgets)

    def admit(self) -> int:
        self.admitted += 1
        self.carry += self.frac if self.mix else 0.0
        if self.carry >= 1.0:
            self.carry -= 1.0
            return self.hi
        return self.level

    def decode_step(self, now, budgets, prefill=False, context=0) -> None:
        pass

    def prefill(self) -> None:
        pass

    def first_token(self, seconds) -> None:
        pass

    def idle(self) -> None:
        pass

    def rate(self) -> float:
        return self.count / self.span if self.span > 0 else 0.0

    def need(self) -> float:
        return self.margin * self.rate() / (1.0 + self.z / math.sqrt(max(1.0, self.count)))

    def read(self, need: float) -> float:
        """x0: the level of `need` requests/s on the capacity table (linear between the usable levels)."""
        cap, used = self.capacity, self.used
        if need <= cap[0]:
            return 0.0
        for a, b in zip(used, used[1:]):
            if need <= cap[b]:
                return a + (b - a) * (need - cap[a]) / (cap[b] - cap[a])
        return float(used[-1])

    def lowest(self, need: float) -> int:
        """The lowest usable level whose capacity is at least `need` (none: the top usable one)."""
        return next((j for j in self.used if self.capacity[j] >= need), self.used[-1])

    def _set(self, level: int, now: float) -> bool:
        if level == self.level:
            return False
        self.seconds[self.level] += now - self.since
        self.level, self.since = level, now
        return True

    def tick(self, now: float, running, waiting: int) -> bool:
        arrived = self.admitted + waiting - self.queued
        self.admitted, self.queued = 0, waiting
        decay = math.exp(-(now - self.last) / self.tau_s)
        self.count = self.count * decay + arrived
        self.span = self.span * decay + self.tau_s * (1.0 - decay)
        self.last = now
        if now - self.last_tick < self.target.period_s:
            return False
        self.last_tick = now
        need = self.need()
        if self.mix:
            x = min(float(self.used[-1]), self.slope * self.read(need))
            lo = max(j for j in self.used if j <= x)  # x between two usable levels: a share frac at the upper
            self.hi = next((j for j in self.used if j > lo), lo)
            self.frac = (x - lo) / (self.hi - lo) if self.hi > lo else 0.0
            self.reason = f"{self.rate():.2f} req/s (less {self.z:g} s.e.: {need:.2f}): level {x:.2f}"
            return self._set(lo, now)
        up = self.lowest(need)
        if up > self.level:
            self.reason = f"{need:.2f} req/s over level {self.level}'s capacity: up"
            return self._set(up, now)
        down = self.lowest((1.0 + self.band) * need)
        if down < self.level and now - self.since >= self.hold_s:
            self.reason = f"{need:.2f} req/s x {1 + self.band:g} within level {down}'s capacity: down"
            return self._set(down, now)
        return False

    def time_per_level(self, now: float) -> list[float]:
        out = list(self.seconds)
        out[self.level] += now - self.since
        return out


class Pinned(Capacity):
    """One level throughout (what a level's SLO capacity is measured with)."""

    def __init__(self, budgets: tuple[int, ...], level: int) -> None:
        super().__init__(Target(1.0), budgets, [0.0] * len(budgets), 0.0)
        self.level = level

    def admit(self) -> int:
        return self.level

    def tick(self, now, running, waiting) -> bool:
        return False


def stream_tpot_p90(res: SimResult, since: float = 0.0) -> float:
    """p90 TPOT (ms) of the requests sent at `since` s or later (numpy's percentile, as SGLang's client)."""
    m = (res.arrival >= since) & (res.output > 1)
    x = (res.e2e[m] - res.ttft[m]) / (res.output[m] - 1) * 1e3
    return float(np.percentile(x, 90)) if len(x) else math.nan
