"""What benchmarks/gpu/sglang_check.py reads off its servers and makes of it: vskipper's route counters
on /metrics, the checks that prove the routed path ran (and that upstream ran none of it), and the
one table of the run.

Legend: run / project = routed-layer tokens that ran a routed layer / skipped it (RandomSkip: identity,
K/V still written); skipped = project / (run + project), summed over the routed layers.
"""
from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass

from benchmarks.results import table

__all__ = ["Check", "Counts", "check_counts", "counts_delta", "parse_counts", "report"]

LAYER_METRIC = "vskipper_routed_layer_tokens_total"  # {layer, route}: vskipper/integrations/sglang/runtime.py
PHASE_METRIC = "vskipper_routed_layer_phase_tokens_total"  # {phase, route}
_SERIES = re.compile(r"^(vskipper_\w+)\{([^}]*)\} (\S+)$", re.M)


@dataclass(frozen=True)
class Counts:
    """vskipper's series on one /metrics page: per routed layer {layer: (run, project)}, per phase
    {phase: (run, project)}, and how many vskipper_* series the page had at all."""

    layers: dict[int, tuple[float, float]]
    phases: dict[str, tuple[float, float]]
    series: int

    def totals(self) -> tuple[float, float]:
        return (sum(r for r, _ in self.layers.values()), sum(p for _, p in self.layers.values()))


def parse_counts(text: str) -> Counts:
    """The route counters in a Prometheus text page (series of one label set summed: SGLang's
    multiprocess collector may list one per process)."""
    layers: dict[int, list[float]] = {}
    phases: dict[str, list[float]] = {}
    series = 0
    for m in _SERIES.finditer(text):
        series += 1
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        route, value = labels.get("route"), float(m.group(3))
        if route not in ("run", "project"):
            continue
        col = 0 if route == "run" else 1
        if m.group(1) == LAYER_METRIC:
            layers.setdefault(int(labels["layer"]), [0.0, 0.0])[col] += value
        elif m.group(1) == PHASE_METRIC:
            phases.setdefault(labels["phase"], [0.0, 0.0])[col] += value
    return Counts({k: tuple(v) for k, v in sorted(layers.items())}, {k: tuple(v) for k, v in phases.items()}, series)


def counts_delta(after: Counts, before: Counts) -> Counts:
    """What a benchmark call added to the counters (after - before, per layer and phase)."""
    def sub(a: dict, b: dict) -> dict:
        return {k: (v[0] - b.get(k, (0.0, 0.0))[0], v[1] - b.get(k, (0.0, 0.0))[1]) for k, v in a.items()}

    return Counts(sub(after.layers, before.layers), sub(after.phases, before.phases), after.series)


def add_counts(a: Counts, b: Counts) -> Counts:
    def add(x: dict, y: dict) -> dict:
        zero = (0.0, 0.0)
        return {k: (x.get(k, zero)[0] + y.get(k, zero)[0], x.get(k, zero)[1] + y.get(k, zero)[1])
                for k in sorted(set(x) | set(y))}

    return Counts(add(a.layers, b.layers), add(a.phases, b.phases), max(a.series, b.series))


def skipped(c: Counts, phase: str | None = None) -> float | None:
    run, project = c.totals() if phase is None else c.phases.get(phase, (0.0, 0.0))
    return project / (run + project) if run + project else None


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


