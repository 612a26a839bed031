"""The routed layer and the bodies that compute it.

For routed layer l with x = input_layernorm(h) and gate g (docs/architecture.md), row by row as
vskipper/skippers/base.py states it (run_value, project_value, gate_combine):
    K, V of x for ALL rows are written to the cache
    RUN:     h1 = h + attn(x);  out = h1 + g * mlp(post_attention_layernorm(h1))   (g = 1 if hard)
    PROJECT: out = h + (1 - g) * adapter(post_attention_layernorm(h))             (identity if no adapter)
    padding (valid False): out = h
Bodies compute it; which one a layer runs is decided once, at transform time, by `make_body`:
  DenseBody         every row through attention, MLP and adapter; a mask selects;
  RoutedBody        RUN rows gathered through attention and MLP, PROJECT rows through the adapter,
                    scattered back, slicing to the real counts (reads them on the host: CPU);
  FixedRoutedBody   the same with fixed shapes, device-side counts and vskipper's grouped ops
                    (no host sync: CUDA graphs), in the ops implementation it was given;
  either, with attend_all ("routed-mlp"): attention for every row as the engine computes it, only
                    the MLP and the adapter routed (at short context attention is cheap and batched,
                    while attending for a subset of rows has fixed costs of its own);
  AutoBody          a dense and the routed bodies, and the cost model's chooser among them per step.
Attention comes from the family's attention part, which knows the engine's cache:
`all_rows(x, ctx)`, `some_rows(x, rows, ctx)`, `masked_rows(x, run, ctx, impl)`; all write K/V
for every row. Shapes: T = rows, H = hidden; h/x may carry leading dims [B, S] (transformers).
"""
from __future__ import annotations

import torch
from torch import nn

from vskipper import cost, ops
from vskipper.config import Config
from vskipper.guard import NoHostSync
from vskipper.skippers.base import gate_combine, project_value, run_value


class Body:
    """What a routed layer runs. `needs_maps`: the layer is given route_maps(run, valid, impl=maps_impl)."""

    name = "body"
    needs_maps = True
    maps_impl = "torch"

    def __call__(self, layer: "RoutedLayer", h, x, g, run, valid, maps, ctx):
        raise NotImplementedError

    def select(self, layer: "RoutedLayer", h, x, run, valid, maps, ctx) -> "Body":
        """The body that runs this step: itself (AutoBody: the one its chooser picks, on the host)."""
        return self

    def describe(self) -> str:
        return self.name


class DenseBody(Body):
    name = "dense"
    needs_maps = False

    def __call__(self, layer, h, x, g, run, valid, maps, ctx):
        h1 = h + layer.attention.all_rows(x, ctx)  # [..., H]
        m = layer.mlp(layer.post_norm(h1))
        p = None if layer.adapter is None else layer.adapter(layer.post_norm(h))
        return gate_combine(h, h1, m, p, g, run, valid, layer.soft)

    def describe(self) -> str:
        return "dense-masked"


class RoutedBody(Body):
    """Dynamic shapes: finds its rows and slices to the real counts, read on the host (no route maps:
    a step in which every row runs needs only the count). attend_all: attention for every row (the
    engine's own), MLP and adapter routed ("routed-mlp")."""

    needs_maps = False

    def __init__(self, attend_all: bool = False) -> None:
        self.attend_all = attend_all
        self.name = "routed-mlp" if attend_all else "routed"

    def __call__(self, layer, h, x, g, run, valid, maps, ctx):
        hf = h.reshape(-1, h.shape[-1])  # [T, H]
        ran = (run & valid).reshape(-1)  # [T]
        n_run = int(ran.sum())  # the dynamic form: data-dependent shapes are allowed here
        if n_run == hf.shape[0]:  # every row runs (rate 0; a step nothing skips): the decoder layer as
            h1 = hf + layer.attention.all_rows(x, ctx).reshape(hf.shape)  # the engine computes it, no gathers
            return run_value(h1, layer.mlp(layer.post_norm(h1)), g.reshape(-1), layer.soft).view_as(h)
        out = hf.clone()  # PROJECT rows without an adapter, and padding, keep h
        rr = ran.nonzero().squeeze(1)  # [n_run] ascending
        if self.attend_all:
            a = layer.attention.all_rows(x, ctx).reshape(hf.shape).index_select(0, rr)  # [n_run, H]
        else:
            a = layer.attention.some_rows(x, rr, ctx)  # [n_run, H]; K/V written for all rows
        if n_run:
            h1 = hf.index_select(0, rr) + a
            m = _mlp_rows(layer.mlp, layer.post_norm(h1), hf.shape[0])
            out.index_copy_(0, rr, run_value(h1, m, _rows_of(g, rr, layer.soft), layer.soft))
        if layer.adapter is not None:
            pr = (valid & ~run).reshape(-1).nonzero().squeeze(1)  # [n_proj] ascending
            if pr.numel():
                hp = hf.index_select(0, pr)
                out.index_copy_(0, pr, project_value(hp, layer.adapter(layer.post_norm(hp)), _rows_of(g, pr, layer.soft),
                                                     layer.soft))
        return out.view_as(h)

    def describe(self) -> str:
        what = "attention for every row, MLP and adapter routed" if self.attend_all else "routed"
        return f"{what}, dynamic shapes (torch; counts read on the host)"


