"""Build a transformers base model from a skip-aware checkpoint's tensors, and write such a
checkpoint (config.json + model.safetensors in the FlexiDepth key layout)."""
from __future__ import annotations

import json
from importlib import import_module
from pathlib import Path

import torch
from torch import nn

from vskipper.models.checkpoint import DD_ARCHITECTURES, CheckpointError, save_tensors

# family -> (transformers module, config class, causal LM class, rotary class)
HF_CLASSES = {
    "llama": ("transformers.models.llama.modeling_llama", "LlamaConfig", "LlamaForCausalLM", "LlamaRotaryEmbedding"),
    "qwen3": ("transformers.models.qwen3.modeling_qwen3", "Qwen3Config", "Qwen3ForCausalLM", "Qwen3RotaryEmbedding"),
}
SKIPPER_CONFIG_KEYS = ("routing_layers", "gate_mode", "router_reduction_factor", "proj_reduction_factor",
                       "expected_run_fraction")
DROP_CONFIG_KEYS = SKIPPER_CONFIG_KEYS + ("architectures", "auto_map", "model_type", "transformers_version",
                                          "torch_dtype", "dtype", "quantization_config")


def hf_config(cfg: dict, family: str):
    mod, cfg_cls, _, _ = HF_CLASSES[family]
    kwargs = {k: v for k, v in cfg.items() if k not in DROP_CONFIG_KEYS}
    try:
        return getattr(import_module(mod), cfg_cls)(**kwargs)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"config.json does not describe a valid {cfg_cls}: {e}") from None


def build_base_model(cfg: dict, family: str, tensors: dict[str, torch.Tensor], path, dtype: torch.dtype) -> nn.Module:
    """The base (untransformed) transformers model with the checkpoint's base weights."""
    mod, _, lm_cls, rope_cls = HF_CLASSES[family]
    config = hf_config(cfg, family)
    config.architectures = [lm_cls]
    with torch.device("meta"):
        model = getattr(import_module(mod), lm_cls)(config)
    expected = model.state_dict()
    tied = bool(getattr(config, "tie_word_embeddings", False))
    state = {}
    for key, ref in expected.items():
        if key == "lm_head.weight" and tied:
            continue
        if key not in tensors:
            raise CheckpointError(f"{path}: missing base tensor {key!r} (expected shape {list(ref.shape)})")
        t = tensors[key]
        if tuple(t.shape) != tuple(ref.shape):
            raise CheckpointError(f"{path}: tensor {key!r} has shape {list(t.shape)}, expected {list(ref.shape)}")
        if not t.is_floating_point():
            raise CheckpointError(f"{path}: tensor {key!r} has dtype {t.dtype}, expected a floating-point dtype")
        state[key] = t.to(dtype)
    model.load_state_dict(state, strict=False, assign=True)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb = getattr(import_module(mod), rope_cls)(config=config)  # non-persistent buffers
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise CheckpointError(f"{path}: no weights for {left[:5]}")
    return model.eval()


def save_checkpoint(path, model: nn.Module, skipper, **extra_config) -> Path:
    """Write `model` (an untransformed transformers Llama/Qwen3) plus a FlexiDepth `skipper` as a
    skip-aware checkpoint directory loadable by `vskipper.from_pretrained` and the SGLang plugin."""
    family = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}.get(type(model).__name__)
    if family is None:
        raise TypeError(f"save_checkpoint: unsupported model class {type(model).__name__}")
    arch = next(a for a, (fam, _) in DD_ARCHITECTURES.items() if fam == family)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg.update(architectures=[arch], routing_layers=list(skipper.layers), gate_mode=skipper.gate,
               router_reduction_factor=skipper.hidden_size // skipper.router_dim,
               proj_reduction_factor=skipper.intermediate_size // skipper.proj_dim, **extra_config)
    if skipper.expected_run_fraction is not None:
        cfg.setdefault("expected_run_fraction", skipper.expected_run_fraction)
    (path / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
    state = {k: v for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    state.update(skipper.flexidepth_state_dict())
    save_tensors(state, path / "model.safetensors")
    return path
