"""Skip-aware checkpoints: round trip, and every way a directory can be wrong."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import vskipper
from vskipper.models.hf_loader import save_checkpoint

from helpers import assert_equal, greedy, prompts
from tiny import flexidepth_for, tiny_llama, tiny_qwen3, transformed


@pytest.fixture(params=["llama", "qwen3"])
def ckpt(request, tmp_path):
    base = tiny_llama() if request.param == "llama" else tiny_qwen3()
    sk = flexidepth_for(base, [1, 3, 4], gate="soft" if request.param == "llama" else "hard")
    path = tmp_path / "ckpt"
    saved = save_checkpoint(path, base, sk, model_type="dd" + request.param,
                            auto_map={"AutoConfig": "configuration_dd.DDConfig"})
    config = json.loads((saved / "config.json").read_text())
    config.pop("gate_mode")  # the architecture's default gate must apply
    (path / "config.json").write_text(json.dumps(config))
    return path, base, sk


def test_round_trip(ckpt):
    path, base, sk = ckpt
    m = vskipper.from_pretrained(path, vskipper.Config(execution="routed"))
    assert m.vskipper.skipper.gate == sk.gate and m.vskipper.skipper.layers == sk.layers
    expected = transformed(base, sk, "routed")
    p = prompts((7,))[0][None]
    assert_equal(greedy(m, p), greedy(expected, p), "tokens after a checkpoint round trip")
    st = vskipper.stats(m)
    assert all(s["tokens"] == 7 + 23 for s in st.values())
    loaded = vskipper.FlexiDepth.from_pretrained(path)
    for k, v in sk.flexidepth_state_dict().items():
        assert_equal(loaded.flexidepth_state_dict()[k], v, k)


def _edit_tensors(path, fn):
    t = load_file(str(path / "model.safetensors"))
    fn(t)
    save_file(t, str(path / "model.safetensors"))


def test_missing_router_tensor(ckpt):
    path, _, _ = ckpt
    _edit_tensors(path, lambda t: t.pop("model.layers.3.router.router_dec.weight"))
    with pytest.raises(ValueError, match=r"missing skipper tensor 'model.layers.3.router.router_dec.weight' "
                                         r"\(expected shape \[\d+, \d+\]\)"):
        vskipper.from_pretrained(path)


def test_missing_adapter_tensor(ckpt):
    path, _, _ = ckpt
    _edit_tensors(path, lambda t: t.pop("model.layers.4.router_proj.up_proj.weight"))
    with pytest.raises(ValueError, match="missing skipper tensor 'model.layers.4.router_proj.up_proj.weight'"):
        vskipper.FlexiDepth.from_pretrained(path)


def test_wrong_shape(ckpt):
    path, _, _ = ckpt

    def bad(t):
        t["model.layers.1.router.router_head.weight"] = torch.zeros(2, 7)
    _edit_tensors(path, bad)
    with pytest.raises(ValueError,
                       match=r"'model.layers.1.router.router_head.weight' has shape \[2, 7\], expected \[1, \d+\]"):
        vskipper.from_pretrained(path)


def test_wrong_dtype(ckpt):
    path, _, _ = ckpt

    def bad(t):
        k = "model.layers.1.router.router_norm.weight"
        t[k] = torch.ones(t[k].shape, dtype=torch.int32)
    _edit_tensors(path, bad)
    with pytest.raises(ValueError, match="router_norm.weight' has dtype torch.int32, expected a floating-point dtype"):
        vskipper.from_pretrained(path)


def test_missing_base_tensor(ckpt):
    path, _, _ = ckpt
    _edit_tensors(path, lambda t: t.pop("model.layers.2.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match="missing base tensor 'model.layers.2.mlp.up_proj.weight'"):
        vskipper.from_pretrained(path)


def test_pickled_weights_are_refused(ckpt):
    path, _, _ = ckpt
    (path / "model.safetensors").unlink()
    torch.save({"x": torch.zeros(1)}, path / "pytorch_model.bin")
    with pytest.raises(ValueError,
                       match=r"holds only pickled weights \['pytorch_model.bin'\]; vskipper loads safetensors only"):
        vskipper.from_pretrained(path)


def test_missing_and_empty_directory(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        vskipper.from_pretrained(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="is empty; expected config.json and"):
        vskipper.from_pretrained(tmp_path / "empty")


@pytest.mark.parametrize("text, msg", [
    ("{not json", "is not valid JSON"),
    ("[1, 2]", "must hold a JSON object"),
])
def test_malformed_config(ckpt, text, msg):
    path, _, _ = ckpt
    (path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=msg):
        vskipper.from_pretrained(path)


@pytest.mark.parametrize("edit, msg", [
    ({"routing_layers": [1, 99]}, r"routing_layers \[99\] are out of range for num_hidden_layers=6"),
    ({"routing_layers": [1, 3, 3]}, r"routing_layers \[3\] appear more than once"),
    ({"routing_layers": []}, "must be a non-empty list"),
    ({"architectures": ["LlamaForCausalLM"]}, "expected \\[\"DDLlamaForCausalLM\"\\]"),
    ({"gate_mode": "maybe"}, "gate_mode='maybe' must be 'soft' or 'hard'"),
    ({"hidden_size": -3}, "hidden_size.*must be a positive integer"),
    ({"expected_run_fraction": 1.5}, r"expected_run_fraction=1.5 must be a number in \[0, 1\]"),
])
def test_bad_config_fields(ckpt, edit, msg):
    path, _, _ = ckpt
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(edit)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=msg):
        vskipper.from_pretrained(path)


def test_expected_run_fraction_is_read_and_written(ckpt, tmp_path):
    path, base, _ = ckpt
    cfg = json.loads((path / "config.json").read_text())
    assert "expected_run_fraction" not in cfg
    assert vskipper.FlexiDepth.from_pretrained(path).expected_run_fraction is None
    cfg["expected_run_fraction"] = 0.7
    (path / "config.json").write_text(json.dumps(cfg))
    sk = vskipper.FlexiDepth.from_pretrained(path)
    assert sk.expected_run_fraction == 0.7
    again = json.loads((save_checkpoint(tmp_path / "again", base, sk) / "config.json").read_text())
    assert again["expected_run_fraction"] == 0.7
