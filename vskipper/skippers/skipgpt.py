"""SkipGPT: per token and routed layer, one router decides the attention and another the MLP
(a sublayer skipper; docs/architecture.md, "Sublayer skippers (SkipGPT)").

Routers (SkipGPT's TokenRouter), both on the layer's input h (before input_layernorm), in float32
(router_dtype: SkipGPT builds them in fp32 after loading the bf16 model and never casts them):
    logits = weight_predictor(relu(hidden_layer(h.float()))).to(h.dtype)   # [T, 2]: execute, skip
    run    = not (logits[..., 1] > logits[..., 0])
the mode of SkipGPT's gumbel_softmax(logits, hard=True) without its noise (argmax, a tie RUNs; a NaN
logit RUNs, the contract's meaning of a broken gate). The two routers' decisions are the skipper's
[T, 2] bools (attention, MLP): no threshold applies.

Checkpoint: a directory of config.json and *.safetensors in SkipGPT's own key names (its code writes
pickled state dicts, which vskipper never loads: convert them to safetensors, keys unchanged).
    config.json   a Llama config with architectures ["SkipGPTLlamaForCausalLM"] and
                  "skipgpt": {"layers": [...] (optional; default every layer, as SkipGPT routes them),
                              "lora": {"r": int, "lora_alpha": number} (where LoRA tensors are present)}
    model.layers.{i}.router_attention.hidden_layer.weight   [H/4, H]   .bias [H/4]
    model.layers.{i}.router_attention.weight_predictor.weight [2, H/4] .bias [2]
    model.layers.{i}.router_mlp.*                            the same
    model.layers.{i}.block.<module>.weight                   the base decoder layer (SkipGPT wraps it as `block`)
    model.embed_tokens.weight, model.norm.weight, lm_head.weight
  After SkipGPT's LoRA stage (PEFT) every key carries the prefix "base_model.model.", and a LoRA target
  module m holds m.base_layer.weight [out, in], m.lora_A.default.weight [r, in] and
  m.lora_B.default.weight [out, r]. The LoRA is merged at load, W + (lora_alpha / r) * B @ A: the
  function SkipGPT's unmerged PEFT model computes at evaluation (dropout off).
"""
from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from vskipper.skippers.base import SUBLAYERS, Skipper

ARCHITECTURE = "SkipGPTLlamaForCausalLM"
PEFT_PREFIX = "base_model.model."
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(router_attention|router_mlp|block)\.(.+)$")


class TokenRouter(nn.Module):
    """SkipGPT's router: h [..., H] -> decisions [...] bool (True = execute), from two logits computed
    in the router's dtype and cast back to h's, as SkipGPT computes them."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.hidden_layer = nn.Linear(hidden, hidden // 4)
        self.weight_predictor = nn.Linear(hidden // 4, 2)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        z = torch.relu(self.hidden_layer(h.to(self.hidden_layer.weight.dtype)))
        return self.weight_predictor(z).to(h.dtype)  # [..., 2]: execute, skip

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.logits(h)
        return ~(logits[..., 1] > logits[..., 0])


class SkipGPTRouter(nn.Module):
    """Routed layer l's two routers: h [..., H] -> decisions [..., 2] bool (attention, MLP; True = RUN)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.router_attention = TokenRouter(hidden)
        self.router_mlp = TokenRouter(hidden)

    def forward(self, h: torch.Tensor, positions=None, token_ids=None) -> torch.Tensor:
        return torch.stack([self.router_attention(h), self.router_mlp(h)], -1)


