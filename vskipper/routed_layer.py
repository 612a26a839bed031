"""The routed layer and the bodies that compute it.

For routed layer l with x = input_layernorm(h) and gate g (docs/architecture.md), row by row as
vskipper/skippers/base.py states it (run_value, project_value, gate_combine):
    K, V of x for ALL rows are written to the cache
    RUN:     h1 = h + attn(x);  out = h1 + g * mlp(post_attention_layernorm(h1))   (g = 1 if hard)
    PROJECT: out = h + (1 - g) * adapter(post_attention_layernorm(h))             (identity if no adapter)
    padding (valid False): out = h
Bodies compute it; which one a layer runs is decided once, at transform time, by `make_body` from
the model's `Plan` (resolve_plan) and what the engine's attention part can do:
  DenseBody         "dense": every row through attention, MLP and adapter; a mask selects;
  RoutedBody        "routed": RUN rows gathered through attention and MLP, PROJECT rows through the
                    adapter, scattered back, slicing to the real counts (read on the host: CPU);
                    "routed-mlp": attention for every row as the engine computes it, only the MLP
                    and the adapter routed (at short context attention is cheap and batched);
  FixedRoutedBody   the same two kinds with fixed shapes, device-side counts and vskipper's grouped
                    ops (no host sync: CUDA graphs), in the ops implementation of the plan;
  AutoBody          dense and routed bodies, and the cost model's chooser among them per step.
A sublayer skipper's layers (g, run [..., 2]: attention, MLP; skippers/base.py) run their own bodies:
  SublayerDenseBody   "dense": every row through attention and MLP; per sublayer a mask selects;
  SublayerRoutedBody  "routed": the attention's RUN rows gathered through attention (K/V written for
                      every row), then the MLP's RUN rows through the MLP, dynamic shapes;
                      "routed-mlp": attention for every row (a mask selects), the MLP routed;
  FixedSublayerBody   the same two kinds with fixed shapes, device-side counts and vskipper's grouped
                      ops (no host sync: CUDA graphs); its route maps are the MLP's (run[..., 1]);
  AutoBody            with the sublayer cost tables (`vskipper calibrate --sublayers`), these bodies and
                      the chooser among them, which reads both sublayers' RUN fractions (cost.py).
The bodies reach the engine only through the parts of vskipper/engines/parts.py. Shapes: T = rows,
n = gathered rows, H = hidden; h/x may carry leading dims [B, S] (transformers).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vskipper import cost, ops
from vskipper.config import Config
from vskipper.engines.parts import AttentionPart, MLPPart
from vskipper.guard import NoHostSync
from vskipper.skippers.base import gate_combine, project_value, run_value, sublayer_value

ROUTED_KINDS = ("routed", "routed-mlp")


@dataclass(frozen=True)
class Plan:
    """What a model's routed layers run, resolved once at transform time (`resolve_plan`).

    execution       Config.execution
    impl            vskipper's ops implementation: "torch" or "triton" (Config.impl resolved)
    fixed_shapes    the routed bodies keep fixed shapes and device-side counts (CUDA graphs)
    tuned_kernels   Triton launches read this GPU's tuned configs (else their defaults)
    decode, prefill the cost tables of `auto` (None: none for this device)
    expected_run_fraction  the skipper's, what `auto` plans captured graphs with
    shapes          why the shapes are what they are (for explain)
    sublayer_decode, sublayer_prefill  `auto`'s tables of a sublayer skipper's bodies, this shape only
    calibrated_for  (device, hidden, intermediate, dtype name) `auto` looked its tables up for"""

    execution: str
    impl: str
    fixed_shapes: bool
    tuned_kernels: bool = True
    decode: cost.Calibration | None = None
    prefill: cost.Calibration | None = None
    expected_run_fraction: float | None = None
    shapes: str = ""
    sublayer_decode: cost.Calibration | None = None
    sublayer_prefill: cost.Calibration | None = None
    calibrated_for: tuple = ()


def resolve_plan(config: Config, device: torch.device, hidden: int, intermediate: int, dtype: torch.dtype,
                 expected_run_fraction: float | None = None, sublayers: bool = False) -> Plan:
    """Config + this device (+ its cost calibration, for auto) -> the Plan. `sublayers`: the skipper
    decides attention and MLP apart, so auto reads the sublayer tables (make_sublayer_body warns where
    there are none) instead of the whole-layer ones. Warns once when auto has no whole-layer
    calibration (dense-masked then) or no prefill table (prefill priced by decode's)."""
    impl = ops.resolve_impl(config.impl, device)
    fixed = device.type == "cuda" if config.static_shapes is None else config.static_shapes
    shapes = (f"static_shapes={config.static_shapes}" if config.static_shapes is not None
              else f"{'fixed' if fixed else 'dynamic'} shapes on {device.type}")
    decode = prefill = sub_decode = sub_prefill = None
    found_for = ()
    if config.execution == "auto":
        dt = cost.dtype_name(dtype)
        found_for = (device, hidden, intermediate, dt)
        if sublayers:
            sub_decode, sub_prefill = (cost.load(device, hidden, intermediate, dt, phase, exact=True, sublayers=True)
                                       for phase in cost.PHASES)
        else:
            decode = cost.load(device, hidden, intermediate, dt)
            if decode is None:
                cost.warn_uncalibrated(device, hidden, intermediate, dt)
            else:
                prefill = cost.load(device, hidden, intermediate, dt, phase="prefill")
                if prefill is None:
                    cost.warn_no_prefill(device, hidden, intermediate, dt)
    return Plan(config.execution, impl, fixed, config.tuned_kernels, decode, prefill, expected_run_fraction, shapes,
                sub_decode, sub_prefill, found_for)


class Body:
    """What a routed layer runs. `name` is its kind ("dense", "routed", "routed-mlp", "auto");
    `needs_maps`: the layer is given route_maps(run, valid, impl=maps_impl, tuned=tuned)."""

    name = "body"
    needs_maps = False
    maps_impl = "torch"
    tuned = True

    def __call__(self, layer: "RoutedLayer", h, x, g, run, valid, maps, ctx):
        raise NotImplementedError

    def select(self, layer: "RoutedLayer", h, x, run, valid, maps, ctx) -> "Body":
        """The body that runs this step: itself (AutoBody: the one its chooser picks, on the host)."""
        return self

    def describe(self) -> str:
        return self.name


class DenseBody(Body):
    name = "dense"

    def __call__(self, layer, h, x, g, run, valid, maps, ctx):
        h1 = h + layer.attention.attend_all(x, ctx)  # [..., H]
        m = layer.mlp(layer.post_norm(h1))
        p = None if layer.adapter is None else layer.adapter(layer.post_norm(h))
        return gate_combine(h, h1, m, p, g, run, valid, layer.soft)

    def describe(self) -> str:
        return "dense-masked (every row through attention, MLP and adapter; a mask selects)"


def _kind(kind: str) -> str:
    if kind not in ROUTED_KINDS:
        raise ValueError(f"routed body kind {kind!r} is not one of {list(ROUTED_KINDS)}")
    return kind


def _what(kind: str) -> str:
    return ("routed-mlp (attention for every row, MLP and adapter routed)" if kind == "routed-mlp"
            else "routed (attention, MLP and adapter for their rows only)")


class RoutedBody(Body):
    """Dynamic shapes: finds its rows and slices to the real counts, read on the host (no route maps:
    a step in which every row runs needs only the count). `impl`: the attention ops' implementation,
    where the engine attends gathered rows through one (SGLang's extend batches)."""

    def __init__(self, kind: str = "routed", impl: str = "torch") -> None:
        self.name = _kind(kind)
        self.impl = impl

    def __call__(self, layer, h, x, g, run, valid, maps, ctx):
        hf = h.reshape(-1, h.shape[-1])  # [T, H]
        ran = (run & valid).reshape(-1)  # [T]
        n_run = int(ran.sum())  # the dynamic form: data-dependent shapes are allowed here
        if n_run == hf.shape[0]:  # every row runs (rate 0; a step nothing skips): the decoder layer as
            h1 = hf + layer.attention.attend_all(x, ctx).reshape(hf.shape)  # the engine computes it, no gathers
            return run_value(h1, layer.mlp(layer.post_norm(h1)), g.reshape(-1), layer.soft).view_as(h)
        out = hf.clone()  # PROJECT rows without an adapter, and padding, keep h
        rr = ran.nonzero().squeeze(1)  # [n] ascending
        if self.name == "routed-mlp":
            a = layer.attention.attend_all(x, ctx).reshape(hf.shape).index_select(0, rr)  # [n, H]
        else:
            a = layer.attention.attend_rows(x, rr, ctx, self.impl)  # [n, H]; K/V written for all rows
        if n_run:
            h1 = hf.index_select(0, rr) + a
            m = _mlp_rows(layer.mlp, layer.post_norm(h1), hf.shape[0])
            out.index_copy_(0, rr, run_value(h1, m, _rows_of(g, rr, layer.soft), layer.soft))
        if layer.adapter is not None:
            pr = (valid & ~run).reshape(-1).nonzero().squeeze(1)  # [n_proj] ascending
            if pr.numel():
                hp = hf.index_select(0, pr)
                p = layer.adapter(layer.post_norm(hp))
                out.index_copy_(0, pr, project_value(hp, p, _rows_of(g, pr, layer.soft), layer.soft))
        return out.view_as(h)

    def describe(self) -> str:
        return f"{_what(self.name)}, dynamic shapes (torch; counts read on the host)"


def _rows_of(g, rows, soft: bool):
    """The gates of `rows` (soft gates); a hard gate reads none (run_value, project_value)."""
    return g.reshape(-1).index_select(0, rows) if soft else None


# On CPU, MKL's f32 GEMM below 16 rows takes a path that streams a weight too large for the cache once
# per 3 rows (docs/architecture.md, "Facts the code relies on"): an MLP of 7-15 gathered rows is computed
# as 16 when the batch has 16 or more.
MLP_MIN_ROWS = 16


def _mlp_rows(mlp, y, T: int):
    """mlp(y) for y's n gathered rows [n, H], padded with copies of the first row to MLP_MIN_ROWS
    (then dropped) on CPU when 7 <= n < MLP_MIN_ROWS <= T."""
    n = y.shape[0]
    if y.is_cpu and 7 <= n < MLP_MIN_ROWS <= T:
        return mlp(torch.cat([y, y[:1].expand(MLP_MIN_ROWS - n, -1)]))[:n]
    return mlp(y)


# The post-attention norms the fused MLP side (ops.routed_swiglu_) restates: RMSNorms with a weight, of the
# families registered here (transformers' Llama and Qwen3, SGLang's); any other norm is called as it is.
FUSED_NORMS = {("transformers.models.llama.modeling_llama", "LlamaRMSNorm"),
               ("transformers.models.qwen3.modeling_qwen3", "Qwen3RMSNorm"), ("sglang.srt.layers.layernorm", "RMSNorm")}


def _norm_params(norm: nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, float] | None:
    """(weight [H], eps) of a post-attention norm ops.routed_swiglu_ can fuse, else None."""
    w, eps = getattr(norm, "weight", None), getattr(norm, "variance_epsilon", None)
    if ((type(norm).__module__, type(norm).__name__) in FUSED_NORMS and isinstance(w, torch.Tensor) and w.dim() == 1
            and w.dtype == dtype and isinstance(eps, float)):
        return w, eps
    return None


class FixedRoutedBody(Body):
    """Fixed shapes, device-side counts, vskipper's grouped ops: no host sync (CUDA graphs). Kind
    "routed" needs an attention part with a fixed-shape masked form (AttentionPart.masks_rows). In
    Triton, on one rank, the MLP side (h + attention, both post-attention norms, the MLP of the RUN
    rows and the adapter of the PROJECT rows, the copy of the rest) is one pair of launches
    (ops.routed_swiglu_); in torch, or under tensor parallelism, the grouped SwiGLU per cohort.
    Prefill (an extend batch: never captured) gathers its rows and runs them through the engine's own
    GEMMs (cuBLAS on a GPU), as RoutedBody does: on an H200, torch's GEMMs on the gathered rows took
    0.57-0.93x the grouped SwiGLU's time at every T measured (docs/results/gpu-kernels.md)."""

    needs_maps = True

    def __init__(self, kind: str, impl: str, tuned: bool = True) -> None:
        self.name = _kind(kind)
        self.impl = self.maps_impl = impl
        self.tuned = tuned
        self.gathered = RoutedBody(kind, impl)

    def __call__(self, layer, h, x, g, run, valid, maps, ctx):
        if not layer.attention.is_decode(x, ctx):
            return self.gathered(layer, h, x, g, run, valid, None, ctx)
        run_rows, project_rows, counts = maps
        H = h.shape[-1]
        hf = h.reshape(-1, H)  # [T, H]
        gf = g.reshape(-1).to(h.dtype) if layer.soft else None  # [T]
        ran = (run & valid).reshape(-1)  # [T]
        if self.name == "routed-mlp":
            a = layer.attention.attend_all(x, ctx).reshape(-1, H)  # [T, H]
        else:
            a = layer.attention.attend_masked(x, ran, ctx, self.impl, self.tuned).reshape(-1, H)  # [T, H]
        mlp = layer.mlp
        norm = _norm_params(layer.post_norm, h.dtype) if self.impl == "triton" and not mlp.partial_sums else None
        if norm is not None:
            out = torch.empty_like(hf)
            adapter = None if layer.adapter is None else layer.adapter.swiglu_weights()
            ops.routed_swiglu_(out, hf, a, maps, mlp.swiglu_weights(), adapter, *norm, gf, valid.reshape(-1),
                               impl=self.impl, tuned=self.tuned)
            return out.view_as(h)
        h1 = hf + a
        if not mlp.partial_sums:
            out = hf.clone()
            ops.grouped_swiglu_(out, h1, layer.post_norm(h1), run_rows, counts[0:1], *mlp.swiglu_weights(), gf,
                                impl=self.impl, tuned=self.tuned)  # run_value
        else:  # tensor parallel: this rank's MLP shard gives a partial sum; complete it, then add the residual
            acc = torch.zeros_like(hf)
            ops.grouped_swiglu_(acc, acc, layer.post_norm(h1), run_rows, counts[0:1], *mlp.swiglu_weights(), gf,
                                impl=self.impl, tuned=self.tuned)
            out = torch.where(ran.unsqueeze(-1), h1 + mlp.rank_sum(acc), hf)
        if layer.adapter is not None:
            ops.grouped_swiglu_(out, hf, layer.post_norm(hf), project_rows, counts[1:2],
                                *layer.adapter.swiglu_weights(), 1 - gf if layer.soft else None,
                                impl=self.impl, tuned=self.tuned)  # project_value
        return out.view_as(h)

    def describe(self) -> str:
        return f"{_what(self.name)}, fixed shapes ({self.impl} ops; no host sync; prefill gathered)"


class AutoBody(Body):
    """A dense body and routed ones (by kind), and the chooser among them: whole-layer bodies, or a
    sublayer skipper's (the chooser's tables say which: Chooser.width 2 reads both sublayers' counts).
    A decode step is priced at its resident K/V (AttentionPart.resident_tokens, host-side) where the
    decode table has a context axis. `forced` ("dense" or "routed", None: the chooser's) pins the body
    while a form of the step is captured (vskipper/replay.py: both forms per batch size, the host
    choosing which to replay); "routed" is `routed_form`."""

    name = "auto"

    def __init__(self, bodies: dict[str, Body], chooser: cost.Chooser) -> None:
        self.bodies, self.chooser = bodies, chooser
        self.chosen = dict.fromkeys(bodies, 0)  # steps each body ran (host-side counts: vskipper.stats)
        self.forced: str | None = None
        routed = [b for b in bodies.values() if b.needs_maps]
        self.needs_maps = bool(routed)
        if routed:
            self.maps_impl, self.tuned = routed[0].maps_impl, routed[0].tuned

    @property
    def routed_form(self) -> str:
        """The body a captured routed form runs: "routed" (attention, MLP and adapter for their rows),
        else "routed-mlp" where that is the routed body there is."""
        return next((k for k in ROUTED_KINDS if k in self.bodies), "dense")

    def form_body(self, form: str) -> str:
        """The body name of a captured form ("dense" or "routed")."""
        if form not in ("dense", "routed"):
            raise ValueError(f"AutoBody: form {form!r} is not 'dense' or 'routed'")
        return "dense" if form == "dense" else self.routed_form

    def select(self, layer, h, x, run, valid, maps, ctx) -> Body:
        if self.forced is not None:
            name = self.form_body(self.forced)
            self.chosen[name] += 1
            return self.bodies[name]
        T = h.numel() // h.shape[-1]
        decode = layer.attention.is_decode(x, ctx)
        counts = maps[2] if maps is not None else None
        if counts is not None and not counts.is_cpu and self.chooser.blind(counts):
            name = self.chooser.planned(T)  # capturing a graph: add nothing to it, read nothing
        else:
            resident = layer.attention.resident_tokens(x, ctx) if decode and self.chooser.reads_context else None
            if self.chooser.width == 1:
                # the RUN count: the maps' (on the device: fixed shapes) or read here (dynamic bodies, no maps)
                name = self.chooser.choose(T, counts if counts is not None else int((run & valid).sum()), decode,
                                           resident=resident)
            else:  # a sublayer layer's (attention RUN, MLP RUN): on the device, read a step late; or on the host
                both = (run & valid.unsqueeze(-1)).reshape(-1, 2).sum(0)  # [2]
                name = self.chooser.choose(T, both if maps is not None else tuple(both.tolist()), decode,
                                           resident=resident)
        self.chosen[name] += 1
        return self.bodies[name]

    def __call__(self, layer, h, x, g, run, valid, maps, ctx):
        return self.select(layer, h, x, run, valid, maps, ctx)(layer, h, x, g, run, valid, maps, ctx)

    def describe(self) -> str:
        both = " from the attention's and the MLP's RUN fractions" if self.chooser.width == 2 else ""
        where = " and the step's resident K/V" if self.chooser.reads_context else ""
        return (f"auto: {' or '.join(b.describe() for b in self.bodies.values())}, chosen per step on the host "
                f"by the cost model{both}{where}")


class SublayerDenseBody(Body):
    """A sublayer skipper's always-correct form: every row through attention and MLP, per sublayer a
    mask selects (padding rows skip both: out = h)."""

    name = "dense"

    def __call__(self, layer, h, x, g, run, valid, maps, ctx):
        run = run & valid.unsqueeze(-1)  # [..., 2]
        h1 = sublayer_value(h, layer.attention.attend_all(x, ctx), run[..., 0])
        return sublayer_value(h1, layer.mlp(layer.post_norm(h1)), run[..., 1])

    def describe(self) -> str:
        return "dense-masked sublayers (every row through attention and MLP; a mask per sublayer selects)"


class SublayerRoutedBody(Body):
    """A sublayer skipper's routed form, dynamic shapes: attention for the rows that run it (K/V
    written for every row), then the MLP for the rows that run it, each slicing to its real count
    (read on the host). Kind "routed-mlp" attends for every row and routes the MLP only. A sublayer
    every row runs is computed as the engine computes it, no gathers."""

    def __init__(self, kind: str = "routed") -> None:
        self.name = _kind(kind)

    def __call__(self, layer, h, x, g, run, valid, maps, ctx):
        hf = h.reshape(-1, h.shape[-1])  # [T, H]
        T = hf.shape[0]
        ran = (run & valid.unsqueeze(-1)).reshape(-1, 2)  # [T, 2]
        rows = ran[:, 0].nonzero().squeeze(1)  # [n_attn] ascending; data-dependent shapes are allowed here
        if self.name == "routed-mlp" or rows.numel() == T:
            a = layer.attention.attend_all(x, ctx).reshape(hf.shape)
            h1 = hf + a if rows.numel() == T else sublayer_value(hf, a, ran[:, 0])
        else:
            a = layer.attention.attend_rows(x, rows, ctx)  # [n_attn, H]; K/V written for all rows
            h1 = hf.clone()
            h1.index_copy_(0, rows, hf.index_select(0, rows) + a)
        rows = ran[:, 1].nonzero().squeeze(1)  # [n_mlp] ascending
        if rows.numel() == T:
            return (h1 + layer.mlp(layer.post_norm(h1))).view_as(h)
        out = h1.clone()
        if rows.numel():
            y = h1.index_select(0, rows)
            out.index_copy_(0, rows, y + _mlp_rows(layer.mlp, layer.post_norm(y), T))
        return out.view_as(h)

    def describe(self) -> str:
        what = ("routed-mlp sublayers (attention for every row, a mask selects; the MLP for its rows only)"
                if self.name == "routed-mlp" else "routed sublayers (attention for its rows, the MLP for its rows)")
        return f"{what}, dynamic shapes (torch; counts read on the host)"


class FixedSublayerBody(Body):
    """A sublayer skipper's routed form with fixed shapes, device-side counts and vskipper's grouped ops:
    no host sync (CUDA graphs). Kind "routed" attends for the attention's rows with the engine's masked
    attention (AttentionPart.masks_rows; other rows get zeros, so h + 0 = h); "routed-mlp" attends for
    every row and a mask selects. The MLP runs for the MLP's rows through the grouped SwiGLU, from the
    route maps of the MLP's decisions (RoutePass gives this body route_maps(run[..., 1], valid))."""

    needs_maps = True

    def __init__(self, kind: str, impl: str, tuned: bool = True) -> None:
        self.name = _kind(kind)
        self.impl = self.maps_impl = impl
        self.tuned = tuned

    def __call__(self, layer, h, x, g, run, valid, maps, ctx):
        mlp_rows, _, counts = maps  # the MLP's RUN rows first, counts[0] of them
        H = h.shape[-1]
        hf = h.reshape(-1, H)  # [T, H]
        ran = (run & valid.unsqueeze(-1)).reshape(-1, 2)  # [T, 2]
        if self.name == "routed":
            h1 = hf + layer.attention.attend_masked(x, ran[:, 0], ctx, self.impl, self.tuned).reshape(-1, H)
        else:
            h1 = sublayer_value(hf, layer.attention.attend_all(x, ctx).reshape(-1, H), ran[:, 0])
        mlp = layer.mlp
        if not mlp.partial_sums:
            out = h1.clone()
            ops.grouped_swiglu_(out, h1, layer.post_norm(h1), mlp_rows, counts[0:1], *mlp.swiglu_weights(), None,
                                impl=self.impl, tuned=self.tuned)
        else:  # tensor parallel: this rank's MLP shard gives a partial sum; complete it, then add the residual
            acc = torch.zeros_like(hf)
            ops.grouped_swiglu_(acc, acc, layer.post_norm(h1), mlp_rows, counts[0:1], *mlp.swiglu_weights(), None,
                                impl=self.impl, tuned=self.tuned)
            out = torch.where(ran[:, 1:], h1 + mlp.rank_sum(acc), h1)
        return out.view_as(h)

    def describe(self) -> str:
        what = ("routed-mlp sublayers (attention for every row, a mask selects; the MLP for its rows only)"
                if self.name == "routed-mlp" else "routed sublayers (attention for its rows, the MLP for its rows)")
        return f"{what}, fixed shapes ({self.impl} ops; no host sync)"


def sublayer_routed_body(plan: Plan, kind: str) -> Body:
    """A sublayer skipper's routed body of `kind` in the plan's shapes (dynamic, or fixed and graph-safe)."""
    return FixedSublayerBody(kind, plan.impl, plan.tuned_kernels) if plan.fixed_shapes else SublayerRoutedBody(kind)


def make_sublayer_body(plan: Plan, attention: AttentionPart) -> tuple[Body, str]:
    """The body of one routed layer of a sublayer skipper and why. `auto` chooses among the sublayer
    bodies with the sublayer cost tables (plan.sublayer_decode/prefill); without them it runs dense-masked,
    the always-correct form, and warns once. A fixed-shape "routed" body needs an attention part that
    masks rows; where the engine has none, the layer runs "routed-mlp"."""
    if plan.execution == "dense":
        return SublayerDenseBody(), "execution='dense'"
    no_mask = plan.fixed_shapes and not attention.masks_rows
    why_mlp = (f"; {type(attention).__name__} has no fixed-shape masked attention, so attention runs for every row"
               if no_mask else "")
    if plan.execution == "auto":
        decode, prefill = plan.sublayer_decode, plan.sublayer_prefill
        if decode is None:
            if plan.calibrated_for:
                cost.warn_uncalibrated(*plan.calibrated_for, sublayers=True)
            return SublayerDenseBody(), ("execution='auto': the cost model does not time sublayer bodies on this "
                                         "device yet, so dense-masked (run `vskipper calibrate --sublayers`)")
        if prefill is None and plan.calibrated_for:
            cost.warn_no_prefill(*plan.calibrated_for, sublayers=True)
        bodies: dict[str, Body] = {"dense": SublayerDenseBody()}
        for kind in ROUTED_KINDS:
            if not (kind == "routed" and no_mask):
                bodies[kind] = sublayer_routed_body(plan, kind)
        chooser = cost.Chooser(decode, plan.expected_run_fraction, prefill=prefill, bodies=tuple(bodies))
        pre = (f"prefill calibration {prefill.key()!r}" if prefill is not None
               else "no prefill calibration: prefill priced by the decode table")
        return AutoBody(bodies, chooser), (f"execution='auto', {plan.shapes}, impl={plan.impl!r}, calibration "
                                           f"{decode.key()!r}, {pre}{why_mlp}")
    why = f"execution={plan.execution!r}, {plan.shapes}"
    if not plan.fixed_shapes:
        return SublayerRoutedBody(plan.execution), why
    if plan.execution == "routed" and no_mask:
        return FixedSublayerBody("routed-mlp", plan.impl, plan.tuned_kernels), f"{why}, impl={plan.impl!r}{why_mlp}"
    return FixedSublayerBody(plan.execution, plan.impl, plan.tuned_kernels), f"{why}, impl={plan.impl!r}"


def routed_body(plan: Plan, kind: str) -> Body:
    return FixedRoutedBody(kind, plan.impl, plan.tuned_kernels) if plan.fixed_shapes else RoutedBody(kind)


def make_body(plan: Plan, attention: AttentionPart, sublayers: bool = False) -> tuple[Body, str]:
    """The body of one routed layer and why: decided here, once. A fixed-shape "routed" body needs
    an attention part that masks rows; where the engine has none (transformers), the layer runs
    "routed-mlp" and the reason says so. A sublayer skipper's layer: make_sublayer_body."""
    if sublayers:
        return make_sublayer_body(plan, attention)
    if plan.execution == "dense":
        return DenseBody(), "execution='dense'"
    no_mask = plan.fixed_shapes and not attention.masks_rows
    why_mlp = (f"; {type(attention).__name__} has no fixed-shape masked attention, so attention runs for "
               f"every row" if no_mask else "")
    if plan.execution != "auto":
        kind = "routed-mlp" if no_mask else plan.execution
        return routed_body(plan, kind), (f"execution={plan.execution!r}, {plan.shapes}, impl={plan.impl!r}"
                                         f"{why_mlp if plan.execution == 'routed' else ''}")
    if plan.decode is None:
        return DenseBody(), "execution='auto' without a cost calibration for this device (run `vskipper calibrate`)"
    timed = set(plan.decode.bodies()) | set(plan.prefill.bodies() if plan.prefill is not None else ())
    bodies: dict[str, Body] = {"dense": DenseBody()}
    for kind in ROUTED_KINDS:
        if kind in timed and not (kind == "routed" and no_mask):
            bodies[kind] = routed_body(plan, kind)
    prefill = (f"prefill calibration {plan.prefill.key()!r}" if plan.prefill is not None
               else "no prefill calibration: prefill priced by the decode table")
    chooser = cost.Chooser(plan.decode, plan.expected_run_fraction, prefill=plan.prefill, bodies=tuple(bodies))
    return AutoBody(bodies, chooser), (f"execution='auto', {plan.shapes}, impl={plan.impl!r}, calibration "
                                       f"{plan.decode.key()!r}, {prefill}{why_mlp if 'routed' in timed else ''}")


class RoutedLayer(nn.Module):
    """A routed decoder layer: the layer's own parts and the skipper's adapter, run by `body`."""

    def __init__(self, index: int, attention: AttentionPart, post_norm: nn.Module, mlp: MLPPart,
                 adapter: nn.Module | None, gate: str, body: Body, check_sync: bool = False) -> None:
        super().__init__()
        self.index = index
        self.attention = attention
        self.post_norm = post_norm
        self.mlp = mlp
        self.adapter = adapter
        self.soft = gate == "soft"
        self.body = body
        self.check_sync = check_sync

    def forward(self, h, x, g, run, valid, maps, **ctx):
        # h, x [..., H]; g, run, valid [...]; maps = route_maps(run, valid) or None (dense)
        body = self.body.select(self, h, x, run, valid, maps, ctx)  # auto's host-side choice: outside the guard,
        if self.check_sync and self.attention.is_decode(x, ctx):  # which checks what a graph captures
            with NoHostSync(f"routed layer {self.index}"):
                return body(self, h, x, g, run, valid, maps, ctx)
        return body(self, h, x, g, run, valid, maps, ctx)

    def extra_repr(self) -> str:
        return f"index={self.index}, body={self.body.describe()!r}, soft={self.soft}"
