"""The skipper semantics written plainly: the oracle every fast path is tested against.

Full-sequence recompute, one sequence, no cache, no padding, attention written out by hand
(no transformers attention code, no SDPA). For routed layer l (ARCHITECTURE.md):

    x   = input_layernorm(h)
    g   = router_l(x, positions, token_ids)            # [S]; non-finite -> RUN with g = 1
    run = g > threshold
    K,V = k_proj/v_proj (+RoPE) of x for ALL tokens
    RUN:     h1 = h + o_proj(attention(q_proj(x), K, V));  out = h1 + g * mlp(post_ln(h1))
    PROJECT: out = h + (1 - g) * adapter(post_ln(h))      (identity if no adapter)
    (hard gate: no scaling by g or 1 - g)
"""
from __future__ import annotations

import torch

from vskipper.skippers.base import Skipper, sanitize_gate


def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _attention(attn, x, cos, sin):
    """Causal self-attention over one sequence. x [S, H] -> [S, H]."""
    S = x.shape[0]
    d = attn.head_dim
    q = attn.q_proj(x).view(S, -1, d)  # [S, nh, d]
    k = attn.k_proj(x).view(S, -1, d)  # [S, kvh, d]
    v = attn.v_proj(x).view(S, -1, d)
    if hasattr(attn, "q_norm"):
        q, k = attn.q_norm(q), attn.k_norm(k)
    q = q * cos[:, None] + _rotate_half(q) * sin[:, None]
    k = k * cos[:, None] + _rotate_half(k) * sin[:, None]
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # [S, nh, d]
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * attn.scaling  # [nh, S, S]
    causal = torch.ones(S, S, dtype=torch.bool, device=x.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    o = torch.einsum("hqk,khd->qhd", p, v.float()).to(x.dtype).reshape(S, -1)
    return attn.o_proj(o)


def _rope_tables(model, S, device, dtype):
    rot = model.model.rotary_emb
    pos = torch.arange(S, device=device, dtype=torch.float32)
    freqs = pos[:, None] * rot.inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * rot.attention_scaling).to(dtype), (emb.sin() * rot.attention_scaling).to(dtype)


@torch.no_grad()
def reference_forward(model, skipper: Skipper, input_ids: torch.Tensor):
    """One sequence through `model` (an untransformed transformers Llama/Qwen3) under `skipper`.

    input_ids [S] -> (logits [S, V], decisions {layer: run [S] bool}, gates {layer: g [S]})."""
    ids = input_ids.reshape(-1)
    inner = model.model
    h = inner.embed_tokens(ids)  # [S, H]
    S = ids.numel()
    positions = torch.arange(S, device=ids.device)
    cos, sin = _rope_tables(model, S, ids.device, h.dtype)
    decisions, gates = {}, {}
    routed = set(skipper.layers)
    for i, layer in enumerate(inner.layers):
        x = layer.input_layernorm(h)
        h1 = h + _attention(layer.self_attn, x, cos, sin)  # K/V of every token feed every query
        run_out = layer.mlp(layer.post_attention_layernorm(h1))
        if i not in routed:
            h = h1 + run_out
            continue
        g, run, _ = sanitize_gate(skipper.router(i)(x, positions, ids), skipper.threshold)
        decisions[i], gates[i] = run, g
        gm = g[:, None].to(h.dtype)
        adapter = skipper.adapter(i)
        if skipper.gate == "soft":
            run_out = h1 + gm * run_out
            proj_out = h if adapter is None else h + (1 - gm) * adapter(layer.post_attention_layernorm(h))
        else:
            run_out = h1 + run_out
            proj_out = h if adapter is None else h + adapter(layer.post_attention_layernorm(h))
        h = torch.where(run[:, None], run_out, proj_out)
    logits = model.lm_head(inner.norm(h))
    return logits, decisions, gates


@torch.no_grad()
def reference_generate(model, skipper: Skipper, input_ids: torch.Tensor, max_new_tokens: int):
    """Greedy decoding by full recompute. Returns (tokens [S + n], decisions over the S + n - 1
    tokens that were fed to the model)."""
    ids = input_ids.reshape(-1)
    for _ in range(max_new_tokens):
        logits, _, _ = reference_forward(model, skipper, ids)
        ids = torch.cat([ids, logits[-1].argmax().reshape(1)])
    _, decisions, _ = reference_forward(model, skipper, ids[:-1])
    return ids, decisions
