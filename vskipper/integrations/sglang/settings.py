"""The plugin's settings, read from the environment in this one place (SGLang starts its
scheduler in subprocesses, which inherit the environment).

VSKIPPER_SKIPPER         skipper spec for a stock Llama/Qwen3 model, e.g.
                         random:rate=0.5,layers=15-29,seed=0 (unset: serve the model unchanged)
VSKIPPER_EXECUTION       auto | dense | routed | routed-mlp         (default auto)
VSKIPPER_IMPL            auto | torch | triton: vskipper's ops; auto = triton on CUDA, torch on CPU
VSKIPPER_STATIC_SHAPES   auto | 0 | 1: graph-safe routed body (fixed shapes, device-side counts);
                         auto = on for CUDA, off on CPU              (default auto)
VSKIPPER_STATS_INTERVAL  log per-layer skip statistics every N decode steps; 0 = never (default 0)
VSKIPPER_CHECK_SYNC      1 = fail on any host sync inside routed layers during decode (a test guard)
VSKIPPER_THRESHOLD       the FlexiDepth router's threshold, in [0, 1] (unset: the skipper's own, 0.5):
                         a token RUNs a routed layer when g > threshold, so a higher one skips more
VSKIPPER_AUTOTUNE        1 | 0: Triton launches use this GPU's tuned configs | their defaults (default 1)
VSKIPPER_ROUTE_DIGEST    a directory: each rank appends a digest of every routed layer's decisions
                         there (a debugging and test aid: it reads the decisions on the host)
VSKIPPER_TPOT_MS         a latency target (ms per output token): turns on elastic depth
                         (vskipper/elastic.py); needs a skipper                    (unset: off)
VSKIPPER_TTFT_MS         with VSKIPPER_TPOT_MS: a time-to-first-token target as well (ms)
VSKIPPER_CONTROL_PERIOD_MS  how often elastic depth chooses its level                (default 1000)
VSKIPPER_ELASTIC_TRACE   a directory: with VSKIPPER_TPOT_MS, each scheduler process appends every event its
                         controller sees there (vskipper/elastic_trace.py: a tuning aid, replayed offline)
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from vskipper.config import EXECUTIONS, IMPLS, Config
from vskipper.elastic import Target, parse_ms
from vskipper.skippers import parse_skipper


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(allowed)}")
    return value


@dataclass(frozen=True)
class Settings:
    skipper_spec: str | None = None
    execution: str = "auto"
    impl: str = "auto"
    static_shapes: bool | None = None
    stats_interval: int = 0
    check_sync: bool = False
    route_digest: str | None = None
    tuned_kernels: bool = True
    threshold: float | None = None
    tpot_ms: float | None = None
    ttft_ms: float | None = None
    control_period_ms: float = 1000.0
    elastic_trace: str | None = None

    @classmethod
    def from_env(cls, env=None) -> "Settings":
        env = os.environ if env is None else env
        spec = env.get("VSKIPPER_SKIPPER") or None
        if spec is not None:
            parse_skipper(spec)  # validate now: a ValueError naming the bad field
        static = _choice("VSKIPPER_STATIC_SHAPES", env.get("VSKIPPER_STATIC_SHAPES", "auto"), ("auto", "0", "1"))
        threshold = env.get("VSKIPPER_THRESHOLD") or None
        if threshold is not None:
            try:
                threshold = float(threshold)
            except ValueError:
                threshold = -1.0
            if not 0.0 <= threshold <= 1.0:
                raise ValueError(f"VSKIPPER_THRESHOLD={env['VSKIPPER_THRESHOLD']!r} must be a number in [0, 1]")
        if threshold is not None and spec is not None and not spec.strip().lower().startswith("flexidepth"):
            raise ValueError(f"VSKIPPER_THRESHOLD applies to a FlexiDepth router's gate; the skipper {spec!r} "
                             f"decides without one (unset VSKIPPER_THRESHOLD)")
        interval = env.get("VSKIPPER_STATS_INTERVAL", "0")
        if not interval.isdigit():
            raise ValueError(f"VSKIPPER_STATS_INTERVAL={interval!r} must be an integer >= 0")
        tpot, ttft = parse_ms("VSKIPPER_TPOT_MS", env.get("VSKIPPER_TPOT_MS")), parse_ms(
            "VSKIPPER_TTFT_MS", env.get("VSKIPPER_TTFT_MS"))
        if ttft is not None and tpot is None:
            raise ValueError("VSKIPPER_TTFT_MS is a target of elastic depth, which VSKIPPER_TPOT_MS turns on; "
                             "set VSKIPPER_TPOT_MS too")
        period = parse_ms("VSKIPPER_CONTROL_PERIOD_MS", env.get("VSKIPPER_CONTROL_PERIOD_MS")) or 1000.0
        trace = env.get("VSKIPPER_ELASTIC_TRACE") or None
        if trace is not None and tpot is None:
            raise ValueError("VSKIPPER_ELASTIC_TRACE records elastic depth, which VSKIPPER_TPOT_MS turns on; "
                             "set VSKIPPER_TPOT_MS too")
        return cls(
            skipper_spec=spec,
            tpot_ms=tpot,
            ttft_ms=ttft,
            control_period_ms=period,
            elastic_trace=trace,
            execution=_choice("VSKIPPER_EXECUTION", env.get("VSKIPPER_EXECUTION", "auto"), EXECUTIONS),
            impl=_choice("VSKIPPER_IMPL", env.get("VSKIPPER_IMPL", "auto"), IMPLS),
            static_shapes=None if static == "auto" else static == "1",
            stats_interval=int(interval),
            check_sync=_choice("VSKIPPER_CHECK_SYNC", env.get("VSKIPPER_CHECK_SYNC", "0"), ("0", "1")) == "1",
            route_digest=env.get("VSKIPPER_ROUTE_DIGEST") or None,
            threshold=threshold,
            tuned_kernels=_choice("VSKIPPER_AUTOTUNE", env.get("VSKIPPER_AUTOTUNE", "1"), ("0", "1")) == "1",
        )

    def config(self) -> Config:
        return Config(execution=self.execution, impl=self.impl, static_shapes=self.static_shapes,
                      check_sync=self.check_sync, tuned_kernels=self.tuned_kernels)

    def target(self) -> Target | None:
        """Elastic depth's latency target, or None when it is off."""
        if self.tpot_ms is None:
            return None
        return Target(self.tpot_ms, self.ttft_ms, self.control_period_ms / 1e3)

    def to_env(self) -> dict[str, str]:
        env = {"VSKIPPER_EXECUTION": self.execution, "VSKIPPER_IMPL": self.impl,
               "VSKIPPER_STATIC_SHAPES": {None: "auto", True: "1", False: "0"}[self.static_shapes],
               "VSKIPPER_STATS_INTERVAL": str(self.stats_interval),
               "VSKIPPER_CHECK_SYNC": "1" if self.check_sync else "0",
               "VSKIPPER_AUTOTUNE": "1" if self.tuned_kernels else "0"}
        if self.skipper_spec:
            env["VSKIPPER_SKIPPER"] = self.skipper_spec
        if self.route_digest:
            env["VSKIPPER_ROUTE_DIGEST"] = self.route_digest
        if self.threshold is not None:
            env["VSKIPPER_THRESHOLD"] = repr(self.threshold)
        if self.tpot_ms is not None:
            env["VSKIPPER_TPOT_MS"] = repr(self.tpot_ms)
            env["VSKIPPER_CONTROL_PERIOD_MS"] = repr(self.control_period_ms)
        if self.elastic_trace:
            env["VSKIPPER_ELASTIC_TRACE"] = self.elastic_trace
        if self.ttft_ms is not None:
            env["VSKIPPER_TTFT_MS"] = repr(self.ttft_ms)
        return env
