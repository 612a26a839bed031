"""Profitability: per routed layer and batch, the cheapest of the bodies (vskipper/routed_layer.py):
dense-masked, routed, and routed-mlp (attention for every row, MLP and adapter routed).

All bodies compute the same function (the one principle): the cost model chooses how, never
what. It is two tables of times measured on this device by `vskipper calibrate`, one per phase:
decode (a decode step of one routed layer in each body, over a grid of batch sizes T, RUN fractions f
and contexts c, the resident K/V tokens each row attends) and prefill (an extend of one prompt of T
tokens, the same grid of f; prefill is compute-bound and attention grows with T, so the decode table
misprices it). Each context's table is read as: dense, one time per T; a routed body, the cell's paired
body/dense ratio times that, at the cell's real RUN fraction, non-decreasing in f; linear in f within a
grid row, linear in log2 T between rows (Calibration._rows, predict). Between contexts the time is
linear in c (a decode step's attention reads its K/V once); past the largest, linear in c along the
last two (never falling); below the smallest, the smallest's. Where a step's context is unknown (a
captured graph's plan, callers that price T alone) the smallest context's table prices it. The break-
even resident K/V V* (break_even) is read off these tables: the K/V a step must hold for the routed
body to cost no more than the dense one. Calibrations are cached per device name, shape and
torch / triton / vskipper versions; a mismatch is ignored with a warning, never trusted.

Where the choice is made: in `Chooser.choose` (held by routed_layer.AutoBody), on the host,
once per routed layer and step, from T (the row count, a shape), the step's resident K/V (a decode
step's: AttentionPart.resident_tokens, host-side lengths) and the layer's RUN fraction:
  - on CPU the route counts are read directly (no device to wait for);
  - on an accelerator the fraction is an EMA of earlier steps' counts, copied to pinned host
    memory without blocking and read once its copy has landed: the choice never waits for the device;
  - inside CUDA-graph capture nothing is read: the body is planned from the calibration, T and the
    skipper's declared expected RUN fraction, so it is fixed per captured batch size (`plan`);
    where both forms are captured per batch size, the host picks the graph to replay per step
    (vskipper/replay.py), from the same tables, resident K/V and the EMA of the device counts.
  Hysteresis (per phase and batch size): the body changes only when the other is predicted
  cheaper by more than `margin`.
  A step is priced by its phase's table (decode batches by the decode table, extend and mixed
  batches by the prefill table); without a prefill table, prefill uses the decode table, with a warning.
No calibration for this device: dense-masked everywhere, with one warning naming the command.

A sublayer skipper (attention and MLP decided apart: skippers/base.py) runs other bodies, so it has
tables of its own (`vskipper calibrate --sublayers`), kept beside the whole-layer ones under their own
key (Calibration.sublayers). Its layers have two RUN fractions, f_attn and f_mlp; the rule:
  - calibrate times cells with both fractions equal to f (the same grid, the same paired method);
  - the choice reads both (on CPU from `run`; on an accelerator, the EMA of the device counts of
    both; inside capture, the skipper's declared expected fraction for both) and prices each body
    as attention plus MLP from those diagonal cells: dense whatever the fractions; routed-mlp at
    f_mlp (its attention runs for every row); routed at f_mlp plus what routing the attention
    changes at f_attn, routed(f_attn) - routed-mlp(f_attn), which is exact where the two
    sublayers' times add up (Calibration.predict).
  Either way this only picks which body runs: every body computes the same function.
"""
from __future__ import annotations

import bisect
import dataclasses
import json
import math
import platform
import statistics
import warnings
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path

import torch

from vskipper import cache

