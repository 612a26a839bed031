"""Elastic depth: under a latency target, a server skips only as much as its load requires.

A ladder of caps on the skipper: level j caps every request it admits at max_skip LADDER[j] (a budget
of k_j of the L routed layers, vskipper/control.py), so level 0 is the base model's function and the
top level is the skipper alone. A request's level is fixed when the server admits it and kept to its
last token; its own `vskipper` field still caps it (the stricter wins). The level reaches the routed
layers as the request's budget, through the same per-row budget buffer as the request field.

The rule, once per control period (`Target.period_s`), from what the scheduler knows:
    step   = the time between two decode steps: what a running stream sees between two tokens (a
             prefill run between them included); the last HISTORY steps are kept, at whatever level
    s, d   = what one row saves per routed layer of budget, and what a step pays for running the routed
             path at all, in ms, on this server (Saving): fitted to the measured prefill-free steps
             (step = a + b T + c C - s B + d D: T rows, B the sum of their budgets, C their context
             tokens, D 1 where some row's budget is above 0, a constant per busy episode), with the
             calibration's price of skipping (StepModel) as s's prior until rows at several budgets ran;
             d is 0 unless the fit has it SURE standard errors above 0 (a batch whose rows are all at
             budget 0 runs SGLang's own layers: no router, no routed path)
    step_j = step - s (T k_j - B) + d (D_j - D): the same step had its rows run at level j (the measured
             step says what it costs here, batch size, prefills and host included; s and d how it moves
             with the budgets)
    est_j  = the 90th percentile, over every run of STREAM consecutive steps of the last HISTORY, of their mean step_j:
             a stream's TPOT is the mean of its gaps, so est_j is the p90 TPOT of the recent streams
             had they run at level j (est_c, at the level c of the steps, is simply what they saw)
    ahead_j = the mean step_j over the last STREAM steps, moved to the n rows running and queued at the tick
             by what one more row costs a step here (Saving's b, and c times a row's mean context: 0 until
             steps of several batch sizes ran), less its saving at level j: the gap the streams of the moment
             will see while the batch stays that size
    no calibration                    -> level 0 (nothing to predict with; said once in the log)
    no running or queued request      -> level 0 (idle; the steps kept are dropped)
    fewer than DWELL steps kept, or DWELL since the level changed -> keep (measuring); at level 0 the
          DWELL steps count once the batch has drained of rows admitted higher (at most DRAIN steps):
          until then the steps show neither level 0 nor what the routed path costs
    miss_j = max(est_j, ahead_j): what the recent streams saw, or the batch of the moment will cost, at level j
    debt   = the miss run up at level c: each tick adds the decode steps since the last tick times
             miss_c / tpot - 1 (a tick under the target pays back), never below 0; in steps' worth of the
             target (a miss by 10% for 80 steps, by 20% for 40, runs up 8)
    over: miss_c > tpot now and debt >= DEBT, or est_c > SURGE * tpot
          -> the lowest level above c with miss_j <= DOWN * tpot (inside the band, so the
          next period does not fall straight back, and with a margin for the estimate); if none, the
          top (the most the skipper can give; its measured steps then teach the saving). Over the
          target there is no verdict that skipping "saves nothing": the saving fitted in service mixes
          the depth with the load (a busy spell starts at level 0 and reaches the top at its heaviest),
          and such verdicts sent RandomSkip 0.5 to level 0 under loads where its top ran faster; a
          skipper that saves nothing costs its quality only while the target is missed anyway
    over: p90 TTFT > ttft -> c + 1
    under: the lowest level j below c with miss_j <= DOWN * tpot (and p90 TTFT <= DOWN * ttft), judged over
          the last STREAM steps, once that many ran at c (the streams of the moment) -> j (the gap between 1 and
          DOWN is the hysteresis; straight to the level that fits, not one at a time)
    else keep.
Up on the miss the streams have run up, down as soon as a stream's length of steps says a lower level fits.
Near the knee the estimate runs over the target in bursts of tens of seconds (arrivals, or a busy neighbour
on the machine) that decide a minute's p90 TPOT, while over HISTORY steps it is nearly their worst stream, so a
busy spell's first seconds, or a burst of a few seconds, put it over at loads where the p90 over every
stream meets the target. A level reaches only the requests admitted after it is set, and those reach the
batch over a stream's lifetime, so a rise must come within seconds of a burst that matters and leave as
soon as it is over, and a short or slight miss must not raise it: the debt weighs a miss by how far over
and how long (a wait for a fixed share of a fixed span came after the bursts that set a step's p90, and a
rise on the first miss with a fall only after several streams' lengths at the level skipped far more than
the load needed: docs/architecture.md). Falls go straight to the level that fits, judged
over the steps of the level alone: a lull between bursts may take it down, and the next burst runs up
its debt again. A miss over SURGE times the target rises at the first decision. The first decision of a
busy spell comes after DWELL steps (a few seconds), its estimate the mean of the steps so far.
Steps are judged over a stream's length: one step carrying a new request's prefill is several times a
decode step, so a rule that read a few steps' p90 swung between level 0 and the top. The running count
moves with every arrival, and a rule that priced it alone swung too; but the steps alone see a burst only
as its rows run, after the streams it admitted at level 0 have begun to miss. So the batch of the moment
is priced (ahead_c) and enters through the debt: a tick adds at most its own steps' worth of its miss,
and a burst that holds runs up its debt from its first ticks, not once its streams have run.
The calibration prices layers, not a server's whole step, and on a CPU at small batches it prices skipping
at almost nothing where whole steps at the skipper's depth run 10-25% faster: the saving is therefore learned
from the server's own steps once it has run more than one depth; before that, where the prior sees no
level that fits, the rule goes to the top and lets the measured steps bring it down.
Saving keeps the last LEARN steps: once the top's steps have left them, the prior speaks again and the top
is tried again, so a saving that grows with the load (larger batches) is found.
Plain host arithmetic (a 3-column least squares over a few hundred steps) once per period; nothing runs
on the device."""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from vskipper.control import RequestControl

