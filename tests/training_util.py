"""What the training tests share (tests/test_training.py, tests/test_training_skipgpt.py): the routed
layers of the tiny model, its training sequences, its base model and targets, a short trainer."""
from __future__ import annotations

import torch

from vskipper.training import TrainConfig, Trainer, make_skipper, warm_start
from vskipper.training.data import build_targets

from tiny import VOCAB, tiny_llama

LAYERS = (2, 3, 4, 5)


def sequences(n=12, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (int(torch.randint(6, 20, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def tiny_base():
    return tiny_llama(seed=0, layers=6)


def targets(base):
    return build_targets(base, sequences(), start_layer=min(LAYERS), topk=16)


def trainer(base, data, init="warm", **kw):
    cfg = TrainConfig(**{"layers": LAYERS, "steps": 12, "batch_size": 4, "lr": 3e-3, "warmup": 2, "log_every": 100,
                         "init": init, **kw})
    torch.manual_seed(cfg.seed)
    sk = make_skipper(base.config, cfg)
    if init == "warm":
        warm_start(sk, base, data, cfg.seed)
    return Trainer(base, sk, data, cfg)