GRID_T = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
GRID_F = (0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0)
PREFILL_T = (16, 64, 256, 1024)  # tokens of the one prompt an extend calibrates; beyond: linear in T
PHASES = ("decode", "prefill")
# The decode table's context axis: resident K/V tokens per row. The first context is timed over the whole
# (T, f) grid; each further one over CONTEXT_T x CONTEXT_F (what the context changes is the attention's
# K/V reads, linear in c and in the RUN fraction: three fractions and every other batch size price it),
# and only the cells of at most MAX_RESIDENT resident tokens (T x c): past them, linear in T.
GRID_C = (256, 1024, 4096, 16384)
CONTEXT_T = (1, 4, 16, 64, 256)
CONTEXT_F = (0.0, 0.5, 1.0)
MAX_RESIDENT = {"cuda": 1 << 20, "cpu": 1 << 16}  # 1M tokens: 4 GB of one 8B-shape layer's bf16 K/V


def run_rows(T: int, f: float) -> int:
    """How many of T rows RUN in a calibration cell with fraction f."""
    return round(f * T)


def device_name(device: torch.device | str = "cpu") -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)  # H100 and H200 are both sm90: key on the name
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu: {model}, {torch.get_num_threads()} threads"


# How calibrate measures (KV pool, rounds in random order, paired ratios, passes, three bodies, dynamic
# bodies finding their own rows, decode on CUDA as CUDA-graph replays, decode over a context axis of
# resident K/V; "routed" with the masked attention where the engine's attention part has one): a
# calibration made another way is not trusted. Bump on change.
METHOD = "7"


def versions() -> dict[str, str]:
    """What a calibration must have been made with to be trusted (vskipper/cache.py), and how."""
    return {**cache.versions(), "method": METHOD}


def cache_dir() -> Path:
    return cache.root() / "cost"


SHIPPED_DIR = Path(__file__).parent / "data" / "cost"


@dataclass(frozen=True)
class ContextTable:
    """A decode table at one further context: like Calibration's own tables, over its own grid."""

    context: int  # resident K/V tokens per row
    ts: tuple
    fs: tuple
    dense: tuple  # ms, [len(ts)][len(fs)]
    routed: tuple
    routed_mlp: tuple = ()

    @classmethod
    def from_json(cls, d: dict) -> "ContextTable":
        return cls(int(d["context"]), tuple(d["ts"]), tuple(d["fs"]), tuple(map(tuple, d["dense"])),
                   tuple(map(tuple, d["routed"])), tuple(map(tuple, d.get("routed_mlp", ()))))


