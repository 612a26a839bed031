"""What a simulated run reports, defined as SGLang's benchmark client defines it
(sglang/benchmark/serving.py: calculate_metrics):

    TTFT   first token at the client - the request sent
    e2e    last token at the client - the request sent
    TPOT   (e2e - TTFT) / (output tokens - 1), per request of more than one token
    ITL    every gap between two consecutive tokens of a request, pooled over requests
    output throughput   all output tokens / (last request done - first request sent), tok/s
    request throughput  requests / the same duration

Each as mean, p50, p90, p99 (numpy's percentile, as the client), in ms; plus the batch size over time
(the decode steps' rows, time-weighted) and, per kind of step, how much of the simulated time was priced
from which part of the step tables.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["METRICS", "SimResult", "knee"]

METRICS = ("ttft", "tpot", "itl", "e2e")


@dataclass
class SimResult:
    arrival: np.ndarray  # s, as sent
    ttft: np.ndarray  # s
    e2e: np.ndarray  # s
    output: np.ndarray  # tokens per request
    itl: np.ndarray  # s, every gap, pooled
    steps: np.ndarray  # [n, 5]: start s, duration s, kind (0 decode, 1 prefill), rows, tokens
    priced: dict = field(default_factory=dict)  # kind of step -> simulated s
    retractions: int = 0

    @classmethod
    def build(cls, sim, egress: float) -> SimResult:
        n = len(sim.reqs)
        arrival, ttft, e2e, out = (np.empty(n) for _ in range(4))
        emit = sim.emit_dec
        gaps = []
        for k, r in enumerate(sim.reqs):
            prev = None
            for first, d0, end in r.segs:
                if prev is not None:
                    gaps.append(first - prev)
                prev = first
                if end is not None and end >= d0:
                    gaps.append(emit[d0] - first)
                    prev = emit[end]
            arrival[k], out[k] = r.arrival, r.target
            ttft[k] = r.segs[0][0] + egress - r.arrival
            e2e[k] = prev + egress - r.arrival
        e = np.asarray(emit)
        w = np.asarray(sim.weights, dtype=np.int64)
        pooled = np.repeat(np.diff(e), w[1:]) if len(e) > 1 else np.empty(0)
        itl = np.concatenate([pooled, np.asarray(gaps)]) if gaps else pooled
        steps = np.asarray(sim.steps_rec, dtype=float).reshape(-1, 5)
        return cls(arrival, ttft, e2e, out, itl, steps, dict(sim.priced), sim.retractions)

    @property
    def tpot(self) -> np.ndarray:
        m = self.output > 1
        return (self.e2e[m] - self.ttft[m]) / (self.output[m] - 1)

    @property
    def duration(self) -> float:
        return float((self.arrival + self.e2e).max() - self.arrival.min())

    def mean_batch(self) -> float:
        """Decode rows, time-weighted over the decode steps."""
        dec = self.steps[self.steps[:, 2] == 0] if len(self.steps) else self.steps
        return float((dec[:, 1] * dec[:, 3]).sum() / dec[:, 1].sum()) if len(dec) else 0.0

    def batch_series(self, bin_s: float = 1.0) -> list[float]:
        """Mean decode rows per bin of simulated time (time-weighted; 0 where no decode ran)."""
        if not len(self.steps):
            return []
        end = float((self.steps[:, 0] + self.steps[:, 1]).max())
        nb = int(np.ceil(end / bin_s)) or 1
        rows, busy = np.zeros(nb), np.zeros(nb)
        dec = self.steps[self.steps[:, 2] == 0]
        idx = np.minimum((dec[:, 0] / bin_s).astype(int), nb - 1)
        np.add.at(rows, idx, dec[:, 1] * dec[:, 3])
        np.add.at(busy, idx, dec[:, 1])
        return [float(x) for x in np.divide(rows, busy, out=np.zeros(nb), where=busy > 0)]

    def summary(self) -> dict:
        """{metric_stat: value}: ttft/tpot/itl/e2e x mean/p50/p90/p99 in ms, output_tps, request_tps,
        completed, duration_s, mean_batch, retractions."""
        out = {}
        for name in METRICS:
            x = getattr(self, name) * 1e3
            if not len(x):
                x = np.zeros(1)
            out[f"{name}_mean"] = float(x.mean())
            for p in (50, 90, 99):
                out[f"{name}_p{p}"] = float(np.percentile(x, p))
        d = self.duration
        out.update(output_tps=float(self.output.sum() / d), request_tps=len(self.output) / d,
                   completed=len(self.output), duration_s=d, mean_batch=self.mean_batch(),
                   retractions=self.retractions)
        return out


def knee(rates: list[float], output_tps: list[float], gain: float = 0.01) -> float | None:
    """The paper's knee Q*: the last rate whose output tok/s beats the running maximum of the rates before
    it by at least `gain` (1%). Rates in increasing order; None for fewer than one rate."""
    if len(rates) != len(output_tps):
        raise ValueError(f"knee: {len(rates)} rates for {len(output_tps)} throughputs")
    if any(b <= a for a, b in zip(rates, rates[1:])):
        raise ValueError("knee: rates must increase")
    if not rates:
        return None
    best, q = output_tps[0], rates[0]
    for r, x in zip(rates[1:], output_tps[1:]):
        if x >= best * (1 + gain):
            q = r
        best = max(best, x)
    return q
