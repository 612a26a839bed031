"""Checkpoint reading: config.json and safetensors only, with errors that name what is wrong.

Pickled weights (.bin, .pt, .pth, .ckpt) are never loaded; remote code is never run.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch

# architectures[0] of a skip-aware checkpoint -> (family name, default gate)
DD_ARCHITECTURES = {"DDLlamaForCausalLM": ("llama", "soft"), "DDQwen3ForCausalLM": ("qwen3", "hard")}
# checkpoints that carry their own skipper: FlexiDepth's layout, and SkipGPT's (vskipper/skippers/skipgpt.py)
SKIPPER_ARCHITECTURES = (*DD_ARCHITECTURES, "SkipGPTLlamaForCausalLM")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class CheckpointError(ValueError):
    """A checkpoint directory that vskipper cannot load; the message says what and where."""


def _dir(path) -> Path:
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint directory {str(p)!r} does not exist")
    if not p.is_dir():
        raise CheckpointError(f"checkpoint path {str(p)!r} is not a directory")
    if not any(p.iterdir()):
        raise CheckpointError(f"checkpoint directory {str(p)!r} is empty; expected config.json and *.safetensors")
    return p


def read_config(path) -> dict:
    p = _dir(path) / "config.json"
    if not p.is_file():
        raise CheckpointError(f"{str(p.parent)!r} has no config.json")
    try:
        cfg = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{str(p)!r} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{str(p)!r} must hold a JSON object, got {type(cfg).__name__}")
    return cfg


def _int_field(cfg: dict, key: str, where: str, default=None) -> int:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise CheckpointError(f"{where}: config.json field {key!r}={v!r} must be a positive integer")
    return v


def skipper_fields(cfg: dict, path) -> dict:
    """The skipper-related fields of a skip-aware config.json, validated."""
    where = str(path)
    archs = cfg.get("architectures")
    if not isinstance(archs, list) or not archs or archs[0] not in DD_ARCHITECTURES:
        raise CheckpointError(
            f"{where}: config.json architectures={archs!r}; expected [\"DDLlamaForCausalLM\"] or "
            f"[\"DDQwen3ForCausalLM\"] for a skip-aware checkpoint"
        )
    family, default_gate = DD_ARCHITECTURES[archs[0]]
    n_layers = _int_field(cfg, "num_hidden_layers", where)
    layers = cfg.get("routing_layers")
    if not isinstance(layers, list) or not layers or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in layers
    ):
        raise CheckpointError(f"{where}: config.json routing_layers={layers!r} must be a non-empty list of layer "
                              f"indices")
    bad = [i for i in layers if not 0 <= i < n_layers]
    if bad:
        raise CheckpointError(
            f"{where}: config.json routing_layers {bad} are out of range for num_hidden_layers={n_layers}"
        )
    dup = sorted({i for i in layers if layers.count(i) > 1})
    if dup:
        raise CheckpointError(f"{where}: config.json routing_layers {dup} appear more than once")
    gate = cfg.get("gate_mode", default_gate)
    if gate not in ("soft", "hard"):
        raise CheckpointError(f"{where}: config.json gate_mode={gate!r} must be 'soft' or 'hard'")
    expected = cfg.get("expected_run_fraction")
    if expected is not None and (isinstance(expected, bool) or not isinstance(expected, (int, float))
                                 or not 0 <= expected <= 1):
        raise CheckpointError(f"{where}: config.json expected_run_fraction={expected!r} must be a number in [0, 1]")
    threshold = cfg.get("router_threshold")  # a FlexiDepth router's threshold for this skipper (absent: 0.5)
    if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))
                                  or not 0 <= threshold <= 1):
        raise CheckpointError(f"{where}: config.json router_threshold={threshold!r} must be a number in [0, 1] "
                              f"(a token RUNs a layer when its gate is above it)")
    eps = cfg.get("rms_norm_eps", 1e-6)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps <= 0:
        raise CheckpointError(f"{where}: config.json rms_norm_eps={eps!r} must be a positive number")
    return {
        "family": family,
        "architecture": archs[0],
        "num_hidden_layers": n_layers,
        "routing_layers": sorted(layers),
        "gate_mode": gate,
        "hidden_size": _int_field(cfg, "hidden_size", where),
        "intermediate_size": _int_field(cfg, "intermediate_size", where),
        "rms_norm_eps": float(eps),
        "router_reduction_factor": _int_field(cfg, "router_reduction_factor", where, 16),
        "proj_reduction_factor": _int_field(cfg, "proj_reduction_factor", where, 16),
        "expected_run_fraction": None if expected is None else float(expected),
        "threshold": None if threshold is None else float(threshold),
    }


def safetensors_files(path) -> list[Path]:
    p = _dir(path)
    files = sorted(p.glob("*.safetensors"))
    if files:
        return files
    pickled = sorted(f.name for f in p.iterdir() if f.suffix in PICKLE_SUFFIXES)
    if pickled:
        raise CheckpointError(
            f"{str(p)!r} holds only pickled weights {pickled}; vskipper loads safetensors only and never "
            f"unpickles. Convert them first (safetensors.torch.save_file)."
        )
    raise CheckpointError(f"{str(p)!r} holds no *.safetensors weights")


def load_tensors(path, keys: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """Tensors from every *.safetensors file in `path`: all of them, or only `keys` (absent
    keys are simply not returned; the caller names what it misses)."""
    from safetensors import SafetensorError, safe_open

    wanted = None if keys is None else set(keys)
    out: dict[str, torch.Tensor] = {}
    for f in safetensors_files(path):
        try:
            with safe_open(str(f), framework="pt") as st:
                for k in st.keys():
                    if wanted is None or k in wanted:
                        out[k] = st.get_tensor(k)
        except SafetensorError as e:
            raise CheckpointError(f"{str(f)!r} is not a readable safetensors file: {e}") from None
    return out


def save_tensors(tensors: dict[str, torch.Tensor], path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path))
