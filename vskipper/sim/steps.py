"""Step models: what one engine step costs, from a device's measured step tables.

A step table file (JSON, format "vskipper-step-tables/1") holds, per system (upstream, a skipper):

    decode  cells [B, C, ms, tag, source]: a decode step of B rows each attending C tokens of context
    extend  cells [tokens, rows, pairs, ms, tag, source] (an extend step: new tokens, requests, attention
            pairs sum n_i (prefix_i + (n_i + 1) / 2)), or fitted coefficients {"e0", "per_token",
            "per_pair", "per_row"} with their source
    run_fraction {"decode": f, "extend": f}: the share of routed-layer work that ran (1 upstream)

and once for the machine, `host`: what the server adds to each step outside the engine (its scheduler,
sampling bookkeeping, streaming: {"decode_ms": [h0, h1]} for h0 + h1 B, {"extend_ms": [g0, g1]} for
g0 + g1 rows), `ingress_ms` (request in to the scheduler) and `egress_ms` (token out to the client), and
`serial`: true where that host work runs between forwards on the same core (CPU), false where SGLang's
overlap scheduler hides it behind the device's forward (a GPU). A system may carry its own `host` (its
server's, where it was fitted per system).

`tag` says where a cell's figure comes from ("measured", "modelled: ..."), `source` names the page or
file and table it was read from, so every step the simulator prices traces to a table.

The decode model: per measured batch size B, t(B, sum C) = t0(B) + k(B) sum C (least squares over the
contexts measured at that B; one context: k from the fit over all cells), piecewise linear in B between
the tables' batch sizes, held flat past the largest in k and extended along its last segment in t0.
The extend model: t = e0 + per_token N + per_pair A + per_row R, fitted (non-negative least squares).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["FORMAT", "Host", "StepModel", "StepTables", "fit_decode", "fit_extend", "nnls"]

FORMAT = "vskipper-step-tables/1"


def nnls(X: list[list[float]], y: list[float]) -> list[float]:
    """Least squares with non-negative coefficients (active set: drop the most negative, refit)."""
    import numpy as np

    X, y = np.asarray(X, float), np.asarray(y, float)
    if X.ndim != 2 or X.shape[0] != y.shape[0] or X.shape[0] == 0:
        raise ValueError(f"nnls: {X.shape} features for {y.shape} targets")
    active = list(range(X.shape[1]))
    coef = np.zeros(X.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(X[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0
            coef[active] = sol
            return [float(c) for c in coef]
        active.pop(int(np.argmin(sol)))
    return [0.0] * X.shape[1]


def fit_decode(cells: list[tuple[int, float, float]]) -> dict[int, tuple[float, float]]:
    """{B: (t0 ms, k ms per context token)} from cells (B, C per row, ms): per B a line in sum C = B C
    over its contexts; a B with one context takes k from the fit of ms = a_B + k B C over all cells."""
    if not cells:
        raise ValueError("fit_decode: no decode cells")
    by_b: dict[int, list[tuple[float, float]]] = {}
    for B, C, ms in cells:
        if B < 1 or C < 0 or not ms > 0:
            raise ValueError(f"fit_decode: a cell (B={B}, C={C}, ms={ms}) needs B >= 1, C >= 0, ms > 0")
        by_b.setdefault(int(B), []).append((B * C, ms))
    bs = sorted(by_b)
    X = [[1.0 if b == B else 0.0 for b in bs] + [s] for B in bs for s, _ in by_b[B]]
    y = [ms for B in bs for _, ms in by_b[B]]
    k_all = nnls(X, y)[-1]
    out = {}
    for B in bs:
        pts = by_b[B]
        if len({s for s, _ in pts}) >= 2:
            t0, k = nnls([[1.0, s] for s, _ in pts], [m for _, m in pts])
        else:
            k = k_all
            t0 = max(sum(m - k * s for s, m in pts) / len(pts), 0.0)
        out[B] = (t0, k)
    return out


def fit_extend(cells: list[tuple[float, float, float, float]]) -> dict[str, float]:
    """{"e0", "per_token", "per_pair", "per_row"} (ms) from cells (tokens, rows, pairs, ms)."""
    if len(cells) < 2:
        raise ValueError(f"fit_extend: {len(cells)} extend cell(s); at least 2 are needed")
    c = nnls([[1.0, n, a, r] for n, r, a, _ in cells], [ms for *_, ms in cells])
    return dict(zip(("e0", "per_token", "per_pair", "per_row"), c))


@dataclass(frozen=True)
class Host:
    """What the server adds to a step outside the engine (ms), and the request's way in and out."""

    decode_ms: tuple[float, float] = (0.0, 0.0)
    extend_ms: tuple[float, float] = (0.0, 0.0)
    ingress_ms: float = 0.0
    egress_ms: float = 0.0
    serial: bool = True
    source: str = ""

    @classmethod
    def from_dict(cls, d: dict) -> Host:
        def pair(k):
            v = d.get(k, [0.0, 0.0])
            if not (isinstance(v, (list, tuple)) and len(v) == 2 and all(isinstance(x, (int, float)) for x in v)):
                raise ValueError(f"step tables: host.{k}={v!r}: expected [a, b] (ms, ms per row)")
            return (float(v[0]), float(v[1]))

        for k in ("ingress_ms", "egress_ms"):
            if not isinstance(d.get(k, 0.0), (int, float)):
                raise ValueError(f"step tables: host.{k}={d.get(k)!r}: expected a number of ms")
        return cls(pair("decode_ms"), pair("extend_ms"), float(d.get("ingress_ms", 0.0)),
                   float(d.get("egress_ms", 0.0)), bool(d.get("serial", True)), str(d.get("source", "")))

    def to_dict(self) -> dict:
        return {"decode_ms": list(self.decode_ms), "extend_ms": list(self.extend_ms), "ingress_ms": self.ingress_ms,
                "egress_ms": self.egress_ms, "serial": self.serial, "source": self.source}