LADDER = (0.0, 0.25, 0.5, 0.75, 1.0)  # max_skip of each level
DWELL = 16  # decode steps at a new level (or of a new busy spell) before the rule decides (again)
STREAM = 32  # decode steps a stream's TPOT is judged over (a typical answer's length)
DRAIN = 4 * STREAM  # at level 0, decode steps the rule waits at most for DWELL steps of a drained batch
HISTORY = 2 * STREAM  # decode steps kept: est_j is judged over them
DEBT = 8.0  # steps' worth of the target the streams must have missed it by at a level before a rise ...
SURGE = 1.5  # ... unless they miss it by this factor: then at once
WINDOW = 64  # first-token times kept
DOWN = 0.85  # a level is moved to (down, or up short of the top) only if predicted within this share of the target
LEARN = 512  # prefill-free decode steps the saving is fitted over (kept across idle)
PRIOR = 1  # steps' worth of weight on the calibration's saving, at budget sums spanning the ladder
FLOOR = 0.25  # a step priced at any level keeps at least this share of its measured time
SURE = 2.0  # standard errors: what running the routed path costs (d) counts only this far above 0


def parse_ms(name: str, value) -> float | None:
    """A latency target in milliseconds from a setting (None or "" = unset); ValueError naming `name`."""
    if value is None or value == "":
        return None
    try:
        ms = float(value)
    except (TypeError, ValueError):
        ms = math.nan
    if not (math.isfinite(ms) and ms > 0):
        raise ValueError(f"{name}={value!r} must be a positive number of milliseconds")
    return ms


@dataclass(frozen=True)
class Target:
    tpot_ms: float
    ttft_ms: float | None = None
    period_s: float = 1.0

    def __post_init__(self) -> None:
        for name in ("tpot_ms", "ttft_ms", "period_s"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"Target.{name} must be a positive number, got {v!r}")


def ladder(n_layers: int) -> tuple[int, ...]:
    """Budgets (routed layers a token may skip) of the levels, lowest first, duplicates dropped."""
    return tuple(sorted({RequestControl(m).budget(n_layers) for m in LADDER}))


def p90(xs) -> float:
    s = sorted(xs)
    return s[max(0, math.ceil(0.9 * len(s)) - 1)]


