"""What happens inside SGLang's model runner after the weights load: transform the model, and
log per-layer skip statistics every N decode steps (read after a runner step, never inside the
model's forward: the route counters stay on the device, and a captured decode graph updates them
on every replay)."""
from __future__ import annotations

import logging
import os
import time
import weakref

import torch

import vskipper
from vskipper.api import chosen_bodies
from vskipper.control import COUNTS
from vskipper.counters import PHASES
from vskipper.integrations.sglang.settings import Settings
from vskipper.skippers import parse_skipper

logger = logging.getLogger("vskipper")
EXPORT_INTERVAL = 8  # decode steps between /metrics updates where no stats line is asked for (--enable-metrics alone)


def transform_loaded(runner) -> None:
    model = runner.model
    if getattr(runner, "is_draft_worker", False):
        logger.info("vskipper: the draft model runner (speculative decoding) is left untransformed; "
                    "the skipper applies to the target model")
        return
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
        if settings.tpot_ms is not None:
            raise ValueError(f"VSKIPPER_TPOT_MS={settings.tpot_ms:g} sets a latency target for elastic depth, which "
                             f"needs a skipper; this model has none (set VSKIPPER_SKIPPER or serve a skip-aware "
                             f"checkpoint, or unset VSKIPPER_TPOT_MS)")
        return  # a stock model and no skipper: served unchanged
    if settings.threshold is not None:
        from vskipper.skippers.flexidepth import FlexiDepth

        if not isinstance(skipper, FlexiDepth):
            raise ValueError(f"VSKIPPER_THRESHOLD={settings.threshold!r} applies to a FlexiDepth router's gate; "
                             f"{type(skipper).__name__} decides without one (unset VSKIPPER_THRESHOLD)")
        skipper.threshold = settings.threshold
    check_supported(runner, skipper.layers)
    from vskipper.integrations.sglang import requests

    budgets = requests.make_budgets(runner, len(skipper.layers))
    vskipper.transform(model, skipper, settings.config(), budgets=budgets)
    bodies = sorted({b.name for b in model.vskipper.bodies.values()})
    cost_state = ("calibrated for this device, picks dense/routed per step" if bodies == ["auto"] else
                  "not calibrated for this device, so dense-masked (run `vskipper calibrate`)"
                  if settings.execution == "auto" else f"not used (execution={settings.execution})")
    logger.info("vskipper: transformed %s with %s [%s], routed layers %s, %s; cost model: %s", type(model).__name__,
                type(skipper).__name__, settings.skipper_spec or "the checkpoint's own", list(skipper.layers),
                settings.config(), cost_state)
    logger.info("%s", vskipper.explain(model))
    if settings.target() is not None:
        from vskipper.integrations.sglang import elastic

        elastic.install(runner, model, settings.target(), budgets, settings.elastic_trace)
    if settings.stats_interval or os.environ.get("PROMETHEUS_MULTIPROC_DIR"):  # the log line, or /metrics alone
        install_stats_logger(runner, settings.stats_interval or EXPORT_INTERVAL, log=bool(settings.stats_interval))
    if settings.route_digest:
        from sglang.srt.runtime_context import get_parallel

        install_route_digest(model, settings.route_digest, get_parallel().tp_rank)


def format_phases(st: dict[int, dict[str, int]]) -> str:
    """The skipped share per phase: prompt tokens (prefill) and generated tokens (decode), each over its
    routed-layer tokens ("-" where a phase counted none)."""
    from vskipper.counters import skipped_share

    parts = []
    for phase in PHASES:
        share = skipped_share(st, phase)
        tokens = sum(s[f"{phase}_tokens"] for s in st.values())
        parts.append(f"{phase} {'-' if share is None else f'{share:.3f}'} over {tokens}")
    return ", ".join(parts)


def format_stats(st: dict[int, dict[str, int]]) -> str:
    """The skipped share of routed-layer work, in all, per phase (prompt tokens: prefill, generated tokens:
    decode) and per layer; for a sublayer skipper (counts in sublayer decisions, two per token) the share
    of routed sublayers, and attention's and the MLP's apart."""
    tokens = sum(s["tokens"] for s in st.values())
    skipped = sum(s["project"] for s in st.values())
    decisions = sum(s["run"] + s["project"] for s in st.values())
    per_layer = " ".join(f"{l}:{s['project'] / max(1, s['run'] + s['project']):.2f}" for l, s in st.items())
    phases = format_phases(st)
    if any("mlp_skip" in s for s in st.values()):
        attn, mlp = (sum(s[k] for s in st.values()) / max(1, tokens) for k in ("attention_skip", "mlp_skip"))
        return (f"skip ratio {skipped / max(1, decisions):.3f} of routed sublayers (attention {attn:.3f}, MLP "
                f"{mlp:.3f}) over {tokens} routed-layer tokens ({phases}); per layer {per_layer}")
    return (f"skip ratio {skipped / max(1, decisions):.3f} over {tokens} routed-layer tokens ({phases}); "
            f"per layer {per_layer}")


