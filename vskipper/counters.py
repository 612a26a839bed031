"""Per-layer route counts, kept on the device (no host sync; read only by vskipper.stats): one counter
per routed layer, fed the layer's decisions after a request's cap (control.RequestCap) applied them,
and counted apart by phase: prefill (prompt tokens) and decode (generated tokens). Which phase a
forward runs is one small device buffer (Phase) that every counter of a model shares and the engine's
forward sets (models/hf.py: a step of one new token per sequence over a cache is decode; SGLang: the
batch's forward mode, integrations/sglang/requests.py), so a captured decode graph counts its rows as
decode at every replay. Shapes: [...] = the rows' leading dims."""
from __future__ import annotations

import torch
from torch import nn

PHASES = ("prefill", "decode")  # row p of a counter's buffer; prefill: prompt tokens, decode: generated tokens
PREFILL, DECODE = 0, 1


class Phase(nn.Module):
    """The phase of the forward being run, as a one-hot [2] int64 buffer (prefill, decode) that route
    counters multiply their sums by. One instance per transformed model, a submodule of every counter
    (moved with the model). `set` is one device copy, no host sync; it writes every time (a captured
    graph that set it inside leaves the buffer as it set it)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.eye(2, dtype=torch.int64), persistent=False)  # row p: phase p
        self.register_buffer("onehot", torch.tensor([1, 0], dtype=torch.int64), persistent=False)

    def set(self, phase: int) -> None:
        if phase not in (PREFILL, DECODE):
            raise ValueError(f"Phase.set: phase={phase!r} must be {PREFILL} (prefill) or {DECODE} (decode)")
        self.onehot.copy_(self.table[phase])


def _by_phase(derive, rows: list[list[int]]) -> dict[str, int]:
    """derive(counts of one row) -> {key: n}: the sums over the phases, then each phase's, keys prefixed."""
    out = derive([sum(col) for col in zip(*rows)])
    for name, row in zip(PHASES, rows):
        out |= {f"{name}_{k}": v for k, v in derive(row).items()}
    return out


class SublayerRouteCounter(nn.Module):
    """A sublayer skipper's route counts, on the device: tokens, attention run, MLP run, nonfinite (a
    token with a non-finite gate for either sublayer). `read` also gives "run" and "project" in
    sublayer decisions (two per token), so that project / (run + project) is the skipped share of
    routed sublayers, as it is the skipped share of routed layers for a whole-layer skipper; and
    each key again per phase ("prefill_run", "decode_mlp_skip", ...)."""

    def __init__(self, phase: Phase | None = None) -> None:
        super().__init__()
        self.phase = Phase() if phase is None else phase
        self.register_buffer("counts", torch.zeros(2, 4, dtype=torch.int64), persistent=False)  # [phase, count]

    def forward(self, run: torch.Tensor, valid: torch.Tensor, nonfinite: torch.Tensor | None) -> None:
        # run [..., 2], valid [...] bool; nonfinite [..., 2] bool or None (the router gave decisions)
        rows = [valid, run[..., 0] & valid, run[..., 1] & valid]
        if nonfinite is not None:
            rows.append(nonfinite.any(-1) & valid)
        sums = torch.stack(rows).reshape(len(rows), -1).sum(1)  # [k]
        self.counts[:, :len(rows)].add_(self.phase.onehot[:, None] * sums)

    @staticmethod
    def _derive(c: list[int]) -> dict[str, int]:
        tokens, attn, mlp, nonfinite = c
        return dict(tokens=tokens, attention_run=attn, attention_skip=tokens - attn, mlp_run=mlp,
                    mlp_skip=tokens - mlp, run=attn + mlp, project=2 * tokens - attn - mlp, nonfinite=nonfinite)

    def read(self) -> dict[str, int]:
        return _by_phase(self._derive, self.counts.tolist())


def route_counter(sublayers: bool, phase: Phase | None = None) -> nn.Module:
    """A routed layer's counter: SublayerRouteCounter for a sublayer skipper, else RouteCounter; `phase`
    the model's shared Phase (None: one of its own, always prefill unless set)."""
    return SublayerRouteCounter(phase) if sublayers else RouteCounter(phase)


class RouteCounter(nn.Module):
    """Per-layer route counts kept on the device (no sync): tokens, run, project, nonfinite, in all and
    per phase. The buffer holds, per phase, the real rows, those that RUN and those with a non-finite
    gate (three sums, the fewest ops per step, and one multiply by the phase); `read` derives the rest."""

    def __init__(self, phase: Phase | None = None) -> None:
        super().__init__()
        self.phase = Phase() if phase is None else phase
        self.register_buffer("counts", torch.zeros(2, 3, dtype=torch.int64), persistent=False)  # [phase, count]

    def forward(self, run: torch.Tensor, valid: torch.Tensor, nonfinite: torch.Tensor | None) -> None:
        # run, valid, nonfinite [...] bool; nonfinite None: the router gave decisions, never non-finite
        if nonfinite is None:
            sums = (torch.stack([valid, run]) & valid).reshape(2, -1).sum(1)  # [2]
            self.counts[:, :2].add_(self.phase.onehot[:, None] * sums)
        else:
            sums = (torch.stack([valid, run, nonfinite]) & valid).reshape(3, -1).sum(1)  # [3]
            self.counts.add_(self.phase.onehot[:, None] * sums)

    @staticmethod
    def _derive(c: list[int]) -> dict[str, int]:
        tokens, run, nonfinite = c
        return dict(tokens=tokens, run=run, project=tokens - run, nonfinite=nonfinite)

    def read(self) -> dict[str, int]:
        return _by_phase(self._derive, self.counts.tolist())


def skipped_share(st: dict[int, dict[str, int]], phase: str | None = None) -> float | None:
    """The skipped share of routed-layer work in vskipper.stats(model)'s counts: project / (run + project)
    summed over the routed layers (a sublayer skipper's: of routed sublayers), over every token
    (phase None) or over one phase's ("prefill": prompt tokens, "decode": generated tokens); None where
    that phase counted no token."""
    if phase is not None and phase not in PHASES:
        raise ValueError(f"skipped_share: phase={phase!r} must be None or one of {list(PHASES)}")
    pre = "" if phase is None else f"{phase}_"
    project = sum(s[f"{pre}project"] for s in st.values())
    decisions = project + sum(s[f"{pre}run"] for s in st.values())
    return project / decisions if decisions else None
