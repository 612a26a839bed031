"""Training data by self-distillation: the base model's own greedy answers to the training split
of the shipped prompts, and its own next-token distribution over them (nothing is downloaded).

    split_prompts     train / held-out split of `vskipper.data.load("prompts")`, by id
    generate_greedy   batched greedy continuations (transformers generate, left padding)
    self_distillation the sequences (chat prompt + greedy answer), cached as JSONL
    TargetSet         per token: the input of the first routed layer (the frozen prefix of the
                      model, computed once) and the base model's top-k log-probabilities plus the
                      log-probability of the rest of the vocabulary; cached as safetensors
    Batcher           seeded, length-bucketed batches; batch k of the run is a pure function of
                      (seed, k), so a resumed run sees the same batches
Legend: N = tokens over all sequences, H = hidden, K = top-k.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from vskipper.models.rotary import rope_tables
from vskipper.reference import attention

HELDOUT_EVERY = 5  # prompt ids p000, p005, p010, ... are held out for evaluation (80 of 400)


def prompt_number(rec: dict) -> int:
    digits = "".join(c for c in str(rec["id"]) if c.isdigit())
    if not digits:
        raise ValueError(f"prompt record id {rec['id']!r} has no number; cannot assign it to a split")
    return int(digits)


def is_heldout(rec: dict) -> bool:
    return prompt_number(rec) % HELDOUT_EVERY == 0


def split_prompts(records: list[dict]) -> tuple[list[dict], list[dict]]:
    """(train, heldout): held out when the number in the id is a multiple of HELDOUT_EVERY."""
    return [r for r in records if not is_heldout(r)], [r for r in records if is_heldout(r)]


def chat_ids(tokenizer, prompt: str) -> list[int]:
    """The prompt as one user turn of the model's chat template, ready for the assistant's answer."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


def left_pad(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad, dtype=torch.long)
    mask = torch.zeros(len(seqs), L, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, L - len(s):] = torch.tensor(s)
        mask[b, L - len(s):] = 1
    return ids, mask


@torch.no_grad()
def generate_greedy(model: nn.Module, prompts: list[list[int]], max_new_tokens: int, eos: int | None,
                    pad: int, batch_size: int = 32, log=None, done: dict[int, list[int]] | None = None,
                    on_batch=None) -> list[list[int]]:
    """Greedy continuations of token-id prompts with `model.generate` (any transformers model,
    transformed or not), batched by length with left padding. Each continuation stops after the
    first eos (kept) or at max_new_tokens. `done`: continuations already known, by prompt index (not
    generated again); `on_batch({index: continuation})` is called after each generated batch."""
    done = done or {}
    order = sorted((i for i in range(len(prompts)) if i not in done), key=lambda i: len(prompts[i]))
    out: list[list[int] | None] = [done.get(i) for i in range(len(prompts))]
    t0 = time.perf_counter()
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        ids, mask = left_pad([prompts[i] for i in idx], pad)
        gen = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=pad, eos_token_id=eos)
        for b, i in enumerate(idx):
            new = gen[b, ids.shape[1]:].tolist()
            if eos is not None and eos in new:
                new = new[: new.index(eos) + 1]
            out[i] = new
        if on_batch:
            on_batch({i: out[i] for i in idx})
        if log:
            log(f"generate: {len(done) + min(start + batch_size, len(order))}/{len(prompts)} prompts, "
                f"{time.perf_counter() - t0:.0f} s")
    return out  # type: ignore[return-value]


