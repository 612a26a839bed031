"""The SGLang general plugin (entry-point group `sglang.srt.plugins`, runs in every SGLang
process): registers the skip-aware architectures and a hook after `ModelRunner.load_model` that
transforms the loaded model. No SGLang file is patched; no fork."""
from __future__ import annotations

import logging

logger = logging.getLogger("vskipper")

LOAD_MODEL = "sglang.srt.model_executor.model_runner.ModelRunner.load_model"
_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from transformers import AutoConfig

    from vskipper.integrations.sglang.models import config_classes, model_classes

    for cls in model_classes():
        ModelRegistry.models[cls.__name__] = cls
    for cfg in config_classes():
        try:
            AutoConfig.register(cfg.model_type, cfg)
        except ValueError:  # already registered in this process
            pass
    HookRegistry.register(LOAD_MODEL, after_load_model, HookType.AFTER)
    _registered = True


def after_load_model(result, runner, *args, **kwargs):
    """Transform runner.model: a skip-aware checkpoint with its own skipper, or a stock model with
    the skipper named by VSKIPPER_SKIPPER."""
    from vskipper.integrations.sglang.runtime import transform_loaded

    transform_loaded(runner)
    return result
