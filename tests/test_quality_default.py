"""The shipped skipper's default threshold: a skipper directory carries the threshold it loads with
(config.json router_threshold), every loader reads it, a spec's threshold= still overrides it."""
from __future__ import annotations

import json

import pytest
import torch

import vskipper
from vskipper.models.checkpoint import CheckpointError
from vskipper.training import make_skipper, write_skipper_dir

from training_util import LAYERS, tiny_base


def test_a_skipper_directory_carries_its_threshold_to_every_loader(tmp_path):
    from vskipper.training import TrainConfig
    from vskipper.training.shipped import build_checkpoint, load_skipper

    base = tiny_base()
    torch.manual_seed(0)
    sk = make_skipper(base.config, TrainConfig(layers=LAYERS, gate="hard"))
    plain = write_skipper_dir(tmp_path / "plain", sk, base.config)
    assert "router_threshold" not in json.loads((plain / "config.json").read_text())
    assert load_skipper(plain).threshold == 0.5  # FlexiDepth's
    d = write_skipper_dir(tmp_path / "skipper", sk, base.config, threshold=0.42)
    assert json.loads((d / "config.json").read_text())["router_threshold"] == 0.42
    assert load_skipper(d).threshold == 0.42
    assert vskipper.parse_skipper(f"flexidepth:path={d}").threshold == 0.42
    assert vskipper.parse_skipper(f"flexidepth:path={d},threshold=0.6").threshold == 0.6  # the spec's wins
    base.save_pretrained(tmp_path / "base")
    ckpt = build_checkpoint(tmp_path / "ckpt", skipper=d, base_dir=tmp_path / "base")
    assert vskipper.from_pretrained(ckpt).vskipper.skipper.threshold == 0.42
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "router_threshold": 1.5}))
    with pytest.raises(CheckpointError, match=r"router_threshold=1.5 must be a number in \[0, 1\]"):
        load_skipper(d)