@dataclass(frozen=True)
class Calibration:
    device: str
    versions: dict
    hidden: int
    intermediate: int
    ts: tuple
    fs: tuple
    dense: tuple  # ms, [len(ts)][len(fs)]
    routed: tuple
    dtype: str = "float32"  # the dtype the layer was timed in (bf16 GEMMs and f32 ones differ in kind)
    routed_mlp: tuple = ()  # ms, like routed: attention for every row, MLP and adapter routed
    phase: str = "decode"  # what was timed: a decode step of T sequences, or an extend of one T-token prompt
    sublayers: bool = False  # a sublayer skipper's bodies (cells with both RUN fractions equal), not whole layers
    context: int = 128  # decode: resident K/V tokens per row the tables above were timed at (the smallest)
    by_context: tuple = ()  # decode: ContextTable at each further context, increasing

    def __post_init__(self) -> None:
        cs = [self.context] + [t.context for t in self.by_context]
        if any(b <= a for a, b in zip(cs, cs[1:])):
            raise ValueError(f"Calibration: contexts {cs} must increase (context, then by_context's)")

    @property
    def contexts(self) -> tuple[int, ...]:
        """The context axis: resident K/V tokens per row of each decode table."""
        return (self.context,) + tuple(t.context for t in self.by_context)

    @cached_property
    def _slices(self) -> list["Calibration"]:
        """One table per context, each a Calibration of one context (the first: this one's own tables)."""
        one = dataclasses.replace(self, by_context=())
        return [one] + [dataclasses.replace(one, context=t.context, ts=t.ts, fs=t.fs, dense=t.dense,
                                            routed=t.routed, routed_mlp=t.routed_mlp) for t in self.by_context]

    def bodies(self) -> tuple[str, ...]:
        """The bodies this table times, by execution name."""
        return ("dense", "routed") + (("routed-mlp",) if self.routed_mlp else ())

    def _table(self, body: str) -> tuple:
        return {"dense": self.dense, "routed": self.routed, "routed-mlp": self.routed_mlp}[body]

    @cached_property
    def _rows(self) -> list[tuple[list[float], float, dict[str, list[float]]]]:
        """Per grid T: (RUN fractions, dense ms, {routed body: ms}). A cell (T, f) was measured with
        run_rows(T, f) RUN rows, so its real fraction is that over T (at small T several cells
        share one: merged). Dense computes every row whatever f: one time per T, the row's median.
        A routed body is the cell's body/dense ratio (paired round by round, so a slow spell of the
        machine cancels) times that dense time, made non-decreasing in f."""
        rows = []
        for i, T in enumerate(self.ts):
            d_row = self.dense[i]
            d = statistics.median(d_row)
            times = {}
            for body in self.bodies()[1:]:
                by_n: dict[int, list[float]] = {}
                for f, dc, rc in zip(self.fs, d_row, self._table(body)[i]):
                    by_n.setdefault(run_rows(T, f), []).append(rc / dc * d)
                ns = sorted(by_n)
                times[body] = _nondecreasing([statistics.median(by_n[n]) for n in ns])
            rows.append(([n / T for n in ns], d, times))
        return rows

    def predict(self, body: str, T: int, f, context: float | None = None) -> float:
        """Interpolated time (ms) of `body` for T rows with RUN fraction f, each row attending `context`
        resident K/V tokens (None: the smallest context timed): linear in f along the two grid rows
        around T, then linear in log2 T between them, then linear in the context (the module
        docstring). A sublayer table's f is (f_attn, f_mlp), or one fraction for both; the body is
        priced as attention plus MLP (the module docstring's rule)."""
        if not self.sublayers:
            return self._at(body, T, f, context)
        f_attn, f_mlp = (f, f) if isinstance(f, (int, float)) else f
        if body == "routed":  # the attention routed at f_attn, the MLP at f_mlp
            return (self._at("routed-mlp", T, f_mlp, context) + self._at("routed", T, f_attn, context)
                    - self._at("routed-mlp", T, f_attn, context))
        return self._at(body, T, f_mlp, context)  # dense: whatever f; routed-mlp: attention for every row

    def _at(self, body: str, T: int, f: float, context: float | None) -> float:
        """`body`'s time at (T, f) in the context's table, linear in the context between tables."""
        slices = self._slices
        if context is None or len(slices) == 1 or context <= slices[0].context:
            return slices[0]._predict(body, T, f)
        k = min(bisect.bisect_right(self.contexts, context), len(slices) - 1)  # the table at or past it
        lo, hi = slices[k - 1], slices[k]
        a, b = lo._predict(body, T, f), hi._predict(body, T, f)
        slope = (b - a) / (hi.context - lo.context)
        if context <= hi.context:
            return a + slope * (context - lo.context)
        return b + max(0.0, slope) * (context - hi.context)  # past the last: more K/V never costs less

    def _predict(self, body: str, T: int, f: float) -> float:
        x = math.log2(max(T, 1))
        xs = [math.log2(t) for t in self.ts]
        i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
        u = min(max((x - xs[i]) / (xs[i + 1] - xs[i]), 0.0), 1.0)

        def at(row):
            fracs, d, times = row
            if body == "dense":
                return d
            r = times[body]
            if len(fracs) == 1:
                return r[0]
            j = min(max(bisect.bisect_right(fracs, f) - 1, 0), len(fracs) - 2)
            v = min(max((f - fracs[j]) / (fracs[j + 1] - fracs[j]), 0.0), 1.0)
            return r[j] * (1 - v) + r[j + 1] * v

        t = at(self._rows[i]) * (1 - u) + at(self._rows[i + 1]) * u
        return t * (T / self.ts[-1]) if T > self.ts[-1] else t  # beyond the grid: linear in T

    def choose(self, T: int, f, current: str | None = None, margin: float = 0.03,
               bodies: tuple[str, ...] | None = None, context: float | None = None) -> str:
        """The body predicted cheapest among `bodies` (default: every body timed) at `context` resident
        K/V tokens per row (None: the smallest context timed); with hysteresis, `current` is kept
        unless another is predicted cheaper by more than `margin`."""
        times = {b: self.predict(b, T, f, context) for b in self.bodies() if bodies is None or b in bodies}
        best = min(times, key=times.get)
        if current in times and best != current and times[best] > times[current] * (1 - margin):
            return current
        return best

    def break_even(self, T: int, f, body: str = "routed", against: str = "dense") -> float | None:
        """V*: the resident K/V tokens (T rows' contexts summed) from which `body` is predicted to cost no
        more than `against` at T rows and RUN fraction f, read off the context axis. 0.0: it pays at every
        context (down to the smallest timed); math.inf: not up to 64 times the largest context timed;
        None: the table has no context axis (one context), so it cannot say."""
        if len(self._slices) == 1:
            return None
        gap = lambda c: self.predict(body, T, f, c) - self.predict(against, T, f, c)  # noqa: E731
        c0, top = self.contexts[0], 64 * self.contexts[-1]
        if gap(c0) <= 0:
            return 0.0
        lo, c = c0, c0
        while c < top:  # a step of 2^(1/8): no crossing between two steps is missed by more than 9%
            c = min(top, c * 2 ** 0.125)
            if gap(c) <= 0:
                break
            lo = c
        else:
            return math.inf
        hi = c
        for _ in range(40):  # the gap is piecewise linear: bisection to well under a token
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if gap(mid) <= 0 else (mid, hi)
        return T * hi

    def key(self) -> str:
        phase = "|prefill" if self.phase == "prefill" else ""
        kind = "|sublayers" if self.sublayers else ""
        return f"{self.device}|{self.hidden}x{self.intermediate}|{self.dtype}{phase}{kind}"

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Calibration":
        return cls(d["device"], d["versions"], d["hidden"], d["intermediate"], tuple(d["ts"]), tuple(d["fs"]),
                   tuple(map(tuple, d["dense"])), tuple(map(tuple, d["routed"])), d.get("dtype", "float32"),
                   tuple(map(tuple, d.get("routed_mlp", ()))), d.get("phase", "decode"), d.get("sublayers", False),
                   int(d.get("context", 128)), tuple(ContextTable.from_json(t) for t in d.get("by_context", ())))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _file_name(device: str) -> str:
    return cache.slug(device) + ".json"


