"""Scoring hooks of the vskipper task files (lm-eval loads this file by path: `!function utils.NAME`)."""
from vskipper.eval.scoring import last_integer


def process_arithmetic(doc: dict, results: list[str]) -> dict:
    """1.0 when the reply's last integer is the answer (benchmarks/quality_hf.py scores the same way)."""
    return {"acc": float(last_integer(results[0]) == int(doc["answer"]))}
