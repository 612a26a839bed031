"""SGLang model classes for skip-aware checkpoints: `DDLlamaForCausalLM`, `DDQwen3ForCausalLM` and
`SkipGPTLlamaForCausalLM`.

They are SGLang's own Llama / Qwen3 (SGLang's loader, attention and MLP parts) plus the skipper read
from the same checkpoint: FlexiDepth's key layout, or SkipGPT's (vskipper/skippers/skipgpt.py: its
base layers under `.block.`, its routers, its LoRA merged as the weights stream in). The load-time
hook then transforms them with `vskipper.transform`."""
from __future__ import annotations

from transformers import LlamaConfig, Qwen3Config

from vskipper.models.checkpoint import skipper_fields
from vskipper.skippers.flexidepth import FlexiDepth

SKIPPER_KEY_PARTS = (".router.", ".router_proj.")


def _skipper_for(config) -> FlexiDepth:
    d = config.to_dict()
    if "original_intermediate_size" in d:  # SGLang pads intermediate_size on CPU; the adapter keeps the original
        d["intermediate_size"] = d["original_intermediate_size"]
    return FlexiDepth.from_fields(skipper_fields(d, f"config of {config.architectures[0]}"))


class _SkipAware:
    """Mixin: keeps the skipper beside (not inside) the SGLang model until the hook transforms it,
    and routes the skipper's checkpoint tensors to it."""

    def _init_skipper(self, config) -> None:
        object.__setattr__(self, "_vskipper_pending", _skipper_for(config))

    def load_weights(self, weights):
        skipper_tensors = {}

        def base_weights():
            for name, tensor in weights:
                if any(p in name for p in SKIPPER_KEY_PARTS):
                    skipper_tensors[name] = tensor
                else:
                    yield name, tensor

        out = super().load_weights(base_weights())
        self._vskipper_pending.load_flexidepth_state_dict(
            skipper_tensors, source=f"{type(self).__name__} checkpoint")
        return out


class _SkipGPTAware:
    """Mixin: reads a SkipGPT checkpoint's base weights through SGLang's own loader (renamed to its
    Llama names, LoRA merged: skipgpt.base_tensors) and builds the SkipGPT skipper from its routers,
    kept beside the model until the hook transforms it."""

    def load_weights(self, weights):
        from vskipper.skippers.skipgpt import base_tensors, fields, make_skipgpt

        where = f"{type(self).__name__} checkpoint"
        cfg = self.config.to_dict()
        layers, lora = fields(cfg, where)
        routers: dict = {}
        out = super().load_weights(base_tensors(weights, lora, where, routers))
        object.__setattr__(self, "_vskipper_pending", make_skipgpt(routers, layers, self.config.num_hidden_layers,
                                                                   self.config.hidden_size, where))
        return out


def model_classes():
    from sglang.srt.models.llama import LlamaForCausalLM
    from sglang.srt.models.qwen3 import Qwen3ForCausalLM

    class DDLlamaForCausalLM(_SkipAware, LlamaForCausalLM):
        def __init__(self, config, quant_config=None, prefix: str = "") -> None:
            super().__init__(config, quant_config=quant_config, prefix=prefix)
            self._init_skipper(config)

    class DDQwen3ForCausalLM(_SkipAware, Qwen3ForCausalLM):
        def __init__(self, config, quant_config=None, prefix: str = "") -> None:
            super().__init__(config, quant_config=quant_config, prefix=prefix)
            self._init_skipper(config)

    class SkipGPTLlamaForCausalLM(_SkipGPTAware, LlamaForCausalLM):
        pass

    classes = [DDLlamaForCausalLM, DDQwen3ForCausalLM, SkipGPTLlamaForCausalLM]
    for cls in classes:
        cls.__module__ = __name__
    return classes


class DDLlamaConfig(LlamaConfig):
    """config.json with model_type "ddllama" (FlexiDepth's own code uses this name with remote
    code; vskipper reads the same fields as a LlamaConfig and never runs that code)."""

    model_type = "ddllama"


class DDQwen3Config(Qwen3Config):
    model_type = "ddqwen3"


def config_classes():
    return [DDLlamaConfig, DDQwen3Config]
