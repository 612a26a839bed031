"""Per-request control inside SGLang (the field and its meaning: vskipper/control.py).

Where a request's setting enters:
    /v1/completions, /v1/chat/completions   top-level "vskipper" (the OpenAI client's extra_body),
                                            moved into the request's custom_params, or
                                            custom_params.vskipper directly
    /generate, Engine.generate              sampling_params.custom_params.vskipper
It is validated by control.parse in the HTTP process: a bad value is an HTTP 400 naming the field
(OpenAI routes: before the request is admitted, also when streaming; /generate and the Engine:
through the tokenizer manager's own request validation, as SGLang answers its own bad input).
A request with a setting gets its own radix-cache namespace (SGLang's extra_key): K/V computed
under one setting are not the K/V of another (a skip: false request must not read a prefix that
was computed with layers skipped).

How it reaches the routed layers: when SGLang builds a ForwardBatch from a ScheduleBatch (same
thread and device stream as the forward that follows), `BatchBudgets.fill` reads each request's
budget (parsed once per request) and writes the batch's per-row budgets [T] into one fixed device
buffer that every routed layer reads (SGLang's runners give the model a copy of the ForwardBatch,
with their own fields only, so nothing can travel on it). A captured graph reads that buffer at
every replay; nothing in the model's forward syncs with the host."""
from __future__ import annotations

import weakref

import torch

from vskipper.control import DEFAULT, FIELD, parse

DECODE_ROWS = 4096  # at least, for the decode requests of a batch (int32: 16 KiB)


def check_openai_request(request, body) -> None:
    """Move a top-level "vskipper" of an OpenAI request body into its custom_params, validating it;
    ValueError naming the field."""
    top = body.get(FIELD) if isinstance(body, dict) else None
    custom = request.custom_params
    if custom is not None and not isinstance(custom, dict):
        return  # SGLang's own validation answers that
    inner = (custom or {}).get(FIELD)
    if top is not None and inner is not None:
        raise ValueError(f"{FIELD} is given twice, at the top level and in custom_params; give it once")
    if top is not None:
        parse(top, FIELD)
        request.custom_params = {**(custom or {}), FIELD: top}
    elif inner is not None:
        parse(inner, f"custom_params.{FIELD}")


async def openai_handle_request(original, serving, request, raw_request=None, *args, **kwargs):
    """AROUND hook of the OpenAI completion and chat handlers: a bad setting is a 400 naming the
    field, before the request is admitted (so also for a streamed one)."""
    try:
        body = await raw_request.json() if raw_request is not None else None  # Starlette's cached parse
        check_openai_request(request, body)
    except ValueError as e:
        return serving.create_error_response(str(e), err_type="BadRequest", status_code=400, param=FIELD)
    return await original(serving, request, raw_request, *args, **kwargs)


def check_generate_request(manager, obj) -> None:
    """Validate sampling_params.custom_params.vskipper of one /generate or Engine request."""
    sp = getattr(obj, "sampling_params", None)
    custom = sp.get("custom_params") if isinstance(sp, dict) else None
    value = custom.get(FIELD) if isinstance(custom, dict) else None
    if value is None:
        return
    parse(value, f"sampling_params.custom_params.{FIELD}")
    spec = getattr(getattr(manager, "server_args", None), "speculative_algorithm", None)
    if spec:
        raise ValueError(f"sampling_params.custom_params.{FIELD}: per-request control is not supported with "
                         f"speculative decoding (--speculative-algorithm {spec})")


def namespace_cache(tokenized, manager, obj, *args, **kwargs):
    """AFTER hook of the tokenizer manager's _create_tokenized_object: requests with the same setting
    share cached prefixes, requests with different ones do not."""
    custom = getattr(getattr(tokenized, "sampling_params", None), "custom_params", None)
    value = custom.get(FIELD) if isinstance(custom, dict) else None
    control = parse(value)
    if control != DEFAULT:
        ns = f"vskipper:max_skip={control.max_skip!r}"
        tokenized.extra_key = f"{tokenized.extra_key}|{ns}" if tokenized.extra_key else ns
    return tokenized


