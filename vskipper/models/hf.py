"""transformers (5.x) LlamaForCausalLM and Qwen3ForCausalLM.

The decoder stack is replaced, for this one model instance, by an fx-traced DecoderStack; the
inner model's forward is rebound (instance attribute, no class is patched) to compute
embeddings, masks and rotary tables as transformers does, then call the stack.
"""
from __future__ import annotations

import torch
from torch import nn

from vskipper.models import register_families, replace_inner_forward
from vskipper.models.rotary import apply_rope

# Shapes: B = batch, S = new tokens per sequence, Skv = cached + new, nh/kvh = heads, d = head dim.


def _rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return apply_rope(t, cos.unsqueeze(1), sin.unsqueeze(1))  # t [B, heads, S, d]; cos/sin [B, S, d]


def _runs(rows: list[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive values in ascending `rows`, as (first, end) pairs."""
    out: list[tuple[int, int]] = []
    for r in rows:
        if out and out[-1][1] == r:
            out[-1] = (out[-1][0], r + 1)
        else:
            out.append((r, r + 1))
    return out


# Prefill attends blocks of this many RUN rows of a sequence, each over the keys up to its last
# position: a mask alone does not skip the masked half, as causal attention does (the same measurement
# as vskipper/triton_kernels/routed_prefill_attention.py's BLOCK_ROWS).
PREFILL_BLOCK_ROWS = 128


def _query_rows(mask, B: int, S: int, Skv: int) -> int:
    """How many of the B*S new rows are tokens, read from the layer's mask [B or 1, 1, S, Skv] (bool,
    or additive with 0 where attended): a token attends itself, a padding row does not."""
    if mask is None:
        return B * S
    s = torch.arange(S, device=mask.device)
    diag = mask[:, 0, s, Skv - S + s]  # [B or 1, S]
    diag = diag if diag.dtype == torch.bool else diag == 0
    return int(diag.sum()) * (B // diag.shape[0])


class HFAttention(nn.Module):
    """A transformers attention module seen by a routed layer: K/V for all rows, queries for some."""

    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        self.attn = attn

    def all_rows(self, x, ctx):
        return self.attn(hidden_states=x, **ctx)[0]  # exactly the stock module: [B, S, H]

    def masked_rows(self, x, run, ctx, impl):
        return self.all_rows(x, ctx)  # transformers runs eagerly: no graph to keep static

    @staticmethod
    def is_decode(x, ctx) -> bool:
        return x.shape[1] == 1

    def _proj(self, proj, norm, x, B, S):
        t = proj(x).view(B, S, -1, self.attn.head_dim)
        return (norm(t) if norm is not None else t).transpose(1, 2)  # [B, heads, S, d]

    def some_rows(self, x, rows, ctx):
        """K/V of every row into the cache; attention output [n, H] for flat rows `rows` of [B*S]."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        attn = self.attn
        B, S, _ = x.shape
        cos, sin = ctx["position_embeddings"]  # [B or 1, S, d]
        cos, sin = cos.expand(B, -1, -1), sin.expand(B, -1, -1)
        k = _rope(self._proj(attn.k_proj, getattr(attn, "k_norm", None), x, B, S), cos, sin)
        v = self._proj(attn.v_proj, None, x, B, S)
        cache = ctx.get("past_key_values")
        if cache is not None:
            k, v = cache.update(k, v, attn.layer_idx)  # [B, kvh, Skv, d]
        n = rows.numel()
        if n == 0:
            return x.new_zeros(0, x.shape[-1])
        mask = ctx.get("attention_mask")
        impl = attn.config._attn_implementation
        fn = ALL_ATTENTION_FUNCTIONS.get_interface(impl, None)
        if fn is None:
            from transformers.models.llama.modeling_llama import eager_attention_forward as fn

        def attend(q, k, v, mask):
            return fn(attn, q, k, v, mask, dropout=0.0, scaling=attn.scaling,
                      sliding_window=getattr(attn, "sliding_window", None))[0]  # [b, S, nh, d]

        if S == 1:  # decode: the rows are whole sequences; attend only for them, over the cache in place:
            # one call per run of consecutive rows, on views (copying the RUN rows' K/V out of the cache
            # moved more memory than the attention reads: measured +25% on a routed layer's step, T=256)
            q = _rope(self._proj(attn.q_proj, getattr(attn, "q_norm", None), x.index_select(0, rows), n, S),
                      cos.index_select(0, rows), sin.index_select(0, rows))  # [n, nh, 1, d]
            per_row = mask is not None and mask.shape[0] == B
            parts, at = [], 0
            for a, b in _runs(rows.tolist()):
                parts.append(attend(q[at:at + b - a], k[a:b], v[a:b], mask[a:b] if per_row else mask))
                at += b - a
            o = parts[0] if len(parts) == 1 else torch.cat(parts)
            return attn.o_proj(o.reshape(n, -1))  # [n, H]
        if (impl in ("eager", "sdpa") and (mask is None or torch.is_tensor(mask))
                and n < _query_rows(mask, B, S, k.shape[2])):  # prefill: queries for the RUN rows only
            return self._prefill_rows(fn, x, rows, k, v, cos, sin, mask)
        # prefill where every token runs (the stock call's shapes: skipping nothing is the model bit for
        # bit), or with another attention (flash, flex): attend for all rows, keep some
        q = _rope(self._proj(attn.q_proj, getattr(attn, "q_norm", None), x, B, S), cos, sin)
        o = attn.o_proj(attend(q, k, v, mask).reshape(B, S, -1).contiguous())  # [B, S, H]
        return o.reshape(B * S, -1)[rows]

    def _prefill_rows(self, fn, x, rows, k, v, cos, sin, mask):
        """Prefill (S > 1): queries, attention and o_proj for the flat rows `rows` of [B*S] only. A
        row at position s of sequence b attends b's keys as the layer's mask says (no mask: causal,
        keys j <= Skv - S + s); per sequence, its rows gathered, one attention call per block of
        PREFILL_BLOCK_ROWS rows over the keys up to the block's last position. -> [n, H]"""
        attn = self.attn
        B, S, H = x.shape
        Skv, n = k.shape[2], rows.numel()
        b_of, s_of = rows // S, rows % S  # [n]
        cs, sn = cos.reshape(B * S, -1)[rows].unsqueeze(0), sin.reshape(B * S, -1)[rows].unsqueeze(0)  # [1, n, d]
        q = _rope(self._proj(attn.q_proj, getattr(attn, "q_norm", None), x.reshape(B * S, H)[rows][None], 1, n),
                  cs, sn)  # [1, nh, n, d]
        if mask is None:  # an additive mask, which eager and sdpa both take
            allowed = torch.arange(Skv, device=x.device)[None, :] <= (Skv - S + s_of)[:, None]  # [n, Skv]
            mask_rows = torch.zeros(n, 1, Skv, dtype=q.dtype, device=x.device).masked_fill_(
                ~allowed[:, None], torch.finfo(q.dtype).min)
        else:  # [B or 1, 1, S, Skv] -> [n, 1, Skv]
            mask_rows = mask[b_of if mask.shape[0] == B else torch.zeros_like(b_of), :, s_of, :]
        out = x.new_empty(n, q.shape[1] * q.shape[3])
        last = (Skv - S + s_of).tolist()  # each row's key position, ascending within a sequence
        for b in range(B):
            idx = (b_of == b).nonzero().squeeze(1)
            for j in range(0, idx.numel(), PREFILL_BLOCK_ROWS):  # blocks of rows, keys up to the block's last
                blk = idx[j:j + PREFILL_BLOCK_ROWS]
                L = last[int(blk[-1])] + 1
                o, _ = fn(attn, q[:, :, blk].contiguous(), k[b:b + 1, :, :L], v[b:b + 1, :, :L],
                          mask_rows[blk, :, :L].transpose(0, 1).unsqueeze(0).contiguous(), dropout=0.0,
                          scaling=attn.scaling, sliding_window=getattr(attn, "sliding_window", None))
                out[blk] = o.reshape(blk.numel(), -1)  # [1, nb, nh, d] -> [nb, nh * d]
        return attn.o_proj(out)


class HFDecoderStack(nn.Module):
    """The decoder loop of a transformers Llama/Qwen3 model; decoder layers are fx leaves."""

    def __init__(self, layers: nn.ModuleList, layer_types: list[str]) -> None:
        super().__init__()
        self.layers = layers
        self.layer_types = layer_types
        self.indices = tuple(range(len(layers)))

    def forward(self, hidden_states, token_ids, positions, valid, masks, position_embeddings,
                position_ids, past_key_values, use_cache):
        for i, layer in enumerate(self.layers):
            hidden_states = layer(
                hidden_states,
                attention_mask=masks[self.layer_types[i]],
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                past_key_values=past_key_values,
                use_cache=use_cache,
            )
        return hidden_states


def _layer_types(config) -> list[str]:
    types_ = getattr(config, "layer_types", None)
    return list(types_) if types_ else ["full_attention"] * config.num_hidden_layers


def make_stacks(model, routed) -> list[HFDecoderStack]:
    inner = model.model
    return [HFDecoderStack(inner.layers, _layer_types(inner.config))]


def _skip_aware_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                        inputs_embeds=None, use_cache=None, **kwargs):
    """The inner model's forward after `vskipper.transform`: as transformers computes it, with the
    decoder loop replaced by the transformed DecoderStack."""
    from transformers.cache_utils import DynamicCache
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
    from transformers.modeling_outputs import BaseModelOutputWithPast

    for k in ("output_hidden_states", "output_attentions"):
        if kwargs.get(k):
            raise NotImplementedError(f"vskipper-transformed models do not return {k.removeprefix('output_')}")
    if (input_ids is None) ^ (inputs_embeds is not None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
    if inputs_embeds is None:
        inputs_embeds = self.embed_tokens(input_ids)
    B, S = inputs_embeds.shape[:2]
    if B == 0 or S == 0:
        raise ValueError(f"vskipper: empty batch (input shape {list(inputs_embeds.shape[:2])}); "
                         f"give at least one sequence with at least one token")
    if use_cache is None:
        use_cache = self.config.use_cache
    if use_cache and past_key_values is None:
        past_key_values = DynamicCache(config=self.config)
    if position_ids is None:
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        position_ids = (torch.arange(S, device=inputs_embeds.device) + past).unsqueeze(0)
    if isinstance(attention_mask, dict):
        masks = attention_mask
    else:
        mk = dict(config=self.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                  past_key_values=past_key_values, position_ids=position_ids)
        masks = {"full_attention": create_causal_mask(**mk)}
        if "sliding_attention" in _layer_types(self.config):
            masks["sliding_attention"] = create_sliding_window_causal_mask(**mk)
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
        valid = attention_mask[:, -S:].bool()  # [B, S]
    else:
        valid = torch.ones(B, S, dtype=torch.bool, device=inputs_embeds.device)
    position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
    positions = position_ids.expand(B, S)
    h = self._vskipper_stack(inputs_embeds, input_ids, positions, valid, masks, position_embeddings,
                             position_ids, past_key_values, use_cache)
    return BaseModelOutputWithPast(last_hidden_state=self.norm(h),
                                   past_key_values=past_key_values if use_cache else None)


def mlp_weights(mlp):
    """(w_gate [I, H], w_up [I, H], w_down [H, I]) of a transformers SwiGLU MLP."""
    return mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight


register_families("transformers", {"LlamaForCausalLM": "transformers.models.llama.modeling_llama",
                    "Qwen3ForCausalLM": "transformers.models.qwen3.modeling_qwen3"},
                  make_stacks=make_stacks, install=replace_inner_forward(_skip_aware_forward),
                  make_attention=lambda layer: HFAttention(layer.self_attn), mlp_weights=mlp_weights)
