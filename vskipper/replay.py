"""Two captured forms per batch size, and the host's choice of which to replay, per decode step.

Under CUDA graphs a captured step keeps the body it was captured with, whatever the context of the
steps that replay it; yet whether routing pays depends on the context, since what a skipped row saves
is mostly the K/V its attention would read (cost.py, the decode table's context axis). So an engine
that captures decode steps captures each batch size twice, with every routed layer forced to its dense
body and to its routed body (`forced`, on an `execution="auto"` model: routed_layer.AutoBody), and
before each replay picks the graph on the host:

    form = ReplayChooser.choose(T, resident)          # no device read
    graphs[T, form].replay()
    ReplayChooser.observe()                           # starts a non-blocking copy of the route counts

`choose` is `replay_form`, a pure function of the decode calibration, T (the captured batch size), the
step's resident K/V tokens (host-side lengths: SGLang's seq_lens_sum, a harness's B x C), the RUN
fraction and the form replayed last at T (hysteresis: the other form must be predicted cheaper by
more than `margin`). The RUN fraction is an EMA of the routed layers' decode counts (the route counters
a replay updates on the device), copied to pinned host memory without blocking (cost.HostCopy) and
folded in once a copy has landed; until then, the skipper's declared expected fraction. Every form
computes the skipper's function (the one principle): this picks how, never what.

Under tensor parallelism every rank must replay the same form (the forms' collectives differ), so a
`lockstep` chooser folds the copy of the step `LAG` steps back on every rank, waiting for its event
(complete by then: a serving engine's host runs at most one step ahead of its device), instead of
whichever copy has landed.

Engines: benchmarks/gpu/decode.py (the harness's `auto`), integrations/sglang/graphs.py (SGLang's
decode CUDA-graph runner, through the plugin's hooks).
"""
from __future__ import annotations

import contextlib

import torch

from vskipper import cost
from vskipper.counters import DECODE

FORMS = ("dense", "routed")
LAG = 2  # lockstep: steps between a replay and the fold of its counts


def replay_form(calibration: cost.Calibration, T: int, resident: int | None, f, current: str | None = None,
                margin: float = 0.03, routed: str = "routed", rows: int | None = None) -> str:
    """The form ("dense" or "routed") predicted cheaper for a captured step of T rows whose `rows` real
    rows (default T) hold `resident` K/V tokens in all (None: unknown, priced at the smallest context
    timed), at RUN fraction f (a sublayer table's: (f_attn, f_mlp)); `routed` is the body the routed
    form runs ("routed" or "routed-mlp"). With hysteresis: `current` is kept unless the other form is
    predicted cheaper by more than `margin`."""
    if current is not None and current not in FORMS:
        raise ValueError(f"replay_form: current={current!r} is not one of {list(FORMS)}")
    context = None if resident is None else resident / max(rows or T, 1)
    body = calibration.choose(T, f, None if current is None else "dense" if current == "dense" else routed,
                              margin, ("dense", routed), context)
    return "dense" if body == "dense" else "routed"


