"""SGLang (0.5.23) attention and MLP parts (the contract: vskipper/engines/parts.py).

The attention part writes K/V of every row into SGLang's paged pool and attends, over that pool,
for the RUN rows only, at decode and in extend (prefill) batches: plain and mixed extend batches,
chunked prefill and radix-cache hits (a RUN row attends its request's cached prefix and the
chunk's earlier tokens). Under tensor parallelism SGLang's layers built for layer boundaries leave
the row-parallel o_proj and down_proj sums to the boundary; the parts complete them (`_rank_sum`),
once per body and per set of rows computed. Shapes: T = tokens of all requests flattened,
H = hidden, n = rows attended."""
from __future__ import annotations

import torch
from torch import nn

from vskipper import ops
from vskipper.engines.parts import AttentionPart, MLPPart


def _tp_size() -> int:
    from sglang.srt.runtime_context import get_parallel

    return get_parallel().tp_size


def _rank_sum(t: torch.Tensor) -> torch.Tensor:
    """Complete a row-parallel linear's sum over the tensor-parallel ranks. SGLang's layers built for
    layer boundaries leave that all-reduce to the boundary; a routed layer completes its own sums,
    once per body and per set of rows computed (the same rows on every rank: route decisions read the
    complete, replicated hidden state, and the skipper is replicated)."""
    from sglang.srt.distributed.communication_op import tensor_model_parallel_all_reduce

    return tensor_model_parallel_all_reduce(t)


def _needs_rank_sum(linear) -> bool:
    return _tp_size() > 1 and not getattr(linear, "reduce_results", True)