class BatchBudgets:
    """The per-row budgets of the batches one model runner runs, in one fixed device buffer (see the
    module docstring); made at load, before the model is transformed (which hands it to the routed
    layers) and before SGLang captures any graph."""

    def __init__(self, n_layers: int, rows: int, device) -> None:
        self.n_layers = n_layers
        self.rows = torch.full((rows,), n_layers, dtype=torch.int32, device=device)
        self.active = False  # does the batch being run have a request with a setting (host side)
        self.plain = False  # is every row's budget 0, so its routed layers may run as SGLang's (host side)
        self.levels: tuple[int, ...] = ()  # elastic depth's budget per level (integrations/sglang/elastic.py)
        self._budgets = weakref.WeakKeyDictionary()  # request -> its budget, parsed once per request

    def budget(self, req) -> int:
        b = self._budgets.get(req)
        if b is None:
            custom = req.sampling_params.custom_params
            value = custom.get(FIELD) if isinstance(custom, dict) else None
            b = parse(value, f"custom_params.{FIELD}").budget(self.n_layers)
            if self.levels:  # elastic depth: the stricter of the field's budget and the level's
                from vskipper.integrations.sglang.elastic import level_of

                level = level_of(req.extra_key)
                b = b if level is None else min(b, self.levels[level])
            self._budgets[req] = b
        return b

    def fixed(self, req) -> bool:
        """Whether `req`'s budget was read (it ran): from then on its level and budget do not change."""
        return req in self._budgets

    def fill(self, forward_batch, batch) -> None:
        """Write the budgets of this batch's rows: request i's over its extend_lens[i] rows at prefill
        (EXTEND, MIXED), one row per request at decode; every other batch (no request can set a budget
        there: see check_generate_request) gets the default. Host work O(requests); the copy to the
        device does not wait for it (pinned memory on CUDA), and the rows are spread on the device."""
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        ids = forward_batch.input_ids
        T = 0 if ids is None else ids.shape[0]
        if T > self.rows.shape[0]:
            raise RuntimeError(f"vskipper: a batch of {T} rows, more than the {self.rows.shape[0]} rows of the "
                               f"per-request budget buffer")
        mode = forward_batch.forward_mode
        budgets = [self.budget(r) for r in batch.reqs] if mode in (ForwardMode.DECODE, ForwardMode.EXTEND,
                                                                   ForwardMode.MIXED) else []
        self.active = any(b != self.n_layers for b in budgets)
        self.plain = bool(budgets) and not any(budgets)
        if not self.active:
            self.rows[:T].fill_(self.n_layers)
            return
        rows = sum(batch.extend_lens) if mode != ForwardMode.DECODE else len(budgets)
        if rows != T:
            raise RuntimeError(f"vskipper: budgets for {rows} rows, the batch has {T}")
        device = self.rows.device
        per_request = torch.tensor(budgets, dtype=torch.int32, pin_memory=device.type == "cuda")
        per_request = per_request.to(device, non_blocking=True)
        if mode != ForwardMode.DECODE:
            lens = forward_batch.extend_seq_lens.to(device, non_blocking=True)
            per_request = torch.repeat_interleave(per_request, lens, output_size=T)
        self.rows[:T].copy_(per_request)


_BUDGETS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model runner -> its BatchBudgets


def make_budgets(runner, n_layers: int) -> BatchBudgets:
    """Per-request control for this runner's model: the budget buffer, sized for the largest batch
    SGLang can form (the most requests of a decode step, or a prefill of up to the context length plus
    the decode requests a mixed batch carries). Kept for the runner's batches (after_forward_batch_init)."""
    sa = getattr(runner, "server_args", None)

    def arg(name):
        return getattr(sa, name, None) or 0

    context = getattr(getattr(runner, "model_config", None), "context_len", 0) or 0
    rows = (max(DECODE_ROWS, arg("max_running_requests"), arg("cuda_graph_max_bs"))
            + max(context, arg("max_prefill_tokens"), arg("chunked_prefill_size")))
    device = next(runner.model.parameters()).device
    _BUDGETS[runner] = budgets = BatchBudgets(n_layers, rows, device)
    return budgets


def after_forward_batch_init(forward_batch, cls, batch, model_runner, *args, **kwargs):
    """AFTER hook of ForwardBatch.init_new: the batch's per-row budgets, and the phase its routed-layer
    tokens are counted in (vskipper/counters.py): decode for a decode batch, else prefill (a mixed batch,
    --enable-mixed-chunk, counts as prefill)."""
    budgets = _BUDGETS.get(model_runner)
    if budgets is not None and getattr(batch, "reqs", None) is not None:
        budgets.fill(forward_batch, batch)
    state = getattr(getattr(model_runner, "model", None), "vskipper", None)
    if state is not None:
        from vskipper.counters import DECODE, PREFILL

        state.phase.set(DECODE if forward_batch.forward_mode.is_decode() else PREFILL)
    return forward_batch
