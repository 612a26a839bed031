"""Skipper directories, and the trained skipper shipped in the package.

A skipper directory holds only the skipper: config.json (the base model's dimensions,
architectures ["DDLlamaForCausalLM"], routing_layers, gate_mode, reduction factors, and how it
was trained) and skipper.safetensors (FlexiDepth key layout). `FlexiDepth.from_pretrained(dir)`
and the spec `flexidepth:path=<dir>` read it as it is; `build_checkpoint` joins it with the base
model's weights into a full skip-aware checkpoint directory for `vskipper.from_pretrained` and
the SGLang plugin.

    from vskipper.training.shipped import build_checkpoint
    path = build_checkpoint()            # SmolLM2-135M-Instruct + the shipped skipper
    model = vskipper.from_pretrained(path)

`write_skipgpt_checkpoint` writes a trained SkipGPT skipper with its base model in SkipGPT's own layout
(what vskipper/skippers/skipgpt.py `load_skipgpt` reads).
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch

from vskipper.models.checkpoint import DD_ARCHITECTURES, save_tensors
from vskipper.skippers.shipped import DEFAULT, SKIPPER_FILE, shipped_dir

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "generation_config.json")
BASE_CONFIG_KEYS = ("model_type", "num_hidden_layers", "hidden_size", "intermediate_size", "rms_norm_eps",
                    "num_attention_heads", "num_key_value_heads", "vocab_size")


def write_skipper_dir(path, skipper, model_config, dtype: torch.dtype = torch.float32, threshold: float | None = None,
                      **extra) -> Path:
    """Write `skipper` (a FlexiDepth) for a model with `model_config` (a transformers config) as a
    skipper directory; `threshold`: the router threshold it loads with (config.json router_threshold;
    None: FlexiDepth's 0.5); `extra` goes into config.json (e.g. how it was trained)."""
    family = {"llama": "DDLlamaForCausalLM", "qwen3": "DDQwen3ForCausalLM"}.get(model_config.model_type)
    if family is None or family not in DD_ARCHITECTURES:
        raise TypeError(f"write_skipper_dir: unsupported model_type {model_config.model_type!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = {k: getattr(model_config, k) for k in BASE_CONFIG_KEYS if hasattr(model_config, k)}
    cfg.update(architectures=[family], routing_layers=list(skipper.layers), gate_mode=skipper.gate,
               router_reduction_factor=skipper.hidden_size // skipper.router_dim,
               proj_reduction_factor=skipper.intermediate_size // skipper.proj_dim,
               skipper_dtype=str(dtype).removeprefix("torch."), **extra)
    if threshold is not None:
        cfg["router_threshold"] = float(threshold)
    if skipper.expected_run_fraction is not None:
        cfg.setdefault("expected_run_fraction", skipper.expected_run_fraction)
    save_tensors({k: v.to(dtype) for k, v in skipper.flexidepth_state_dict().items()}, path / SKIPPER_FILE)
    (path / "config.json").write_text(json.dumps(cfg, indent=2, default=str) + "\n")
    return path


def write_skipgpt_checkpoint(path, model, skipper, **extra) -> Path:
    """Write `model` (an untransformed transformers Llama) with a SkipGPT `skipper` as a checkpoint directory in
    SkipGPT's layout: config.json (the model's, architectures ["SkipGPTLlamaForCausalLM"], "skipgpt":
    {"layers": [...]}, and `extra`) and model.safetensors (decoder layer i under model.layers.{i}.block.*, its
    routers under model.layers.{i}.router_attention.* / router_mlp.*, the rest under their own names; no
    LoRA). vskipper.from_pretrained loads it."""
    import re

    from vskipper.skippers.skipgpt import ARCHITECTURE

    if type(model).__name__ != "LlamaForCausalLM":
        raise TypeError(f"write_skipgpt_checkpoint: SkipGPT checkpoints are Llama models, got {type(model).__name__}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {re.sub(r"^model\.layers\.(\d+)\.", r"model.layers.\1.block.", k): v
             for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    state.update(skipper.skipgpt_state_dict())
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg.update(architectures=[ARCHITECTURE], skipgpt={"layers": list(skipper.layers)}, **extra)
    save_tensors(state, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(cfg, indent=2, default=str) + "\n")
    return path


def load_skipper(path_or_name=DEFAULT, dtype: torch.dtype = torch.float32):
    """A FlexiDepth skipper from a skipper directory, or from a shipped one by name."""
    from vskipper.skippers.flexidepth import FlexiDepth

    p = Path(path_or_name)
    if not p.is_dir():
        p = shipped_dir(str(path_or_name))
    return FlexiDepth.from_pretrained(p, dtype=dtype)


def _digest(*files: Path) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.read_bytes() if f.stat().st_size < 64 << 20 else str(f.stat().st_size).encode())
    return h.hexdigest()[:16]


def build_checkpoint(dest_dir=None, skipper=DEFAULT, base_dir=None) -> Path:
    """Join a base model directory (default: the bundled SmolLM2-135M-Instruct, f32 safetensors)
    with a skipper directory (default: the shipped one; a path or a shipped name) into a
    skip-aware checkpoint directory (config.json with architectures ["DDLlamaForCausalLM"],
    model.safetensors with base and FlexiDepth tensors, and the tokenizer), loadable by
    `vskipper.from_pretrained` and the SGLang plugin. Default destination:
    <vskipper cache>/<skipper name>-checkpoint. Reused when it was built from the same files."""
    from transformers import AutoModelForCausalLM

    from vskipper.cache import root as cache_root
    from vskipper.models.hf_loader import save_checkpoint
    from vskipper.models.smollm2 import smollm2_dir

    sk_dir = Path(skipper) if Path(skipper).is_dir() else shipped_dir(str(skipper))
    base = Path(base_dir) if base_dir is not None else smollm2_dir()
    dest = Path(dest_dir) if dest_dir is not None else cache_root() / f"{sk_dir.name}-checkpoint"
    stamp = _digest(sk_dir / SKIPPER_FILE, sk_dir / "config.json", base / "config.json",
                    *sorted(base.glob("*.safetensors")))
    if (dest / "model.safetensors").is_file() and (dest / ".vskipper-build").is_file() \
            and (dest / ".vskipper-build").read_text().strip() == stamp:
        return dest
    sk = load_skipper(sk_dir)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    if model.config.num_hidden_layers != json.loads((sk_dir / "config.json").read_text())["num_hidden_layers"]:
        raise ValueError(f"skipper {sk_dir} was trained for another model than {base}")
    sk.check_model(model.config.num_hidden_layers, model.config.hidden_size)
    trained = {k: v for k, v in json.loads((sk_dir / "config.json").read_text()).items()
               if k.startswith("vskipper_") or k == "router_threshold"}
    save_checkpoint(dest, model, sk, **trained)
    for name in TOKENIZER_FILES:
        if (base / name).is_file():
            shutil.copy2(base / name, dest / name)
    (dest / ".vskipper-build").write_text(stamp + "\n")
    return dest