class StepModel:
    """One decode step of T rows, in ms, as the cost calibration (vskipper/cost.py) prices it: each
    routed layer (rank r of L) at the RUN fraction its rows give it (a row whose budget is <= r RUNs,
    the others RUN at the skipper's `run_fraction`), in the cheapest of `bodies`, plus the unrouted
    layers as dense ones. Attention over long contexts, lm_head and the host are not in it; the rule
    takes them from the measured step."""

    def __init__(self, calibration, bodies: tuple[str, ...], n_layers: int, n_routed: int,
                 run_fraction: float | None) -> None:
        self.cal, self.bodies = calibration, tuple(b for b in bodies if b in calibration.bodies()) or ("dense",)
        self.n_layers, self.n_routed = n_layers, n_routed
        self.f = 0.5 if run_fraction is None else run_fraction
        self._memo: dict[tuple[int, ...], float] = {}  # each fit asks at the steps' mean T; it repeats

    def __call__(self, budgets) -> float:
        key = tuple(sorted(budgets))
        ms = self._memo.get(key)
        if ms is None:
            if len(self._memo) > 4096:
                self._memo.clear()
            ms = self._memo[key] = self._price(key)
        return ms

    def _price(self, budgets: tuple[int, ...]) -> float:
        T = max(1, len(budgets))
        ms = (self.n_layers - self.n_routed) * self.cal.predict("dense", T, 1.0)
        for r in range(self.n_routed):
            f = sum(1.0 if b <= r else self.f for b in budgets) / T if budgets else 1.0
            ms += min(self.cal.predict(b, T, f) for b in self.bodies)
        return ms


def stream_p90(xs, stream: int = STREAM) -> float | None:
    """The 90th percentile, over every run of `stream` consecutive values (all of them, when fewer are
    kept), of their mean."""
    xs = list(xs)
    if not xs:
        return None
    w = min(stream, len(xs))
    total, means = 0.0, []
    for i, x in enumerate(xs):
        total += x - (xs[i - w] if i >= w else 0.0)
        if i >= w - 1:
            means.append(total / w)
    return p90(means)


class Saving:
    """What skipping saves on this server, learned from its own decode steps: a least-squares fit of
    step ms = a_e + b T + c C - s B + d D over the last LEARN steps that ran no prefill (T rows, B the sum
    of their budgets, C the tokens of context they attend over, D 1 where some row's budget is above 0,
    a_e one constant per busy episode: the machine and the prompts of one burst are not those of the
    next), so s is the ms one row saves per routed layer of budget and d what a step pays for running the
    routed path at all (a step whose rows are all at budget 0 runs SGLang's own layers: no router, no
    routed body), both judged only between steps of the same episode. Steps at one depth cannot tell s
    from the batch's size, so the fit leans on a prior: the share of a step the calibration prices a
    level's skipping at (at the steps' mean T), weighted as PRIOR steps whose budget sums span the
    ladder; once the server has run rows at several budgets the measured steps take over. d has no prior:
    0 unless the fit has it SURE standard errors above 0. On a CPU at small batches the calibration prices
    skipping at almost nothing (it prices layers, not attention over the context nor the host) while
    whole steps at the skipper's depth run 10-25% faster. Kept across idle: what a skipped layer saves
    does not change with the load."""

    def __init__(self, model: StepModel | None, top: int) -> None:
        self.model, self.top = model, max(1, top)
        self.steps: deque[tuple[float, int, int, int, int, int]] = deque(maxlen=LEARN)  # (ms, T, B, C, D, episode)
        self.episode = 0
        self.value: float | None = None  # s, refitted by fit()
        self.routed = 0.0  # d, refitted by fit()
        self.row = 0.0  # b plus c times a row's mean context: what one more row costs a step, refitted by fit()
        self.prior: float | None = None

    def add(self, ms: float, budgets, context: int = 0) -> None:
        B = sum(budgets)
        self.steps.append((ms, len(budgets), B, context, int(B > 0), self.episode))

    def new_episode(self) -> None:
        """The server went idle: the next steps are compared among themselves."""
        self.episode += 1

    def _within(self) -> np.ndarray:
        """(ms, T, B, C, D) of the steps kept, less their episode's mean."""
        cols = np.array([s[:5] for s in self.steps], dtype=float)
        episodes = np.array([s[5] for s in self.steps])
        for e in np.unique(episodes):
            rows = episodes == e
            cols[rows] -= cols[rows].mean(0)
        return cols

    def _mean_t(self) -> int:
        return max(1, round(sum(s[1] for s in self.steps) / len(self.steps)))

    def _span(self) -> float:
        """The budget sum's spread that PRIOR steps spanning the ladder give, at the steps' mean T."""
        return math.sqrt(PRIOR) * self._mean_t() * self.top / 2

    def fit(self) -> float | None:
        if not self.steps:
            return self.value
        t = self._mean_t()
        share = 0.0
        if self.model is not None:  # the calibration's saving per unit of budget, as a share of a step
            share = max(0.0, 1.0 - self.model([self.top] * t) / max(self.model([0] * t), 1e-9)) / self.top
        self.prior = share * sum(s[0] for s in self.steps) / len(self.steps) / t
        cols, w = self._within(), self._span()
        episodes = len({s[5] for s in self.steps})
        coef, cov = self._least_squares(cols, w, episodes, routed=True)
        if coef is not None and (cov is None or not coef[3] > SURE * math.sqrt(max(0.0, cov[3, 3]))):
            # d not surely above 0 (no episode ran steps on both sides of it, or too few, or the steps with
            # skipping rows all ran at one depth, where s and d are one number): priced at 0
            coef, cov = None, None
        if coef is None:
            coef, cov = self._least_squares(cols, w, episodes, routed=False)
        self.value, self.routed = max(0.0, float(coef[1])), float(coef[3]) if len(coef) > 3 else 0.0
        context = sum(s[3] for s in self.steps) / max(1, sum(s[1] for s in self.steps))
        self.row = max(0.0, float(coef[0]) + max(0.0, float(coef[2])) * context)
        return self.value

    def _least_squares(self, cols: np.ndarray, w: float, episodes: int, routed: bool):
        """(b, s, c[, d]) and their covariance (None with no degrees of freedom left); None, None where
        `routed` and no episode's steps ran on both sides of D."""
        if routed and not np.any(cols[:, 4]):
            return None, None
        X = np.column_stack([cols[:, 1], -cols[:, 2], cols[:, 3]] + ([cols[:, 4]] if routed else []))
        X = np.vstack([X, [0.0, w, 0.0] + ([0.0] if routed else [])])  # the prior, on s
        y = np.append(cols[:, 0], w * self.prior)
        coef = np.linalg.lstsq(X, y, rcond=None)[0]
        dof = len(y) - X.shape[1] - episodes  # an episode's mean took one each
        if dof <= 0:
            return coef, None
        resid = y - X @ coef
        return coef, float(resid @ resid) / dof * np.linalg.pinv(X.T @ X)  # the usual least-squares covariance

    def learned(self) -> bool:
        """Whether the steps say more about s than the prior does (their budget sums spread wider within
        their episodes)."""
        return bool(self.steps) and float((self._within()[:, 2] ** 2).sum()) > self._span() ** 2


