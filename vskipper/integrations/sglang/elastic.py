"""Elastic depth inside SGLang's scheduler (the rule: vskipper/elastic.py). On when VSKIPPER_TPOT_MS is
set; one controller per scheduler process, made when the model loads.

Where it meets SGLang (hooks, no SGLang file patched):
    SchedulerRequestReceiver._broadcast_reqs_across_ranks  BEFORE: on the rank that receives the requests (rank 0
        of a tensor-parallel group, each data-parallel replica's own), each new request's extra_key gets
        `vskipper:level=j`, the level now; when that level is not the one last handed on, a `Handed` marker
        joins the broadcast's local requests (the work channel: under attention DP it stays within its
        group). The requests and the marker travel to the other ranks in SGLang's own broadcast on the CPU
        group, so every rank knows the same level at the same scheduler pass and no collective is added.
        AFTER (every rank): the marker is taken out of the received requests and its level kept as the
        level handed on; a rank that does not decide follows it (reported, never decided there).
    Scheduler.get_new_batch_prefill  BEFORE (every rank): after a new level was handed on, the requests
        still in the waiting queue that never ran are stamped with it, so a request's level is the one
        when it leaves the queue, not when it arrived: under a backlog the queue takes a rise at once.
        Every rank restamps the same queue at the same pass; a retracted request (it ran) keeps its level.
    Scheduler._create_generation_req  AFTER: the request's arrival time (for TTFT).
    Scheduler.process_batch_result    AFTER: a decode step's time, its rows' budgets and context tokens (and
        whether a prefill ran since the last one); first tokens; the control tick.
    Scheduler.on_idle                 AFTER: no batch ran (the next step time starts afresh; idle -> level 0).
The extra_key is also the radix cache's namespace: a request never reads K/V computed at another level.
A request's budget is the stricter of its field's and its level's (requests.BatchBudgets.budget), read
once, when it first runs, and reaches the routed layers through the per-row budget buffer: nothing new
inside captured graphs."""
from __future__ import annotations

import logging
import os
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

from vskipper import cost
from vskipper.elastic import LADDER, Controller, StepModel, ladder

logger = logging.getLogger("vskipper")

RECEIVE = ("sglang.srt.managers.scheduler_components.request_receiver.SchedulerRequestReceiver"
           "._broadcast_reqs_across_ranks")
ADMIT = "sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill"
NEW_REQ = "sglang.srt.managers.scheduler.Scheduler._create_generation_req"
BATCH_DONE = "sglang.srt.managers.scheduler.Scheduler.process_batch_result"
IDLE = "sglang.srt.managers.scheduler.Scheduler.on_idle"
KEY = "vskipper:level="


class Elastic:
    """The process's controller and what it needs from the model runner."""

    def __init__(self, controller: Controller, budgets) -> None:
        self.controller, self.budgets = controller, budgets
        self.leader = True  # this rank receives the requests and decides (False: it follows the level handed on)
        self.arrivals: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # request -> arrival time
        self.sent = 0  # the level the deciding rank last handed on (there only)
        self.handed = 0  # the level last handed on, on every rank: waiting requests are admitted at it
        self.restamp = False  # a level was handed on since the waiting queue was last stamped


@dataclass(frozen=True)
class Handed:
    """Rides SGLang's request broadcast from the deciding rank to the others: the level from now on."""
    level: int


_ELASTIC: Elastic | None = None


def current() -> Elastic | None:
    return _ELASTIC


def with_level(extra_key: str | None, level: int) -> str:
    """`extra_key` stamped with `level`: an earlier stamp of ours replaced in place (what SGLang appended
    after it, such as its elastic-EP namespace, kept), else appended."""
    ns = f"{KEY}{level}"
    if extra_key and KEY in extra_key:
        head, tail = extra_key.rsplit(KEY, 1)
        rest = tail.split("|", 1)
        return head + ns + (f"|{rest[1]}" if len(rest) > 1 else "")
    return f"{extra_key}|{ns}" if extra_key else ns


def level_of(extra_key: str | None) -> int | None:
    """The level a request was admitted at, from its extra_key (the last stamp: ours is appended last)."""
    if not extra_key or KEY not in extra_key:
        return None
    return int(extra_key.rsplit(KEY, 1)[1].split("|", 1)[0])


