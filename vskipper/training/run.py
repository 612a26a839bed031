"""`vskipper train` end to end: base model -> self-distilled data -> trained skipper -> checkpoint.

Output directory:
    config.json, model.safetensors, tokenizer   a skip-aware checkpoint (save_checkpoint), loadable
                                                by vskipper.from_pretrained and the SGLang plugin
    skipper/                                    the skipper alone (config.json + skipper.safetensors),
                                                what ships in vskipper/data/skippers/
    state/                                      the latest training state, for --resume
    train_log.jsonl                             one record per step
With family "skipgpt": config.json + model.safetensors in SkipGPT's layout (shipped.write_skipgpt_checkpoint,
loadable by vskipper.from_pretrained) + tokenizer, state/ and train_log.jsonl; no skipper/ directory.
"""
from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import torch

from vskipper.training.config import TrainConfig
from vskipper.training.loop import Trainer, make_skipper, warm_start


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def evenly_spaced(items: list, n: int) -> list:
    """n of the items at evenly spaced positions (the first included): each kind keeps its share."""
    return [items[i * len(items) // n] for i in range(n)]


def train(cfg: TrainConfig, out_dir, model_dir=None, resume: bool = False, max_new_tokens: int = 128,
          full_checkpoint: bool = True, log=_log) -> Trainer:
    """Train a skipper of cfg.family for the model in `model_dir` (default: the bundled
    SmolLM2-135M-Instruct) on the training split of the shipped prompts, and write `out_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vskipper.cache import root as cache_root
    from vskipper.data import load
    from vskipper.models.smollm2 import smollm2_dir
    from vskipper.training.data import cached_targets, model_tag, self_distillation, split_prompts
    from vskipper.training.shipped import TOKENIZER_FILES, write_skipgpt_checkpoint, write_skipper_dir

    out = Path(out_dir)
    if cfg.family == "skipgpt" and not full_checkpoint:
        raise ValueError("--no-full-checkpoint: a skipgpt run writes only its full checkpoint (SkipGPT's layout "
                         "holds the base weights beside the routers); drop the flag")
    if resume and not (out / "state").is_dir():
        raise ValueError(f"--resume: {str(out)!r} has no saved training state (expected {out / 'state'})")
    if not resume and (out / "state").is_dir():
        raise ValueError(f"{str(out)!r} already holds a training run; pass --resume to continue it, "
                         f"or choose another --out")
    model_dir = Path(model_dir) if model_dir is not None else smollm2_dir()
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    skipper = make_skipper(model.config, cfg)  # ValueError for a layer the model does not have
    train_set, heldout = [], []
    for name in cfg.data:
        t, h = split_prompts(load(name))
        train_set, heldout = train_set + t, heldout + h
    log(f"prompts ({', '.join(cfg.data)}): {len(train_set)} for training, {len(heldout)} held out "
        f"(ids with number % 5 == 0)")
    if cfg.max_prompts is not None and cfg.max_prompts < len(train_set):
        train_set = evenly_spaced(train_set, cfg.max_prompts)
        log(f"prompts: {len(train_set)} of them, evenly spaced (--max-prompts)")
    cache = cache_root() / "training"
    tag = model_tag(model_dir)
    rows = self_distillation(model, tok, train_set, max_new_tokens, cache, tag, log=log)
    data = cached_targets(model, [r["ids"] for r in rows], min(cfg.layers), cfg.topk, cache, tag, log=log)
    data.n_prompt = torch.tensor([r["n_prompt"] for r in rows])  # which tokens are the prompt's, which generated
    log(f"data: {len(data)} sequences, {data.ids.numel()} tokens "
        f"({sum(len(r['ids']) - r['n_prompt'] for r in rows)} generated)")
    if cfg.init == "warm":
        share = warm_start(skipper, model, data, cfg.seed, logit=cfg.init_logit)
        what = "(token, sublayer) pairs" if skipper.sublayers else "tokens"
        log(f"warm start: {100 * sum(share.values()) / len(share):.1f}% of {what} start at RUN")
    trainer = Trainer(model, skipper, data, cfg)
    if resume:
        trainer.load_state(out / "state")
        log(f"resumed at step {trainer.step}")
    out.mkdir(parents=True, exist_ok=True)
    step_log = out / "train_log.jsonl"
    written = {"n": len(trainer.history)}

    def save(t: Trainer) -> None:
        t.save_state(out / "state")
        with step_log.open("a") as f:
            for rec in t.history[written["n"]:]:
                f.write(json.dumps(rec) + "\n")
        written["n"] = len(t.history)

    t0 = time.perf_counter()
    trainer.run(log=log, on_save=save)
    if not trainer.history or trainer.step != cfg.steps:
        save(trainer)
    log(f"trained to step {trainer.step} in {time.perf_counter() - t0:.0f} s")
    last = trainer.history[-min(len(trainer.history), 20):]
    summary = {
        "steps": trainer.step,
        "final_loss": sum(h["loss"] for h in last) / max(1, len(last)),
        f"final_{cfg.loss}": sum(h["main"] for h in last) / max(1, len(last)),
        "final_train_skip_ratio": sum(h["skip"] for h in last) / max(1, len(last)),
        **{f"final_train_skip_{kind}": _share(last, kind) for kind in ("prompt", "generated")},
        "train_tokens": data.ids.numel(),
        "train_sequences": len(data),
        "base_model": model_dir.name,
    }
    if skipper.sublayers:  # final_train_skip_ratio is the share of skipped sublayer work
        from vskipper.training.forward import sublayer_work

        summary["sublayer_work"] = dict(zip(("attention", "mlp"), sublayer_work(model.config)))
        for k in ("skip_attention", "skip_mlp"):
            summary[f"final_train_{k}"] = sum(h[k] for h in last) / max(1, len(last))
        write_skipgpt_checkpoint(out, model, skipper, vskipper_training={**cfg.to_dict(), **summary})
        for name in TOKENIZER_FILES:
            if (model_dir / name).is_file():
                shutil.copy2(model_dir / name, out / name)
        log(f"wrote {out} (a SkipGPT checkpoint)")
        return trainer
    write_skipper_dir(out / "skipper", skipper, model.config, vskipper_training={**cfg.to_dict(), **summary})
    if full_checkpoint:
        from vskipper.models.hf_loader import save_checkpoint

        save_checkpoint(out, model, skipper)
        for name in TOKENIZER_FILES:
            if (model_dir / name).is_file():
                shutil.copy2(model_dir / name, out / name)
    log(f"wrote {out} (skipper alone in {out / 'skipper'})")
    return trainer


def _share(history: list[dict], kind: str) -> float | None:
    """The skip of `kind` tokens ("prompt", "generated") over these steps, token-weighted."""
    n = sum(h.get(f"tokens_{kind}") or 0 for h in history)
    return sum(h[f"skip_{kind}"] * h[f"tokens_{kind}"] for h in history if h.get(f"tokens_{kind}")) / n if n else None


def export_state(out_dir, dest=None, model_dir=None) -> Path:
    """Write the skipper of the latest saved training state in `out_dir` (a run in progress or
    stopped) as a skipper directory (default: out_dir/skipper-step<N>)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from vskipper.models.smollm2 import smollm2_dir
    from vskipper.training.loop import STATE_JSON, STATE_TENSORS
    from vskipper.training.shipped import write_skipper_dir

    out = Path(out_dir)
    meta = json.loads((out / "state" / STATE_JSON).read_text())
    cfg = TrainConfig.from_dict(meta["config"])
    if cfg.family != "flexidepth":
        raise ValueError(f"export_state: {str(out)!r} is a {cfg.family} run; only FlexiDepth runs export a skipper "
                         f"directory (a skipgpt run writes its checkpoint when it ends)")
    model_config = AutoConfig.from_pretrained(str(Path(model_dir) if model_dir else smollm2_dir()))
    skipper = make_skipper(model_config, cfg)
    tensors = load_file(str(out / "state" / STATE_TENSORS))
    with torch.no_grad():
        for name, p in skipper.named_parameters():
            p.copy_(tensors[f"skipper.{name}"])
    dest = Path(dest) if dest else out / f"skipper-step{meta['step']}"
    return write_skipper_dir(dest, skipper, model_config,
                             vskipper_training={**cfg.to_dict(), "steps_done": meta["step"]})
