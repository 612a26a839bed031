"""Training FlexiDepth-style skippers, or SkipGPT's sublayer routers, on CPU: self-distillation from the
base model, a straight-through hard route decision, the FlexiDepth skip penalty (docs/training.md).

    vskipper train --out /tmp/run --layers 15-29 --penalty 0.1      # the CLI
    from vskipper.training.shipped import build_checkpoint           # the shipped skipper
"""
from vskipper.training.config import TrainConfig
from vskipper.training.forward import SkipOutput, greedy, logits_of, skip_forward, sublayer_work
from vskipper.training.loop import Trainer, make_skipper, warm_start
from vskipper.training.shipped import (
    build_checkpoint,
    load_skipper,
    shipped_dir,
    write_skipgpt_checkpoint,
    write_skipper_dir,
)

__all__ = [
    "TrainConfig",
    "Trainer",
    "make_skipper",
    "warm_start",
    "skip_forward",
    "logits_of",
    "greedy",
    "SkipOutput",
    "sublayer_work",
    "build_checkpoint",
    "load_skipper",
    "shipped_dir",
    "write_skipper_dir",
    "write_skipgpt_checkpoint",
]
