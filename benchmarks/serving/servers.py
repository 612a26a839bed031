"""Start and stop SGLang servers for benchmarks: upstream (the stock model, nothing transformed)
or with vskipper (a skipper spec, or a skip-aware checkpoint); the systems the serving benchmarks
compare, and the settings every one of their servers shares."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vskipper.eval.server import free_port  # noqa: F401 (the benchmarks and tests import it from here)

# One CPU thread per server (OMP_NUM_THREADS), in every serving benchmark: with torch's default of
# one per core, a server on the shared 2-CPU machine ran 5-13x slower whenever another process held
# a core, its OpenMP threads waiting on each other (benchmarks/README.md, "Measurements behind the
# settings").
SERVER_THREADS = 1


@dataclass(frozen=True)
class System:
    """One server configuration. skipper=None serves the model unchanged (upstream SGLang).
    opted_out: the share of its requests the benchmark client sends with {"vskipper": {"skip": false}}
    (every request's base-model answer; vskipper/control.py), spread evenly over the request order."""

    name: str
    model_path: str
    skipper: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    label: str = ""  # how a verdict names it, e.g. "RandomSkip(0.5)"
    opted_out: float = 0.0
    args: tuple[str, ...] = ()  # more `sglang.launch_server` flags, e.g. ("--chunked-prefill-size", "512")


def default_systems(model: str | None = None, skipper: str | None = None) -> list[System]:
    """The systems the serving benchmarks compare: upstream, vskipper at rate 0 (the same engine path
    with nothing skipped), vskipper with the skipper under test (default RandomSkip 0.5 over the
    second half of the layers) and, on the bundled SmolLM2-135M with the default skipper, the
    FlexiDepth skipper shipped for it. ValueError for a bad skipper spec (before any server starts)."""
    from vskipper.models.checkpoint import read_config
    from vskipper.skippers import parse_skipper

    trained = None
    if model is None:
        from vskipper.models.smollm2 import smollm2_dir
        from vskipper.skippers.shipped import DEFAULT

        model = str(smollm2_dir())
        trained = f"flexidepth:name={DEFAULT}"  # trained for exactly this model
    n = read_config(model)["num_hidden_layers"]
    layers = f"{n // 2}-{n - 1}"
    spec = skipper or f"random:rate=0.5,layers={layers},seed=0"
    label = type(parse_skipper(spec)).__name__ if skipper is not None else "RandomSkip(0.5)"
    systems = [System("upstream", model, label="upstream"),
               System("vskipper-rate0", model, f"random:rate=0,layers={layers}", label="rate 0"),
               System("vskipper", model, spec, label=f"vskipper {label}")]
    if trained is not None and skipper is None:
        systems.append(System("vskipper-trained", model, trained, label="trained FlexiDepth"))
    return systems


@dataclass
class Server:
    system: System
    port: int
    proc: subprocess.Popen
    log_path: Path
    extra: dict = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def start(system: System, log_dir: Path, max_total_tokens: int = 32768, timeout: float = 300,
          threads: int | None = None, log_level: str = "warning", launched: list | None = None) -> Server:
    """Launch `python -m sglang.launch_server` for `system` and wait until /health answers.
    --sleep-on-idle keeps an idle server off the CPU, so several can stay up and be measured in
    turn on a small machine. threads: the server's CPU threads (OMP_NUM_THREADS; None: torch's
    default, one per core)."""
    port = free_port()
    env = dict(os.environ)
    env.pop("VSKIPPER_SKIPPER", None)
    if system.skipper:
        env["VSKIPPER_SKIPPER"] = system.skipper
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    if "SGLANG_DISABLED_MODEL_ARCHS" not in env and (unused := unused_model_modules(system.model_path)):
        env["SGLANG_DISABLED_MODEL_ARCHS"] = ",".join(unused)
    env.update(dict(system.env))
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", system.model_path, "--host", "127.0.0.1",
           "--port", str(port), "--sleep-on-idle", "--max-total-tokens", str(max_total_tokens),
           "--log-level", log_level]
    if not torch.cuda.is_available():
        env["SGLANG_PLATFORM"] = "vskipper_cpu"
        # --mem-fraction-static: on CPU SGLang sizes the KV pool from host memory free after loading,
        # less a slack of (1 - fraction) x what was free before; with several servers starting at once
        # the others' loading eats into it (the sixth server of the elastic ramp failed with "no memory
        # for the KV cache" at the default). The pool is capped by --max-total-tokens anyway.
        cmd += ["--device", "cpu", "--dtype", "float32", "--attention-backend", "torch_native",
                "--mem-fraction-static", "0.95"]
    cmd += list(system.args)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"server-{system.name}.log"
    log = open(log_path, "w")
    env["SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE"] = f"file://{log_dir.resolve() / f'dist-store-{port}'}"
    (log_dir / f"dist-store-{port}").unlink(missing_ok=True)
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = Server(system, port, proc, log_path)
    if launched is not None:  # so that a caller interrupted while we wait can stop it
        launched.append(server)
    problem = wait_healthy(server.url, proc, timeout)
    if problem is None:
        return server
    stop(server)
    raise RuntimeError(f"server {system.name} {problem}; see {log_path}")


