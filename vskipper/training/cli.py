"""`vskipper train`: its flags and its entry point (vskipper/cli.py only adds the subparser).

--family flexidepth (the default) trains FlexiDepth routers and adapters; --family skipgpt trains SkipGPT's
attention and MLP routers only (SkipGPT's second stage, LoRA over the base, is not done here)."""
from __future__ import annotations

import argparse
import math
import sys

from vskipper.training.config import DATA_SETS, FAMILIES, TARGET_TOKENS, TrainConfig

DEFAULTS = TrainConfig(layers=(0,))


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = DEFAULTS
    p.add_argument("--out", required=True, help="output directory (checkpoint + skipper/ + state/)")
    p.add_argument("--model-path", help="base model directory (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--layers", help="routed layers, e.g. 15-29 (default: the second half of the model's layers)")
    p.add_argument("--data", default=",".join(d.data),
                   help=f"prompt sets to self-distill, comma-separated, from {', '.join(DATA_SETS)} "
                        f"(default %(default)s)")
    p.add_argument("--max-prompts", type=int, help="train on at most this many of those prompts, evenly spaced "
                                                  "over them (every kind keeps its share; default: all)")
    p.add_argument("--family", choices=list(FAMILIES), default=d.family,
                   help="flexidepth (default): one router and adapter per routed layer; skipgpt: SkipGPT's two "
                        "routers per routed layer, attention and MLP skipped separately (routers only, no LoRA)")
    p.add_argument("--gate", choices=["soft", "hard"],
                   help=f"flexidepth's gate (default {d.gate}); skipgpt is hard-gated (a skipped sublayer is the "
                        f"identity)")
    p.add_argument("--loss", choices=["kl", "lm"], default=d.loss)
    p.add_argument("--penalty", default=str(d.penalty), help=f"skip penalty weight (default {d.penalty})")
    p.add_argument("--penalty-warmup", type=int, default=d.penalty_warmup)
    p.add_argument("--target-skip", type=float, help="adapt the penalty weight towards this skip ratio (0..1)")
    p.add_argument("--target-rate", type=float, default=d.target_rate, help="step of that adaptation (log scale)")
    p.add_argument("--target-tokens", choices=list(TARGET_TOKENS), default=d.target_tokens,
                   help="the tokens the penalty and --target-skip count: all (default) or generated (the answer's "
                        "tokens a generation feeds back), the prompt's tokens then their own term (--prompt-penalty)")
    p.add_argument("--prompt-penalty", type=float, default=d.prompt_penalty,
                   help="with --target-tokens generated: the prompt tokens' penalty weight (default 0: the KL alone "
                        "decides them; below 0 it rewards running them); with --prompt-target-skip its starting "
                        "weight")
    p.add_argument("--prompt-target-skip", type=float,
                   help="with --target-tokens generated: adapt the prompt tokens' weight towards this skip ratio")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per step")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--topk", type=int, default=d.topk, help="base log-probs kept per token for the KL")
    p.add_argument("--init", choices=["warm", "random"], default=d.init)
    p.add_argument("--init-logit", type=float, default=d.init_logit, help="warm start: router logit on RUN")
    p.add_argument("--no-straight-through", action="store_true")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--save-every", type=int, default=d.save_every)
    p.add_argument("--log-every", type=int, default=d.log_every)
    p.add_argument("--max-new-tokens", type=int, default=128, help="length of the self-distilled answers")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--resume", action="store_true", help="continue the run saved in --out")
    p.add_argument("--no-full-checkpoint", action="store_true", help="write only skipper/ and state/")


def _config(args: argparse.Namespace, num_layers: int) -> TrainConfig:
    from vskipper.skippers.spec import parse_layers

    try:
        penalty = float(args.penalty)
    except ValueError:
        raise ValueError(f"--penalty={args.penalty!r} is not a number") from None
    if not math.isfinite(penalty) or penalty < 0:
        raise ValueError(f"--penalty={args.penalty!r} must be a finite number >= 0")
    if args.layers is None:
        layers = list(range(num_layers // 2, num_layers))
    else:
        try:
            layers = parse_layers(args.layers, args.layers)
        except ValueError:
            raise ValueError(f"--layers={args.layers!r}: expected indices and inclusive ranges, e.g. 15-29 "
                             f"or 20,22,24-27") from None
    bad = [l for l in layers if not 0 <= l < num_layers]
    if bad:
        raise ValueError(f"--layers: layer(s) {bad} do not exist in a model with {num_layers} layers "
                         f"(valid: 0..{num_layers - 1})")
    data = tuple(d.strip() for d in args.data.split(",") if d.strip())
    bad = [d for d in data if d not in DATA_SETS]
    if bad or not data:
        raise ValueError(f"--data={args.data!r}: expected prompt sets among {', '.join(DATA_SETS)}, comma-separated")
    if args.max_prompts is not None and args.max_prompts < 1:
        raise ValueError(f"--max-prompts={args.max_prompts}: expected a positive number of prompts")
    if args.family == "skipgpt" and args.gate not in (None, "hard"):
        raise ValueError(f"--gate {args.gate}: --family skipgpt is hard-gated (a skipped sublayer is the identity); "
                         f"drop --gate or pass --gate hard")
    if args.family == "skipgpt" and args.no_full_checkpoint:
        raise ValueError("--no-full-checkpoint: --family skipgpt writes only its full checkpoint (SkipGPT's layout "
                         "holds the base weights beside the routers); drop the flag")
    gate = args.gate or ("hard" if args.family == "skipgpt" else DEFAULTS.gate)
    return TrainConfig(layers=tuple(layers), family=args.family, data=data, max_prompts=args.max_prompts, gate=gate,
                       loss=args.loss,
                       penalty=penalty,
                       penalty_warmup=args.penalty_warmup, target_skip=args.target_skip,
                       target_rate=args.target_rate, target_tokens=args.target_tokens,
                       prompt_penalty=args.prompt_penalty, prompt_target_skip=args.prompt_target_skip,
                       init_logit=args.init_logit,
                       straight_through=not args.no_straight_through, init=args.init, topk=args.topk,
                       steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup=args.warmup,
                       seed=args.seed, save_every=args.save_every, log_every=args.log_every)


def main(args: argparse.Namespace) -> None:
    """Validate everything cheap first (flags, layers against the model's config), then train."""
    import json
    from pathlib import Path

    import torch

    from vskipper.models.checkpoint import read_config
    from vskipper.training.run import train

    try:
        if args.model_path is None:
            from vskipper.models.smollm2 import smollm2_dir

            model_dir = smollm2_dir()
        else:
            model_dir = Path(args.model_path)
        n = read_config(model_dir).get("num_hidden_layers")
        if not isinstance(n, int):
            raise ValueError(f"{model_dir}/config.json has no num_hidden_layers")
        cfg = _config(args, n)
        if args.max_new_tokens <= 0:
            raise ValueError(f"--max-new-tokens={args.max_new_tokens} must be a positive integer")
        if args.threads is not None:
            if args.threads <= 0:
                raise ValueError(f"--threads={args.threads} must be a positive integer")
            torch.set_num_threads(args.threads)
        print(f"vskipper train: {json.dumps(cfg.to_dict())}", file=sys.stderr, flush=True)
        train(cfg, args.out, model_dir=model_dir, resume=args.resume, max_new_tokens=args.max_new_tokens,
              full_checkpoint=not args.no_full_checkpoint)
    except ValueError as e:
        print(f"vskipper train: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