class SGLangMLP(MLPPart):
    """An SGLang MLP seen by a routed layer: its output complete on every rank. Under tensor
    parallelism, where SGLang's layer boundary would complete down_proj's sum, `partial_sums` is set
    and the part completes it itself (the fixed-shape body, after its grouped GEMM over this rank's
    shards)."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__(mlp)
        self.partial_sums = _needs_rank_sum(mlp.down_proj)

    def forward(self, y):
        out = self.mlp(y)
        return self.rank_sum(out) if self.partial_sums else out

    def rank_sum(self, t):
        return _rank_sum(t) if self.partial_sums else t

    def swiglu_weights(self):
        """(w_gate [I, H], w_up [I, H], w_down [H, I]): the merged gate_up_proj split (under tensor
        parallelism this rank's shards: I = intermediate / tp)."""
        w = self.mlp.gate_up_proj.weight
        i = w.shape[0] // 2
        return w[:i], w[i:], self.mlp.down_proj.weight


class SGLangAttention(AttentionPart):
    """An SGLang attention module seen by a routed layer: K/V written for all rows, attention and
    o_proj for RUN rows only, at decode and in extend (prefill) batches: plain and mixed extend
    batches, chunked prefill and radix-cache hits (a RUN row attends its request's cached prefix
    and the chunk's earlier tokens). Other batches (speculative verify, split prefill) and sliding
    windows attend for all rows through SGLang's backend."""

    masks_rows = True

    def __init__(self, self_attn: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.reduce = _needs_rank_sum(self_attn.o_proj)
        # _prepare_rows restates forward_prepare_native for the two families registered here
        # (SGLang 0.5.23: qkv_proj, split, Qwen3's apply_qk_norm, rotary_emb); any other attention
        # projects every row's query through its own forward_prepare_native.
        from sglang.srt.models.llama import LlamaAttention
        from sglang.srt.models.qwen3 import Qwen3Attention

        self.qk_norm = type(self_attn) is Qwen3Attention
        self.splits_qkv = type(self_attn) in (LlamaAttention, Qwen3Attention)

    def _o_proj(self, o):
        out, _ = self.self_attn.o_proj(o)
        return _rank_sum(out) if self.reduce else out

    def attend_all(self, x, ctx):
        out = self.self_attn(ctx["positions"], x, ctx["forward_batch"])
        return _rank_sum(out) if self.reduce else out

    def is_decode(self, x, ctx) -> bool:
        return ctx["forward_batch"].forward_mode.is_decode()

    def resident_tokens(self, x, ctx) -> int:
        """The batch's sequence lengths summed, as SGLang keeps them on the host (`seq_lens_sum`)."""
        return int(ctx["forward_batch"].seq_lens_sum)

    def _prepare_rows(self, positions, x, rows):
        """forward_prepare_native's (q, k, v) with the query projected for `rows` only (zeros
        elsewhere, which no attention reads): K and V of every row, as SGLang computes them. The
        fused qkv_proj is split by its output rows (q, then k and v: this rank's shards under tensor
        parallelism), so a PROJECT token skips its share of the q projection; Qwen3's q/k norms and
        the rotary embedding are SGLang's own calls, on tensors of the usual shapes."""
        sa = self.self_attn
        w, b = sa.qkv_proj.weight, sa.qkv_proj.bias
        n = sa.q_size
        k, v = torch.nn.functional.linear(x, w[n:], None if b is None else b[n:]).split([sa.kv_size, sa.kv_size], -1)
        q_run = torch.nn.functional.linear(x.index_select(0, rows), w[:n], None if b is None else b[:n])
        q = x.new_zeros(x.shape[0], n).index_copy_(0, rows, q_run)
        if self.qk_norm:
            from sglang.srt.models.utils import apply_qk_norm

            q, k = apply_qk_norm(q=q, k=k, q_norm=sa.q_norm, k_norm=sa.k_norm, head_dim=sa.head_dim)
        return (*sa.rotary_emb(positions, q, k), v)

    def _qkv_and_write(self, x, ctx, rows=None):
        """q [T, heads, d], the pool, the attention layer and the batch; K/V of every row written.
        rows: the rows whose queries are needed (None: all), in extend batches."""
        from sglang.srt.model_executor.forward_context import get_token_to_kv_pool

        sa, fb = self.self_attn, ctx["forward_batch"]
        if rows is not None and self.splits_qkv and rows.numel() < x.shape[0]:
            q, k, v = self._prepare_rows(ctx["positions"], x, rows)
        else:
            q, k, v = sa.forward_prepare_native(ctx["positions"], x)
        layer = sa.attn
        pool = get_token_to_kv_pool()
        pool.set_kv_buffer(layer, fb.out_cache_loc, k.view(-1, layer.tp_k_head_num, layer.qk_head_dim),
                           v.view(-1, layer.tp_v_head_num, layer.v_head_dim))
        return q.view(-1, layer.tp_q_head_num, layer.qk_head_dim), pool, layer, fb

    def _routes_extend(self, fb) -> bool:
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        window = getattr(self.self_attn.attn, "sliding_window_size", None)
        return (fb.forward_mode in (ForwardMode.EXTEND, ForwardMode.MIXED) and getattr(fb, "encoder_lens", None) is None
                and (window is None or window < 0))

    def _extend_rows(self, x, run, rows, ctx, impl, tuned=True):
        """Attention [T, nh * d] of an extend batch, zeros off `run` [T] (`rows`: its indices); K/V of
        every row written, queries projected for `rows` only."""
        from sglang.srt.model_executor.forward_context import get_req_to_token_pool

        q, pool, layer, fb = self._qkv_and_write(x, ctx, rows)
        o = ops.routed_prefill_attention(q, pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id),
                                         get_req_to_token_pool().req_to_token, fb.req_pool_indices,
                                         fb.extend_prefix_lens, fb.extend_seq_lens, run, layer.scaling, impl=impl,
                                         tuned=tuned)
        return o.reshape(q.shape[0], -1)

    def attend_rows(self, x, rows, ctx, impl="torch"):
        """Attention output [n, H] for rows `rows` of [T]; K/V of every row written. In extend batches
        through ops.routed_prefill_attention in `impl`."""
        fb = ctx["forward_batch"]
        if not fb.forward_mode.is_decode():
            if not self._routes_extend(fb):
                return self.attend_all(x, ctx)[rows]
            run = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device).index_fill_(0, rows, True)
            o = self._extend_rows(x, run, rows, ctx, impl)  # [T, nh * d]
            return self._o_proj(o[rows]) if rows.numel() else x.new_zeros(0, x.shape[-1])
        from sglang.srt.model_executor.forward_context import get_req_to_token_pool

        q, pool, layer, fb = self._qkv_and_write(x, ctx)
        n = rows.numel()
        if n == 0:
            return x.new_zeros(0, x.shape[-1])
        run = torch.zeros(q.shape[0], dtype=torch.bool, device=q.device).index_fill_(0, rows, True)
        o = ops.masked_decode_attention_dynamic(q, pool.get_key_buffer(layer.layer_id),
                                                pool.get_value_buffer(layer.layer_id),
                                                get_req_to_token_pool().req_to_token, fb.req_pool_indices,
                                                fb.seq_lens, run, layer.scaling)  # [T, nh, d], zeros off `rows`
        return self._o_proj(o[rows].reshape(n, -1))

    def attend_masked(self, x, run, ctx, impl, tuned=True):
        """Attention output [T, H], meaningful for rows with `run` set; fixed shapes, no host sync
        (decode; extend batches are never captured, and the torch form reads their lengths)."""
        fb = ctx["forward_batch"]
        if not fb.forward_mode.is_decode():
            if not self._routes_extend(fb):
                return self.attend_all(x, ctx)
            rows = run.nonzero().squeeze(1)  # a host read: extend batches are never captured
            return self._o_proj(self._extend_rows(x, run, rows, ctx, impl, tuned))
        from sglang.srt.model_executor.forward_context import get_req_to_token_pool

        q, pool, layer, fb = self._qkv_and_write(x, ctx)
        o = ops.masked_decode_attention(q, pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id),
                                        get_req_to_token_pool().req_to_token, fb.req_pool_indices, fb.seq_lens,
                                        run, layer.scaling, impl=impl, tuned=tuned)
        return self._o_proj(o.reshape(q.shape[0], -1))
