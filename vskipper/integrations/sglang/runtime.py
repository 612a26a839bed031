"""What happens inside SGLang's model runner after the weights load: transform the model, and
log per-layer skip statistics every N decode steps."""
from __future__ import annotations

import logging

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
    logger.info("vskipper: transformed %s with %s (%s), routed layers %s", type(model).__name__,
                type(skipper).__name__, settings.config(), list(skipper.layers))
    if settings.stats_interval:
        install_stats_logger(model, settings.stats_interval)


def format_stats(st: dict[int, dict[str, int]]) -> str:
    tokens = sum(s["tokens"] for s in st.values())
    skipped = sum(s["project"] for s in st.values())
    per_layer = " ".join(f"{l}:{s['project'] / max(1, s['tokens']):.2f}" for l, s in st.items())
    return f"skip ratio {skipped / max(1, tokens):.3f} over {tokens} routed-layer tokens; per layer {per_layer}"


def install_stats_logger(model, interval: int) -> None:
    steps = {"n": 0}

    def hook(module, args, kwargs, output):
        fb = kwargs.get("forward_batch", args[2] if len(args) > 2 else None)
        if fb is None or not fb.forward_mode.is_decode():
            return
        steps["n"] += 1
        if steps["n"] % interval == 0:
            logger.info("vskipper: after %d decode steps: %s", steps["n"], format_stats(vskipper.stats(model)))

    # SGLang's runner calls model.forward() directly (no hooks); the inner model is called normally
    model.model.register_forward_hook(hook, with_kwargs=True)
