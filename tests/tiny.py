"""Tiny random transformers models and skippers, built in the tests (odd sizes, GQA)."""
from __future__ import annotations

import copy
import json
import re

import torch

import vskipper

VOCAB = 101


def tiny_llama(seed: int = 0, layers: int = 6):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=40, intermediate_size=72, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, pad_token_id=0,
                      bos_token_id=None, eos_token_id=None)
    return _init(LlamaForCausalLM(cfg))


def tiny_qwen3(seed: int = 0, layers: int = 6, heads: int = 3, kv_heads: int = 1):
    """(heads=4, kv_heads=2 shard over two tensor-parallel ranks; the default does not.)"""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=36, intermediate_size=50, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=12, max_position_embeddings=256,
                      rms_norm_eps=1e-6, tie_word_embeddings=True, pad_token_id=0,
                      bos_token_id=None, eos_token_id=None)
    return _init(Qwen3ForCausalLM(cfg))


def _init(model):
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    # transformers' init is tiny (std 0.02): widen it so every layer changes the logits visibly
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    return model.eval()


def flexidepth_for(model, layers, gate: str, seed: int = 1, head_scale: float = 20.0, **kw):
    """A FlexiDepth skipper with random weights; head_scale spreads gates away from 0.5 so that
    route decisions are not decided by last-bit noise."""
    torch.manual_seed(seed)
    c = model.config
    sk = vskipper.FlexiDepth(layers, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                             rms_norm_eps=c.rms_norm_eps, gate=gate, router_reduction_factor=4,
                             proj_reduction_factor=4, **kw)
    with torch.no_grad():
        for name, p in sk.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
            if "router_head" in name:
                p.mul_(head_scale)
    return sk


def transformed(model, skipper, execution: str, **config):
    return vskipper.transform(copy.deepcopy(model), copy.deepcopy(skipper),
                              vskipper.Config(execution=execution, **config))


def synthetic_calibration(hidden=40, intermediate=72, device="cpu"):
    """A cost calibration for this machine where dense wins at tiny T, routed is cheaper for T >= 4
    unless nearly every row runs, and routed-mlp is cheapest at T = 4 and 8 when more than half the
    rows run: execution="auto" then uses all three bodies."""
    from vskipper import cost

    ts, fs = (1, 2, 4, 8, 16), (0.0, 0.5, 1.0)
    dense = tuple(tuple(1.0 * t for _ in fs) for t in ts)
    routed = tuple(tuple((2.0 if t < 4 else 0.3 + 0.8 * f) * t for f in fs) for t in ts)
    routed_mlp = tuple(tuple((0.5 + 0.4 * f if t in (4, 8) else 3.0) * t for f in fs) for t in ts)
    return cost.Calibration(cost.device_name(device), cost.versions(), hidden, intermediate, ts, fs, dense, routed,
                            routed_mlp=routed_mlp)


def record_routes(model):
    """Hook every router of a transformed model; returns {layer: [router output per call]}."""
    calls: dict[int, list[torch.Tensor]] = {}
    sk = model.vskipper.skipper
    for l in sk.layers:
        calls[l] = []
        sk.router(l).register_forward_hook(lambda m, a, out, l=l: calls[l].append(out.detach().clone()))
    return calls


# A SkipGPT checkpoint (vskipper/skippers/skipgpt.py), as SkipGPT's code names the tensors.
LORA_TARGETS = ("self_attn.q_proj", "self_attn.v_proj", "mlp.gate_proj")  # SkipGPT's post_training stage


def skipgpt_checkpoint(path, base, layers=None, lora=(4, 8.0), peft=True, seed=3):
    """A tiny checkpoint in SkipGPT's layout, written as its code names the tensors: the base layers under
    `.block.`, random routers, and (lora=(r, alpha)) LoRA on LORA_TARGETS in PEFT's naming. Returns (the
    base model with the LoRA merged by hand, the skipper)."""
    from vskipper.models.checkpoint import save_tensors
    from vskipper.skippers.skipgpt import SkipGPT

    torch.manual_seed(seed)
    c = base.config
    sk = SkipGPT(list(range(c.num_hidden_layers)) if layers is None else layers, c.hidden_size)
    with torch.no_grad():
        for p in sk.parameters():
            p.normal_(0, 0.5)
    merged = copy.deepcopy(base)
    tensors = {}
    for key, w in base.state_dict().items():
        m = re.match(r"model\.layers\.(\d+)\.(.+)\.weight$", key)
        if m is None:
            tensors[key] = w
            continue
        name = f"model.layers.{m.group(1)}.block.{m.group(2)}"
        if lora is None or m.group(2) not in LORA_TARGETS:
            tensors[name + ".weight"] = w
            continue
        r, alpha = lora
        a, b = torch.randn(r, w.shape[1]) * 0.3, torch.randn(w.shape[0], r) * 0.3
        tensors.update({name + ".base_layer.weight": w, name + ".lora_A.default.weight": a,
                        name + ".lora_B.default.weight": b})
        merged.get_parameter(key).data += alpha / r * b @ a
    tensors.update(sk.skipgpt_state_dict())
    if peft:
        tensors = {"base_model.model." + k: v for k, v in tensors.items()}
    path.mkdir(parents=True, exist_ok=True)
    cfg = dict(c.to_dict(), architectures=["SkipGPTLlamaForCausalLM"])
    cfg["skipgpt"] = ({} if layers is None else {"layers": layers}) | ({} if lora is None else
                                                                       {"lora": {"r": lora[0], "lora_alpha": lora[1]}})
    (path / "config.json").write_text(json.dumps(cfg, default=str))
    save_tensors(tensors, path / "model.safetensors")
    return merged, sk
