"""SGLang (0.5.23) LlamaForCausalLM and Qwen3ForCausalLM, inside SGLang: only routed layers change.

The inner model's forward stays SGLang's own, and so does every decoder layer the skipper does not
route. A routed layer i is replaced, in `model.model.layers[i]`, by `SGLangRoutedLayer`: it takes
and returns the hidden state in SGLang's convention at the layer boundary (SGLang's layers carry
the residual in `forward_batch.residual_stream` and fuse its add into the next RMSNorm), and
inside runs the routed layer the fx passes built from that layer's own parts (input_layernorm,
self_attn, post_attention_layernorm, mlp). At its entry `residual_batch.fold` completes the
hidden state (h = residual + the previous layer's output); at its exit `residual_batch.set_written`
hands the routed layer's output on as a complete value, which the next layer's boundary reads as
it reads an embedding. Auxiliary hidden-state capture (EAGLE3) receives the complete input, as
SGLang's boundary gives it. Under tensor parallelism the routed layer completes its own sums over
the ranks (`_rank_sum`) where SGLang's boundaries would; pipeline parallelism is refused, naming
--pp-size. Shapes: T = tokens of all requests flattened, H = hidden."""
from __future__ import annotations

import torch
from torch import nn

from vskipper.models import register_families


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


class SGLangMLP(nn.Module):
    """An SGLang MLP seen by a routed layer: its output complete on every rank. `rank_sum` is set
    under tensor parallelism (the fixed-shape body completes the sum itself after its grouped GEMM)."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.mlp = mlp
        self.rank_sum = _rank_sum if _needs_rank_sum(mlp.down_proj) else None

    def forward(self, y):
        out = self.mlp(y)
        return out if self.rank_sum is None else self.rank_sum(out)


class SGLangAttention(nn.Module):
    """An SGLang attention module seen by a routed layer: K/V written for all rows, attention and
    o_proj for RUN rows only, at decode and in extend (prefill) batches: plain and mixed extend
    batches, chunked prefill and radix-cache hits (a RUN row attends its request's cached prefix
    and the chunk's earlier tokens). Other batches (speculative verify, split prefill) and sliding
    windows attend for all rows through SGLang's backend."""

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

    def all_rows(self, x, ctx):
        out = self.self_attn(ctx["positions"], x, ctx["forward_batch"])
        return _rank_sum(out) if self.reduce else out

    @staticmethod
    def is_decode(x, ctx) -> bool:
        return ctx["forward_batch"].forward_mode.is_decode()

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

    def _extend_rows(self, x, run, rows, ctx, impl):
        """Attention [T, nh * d] of an extend batch, zeros off `run` [T] (`rows`: its indices); K/V of
        every row written, queries projected for `rows` only."""
        from sglang.srt.model_executor.forward_context import get_req_to_token_pool

        from vskipper import ops

        q, pool, layer, fb = self._qkv_and_write(x, ctx, rows)
        o = ops.routed_prefill_attention(q, pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id),
                                         get_req_to_token_pool().req_to_token, fb.req_pool_indices,
                                         fb.extend_prefix_lens, fb.extend_seq_lens, run, layer.scaling, impl=impl)
        return o.reshape(q.shape[0], -1)

    def some_rows(self, x, rows, ctx):
        """Attention output [n, H] for rows `rows` of [T]; K/V of every row written."""
        fb = ctx["forward_batch"]
        if not fb.forward_mode.is_decode():
            if not self._routes_extend(fb):
                return self.all_rows(x, ctx)[rows]
            run = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device).index_fill_(0, rows, True)
            o = self._extend_rows(x, run, rows, ctx, "torch")  # [T, nh * d]
            return self._o_proj(o[rows]) if rows.numel() else x.new_zeros(0, x.shape[-1])
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
        return self._o_proj(o[rows].reshape(n, -1))

    def masked_rows(self, x, run, ctx, impl):
        """Attention output [T, H], meaningful for rows with `run` set; fixed shapes, no host sync
        (decode; extend batches are never captured, and the torch form reads their lengths)."""
        fb = ctx["forward_batch"]
        if not fb.forward_mode.is_decode():
            if not self._routes_extend(fb):
                return self.all_rows(x, ctx)
            rows = run.nonzero().squeeze(1)  # a host read: extend batches are never captured
            return self._o_proj(self._extend_rows(x, run, rows, ctx, impl))
        from sglang.srt.model_executor.forward_context import get_req_to_token_pool

        from vskipper import ops

        q, pool, layer, fb = self._qkv_and_write(x, ctx)
        o = ops.masked_decode_attention(q, pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id),
                                        get_req_to_token_pool().req_to_token, fb.req_pool_indices, fb.seq_lens,
                                        run, layer.scaling, impl=impl)
        return self._o_proj(o.reshape(q.shape[0], -1))


class SGLangSlot(nn.Module):
    """What the fx passes trace for routed layer `index`: one call of the decoder layer (an fx
    leaf, target "layers.<index>"), which the route pass rewrites into the routed layer."""

    def __init__(self, index: int, layer: nn.Module) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(index): layer})
        self.indices = (index,)
        self.key = str(index)

    def forward(self, hidden_states, token_ids, positions, valid, budget, forward_batch):
        return self.layers[self.key](hidden_states, positions=positions, forward_batch=forward_batch)


