"""Per-layer route counts, kept on the device (no host sync; read only by vskipper.stats): one counter
per routed layer, fed the layer's decisions after a request's cap (control.RequestCap) applied them.
Shapes: [...] = the rows' leading dims."""
from __future__ import annotations

import torch
from torch import nn


class SublayerRouteCounter(nn.Module):
    """A sublayer skipper's route counts, on the device: tokens, attention run, MLP run, nonfinite (a
    token with a non-finite gate for either sublayer). `read` also gives "run" and "project" in
    sublayer decisions (two per token), so that project / (run + project) is the skipped share of
    routed sublayers, as it is the skipped share of routed layers for a whole-layer skipper."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("counts", torch.zeros(4, dtype=torch.int64), persistent=False)

    def forward(self, run: torch.Tensor, valid: torch.Tensor, nonfinite: torch.Tensor | None) -> None:
        # run [..., 2], valid [...] bool; nonfinite [..., 2] bool or None (the router gave decisions)
        rows = [valid, run[..., 0] & valid, run[..., 1] & valid]
        if nonfinite is not None:
            rows.append(nonfinite.any(-1) & valid)
        self.counts[:len(rows)].add_(torch.stack(rows).reshape(len(rows), -1).sum(1))

    def read(self) -> dict[str, int]:
        tokens, attn, mlp, nonfinite = self.counts.tolist()
        return dict(tokens=tokens, attention_run=attn, attention_skip=tokens - attn, mlp_run=mlp,
                    mlp_skip=tokens - mlp, run=attn + mlp, project=2 * tokens - attn - mlp, nonfinite=nonfinite)


def route_counter(sublayers: bool) -> nn.Module:
    """A routed layer's counter: SublayerRouteCounter for a sublayer skipper, else RouteCounter."""
    return SublayerRouteCounter() if sublayers else RouteCounter()


class RouteCounter(nn.Module):
    """Per-layer route counts kept on the device (no sync): tokens, run, project, nonfinite. The
    buffer holds the real rows, those that RUN and those with a non-finite gate (three sums, the
    fewest ops per step); `read` derives the rest."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("counts", torch.zeros(3, dtype=torch.int64), persistent=False)

    def forward(self, run: torch.Tensor, valid: torch.Tensor, nonfinite: torch.Tensor | None) -> None:
        # run, valid, nonfinite [...] bool; nonfinite None: the router gave decisions, never non-finite
        if nonfinite is None:
            self.counts[:2].add_((torch.stack([valid, run]) & valid).reshape(2, -1).sum(1))
        else:
            self.counts.add_((torch.stack([valid, run, nonfinite]) & valid).reshape(3, -1).sum(1))

    def read(self) -> dict[str, int]:
        tokens, run, nonfinite = self.counts.tolist()
        return dict(tokens=tokens, run=run, project=tokens - run, nonfinite=nonfinite)
