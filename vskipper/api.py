"""The public verbs: transform, from_pretrained, stats."""
from __future__ import annotations

import torch
from torch import nn

from vskipper import cost
from vskipper.config import Config
from vskipper.models import ModelAdapter, adapter_for
from vskipper.passes import DispatchPass, RoutePass, VerifyPass, run_passes, trace_stack
from vskipper.routed_layer import RouteCounter, RoutedLayer
from vskipper.skippers.base import Skipper


class VSkipperState(nn.Module):
    """What `transform` attaches to a model (as `model.vskipper`): the skipper, the per-layer
    route counters, the config and what the passes did."""

    def __init__(self, skipper: Skipper, config: Config, adapter: ModelAdapter) -> None:
        super().__init__()
        self.skipper = skipper
        self.counters = nn.ModuleDict({str(l): RouteCounter() for l in skipper.layers})
        self.config = config
        self.adapter_name = adapter.name
        self.rewritten: list[int] = []
        self.bodies: dict[int, str] = {}

    def extra_repr(self) -> str:
        return f"config={self.config}, rewritten={len(self.rewritten)}/{len(self.skipper.layers)} routed layers"


def _model_dims(model: nn.Module, layers: nn.ModuleList) -> tuple[int, int, torch.dtype, torch.device]:
    p = next(layers[0].parameters())
    return len(layers), model.config.hidden_size, p.dtype, p.device


def transform(model: nn.Module, skipper: Skipper, config: Config | None = None) -> nn.Module:
    """Make `model` skip-aware in place, and return it.

    model:   a transformers LlamaForCausalLM or Qwen3ForCausalLM (or an SGLang Llama/Qwen3
             model inside SGLang); anything else raises TypeError naming the supported classes.
    skipper: a `vskipper.Skipper` (FlexiDepth, RandomSkip, Static, ...); its routed layer indices
             must exist in the model (ValueError otherwise). It is moved to the model's device
             and dtype and attached as `model.vskipper.skipper`.
    config:  `vskipper.Config(execution="auto" | "dense" | "routed")`; every choice computes the
             same function. "auto" uses the cost model measured by `vskipper calibrate` on this
             device; with no calibration it runs dense-masked and warns once.

    A torch.fx pass traces the model's decoder stack with decoder layers as leaves and, at every
    routed layer, inserts input_layernorm -> router -> route decisions -> route maps -> route
    counter -> routed layer. K/V are written for every token at every layer. Route counts are
    read with `vskipper.stats(model)`.
    """
    config = Config() if config is None else config
    if not isinstance(config, Config):
        raise TypeError(f"vskipper.transform: config must be a vskipper.Config, got {type(config).__name__}")
    if not isinstance(skipper, Skipper):
        raise TypeError(f"vskipper.transform: skipper must be a vskipper.Skipper, got {type(skipper).__name__}")
    adapter = adapter_for(model)  # TypeError naming the supported classes
    if hasattr(model, "vskipper") and isinstance(getattr(model, "vskipper"), VSkipperState):
        raise ValueError("vskipper.transform: this model is already transformed; transform a fresh model")
    stack = adapter.make_stack(model)
    n_layers, hidden, dtype, device = _model_dims(model, stack.layers)
    skipper.check_model(n_layers, hidden)
    skipper.to(device=device, dtype=dtype)
    state = VSkipperState(skipper, config, adapter).to(device)

    def make_routed(i: int, layer: nn.Module) -> RoutedLayer:
        return RoutedLayer(i, adapter.make_attention(layer), getattr(layer, adapter.post_norm),
                           getattr(layer, adapter.mlp), skipper.adapter(i), skipper.gate,
                           mlp_weights=adapter.mlp_weights, static_shapes=config.static_shapes,
                           check_sync=config.check_sync)

    calibration = None
    if config.execution == "auto":
        intermediate = getattr(model.config, "intermediate_size", hidden)
        calibration = cost.load(device, hidden, intermediate)
        if calibration is None:
            cost.warn_uncalibrated(device, hidden, intermediate)
    route = RoutePass(skipper, make_routed, state.counters, adapter.input_norm)
    dispatch = DispatchPass(config, calibration)
    gm, _ = run_passes(trace_stack(stack), [route, dispatch, VerifyPass(n_layers, skipper.layers)])
    state.rewritten, state.bodies = route.rewritten, dispatch.bodies
    model.vskipper = state
    adapter.install(model, gm)
    return model


def _state(model: nn.Module) -> VSkipperState:
    state = getattr(model, "vskipper", None)
    if not isinstance(state, VSkipperState):
        raise ValueError("vskipper.stats: this model was not transformed by vskipper.transform")
    return state


def stats(model: nn.Module, reset: bool = False) -> dict[int, dict[str, int]]:
    """Route counts per routed layer since the last reset:
    {layer: {"tokens": n, "run": n, "project": n, "nonfinite": n}} (padding rows not counted;
    "nonfinite" counts tokens whose router gave NaN/Inf, which ran the layer)."""
    out = {}
    for key, counter in _state(model).counters.items():
        out[int(key)] = dict(zip(RouteCounter.FIELDS, counter.counts.tolist()))
        if reset:
            counter.counts.zero_()
    return out


def from_pretrained(path, config: Config | None = None, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Load a skip-aware checkpoint directory and return the transformed transformers model.

    The directory holds config.json with architectures ["DDLlamaForCausalLM"] or
    ["DDQwen3ForCausalLM"], routing_layers, optional gate_mode (default soft for DDLlama, hard
    for DDQwen3), router_reduction_factor / proj_reduction_factor (default 16), and safetensors
    weights in the FlexiDepth key layout. Pickled weights are refused; no remote code runs."""
    from vskipper.models.checkpoint import load_tensors, read_config, skipper_fields
    from vskipper.models.hf_loader import build_base_model
    from vskipper.skippers.flexidepth import FlexiDepth

    cfg = read_config(path)
    f = skipper_fields(cfg, path)
    skipper = FlexiDepth(
        f["routing_layers"], hidden_size=f["hidden_size"], intermediate_size=f["intermediate_size"],
        rms_norm_eps=f["rms_norm_eps"], gate=f["gate_mode"],
        router_reduction_factor=f["router_reduction_factor"], proj_reduction_factor=f["proj_reduction_factor"],
    )
    tensors = load_tensors(path)
    skipper.load_flexidepth_state_dict(tensors, source=str(path))
    model = build_base_model(cfg, f["family"], tensors, path, dtype)
    return transform(model, skipper.to(dtype), config)
