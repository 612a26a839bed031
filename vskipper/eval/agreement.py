"""Agreement with the base model on held-out chat prompts.

    PROMPT_SETS       the held-out prompt sets: "everyday" (60 hand-written prompts, never templated,
                      never trained on), "chat" (the held-out split of the templated chat set: ids
                      whose number % 5 == 0, vskipper/training/data.py split_prompts) and "prompts"
                      (the held-out split of the word-problem set, 80 prompts: benchmarks/quality_hf.py's)
    heldout_prompts   their records, in order
    teacher_forced    top-1 agreement and KL(base || model) over the base's greedy answer tokens,
                      in-process with transformers, per prompt
    load_teacher_forced  the base and skip-aware models for a skipper spec or a checkpoint directory

The greedy agreement between two servers is vskipper.eval.scoring.agreement over the answers of
vskipper.eval.server.greedy.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from torch import nn

PROMPT_SETS = ("everyday", "chat", "prompts")


def heldout_prompts(sets: list[str], limit: int | None = None) -> list[dict]:
    """Records of the held-out prompts of `sets` (at most `limit` per set)."""
    from vskipper.data import load
    from vskipper.training.data import split_prompts

    out = []
    for name in sets:
        if name not in PROMPT_SETS:
            raise ValueError(f"no held-out prompt set {name!r}; expected {', '.join(PROMPT_SETS)}")
        recs = load("everyday") if name == "everyday" else split_prompts(load(name))[1]
        out += recs[:limit] if limit else recs
    return out


class PositionRoutes:
    """The route decisions of a transformed model's forwards over one sequence, per position, read from
    the inputs of its route counters (a forward pre-hook each; no skipper: nothing recorded). `split(n,
    length)` -> {"prompt": (skipped, decisions), "generated": (...)}: positions t < n, and the generated
    ones (vskipper.training.data.generated); a sublayer skipper's decisions are two per token."""

    def __init__(self, model) -> None:
        self.runs: list[torch.Tensor] = []
        counters = getattr(getattr(model, "vskipper", None), "counters", None)
        self.hooks = [c.register_forward_pre_hook(self._hook) for c in (counters or {}).values()]

    def _hook(self, module, args) -> None:
        run, valid = args[0], args[1]  # run [1, S] (a sublayer skipper's [1, S, 2]), valid [1, S]
        if valid.shape[0] != 1 or not valid.all():
            raise ValueError("PositionRoutes: one unpadded sequence per forward")
        self.runs.append(run.reshape(valid.shape[1], -1))  # [S, decisions per token]

    def split(self, n: int, length: int) -> dict[str, tuple[int, int]]:
        from vskipper.training.data import generated

        masks = {"prompt": torch.arange(length) < n, "generated": generated(n, length)}
        out = {}
        for name, m in masks.items():
            rows = [r[m] for r in self.runs]
            out[name] = (sum(int((~r).sum()) for r in rows), sum(r.numel() for r in rows))
        self.runs = []
        return out

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()


