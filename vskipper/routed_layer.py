"""The body a routed layer becomes.

For routed layer l with x = input_layernorm(h) and gate g (ARCHITECTURE.md):
    K, V of x for ALL rows are written to the cache
    RUN:     h1 = h + attn(x);  out = h1 + g * mlp(post_attention_layernorm(h1))   (g = 1 if hard)
    PROJECT: out = h + (1 - g) * adapter(post_attention_layernorm(h))             (identity if no adapter)
    invalid (padding) rows: out = h
Three bodies compute it:
  dense   every row through attention, MLP and adapter; a mask selects;
  routed  RUN rows gathered through attention and MLP, PROJECT rows through the adapter,
          scattered back; two variants:
          dynamic  slices to the real counts (host sync; the fast path on CPU);
          static   fixed shapes, device-side counts, grouped ops (no host sync: CUDA graphs).
Attention comes from the family's attention adapter, which knows the engine's cache:
`all_rows(x, ctx)`, `some_rows(x, rows, ctx)`, `masked_rows(x, run, ctx)`; all write K/V for
every row. Shapes: T = rows, H = hidden; h/x may carry leading dims [B, S] (transformers).
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from vskipper import ops
from vskipper.guard import NoHostSync

BODIES = ("dense", "routed", "auto")  # auto: self.chooser (cost.AutoBody) picks dense or routed per step


class RoutedLayer(nn.Module):
    def __init__(self, index: int, attention: nn.Module, post_norm: nn.Module, mlp: nn.Module,
                 adapter: nn.Module | None, gate: str, mlp_weights=None, body: str = "routed",
                 static_shapes: bool | None = None, check_sync: bool = False) -> None:
        super().__init__()
        self.index = index
        self.attention = attention
        self.post_norm = post_norm
        self.mlp = mlp
        self.adapter = adapter
        self.soft = gate == "soft"
        self.body = body
        self.static_shapes = static_shapes
        self.check_sync = check_sync
        self._mlp_weights = mlp_weights  # mlp -> (w_gate, w_up, w_down), for the static body
        self.chooser = None  # cost.AutoBody when body == "auto"

    def forward(self, h, x, g, run, valid, maps, **ctx):
        # h, x [..., H]; g, run, valid [...]; maps = route_maps(run, valid) or None (dense)
        guard = self.check_sync and self.attention.is_decode(x, ctx)
        with NoHostSync(f"routed layer {self.index}") if guard else contextlib.nullcontext():
            body = self.body
            if body == "auto" and maps is not None:
                body = self.chooser.choose(h.numel() // h.shape[-1], maps[2])
            if body == "dense" or maps is None:
                return self._dense(h, x, g, run, valid, ctx)
            static = h.is_cuda if self.static_shapes is None else self.static_shapes
            if static:
                return self._static(h, x, g, run, valid, maps, ctx)
            return self._dynamic(h, x, g, maps, ctx)

    def _dense(self, h, x, g, run, valid, ctx):
        a = self.attention.all_rows(x, ctx)  # [..., H]
        h1 = h + a
        m = self.mlp(self.post_norm(h1))
        gm = g.unsqueeze(-1).to(h.dtype)
        run_out = h1 + gm * m if self.soft else h1 + m
        if self.adapter is None:
            proj_out = h
        else:
            p = self.adapter(self.post_norm(h))
            proj_out = h + (1 - gm) * p if self.soft else h + p
        return torch.where(run.unsqueeze(-1), run_out, torch.where(valid.unsqueeze(-1), proj_out, h))

    def _dynamic(self, h, x, g, maps, ctx):
        run_rows, project_rows, counts = maps
        n_run, n_proj = counts.tolist()  # the torch path: data-dependent shapes are allowed here
        hf = h.reshape(-1, h.shape[-1])  # [T, H]
        gf = g.reshape(-1, 1).to(h.dtype)  # [T, 1]
        out = hf.clone()
        rr = run_rows[:n_run].long()
        a = self.attention.some_rows(x, rr, ctx)  # [n_run, H]; K/V written for all rows
        if n_run:
            h1 = hf[rr] + a
            m = self.mlp(self.post_norm(h1))
            out[rr] = h1 + gf[rr] * m if self.soft else h1 + m
        if self.adapter is not None and n_proj:
            pr = project_rows[:n_proj].long()
            hp = hf[pr]
            p = self.adapter(self.post_norm(hp))
            out[pr] = hp + (1 - gf[pr]) * p if self.soft else hp + p
        return out.view_as(h)

    def _static(self, h, x, g, run, valid, maps, ctx):
        run_rows, project_rows, counts = maps
        H = h.shape[-1]
        hf = h.reshape(-1, H)  # [T, H]
        gf = g.reshape(-1).to(h.dtype)  # [T]
        with ops.fixed_shapes():
            a = self.attention.masked_rows(x, (run & valid).reshape(-1), ctx).reshape(-1, H)  # [T, H]
            h1 = hf + a
            out = hf.clone()
            ops.grouped_swiglu_(out, h1, self.post_norm(h1), run_rows, counts[0:1], *self._mlp_weights(self.mlp),
                                gf if self.soft else None)
            if self.adapter is not None:
                ops.grouped_swiglu_(out, hf, self.post_norm(hf), project_rows, counts[1:2],
                                    *self.adapter.swiglu_weights(), 1 - gf if self.soft else None)
        return out.view_as(h)

    def extra_repr(self) -> str:
        return f"index={self.index}, body={self.body!r}, soft={self.soft}, static_shapes={self.static_shapes}"


class RouteCounter(nn.Module):
    """Per-layer route counts kept on the device (no sync): tokens, run, project, nonfinite."""

    FIELDS = ("tokens", "run", "project", "nonfinite")

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("counts", torch.zeros(4, dtype=torch.int64), persistent=False)

    def forward(self, run: torch.Tensor, valid: torch.Tensor, nonfinite: torch.Tensor) -> None:
        self.counts += torch.stack([valid, run & valid, valid & ~run, nonfinite & valid]).reshape(4, -1).sum(1)