def valid_rows(forward_batch, T: int, device) -> torch.Tensor:
    """[T] bool: the rows that are tokens, without a host sync (read at every replay of a graph).
    The CUDA-graph runner pads a batch up to a captured size; where SGLang enables it, it gives the
    real count in `num_token_non_padded`; otherwise its padding convention tells: padded rows write
    their K/V to the pool's reserved padding slot 0 (`out_cache_loc == 0`), which no token is ever
    given."""
    n = getattr(forward_batch, "num_token_non_padded", None)
    if n is not None:
        return torch.arange(T, device=device) < n
    loc = getattr(forward_batch, "out_cache_loc", None)
    if loc is not None and loc.shape[0] == T:
        return loc != 0
    return torch.ones(T, dtype=torch.bool, device=device)


def request_budgets(budgets, T: int) -> torch.Tensor | None:
    """[T] int32: per row, how many routed layers its request may skip (vskipper/control.py), or None:
    no per-request control installed, or an eager batch in which no request has a setting (the
    common case costs no cap at all). `budgets` (integrations/sglang/requests.py: BatchBudgets) holds
    one device buffer that the plugin fills for each batch before its forward: SGLang's runners hand
    the model a copy of the ForwardBatch they were given, so the budgets cannot travel on it. While
    SGLang captures a graph the cap is always in it, and the graph reads the buffer at every replay
    (rows the graph runner pads read stale entries, which matter to no one: padding is never routed
    or counted)."""
    if budgets is None:
        return None
    if not budgets.active:
        from sglang.srt.model_executor.runner_utils.capture_mode import get_is_capture_mode

        if not get_is_capture_mode():
            return None
    fixed = budgets.rows
    if T > fixed.shape[0]:
        raise RuntimeError(f"vskipper: a batch of {T} rows, more than the {fixed.shape[0]} rows of the "
                           f"per-request budget buffer")
    return fixed[:T]


class SGLangRoutedLayer(nn.Module):
    """Stands in `model.model.layers[i]` for a routed layer (see the module docstring). It holds
    the decoder layer's own children under their own names, so the model's state-dict keys are
    SGLang's; the traced routed layer is kept beside them, not as a submodule (its modules are
    these)."""

    def __init__(self, layer: nn.Module, graph) -> None:
        super().__init__()
        for name, child in layer.named_children():
            self.add_module(name, child)
        self.layer_id = getattr(layer.self_attn.attn, "layer_id", None)
        object.__setattr__(self, "_vskipper_layer", graph)
        self.budgets = None  # set by the plugin: the batches' per-row budgets (request_budgets)

    def forward(self, positions, hidden_states, forward_batch, post_residual_addition=None, capture_output=None):
        from sglang.srt.layers.layer_boundary.residual import batch as residual_batch

        if post_residual_addition is not None:
            raise NotImplementedError(f"vskipper: routed layer {self.layer_id} got post_residual_addition "
                                      "(deepstack inputs of a vision-language model): not supported")
        h = residual_batch.fold(hidden_states, forward_batch)  # the complete hidden state [T, H]
        if capture_output is not None:
            capture_output(h)
        valid = valid_rows(forward_batch, h.shape[0], h.device)
        budget = request_budgets(self.budgets, h.shape[0])
        out = self._vskipper_layer(h, forward_batch.input_ids, positions, valid, budget, forward_batch)
        return residual_batch.set_written(out, forward_batch)


def _check_parallel(model) -> None:
    from sglang.srt.runtime_context import get_parallel

    p = get_parallel()
    if p.pp_group.world_size != 1:
        raise NotImplementedError(
            f"vskipper: pipeline parallelism (--pp-size {p.pp_group.world_size}) is not supported; "
            f"tensor parallelism (--tp-size) and data parallelism (--dp-size) are"
        )


def make_stacks(model, routed) -> list[SGLangSlot]:
    _check_parallel(model)
    layers = model.model.layers
    return [SGLangSlot(i, layers[i]) for i in routed]


def install(model, stacks) -> None:
    """Each routed layer's slot in model.model.layers takes its transformed graph; nothing else changes."""
    layers = model.model.layers
    for slot, gm in stacks:
        (i,) = slot.indices
        layers[i] = SGLangRoutedLayer(layers[i], gm)


def mlp_weights(mlp):
    """(w_gate [I, H], w_up [I, H], w_down [H, I]) of an SGLang MLP (merged gate_up_proj; under tensor
    parallelism this rank's shards: I = intermediate / tp)."""
    mlp = mlp.mlp  # SGLangMLP
    w = mlp.gate_up_proj.weight
    i = w.shape[0] // 2
    return w[:i], w[i:], mlp.down_proj.weight


register_families("sglang", {"LlamaForCausalLM": "sglang.srt.models.llama", "Qwen3ForCausalLM": "sglang.srt.models.qwen3"},
                  make_stacks=make_stacks, install=install,
                  make_attention=lambda layer: SGLangAttention(layer.self_attn), mlp_weights=mlp_weights,
                  make_mlp=lambda layer: SGLangMLP(layer.mlp))
