"""Teacher-forced forwards of a transformers Llama under given route decisions, their scores, and the
oracle of benchmarks/quality_oracle.py (the CLI, the systems beside it and the page are there).

    Stack     the decoder layers from the first routed one up, called part by part: RUN rows are the
              layer, PROJECT rows the identity or (adapters) h + adapter(post_attention_layernorm(h))
    score     top-1, KL, agreeing prefix over the scored positions; skip at generated and prompt positions
    Oracle    left to right over each answer, every generated token given the deepest-first greedy choice
              of the layers it can skip while its own next-token distribution stays within a KL budget of
              the base's and keeps the base's most likely token, in the context the earlier choices made

Legend: S = positions of one sequence, B = rows in lockstep (sequences x budgets), H = hidden, V =
vocabulary, nh/kvh = heads, r = nh / kvh, d = head dim, n = rows, L = routed layers, A = scored positions.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from benchmarks import results as res


@dataclass
class Seq:
    """One held-out sequence, ready for teacher-forced forwards."""

    ids: torch.Tensor  # [S] prompt + the base's greedy answer
    n: int  # prompt tokens
    gen: torch.Tensor  # [S] bool: generated positions (training.data.generated)
    h0: torch.Tensor  # [S, H] the input of the first routed layer (the layers before are never routed)
    cos: torch.Tensor  # [S, d]
    sin: torch.Tensor
    base_logp: torch.Tensor | None = None  # [A, V] the base's log-probabilities at the scored positions n-1..S-2
    base_top: torch.Tensor | None = None  # [A] the base's most likely next token there

    @property
    def scored(self) -> slice:
        return slice(self.n - 1, len(self.ids) - 1)


class Stack:
    """The decoder layers of a transformers Llama from the first routed layer up, called part by part
    under given route decisions (hard gate: adapters must be a hard-gated FlexiDepth skipper's). Every
    forward of the bound is this one code, so the base's figures and every system's are computed alike."""

    def __init__(self, model, layers, adapters=None) -> None:
        if adapters is not None and adapters.gate != "hard":
            raise ValueError(f"adapters: a hard-gated FlexiDepth skipper's (PROJECT rows h + adapter), got "
                             f"gate={adapters.gate!r}")
        self.model, self.inner = model, model.model
        self.layers = tuple(sorted(layers))
        self.first = self.layers[0]
        self.adapters = adapters

    @torch.inference_mode()
    def prepare(self, ids: list[int], n: int) -> Seq:
        from vskipper.models.rotary import rope_tables
        from vskipper.reference import attention
        from vskipper.training.data import generated

        t = torch.tensor(ids)
        h = self.inner.embed_tokens(t)
        cos, sin = rope_tables(self.inner.rotary_emb, len(ids), h.device, h.dtype)
        for layer in self.inner.layers[:self.first]:
            h = h + attention(layer.self_attn, layer.input_layernorm(h), cos, sin)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        seq = Seq(t, n, generated(n, len(ids)), h, cos, sin)
        logp, _, _ = self.run(seq, lambda i, x: torch.ones(len(ids), dtype=torch.bool))
        seq.base_logp, seq.base_top = logp, logp.argmax(-1)
        return seq

    @staticmethod
    def _qkv(attn, x, cos, sin):
        from vskipper.models.rotary import apply_rope

        n, d = x.shape[0], attn.head_dim
        q, k = attn.q_proj(x).view(n, -1, d), attn.k_proj(x).view(n, -1, d)  # [n, nh, d], [n, kvh, d]
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        c, s = cos[:, None], sin[:, None]
        return apply_rope(q, c, s), apply_rope(k, c, s), attn.v_proj(x).view(n, -1, d)

    @staticmethod
    def _attend(attn, q, K, V, pos, k_own, v_own):
        """Each row attends keys K/V at the positions before its own `pos` [n], and its own k_own/v_own
        [n, kvh, d] at its position. K/V: [S, kvh, d] shared by the rows (a whole sequence; K, V = k_own,
        v_own: causal attention), or [n, S, kvh, d], each row's own cache. -> o_proj output [n, H]."""
        n, nh, d = q.shape
        kvh = k_own.shape[1]
        g = q.view(n, kvh, nh // kvh, d)  # [n, kvh, r, d]
        if K.dim() == 3:
            sc = torch.einsum("ngrd,sgd->ngrs", g, K)
        else:
            sc = torch.einsum("ngrd,nsgd->ngrs", g, K)  # [n, kvh, r, S]
        earlier = torch.arange(K.shape[-3])[None, :] < pos[:, None]  # [n, S]
        sc = sc.masked_fill(~earlier[:, None, None, :], float("-inf")) * attn.scaling
        own = (g * k_own[:, :, None, :]).sum(-1, keepdim=True) * attn.scaling  # [n, kvh, r, 1]
        p = torch.softmax(torch.cat([sc, own], -1), -1)
        eq = "ngrs,sgd->ngrd" if K.dim() == 3 else "ngrs,nsgd->ngrd"
        o = torch.einsum(eq, p[..., :-1], V) + p[..., -1:] * v_own[:, :, None, :]
        return attn.o_proj(o.reshape(n, nh * d))

    def _project(self, i, h):
        if self.adapters is None:
            return h
        return h + self.adapters.adapter(i)(self.inner.layers[i].post_attention_layernorm(h))

    def layer(self, i, h, pos, cos, sin, kv=None):
        """Layer i over rows of states h [n, H] at positions pos [n]: (RUN value, PROJECT value or None for
        a layer not routed, the rows' k, v, x = input_layernorm(h)); kv: the (K, V) the rows attend
        (`_attend`), None for a whole sequence's own."""
        layer = self.inner.layers[i]
        x = layer.input_layernorm(h)
        q, k, v = self._qkv(layer.self_attn, x, cos, sin)
        K, V = (k, v) if kv is None else kv
        h1 = h + self._attend(layer.self_attn, q, K, V, pos, k, v)
        r = h1 + layer.mlp(layer.post_attention_layernorm(h1))
        return r, (self._project(i, h) if i in self.layers else None), k, v, x

    def logp(self, h):
        return torch.log_softmax(self.model.lm_head(self.inner.norm(h)).float(), -1)

    @torch.inference_mode()
    def run(self, seq: Seq, decide, capture: bool = False):
        """decide(layer, x [S, H]) -> run [S] bool at each routed layer. Returns (log-probabilities at the
        scored positions [A, V], {layer: run [S]}, and with capture {layer: (K, V)} [S, kvh, d])."""
        pos = torch.arange(len(seq.ids))
        h, runs, states = seq.h0, {}, {}
        for i in range(self.first, len(self.inner.layers)):
            r, p, k, v, x = self.layer(i, h, pos, seq.cos, seq.sin)
            if capture:
                states[i] = (k, v)
            if p is None:
                h = r
            else:
                runs[i] = decide(i, x)
                h = torch.where(runs[i][:, None], r, p)
        return self.logp(h[seq.scored]), runs, states


def kl_rows(base_logp: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """KL(base || q) per row, nats. [n, V] x2 -> [n]."""
    return (base_logp.exp() * (base_logp - logp)).sum(-1)


def score(seqs: list[Seq], logps: list[torch.Tensor], runs: list[dict]) -> dict:
    """top-1, KL and agreeing prefix (mean +- stderr over sequences; prefix median, share identical in
    full) over the scored positions, and the skip at generated and at prompt positions."""
    from vskipper.eval.scoring import mean_stderr

    top1, kl, prefix = [], [], []
    skipped = {"generated": [0, 0], "prompt": [0, 0]}
    for s, lp, rn in zip(seqs, logps, runs):
        same = lp.argmax(-1) == s.base_top  # [A]
        top1.append(float(same.float().mean()))
        kl.append(float(kl_rows(s.base_logp, lp).mean()))
        prefix.append(float(same.numel() if same.all() else int((~same).int().argmax())))
        for name, m in (("generated", s.gen), ("prompt", torch.arange(len(s.ids)) < s.n)):
            for r in rn.values():
                skipped[name][0] += int((~r & m).sum())
                skipped[name][1] += int(m.sum())
    out = {}
    for key, vals in (("top1", top1), ("kl", kl), ("prefix", prefix)):
        out[key], out[f"{key}_se"] = mean_stderr(vals)
    out["prefix_median"] = sorted(prefix)[len(prefix) // 2]
    out["identical"] = sum(p == len(s.base_top) for p, s in zip(prefix, seqs)) / len(seqs)
    for name, (k, n) in skipped.items():
        out[f"skip_{name}"] = k / n if n else None
    return out


def evaluate(stack: Stack, seqs: list[Seq], decide_for) -> dict:
    """decide_for(seq) -> decide(layer, x) for that sequence; one forward per sequence, scored."""
    logps, runs = [], []
    for s in seqs:
        lp, rn, _ = stack.run(s, decide_for(s))
        logps.append(lp)
        runs.append(rn)
    return score(seqs, logps, runs)


def fixed(runs: dict):
    """decide(layer, x) of decisions given in advance: {layer: run [S]}."""
    return lambda i, x: runs[i]


class Oracle:
    """The oracle of benchmarks/quality_oracle.py. For a KL budget tau, each sequence's answer is walked
    left to right; at each generated position t, in the context its earlier positions' decisions made
    (their K/V as they computed them), the token starts with every layer RUN and, from the deepest routed
    layer up, skips a layer where its own next-token distribution then stays within KL(base || q) <= tau
    and keeps the base's most likely token; its K/V are then the ones its decisions give. Every prompt
    token runs every layer. Its own output is exact for each choice (no earlier row changes), so no token
    loses the base's next token by its own skips; a token can still lose it to its context, and then skips
    nothing. Sequences and budgets run in lockstep, one answer position a step."""

    def __init__(self, stack: Stack, seqs: list[Seq], log=res.log) -> None:
        self.stack, self.seqs, self.log = stack, seqs, log

    @torch.inference_mode()
    def run(self, taus: list[float]) -> list[dict]:
        """score() of the oracle's decisions at each budget in `taus`."""
        st, seqs = self.stack, self.seqs
        rows = [(j, tau) for tau in taus for j in range(len(seqs))]
        B, S = len(rows), max(len(s.ids) for s in seqs)
        tau = torch.tensor([t for _, t in rows])  # [B]
        idx = [j for j, _ in rows]
        routed, n_layers = st.layers, len(st.inner.layers)
        caches = {}  # layer -> (K, V) [B, S, kvh, d]: the prompt as the base computes it, then each decision's
        for j, s in enumerate(seqs):
            _, _, kv = st.run(s, lambda i, x, S_=len(s.ids): torch.ones(S_, dtype=torch.bool), capture=True)
            for i, (k, v) in kv.items():
                if i not in caches:
                    caches[i] = (k.new_zeros(B, S, *k.shape[1:]), v.new_zeros(B, S, *v.shape[1:]))
                for b in (b for b, jj in enumerate(idx) if jj == j):
                    caches[i][0][b, :s.n], caches[i][1][b, :s.n] = k[:s.n], v[:s.n]
        runs = [{l: torch.ones(len(seqs[j].ids), dtype=torch.bool) for l in routed} for j in idx]
        logps = [seqs[j].base_logp.clone() for j in idx]  # the scored position n-1 stays the base's (prefill)
        t0 = time.perf_counter()
        for a in range(max(len(s.ids) - s.n for s in seqs)):
            act = [b for b, j in enumerate(idx) if seqs[j].gen[min(seqs[j].n + a, len(seqs[j].ids) - 1)]]
            if not act:
                continue
            pos = torch.tensor([seqs[idx[b]].n + a for b in act])  # [n]
            cos = torch.stack([seqs[idx[b]].cos[p] for b, p in zip(act, pos.tolist())])
            sin = torch.stack([seqs[idx[b]].sin[p] for b, p in zip(act, pos.tolist())])
            base = torch.stack([seqs[idx[b]].base_logp[p - seqs[idx[b]].n + 1] for b, p in zip(act, pos.tolist())])
            top = base.argmax(-1)
            kv = {i: (caches[i][0][act], caches[i][1][act]) for i in caches}
            run = torch.ones(len(act), len(routed), dtype=torch.bool)  # [n, L]

            def forward(h, start):  # layers start.. under `run`: (the inputs of each layer, log-probabilities)
                ins = {}
                for i in range(start, n_layers):
                    ins[i] = h
                    r, p, _, _, _ = st.layer(i, h, pos, cos, sin, kv[i])
                    h = r if p is None else torch.where(run[:, routed.index(i), None], r, p)
                return ins, st.logp(h)

            h0 = torch.stack([seqs[idx[b]].h0[p] for b, p in zip(act, pos.tolist())])
            ins, lp = forward(h0, st.first)
            for l in reversed(routed):  # deepest first: try skipping l, keep it where the token stays close
                c = routed.index(l)
                run[:, c] = False
                new_ins, new_lp = forward(st._project(l, ins[l]), l + 1)
                ok = (kl_rows(base, new_lp) <= tau[act]) & (new_lp.argmax(-1) == top)
                run[:, c] = ~ok
                lp = torch.where(ok[:, None], new_lp, lp)
                for i, h in new_ins.items():
                    ins[i] = torch.where(ok[:, None], h, ins[i])
            for i in caches:  # the token's K/V as its decisions computed them
                layer = st.inner.layers[i]
                _, k, v = st._qkv(layer.self_attn, layer.input_layernorm(ins[i]), cos, sin)
                for m, (b, p) in enumerate(zip(act, pos.tolist())):
                    caches[i][0][b, p], caches[i][1][b, p] = k[m], v[m]
            for m, (b, p) in enumerate(zip(act, pos.tolist())):
                logps[b][p - seqs[idx[b]].n + 1] = lp[m]
                for c, l in enumerate(routed):
                    runs[b][l][p] = run[m, c]
            if a % 8 == 0:
                self.log(f"oracle: answer position {a}, {len(act)} rows ({time.perf_counter() - t0:.0f} s)")
        self.decisions = runs  # row b = budget b // len(seqs), sequence b % len(seqs)
        out = []
        for k, t in enumerate(taus):
            sel = range(k * len(seqs), (k + 1) * len(seqs))
            out.append({"tau": t, **score(seqs, [logps[b] for b in sel], [runs[b] for b in sel])})
        return out
