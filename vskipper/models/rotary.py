"""Rotary position embedding as transformers' Llama/Qwen3 apply it, written once (the reference,
the training forward and the transformers attention part use it). d = head dim."""
from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """t [..., d] with cos/sin already broadcastable to it (transformers' apply_rotary_pos_emb)."""
    return (t * cos) + (rotate_half(t) * sin)


def rope_tables(rotary_emb, S: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [S, d] for positions 0..S-1 from a transformers rotary embedding module, in f32 then
    cast (its own arithmetic, without its autocast and caching)."""
    pos = torch.arange(S, device=device, dtype=torch.float32)
    freqs = pos[:, None] * rotary_emb.inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * rotary_emb.attention_scaling).to(dtype), (emb.sin() * rotary_emb.attention_scaling).to(dtype)
