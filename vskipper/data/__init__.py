"""Prompt sets shipped with vskipper (made by make_prompts.py and make_chat.py):

    prompts      word problems and short reasoning questions (serving benchmarks, training)
    arithmetic   500 questions with integer answers (the arithmetic evaluation task)
    chat         everyday requests, short facts, arithmetic (training; ids % 5 == 0 held out)
    everyday     hand-written everyday chat prompts, never trained on (greedy agreement)
    facts_mc     multiple-choice short facts (the loglikelihood evaluation task)"""
from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).parent


def load(name: str) -> list[dict]:
    """Records of the shipped set `name` (<name>.jsonl here)."""
    path = HERE / f"{name}.jsonl"
    if not path.is_file():
        names = ", ".join(sorted(p.stem for p in HERE.glob("*.jsonl")))
        raise ValueError(f"no shipped prompt set {name!r}; expected one of {names}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
