"""Per-request control: a request may opt out of skipping, or cap how much of its routed-layer work
is skipped. What a request chooses is explicit; nothing changes behind its back.

The request field, validated here and nowhere else (`parse`):
    {"skip": false}      every token of the request RUNs every routed layer: the base model's function
    {"max_skip": f}      f in [0, 1]: at most that fraction of its routed-layer work is skipped
    {} / absent          the skipper decides alone (max_skip 1)

A setting becomes a budget: of the skipper's L routed layers, a request may skip at its
k shallowest ones, k the largest with k / L <= max_skip, and is forced to RUN the other L - k (deepest first: as the
cap tightens, the deepest routed layers are forced first). So every token skips at most k of L
routed layers, k / L <= max_skip, whatever the router says. `skip: false` is budget 0.

A forced row RUNs the layer as the base model does: g = 1 (so the soft gate does not scale its MLP),
the meaning non-finite router output already has. A sublayer skipper (attention and MLP decided apart,
vskipper/skippers/base.py) has the same budget in layers: at the L - k layers it is forced at, a row
RUNs both sublayers, so it skips at most 2k of its 2L routed sublayers, a share k / L <= max_skip of
them; within its k layers it skips whichever sublayers the router says. Its counts ("run", "project")
are sublayer decisions, two per token (vskipper.stats). `RequestCap` applies the budgets of a batch's rows
to one routed layer's decisions, before route maps, counters and bodies see them (so every body
agrees), on the device, without a host sync; it also counts rows per setting for `vskipper.stats`.
Shapes: T = rows of the batch."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

FIELD = "vskipper"
KEYS = ("skip", "max_skip")
SETTINGS = ("default", "capped", "no_skip")  # what a row's budget k of L routed layers is: L, 0 < k < L, 0
COUNTS = ("tokens", "run", "project", "forced")


@dataclass(frozen=True)
class RequestControl:
    max_skip: float = 1.0

    def budget(self, n_layers: int) -> int:
        """How many of the skipper's n_layers routed layers a token of this request may skip: the
        largest k with k / n_layers <= max_skip (as Python compares them: floor(max_skip * n) can be
        one short, e.g. 0.29 * 100 = 28.999999999999996)."""
        k = min(n_layers, math.floor(self.max_skip * n_layers))
        return k + 1 if k < n_layers and (k + 1) / n_layers <= self.max_skip else k


DEFAULT = RequestControl()


def parse(value, where: str = FIELD) -> RequestControl:
    """The request field's value -> RequestControl; ValueError naming the field and what is expected."""
    if value is None:
        return DEFAULT
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be an object such as {{\"skip\": false}} or {{\"max_skip\": 0.2}}, "
                         f"got {value!r}")
    unknown = sorted(set(value) - set(KEYS))
    if unknown:
        raise ValueError(f"{where}.{unknown[0]} is not a field; the fields are {', '.join(KEYS)}")
    skip = value.get("skip", True)
    if not isinstance(skip, bool):
        raise ValueError(f"{where}.skip must be true or false, got {skip!r}")
    cap = value.get("max_skip", None)
    if cap is not None:
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0.0 <= cap <= 1.0:
            raise ValueError(f"{where}.max_skip must be a number in [0, 1], got {cap!r}")
        if not skip and cap != 0:
            raise ValueError(f"{where}: skip false and max_skip {cap!r} disagree; give one of them")
    if not skip:
        return RequestControl(0.0)
    return DEFAULT if cap is None else RequestControl(float(cap))


class RequestCap(nn.Module):
    """At routed layer `rank` (0 = the skipper's shallowest) of `n_layers`: rows whose budget is
    <= rank RUN with g = 1. Counts, per budget below n_layers (`counts[k]`, on the device), the real
    rows, those that RUN, those that skip and those forced to RUN (whatever the router said);
    `setting_counts` sums them per setting (SETTINGS). The engine may leave the cap out of a batch in
    which no request has a budget, so the "default" rows (budget n_layers) are what the layer's
    RouteCounter counted less these (vskipper.stats)."""

    def __init__(self, rank: int, n_layers: int, sublayers: bool = False) -> None:
        super().__init__()
        self.rank, self.n_layers, self.sublayers = rank, n_layers, sublayers
        self.register_buffer("counts", torch.zeros(n_layers + 1, len(COUNTS), dtype=torch.int64), persistent=False)

    def forward(self, decisions, valid: torch.Tensor, budget: torch.Tensor | None):
        # decisions = sanitize_gate(...): (g [T], run [T] bool, nonfinite [T] bool or None), a sublayer
        # skipper's g and run [T, 2]; budget [T] int or None
        if budget is None:
            return decisions
        g, run, nonfinite = decisions
        budget = budget.reshape(valid.shape)
        forced = budget <= self.rank  # [T]
        k = budget.clamp(0, self.n_layers).long()  # [T]: index into counts
        default = (k < self.n_layers).reshape(-1, 1)  # "default" rows are counted by the route counter
        if self.sublayers:  # both sublayers forced; run and project count sublayer decisions
            run = run | forced.unsqueeze(-1)
            g = torch.where(forced.unsqueeze(-1), torch.ones_like(g), g)
            v = valid.unsqueeze(-1)
            rows = torch.stack([valid.long(), (run & v).sum(-1), (v & ~run).sum(-1), (forced & valid).long()], -1)
            self.counts.index_add_(0, k.reshape(-1), rows.reshape(-1, len(COUNTS)) * default)
            return g, run, nonfinite
        g = torch.where(forced, torch.ones_like(g), g)
        run = run | forced
        rows = torch.stack([valid, run & valid, valid & ~run, forced & valid], 1).reshape(-1, len(COUNTS))
        self.counts.index_add_(0, k.reshape(-1), (rows & default).long())
        return g, run, nonfinite

    def setting_counts(self) -> list[list[int]]:
        """counts per setting, in SETTINGS order ("default" left at 0: see the class docstring)."""
        c = self.counts.tolist()
        capped = [sum(r[i] for r in c[1:self.n_layers]) for i in range(len(COUNTS))]
        return [[0] * len(COUNTS), capped, c[0]]

    def extra_repr(self) -> str:
        return f"rank={self.rank}, n_layers={self.n_layers}" + (", sublayers=True" if self.sublayers else "")
