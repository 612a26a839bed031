"""The SGLang general plugin (entry-point group `sglang.srt.plugins`, runs in every SGLang
process): registers the skip-aware architectures and a hook after `ModelRunner.load_model` that
transforms the loaded model. No SGLang file is patched; no fork."""
from __future__ import annotations

import logging

logger = logging.getLogger("vskipper")

LOAD_MODEL = "sglang.srt.model_executor.model_runner.ModelRunner.load_model"
RUNNER_FORWARD = "sglang.srt.model_executor.model_runner.ModelRunner.forward"  # one scheduler step, eager or replayed
VALIDATE = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"
TOKENIZED = "sglang.srt.managers.tokenizer_manager.TokenizerManager._create_tokenized_object"
BATCH_INIT = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"  # per-request budgets per batch
OPENAI_HANDLERS = ("sglang.srt.entrypoints.openai.serving_completions.OpenAIServingCompletion.handle_request",
                   "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat.handle_request")
_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from transformers import AutoConfig

    from vskipper.integrations.sglang import elastic, graphs, requests
    from vskipper.integrations.sglang.models import config_classes, model_classes

    for cls in model_classes():
        ModelRegistry.models[cls.__name__] = cls
    for cfg in config_classes():
        try:
            AutoConfig.register(cfg.model_type, cfg)
        except ValueError:  # already registered in this process
            pass
    HookRegistry.register(LOAD_MODEL, after_load_model, HookType.AFTER)
    HookRegistry.register(RUNNER_FORWARD, after_runner_forward, HookType.AFTER)
    HookRegistry.register(VALIDATE, validate_token_ids, HookType.BEFORE)
    HookRegistry.register(TOKENIZED, requests.namespace_cache, HookType.AFTER)
    HookRegistry.register(BATCH_INIT, requests.after_forward_batch_init, HookType.AFTER)
    for target in OPENAI_HANDLERS:
        HookRegistry.register(target, requests.openai_handle_request, HookType.AROUND)
    elastic.register()
    graphs.register(HookRegistry, HookType)  # decode CUDA graphs: both forms per batch size, chosen per step
    _registered = True


def validate_token_ids(manager, obj, input_ids, *args, **kwargs):
    """Refuse, with a clear error (HTTP 400), the inputs SGLang 0.5.23 lets through: an empty
    prompt inside a batch (answered with another request's logits) and token ids outside the
    vocabulary (an IndexError that takes the whole scheduler down); and a bad per-request setting
    (sampling_params.custom_params.vskipper, vskipper/control.py)."""
    from vskipper.integrations.sglang.requests import check_generate_request

    check_generate_request(manager, obj)
    if getattr(obj, "input_embeds", None) is not None or input_ids is None:
        return None
    if len(input_ids) == 0:
        raise ValueError("empty prompt: a request needs at least one input token")
    vocab = getattr(getattr(manager, "model_config", None), "vocab_size", None)
    if vocab is not None:
        bad = [t for t in input_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    return None


def after_load_model(result, runner, *args, **kwargs):
    """Transform runner.model: a skip-aware checkpoint with its own skipper, or a stock model with
    the skipper named by VSKIPPER_SKIPPER."""
    from vskipper.integrations.sglang.runtime import transform_loaded

    transform_loaded(runner)
    return result


def after_runner_forward(result, runner, *args, **kwargs):
    """After each model-runner step (outside the model's forward, so also when the step was a
    replayed CUDA graph): the stats reporter, if the runner has one, counts it."""
    from vskipper.integrations.sglang.runtime import reporter_of

    reporter = reporter_of(runner)
    if reporter is not None:
        fb = kwargs.get("forward_batch", args[0] if args else None)
        reporter.after_step(fb)
    return result
