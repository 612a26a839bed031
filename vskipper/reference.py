"""The skipper semantics written plainly: the oracle every fast path is tested against.

Full-sequence recompute, one sequence, no cache, no padding, attention written out by hand
(no transformers attention code, no SDPA). For routed layer l (docs/architecture.md):

    x   = input_layernorm(h)
    g   = router_l(x, positions, token_ids)            # [S]; non-finite -> RUN with g = 1
    run = g > threshold
    K,V = k_proj/v_proj (+RoPE) of x for ALL tokens
    RUN:     h1 = h + o_proj(attention(q_proj(x), K, V));  out = h1 + g * mlp(post_ln(h1))
    PROJECT: out = h + (1 - g) * adapter(post_ln(h))      (identity if no adapter)
    (hard gate: no scaling by g or 1 - g)
    a request's budget k (vskipper/control.py): at the skipper's routed layers of rank >= k (0 = the
    shallowest), RUN with g = 1 whatever the router says

A sublayer skipper (skipper.sublayers == ("attention", "mlp"), hard gate, no adapter) instead:

    r   = x, or h itself for router_input "residual"
    g   = router_l(r, positions, token_ids)            # [S, 2]; column 0 attention, column 1 MLP
    run = g > threshold                                # per column; non-finite -> that sublayer RUNs
    K,V = k_proj/v_proj (+RoPE) of x for ALL tokens, attention-skipping ones too
    h1  = h + o_proj(attention(q_proj(x), K, V))   where run[:, 0], else h
    out = h1 + mlp(post_ln(h1))                     where run[:, 1], else h1
    a budget forces both sublayers to RUN
"""
from __future__ import annotations

import torch

from vskipper.models.rotary import apply_rope, rope_tables
from vskipper.skippers.base import Skipper, gate_combine, sanitize_gate, sublayer_value


def attention(attn, x, cos, sin):
    """Causal self-attention of a transformers Llama/Qwen3 attention module, written out by hand.
    x [B, S, H] (or [S, H]) -> the same shape; cos/sin [S, d]. Differentiable (the training forward
    uses it too)."""
    if x.dim() == 2:
        return attention(attn, x[None], cos, sin)[0]
    B, S, _ = x.shape
    d = attn.head_dim
    q = attn.q_proj(x).view(B, S, -1, d)  # [B, S, nh, d]
    k = attn.k_proj(x).view(B, S, -1, d)  # [B, S, kvh, d]
    v = attn.v_proj(x).view(B, S, -1, d)
    if hasattr(attn, "q_norm"):
        q, k = attn.q_norm(q), attn.k_norm(k)
    c, s = cos[:, None], sin[:, None]  # [S, 1, d]
    q, k = apply_rope(q, c, s), apply_rope(k, c, s)
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)  # [B, S, nh, d]
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * attn.scaling  # [B, nh, S, S]
    causal = torch.ones(S, S, dtype=torch.bool, device=x.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    o = torch.einsum("bhqk,bkhd->bqhd", p, v.float()).to(x.dtype).reshape(B, S, -1)
    return attn.o_proj(o)


@torch.no_grad()
def reference_forward(model, skipper: Skipper, input_ids: torch.Tensor, budget: int | None = None):
    """One sequence through `model` (an untransformed transformers Llama/Qwen3) under `skipper`, for a
    request that may skip at most `budget` routed layers (None: no cap).

    input_ids [S] -> (logits [S, V], decisions {layer: run [S] bool}, gates {layer: g [S]}); for a
    sublayer skipper run and g are [S, 2] (attention, MLP)."""
    ids = input_ids.reshape(-1)
    inner = model.model
    h = inner.embed_tokens(ids)  # [S, H]
    S = ids.numel()
    positions = torch.arange(S, device=ids.device)
    cos, sin = rope_tables(inner.rotary_emb, S, ids.device, h.dtype)
    decisions, gates = {}, {}
    routed = set(skipper.layers)
    for i, layer in enumerate(inner.layers):
        x = layer.input_layernorm(h)
        a = attention(layer.self_attn, x, cos, sin)  # K/V of every token feed every query
        if i not in routed:
            h1 = h + a
            h = h1 + layer.mlp(layer.post_attention_layernorm(h1))
            continue
        r = h if skipper.router_input == "residual" else x
        g, run, _ = sanitize_gate(skipper.router(i)(r, positions, ids), skipper.threshold)
        if budget is not None and skipper.layers.index(i) >= budget:
            g, run = torch.ones_like(g), torch.ones_like(run)
        decisions[i], gates[i] = run, g
        if skipper.sublayers:  # attention-skipping tokens were attended to above all the same
            h1 = sublayer_value(h, a, run[:, 0])
            h = sublayer_value(h1, layer.mlp(layer.post_attention_layernorm(h1)), run[:, 1])
            continue
        h1 = h + a
        m = layer.mlp(layer.post_attention_layernorm(h1))
        adapter = skipper.adapter(i)
        p = None if adapter is None else adapter(layer.post_attention_layernorm(h))
        h = gate_combine(h, h1, m, p, g, run, soft=skipper.gate == "soft")
    logits = model.lm_head(inner.norm(h))
    return logits, decisions, gates


@torch.no_grad()
def reference_generate(model, skipper: Skipper, input_ids: torch.Tensor, max_new_tokens: int,
                       budget: int | None = None):
    """Greedy decoding by full recompute. Returns (tokens [S + n], decisions over the S + n - 1
    tokens that were fed to the model)."""
    ids = input_ids.reshape(-1)
    for _ in range(max_new_tokens):
        logits, _, _ = reference_forward(model, skipper, ids, budget)
        ids = torch.cat([ids, logits[-1].argmax().reshape(1)])
    _, decisions, _ = reference_forward(model, skipper, ids[:-1], budget)
    return ids, decisions