@torch.no_grad()
def teacher_forced(base: nn.Module, model: nn.Module, seqs: list[list[int]], n_prompt: list[int]) -> dict:
    """Teacher-forced agreement of `model` with `base` over the answer part of each sequence
    (sequence i: prompt tokens seqs[i][:n_prompt[i]], then the base's greedy answer), one sequence
    at a time (no padding). Per prompt, over its answer positions:

        top1   share of positions where the model's most likely next token is the base's (on the
               base's greedy answer: the answer's next token)
        kl     mean KL(base || model) per position, full vocabulary, nats

    Returns {"top1": [...], "kl": [...], "positions": [...]} per prompt (prompts without answer
    tokens left out), their means over prompts with standard errors (top1_mean, top1_stderr,
    kl_mean, kl_stderr), and the model's PROJECT share of routed-layer work on these sequences (None for
    a model without a skipper): "skip" over every position, "skip_prompt" over the prompts' positions,
    "skip_generated" over the generated ones (the answer's tokens a generation feeds back,
    vskipper.training.data.generated: what its decode would route)."""
    from vskipper.eval.scoring import mean_stderr

    top1, kl, positions = [], [], []
    counts = {"all": [0, 0], "prompt": [0, 0], "generated": [0, 0]}
    routes = PositionRoutes(model)
    try:
        for seq, n in zip(seqs, n_prompt):
            if len(seq) <= n:
                continue
            ids = torch.tensor([seq], dtype=torch.long)
            p = torch.log_softmax(base(ids).logits[0, n - 1: len(seq) - 1].float(), -1)
            q = torch.log_softmax(model(ids).logits[0, n - 1: len(seq) - 1].float(), -1)
            counts["all"][0] += sum(int((~r).sum()) for r in routes.runs)
            counts["all"][1] += sum(r.numel() for r in routes.runs)
            for name, (k, d) in routes.split(n, len(seq)).items():
                counts[name][0] += k
                counts[name][1] += d
            top1.append(float((q.argmax(-1) == p.argmax(-1)).float().mean()))
            kl.append(float((p.exp() * (p - q)).sum(-1).mean()))
            positions.append(len(seq) - n)
    finally:
        routes.remove()
    t_mean, t_se = mean_stderr(top1)
    k_mean, k_se = mean_stderr(kl)
    skip = {f"skip{'' if name == 'all' else '_' + name}": k / d if d else None for name, (k, d) in counts.items()}
    return {"n": len(top1), "top1_mean": t_mean, "top1_stderr": t_se, "kl_mean": k_mean, "kl_stderr": k_se,
            **skip, "top1": top1, "kl": kl, "positions": positions}


def is_checkpoint(path) -> bool:
    """A skip-aware checkpoint directory (config.json naming an architecture with its own skipper)."""
    from vskipper.models.checkpoint import SKIPPER_ARCHITECTURES

    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return False
    try:
        arch = (json.loads(cfg.read_text()).get("architectures") or [None])[0]
    except (ValueError, AttributeError):
        return False
    return arch in SKIPPER_ARCHITECTURES


def check_teacher_forced(what: str):
    """Validate --teacher-forced before anything slow: returns ("checkpoint", path) or ("spec", skipper)."""
    from vskipper.skippers.spec import parse_skipper

    p = Path(what)
    if p.is_dir():
        if is_checkpoint(p):
            return "checkpoint", p
        if (p / "skipper.safetensors").is_file():
            return "spec", parse_skipper(f"flexidepth:path={p}")
        raise ValueError(f"--teacher-forced {what}: a directory, but neither a skip-aware checkpoint "
                         f"(config.json with a DD architecture) nor a skipper directory (skipper.safetensors)")
    try:
        return "spec", parse_skipper(what)
    except (KeyError, ValueError) as e:
        raise ValueError(f"--teacher-forced: no directory {what!r}, and as a skipper spec: {e} (e.g. "
                         f"flexidepth:name=smollm2-135m-flexidepth or random:rate=0.3,layers=15-29)") from None


def load_teacher_forced(kind: str, what, base_dir) -> tuple[nn.Module, nn.Module]:
    """(base, skip-aware model) in float32 for `check_teacher_forced`'s result: a checkpoint gives
    both (its base weights, and vskipper.from_pretrained); a skipper is applied to a copy of the
    transformers model in `base_dir`."""
    import vskipper

    if kind == "checkpoint":
        from vskipper.models.checkpoint import load_tensors, read_config, skipper_fields
        from vskipper.models.hf_loader import build_base_model

        cfg = read_config(what)
        base = build_base_model(cfg, skipper_fields(cfg, what)["family"], load_tensors(what), what, torch.float32)
        return base, vskipper.from_pretrained(what)
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()
    return base, vskipper.transform(copy.deepcopy(base), what)
