"""Per-GPU kernel configs, strictly keyed (the FlashInfer way).

A tuned table is a JSON file named after the GPU (`nvidia_h200.json` for "NVIDIA H200": H100 and
H200 are both sm90, so the key is the name, not the capability), stamped (vskipper/cache.py) with
the GPU name and the torch, triton and vskipper versions it was measured with:

    {"meta": {"device": "NVIDIA H200", "torch": "2.11.0+cu130", "triton": "3.6.0", "vskipper": "0.1.0"},
     "configs": {"grouped_swiglu_": {"16": {"gate_up": {...}, "down": {...}}, ...}, ...}}

Keys under an op are token-count buckets (the next power of two); a bucket not tuned takes the tuned
bucket half its size if there is one, else the defaults (a config tuned at a quarter of the rows can
run slower than the defaults: grouped_swiglu_ at T=1024 in docs/results/gpu-kernels*.md). Tables are
looked up in the cache (`<vskipper cache>/kernel_configs`, written by
`benchmarks/gpu/kernel_timings.py --tune`), then in this package. A table whose stamp does not match
this GPU and these versions is ignored with a warning, never trusted. Without a table, or where the
model's plan says untuned (Config(tuned_kernels=False), VSKIPPER_AUTOTUNE=0 in SGLang), every op
uses the untuned defaults written in its own file (`vskipper/triton_kernels/<op>.py`,
`default_config`). Nothing here reads the environment.
"""
from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path

import torch

from vskipper import cache

PACKAGE_DIR = Path(__file__).resolve().parent


def bucket(tokens: int) -> int:
    """Token counts are bucketed to the next power of two (at least 1)."""
    return 1 << max(0, int(tokens) - 1).bit_length()


def search_dirs() -> list[Path]:
    return [cache.root() / "kernel_configs", PACKAGE_DIR]


@functools.lru_cache(maxsize=None)
def tuned_table(gpu: str, dirs: tuple[Path, ...] | None = None) -> dict[str, dict[str, dict]]:
    """{op: {bucket: config}} of the first table for `gpu` whose stamp matches; {} if none does."""
    want = cache.stamp(gpu)
    for d in dirs if dirs is not None else search_dirs():
        path = Path(d) / f"{cache.slug(gpu)}.json"
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text())
            meta, configs = dict(data["meta"]), data["configs"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            cache.warn_ignored("unreadable kernel-config table", path, str(e))
            continue
        why = cache.mismatch(meta, want)
        if why:
            cache.warn_ignored("kernel-config table", path, f"tuned with {why}")
            continue
        return configs
    return {}


@functools.lru_cache(maxsize=None)
def _gpu_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def lookup(op: str, tokens: int, device: torch.device, default: Callable[[int], dict], tuned: bool = True) -> dict:
    """The launch config of `op` for `tokens` rows on `device`: where `tuned`, the tuned one if a
    trusted table has it (the bucket itself, else the bucket half its size); else `default(bucket)`."""
    b = bucket(tokens)
    cfg = default(b)
    if device.type != "cuda" or not tuned:
        return cfg
    index = device.index if device.index is not None else torch.cuda.current_device()
    return pick(tuned_table(_gpu_name(index)).get(op, {}), b, cfg)


def pick(op_table: dict[str, dict], b: int, default: dict) -> dict:
    """The tuned entry for bucket `b` (else for bucket b / 2) over `default`; a config tuned at a
    quarter of the rows or fewer is not trusted to carry over."""
    for k in (str(b), str(b // 2)):
        if k in op_table:
            return {**default, **op_table[k]}
    return default


def save(configs: dict[str, dict[str, dict]], gpu: str, directory: Path | str) -> Path:
    """Write a stamped table for `gpu` (used by benchmarks/gpu/kernel_timings.py --tune)."""
    path = Path(directory) / f"{cache.slug(gpu)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": cache.stamp(gpu), "configs": configs}, indent=1, sort_keys=True) + "\n")
    tuned_table.cache_clear()
    return path
