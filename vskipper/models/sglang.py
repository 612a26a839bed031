"""SGLang (0.5.23) LlamaForCausalLM and Qwen3ForCausalLM, inside SGLang.

SGLang's decoder layers keep their residual in a "layer boundary" framework that is fragile to
subclass or interleave with other code. vskipper therefore composes every layer from
its parts: h1 = h + self_attn(norm(h)); out = h1 + mlp(post_norm(h1)), the same function
without the fused add+norm. Tensor parallelism and pipeline parallelism are not supported
(transform raises). Shapes: T = tokens of all requests flattened, H = hidden."""
from __future__ import annotations

import torch
from torch import nn

from vskipper.models import register_families


class SGLangLayer(nn.Module):
    """A decoder layer composed from its parts (an fx leaf of the stack)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = layer.input_layernorm
        self.self_attn = layer.self_attn
        self.post_attention_layernorm = layer.post_attention_layernorm
        self.mlp = layer.mlp

    def forward(self, h, positions, forward_batch):
        h = h + self.self_attn(positions, self.input_layernorm(h), forward_batch)
        return h + self.mlp(self.post_attention_layernorm(h), forward_batch)


class SGLangAttention(nn.Module):
    """An SGLang attention module seen by a routed layer: K/V written for all rows, attention for
    RUN rows only at decode (prefill attends for all rows through SGLang's backend)."""

    def __init__(self, self_attn: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn

    def all_rows(self, x, ctx):
        return self.self_attn(ctx["positions"], x, ctx["forward_batch"])

    @staticmethod
    def is_decode(x, ctx) -> bool:
        return ctx["forward_batch"].forward_mode.is_decode()

    def _qkv_and_write(self, x, ctx):
        from sglang.srt.model_executor.forward_context import get_token_to_kv_pool

        sa, fb = self.self_attn, ctx["forward_batch"]
        q, k, v = sa.forward_prepare_native(ctx["positions"], x)
        layer = sa.attn
        pool = get_token_to_kv_pool()
        pool.set_kv_buffer(layer, fb.out_cache_loc, k.view(-1, layer.tp_k_head_num, layer.qk_head_dim),
                           v.view(-1, layer.tp_v_head_num, layer.v_head_dim))
        return q.view(-1, layer.tp_q_head_num, layer.qk_head_dim), pool, layer, fb

    def some_rows(self, x, rows, ctx):
        """Attention output [n, H] for rows `rows` of [T]; K/V of every row written."""
        if not ctx["forward_batch"].forward_mode.is_decode():
            return self.all_rows(x, ctx)[rows]
        from sglang.srt.model_executor.forward_context import get_req_to_token_pool

        from vskipper import ops

        q, pool, layer, fb = self._qkv_and_write(x, ctx)
        n = rows.numel()
        if n == 0:
            return x.new_zeros(0, x.shape[-1])
        run = torch.zeros(q.shape[0], dtype=torch.bool, device=q.device).index_fill_(0, rows, True)
        o = ops.masked_decode_attention_dynamic(q, pool.get_key_buffer(layer.layer_id),
                                                pool.get_value_buffer(layer.layer_id),
                                                get_req_to_token_pool().req_to_token, fb.req_pool_indices,
                                                fb.seq_lens, run, layer.scaling)  # [T, nh, d], zeros off `rows`
        out, _ = self.self_attn.o_proj(o[rows].reshape(n, -1))
        return out

    def masked_rows(self, x, run, ctx, impl):
        """Attention output [T, H], meaningful for rows with `run` set; fixed shapes, no host sync."""
        if not ctx["forward_batch"].forward_mode.is_decode():
            return self.all_rows(x, ctx)
        from sglang.srt.model_executor.forward_context import get_req_to_token_pool

        from vskipper import ops

        q, pool, layer, fb = self._qkv_and_write(x, ctx)
        o = ops.masked_decode_attention(q, pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id),
                                        get_req_to_token_pool().req_to_token, fb.req_pool_indices, fb.seq_lens,
                                        run, layer.scaling, impl=impl)
        out, _ = self.self_attn.o_proj(o.reshape(q.shape[0], -1))
        return out


class SGLangDecoderStack(nn.Module):
    def __init__(self, layers: nn.ModuleList) -> None:
        super().__init__()
        self.layers = layers

    def forward(self, hidden_states, token_ids, positions, valid, forward_batch):
        for layer in self.layers:
            hidden_states = layer(hidden_states, positions=positions, forward_batch=forward_batch)
        return hidden_states


def _check_parallel(model) -> None:
    from sglang.srt.runtime_context import get_parallel

    p = get_parallel()
    if p.tp_size != 1 or p.pp_group.world_size != 1:
        raise NotImplementedError(
            f"vskipper supports SGLang with tp_size=1 and pp_size=1 (got tp={p.tp_size}, "
            f"pp={p.pp_group.world_size})"
        )


def make_stack(model) -> SGLangDecoderStack:
    _check_parallel(model)
    inner = model.model
    return SGLangDecoderStack(nn.ModuleList([SGLangLayer(l) for l in inner.layers]))


def _skip_aware_forward(self, input_ids, positions, forward_batch, input_embeds=None, pp_proxy_tensors=None):
    """The SGLang inner model's forward after `vskipper.transform`."""
    h = self.embed_tokens(input_ids) if input_embeds is None else input_embeds  # [T, H]
    valid = torch.ones(h.shape[0], dtype=torch.bool, device=h.device)
    h = self._vskipper_stack(h, input_ids, positions, valid, forward_batch)
    return self.norm(h)


def mlp_weights(mlp):
    """(w_gate [I, H], w_up [I, H], w_down [H, I]) of an SGLang MLP (merged gate_up_proj)."""
    w = mlp.gate_up_proj.weight
    i = w.shape[0] // 2
    return w[:i], w[i:], mlp.down_proj.weight


register_families("sglang", {"LlamaForCausalLM": "sglang.srt.models.llama", "Qwen3ForCausalLM": "sglang.srt.models.qwen3"},
                  make_stack=make_stack, make_attention=lambda layer: SGLangAttention(layer.self_attn),
                  forward=_skip_aware_forward, mlp_weights=mlp_weights)