def install(runner, model, target, budgets, trace: str | None = None) -> None:
    """Make this process's controller: the ladder over the skipper's routed layers, the calibration's
    step model (none for this device: the controller stays at level 0 and says so); `trace`: a directory
    its events are appended to (vskipper/elastic_trace.py)."""
    global _ELASTIC
    st = model.vskipper
    L = len(st.skipper.layers)
    levels = ladder(L)
    budgets.levels = st.levels = levels
    p = next(model.parameters())
    c = model.config
    inter = getattr(c, "original_intermediate_size", None) or c.intermediate_size
    cal = st.plan.decode or cost.load(p.device, c.hidden_size, inter, cost.dtype_name(p.dtype))
    execution = st.config.execution
    bodies = cost.Calibration.bodies(cal) if cal is not None and execution == "auto" else (execution,)
    step = None if cal is None else StepModel(cal, bodies, len(model.model.layers), L, st.skipper.expected_run_fraction)
    now = time.monotonic()
    controller = Controller(target, levels, step, now)
    if trace:
        from sglang.srt.runtime_context import get_parallel

        from vskipper.elastic_trace import Recorder

        path = Path(trace) / f"tp{get_parallel().tp_rank}-{os.getpid()}.jsonl"
        controller = Recorder(controller, path, now)
        logger.info("vskipper: elastic depth's events are traced to %s", path)
    _ELASTIC = Elastic(controller, budgets)
    caps = ", ".join(f"{j}:{m:g}" for j, m in enumerate(LADDER[:len(levels)]))
    logger.info("vskipper: elastic depth on: target TPOT %g ms%s, control period %g s; levels (max_skip) %s, "
                "budgets %s of %d routed layers; starts at level 0 (the base model's function)%s", target.tpot_ms,
                f", TTFT {target.ttft_ms:g} ms" if target.ttft_ms else "", target.period_s, caps, list(levels), L,
                "" if cal is not None else
                "; NO cost calibration for this device, so it stays at level 0: run `vskipper calibrate`")


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(RECEIVE, stamp, HookType.BEFORE)
    HookRegistry.register(RECEIVE, received, HookType.AFTER)
    HookRegistry.register(ADMIT, admit, HookType.BEFORE)
    HookRegistry.register(NEW_REQ, on_new_request, HookType.AFTER)
    HookRegistry.register(BATCH_DONE, after_batch, HookType.AFTER)
    HookRegistry.register(IDLE, after_idle, HookType.AFTER)


def _generate_reqs(recv_reqs):
    from sglang.srt.managers.io_struct import BatchTokenizedGenerateReqInput, TokenizedGenerateReqInput

    for r in recv_reqs:
        if isinstance(r, TokenizedGenerateReqInput):
            yield r
        elif isinstance(r, BatchTokenizedGenerateReqInput):
            yield from r.batch


def stamp(receiver, recv_reqs, local_reqs=None, *args, **kwargs):
    e = _ELASTIC
    if e is None:
        return None
    e.leader = recv_reqs is not None
    if not e.leader:
        return None
    level = e.controller.admit()
    for r in _generate_reqs(recv_reqs):
        r.extra_key = with_level(r.extra_key, level)
    if level == e.sent:
        return None
    e.sent = level
    return (receiver, recv_reqs, [*(local_reqs or []), Handed(level)], *args), kwargs


def received(result, receiver, *args, **kwargs):
    e = _ELASTIC
    if e is None or not result or not any(isinstance(r, Handed) for r in result):
        return None
    e.handed = [r for r in result if isinstance(r, Handed)][-1].level
    e.restamp = True
    if not e.leader:
        e.controller.follow(e.handed, time.monotonic())
    return [r for r in result if not isinstance(r, Handed)]


def admit(scheduler, *args, **kwargs):
    e = _ELASTIC
    if e is not None and e.restamp:
        for req in scheduler.waiting_queue:
            if not e.budgets.fixed(req):  # a retracted request ran: it keeps its level
                req.extra_key = with_level(req.extra_key, e.handed)
        e.restamp = False
    return None


def on_new_request(req, scheduler, *args, **kwargs):
    e = _ELASTIC
    if e is not None:
        e.arrivals[req] = time.monotonic()
    return req


def _tick(e: Elastic, scheduler, now: float) -> None:
    running = [e.budgets.budget(r) for r in getattr(scheduler.running_batch, "reqs", None) or []]
    before = e.controller.level
    if e.controller.tick(now, running, len(scheduler.waiting_queue)):
        logger.info("vskipper: elastic depth level %d -> %d: %s", before, e.controller.level, e.controller.reason)


def after_batch(result, scheduler, batch, *args, **kwargs):
    e = _ELASTIC
    if e is None or batch is None:
        return result
    now = time.monotonic()
    mode = batch.forward_mode
    if mode.is_decode() or mode.is_mixed():
        e.controller.decode_step(now, [e.budgets.budget(r) for r in batch.reqs], prefill=mode.is_mixed(),
                                 context=sum(r.seqlen for r in batch.reqs))
    elif mode.is_extend():
        e.controller.prefill()
    if mode.is_extend():
        for r in batch.reqs:
            t = e.arrivals.get(r)
            if t is not None and r.output_ids:
                e.controller.first_token(now - t)
                del e.arrivals[r]
    if e.leader:
        _tick(e, scheduler, now)
    return result


def after_idle(result, scheduler, *args, **kwargs):
    e = _ELASTIC
    if e is not None:
        e.controller.idle()
        if e.leader:
            _tick(e, scheduler, time.monotonic())
    return result