def unused_model_modules(model_path: str) -> list[str]:
    """SGLang's model modules (sglang/srt/models/*.py) whose source names none of the checkpoint's
    architectures, for SGLANG_DISABLED_MODEL_ARCHS: SGLang's own switch for not importing them.
    Every process of a server imports all ~250 of them at start-up otherwise (about 4 s of CPU per
    process on the 2-CPU machine). Only start-up changes, for every system alike. [] when an
    architecture is named by no module (then SGLang looks for it everywhere, as usual) or the config
    cannot be read."""
    import importlib.util

    try:
        from vskipper.models.checkpoint import read_config

        archs = read_config(model_path).get("architectures") or []
        spec = importlib.util.find_spec("sglang.srt.models")
    except Exception:  # noqa: BLE001 - not our call to make then: SGLang reports a bad model itself
        return []
    if not archs or spec is None or not spec.submodule_search_locations:
        return []
    root = Path(list(spec.submodule_search_locations)[0])
    mods = {f.stem: f.read_text(errors="replace") for f in sorted(root.glob("*.py")) if f.stem != "__init__"}
    named = {m for m, text in mods.items() if any(a in text for a in archs)}
    if not all(any(a in mods[m] for m in named) for a in archs):
        return []
    return [m for m in mods if m not in named and m != "registry"]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> str | None:
    """Wait until `url`/health answers 200: None then, else what went wrong (the process exited,
    or the time ran out)."""
    import requests

    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            return f"exited with {proc.returncode} before it was healthy"
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return None
        except requests.RequestException:
            pass
        time.sleep(1)
    return f"not healthy after {timeout:.0f} s"


def start_all(systems: list[System], log_dir: Path, max_total_tokens: int = 32768, timeout: float = 300,
              on_ready=None, **kwargs) -> dict[str, Server]:
    """Start every system's server at once (their start-up is mostly imports and loading, which
    overlap well even on 2 CPUs) and wait for all; if one fails, stop the others and raise.
    on_ready(name) is called as each one becomes healthy; kwargs go to `start`."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    servers, errors, launched = {}, [], []
    with ThreadPoolExecutor(len(systems)) as ex:
        futures = {ex.submit(start, s, log_dir, max_total_tokens, timeout, launched=launched, **kwargs): s.name
                   for s in systems}
        try:
            for f in as_completed(futures):
                try:
                    servers[futures[f]] = f.result()
                    if on_ready is not None:
                        on_ready(futures[f])
                except Exception as e:  # noqa: BLE001 - collected, the others stopped, then raised
                    errors.append(str(e))
        except BaseException:  # interrupted (SIGTERM, Ctrl-C) while servers start: none may outlive us
            for srv in list(launched):
                stop(srv)
            raise
    if errors:
        for srv in servers.values():
            stop(srv)
        raise RuntimeError("; ".join(errors))
    return servers


def memory_gb(server: Server) -> float:
    """Proportional set size of the server's process tree (shared pages split among sharers), GB."""
    import psutil

    try:
        p = psutil.Process(server.proc.pid)
        return sum(c.memory_full_info().pss for c in [p] + p.children(recursive=True)) / 1e9
    except psutil.Error:
        return float("nan")


def transform_line(server: Server) -> str | None:
    """The line the server logged when vskipper transformed its model (skipper, routed layers,
    cost model state), or None (an upstream server, or a log level above info)."""
    try:
        lines = server.log_path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    found = [x for x in lines if "vskipper: transformed" in x]
    return found[-1][found[-1].index("vskipper: transformed"):] if found else None


def stop(server: Server) -> None:
    if server.proc.poll() is None:
        os.killpg(server.proc.pid, signal.SIGTERM)
        try:
            server.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait()