def setting_totals(by: dict[str, dict[int, dict[str, int]]]) -> dict[str, dict[str, int]]:
    """vskipper.stats(model, by_setting=True) summed over the routed layers: {setting: {count: n}}."""
    return {s: {k: sum(c[k] for c in layers.values()) for k in COUNTS} for s, layers in by.items()}


def level_tokens(by: dict[str, dict[int, dict[str, int]]]) -> list[int]:
    """Tokens per elastic level (vskipper.stats(model, by_setting=True)'s "level j" at the shallowest
    routed layer, which every token passes once)."""
    out = []
    for j in range(len(by)):
        layers = by.get(f"level {j}")
        if layers is None:
            break
        out.append(layers[min(layers)]["tokens"] if layers else 0)
    return out


def format_settings(by: dict[str, dict[int, dict[str, int]]]) -> str:
    """Skip ratio and rows forced to RUN per request setting (vskipper/control.py), settings seen only."""
    parts = [f"{s} {t['project'] / max(1, t['run'] + t['project']):.3f} over {t['tokens']} "
             f"(forced to run {t['forced']})" for s, t in setting_totals(by).items()
             if t["tokens"] and not s.startswith("level ")]
    return "by request setting: " + (", ".join(parts) if parts else "none")


class PrometheusExport:
    """Per-layer route counters exported through SGLang's Prometheus endpoint (--enable-metrics):
    SGLang runs prometheus_client in multiprocess mode, so a counter created in the scheduler
    process is served by /metrics. Metrics: vskipper_routed_layer_tokens_total{layer, route} and,
    summed over the routed layers, vskipper_routed_layer_phase_tokens_total{phase, route} (phase: prefill =
    prompt tokens, decode = generated tokens; route: run, project) and
    vskipper_request_setting_tokens_total{setting, route} (setting: default, capped, no_skip; route: run,
    project, forced = rows a request's setting forced to RUN)."""

    def __init__(self) -> None:
        from prometheus_client import Counter

        self.counter = Counter("vskipper_routed_layer_tokens_total",
                               "Tokens that reached a routed layer, by route (run / project / nonfinite)",
                               ["layer", "route"])
        self.by_setting = Counter("vskipper_request_setting_tokens_total",
                                  "Routed-layer tokens by their request's setting and route (run / project / forced)",
                                  ["setting", "route"])
        self.by_phase = Counter("vskipper_routed_layer_phase_tokens",
                                "Routed-layer tokens summed over the routed layers, by phase (prefill: prompt "
                                "tokens, decode: generated tokens) and route (run / project)", ["phase", "route"])
        self.last: dict[tuple, int] = {}
        self.gauges = None

    def update_elastic(self, e, tokens: list[int], now: float) -> None:
        """Elastic depth (integrations/sglang/elastic.py): vskipper_elastic_level, _target_tpot_ms and
        _p90_tpot_ms (gauges), vskipper_elastic_seconds_total{level} and vskipper_elastic_tokens_total{level}
        (tokens that went through the routed layers with that level's cap)."""
        from prometheus_client import Counter, Gauge

        if self.gauges is None:
            gauge = lambda name, doc: Gauge(f"vskipper_elastic_{name}", doc, multiprocess_mode="mostrecent")  # noqa: E731
            self.gauges = {name: gauge(name, doc) for name, doc in (
                ("level", "Elastic depth: the level requests are admitted at now (0 = the base model's function)"),
                ("target_tpot_ms", "Elastic depth: the TPOT target (ms)"),
                ("p90_tpot_ms", "Elastic depth: p90 TPOT of a stream over the recent decode steps (ms)"))}
            self.seconds = Counter("vskipper_elastic_seconds", "Elastic depth: seconds spent at each level", ["level"])
            self.tokens = Counter("vskipper_elastic_tokens", "Elastic depth: tokens served with each level's cap",
                                  ["level"])
        c = e.controller
        self.gauges["level"].set(c.level)
        self.gauges["target_tpot_ms"].set(c.target.tpot_ms)
        if c.observed() is not None:
            self.gauges["p90_tpot_ms"].set(c.observed())
        for j, (sec, n) in enumerate(zip(c.time_per_level(now), tokens)):
            last = self.last.get(("elastic_s", j), 0.0)
            if sec > last:
                self.seconds.labels(level=str(j)).inc(sec - last)
            self.last[("elastic_s", j)] = sec
            self._inc(self.tokens, ("elastic_tokens", j), n, level=str(j))

    def _inc(self, counter, key: tuple, value: int, **labels) -> None:
        delta = value - self.last.get(key, 0)
        if delta > 0:
            counter.labels(**labels).inc(delta)
        self.last[key] = value

    def update(self, st: dict[int, dict[str, int]], by: dict | None = None) -> None:
        for layer, s in st.items():
            for route in ("run", "project", "nonfinite"):
                self._inc(self.counter, (layer, route), s[route], layer=str(layer), route=route)
        for phase in PHASES:
            for route in ("run", "project"):
                self._inc(self.by_phase, ("phase", phase, route), sum(s[f"{phase}_{route}"] for s in st.values()),
                          phase=phase, route=route)
        for setting, t in setting_totals(by or {}).items():
            if setting.startswith("level "):
                continue  # elastic depth's own export (update_elastic)
            for route in ("run", "project", "forced"):
                self._inc(self.by_setting, (setting, route), t[route], setting=setting, route=route)