class SkipGPT(Skipper):
    """SkipGPT's routers at `layers` of a model of width `hidden_size` (hard gate, no adapter, routers
    in float32)."""

    router_dtype = torch.float32

    def __init__(self, layers: Iterable[int], hidden_size: int) -> None:
        super().__init__(layers, gate="hard", sublayers=SUBLAYERS, router_input="residual")
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 4:
            raise ValueError(f"SkipGPT: hidden_size={hidden_size!r} must be an integer >= 4")
        self.hidden_size = hidden_size
        self.routers = nn.ModuleDict({str(l): SkipGPTRouter(hidden_size) for l in self.layers})

    def router(self, layer: int) -> nn.Module:
        return self.routers[str(layer)]

    def check_model(self, num_layers: int, hidden_size: int) -> None:
        super().check_model(num_layers, hidden_size)
        if hidden_size != self.hidden_size:
            raise ValueError(f"SkipGPT: hidden_size={self.hidden_size} but the model's is {hidden_size}")

    def skipgpt_state_dict(self) -> dict[str, torch.Tensor]:
        """The routers' tensors under SkipGPT's key names (model.layers.{l}.router_attention...)."""
        return {f"model.layers.{l}.{k}": v for l in self.layers for k, v in self.router(l).state_dict().items()}

    def extra_repr(self) -> str:
        return f"layers={list(self.layers)}, hidden_size={self.hidden_size}"


def fields(cfg: dict, where: str) -> tuple[list[int] | None, dict | None]:
    """config.json's "skipgpt" object -> (routed layers or None: every layer, lora {r, lora_alpha} or None)."""
    from vskipper.models.checkpoint import CheckpointError

    archs = cfg.get("architectures")
    if not isinstance(archs, list) or archs[:1] != [ARCHITECTURE]:
        raise CheckpointError(f"{where}: config.json architectures={archs!r}; expected [{ARCHITECTURE!r}]")
    block = cfg.get("skipgpt", {})
    if not isinstance(block, dict):
        raise CheckpointError(f"{where}: config.json skipgpt={block!r} must be an object")
    unknown = sorted(set(block) - {"layers", "lora"})
    if unknown:
        raise CheckpointError(f"{where}: config.json skipgpt.{unknown[0]} is not a field; the fields are layers, lora")
    layers = block.get("layers")
    if layers is not None and (not isinstance(layers, list) or not layers
                               or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers)):
        raise CheckpointError(f"{where}: config.json skipgpt.layers={layers!r} must be a non-empty list of layer "
                              f"indices")
    lora = block.get("lora")
    if lora is not None:
        r, alpha = (lora.get("r"), lora.get("lora_alpha")) if isinstance(lora, dict) else (None, None)
        if (isinstance(r, bool) or not isinstance(r, int) or r <= 0 or isinstance(alpha, bool)
                or not isinstance(alpha, (int, float)) or sorted(lora) != ["lora_alpha", "r"]):
            raise CheckpointError(f"{where}: config.json skipgpt.lora={lora!r} must be {{\"r\": a positive integer, "
                                  f"\"lora_alpha\": a number}}")
    return layers, lora


def _merge_lora(base: dict[str, torch.Tensor], lora: dict[str, dict[str, torch.Tensor]], cfg: dict | None,
                where: str) -> None:
    """W += (lora_alpha / r) * B @ A for every LoRA target module, in fp32, in place in `base`."""
    from vskipper.models.checkpoint import CheckpointError

    if lora and cfg is None:
        raise CheckpointError(f"{where}: LoRA tensors for {sorted(lora)[0]!r} but config.json has no "
                              f"skipgpt.lora {{\"r\", \"lora_alpha\"}} to scale them")
    for module, parts in sorted(lora.items()):
        missing = [p for p in ("lora_A", "lora_B") if p not in parts] + ([] if module + ".weight" in base else
                                                                         ["base_layer"])
        if missing:
            raise CheckpointError(f"{where}: LoRA module {module!r} has no {missing[0]} weight")
        a, b, w = parts["lora_A"], parts["lora_B"], base[module + ".weight"]
        if a.shape != (cfg["r"], w.shape[1]) or b.shape != (w.shape[0], cfg["r"]):
            raise CheckpointError(f"{where}: LoRA module {module!r}: lora_A {list(a.shape)}, lora_B {list(b.shape)} "
                                  f"do not fit its weight {list(w.shape)} at r={cfg['r']}")
        scale = cfg["lora_alpha"] / cfg["r"]
        base[module + ".weight"] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)