def check_counts(system: str, rate: float | None, routed: list[int], c: Counts) -> list[Check]:
    """The proof that the routed path ran, from one server's counters over the measured calls:
    upstream (rate None) exports no vskipper series at all; a vskipper server counted tokens at every
    routed layer and at no other, in prefill and in decode (under CUDA graphs decode is the captured
    graph's replay), and skipped its rate of them (RandomSkip hashes every token and layer, so the
    share is a binomial one: within 4 standard deviations, and 0.02)."""
    if rate is None:
        return [Check(f"{system}: no vskipper counters", c.series == 0,
                      "no vskipper_* series on /metrics (plugin not loaded)" if c.series == 0
                      else f"{c.series} vskipper_* series on /metrics: the plugin ran in the upstream server")]
    out = []
    empty = [layer for layer in routed if sum(c.layers.get(layer, (0.0, 0.0))) <= 0]
    extra = sorted(set(c.layers) - set(routed))
    out.append(Check(f"{system}: every routed layer counted", not empty and not extra,
                     f"{len(routed) - len(empty)}/{len(routed)} routed layers counted tokens"
                     + (f"; none at {empty}" if empty else "")
                     + (f"; counters at unrouted layers {extra}" if extra else "")))
    phases = {p: sum(c.phases.get(p, (0.0, 0.0))) for p in ("prefill", "decode")}
    out.append(Check(f"{system}: prefill and decode counted", all(v > 0 for v in phases.values()),
                     ", ".join(f"{p} {v:.0f} routed-layer tokens" for p, v in phases.items())))
    run, project = c.totals()
    n = run + project
    share = project / n if n else float("nan")
    tol = 0.0 if rate in (0.0, 1.0) else max(0.02, 4 * math.sqrt(rate * (1 - rate) / max(n, 1)))
    out.append(Check(f"{system}: skipped {rate:g} of routed-layer tokens", n > 0 and abs(share - rate) <= tol,
                     f"skipped {share:.4f} of {n:.0f} (expected {rate:g} +- {tol:.3f})"))
    return out


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _ratio(x: float, base: float) -> str:
    return f"{x / base:.3f}x" if base and not math.isnan(x) and not math.isnan(base) else "-"


def report(workloads: list, systems: list, calls: list[dict], counts: dict, checks: list[Check], head: str) -> str:
    """The run's one table (per workload and system: the median over rounds of SGLang's benchmark
    figures, each against upstream's; the route counters over the measured calls) and its checks.
    calls: {"workload", "system", "round", "result": SGLang's JSONL record or None}; counts:
    {(workload, system): Counts summed over that pair's calls}."""
    header = ["workload", "system", "output tok/s", "vs upstream", "mean TTFT (ms)", "vs upstream",
              "mean TPOT (ms)", "vs upstream", "routed-layer tokens", "skipped (prefill / decode)"]
    rows = []
    for w in workloads:
        med = {}
        for s in systems:
            got = [c["result"] for c in calls if c["workload"] == w.name and c["system"] == s.name and c["result"]]
            med[s.name] = {k: _median([g[k] for g in got])
                           for k in ("output_throughput", "mean_ttft_ms", "mean_tpot_ms")}
            med[s.name]["rounds"] = len(got)
        up = med[systems[0].name]
        for s in systems:
            m = med[s.name]
            c = counts.get((w.name, s.name))
            if s.rate is None or c is None:
                tokens, share = "-", "-"
            else:
                run, project = c.totals()
                tokens = f"{run + project:.0f}"
                parts = [skipped(c), skipped(c, "prefill"), skipped(c, "decode")]
                share = " ".join(["-" if parts[0] is None else f"{parts[0]:.3f}",
                                  "(" + " / ".join("-" if x is None else f"{x:.3f}" for x in parts[1:]) + ")"])
            rows.append([f"{w.name} ({w.input_len} in / {w.output_len} out, {w.prompts} prompts at concurrency "
                         f"{w.concurrency})", s.label, f"{m['output_throughput']:.1f}",
                         _ratio(m["output_throughput"], up["output_throughput"]), f"{m['mean_ttft_ms']:.1f}",
                         _ratio(up["mean_ttft_ms"], m["mean_ttft_ms"]), f"{m['mean_tpot_ms']:.2f}",
                         _ratio(up["mean_tpot_ms"], m["mean_tpot_ms"]), tokens, share])
    failed = [c for c in checks if not c.ok]
    lines = [head, "", f"Checks: {len(checks) - len(failed)}/{len(checks)} passed"
             + ("." if not failed else "; FAILED: " + "; ".join(c.name for c in failed) + "."), ""]
    lines += [f"- {'ok' if c.ok else 'FAILED'}: {c.name}: {c.detail}" for c in checks]
    lines += ["", "Medians over the rounds of `python -m sglang.benchmark.serving` (each call's record in "
              "results.json); \"vs upstream\": throughput over upstream's, latencies as upstream's over the "
              "system's (above 1: faster). Route counters: vskipper_routed_layer_tokens_total on each server's "
              "/metrics before and after each measured call, summed over the rounds (they include the benchmark's "
              "own warm-up request, and are exported every 8 decode steps, so a call's last few steps count in the "
              "next).", "", table(header, rows)]
    return "\n".join(lines)