class ReplayChooser:
    """The per-step choice between the two captured forms (the module docstring), for one model.

    calibration  the decode table (cost.Calibration) the model's AutoBody layers price with
    routed       the body the routed form runs (AutoBody.routed_form)
    expected     the RUN fraction to plan with until counts land (the skipper's declared one, else 0.5)
    counters     the model's route counters (counters.RouteCounter / SublayerRouteCounter), whose
                 cumulative decode counts the EMA is folded from; None: no EMA (always `expected`)
    lockstep     fold the counts of the step LAG back, waiting for them (tensor parallelism)
    event        the event type of the copies (CUDA's by default; a test's stand-in on CPU)"""

    def __init__(self, calibration: cost.Calibration, routed: str = "routed", expected: float | None = None,
                 counters=None, margin: float = 0.03, ema: float = 0.5, lockstep: bool = False, event=None,
                 bodies=()) -> None:
        if calibration.phase != "decode":
            raise ValueError(f"ReplayChooser: a {calibration.phase!r} table; replayed graphs are decode steps")
        self.cal, self.routed, self.margin, self.alpha = calibration, routed, margin, ema
        self.width = 2 if calibration.sublayers else 1
        self.expected = 0.5 if expected is None else float(expected)
        self.counters = list(counters or ())
        self.lockstep, self.event = lockstep, event
        self.bodies = list(bodies)  # the model's AutoBody layers: their `chosen` counts what replays ran
        self.current: dict[int, str] = {}  # T -> the form replayed last (hysteresis)
        self.fraction: tuple[float, ...] | None = None  # EMA of the RUN fractions seen
        self.replays = dict.fromkeys(FORMS, 0)
        self._copy = cost.HostCopy(event)
        self._last: list[int] | None = None  # the cumulative counts last folded
        self._ring: list = []  # lockstep: LAG + 1 (pinned host buffer, event) slots
        self._steps = 0
        self._memo: dict[tuple, str] = {}

    @classmethod
    def for_model(cls, model, lockstep: bool = False, event=None, margin: float = 0.03) -> "ReplayChooser | None":
        """The chooser of a transformed model whose routed layers run `auto` (None if none does: a model
        without a calibration runs dense-masked, one form is all there is)."""
        from vskipper.routed_layer import AutoBody

        state = getattr(model, "vskipper", None)
        autos = [b for b in (state.bodies.values() if state is not None else ()) if isinstance(b, AutoBody)]
        if not autos:
            return None
        chooser = autos[0].chooser
        return cls(chooser.tables[True], autos[0].routed_form, chooser.expected if chooser.declared else None,
                   [state.counters[str(l)] for l in state.bodies if isinstance(state.bodies[l], AutoBody)],
                   margin=margin, ema=chooser.alpha, lockstep=lockstep, event=event, bodies=autos)

    def f(self):
        """The RUN fraction the choice reads: the EMA, or `expected` before any count landed."""
        f = self.fraction if self.fraction is not None else (self.expected,) * self.width
        return f[0] if self.width == 1 else f

    def choose(self, T: int, resident: int | None, rows: int | None = None) -> str:
        """The form to replay for a step of T (captured) rows, `rows` of them real, holding `resident`
        K/V tokens (host-side; None: unknown)."""
        f = self.f()
        ck = cost.context_key(resident, rows or T)
        key = (T, ck, tuple(round(x * 100) for x in (f if self.width == 2 else (f,))), self.current.get(T))
        form = self._memo.get(key)
        if form is None:
            if len(self._memo) > 4096:
                self._memo.clear()
            c = cost.bucket_context(ck)
            form = self._memo[key] = replay_form(self.cal, T, None if c is None else c * T, f, self.current.get(T),
                                                 self.margin, self.routed)
        self.current[T] = form
        return form

    def ran(self, form: str) -> None:
        """Count a replay of `form` (and, in each AutoBody's `chosen`, a step of the body it runs)."""
        self.replays[form] += 1
        for b in self.bodies:
            b.chosen[b.form_body(form)] += 1

    def _stacked(self) -> torch.Tensor:
        """The routed layers' cumulative decode counts, one row per layer: [L, k] (k: 3 or 4)."""
        return torch.stack([c.counts[DECODE] for c in self.counters])

    def observe(self) -> None:
        """After a replay: start copying the route counters' decode counts to the host, and fold the
        counts that have landed into the EMA (lockstep: those of the step LAG back)."""
        if not self.counters:
            return
        t = self._stacked()
        if t.is_cpu and self.event is None:  # no device to wait for (a test's event: the copy path on CPU)
            self._fold(t.tolist())
        elif not self.lockstep:
            seen = self._copy.push(t)
            if seen is not None:
                self._fold(seen)
        else:  # a ring of LAG + 1 pinned buffers: step n writes slot n, folds the slot of step n - LAG
            if not self._ring:
                self._ring = [(torch.zeros(t.shape, dtype=t.dtype, pin_memory=t.is_cuda),
                               (self.event or torch.cuda.Event)()) for _ in range(LAG + 1)]
            n, self._steps = self._steps, self._steps + 1
            host, done = self._ring[n % (LAG + 1)]
            host.copy_(t, non_blocking=True)
            done.record()
            if n >= LAG:
                host, done = self._ring[(n - LAG) % (LAG + 1)]
                done.synchronize()  # LAG steps old: complete, in an engine whose host runs one step ahead
                self._fold(host.tolist())

    def _fold(self, rows: list[list[int]]) -> None:
        """Fold cumulative per-layer counts [[tokens, run (, mlp run), ...], ...] into the EMA: the
        fraction of the rows counted since the last fold that RUN."""
        now = [sum(col) for col in zip(*rows)]  # summed over the layers
        last, self._last = self._last, now
        if last is None:
            return
        tokens = now[0] - last[0]
        if tokens <= 0:
            return
        seen = tuple((now[1 + i] - last[1 + i]) / tokens for i in range(self.width))
        self.fraction = seen if self.fraction is None else tuple(
            self.alpha * s + (1 - self.alpha) * p for s, p in zip(seen, self.fraction))

    def describe(self) -> str:
        return (f"both forms captured per batch size, the one replayed chosen on the host per step from the "
                f"resident K/V and the RUN fraction (EMA of the route counts, {self.expected:g} until they land)"
                f"{'; lockstep over ranks' if self.lockstep else ''}")


@contextlib.contextmanager
def forced(model, form: str):
    """Within: every `auto` routed layer of `model` runs the body of `form` ("dense" or "routed"), as a
    graph of that form is captured (or, eagerly, as it replays)."""
    from vskipper.routed_layer import AutoBody

    if form not in FORMS:
        raise ValueError(f"forced: form {form!r} is not one of {list(FORMS)}")
    state = getattr(model, "vskipper", None)
    autos = [b for b in (state.bodies.values() if state is not None else ()) if isinstance(b, AutoBody)]
    before = [b.forced for b in autos]
    for b in autos:
        b.forced = form
    try:
        yield
    finally:
        for b, was in zip(autos, before):
            b.forced = was