def _rows_of(g, rows, soft: bool):
    """The gates of `rows` (soft gates); a hard gate reads none (run_value, project_value)."""
    return g.reshape(-1).index_select(0, rows) if soft else None


def _mlp_rows(mlp, y, T: int):
    """mlp(y) for y's n gathered rows [n, H]. On CPU, 7-15 rows are computed as 16 (padded with copies
    of the first, then dropped) when the batch has 16 or more: below 16 rows MKL's f32 GEMM takes a
    path that streams a weight too large for the cache once per 3 rows. Measured for SmolLM2-135M's
    MLP, one thread, 2-CPU Xeon VM (2026-12-01): 6 rows 0.79 ms, 8 rows 1.13, 12 rows 1.48, 15 rows
    1.84, 16 rows 1.07, 32 rows 1.46; a routed layer at batch 32 with half the rows RUN (12-20 of them)
    saved nothing without this."""
    n = y.shape[0]
    if y.is_cpu and 7 <= n < 16 <= T:
        return mlp(torch.cat([y, y[:1].expand(16 - n, -1)]))[:n]
    return mlp(y)


class FixedRoutedBody(Body):
    """Fixed shapes, device-side counts, vskipper's grouped ops: no host sync (CUDA graphs).
    attend_all: attention for every row (the engine's own), MLP and adapter routed ("routed-mlp")."""

    def __init__(self, impl: str, attend_all: bool = False) -> None:
        self.impl = self.maps_impl = impl
        self.attend_all = attend_all
        self.name = "routed-mlp" if attend_all else "routed"

    def __call__(self, layer, h, x, g, run, valid, maps, ctx):
        run_rows, project_rows, counts = maps
        H = h.shape[-1]
        hf = h.reshape(-1, H)  # [T, H]
        gf = g.reshape(-1).to(h.dtype) if layer.soft else None  # [T]
        ran = (run & valid).reshape(-1)  # [T]
        if self.attend_all:
            a = layer.attention.all_rows(x, ctx).reshape(-1, H)  # [T, H]
        else:
            a = layer.attention.masked_rows(x, ran, ctx, self.impl).reshape(-1, H)  # [T, H]
        h1 = hf + a
        rank_sum = getattr(layer.mlp, "rank_sum", None)
        if rank_sum is None:
            out = hf.clone()
            ops.grouped_swiglu_(out, h1, layer.post_norm(h1), run_rows, counts[0:1], *layer.mlp_weights(),
                                gf, impl=self.impl)  # run_value
        else:  # tensor parallel: this rank's MLP shard gives a partial sum; complete it, then add the residual
            acc = torch.zeros_like(hf)
            ops.grouped_swiglu_(acc, acc, layer.post_norm(h1), run_rows, counts[0:1], *layer.mlp_weights(), gf,
                                impl=self.impl)
            out = torch.where(ran.unsqueeze(-1), h1 + rank_sum(acc), hf)
        if layer.adapter is not None:
            ops.grouped_swiglu_(out, hf, layer.post_norm(hf), project_rows, counts[1:2],
                                *layer.adapter.swiglu_weights(), 1 - gf if layer.soft else None,
                                impl=self.impl)  # project_value
        return out.view_as(h)

    def describe(self) -> str:
        what = "attention for every row, MLP and adapter routed" if self.attend_all else "routed"
        return f"{what}, fixed shapes ({self.impl} ops; no host sync)"