def base_tensors(items, lora_cfg: dict | None, where: str, routers: dict):
    """Stream a SkipGPT checkpoint's (name, tensor) pairs (see the module docstring) as the base model's,
    under transformers' (and SGLang's) Llama names, LoRA merged; the routers' tensors go into `routers`
    ({l: {name: tensor}}). Only the LoRA targets' weights are held until the end, where they are merged."""
    held: dict[str, torch.Tensor] = {}
    lora: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in items:
        k = key.removeprefix(PEFT_PREFIX)
        m = _LAYER.match(k)
        if m and m.group(2) != "block":
            routers.setdefault(int(m.group(1)), {})[f"{m.group(2)}.{m.group(3)}"] = t
            continue
        if m:
            k = f"model.layers.{m.group(1)}.{m.group(3)}"
        lo = re.match(r"^(.+)\.(lora_A|lora_B)\.default\.weight$", k)
        if lo:
            lora.setdefault(lo.group(1), {})[lo.group(2)] = t
        elif ".base_layer." in k:
            held[k.replace(".base_layer.", ".")] = t
        else:
            yield k, t
    _merge_lora(held, lora, lora_cfg, where)
    yield from held.items()


def split_tensors(tensors: dict[str, torch.Tensor], cfg: dict, where: str):
    """A SkipGPT checkpoint's tensors -> (the base model's tensors, LoRA merged (base_tensors); the
    routers' tensors per layer {l: {name: tensor}}; the routed layers skipgpt.layers names, or None:
    every layer)."""
    layers, lora_cfg = fields(cfg, where)
    routers: dict[int, dict[str, torch.Tensor]] = {}
    base = dict(base_tensors(tensors.items(), lora_cfg, where, routers))
    return base, routers, layers


def make_skipgpt(routers: dict[int, dict[str, torch.Tensor]], layers: list[int] | None, n_layers: int, hidden: int,
                 where: str) -> SkipGPT:
    """The SkipGPT skipper of a model of n_layers layers of width `hidden`, its routers loaded from
    split_tensors' routers (float32). CheckpointError naming the tensor for a missing or misshapen one."""
    from vskipper.models.checkpoint import CheckpointError

    routed = list(range(n_layers)) if layers is None else layers
    try:
        skipper = SkipGPT(routed, hidden)
        skipper.check_model(n_layers, hidden)
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from None
    extra = sorted(set(routers) - set(skipper.layers))
    if extra:
        raise CheckpointError(f"{where}: router weights for layer {extra[0]}, which skipgpt.layers does not route")
    for l in skipper.layers:
        router = skipper.router(l)
        found = routers.get(l, {})
        for name, ref in router.state_dict().items():
            if name not in found:
                raise CheckpointError(f"{where}: missing router tensor 'model.layers.{l}.{name}' "
                                      f"(expected shape {list(ref.shape)})")
            if found[name].shape != ref.shape:
                raise CheckpointError(f"{where}: router tensor 'model.layers.{l}.{name}' has shape "
                                      f"{list(found[name].shape)}, expected {list(ref.shape)}")
        router.load_state_dict({k: found[k].float() for k in router.state_dict()})
    return skipper.eval()


def load_skipgpt(path, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, SkipGPT]:
    """A SkipGPT checkpoint directory (see the module docstring) -> (the base transformers
    LlamaForCausalLM in `dtype` with its LoRA merged, the SkipGPT skipper in float32), neither
    transformed. Only safetensors are read; no remote code runs."""
    from vskipper.models.checkpoint import load_tensors, read_config
    from vskipper.models.hf_loader import build_base_model

    where = str(path)
    cfg = read_config(path)
    base, routers, layers = split_tensors(load_tensors(path), cfg, where)
    model = build_base_model({k: v for k, v in cfg.items() if k != "skipgpt"}, "llama", base, path, dtype)
    return model, make_skipgpt(routers, layers, model.config.num_hidden_layers, model.config.hidden_size, where)
