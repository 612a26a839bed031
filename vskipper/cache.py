"""The one stamped cache: where vskipper keeps what it measured or converted on this machine, and
the stamp that says whether a cached table can be trusted here (the FlashInfer way).

Root: $VSKIPPER_CACHE, else ~/.cache/vskipper. Below it: `cost/` (calibrations, vskipper/cost.py),
`kernel_configs/` (tuned Triton launch configs, vskipper/kernel_configs), the converted bundled
model and built checkpoints. A stamp names the device (GPU name, or CPU model and thread count)
and the torch, triton and vskipper versions; a table whose stamp differs from this process's is
ignored with one warning naming the difference, never trusted.
"""
from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

import torch

from vskipper._version import __version__


def root() -> Path:
    return Path(os.environ.get("VSKIPPER_CACHE") or Path.home() / ".cache" / "vskipper")


def versions() -> dict[str, str]:
    """The library versions a cached table must have been made with."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    return {"torch": torch.__version__, "triton": triton_version, "vskipper": __version__}


def stamp(device: str, **extra: str) -> dict[str, str]:
    """What a table made here now is stamped with: the device name, the versions, and `extra`
    (e.g. the measuring method's version)."""
    return {"device": device, **versions(), **extra}


def slug(name: str) -> str:
    """A file name for a device name: 'NVIDIA H200' -> 'nvidia_h200'."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def mismatch(have: dict, want: dict) -> str | None:
    """None if `have` (a table's stamp) matches `want`; else what differs, in words."""
    diff = [f"{k} {have.get(k)!r} (now {v!r})" for k, v in want.items() if have.get(k) != v]
    return ", ".join(diff) or None


def warn_ignored(what: str, path: Path, why: str) -> None:
    """The one warning for a cached table that is not trusted."""
    warnings.warn(f"vskipper: ignoring {what} {path}: {why}", stacklevel=3)