def _entry_key(e: dict) -> tuple:
    """What a cached entry replaces: the entry of the same shape, dtype, phase and kind."""
    return (e["hidden"], e["intermediate"], e.get("dtype", "float32"), e.get("phase", "decode"),
            e.get("sublayers", False))


def save(cal: Calibration, directory: Path | None = None) -> Path:
    """Cache `cal` in its device's file, in place of the entry of the same shape, dtype, phase and kind
    (whole-layer and sublayer tables are kept side by side)."""
    directory = directory or cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / _file_name(cal.device)
    entries = json.loads(path.read_text()) if path.is_file() else []
    entries = [e for e in entries if _entry_key(e) != _entry_key(cal.to_json())]
    path.write_text(json.dumps(entries + [cal.to_json()], indent=1))
    return path


def load(device: torch.device | str, hidden: int, intermediate: int, dtype: str = "float32",
         phase: str = "decode", exact: bool = False, sublayers: bool = False) -> Calibration | None:
    """The `phase` calibration for this device, versions and dtype, nearest shape first (exact: this
    shape only), of whole layers or (sublayers) of a sublayer skipper's bodies; None if there is none."""
    if phase not in PHASES:
        raise ValueError(f"phase={phase!r} is not one of {list(PHASES)}")
    name, ver = device_name(device), versions()
    found = []
    for directory in (cache_dir(), SHIPPED_DIR):
        path = directory / _file_name(name)
        if not path.is_file():
            continue
        for e in json.loads(path.read_text()):
            if (e["device"] != name or e.get("dtype", "float32") != dtype or e.get("phase", "decode") != phase
                    or e.get("sublayers", False) != sublayers):
                continue
            why = cache.mismatch(e["versions"], ver)
            if why:
                cache.warn_ignored("a stale cost calibration in", path,
                                   f"made with {why}; run `vskipper calibrate` again")
                continue
            found.append(Calibration.from_json(e))
        if found:
            break
    if not found:
        return None
    best = min(found, key=lambda c: abs(math.log(c.hidden * c.intermediate / (hidden * intermediate))))
    if (best.hidden, best.intermediate) != (hidden, intermediate):
        if exact:
            return None
        what = ("sublayer " if sublayers else "") + ("prefill " if phase == "prefill" else "") + "cost calibration"
        warnings.warn(f"vskipper: no {what} for hidden={hidden}, intermediate={intermediate} on "
                      f"{name!r}; using the nearest shape, {best.hidden}x{best.intermediate}. For this shape: "
                      f"`vskipper calibrate{' --sublayers' if sublayers else ''} --shape {hidden},{intermediate}`",
                      stacklevel=2)
    return best


