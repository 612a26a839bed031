"""Skippers shipped in the package (vskipper/data/skippers/<name>/: config.json and
skipper.safetensors), found by name. How one is trained and built: vskipper/training/shipped.py."""
from __future__ import annotations

from pathlib import Path

SKIPPERS = Path(__file__).resolve().parent.parent / "data" / "skippers"
DEFAULT = "smollm2-135m-flexidepth"  # trained for SmolLM2-135M-Instruct, routed layers 15..29
SKIPPER_FILE = "skipper.safetensors"


def shipped_dir(name: str = DEFAULT) -> Path:
    """The directory of a skipper shipped in the package (ValueError listing those that exist)."""
    p = SKIPPERS / name
    if not (p / SKIPPER_FILE).is_file():
        have = sorted(d.name for d in SKIPPERS.iterdir() if (d / SKIPPER_FILE).is_file()) if SKIPPERS.is_dir() else []
        raise ValueError(f"no shipped skipper {name!r}; shipped: {have}")
    return p
