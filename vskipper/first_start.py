"""What `vskipper serve` does around SGLang's start: a cost calibration for the server's settings,
measured before the port opens when there is none, and one line, once the server answers, that says
in plain words what it does.

Why before the port opens, not in the background: what a routed layer runs is decided when the
model is transformed, at load (and under CUDA graphs, fixed per captured batch size then); a
calibration that lands after the load would leave that server on the dense-masked body until its
next start. Sized to what the server sees, it takes about a minute for a small model on a CPU; it
is cached (per device, thread count, shape, dtype and versions), so a second start reuses it.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import torch

from vskipper import cost

CPU_MAX_BATCH = 64  # decode batch sizes timed on a CPU unless --max-running-requests says more
CPU_PREFILL_T = (16, 64, 256)  # prompt lengths timed on a CPU (beyond the table: linear in T)
CPU_CONTEXTS = (256, 1024, 4096)  # the decode table's context axis on a CPU (beyond: linear in the context)
PROBE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def serve_threads(threads: int | None) -> int:
    """The CPU threads a server runs with: --threads, else OMP_NUM_THREADS, else torch's default
    (what `vskipper calibrate` assumes too)."""
    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads {threads}: expected an integer >= 1")
        return threads
    return torch.get_num_threads()


def ensure_calibration(model_path: str, device: str, dtype: str, threads: int, max_batch: int,
                       log=print, sublayers: bool = False) -> tuple[cost.Calibration, cost.Calibration, str]:
    """(decode table, prefill table, what happened) for this device at `threads` threads and this
    model's shape: the cached ones if both are there, else measured now (the decode batch sizes up to
    `max_batch`) and cached. sublayers: a sublayer skipper's tables (only those: its layers read no
    others). Progress on stderr with an ETA."""
    from vskipper.calibrate import measure, shape_of

    if device == "cpu":
        torch.set_num_threads(threads)
    hidden, inter, heads, kv = shape_of(model_path)
    found = {}
    for phase in cost.PHASES:
        cal = cost.load(device, hidden, inter, dtype, phase=phase, exact=True, sublayers=sublayers)
        if cal is not None:
            found[phase] = cal
    where = cost.cache_dir() / (cost.cache.slug(cost.device_name(device)) + ".json")
    if len(found) == len(cost.PHASES):
        return found["decode"], found["prefill"], f"reused from {where}"
    missing = [p for p in cost.PHASES if p not in found]
    what = "sublayer cost calibration" if sublayers else "cost calibration"
    log(f"vskipper: no {what} for {cost.device_name(device)} ({hidden}x{inter}, {dtype}) yet: measuring "
        f"{' and '.join(missing)} before the server starts (once; cached in {where}; --no-calibrate skips it)")
    t0 = time.perf_counter()
    on_cpu = device == "cpu"
    for phase in missing:
        ts = (tuple(t for t in cost.GRID_T if t <= max(2, max_batch)) if phase == "decode"
              else CPU_PREFILL_T if on_cpu else cost.PREFILL_T)
        cal, _ = measure(hidden, inter, heads, kv, device=device, dtype=getattr(torch, dtype), ts=ts,
                         repeats=3 if on_cpu else 6, passes=2 if on_cpu else 3, phase=phase, sublayers=sublayers,
                         contexts=(CPU_CONTEXTS if on_cpu else cost.GRID_C) if phase == "decode" else None)
        cost.save(cal)
        found[phase] = cal
    return found["decode"], found["prefill"], f"measured now in {time.perf_counter() - t0:.0f} s, cached in {where}"


def _ranges(plan: dict[int, str]) -> str:
    """{T: body} over increasing T -> 'routed at 1-2, dense at 4, routed at 8-64'."""
    parts: list[list] = []
    for T, body in plan.items():
        if parts and parts[-1][0] == body:
            parts[-1][2] = T
        else:
            parts.append([body, T, T])
    return ", ".join(f"{b} at {lo}" if lo == hi else f"{b} at {lo}-{hi}" for b, lo, hi in parts)


def bodies_line(decode: cost.Calibration, prefill: cost.Calibration, expected: float | None, max_batch: int) -> str:
    """Which body auto picks per phase and batch size at the skipper's expected RUN fraction (decode: at
    the smallest context timed), and V*, the break-even resident K/V per batch size of the table."""
    from vskipper.calibrate import break_even_line

    f = 0.5 if expected is None else expected
    sizes = [T for T in PROBE_SIZES if T <= max(2, max_batch)]
    dec = _ranges({T: decode.choose(T, f) for T in sizes})
    pre = _ranges({T: prefill.choose(T, f) for T in prefill.ts})
    where = f" at {decode.context} resident K/V tokens per row" if len(decode.contexts) > 1 else ""
    vstar = break_even_line(decode, f, [T for T in decode.ts if T <= max(2, max_batch)])
    return (f"at a RUN fraction of {f:g} ({'declared by the skipper' if expected is not None else 'assumed'}): "
            f"decode batch {dec}{where}; prefill of {pre} tokens; {vstar}")


def run(cmd: list[str], env: dict, host: str, port: int, announce: str, timeout: float = 3600.0) -> int:
    """Run SGLang's server as a child, print `announce` once it answers /health, then wait for it;
    SIGTERM and SIGINT are passed on to it. Returns its exit status."""
    import requests

    proc = subprocess.Popen(cmd, env=env)

    def forward(signum, frame):
        if proc.poll() is None:
            proc.send_signal(signum)

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, forward)
    t0 = time.perf_counter()
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}/health"
    while proc.poll() is None and time.perf_counter() - t0 < timeout:
        try:
            if requests.get(url, timeout=2).status_code == 200:
                print(f"{announce}; ready in {time.perf_counter() - t0:.0f} s at http://{host}:{port}",
                      file=sys.stderr, flush=True)
                break
        except requests.RequestException:
            pass
        time.sleep(1)
    return proc.wait()


def flag_value(args: list[str], flag: str, default=None):
    """The value of `--flag V` or `--flag=V` in a command line, else default."""
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return default


def prepare(cmd: list[str], env: dict, settings, model_path: str, on_cpu: bool, threads: int | None,
            no_calibrate: bool, log=None) -> str:
    """Before SGLang starts: the server's CPU threads (OMP_NUM_THREADS in `env`), its cost calibration
    when it skips with execution auto (measured now if there is none, unless `no_calibrate`), and the
    line that says what the server will do, printed once it answers."""
    from vskipper.models.checkpoint import DD_ARCHITECTURES, read_config, skipper_fields

    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    where = "cuda"
    if on_cpu:
        threads = serve_threads(threads)
        env["OMP_NUM_THREADS"] = str(threads)
        where = f"cpu, {threads} thread{'s' if threads != 1 else ''}"
    from vskipper.skippers.skipgpt import ARCHITECTURE as SKIPGPT

    cfg = read_config(model_path)
    arch = (cfg.get("architectures") or [None])[0]
    if arch in DD_ARCHITECTURES:
        from vskipper.skippers.flexidepth import FlexiDepth

        skipper, what = FlexiDepth.from_fields(skipper_fields(cfg, model_path)), "its own FlexiDepth skipper"
    elif arch == SKIPGPT:
        from vskipper.skippers.skipgpt import SkipGPT, fields

        layers = fields(cfg, model_path)[0]
        with torch.device("meta"):  # what it routes and how, not its weights
            skipper = SkipGPT(range(cfg["num_hidden_layers"]) if layers is None else layers, cfg["hidden_size"])
        what = "its own SkipGPT skipper"
    elif settings.skipper_spec:
        from vskipper.skippers import parse_skipper

        skipper, what = parse_skipper(settings.skipper_spec), settings.skipper_spec
    else:
        return f"vskipper: serving {model_path} unchanged (no skipper), {where}"
    layers = list(skipper.layers)
    head = f"vskipper: serving {model_path} with {what} on layers {layers[0]}-{layers[-1]}, {where}"
    if settings.tpot_ms is not None:
        head += f"; elastic depth to a TPOT target of {settings.tpot_ms:g} ms"
    if settings.execution != "auto" and settings.tpot_ms is None:  # (elastic depth prices levels by the calibration)
        return f"{head}; every routed layer runs its {settings.execution} body (--execution)"
    device = "cpu" if on_cpu else "cuda"
    dtype = flag_value(cmd, "--dtype", "auto")
    dtype = dtype if dtype in ("float32", "float16", "bfloat16") else "float32" if on_cpu else "bfloat16"
    max_batch = int(flag_value(cmd, "--max-running-requests", 0) or (CPU_MAX_BATCH if on_cpu else cost.GRID_T[-1]))
    sublayers = bool(skipper.sublayers)  # a sublayer skipper's layers are priced by sublayer tables only
    if no_calibrate:
        hidden, inter = cfg.get("hidden_size"), cfg.get("intermediate_size")
        decode, prefill = (cost.load(device, hidden, inter, dtype, phase, exact=True, sublayers=sublayers)
                           for phase in cost.PHASES)
        if decode is None:
            return (f"{head}; NOT CALIBRATED for {cost.device_name(device)}, so every routed layer runs dense-masked "
                    f"(the skipper's answers, none of its speed): drop --no-calibrate, or run `vskipper calibrate "
                    f"--model {model_path}{f' --threads {threads}' if on_cpu else ''}"
                    f"{' --sublayers' if sublayers else ''}`"
                    + ("; elastic depth stays at level 0 without it" if settings.tpot_ms is not None else ""))
        how = "reused"
    else:
        decode, prefill, how = ensure_calibration(model_path, device, dtype, threads or 0, max_batch, log, sublayers)
    bodies = bodies_line(decode, prefill or decode, skipper.expected_run_fraction, max_batch)
    return f"{head}; bodies chosen by the cost model {bodies}; calibration {how}"