def _key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def self_distillation(model: nn.Module, tokenizer, records: list[dict], max_new_tokens: int, cache_dir: Path,
                      model_tag: str, batch_size: int = 32, log=None) -> list[dict]:
    """[{"id", "ids": prompt + greedy answer, "n_prompt"}] for `records`, cached in cache_dir
    (keyed by model tag, prompts and max_new_tokens). Answers are appended to a .partial file batch
    by batch, so an interrupted run generates only what is missing when it starts again."""
    prompts = [chat_ids(tokenizer, r["prompt"]) for r in records]
    key = _key(model_tag, max_new_tokens, [r["id"] for r in records], prompts)
    path = Path(cache_dir) / f"generations-{key}.jsonl"
    if path.is_file():
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if log:
            log(f"self-distillation set: {len(rows)} sequences from {path}")
        return rows
    if log:
        log(f"self-distillation: greedy answers of the base model to {len(records)} training prompts "
            f"(max {max_new_tokens} new tokens), cached in {path}")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    done = {}
    if partial.is_file():
        for line in partial.read_text().splitlines():
            try:
                rec = json.loads(line)
                done[int(rec["i"])] = list(rec["new"])
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by an interruption: that answer is generated again
        if log and done:
            log(f"self-distillation: {len(done)} answers kept from an interrupted run ({partial})")

    def keep(batch: dict[int, list[int]]) -> None:
        with partial.open("a") as f:
            f.write("".join(json.dumps({"i": i, "new": new}) + "\n" for i, new in batch.items()))

    news = generate_greedy(model, prompts, max_new_tokens, tokenizer.eos_token_id, pad, batch_size, log, done, keep)
    rows = [{"id": r["id"], "ids": p + n, "n_prompt": len(p)} for r, p, n in zip(records, prompts, news)]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tmp.rename(path)
    partial.unlink(missing_ok=True)
    return rows


def generated(n_prompt: int, length: int) -> torch.Tensor:
    """[length] bool: the positions of a prompt + answer sequence whose tokens a generation feeds back to
    the model, the generated tokens it decodes: n_prompt <= t < length - 1 (the answer's tokens but its
    last, which is never fed back). The prompt's positions t < n_prompt are what its prefill runs. Every
    skip "on generated tokens" that a teacher-forced measure reports counts these positions."""
    t = torch.arange(length)
    return (t >= n_prompt) & (t < length - 1)


# --- per-token targets ----------------------------------------------------------------------
@dataclass
class TargetSet:
    """Flat per-token tensors over all sequences; sequence i owns rows offsets[i]:offsets[i+1].
    n_prompt (optional, not cached: it comes with the sequences) gives each sequence's prompt length."""

    ids: torch.Tensor  # [N] int64 token ids
    offsets: torch.Tensor  # [n_seq + 1] int64
    start_hidden: torch.Tensor  # [N, H] input of layer `start_layer` (base model, no skipping)
    top_idx: torch.Tensor  # [N, K] int64, the base model's K most likely next tokens
    top_logp: torch.Tensor  # [N, K] their log-probabilities
    rest_logp: torch.Tensor  # [N] log-probability of every other token together
    start_layer: int
    n_prompt: torch.Tensor | None = None  # [n_seq] int64: each sequence's prompt tokens

    def generated_rows(self) -> torch.Tensor:
        """[N] bool: the rows that are generated tokens (`generated`); ValueError without n_prompt."""
        if self.n_prompt is None:
            raise ValueError("TargetSet: no prompt lengths (n_prompt); the generated tokens are unknown")
        if self.n_prompt.numel() != len(self):
            raise ValueError(f"TargetSet: n_prompt has {self.n_prompt.numel()} entries for {len(self)} sequences")
        return torch.cat([generated(int(n), int(L)) for n, L in zip(self.n_prompt.tolist(), self.lengths)])

    @property
    def lengths(self) -> list[int]:
        return (self.offsets[1:] - self.offsets[:-1]).tolist()

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    def rows(self, i: int) -> slice:
        return slice(int(self.offsets[i]), int(self.offsets[i + 1]))

    def save(self, path) -> None:
        from safetensors.torch import save_file

        t = {k: getattr(self, k).contiguous() for k in ("ids", "offsets", "start_hidden", "top_idx", "top_logp",
                                                        "rest_logp")}
        t["start_layer"] = torch.tensor([self.start_layer])
        tmp = Path(str(path) + ".tmp")
        save_file(t, str(tmp))
        tmp.rename(path)

    @classmethod
    def load(cls, path) -> "TargetSet":
        from safetensors.torch import load_file

        t = load_file(str(path))
        return cls(**{k: v for k, v in t.items() if k != "start_layer"}, start_layer=int(t["start_layer"]))