class AutoBody(Body):
    """A dense body and routed ones (by name: "routed", "routed-mlp"), and the chooser among them."""

    name = "auto"

    def __init__(self, bodies: dict[str, Body], chooser: cost.Chooser) -> None:
        self.bodies, self.chooser = bodies, chooser
        self.needs_maps = bodies["routed"].needs_maps
        self.maps_impl = bodies["routed"].maps_impl

    def select(self, layer, h, x, run, valid, maps, ctx) -> Body:
        # the RUN count: the maps' (on the device: fixed shapes) or read here (dynamic bodies, no maps)
        counts = maps[2] if maps is not None else int((run & valid).sum())
        return self.bodies[self.chooser.choose(h.numel() // h.shape[-1], counts, layer.attention.is_decode(x, ctx))]

    def __call__(self, layer, h, x, g, run, valid, maps, ctx):
        return self.select(layer, h, x, run, valid, maps, ctx)(layer, h, x, g, run, valid, maps, ctx)

    def describe(self) -> str:
        return (f"auto: {' or '.join(b.describe() for b in self.bodies.values())}, chosen per step on the host "
                f"by the cost model")


def make_bodies(config: Config, device: torch.device) -> dict[str, Body]:
    """Every body a routed layer of a model on `device` can run, by execution name."""
    impl = ops.resolve_impl(config.impl, device)
    fixed = device.type == "cuda" if config.static_shapes is None else config.static_shapes
    if fixed:
        return {"dense": DenseBody(), "routed": FixedRoutedBody(impl), "routed-mlp": FixedRoutedBody(impl, True)}
    return {"dense": DenseBody(), "routed": RoutedBody(), "routed-mlp": RoutedBody(True)}


def make_body(config: Config, device: torch.device, calibration: cost.Calibration | None,
              expected_run_fraction: float | None = None,
              prefill_calibration: cost.Calibration | None = None) -> tuple[Body, str]:
    """The body of one routed layer of a model on `device`, and why: decided here, once.
    expected_run_fraction: the skipper's, what auto plans captured graphs with. calibration prices
    decode steps, prefill_calibration extend steps (None: the decode table prices them too)."""
    impl = ops.resolve_impl(config.impl, device)
    fixed = device.type == "cuda" if config.static_shapes is None else config.static_shapes
    bodies = make_bodies(config, device)
    shapes = (f"static_shapes={config.static_shapes}" if config.static_shapes is not None
              else f"fixed shapes on {device.type}" if fixed else f"dynamic shapes on {device.type}")
    if config.execution == "dense":
        return bodies["dense"], "execution='dense'"
    if config.execution != "auto":
        return bodies[config.execution], f"execution={config.execution!r}, {shapes}, impl={impl!r}"
    if calibration is None:
        return bodies["dense"], "execution='auto' without a cost calibration for this device (run `vskipper calibrate`)"
    timed = set(calibration.bodies()) | set(prefill_calibration.bodies() if prefill_calibration is not None else ())
    bodies = {name: body for name, body in bodies.items() if name in timed}
    prefill = (f"prefill calibration {prefill_calibration.key()!r}" if prefill_calibration is not None
               else "no prefill calibration: prefill priced by the decode table")
    return (AutoBody(bodies, cost.Chooser(calibration, expected_run_fraction, prefill=prefill_calibration)),
            f"execution='auto', {shapes}, impl={impl!r}, calibration {calibration.key()!r}, {prefill}")


class RoutedLayer(nn.Module):
    """A routed decoder layer: the layer's own parts and the skipper's adapter, run by `body`."""

    def __init__(self, index: int, attention: nn.Module, post_norm: nn.Module, mlp: nn.Module,
                 adapter: nn.Module | None, gate: str, body: Body, mlp_weights=None, check_sync: bool = False) -> None:
        super().__init__()
        self.index = index
        self.attention = attention
        self.post_norm = post_norm
        self.mlp = mlp
        self.adapter = adapter
        self.soft = gate == "soft"
        self.body = body
        self.check_sync = check_sync
        self._mlp_weights = mlp_weights  # mlp -> (w_gate, w_up, w_down), for the fixed-shape body

    def mlp_weights(self):
        return self._mlp_weights(self.mlp)

    def forward(self, h, x, g, run, valid, maps, **ctx):
        # h, x [..., H]; g, run, valid [...]; maps = route_maps(run, valid) or None (dense)
        body = self.body.select(self, h, x, run, valid, maps, ctx)  # auto's host-side choice: outside the guard,
        if self.check_sync and self.attention.is_decode(x, ctx):  # which checks what a graph captures
            with NoHostSync(f"routed layer {self.index}"):
                return body(self, h, x, g, run, valid, maps, ctx)
        return body(self, h, x, g, run, valid, maps, ctx)

    def extra_repr(self) -> str:
        return f"index={self.index}, body={self.body.describe()!r}, soft={self.soft}"


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