@dataclass
class StepModel:
    """One system's steps on one device: decode(B, sum C) and extend(tokens, rows, pairs) in ms, engine
    only (the host is separate). decode_fit: {B: (t0, k)}; extend: {"e0", "per_token", "per_pair",
    "per_row"}; tags: {B: tag} of the decode cells' sources (interpolated between them)."""

    name: str
    decode_fit: dict[int, tuple[float, float]]
    extend: dict[str, float]
    run_fraction: dict[str, float] = field(default_factory=lambda: {"decode": 1.0, "extend": 1.0})
    tags: dict[int, str] = field(default_factory=dict)
    label: str = ""

    def __post_init__(self):
        if not self.decode_fit:
            raise ValueError(f"step model {self.name!r}: no decode cells")
        missing = [k for k in ("e0", "per_token", "per_pair", "per_row") if k not in self.extend]
        if missing:
            raise ValueError(f"step model {self.name!r}: extend coefficients missing {', '.join(missing)}")
        self._bs = sorted(self.decode_fit)
        measured = [B for B in self._bs if self.tags.get(B, "measured").startswith("measured")]
        self.measured_max = max(measured) if measured else None  # the largest batch size of a measured cell
        self._t0: list[float] = [0.0]
        self._k: list[float] = [0.0]

    def _grow(self, n: int) -> None:
        bs, fit = self._bs, self.decode_fit
        for B in range(len(self._t0), n + 1):
            if B <= bs[0]:
                t0, k = fit[bs[0]]
            elif B >= bs[-1]:
                if len(bs) == 1:
                    t0, k = fit[bs[0]]
                else:
                    (b1, (a1, _)), (b2, (a2, k)) = (bs[-2], fit[bs[-2]]), (bs[-1], fit[bs[-1]])
                    t0 = a2 + max(a2 - a1, 0.0) / (b2 - b1) * (B - b2)
            else:
                j = next(i for i, b in enumerate(bs) if b >= B)
                b1, b2 = bs[j - 1], bs[j]
                w = (B - b1) / (b2 - b1)
                t0 = fit[b1][0] + w * (fit[b2][0] - fit[b1][0])
                k = fit[b1][1] + w * (fit[b2][1] - fit[b1][1])
            self._t0.append(t0)
            self._k.append(k)

    def decode_ms(self, rows: int, context: float) -> float:
        """A decode step of `rows` rows attending `context` tokens in all."""
        if rows >= len(self._t0):
            self._grow(max(rows, 2 * len(self._t0)))
        return self._t0[rows] + self._k[rows] * context

    def extend_ms(self, tokens: int, rows: int, pairs: float) -> float:
        e = self.extend
        return e["e0"] + e["per_token"] * tokens + e["per_pair"] * pairs + e["per_row"] * rows

    def where(self, rows: int) -> str:
        """Where a decode step of `rows` rows is priced from: a table's batch size, between two, or past them."""
        if rows in self.decode_fit:
            return self.tags.get(rows, "measured")
        if rows > self._bs[-1]:
            return f"extrapolated past B={self._bs[-1]}"
        if rows < self._bs[0]:
            return f"held at B={self._bs[0]}"
        lo = max(b for b in self._bs if b < rows)
        hi = min(b for b in self._bs if b > rows)
        tl, th = self.tags.get(lo, "measured"), self.tags.get(hi, "measured")
        return f"interpolated between B={lo} ({tl}) and B={hi} ({th})"

    def scaled(self, anchor: StepModel, run_fraction: float, name: str) -> StepModel:
        """A skipper at another RUN fraction f, from this skipper's steps (at its own f_s) and an anchor's
        (nothing skipped, f = 1): every coefficient moved linearly, t(f) = t_1 + (t_s - t_1) (1 - f) /
        (1 - f_s), per phase. f in [0, 1]."""
        if not 0 <= run_fraction <= 1:
            raise ValueError(f"run fraction {run_fraction!r}: expected a number in [0, 1]")
        fd, fe = self.run_fraction["decode"], self.run_fraction["extend"]
        if fd >= 1 or fe >= 1:
            raise ValueError(f"step model {self.name!r} skips nothing (RUN fraction {fd}, {fe}): it cannot be "
                             f"scaled to another RUN fraction")
        wd, we = (1 - run_fraction) / (1 - fd), (1 - run_fraction) / (1 - fe)
        bs = sorted(set(self.decode_fit) | set(anchor.decode_fit))
        big = max(bs)
        self._grow(big)
        anchor._grow(big)
        dec = {B: (anchor._t0[B] + wd * (self._t0[B] - anchor._t0[B]), anchor._k[B] + wd * (self._k[B] - anchor._k[B]))
               for B in bs}
        ext = {k: anchor.extend[k] + we * (self.extend[k] - anchor.extend[k]) for k in self.extend}
        tags = {B: f"scaled from {self.name} ({self.tags.get(B, 'measured')}) and {anchor.name}" for B in bs}
        return StepModel(name, dec, ext, {"decode": run_fraction, "extend": run_fraction}, tags,
                         f"RUN fraction {run_fraction:g} (scaled from {self.label or self.name})")


