"""Both forms of a decode step captured per batch size in SGLang's decode CUDA-graph runner, and the
one to replay chosen on the host per step (vskipper/replay.py), through the plugin's hooks on
`DecodeCudaGraphRunner` (SGLang 0.5.23: sglang/srt/model_executor/runner/decode_cuda_graph_runner.py):

    capture_one_shape  AROUND  runs SGLang's capture of one batch size once per form, the model's `auto`
                               routed layers forced to that form's body (replay.forced)
    _make_graph_key    AROUND  the graph key (ShapeKey) carries the form in its variant label, so the
                               backend keeps both graphs: "vskipper:dense", or "<label>|vskipper:routed"
                               beside a LoRA label; capture keys get the form being captured, other
                               keys (can_run_graph's) the form chosen last
    load_batch         AFTER   the replay key's form: ReplayChooser.choose(padded batch size, resident K/V
                               = forward_batch.seq_lens_sum, real rows), host-side values only
    execute            AFTER   ReplayChooser.observe: a non-blocking copy of the route counters' decode
                               counts, folded into the RUN-fraction EMA once landed; ReplayChooser.ran

A runner whose model has no `auto` routed layer (execution dense / routed, no calibration, a draft model)
is left as SGLang made it. So is a runner whose graphs gather across data-parallel ranks (DP attention:
ranks with different batches would choose different forms inside shared collectives). Under tensor
parallelism the chooser runs in lockstep (every rank folds the same steps' counts: replay.LAG). Capturing
each batch size twice doubles the decode graphs' capture time; their memory comes from SGLang's one graph
pool, which the forms of a batch size share.
"""
from __future__ import annotations

import dataclasses
import logging
import weakref

from vskipper.replay import FORMS, ReplayChooser, forced

logger = logging.getLogger("vskipper")

RUNNER = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner"
CAPTURE_ONE = RUNNER + ".capture_one_shape"
GRAPH_KEY = RUNNER + "._make_graph_key"
LOAD_BATCH = RUNNER + ".load_batch"
EXECUTE = RUNNER + ".execute"
TAG = "vskipper:"


class Forms:
    """A runner's two forms: the model, its replay chooser, and the form its keys carry now."""

    def __init__(self, model, chooser: ReplayChooser) -> None:
        self.model, self.chooser = model, chooser
        self.form = FORMS[0]


_FORMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # runner -> Forms, or None: left alone


def register(registry, hook_type) -> None:
    """Register the hooks (plugin.register passes SGLang's HookRegistry and HookType)."""
    registry.register(CAPTURE_ONE, around_capture_one_shape, hook_type.AROUND)
    registry.register(GRAPH_KEY, around_make_graph_key, hook_type.AROUND)
    registry.register(LOAD_BATCH, after_load_batch, hook_type.AFTER)
    registry.register(EXECUTE, after_execute, hook_type.AFTER)


def tp_size() -> int:
    from sglang.srt.runtime_context import get_parallel

    return get_parallel().tp_size


def forms_of(runner) -> Forms | None:
    """The runner's Forms, made at its first hook call; None where the runner is left alone."""
    try:
        return _FORMS[runner]
    except KeyError:
        pass
    model = getattr(getattr(runner, "model_runner", None), "model", None)
    chooser = None
    if getattr(runner, "require_mlp_tp_gather", False) or getattr(runner, "require_attn_tp_gather", False):
        if ReplayChooser.for_model(model) is not None:
            logger.info("vskipper: decode graphs gather across data-parallel ranks: one form per batch size "
                        "(auto's plan), not both")
    else:
        chooser = ReplayChooser.for_model(model, lockstep=tp_size() > 1)
    st = None if chooser is None else Forms(model, chooser)
    _FORMS[runner] = st
    if st is not None:
        from vskipper.calibrate import break_even_line

        logger.info("vskipper: decode CUDA graphs: %s; %s", chooser.describe(),
                    break_even_line(chooser.cal, chooser.f(), list(getattr(runner, "capture_bs", None) or ())
                                    or None))
    return st


def with_form(key, form: str):
    """`key` (a ShapeKey) with its variant label carrying `form` in place of any form it carried."""
    label = key.variant_label
    base = None if label is None or label.startswith(TAG) else label.split("|" + TAG)[0]
    return dataclasses.replace(key, variant_label=TAG + form if base is None else f"{base}|{TAG}{form}")


def around_capture_one_shape(original, runner, *args, **kwargs):
    """SGLang's capture of one batch size, once per form (the forms' graphs keyed apart)."""
    st = forms_of(runner)
    if st is None:
        return original(runner, *args, **kwargs)
    out = None
    for form in FORMS:
        st.form = form
        with forced(st.model, form):
            out = original(runner, *args, **kwargs)
    st.form = FORMS[0]
    return out


def around_make_graph_key(original, runner, *args, **kwargs):
    key = original(runner, *args, **kwargs)
    st = forms_of(runner)
    return key if st is None else with_form(key, st.form)


def resident_tokens(forward_batch) -> int | None:
    """The batch's K/V positions summed, from host-side lengths (None if SGLang kept none)."""
    total = getattr(forward_batch, "seq_lens_sum", None)
    if total is None:
        lens = getattr(forward_batch, "seq_lens_cpu", None)
        total = None if lens is None else int(lens.sum())
    return None if total is None else int(total)


def after_load_batch(result, runner, forward_batch, *args, **kwargs):
    """The replay key's form, chosen for this batch on the host."""
    st = forms_of(runner)
    if st is not None:
        key = runner._replay_graph_key  # the captured size replayed (the batch padded up to it)
        st.form = st.chooser.choose(key.size, resident_tokens(forward_batch), rows=forward_batch.batch_size)
        runner._replay_graph_key = with_form(key, st.form)
    return result


def after_execute(result, runner, *args, **kwargs):
    """After a replay: count it, and start the copy of its route counts."""
    st = forms_of(runner)
    if st is not None:
        st.chooser.ran(st.form)
        st.chooser.observe()
    return result
