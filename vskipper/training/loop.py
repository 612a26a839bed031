"""The training loop: routers and adapters over a frozen base model.

loss = KL(base || skipper)  (or LM cross-entropy)  +  lambda * mean_t ((1/L) sum_l g_lt)^2
(SkipGPT: g_lt = w_a p_a + w_m p_m, the work-weighted run probability of layer l's two sublayers,
w = forward.sublayer_work; its skip ratio is the share of skipped sublayer work.)
With target_tokens "generated" the penalty is two terms, each a mean over its own tokens:
lambda * mean over generated tokens + lambda_prompt * mean over prompt tokens, and target_skip steers
lambda by the generated tokens' skip (prompt_target_skip, lambda_prompt by the prompt's).
Only the skipper's tensors train (AdamW); the base model is frozen and its layers before the
first routed layer are replaced by their cached output (TargetSet.start_hidden).
Resumable: `save_state(dir)` writes the skipper, the optimizer moments and the step as
safetensors + JSON; batches and the learning rate are pure functions of (seed, step), so a
resumed run continues exactly where the saved one stopped.
Legend: B = sequences, S = positions, n = real tokens in the batch, K = top-k, V = vocabulary.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import MISSING, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from vskipper.skippers.base import Skipper
from vskipper.skippers.flexidepth import FlexiDepth
from vskipper.skippers.skipgpt import SkipGPT
from vskipper.training.config import TrainConfig
from vskipper.training.data import Batcher, TargetSet, base_forward, right_pad
from vskipper.training.forward import logits_of, skip_forward, sublayer_work

STATE_TENSORS = "state.safetensors"
STATE_JSON = "state.json"


def make_skipper(c, cfg: TrainConfig) -> FlexiDepth | SkipGPT:
    """A skipper of cfg.family for a model with config `c` under `cfg` (ValueError naming a bad layer)."""
    n = c.num_hidden_layers
    bad = [l for l in cfg.layers if l >= n]
    if bad:
        raise ValueError(f"layers {bad} are out of range for a model with {n} layers (valid: 0..{n - 1})")
    if cfg.family == "skipgpt":
        return SkipGPT(cfg.layers, c.hidden_size)
    return FlexiDepth(cfg.layers, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                      rms_norm_eps=c.rms_norm_eps, gate=cfg.gate, router_reduction_factor=cfg.router_reduction_factor,
                      proj_reduction_factor=cfg.proj_reduction_factor)


def _layer_inputs(model: nn.Module, data: TargetSet, layers, n_seq: int, normed: bool) -> dict[int, torch.Tensor]:
    """The base model's input_layernorm(h) (normed) or h at each of `layers`, over the real tokens of the
    first `n_seq` training sequences: {layer: [n, H]}."""
    seqs = [data.ids[data.rows(i)] for i in range(min(n_seq, len(data)))]
    ids, valid = right_pad(seqs)
    xs: dict[int, torch.Tensor] = {}
    if normed:
        hooks = [model.model.layers[l].input_layernorm.register_forward_hook(
            lambda m, a, out, l=l: xs.__setitem__(l, out[valid])) for l in layers]
    else:
        hooks = [model.model.layers[l].input_layernorm.register_forward_pre_hook(
            lambda m, a, l=l: xs.__setitem__(l, a[0][valid])) for l in layers]
    try:
        base_forward(model, ids, capture=0)
    finally:
        for h in hooks:
            h.remove()
    return xs


@torch.no_grad()
def warm_start(skipper: FlexiDepth | SkipGPT, model: nn.Module, data: TargetSet, seed: int, n_seq: int = 16,
               logit: float = 4.0) -> dict[int, float]:
    """Start every router at g ~ sigmoid(logit) on (almost) every token and every adapter at zero,
    so training starts from the base model and the penalty has to earn each skip.

    The router has no bias and its logit is an odd function of x, so no weight setting gives the
    same g to every token. But the normalized hidden states of an LLM share a dominant direction:
    with router_enc's first row along the mean x of the layer (measured on `n_seq` training
    sequences), tanh(router_norm(.)) of that row is ~ +1 for every token with a positive projection,
    and router_head reads it with weight `logit`. Returns {layer: share of tokens that start at RUN}.

    SkipGPT (warm_start_skipgpt): the router has biases, so every token starts executing both sublayers."""
    if isinstance(skipper, SkipGPT):
        return warm_start_skipgpt(skipper, model, data, seed, n_seq, logit)
    g = torch.Generator().manual_seed(seed)
    xs = _layer_inputs(model, data, skipper.layers, n_seq, normed=True)
    share = {}
    for l in skipper.layers:
        r = skipper.router(l)
        x = xs[l]  # [n, H]
        mu = x.mean(0)
        H, R = r.router_enc.weight.shape[1], r.router_enc.weight.shape[0]
        enc = torch.randn(R, H, generator=g) / math.sqrt(H) / x.pow(2).mean().sqrt()
        enc[0] = mu / mu.norm() / x.norm(dim=-1).mean() * math.sqrt(H) * 4.0
        r.router_enc.weight.copy_(enc)
        r.router_norm.weight.fill_(1.0)
        e = torch.randn(H, generator=g)
        e /= e.norm()
        dec = torch.randn(H, R, generator=g) * (0.01 / math.sqrt(R))
        dec[:, 0] = e
        r.router_dec.weight.copy_(dec)
        r.router_head.weight.copy_(logit * e[None, :])
        share[l] = float((r(x) > skipper.threshold).float().mean())
        a = skipper.adapter(l)
        for lin in (a.gate_proj, a.down_proj):
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) / math.sqrt(H))
        a.up_proj.weight.zero_()
    return share


@torch.no_grad()
def warm_start_skipgpt(skipper: SkipGPT, model: nn.Module, data: TargetSet, seed: int, n_seq: int = 16,
                       logit: float = 4.0) -> dict[int, float]:
    """Every SkipGPT router starts executing every token with p_run = sigmoid(logit) (0.98): its
    weight_predictor's weight is zero and its bias (logit, 0) (execute, skip), so the skipper starts as
    the base model. hidden_layer is random, scaled to the layer's input h (its RMS over the real tokens
    of `n_seq` training sequences: the residual stream grows with depth), so that its pre-activations are
    O(1) and the first steps move the logits by O(lr). Returns {layer: share of (token, sublayer) pairs
    that start at RUN} (1.0)."""
    g = torch.Generator().manual_seed(seed)
    hs = _layer_inputs(model, data, skipper.layers, n_seq, normed=False)
    share = {}
    for l in skipper.layers:
        h = hs[l]  # [n, H]
        rms = h.pow(2).mean().sqrt()
        for tr in (skipper.router(l).router_attention, skipper.router(l).router_mlp):
            H = tr.hidden_layer.weight.shape[1]
            tr.hidden_layer.weight.copy_(torch.randn(tr.hidden_layer.weight.shape, generator=g) / math.sqrt(H) / rms)
            tr.hidden_layer.bias.zero_()
            tr.weight_predictor.weight.zero_()
            tr.weight_predictor.bias.copy_(torch.tensor([logit, 0.0]))
        share[l] = float(skipper.router(l)(h).float().mean())
    return share


class Trainer:
    def __init__(self, model: nn.Module, skipper: Skipper, data: TargetSet, cfg: TrainConfig) -> None:
        if tuple(skipper.layers) != cfg.layers:
            raise ValueError(f"Trainer: skipper layers {list(skipper.layers)} != config layers {list(cfg.layers)}")
        if min(cfg.layers) < data.start_layer:
            raise ValueError(f"Trainer: routed layer {min(cfg.layers)} is before the cached start layer "
                             f"{data.start_layer}")
        self.model, self.skipper, self.data, self.cfg = model, skipper, data, cfg
        # per-decision work weights: a sublayer skipper's (attention, MLP) shares of a layer's work
        self.work = torch.tensor(sublayer_work(model.config)) if skipper.sublayers else None
        for p in model.parameters():
            p.requires_grad_(False)
        self.params = [p for _, p in sorted(skipper.named_parameters())]
        self.names = [n for n, _ in sorted(skipper.named_parameters())]
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        self.batcher = Batcher(data.lengths, cfg.batch_size, cfg.seed)
        # [N] bool, the generated tokens' rows (data.generated), where the prompt lengths are known
        self.gen_rows = None if data.n_prompt is None else data.generated_rows()
        if cfg.target_tokens == "generated" and self.gen_rows is None:
            raise ValueError("Trainer: target_tokens='generated' needs the data's prompt lengths (TargetSet.n_prompt)")
        self.step = 0
        self.penalty_weight = cfg.penalty  # adapted when cfg.target_skip is set
        self.prompt_penalty_weight = cfg.prompt_penalty  # adapted when cfg.prompt_target_skip is set
        self.history: list[dict] = []

    # --- schedule ----------------------------------------------------------------------------
    def lr_at(self, step: int) -> float:
        c = self.cfg
        if step < c.warmup:
            return c.lr * (step + 1) / c.warmup
        t = (step - c.warmup) / max(1, c.steps - c.warmup)
        return c.lr * (c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))

    def penalty_at(self, step: int, weight: float | None = None) -> float:
        """`weight` (default the penalty weight) under the penalty's warm-up at `step`."""
        c = self.cfg
        w = self.penalty_weight if weight is None else weight
        return w * (min(1.0, (step + 1) / c.penalty_warmup) if c.penalty_warmup else 1.0)

    # --- one batch ---------------------------------------------------------------------------
    def batch(self, indices: list[int]):
        d = self.data
        seqs = [d.ids[d.rows(i)] for i in indices]
        ids, valid = right_pad(seqs)
        hidden = torch.zeros(*ids.shape, d.start_hidden.shape[1], dtype=d.start_hidden.dtype)
        hidden[valid] = torch.cat([d.start_hidden[d.rows(i)] for i in indices])
        rows = torch.cat([torch.arange(d.offsets[i], d.offsets[i + 1]) for i in indices])  # [n], row-major order
        return ids, valid, hidden, rows

    def losses(self, indices: list[int], penalty: float, prompt_penalty: float = 0.0):
        """(total, parts) for a batch: parts are floats for the log. With target_tokens "generated",
        `penalty` weighs the generated tokens' term and `prompt_penalty` the prompt tokens'."""
        d, cfg = self.data, self.cfg
        ids, valid, hidden, rows = self.batch(indices)
        out = skip_forward(self.model, self.skipper, ids, start_hidden=hidden, start_layer=d.start_layer,
                           straight_through=cfg.straight_through)
        logq = torch.log_softmax(logits_of(self.model, out.hidden[valid]).float(), dim=-1)  # [n, V]
        if cfg.loss == "kl":
            k = min(cfg.topk, d.top_idx.shape[1])
            idx, lp, rest = d.top_idx[rows, :k], d.top_logp[rows, :k], d.rest_logp[rows]
            if k < d.top_idx.shape[1]:  # fewer than cached: fold the others into the rest
                rest = torch.logaddexp(rest, d.top_logp[rows, k:].logsumexp(-1))
            q_top = logq.gather(1, idx)  # [n, K]
            q_rest = logq.scatter(1, idx, float("-inf")).logsumexp(-1)  # [n]
            rest_term = torch.where(rest > float("-inf"), rest.exp() * (rest - q_rest), 0.0)  # 0 when K = V
            main = ((lp.exp() * (lp - q_top)).sum(-1) + rest_term).mean()
        else:  # next token of the self-distilled text; the last token of each sequence has none
            nxt = torch.full_like(ids, -100)
            nxt[:, :-1] = ids[:, 1:].masked_fill(~valid[:, 1:], -100)
            main = F.cross_entropy(logq, nxt[valid], ignore_index=-100)
        g = torch.stack([out.gates[l][valid] for l in self.skipper.layers]).float()  # [L, n] (sublayers [L, n, 2])
        run = torch.stack([out.run[l][valid] for l in self.skipper.layers]).float()
        parts = {}
        if self.work is not None:  # work-weighted: a layer's run share = w_a run_a + w_m run_m
            parts["skip_attention"], parts["skip_mlp"] = (1.0 - run.mean((0, 1))).tolist()
            g, run = g @ self.work, run @ self.work  # [L, n]
        usage = g.mean(0)  # [n]: (1/L) sum_l g_lt
        gen = None if self.gen_rows is None else self.gen_rows[rows]  # [n] bool: generated tokens
        if cfg.target_tokens == "generated":
            pen, pen_p = _mean_sq(usage[gen]), _mean_sq(usage[~gen])
            total = main + penalty * pen + prompt_penalty * pen_p
            parts["penalty_prompt"] = float(pen_p.detach())
        else:
            pen = usage.pow(2).mean()
            total = main + penalty * pen
        parts.update({"main": float(main.detach()), "penalty": float(pen.detach()), "skip": 1.0 - float(run.mean()),
                      "tokens": int(valid.sum()), "skip_per_layer": (1.0 - run.mean(1)).tolist()})
        if gen is not None:  # the skip of each kind of token (None where the batch has none)
            for name, m in (("generated", gen), ("prompt", ~gen)):
                n = int(m.sum())
                parts[f"tokens_{name}"] = n
                parts[f"skip_{name}"] = 1.0 - float(run[:, m].mean()) if n else None
        return total, parts

    @torch.no_grad()
    def evaluate(self, indices: list[int] | None = None, batch_size: int | None = None) -> dict:
        """Token-weighted mean loss parts over `indices` (default: every sequence), in eval mode."""
        self.skipper.eval()
        indices = list(range(len(self.data))) if indices is None else indices
        bs = batch_size or self.cfg.batch_size
        sums, n = {"main": 0.0, "penalty": 0.0, "skip": 0.0}, 0
        if self.work is not None:
            sums |= {"skip_attention": 0.0, "skip_mlp": 0.0}
        kinds = {} if self.gen_rows is None else {"generated": [0.0, 0], "prompt": [0.0, 0]}  # skip x tokens, tokens
        for b in range(0, len(indices), bs):
            _, parts = self.losses(indices[b:b + bs], 0.0)
            for k in sums:
                sums[k] += parts[k] * parts["tokens"]
            n += parts["tokens"]
            for name, acc in kinds.items():
                if parts[f"tokens_{name}"]:
                    acc[0] += parts[f"skip_{name}"] * parts[f"tokens_{name}"]
                    acc[1] += parts[f"tokens_{name}"]
        out = {k: v / n for k, v in sums.items()} | {"tokens": n}
        for name, (skipped, tokens) in kinds.items():
            out |= {f"skip_{name}": skipped / tokens if tokens else None, f"tokens_{name}": tokens}
        return out

    def train_step(self) -> dict:
        self.skipper.train()
        lr = self.lr_at(self.step)
        for group in self.opt.param_groups:
            group["lr"] = lr
        c = self.cfg
        lam, lam_p = self.penalty_at(self.step), self.penalty_at(self.step, self.prompt_penalty_weight)
        total, parts = self.losses(self.batcher.batch(self.step), lam, lam_p)
        self.opt.zero_grad(set_to_none=True)
        total.backward()
        if c.grad_clip:
            parts["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.params, c.grad_clip))
        self.opt.step()
        if c.target_skip is not None:  # multiplicative dual step towards the target skip ratio
            skip = parts["skip_generated"] if c.target_tokens == "generated" else parts["skip"]
            if skip is not None:
                self.penalty_weight *= math.exp(c.target_rate * (c.target_skip - skip) / c.target_skip)
        if c.prompt_target_skip is not None and parts["skip_prompt"] is not None:
            t = c.prompt_target_skip
            self.prompt_penalty_weight *= math.exp(c.target_rate * (t - parts["skip_prompt"]) / t)
        self.step += 1
        parts.update(step=self.step, loss=float(total.detach()), lr=lr, penalty_weight=lam)
        if c.target_tokens == "generated":
            parts["prompt_penalty_weight"] = lam_p
        return parts

    def run(self, until: int | None = None, log=print, on_save=None) -> list[dict]:
        """Train up to step `until` (default cfg.steps), logging every log_every steps and calling
        on_save(self) every save_every steps and at the end."""
        until = self.cfg.steps if until is None else until
        window, t_win, tok_win = [], time.perf_counter(), 0
        t_start, start_step = time.perf_counter(), self.step
        while self.step < until:
            parts = self.train_step()
            parts.pop("skip_per_layer")
            self.history.append(parts)
            window.append(parts)
            tok_win += parts["tokens"]
            if self.step % self.cfg.log_every == 0 or self.step == until:
                now = time.perf_counter()
                rate = tok_win / max(1e-9, now - t_win)
                per_step = (now - t_start) / (self.step - start_step)
                eta = per_step * (until - self.step)
                avg = {k: sum(p[k] for p in window) / len(window) for k in ("loss", "main", "penalty", "skip")}
                sub = ""
                if "skip_mlp" in parts:  # a sublayer skipper: skip is of the work, these of each sublayer's tokens
                    sub = (f" of work (attention {100 * sum(p['skip_attention'] for p in window) / len(window):.1f}%, "
                           f"MLP {100 * sum(p['skip_mlp'] for p in window) / len(window):.1f}%)")
                sub += _kinds(window)
                prompt = (f" + {parts['prompt_penalty_weight']:.3g} x prompt pen "
                          f"{sum(p['penalty_prompt'] for p in window) / len(window):.4f}"
                          if "prompt_penalty_weight" in parts else "")
                log(f"step {self.step}/{until} | loss {avg['loss']:.4f} = {self.cfg.loss} {avg['main']:.4f} + "
                    f"{parts['penalty_weight']:.3g} x pen {avg['penalty']:.4f}{prompt} | skip {100 * avg['skip']:.1f}%"
                    f"{sub} | "
                    f"lr {parts['lr']:.2e} | {rate:.0f} tok/s | ETA {_hms(eta)}")
                window, t_win, tok_win = [], now, 0
            if on_save and (self.step % self.cfg.save_every == 0 or self.step == until):
                on_save(self)
        return self.history

    # --- state -------------------------------------------------------------------------------
    def save_state(self, path) -> Path:
        """Skipper tensors, AdamW moments and the step, as safetensors + JSON (atomic)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        tensors = {f"skipper.{n}": p.detach().contiguous() for n, p in zip(self.names, self.params)}
        for n, p in zip(self.names, self.params):
            st = self.opt.state.get(p)
            if st:
                tensors[f"adam.{n}.exp_avg"] = st["exp_avg"].contiguous()
                tensors[f"adam.{n}.exp_avg_sq"] = st["exp_avg_sq"].contiguous()
                tensors[f"adam.{n}.step"] = torch.as_tensor(st["step"]).reshape(1).float()
        save_file(tensors, str(path / (STATE_TENSORS + ".tmp")))
        meta = {"step": self.step, "penalty_weight": self.penalty_weight,
                "prompt_penalty_weight": self.prompt_penalty_weight, "config": self.cfg.to_dict(),
                "history": self.history}
        (path / (STATE_JSON + ".tmp")).write_text(json.dumps(meta))
        (path / (STATE_TENSORS + ".tmp")).replace(path / STATE_TENSORS)
        (path / (STATE_JSON + ".tmp")).replace(path / STATE_JSON)
        return path

    def load_state(self, path) -> None:
        """Continue a saved run; a config that differs in anything but RESUMABLE_CHANGES raises."""
        from safetensors.torch import load_file

        path = Path(path)
        if not (path / STATE_JSON).is_file() or not (path / STATE_TENSORS).is_file():
            raise ValueError(f"resume: {str(path)!r} holds no saved training state ({STATE_JSON}, {STATE_TENSORS})")
        meta = json.loads((path / STATE_JSON).read_text())
        # a state saved before a field existed ran with that field's default (older states: FlexiDepth, all tokens)
        defaults = {f.name: f.default for f in fields(TrainConfig) if f.default is not MISSING}
        saved, now = defaults | meta["config"], self.cfg.to_dict()
        diff = {k: (saved.get(k), v) for k, v in now.items()
                if k not in TrainConfig.RESUMABLE_CHANGES and saved.get(k) != v}
        if diff:
            raise ValueError(f"resume: the saved run used different settings {diff} (saved, now); "
                             f"start a new run in another directory")
        t = load_file(str(path / STATE_TENSORS))
        with torch.no_grad():
            for n, p in zip(self.names, self.params):
                p.copy_(t[f"skipper.{n}"])
                if f"adam.{n}.exp_avg" in t:
                    self.opt.state[p] = {"step": t[f"adam.{n}.step"].reshape(()).clone(),
                                         "exp_avg": t[f"adam.{n}.exp_avg"].clone(),
                                         "exp_avg_sq": t[f"adam.{n}.exp_avg_sq"].clone()}
        self.step = int(meta["step"])
        self.penalty_weight = float(meta["penalty_weight"])
        self.prompt_penalty_weight = float(meta.get("prompt_penalty_weight", self.cfg.prompt_penalty))
        self.history = list(meta.get("history", []))


def _mean_sq(u: torch.Tensor) -> torch.Tensor:
    """mean(u^2), 0 for no element (a batch without tokens of a kind)."""
    return u.pow(2).mean() if u.numel() else u.new_zeros(())


def _kinds(window: list[dict]) -> str:
    """' (prompt p%, generated g%)': each kind's skip over the window's steps, token-weighted ('' without)."""
    if "tokens_generated" not in window[0]:
        return ""
    out = []
    for name in ("prompt", "generated"):
        n = sum(p[f"tokens_{name}"] for p in window)
        skipped = sum(p[f"skip_{name}"] * p[f"tokens_{name}"] for p in window if p[f"tokens_{name}"])
        out.append(f"{name} {100 * skipped / n:.1f}%" if n else f"{name} -")
    return f" ({', '.join(out)})"


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s // 60 % 60:02d}m{s % 60:02d}s" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