class StepTables:
    """A device's step tables, read from JSON (see the module docstring): `.host`, `.systems` {name:
    StepModel}, `.meta` (device, engine, model, source), `.server` (the flags its server ran with)."""

    def __init__(self, data: dict, where: str = "step tables"):
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"{where}: not a step table file (expected \"format\": \"{FORMAT}\")")
        systems = data.get("systems")
        if not isinstance(systems, dict) or "upstream" not in systems:
            raise ValueError(f"{where}: \"systems\" must be an object with at least \"upstream\"")
        self.data = data
        self.meta = {k: data.get(k, "") for k in ("device", "engine", "model", "source")}
        self.host = Host.from_dict(data.get("host", {}))
        self.server = list(data.get("server", []))
        self.systems = {n: self._system(n, s, where) for n, s in systems.items()}
        self.hosts = {n: Host.from_dict(s["host"]) if isinstance(s.get("host"), dict) else self.host
                      for n, s in systems.items()}

    @staticmethod
    def _system(name: str, s: dict, where: str) -> StepModel:
        if not isinstance(s, dict):
            raise ValueError(f"{where}: systems.{name}: expected an object")
        cells = s.get("decode")
        if not isinstance(cells, list) or not cells:
            raise ValueError(f"{where}: systems.{name}.decode: expected a list of [B, C, ms, tag, source] cells")
        try:
            dec = [(int(c[0]), float(c[1]), float(c[2])) for c in cells]
        except (TypeError, ValueError, IndexError):
            raise ValueError(f"{where}: systems.{name}.decode: a cell is not [B, C, ms, ...]") from None
        tags = {}
        for c in cells:
            tags.setdefault(int(c[0]), str(c[3]) if len(c) > 3 else "measured")
        ext = s.get("extend")
        if not isinstance(ext, dict) or not ({"cells"} & ext.keys() or {"coef"} & ext.keys()):
            raise ValueError(f"{where}: systems.{name}.extend: expected {{\"cells\": [...]}} or {{\"coef\": {{...}}}}")
        if "coef" in ext:
            coef = ext["coef"]
            if not isinstance(coef, dict) or not all(isinstance(coef.get(k), (int, float))
                                                     for k in ("e0", "per_token", "per_pair", "per_row")):
                raise ValueError(f"{where}: systems.{name}.extend.coef: expected numbers e0, per_token, per_pair, "
                                 f"per_row (ms)")
            coef = {k: float(coef[k]) for k in ("e0", "per_token", "per_pair", "per_row")}
        else:
            try:
                coef = fit_extend([(float(c[0]), float(c[1]), float(c[2]), float(c[3])) for c in ext["cells"]])
            except (TypeError, ValueError, IndexError) as e:
                raise ValueError(f"{where}: systems.{name}.extend.cells: {e}") from None
        rf = s.get("run_fraction", {"decode": 1.0, "extend": 1.0})
        if isinstance(rf, (int, float)):
            rf = {"decode": float(rf), "extend": float(rf)}
        if not (isinstance(rf, dict) and all(isinstance(rf.get(k), (int, float)) and 0 <= rf[k] <= 1
                                             for k in ("decode", "extend"))):
            raise ValueError(f"{where}: systems.{name}.run_fraction: expected {{\"decode\": f, \"extend\": f}} "
                             f"in [0, 1]")
        try:
            fit = fit_decode(dec)
        except ValueError as e:
            raise ValueError(f"{where}: systems.{name}.decode: {e}") from None
        return StepModel(name, fit, coef, {k: float(rf[k]) for k in ("decode", "extend")}, tags,
                         str(s.get("label", name)))

    @classmethod
    def load(cls, path: str | Path) -> StepTables:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"step tables {path}: no such file")
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"step tables {path}: not JSON ({e.msg}, line {e.lineno})") from None
        return cls(data, str(path))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.data, indent=1) + "\n")

    def host_for(self, name: str) -> Host:
        """The host work of a system's server: its own where the tables fit one (systems.NAME.host), else the
        machine's."""
        self.model(name)
        return self.hosts[name]

    def model(self, name: str) -> StepModel:
        if name not in self.systems:
            raise ValueError(f"system {name!r}: not in the step tables; they have {', '.join(self.systems)}")
        return self.systems[name]

