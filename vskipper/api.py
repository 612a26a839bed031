"""The public verbs: transform, from_pretrained, stats, explain."""
from __future__ import annotations

import torch
from torch import nn

from vskipper.config import Config
from vskipper.control import COUNTS, SETTINGS, RequestCap
from vskipper.counters import Phase, route_counter
from vskipper.models import ModelFamily, family_for
from vskipper.passes import RoutePass, VerifyPass, run_passes, trace_stack
from vskipper.routed_layer import AutoBody, Body, Plan, RoutedLayer, make_body, resolve_plan
from vskipper.skippers.base import Skipper

GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # batch sizes explain() shows auto's graph plan for


class VSkipperState(nn.Module):
    """What `transform` attaches to a model (as `model.vskipper`): the skipper, the per-layer
    route counters and the phase they count in (set by the engine's forward: prefill or decode), the
    per-layer request caps (where the engine passes per-request budgets, vskipper/control.py), the
    config and its resolved plan, what each routed layer runs and why, and the transformed stacks
    (`graphs`, fx GraphModules; their modules are the model's own). Its repr is `explain`."""

    def __init__(self, skipper: Skipper, config: Config, family: ModelFamily, device: torch.device,
                 plan: Plan) -> None:
        super().__init__()
        self.skipper = skipper
        self.phase = Phase()  # one buffer for every counter: the engine's forward sets it (vskipper/counters.py)
        self.counters = nn.ModuleDict({str(l): route_counter(bool(skipper.sublayers), self.phase)
                                       for l in skipper.layers})
        n = len(skipper.layers)
        self.caps = nn.ModuleDict({str(l): RequestCap(r, n, bool(skipper.sublayers))
                                   for r, l in enumerate(skipper.layers)})
        self.config = config
        self.plan = plan
        self.family = family.name
        self.device = device
        self.rewritten: list[int] = []
        self.bodies: dict[int, Body] = {}
        self.reasons: dict[int, str] = {}
        self.graphs: tuple = ()
        self.levels: tuple[int, ...] = ()  # elastic depth's ladder of budgets, where an engine runs one

    def explain(self) -> str:
        n = len(self.skipper.layers)
        lines = [f"vskipper: {self.family} on {self.device}, {type(self.skipper).__name__}"
                 f"({self.skipper.extra_repr()}), {self.config}",
                 f"rewritten {len(self.rewritten)}/{n} routed layers:"]
        groups: list[list] = []  # consecutive layers that run the same body for the same reason
        for i in self.rewritten:
            key = (self.bodies[i].describe(), self.reasons[i])
            if groups and groups[-1][0] == key and groups[-1][2] == i - 1:
                groups[-1][2] = i
            else:
                groups.append([key, i, i])
        for (what, why), lo, hi in groups:
            lines.append(f"  layer{'s' if hi > lo else ''} {lo if lo == hi else f'{lo}-{hi}'}: {what}  [{why}]")
        auto = next((b.chooser for b in self.bodies.values() if isinstance(b, AutoBody)), None)
        if auto is not None:
            plan = " ".join(f"{T}:{b}" for T, b in auto.plan(GRAPH_SIZES).items())
            lines.append(f"  auto inside captured CUDA graphs, body per batch size at RUN fraction {auto.expected:g} "
                         f"({'declared by the skipper' if auto.declared else 'not declared: assumed'}): {plan}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.explain()


def transform(model: nn.Module, skipper: Skipper, config: Config | None = None, *, budgets=None) -> nn.Module:
    """Make `model` skip-aware in place, and return it.

    model:   a transformers LlamaForCausalLM or Qwen3ForCausalLM (or an SGLang Llama/Qwen3
             model inside SGLang); anything else raises TypeError naming the supported classes.
    skipper: a `vskipper.Skipper` (FlexiDepth, RandomSkip, Static, ...); its routed layer indices
             must exist in the model (ValueError otherwise). It is moved to the model's device
             and dtype (or its own `router_dtype`) and attached as `model.vskipper.skipper`.
    config:  `vskipper.Config(execution="auto" | "dense" | "routed" | "routed-mlp", impl=...)`; every choice
             computes the same function. "auto" uses the cost model measured by `vskipper calibrate`
             on this device; with no calibration it runs dense-masked and warns once.
    budgets: for an engine with per-request control (the SGLang plugin): the per-row budget buffer its
             routed layers read (vskipper/control.py); None elsewhere.

    What each routed layer runs (its body) is decided here, once; `print(model.vskipper)` (or
    `vskipper.explain(model)`) says which and why. A torch.fx pass traces the model's decoder
    stack with decoder layers as leaves and, at every routed layer, inserts input_layernorm ->
    router -> route decisions -> route maps -> route counter -> routed layer. K/V are written for
    every token at every layer. Route counts are read with `vskipper.stats(model)`.
    """
    config = Config() if config is None else config
    if not isinstance(config, Config):
        raise TypeError(f"vskipper.transform: config must be a vskipper.Config, got {type(config).__name__}")
    if not isinstance(skipper, Skipper):
        raise TypeError(f"vskipper.transform: skipper must be a vskipper.Skipper, got {type(skipper).__name__}")
    family = family_for(model)  # TypeError naming the supported classes
    if hasattr(model, "vskipper") and isinstance(getattr(model, "vskipper"), VSkipperState):
        raise ValueError("vskipper.transform: this model is already transformed; transform a fresh model")
    layers = family.layers(model)
    p = next(layers[0].parameters())
    hidden, dtype, device = model.config.hidden_size, p.dtype, p.device
    skipper.check_model(len(layers), hidden)
    stacks = family.make_stacks(model, skipper.layers)
    skipper.to(device=device, dtype=skipper.router_dtype or dtype)
    plan = resolve_plan(config, device, hidden, getattr(model.config, "intermediate_size", hidden), dtype,
                        skipper.expected_run_fraction, sublayers=bool(skipper.sublayers))
    state = VSkipperState(skipper, config, family, device, plan).to(device)

    def make_routed(i: int, layer: nn.Module) -> RoutedLayer:
        attention = family.make_attention(layer)
        state.bodies[i], state.reasons[i] = make_body(plan, attention, sublayers=bool(skipper.sublayers))
        return RoutedLayer(i, attention, getattr(layer, family.post_norm), family.make_mlp(layer), skipper.adapter(i),
                           skipper.gate, state.bodies[i], check_sync=config.check_sync)

    transformed = []
    for stack in stacks:
        routed = [i for i in stack.indices if i in skipper.layers]
        route = RoutePass(skipper, make_routed, state.counters, family.input_norm, layers=routed, caps=state.caps)
        gm, _ = run_passes(trace_stack(stack), [route, VerifyPass(stack.indices, routed)])
        state.rewritten += route.rewritten
        transformed.append((stack, gm))
    state.graphs = tuple(gm for _, gm in transformed)
    model.vskipper = state
    family.install(model, transformed, budgets)
    return model


def _state(model: nn.Module, verb: str = "stats") -> VSkipperState:
    state = getattr(model, "vskipper", None)
    if not isinstance(state, VSkipperState):
        raise ValueError(f"vskipper.{verb}: this model was not transformed by vskipper.transform")
    return state


def explain(model: nn.Module) -> str:
    """Per routed layer: which body runs, in which implementation, and why (`print(model.vskipper)`)."""
    return _state(model, "explain").explain()


def chosen_bodies(model: nn.Module, reset: bool = False) -> dict[str, int]:
    """With execution="auto": how many layer-steps each body ran since the last reset, summed over the
    routed layers ({} for another execution). Counted on the host where auto chooses."""
    out: dict[str, int] = {}
    for body in _state(model).bodies.values():
        if isinstance(body, AutoBody):
            for name, n in body.chosen.items():
                out[name] = out.get(name, 0) + n
                if reset:
                    body.chosen[name] = 0
    return out


def stats(model: nn.Module, reset: bool = False, by_setting: bool = False) -> dict:
    """Route counts per routed layer since the last reset:
    {layer: {"tokens": n, "run": n, "project": n, "nonfinite": n, "prefill_tokens": n, ..., "decode_tokens": n,
    ...}} (padding rows not counted; "nonfinite" counts tokens whose router gave NaN/Inf, which ran the
    layer). The unprefixed counts are over every token; "prefill_*" count prompt tokens (the forward
    over a prompt, or a prompt's chunk) and "decode_*" generated tokens (a step of one new token per
    sequence), and each pair sums to the unprefixed count. A sublayer skipper's layers count "tokens",
    "attention_run", "attention_skip", "mlp_run", "mlp_skip", "nonfinite", and "run" / "project" in
    sublayer decisions (two per token), each per phase too: project / (run + project) is the skipped
    share for either kind (vskipper.counters.skipped_share(st, phase) sums it over the layers).

    by_setting=True: the same rows split by what their request chose (vskipper/control.py), where the
    engine passes per-request settings (SGLang): {setting: {layer: {"tokens", "run", "project",
    "forced"}}}, setting "default" (no cap), "capped" (max_skip below 1 but above 0 layers) or
    "no_skip" (skip false, or a cap of 0 layers); "forced" counts rows forced to RUN by the setting.
    Under elastic depth (vskipper/elastic.py) also "level j": the rows whose cap (the stricter of the
    request's field and its level) was level j's budget.
    reset zeroes the counts returned (by_setting: the caps' and the route counters')."""
    state = _state(model)
    if by_setting:  # the caps count the rows with a budget; "default" is the rest of the layer's rows
        out = {s: {} for s in SETTINGS + tuple(f"level {j}" for j in range(len(state.levels)))}
        for key, cap in state.caps.items():
            layer = int(key)
            rows = dict(zip(SETTINGS, cap.setting_counts()))
            total = state.counters[key].read()
            rows["default"] = [total[c] - sum(rows[s][i] for s in SETTINGS[1:]) if c in total else 0
                               for i, c in enumerate(COUNTS)]
            by_budget = cap.counts.tolist()
            for j, k in enumerate(state.levels):  # elastic depth: the rows whose cap was level j's
                rows[f"level {j}"] = rows["default"] if k >= cap.n_layers else by_budget[k]
            for s in out:
                out[s][layer] = dict(zip(COUNTS, rows[s]))
            if reset:
                cap.counts.zero_()
                state.counters[key].counts.zero_()
        return out
    out = {}
    for key, counter in state.counters.items():
        out[int(key)] = counter.read()
        if reset:
            counter.counts.zero_()
    return out


def from_pretrained(path, config: Config | None = None, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Load a skip-aware checkpoint directory and return the transformed transformers model.

    The directory holds config.json with architectures ["DDLlamaForCausalLM"] or
    ["DDQwen3ForCausalLM"], routing_layers, optional gate_mode (default soft for DDLlama, hard
    for DDQwen3), router_reduction_factor / proj_reduction_factor (default 16), and safetensors
    weights in the FlexiDepth key layout; or architectures ["SkipGPTLlamaForCausalLM"] and SkipGPT's
    key layout (vskipper/skippers/skipgpt.py: its routers, LoRA merged). Pickled weights are refused; no
    remote code runs."""
    from vskipper.models.checkpoint import load_tensors, read_config, skipper_fields
    from vskipper.models.hf_loader import build_base_model
    from vskipper.skippers.flexidepth import FlexiDepth
    from vskipper.skippers.skipgpt import ARCHITECTURE, load_skipgpt

    cfg = read_config(path)
    archs = cfg.get("architectures")
    if isinstance(archs, list) and archs[:1] == [ARCHITECTURE]:
        return transform(*load_skipgpt(path, dtype), config)
    f = skipper_fields(cfg, path)
    skipper = FlexiDepth.from_fields(f)
    tensors = load_tensors(path)
    skipper.load_flexidepth_state_dict(tensors, source=str(path))
    model = build_base_model(cfg, f["family"], tensors, path, dtype)
    return transform(model, skipper.to(dtype), config)