class Controller:
    """The rule above. `admit()` is the level a request leaving the queue now is admitted at; the scheduler calls
    `decode_step`, `prefill`, `first_token`, `idle` and `tick` as things happen (times in seconds)."""

    def __init__(self, target: Target, budgets: tuple[int, ...], model: StepModel | None, now: float) -> None:
        self.target, self.budgets, self.model = target, budgets, model
        self.top = len(budgets) - 1
        self.level = 0
        self.reason = "measuring" if model is not None else "no cost calibration: level 0"
        self.steps: deque[tuple[float, int, int]] = deque(maxlen=HISTORY)  # (ms, T, B) of each step
        self.saving = Saving(model, budgets[-1])
        self.fresh = 0  # decode steps since the level changed (at level 0: since the batch drained of skipping rows)
        self.count = 0  # decode steps timed
        self.debt = 0.0  # the miss run up at this level (of this busy spell), in steps' worth of the target
        self.judged: int | None = None  # self.count at the last tick that judged the level (of this busy spell)
        self.drain = 0  # decode steps since the level changed
        self.last_seen: float | None = None  # stream p90 TPOT of the steps last dropped at idle
        self.ttfts: deque[float] = deque(maxlen=WINDOW)  # ms, since the level last changed
        self.last_step: float | None = None
        self.prefilled = False  # a prefill ran since the last decode step
        self.last_tick = self.since = now
        self.seconds = [0.0] * len(budgets)  # time spent at each level

    def admit(self) -> int:
        return self.level

    def decode_step(self, now: float, budgets, prefill: bool = False, context: int = 0) -> None:
        """A decode step ended at `now`; `budgets`: its rows' budgets; `prefill`: it carried prefill work;
        `context`: the tokens its rows attend over."""
        budgets = list(budgets)
        if self.last_step is not None:
            ms = (now - self.last_step) * 1e3
            self.steps.append((ms, len(budgets), sum(budgets)))
            self.count += 1
            if not (prefill or self.prefilled):
                self.saving.add(ms, budgets, context)
            # at level 0, steps whose batch still holds rows admitted higher do not show level 0
            if self.level > 0 or not any(budgets):
                self.fresh += 1
            self.drain += 1
        self.last_step, self.prefilled = now, False

    def prefill(self) -> None:
        """A prefill batch ran: the next decode step's gap carries it (it counts for TPOT, not for Saving)."""
        self.prefilled = True

    def first_token(self, seconds: float) -> None:
        self.ttfts.append(seconds * 1e3)

    def idle(self) -> None:
        self.last_step = None  # the next step time starts with the next decode step

    def _set(self, level: int, reason: str, now: float) -> bool:
        self.reason = reason
        if level == self.level:
            return False
        self.seconds[self.level] += now - self.since
        self.level, self.since = level, now
        self.fresh = self.drain = 0
        self.debt, self.judged = 0.0, None
        self.ttfts.clear()
        return True

    def follow(self, level: int, now: float) -> None:
        """On a rank that does not decide: the level the deciding rank admitted the last request at."""
        self._set(level, "the level of the rank that receives the requests", now)

    def recent(self) -> list[tuple[float, int, int]]:
        """The last HISTORY steps: what est_j is judged over."""
        return list(self.steps)

    def observed(self) -> float | None:
        """The p90 TPOT of a stream over the last HISTORY steps (ms), whatever the level (idle: the last one)."""
        seen = stream_p90(ms for ms, _, _ in self.recent())
        return self.last_seen if seen is None else seen

    def estimates(self, s: float | None = None, steps=None) -> list[float]:
        """est_j of every level (ms): each of `steps` (default the last HISTORY), priced at level j by what
        skipping saves here (or by `s` ms per row and routed layer of budget) and what running the routed
        path at all costs."""
        if s is None:
            s = self.saving.fit() or 0.0
        steps = self.recent() if steps is None else steps
        return [stream_p90(self._priced(steps, s, k)) for k in self.budgets]

    def _priced(self, steps, s: float, k: int) -> list[float]:
        """step_j of each of `steps` at the level whose budget is k (s: ms one row saves per routed layer of budget)."""
        d = self.saving.routed
        return [max(FLOOR * ms, ms - s * (T * k - B) + d * ((k > 0) - (B > 0))) for ms, T, B in steps]

    def ahead(self, s: float, n: int, steps=None) -> list[float]:
        """ahead_j of every level (ms): the mean of `steps` (default the last STREAM) priced at level j, moved
        to a batch of `n` rows at level j by what a row costs here (Saving.row, less its saving at level j):
        the gap the streams running and queued now will see, while the batch stays that size."""
        steps = self.recent()[-STREAM:] if steps is None else steps
        if not steps:
            return [0.0] * len(self.budgets)
        T = sum(t for _, t, _ in steps) / len(steps)
        means = [sum(self._priced(steps, s, k)) / len(steps) for k in self.budgets]
        return [max(FLOOR * m, m + (n - T) * max(0.0, self.saving.row - s * k)) for m, k in zip(means, self.budgets)]

    def tick(self, now: float, running: list[int], waiting: int) -> bool:
        """running: budgets of the running requests. Returns whether the level changed."""
        n = len(running) + waiting
        if self.model is None:
            return False
        if n == 0:
            if self.steps:  # the load went; what it measured says nothing about the next
                self.last_seen = self.observed()
                self.steps.clear()
                self.saving.new_episode()
            self.debt, self.judged = 0.0, None
            return self._set(0, "idle", now)
        if now - self.last_tick < self.target.period_s:
            return False
        self.last_tick = now
        if len(self.steps) < DWELL or (self.fresh < DWELL and self.drain < DRAIN):
            return self._set(self.level, "measuring", now)
        t, c = self.target, self.level
        seen = self.observed()
        est = self.estimates()
        s = self.saving.value or 0.0  # as fitted for est: one fit a tick
        ahead = self.ahead(s, n)
        ttft = p90(self.ttfts) if self.ttfts else None
        ttft_over = t.ttft_ms is not None and ttft is not None and ttft > t.ttft_ms
        ttft_under = t.ttft_ms is None or ttft is None or ttft <= DOWN * t.ttft_ms
        load = (f"stream p90 TPOT {seen:.1f} ms, {len(running)} running, {waiting} queued; predicted per level "
                + " ".join(f"{j}:{e:.0f}" for j, e in enumerate(est)) + f" ms, for the {n} running and queued "
                + " ".join(f"{j}:{e:.0f}" for j, e in enumerate(ahead)) + " ms; " + self.describe_saving())
        miss = max(est[c], ahead[c])
        over = miss > t.tpot_ms
        debt = self._owe(miss)
        missed = f"missed by {debt:.1f} steps' worth of it at level {c}"
        if over and (debt >= DEBT or est[c] > SURGE * t.tpot_ms):
            fits = [j for j in range(c + 1, self.top + 1) if max(est[j], ahead[j]) <= DOWN * t.tpot_ms]
            j, why = ((fits[0], "") if fits else
                      (self.top, f", no level predicted within {DOWN:g} x target: the top"))
            how = missed if debt >= DEBT else f"over {SURGE:g} x target"
            return self._set(j, f"TPOT {miss:.1f} ms at level {c} over target {t.tpot_ms:g} ms{why} "
                                f"({how}; {load})", now)
        if ttft_over and c < self.top:
            return self._set(c + 1, f"TTFT p90 {ttft:.0f} ms over target {t.ttft_ms:g} ms ({load})", now)
        if c > 0 and ttft_under:  # judged over the level's own steps: the last STREAM (or the DWELL and more run)
            since = list(self.steps)[-min(self.fresh, STREAM):]
            low = [max(e, a) for e, a in zip(self.estimates(s, since), self.ahead(s, n, since))]
            if low[c - 1] <= DOWN * t.tpot_ms:
                j = next(j for j in range(c) if low[j] <= DOWN * t.tpot_ms)
                if self.fresh < STREAM:
                    return self._set(c, f"holding: level {j} predicted at {low[j]:.1f} ms, within {DOWN:g} x "
                                        f"target, after {self.fresh} of the {STREAM} steps at level {c} a fall "
                                        f"waits for ({load})", now)
                return self._set(j, f"level {j} predicted at {low[j]:.1f} ms over the {len(since)} steps at level "
                                    f"{c}, within {DOWN:g} x target {t.tpot_ms:g} ms ({load})", now)
        if over:
            return self._set(c, f"holding: TPOT {miss:.1f} ms at level {c} over target {t.tpot_ms:g} ms, {missed}; "
                                f"a rise at {DEBT:g} ({load})", now)
        return self._set(c, f"holding ({load})", now)

    def _owe(self, est: float) -> float:
        """Add this tick's miss to the debt (the decode steps since the last tick times miss_c's excess over the
        target, a share of it; under the target it pays back, to 0 at most); returns the debt."""
        if self.judged is not None:
            self.debt = max(0.0, self.debt + (self.count - self.judged) * (est / self.target.tpot_ms - 1.0))
        self.judged = self.count
        return self.debt

    def describe_saving(self) -> str:
        sv = self.saving
        if sv.value is None:
            return "skipping's saving not measured yet"
        return (f"a row saves {sv.value:.3f} ms per routed layer of budget ("
                + ("measured" if sv.learned() else "the calibration's prior")
                + f", {len(sv.steps)} steps; prior {sv.prior:.3f}); a step running the routed path pays "
                + (f"{sv.routed:.2f} ms for it" if sv.routed else "nothing measured for it"))

    def time_per_level(self, now: float) -> list[float]:
        out = list(self.seconds)
        out[self.level] += now - self.since
        return out

    def describe(self, now: float) -> str:
        seen = self.observed()
        spent = " ".join(f"{j}:{s:.1f}s" for j, s in enumerate(self.time_per_level(now)) if s > 0)
        return (f"elastic level {self.level}/{self.top} (skips at most {self.budgets[self.level]} of "
                f"{self.budgets[-1]} routed layers): {self.reason}; target TPOT {self.target.tpot_ms:g} ms"
                + (f", TTFT {self.target.ttft_ms:g} ms" if self.target.ttft_ms else "")
                + (f"; observed stream p90 TPOT {seen:.1f} ms" if seen is not None else "")
                + f"; time per level {spent}")
