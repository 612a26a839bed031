"""A differentiable, batched forward of a skip-aware model: the training twin of vskipper/reference.py.

Full sequence, no cache, right padding (sequence b holds its tokens at positions 0..len_b-1, so
plain causal attention never lets a real token see a padding row). Legend: B = sequences,
S = positions, H = hidden, L = routed layers, V = vocabulary.

Routed layer l, x = input_layernorm(h) (the reference semantics, docs/architecture.md):
    g   = router_l(x)                                  # [B, S]; non-finite -> RUN with g = 1
    run = g > threshold
    R   = h1 + g * mlp(post_ln(h1)),  h1 = h + attn(x) # soft gate (hard: no g)
    P   = h + (1 - g) * adapter(post_ln(h))            # soft gate (hard: no 1 - g)
    out = where(run, R, P)
With gradients on, a straight-through term is added:
    out = where(run, R, P) + (g - sg(g)) * (R - P)     # sg = stop-gradient
Its value is exactly zero (g - g == 0 in IEEE arithmetic), so the forward is the inference
forward bit for bit and sees the same RUN/PROJECT decisions; its gradient d out / d g = R - P
tells the router what switching the token's route would change. On top of it the soft gate
keeps its own gradient through the g / (1 - g) scaling.

A sublayer skipper (SkipGPT, vskipper/skippers/skipgpt.py) has two routers per routed layer, both on
the layer's input h; each gives logits [execute, skip] and the inference decision
run = not(logit_skip > logit_execute). Training adds a differentiable run probability per sublayer,
p = sigmoid(logit_execute - logit_skip), through the same straight-through term:
    h1  = where(run_a, h + a, h) + (p_a - sg(p_a)) * a        a = attn(x), every token's K/V written
    out = where(run_m, h1 + m, h1) + (p_m - sg(p_m)) * m      m = mlp(post_ln(h1))
again exactly the inference forward in value.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vskipper.models.rotary import rope_tables
from vskipper.reference import attention
from vskipper.skippers.base import Skipper, gate_combine, project_value, run_value, sanitize_gate, sublayer_value
from vskipper.skippers.skipgpt import SkipGPT


@dataclass
class SkipOutput:
    hidden: torch.Tensor  # [B, S, H] after the last decoder layer, before the final norm
    gates: dict  # {layer: g [B, S]} (sanitized: non-finite -> 1), differentiable; sublayers: p_run [B, S, 2]
    run: dict  # {layer: run [B, S] bool}; sublayers: [B, S, 2] (attention, MLP)


def sublayer_work(config) -> tuple[float, float]:
    """The shares of a decoder layer's work that its attention and its MLP are, (attention, mlp), summing
    to 1: each sublayer's linear-layer FLOPs per token (q, k, v, o: H * (2 nh + 2 kvh) * d; a SwiGLU MLP:
    3 H I), i.e. at short context, where the attention's score arithmetic (growing with the context) is
    small. SmolLM2-135M: 884,736 and 2,654,208 weights, 0.25 and 0.75. `config`: a transformers config."""
    H, I = config.hidden_size, config.intermediate_size
    nh, kvh = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    d = getattr(config, "head_dim", None) or H // nh
    attn, mlp = H * (2 * nh + 2 * kvh) * d, 3 * H * I
    return attn / (attn + mlp), mlp / (attn + mlp)


def sublayer_routed_layer(layer: nn.Module, skipper: Skipper, index: int, h: torch.Tensor, cos, sin,
                          straight_through: bool):
    """One routed layer of a SkipGPT skipper. h [B, S, H] -> (out [B, S, H], p_run [B, S, 2], run [B, S, 2])."""
    router = skipper.router(index)
    logits = torch.stack([router.router_attention.logits(h), router.router_mlp.logits(h)], -2)  # [B, S, 2, 2]
    run = ~(logits[..., 1] > logits[..., 0])  # [B, S, 2]: SkipGPT's argmax (a tie, a NaN: RUN)
    p = torch.nan_to_num(torch.sigmoid(logits[..., 0] - logits[..., 1]), nan=1.0)  # [B, S, 2]
    st = straight_through and torch.is_grad_enabled() and p.requires_grad
    a = attention(layer.self_attn, layer.input_layernorm(h), cos, sin)  # K/V of every token feed every query
    h1 = sublayer_value(h, a, run[..., 0])
    if st:
        pa = p[..., :1].to(h.dtype)
        h1 = h1 + (pa - pa.detach()) * a  # == 0 in value
    m = layer.mlp(layer.post_attention_layernorm(h1))
    out = sublayer_value(h1, m, run[..., 1])
    if st:
        pm = p[..., 1:].to(h.dtype)
        out = out + (pm - pm.detach()) * m  # == 0 in value
    return out, p, run


def routed_layer(layer: nn.Module, skipper: Skipper, index: int, h: torch.Tensor, cos, sin,
                 positions: torch.Tensor, ids: torch.Tensor | None, straight_through: bool):
    """One routed decoder layer. h [B, S, H] -> (out [B, S, H], g [B, S], run [B, S])."""
    x = layer.input_layernorm(h)
    g, run, _ = sanitize_gate(skipper.router(index)(x, positions, ids), skipper.threshold)  # [B, S]
    h1 = h + attention(layer.self_attn, x, cos, sin)  # K/V of every token feed every query
    m = layer.mlp(layer.post_attention_layernorm(h1))
    adapter = skipper.adapter(index)
    p = None if adapter is None else adapter(layer.post_attention_layernorm(h))
    soft = skipper.gate == "soft"
    out = gate_combine(h, h1, m, p, g, run, soft=soft)
    if straight_through and torch.is_grad_enabled() and g.requires_grad:
        gm = g[..., None].to(h.dtype)
        out = out + (gm - gm.detach()) * (run_value(h1, m, g, soft) - project_value(h, p, g, soft))  # == 0 in value
    return out, g, run


def skip_forward(model: nn.Module, skipper: Skipper, input_ids: torch.Tensor, *, start_hidden=None,
                 start_layer: int = 0, straight_through: bool = True) -> SkipOutput:
    """The skip-aware decoder stack of `model` (an untransformed transformers Llama/Qwen3).

    input_ids [B, S] (right padded); start_hidden [B, S, H]: the input of layer `start_layer`
    (e.g. cached, when the layers before it are frozen and unrouted); otherwise the embeddings.
    Returns the last hidden state and, per routed layer, gates and decisions."""
    inner = model.model
    B, S = input_ids.shape
    if start_hidden is None:
        h, start_layer = inner.embed_tokens(input_ids), 0
    else:
        h = start_hidden
    if skipper.sublayers and not isinstance(skipper, SkipGPT):
        raise TypeError(f"skip_forward: a sublayer skipper trains as SkipGPT's routers (logits [execute, skip]); "
                        f"got {type(skipper).__name__}")
    if any(l < start_layer for l in skipper.layers):
        raise ValueError(f"skip_forward: start_layer={start_layer} is past routed layer {min(skipper.layers)}")
    cos, sin = rope_tables(inner.rotary_emb, S, h.device, h.dtype)
    positions = torch.arange(S, device=h.device).expand(B, S)
    routed = set(skipper.layers)
    gates, runs = {}, {}
    for i in range(start_layer, len(inner.layers)):
        layer = inner.layers[i]
        if i in routed and skipper.sublayers:
            h, gates[i], runs[i] = sublayer_routed_layer(layer, skipper, i, h, cos, sin, straight_through)
        elif i in routed:
            h, gates[i], runs[i] = routed_layer(layer, skipper, i, h, cos, sin, positions, input_ids,
                                                straight_through)
        else:
            x = layer.input_layernorm(h)
            h = h + attention(layer.self_attn, x, cos, sin)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
    return SkipOutput(h, gates, runs)


def logits_of(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Final norm and LM head. hidden [..., H] -> logits [..., V]."""
    return model.lm_head(model.model.norm(hidden))


@torch.no_grad()
def greedy(model: nn.Module, skipper: Skipper, input_ids: torch.Tensor, max_new_tokens: int):
    """Greedy decoding by full recompute with the training forward (eval semantics), one sequence.
    input_ids [S] -> (tokens [S + n], decisions {layer: run [S + n - 1] (sublayers: [S + n - 1, 2])} of the
    last forward)."""
    ids = input_ids.reshape(1, -1)
    out = None
    for _ in range(max_new_tokens):
        out = skip_forward(model, skipper, ids, straight_through=False)
        nxt = logits_of(model, out.hidden[:, -1]).argmax(-1)
        ids = torch.cat([ids, nxt[:, None]], dim=1)
    out = skip_forward(model, skipper, ids[:, :-1], straight_through=False)
    return ids[0], {l: r[0] for l, r in out.run.items()}