def _other_thread_counts(name: str) -> list[str]:
    """Devices in the cache that are this CPU at another torch thread count."""
    head, sep, _ = name.rpartition(", ")
    if not name.startswith("cpu: ") or not sep:
        return []
    out = []
    for directory in (cache_dir(), SHIPPED_DIR):
        for path in directory.glob(_file_name(head + ", ").removesuffix(".json") + "*.json"):
            try:
                out += [e["device"] for e in json.loads(path.read_text()) if e["device"] != name]
            except (OSError, ValueError, KeyError, TypeError):
                continue
    return sorted(set(out))


class HostCopy:
    """A device tensor copied to a pinned host buffer without blocking, read once its copy has landed:
    `push(t)` starts this copy and returns the values of the last copy that has landed since the
    previous push (a list), or None if none has. `event` makes the event (CUDA's by default; a test
    can hand in its own and run this same path on CPU tensors)."""

    def __init__(self, event=None) -> None:
        self.event_type = event
        self._host = self._event = None

    def push(self, t: torch.Tensor) -> list | None:
        seen = None
        if self._host is None:
            self._host = torch.zeros(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            self._event = (self.event_type or torch.cuda.Event)()
        elif self._event.query():  # the previous copy has landed: read it, never wait for it
            seen = self._host.tolist()
        self._host.copy_(t, non_blocking=True)
        self._event.record()
        return seen


class DeviceCounts:
    """The previous steps' RUN counts of one phase, read from an accelerator without waiting for it:
    each step's counts [2] (RUN, PROJECT; a sublayer layer's: attention RUN, MLP RUN) are copied to a
    pinned host buffer without blocking (HostCopy), with the T they were counted over, and read once
    their copy's event has completed. One per phase, so a prefill step's count is never divided by a
    decode step's T. `width`: how many leading counts are RUN counts (1, or 2 for a sublayer layer)."""

    def __init__(self, event=None, width: int = 1) -> None:
        self.width = width
        self._copy = HostCopy(event)
        self._T = 0

    def push(self, counts: torch.Tensor, T: int) -> tuple[float, ...] | None:
        """Start copying this step's counts (taken over T rows); return the RUN fractions (`width` of
        them) of the last copy that has landed since the previous call, or None if none has."""
        seen = self._copy.push(counts)
        if seen is not None:
            seen = tuple(n / max(self._T, 1) for n in seen[:self.width])
        self._T = T
        return seen


def context_key(resident: int | None, T: int) -> int | None:
    """A step's resident K/V per row, bucketed (2^(k/8) tokens: 9% apart) for the chooser's memo;
    None where unknown or empty."""
    if resident is None or resident <= 0:
        return None
    return round(8 * math.log2(resident / max(T, 1)))


def bucket_context(key: int | None) -> float | None:
    """The context (tokens per row) a bucket stands for."""
    return None if key is None else 2.0 ** (key / 8)


class Chooser:
    """The per-layer choice of routed_layer.AutoBody (Config(execution="auto")): the name of a body
    among `bodies` (default: every body the calibration times), from the calibration (see the module
    docstring).

    expected: the RUN fraction the skipper declares (Skipper.expected_run_fraction; 0.5 when it
    declares none), what the choice plans with where it cannot look: inside CUDA-graph capture the
    body is `planned(T)`, a pure function of the calibration, T and `expected`, so each captured
    batch size gets one fixed body (`plan` lists them). Elsewhere the choice is made per step, with
    hysteresis state kept per phase (prefill, decode) and batch size, from the phase's table
    (`prefill`: the prefill calibration; None: prefill steps use the decode table). Counts on an
    accelerator are read a step late (DeviceCounts, one per phase; `event` as there). A decode step is
    priced at its resident K/V per row (`resident` / T, bucketed: context_key) where the decode table has
    a context axis (`reads_context`); prefill steps by the prefill table alone. With sublayer tables
    (`width` 2) the choice reads two RUN fractions, (attention, MLP): the module docstring's rule."""

    def __init__(self, calibration: Calibration, expected: float | None = None, ema: float = 0.5,
                 margin: float = 0.03, prefill: Calibration | None = None, bodies: tuple[str, ...] | None = None,
                 event=None) -> None:
        self.cal, self.alpha, self.margin = calibration, ema, margin
        self.tables = {True: calibration, False: prefill if prefill is not None else calibration}  # decode? -> table
        self.bodies = bodies
        self.declared = expected is not None
        self.expected = 0.5 if expected is None else float(expected)
        self.current: dict[tuple, str] = {}  # (phase, T) -> the body chosen last (hysteresis)
        self.width = 2 if calibration.sublayers else 1  # RUN fractions a step has: (attention, MLP) or one
        self.fraction: dict[bool, tuple] = {}  # phase -> EMA of the RUN fractions seen (accelerators), `width` of them
        self.event = event
        self.device_counts = {phase: DeviceCounts(event, self.width) for phase in (True, False)}
        self.reads_context = len(calibration.contexts) > 1  # a decode step's resident K/V moves the choice
        self._memo: dict[tuple, str] = {}  # (phase, T, RUN count or percent, context, current) -> body

    def planned(self, T: int) -> str:
        """The body for a captured graph of T rows: no state, no device read."""
        return self.cal.choose(T, self.expected, bodies=self.bodies)

    def plan(self, sizes) -> dict[int, str]:
        return {T: self.planned(T) for T in sizes}

    def _decide(self, decode: bool, T: int, key, f, resident: int | None = None) -> str:
        where = (decode, T)
        cur = self.current.get(where)
        ck = context_key(resident, T) if decode and self.reads_context else None
        memo_key = (decode, T, key, ck, cur)
        body = self._memo.get(memo_key)
        if body is None:
            if len(self._memo) > 4096:  # prefill sizes vary without bound: keep the memo small
                self._memo.clear()
            body = self._memo[memo_key] = self.tables[decode].choose(T, f, cur, self.margin, self.bodies,
                                                                     bucket_context(ck))
        self.current[where] = body
        return body

    def blind(self, counts: torch.Tensor) -> bool:
        """Whether a device tensor is not to be read now: a CUDA graph is being captured, or the device
        has no CUDA events (choose then gives `planned`)."""
        return torch.cuda.is_current_stream_capturing() if counts.is_cuda else self.event is None

    def choose(self, T: int, counts, decode: bool = True, on_host: bool | None = None,
               resident: int | None = None) -> str:
        """counts: on the device, route maps' counts [2] (RUN, PROJECT), or with sublayer tables the
        layer's (attention RUN, MLP RUN) [2]; or read on the host, the RUN count (an int), or with
        sublayer tables the pair (attention RUN, MLP RUN). on_host: read a tensor's counts directly
        (default: when it is a CPU tensor). resident: a decode step's resident K/V tokens, its T rows'
        contexts summed (host-side; None: priced at the smallest context timed)."""
        if isinstance(counts, torch.Tensor):
            if on_host is None:
                on_host = counts.is_cpu  # (not .device.type: measured 5 us per call inside a step)
            if on_host:
                counts = counts.tolist()[:self.width]
            elif self.blind(counts):
                return self.planned(T)  # capturing a graph, or a device without CUDA events: never read
            else:
                return self._choose_seen(T, counts, decode, resident)
        ns = (counts,) if isinstance(counts, int) else tuple(counts)
        if len(ns) != self.width:
            raise ValueError(f"Chooser.choose: {len(ns)} RUN count(s) {ns} for a table that reads {self.width}")
        return self._decide(decode, T, ns, self._f(n / max(T, 1) for n in ns), resident)

    def _f(self, fs) -> float | tuple:
        """What the table reads: one fraction, or (attention, MLP)."""
        fs = tuple(fs)
        return fs[0] if self.width == 1 else fs

    def _choose_seen(self, T: int, counts: torch.Tensor, decode: bool, resident: int | None) -> str:
        seen = self.device_counts[decode].push(counts, T)
        if seen is not None:
            last = self.fraction.get(decode)
            self.fraction[decode] = seen if last is None else tuple(
                self.alpha * s + (1 - self.alpha) * l for s, l in zip(seen, last))
        f = self.fraction.get(decode, (self.expected,) * self.width)
        return self._decide(decode, T, tuple(round(x * 100) for x in f), self._f(f), resident)


def _nondecreasing(ys: list[float]) -> list[float]:
    """The least-squares non-decreasing fit of ys (pool adjacent violators). A routed step with one
    more RUN row and one fewer PROJECT row costs at least as much, so a dip is measurement noise."""
    blocks: list[list[float]] = []  # [mean, count]
    for y in ys:
        blocks.append([y, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, c1), (m2, c2) = blocks.pop(-2), blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    return [m for m, c in blocks for _ in range(c)]


_warned: set[tuple] = set()


def warn_uncalibrated(device: torch.device, hidden: int, intermediate: int, dtype: str = "float32",
                      sublayers: bool = False) -> None:
    """No calibration (of whole layers, or of a sublayer skipper's bodies): auto runs dense-masked."""
    name = device_name(device)
    if (name, dtype, sublayers) in _warned:
        return
    _warned.add((name, dtype, sublayers))
    others = _other_thread_counts(name)
    threads = f" --threads {torch.get_num_threads()}" if others else ""
    also = f" (there are calibrations of this CPU at other thread counts: {others})" if others else ""
    flag = ("" if dtype == "float32" else f" --dtype {dtype}") + (" --sublayers" if sublayers else "")
    what, runs = (("sublayer cost calibration", "a sublayer skipper's layers dense-masked") if sublayers
                  else ("cost calibration", "the dense-masked body"))
    warnings.warn(f"vskipper: no {what} for {name!r} (hidden={hidden}, intermediate={intermediate}, "
                  f"{dtype}){also}; execution='auto' runs {runs}. Measure this device with "
                  f"`vskipper calibrate --shape {hidden},{intermediate}{threads}{flag}` (or --model PATH).",
                  stacklevel=4)


def warn_no_prefill(device: torch.device, hidden: int, intermediate: int, dtype: str = "float32",
                    sublayers: bool = False) -> None:
    """A decode calibration without a prefill one: prefill steps are priced by the decode table."""
    name = device_name(device)
    if (name, dtype, "prefill", sublayers) in _warned:
        return
    _warned.add((name, dtype, "prefill", sublayers))
    flag = ("" if dtype == "float32" else f" --dtype {dtype}") + (" --sublayers" if sublayers else "")
    what = "sublayer prefill" if sublayers else "prefill"
    warnings.warn(f"vskipper: no {what} cost calibration for {name!r} (hidden={hidden}, intermediate={intermediate}, "
                  f"{dtype}); execution='auto' prices prefill steps by the decode table, which misprices them. "
                  f"Measure prefill with `vskipper calibrate --phase prefill --shape {hidden},{intermediate}{flag}`.",
                  stacklevel=4)
