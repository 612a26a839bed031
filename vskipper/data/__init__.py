"""Prompt sets shipped with vskipper (see make_prompts.py)."""
from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).parent


def load(name: str) -> list[dict]:
    """Records of prompts.jsonl ("prompts") or arithmetic.jsonl ("arithmetic")."""
    path = HERE / f"{name}.jsonl"
    if not path.is_file():
        raise ValueError(f"no shipped prompt set {name!r}; expected one of prompts, arithmetic")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
