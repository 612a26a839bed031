"""transformers (5.x) attention and MLP parts (the contract: vskipper/engines/parts.py).

The attention part writes K/V of every row through transformers' cache and attends for the RUN
rows only: at decode per run of consecutive rows, over the cache in place (dynamic shapes), or with
fixed shapes through vskipper's cache_decode_attention, which skipped rows do not read (CUDA graphs);
in prefill per sequence, queries of the RUN rows over the layer's own mask. Shapes: B = batch, S = new tokens
per sequence, Skv = cached + new, nh/kvh = heads, d = head dim, n = rows attended."""
from __future__ import annotations

import torch
from torch import nn

from vskipper import ops
from vskipper.engines.parts import AttentionPart, MLPPart
from vskipper.models.rotary import apply_rope


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


def _key_mask(mask, B: int, L: int):
    """The positions a decode row attends, [B or 1, L] bool, from the layer's mask [B or 1, 1, 1, L]
    (bool, or additive: 0 where attended and the dtype's minimum elsewhere, as transformers builds it);
    None: every position (no mask, or the GPU harness's FULL one). False: a mask of another kind."""
    if mask is None or getattr(mask, "vskipper_full", False):
        return None
    if not (torch.is_tensor(mask) and mask.dim() == 4 and mask.shape[1] == mask.shape[2] == 1
            and mask.shape[0] in (1, B) and mask.shape[3] == L):
        return False
    m = mask[:, 0, 0, :]
    return m if m.dtype == torch.bool else m == 0


class HFAttention(AttentionPart):
    """A transformers attention module seen by a routed layer: K/V for all rows, queries for some.
    Its fixed-shape masked form (`attend_masked`, decode) attends the cache transformers returns,
    [B, kvh, L, d], with vskipper's cache_decode_attention: skipped rows read no K/V."""

    masks_rows = True

    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        self.attn = attn

    def attend_all(self, x, ctx):
        return self.attn(hidden_states=x, **ctx)[0]  # exactly the stock module: [B, S, H]

    def is_decode(self, x, ctx) -> bool:
        return x.shape[1] == 1

    def resident_tokens(self, x, ctx) -> int:
        """B times the key length of the layer's mask [B or 1, 1, S, Skv] (a static cache: its
        capacity, which its attention reads masked), or of the cache when there is no mask."""
        mask = ctx.get("attention_mask")
        if torch.is_tensor(mask) and mask.dim() == 4:
            return x.shape[0] * mask.shape[-1]
        cache = ctx.get("past_key_values")
        past = cache.get_seq_length(self.attn.layer_idx) if cache is not None else 0
        return x.shape[0] * (int(past) + x.shape[1])

    def _proj(self, proj, norm, x, B, S):
        t = proj(x).view(B, S, -1, self.attn.head_dim)
        return (norm(t) if norm is not None else t).transpose(1, 2)  # [B, heads, S, d]

    def attend_rows(self, x, rows, ctx, impl="torch"):
        """K/V of every row into the cache; attention output [n, H] for flat rows `rows` of [B*S] (through
        transformers' attention function: `impl` is not used)."""
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

    def attend_masked(self, x, run, ctx, impl, tuned=True):
        """Attention output [B, S, H], meaningful for rows with `run` [B, S] set; K/V of every row
        written. Decode (S = 1): fixed shapes, no host sync (CUDA graphs), as SGLang's part does it:
        q, k, v and the cache update for every row, attention over the cache for the RUN rows only,
        o_proj over all rows (a skipped row's output is never read). Prefill (never captured): the RUN
        rows' queries through attend_rows (reads their indices on the host). A sliding-window layer, or a
        mask this form cannot read, attends every row as the stock module does (the same function)."""
        attn = self.attn
        B, S, H = x.shape
        if S != 1:
            rows = run.reshape(-1).nonzero().squeeze(1)  # a host read: prefill is never captured
            a = self.attend_rows(x, rows, ctx)
            return x.new_zeros(B * S, H).index_copy_(0, rows, a).view(B, S, H)
        cache = ctx.get("past_key_values")
        if getattr(attn, "sliding_window", None) is not None:
            return self.attend_all(x, ctx)
        cos, sin = ctx["position_embeddings"]  # [B or 1, 1, d]
        cos, sin = cos.expand(B, -1, -1), sin.expand(B, -1, -1)
        q = _rope(self._proj(attn.q_proj, getattr(attn, "q_norm", None), x, B, 1), cos, sin)  # [B, nh, 1, d]
        k = _rope(self._proj(attn.k_proj, getattr(attn, "k_norm", None), x, B, 1), cos, sin)
        v = self._proj(attn.v_proj, None, x, B, 1)
        if cache is not None:
            k, v = cache.update(k, v, attn.layer_idx)  # [B, kvh, L, d]
        attended = _key_mask(ctx.get("attention_mask"), B, k.shape[2])
        if attended is False:  # e.g. a flex-attention BlockMask: the stock call on what we computed
            return self._attend_stock(q, k, v, ctx.get("attention_mask"), B)
        o = ops.cache_decode_attention(q[:, :, 0], k, v, attended, run.reshape(B), attn.scaling, impl=impl,
                                       tuned=tuned)  # [B, nh, d], zeros off `run`
        return attn.o_proj(o.reshape(B, 1, -1))

    def _attend_stock(self, q, k, v, mask, B):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        attn = self.attn
        fn = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, None)
        if fn is None:
            from transformers.models.llama.modeling_llama import eager_attention_forward as fn
        o = fn(attn, q, k, v, mask, dropout=0.0, scaling=attn.scaling)[0]  # [B, 1, nh, d]
        return attn.o_proj(o.reshape(B, 1, -1).contiguous())

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


class HFMLP(MLPPart):
    """A transformers SwiGLU MLP (gate_proj, up_proj, down_proj)."""

    def swiglu_weights(self):
        return self.mlp.gate_proj.weight, self.mlp.up_proj.weight, self.mlp.down_proj.weight
