"""Scores and their standard errors, written once for `vskipper eval` and its task files.

    last_integer      a reply's answer: its last integer (benchmarks/quality_hf.py scores the same way)
    prefix_length     tokens of a greedy answer that agree with the base's before the first divergence
    mean_stderr       mean and standard error of the mean (sample standard deviation / sqrt(n))
    median_stderr     median and its bootstrap standard error (seeded)
    agreement         greedy agreement of answers with the base's answers, per prompt and summed up
"""
from __future__ import annotations

import math
import random
import re
import statistics


def last_integer(text: str) -> int | None:
    """The answer a reply gives: its last integer, commas as thousands separators allowed
    ("1,250" -> 1250); None when the reply has no integer."""
    found = re.findall(r"-?\d[\d,]*", text)
    if not found:
        return None
    try:
        return int(found[-1].replace(",", ""))
    except ValueError:
        return None


def prefix_length(answer: list[int], base: list[int]) -> int:
    """Tokens of `answer` equal to `base`'s before the first divergence; at most len(base)."""
    n = 0
    while n < min(len(answer), len(base)) and answer[n] == base[n]:
        n += 1
    return n


def mean_stderr(values: list[float]) -> tuple[float, float]:
    """(mean, standard error of the mean): the sample standard deviation (n - 1) over sqrt(n), the
    same estimate lm-eval gives for a metric aggregated by the mean; 0 for a single value, NaN for none."""
    n = len(values)
    if n == 0:
        return math.nan, math.nan
    m = sum(values) / n
    if n == 1:
        return m, 0.0
    return m, math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1) / n)


def median_stderr(values: list[float], iters: int = 1000, seed: int = 0) -> tuple[float, float]:
    """(median, its standard error): the standard deviation of the medians of `iters` bootstrap
    resamples (seeded, so the same values always give the same error)."""
    n = len(values)
    if n == 0:
        return math.nan, math.nan
    med = float(statistics.median(values))
    if n == 1:
        return med, 0.0
    r = random.Random(seed)
    meds = [statistics.median(r.choices(values, k=n)) for _ in range(iters)]
    return med, statistics.stdev(meds)


def agreement(answers: list[list[int]], base: list[list[int]]) -> dict:
    """Greedy agreement of `answers` with the base model's `base` answers to the same prompts:

    prefix          per prompt, tokens agreeing before the first divergence (capped at the base's length)
    prefix_mean     their mean over prompts, with prefix_mean_stderr (standard error of the mean)
    prefix_median   their median, with prefix_median_stderr (bootstrap)
    identical       share of answers equal to the base's in full (same tokens, same length), with
                    identical_stderr (standard error of the mean of the 0/1 outcomes)
    base_len_mean   the base answers' mean length, for scale"""
    if len(answers) != len(base):
        raise ValueError(f"agreement: {len(answers)} answers for {len(base)} base answers")
    prefix = [prefix_length(a, b) for a, b in zip(answers, base)]
    same = [float(list(a) == list(b)) for a, b in zip(answers, base)]
    pm, pse = mean_stderr([float(p) for p in prefix])
    med, mse = median_stderr([float(p) for p in prefix])
    im, ise = mean_stderr(same)
    return {"n": len(prefix), "prefix": prefix, "prefix_mean": pm, "prefix_mean_stderr": pse,
            "prefix_median": med, "prefix_median_stderr": mse, "identical": im, "identical_stderr": ise,
            "base_len_mean": mean_stderr([float(len(b)) for b in base])[0]}