def right_pad(seqs: list[torch.Tensor], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token sequences -> ids [B, S] (right padded with `pad`), valid [B, S] bool."""
    S = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), S), pad, dtype=torch.long)
    valid = torch.zeros(len(seqs), S, dtype=torch.bool)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = s
        valid[b, : len(s)] = True
    return ids, valid


@torch.no_grad()
def base_forward(model: nn.Module, ids: torch.Tensor, capture: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The base model over right-padded ids [B, S], with the training forward's own attention.
    Returns (input of layer `capture` [B, S, H], logits [B, S, V])."""
    inner = model.model
    h = inner.embed_tokens(ids)
    cos, sin = rope_tables(model.model.rotary_emb, ids.shape[1], h.device, h.dtype)
    captured = h
    for i, layer in enumerate(inner.layers):
        if i == capture:
            captured = h
        h = h + attention(layer.self_attn, layer.input_layernorm(h), cos, sin)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return captured, model.lm_head(inner.norm(h))


@torch.no_grad()
def build_targets(model: nn.Module, sequences: list[list[int]], start_layer: int, topk: int,
                  batch_size: int = 8, log=None) -> TargetSet:
    """Run the base model once over every sequence; keep what training needs per token."""
    seqs = [torch.tensor(s, dtype=torch.long) for s in sequences]
    hid, idx, lp, rest = [], [], [], []
    t0 = time.perf_counter()
    for start in range(0, len(seqs), batch_size):
        batch = seqs[start:start + batch_size]
        ids, valid = right_pad(batch)
        h, logits = base_forward(model, ids, start_layer)
        logp = torch.log_softmax(logits[valid].float(), dim=-1)  # [n, V]
        top_logp, top_idx = logp.topk(topk, dim=-1)  # [n, K]
        rest.append(logp.scatter(1, top_idx, float("-inf")).logsumexp(-1))
        hid.append(h[valid])
        idx.append(top_idx)
        lp.append(top_logp)
        if log:
            log(f"targets: {min(start + batch_size, len(seqs))}/{len(seqs)} sequences, "
                f"{time.perf_counter() - t0:.0f} s")
    lengths = torch.tensor([0] + [len(s) for s in seqs])
    return TargetSet(ids=torch.cat(seqs), offsets=lengths.cumsum(0), start_hidden=torch.cat(hid),
                     top_idx=torch.cat(idx), top_logp=torch.cat(lp), rest_logp=torch.cat(rest),
                     start_layer=start_layer)


def cached_targets(model: nn.Module, sequences: list[list[int]], start_layer: int, topk: int, cache_dir: Path,
                   model_tag: str, log=None) -> TargetSet:
    key = _key(model_tag, start_layer, topk, sequences)
    path = Path(cache_dir) / f"targets-{key}.safetensors"
    if path.is_file():
        if log:
            log(f"targets: {path}")
        return TargetSet.load(path)
    ts = build_targets(model, sequences, start_layer, topk, log=log)
    path.parent.mkdir(parents=True, exist_ok=True)
    ts.save(path)
    return ts


# --- batches ---------------------------------------------------------------------------------
class Batcher:
    """Seeded, length-bucketed batches of sequence indices. Epoch e: a permutation from
    (seed, e), cut into pools of 8 batches, each pool sorted by length and cut into batches
    (little padding), then the batches of the epoch shuffled."""

    def __init__(self, lengths: list[int], batch_size: int, seed: int) -> None:
        if batch_size > len(lengths):
            raise ValueError(f"batch_size={batch_size} is larger than the training set ({len(lengths)} sequences)")
        self.lengths, self.batch_size, self.seed = lengths, batch_size, seed
        self.per_epoch = len(lengths) // batch_size  # the remainder of each epoch is dropped
        self._cache: tuple[int, list[list[int]]] | None = None

    def epoch(self, e: int) -> list[list[int]]:
        if self._cache and self._cache[0] == e:
            return self._cache[1]
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + e)
        perm = torch.randperm(len(self.lengths), generator=g).tolist()[: self.per_epoch * self.batch_size]
        pool = 8 * self.batch_size
        batches = []
        for p in range(0, len(perm), pool):
            chunk = sorted(perm[p:p + pool], key=lambda i: (self.lengths[i], i))
            batches += [chunk[b:b + self.batch_size] for b in range(0, len(chunk), self.batch_size)]
        order = torch.randperm(len(batches), generator=g).tolist()
        batches = [batches[i] for i in order]
        self._cache = (e, batches)
        return batches

    def batch(self, step: int) -> list[int]:
        return self.epoch(step // self.per_epoch)[step % self.per_epoch]


def model_tag(model_dir) -> str:
    """A cache key for a model directory: its name and a hash of its config.json and weight sizes."""
    p = Path(model_dir)
    sizes = sorted((f.name, f.stat().st_size) for f in p.glob("*.safetensors"))
    return f"{p.name}:{_key((p / 'config.json').read_text(), sizes)}"