def check_supported(runner, routed) -> None:
    """Fail at load, naming the layer or flag, for what the routed layers cannot run yet: quantized
    linears (the routed bodies read plain weights) and a quantized KV cache (K/V are written
    without scales)."""
    kv = getattr(getattr(runner, "server_args", None), "kv_cache_dtype", "auto")
    if kv not in ("auto", None, "bfloat16", "float16", "float32"):
        raise NotImplementedError(f"vskipper: --kv-cache-dtype {kv} is not supported (routed layers write K/V "
                                  f"without scales); serve with --kv-cache-dtype auto")
    layers = runner.model.model.layers
    for i in (i for i in routed if i < len(layers)):  # (out of range: transform names it)
        for name, module in layers[i].named_modules():
            method = getattr(module, "quant_method", None)
            if method is not None and type(method).__name__ != "UnquantizedLinearMethod":
                raise NotImplementedError(f"vskipper: model.layers.{i}.{name} is quantized ({type(method).__name__}); "
                                          f"vskipper's routed layers support unquantized (bf16/fp16/fp32) models only")


class StatsReporter:
    """Counts decode steps after each model-runner step and, every `interval`, reads the route
    counters (a host read, outside the model's forward, never while SGLang captures a graph), logs
    them (`log`) and updates the Prometheus export (where SGLang runs with --enable-metrics)."""

    def __init__(self, model, interval: int, log: bool = True) -> None:
        self.model, self.interval, self.steps, self.log = model, interval, 0, log
        self.export = PrometheusExport() if os.environ.get("PROMETHEUS_MULTIPROC_DIR") else None

    def after_step(self, forward_batch) -> None:
        from sglang.srt.model_executor.runner_utils.capture_mode import get_is_capture_mode

        if forward_batch is None or get_is_capture_mode() or not forward_batch.forward_mode.is_decode():
            return
        self.steps += 1
        if self.steps % self.interval == 0:
            st, by = vskipper.stats(self.model), vskipper.stats(self.model, by_setting=True)
            bodies = chosen_bodies(self.model)
            chosen = (f"; auto ran {', '.join(f'{b} {n}' for b, n in bodies.items())} layer-steps" if bodies else "")
            plain = sum(getattr(layer, "plain_steps", 0) for layer in self.model.model.layers)
            if plain:
                chosen += f"; {plain} layer-steps ran as SGLang's layers (every row at budget 0)"
            from vskipper.integrations.sglang.elastic import current

            e, now = current(), time.monotonic()
            tokens = level_tokens(by)
            elastic = (f"; {e.controller.describe(now)}; tokens per level "
                       + " ".join(f"{j}:{n}" for j, n in enumerate(tokens) if n) if e is not None else "")
            if self.log:
                logger.info("vskipper: after %d decode steps: %s; %s%s%s", self.steps, format_stats(st),
                            format_settings(by), chosen, elastic)
            if self.export is not None:
                self.export.update(st, by)
                if e is not None:
                    self.export.update_elastic(e, tokens, now)


_REPORTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model runner -> its StatsReporter


def install_stats_logger(runner, interval: int, log: bool = True) -> None:
    _REPORTERS[runner] = StatsReporter(runner.model, interval, log)


def reporter_of(runner) -> StatsReporter | None:
    return _REPORTERS.get(runner)


def install_route_digest(model, directory: str, rank: int) -> None:
    """Append, for every call of a routed layer's route counter, `layer call digest` to
    <directory>/tp<rank>-<pid>.txt: a hash of the layer's RUN decisions over the real rows. Ranks of
    one tensor-parallel model must write the same lines. Reads the decisions on the host: a test
    and debugging aid, not for captured graphs."""
    import hashlib
    from pathlib import Path

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    out = path / f"tp{rank}-{os.getpid()}.txt"
    calls: dict[int, int] = {}

    def hook(module, args, layer):
        run, valid = args[0], args[1]  # run [T] (a sublayer skipper's [T, 2]), valid [T]
        bits = (run & valid.reshape(valid.shape + (1,) * (run.dim() - valid.dim()))).reshape(-1)
        bits = bits.to(torch.uint8).cpu().numpy().tobytes()
        calls[layer] = calls.get(layer, 0) + 1
        with out.open("a") as f:
            f.write(f"{layer} {calls[layer]} {hashlib.sha1(bits).hexdigest()[:16]}\n")

    for key, counter in model.vskipper.counters.items():
        counter.register_forward_pre_hook(lambda m, a, _l=int(key): hook(m, a, _l))
