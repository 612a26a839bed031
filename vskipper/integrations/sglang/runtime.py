"""What happens inside SGLang's model runner after the weights load: transform the model, and
log per-layer skip statistics every N decode steps."""
from __future__ import annotations

import logging
import os

import vskipper
from vskipper.integrations.sglang.settings import Settings
from vskipper.skippers import parse_skipper

logger = logging.getLogger("vskipper")


def transform_loaded(runner) -> None:
    model = runner.model
    settings = Settings.from_env()
    pending = getattr(model, "_vskipper_pending", None)
    if pending is not None:
        if settings.skipper_spec:
            raise ValueError(
                f"VSKIPPER_SKIPPER={settings.skipper_spec!r} is set, but the checkpoint "
                f"({type(model).__name__}) carries its own skipper; unset VSKIPPER_SKIPPER"
            )
        skipper = pending
    elif settings.skipper_spec:
        skipper = parse_skipper(settings.skipper_spec)
    else:
        return  # a stock model and no skipper: served unchanged
    vskipper.transform(model, skipper, settings.config())
    bodies = sorted(set(model.vskipper.bodies.values()))
    cost_state = ("calibrated for this device, picks dense/routed per step" if bodies == ["auto"] else
                  "not calibrated for this device, so dense-masked (run `vskipper calibrate`)"
                  if settings.execution == "auto" else f"not used (execution={settings.execution})")
    logger.info("vskipper: transformed %s with %s [%s], routed layers %s, %s; cost model: %s", type(model).__name__,
                type(skipper).__name__, settings.skipper_spec or "the checkpoint's own", list(skipper.layers),
                settings.config(), cost_state)
    if settings.stats_interval:
        install_stats_logger(model, settings.stats_interval)


def format_stats(st: dict[int, dict[str, int]]) -> str:
    tokens = sum(s["tokens"] for s in st.values())
    skipped = sum(s["project"] for s in st.values())
    per_layer = " ".join(f"{l}:{s['project'] / max(1, s['tokens']):.2f}" for l, s in st.items())
    return f"skip ratio {skipped / max(1, tokens):.3f} over {tokens} routed-layer tokens; per layer {per_layer}"


class PrometheusExport:
    """Per-layer route counters exported through SGLang's Prometheus endpoint (--enable-metrics):
    SGLang runs prometheus_client in multiprocess mode, so a counter created in the scheduler
    process is served by /metrics. Metric: vskipper_routed_layer_tokens_total{layer, route}."""

    def __init__(self) -> None:
        from prometheus_client import Counter

        self.counter = Counter("vskipper_routed_layer_tokens_total",
                               "Tokens that reached a routed layer, by route (run / project / nonfinite)",
                               ["layer", "route"])
        self.last: dict[tuple[int, str], int] = {}

    def update(self, st: dict[int, dict[str, int]]) -> None:
        for layer, s in st.items():
            for route in ("run", "project", "nonfinite"):
                key = (layer, route)
                delta = s[route] - self.last.get(key, 0)
                if delta > 0:
                    self.counter.labels(layer=str(layer), route=route).inc(delta)
                self.last[key] = s[route]


def install_stats_logger(model, interval: int) -> None:
    steps = {"n": 0}
    export = PrometheusExport() if os.environ.get("PROMETHEUS_MULTIPROC_DIR") else None

    def hook(module, args, kwargs, output):
        fb = kwargs.get("forward_batch", args[2] if len(args) > 2 else None)
        if fb is None or not fb.forward_mode.is_decode():
            return
        steps["n"] += 1
        if steps["n"] % interval == 0:
            st = vskipper.stats(model)
            logger.info("vskipper: after %d decode steps: %s", steps["n"], format_stats(st))
            if export is not None:
                export.update(st)

    # SGLang's runner calls model.forward() directly (no hooks); the inner model is called normally
    model.model.register_forward_hook(hook, with_kwargs=True)
