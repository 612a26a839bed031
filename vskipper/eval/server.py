"""The servers `vskipper eval` talks to: one given by URL, or one it starts as `vskipper serve` would
(vskipper/serve.py's serve_command: same defaults, same validation) and stops when done.

    EvalError    bad input or an unreachable server: one line for the user, no traceback
    root_url     http://HOST:PORT from what the user typed (a trailing /v1 or / is dropped)
    Server       a started server: its URL, log file, stop()
    launch_server `vskipper serve` as a subprocess on a free port (start_server: and wait until ready)
    model_info   the served model's name and tokenizer path (GET /v1/models, /get_model_info)
    greedy       greedy answers to token-id prompts through SGLang's native /generate
    route_phases the server's routed-layer tokens by phase and route, from its /metrics
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import shlex
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

SERVE_HINT = "is a server running? start one with `vskipper serve`, or let `vskipper eval --serve` start one"


class EvalError(ValueError):
    """A problem with the user's input or servers, said in one line."""


def root_url(url: str) -> str:
    u = url.strip().rstrip("/")
    if u.endswith("/v1"):
        u = u[: -len("/v1")]
    p = urlparse(u)
    if p.scheme not in ("http", "https") or not p.netloc or p.path not in ("", "/"):
        raise EvalError(f"{url!r} is not a server URL; expected http://HOST:PORT (optionally ending in /v1)")
    return u


def _get(url: str, timeout: float = 10.0):
    import requests

    r = requests.get(url, timeout=timeout)
    r.raise_for_status()
    return r.json()


def model_info(root: str) -> dict:
    """{"name": the served model name, "model_path", "tokenizer": the server's paths (SGLang) or None}; EvalError
    naming the URL when nothing OpenAI-compatible answers there."""
    import requests

    try:
        models = _get(f"{root}/v1/models")
        name = models["data"][0]["id"]
    except requests.ConnectionError:
        raise EvalError(f"no server answers at {root}: expected an OpenAI-compatible server "
                        f"(GET {root}/v1/models); {SERVE_HINT}") from None
    except (requests.RequestException, ValueError, KeyError, IndexError, TypeError) as e:
        raise EvalError(f"{root} did not answer GET /v1/models as an OpenAI-compatible server does "
                        f"({type(e).__name__}: {e}); {SERVE_HINT}") from None
    info = {}
    try:  # SGLang says what it serves and where its tokenizer is
        info = _get(f"{root}/get_model_info")
    except (requests.RequestException, ValueError):
        pass
    return {"name": name, "model_path": info.get("model_path"),
            "tokenizer": info.get("tokenizer_path") or info.get("model_path")}


def _generate_one(root: str, ids: list[int], max_new_tokens: int, timeout: float) -> list[int]:
    import requests

    # return_logprob with logprob_start_len=0 makes SGLang prefill the whole prompt (no radix-cache
    # hit): the same prompt gets the same arithmetic every time it is asked, on either server.
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0,
                                                  "ignore_eos": False},
            "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 0}
    try:
        r = requests.post(f"{root}/generate", json=body, timeout=timeout)
    except requests.ConnectionError:
        raise EvalError(f"no server answers at {root} (POST /generate); {SERVE_HINT}") from None
    if r.status_code == 404:
        raise EvalError(f"{root} has no /generate: the greedy agreement asks SGLang's native API for token ids; "
                        f"serve the models with `vskipper serve` (SGLang)")
    if not r.ok:
        raise EvalError(f"{root}/generate answered {r.status_code}: {r.text[:300]}")
    out = r.json()
    if "output_ids" not in out:
        raise EvalError(f"{root}/generate did not return output_ids; the greedy agreement needs an SGLang server")
    return list(out["output_ids"])


def greedy(root: str, prompts: list[list[int]], max_new_tokens: int, concurrency: int = 1,
           timeout: float = 600.0, log=None) -> list[list[int]]:
    """Greedy answers (temperature 0, stopping at the model's end of sequence, at most
    `max_new_tokens` tokens) to token-id prompts. One request at a time by default: a batch's
    composition changes the float arithmetic, so answers sent alone are comparable across servers."""
    out: list[list[int] | None] = [None] * len(prompts)
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max(1, concurrency)) as pool:
        futs = {pool.submit(_generate_one, root, p, max_new_tokens, timeout): i for i, p in enumerate(prompts)}
        for done, f in enumerate(concurrent.futures.as_completed(futs), 1):
            out[futs[f]] = f.result()
            if log and (done % 10 == 0 or done == len(prompts)):
                log(f"  {root}: {done}/{len(prompts)} answers, {time.perf_counter() - t0:.0f} s")
    return out  # type: ignore[return-value]


PHASE_METRIC = "vskipper_routed_layer_phase_tokens_total"  # vskipper/integrations/sglang/runtime.py


def route_phases(root: str) -> dict[str, dict[str, float]] | None:
    """{phase: {route: tokens}} (phase prefill / decode, route run / project) summed over the routed layers,
    from the server's /metrics; None where it exports none (no skipper, started without --enable-metrics,
    or not an SGLang server with vskipper). The server exports its counts every few decode steps, so a
    reading can miss the last steps before it."""
    import re

    import requests

    try:
        r = requests.get(f"{root}/metrics", timeout=10)
    except requests.RequestException:
        return None
    if not r.ok:
        return None
    out: dict[str, dict[str, float]] = {}
    for m in re.finditer(rf"^{PHASE_METRIC}\{{([^}}]*)\}} (\S+)$", r.text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        out.setdefault(labels.get("phase", "?"), {})[labels.get("route", "?")] = float(m.group(2))
    return out or None


def phase_shares(before: dict | None, after: dict | None) -> dict[str, float | None] | None:
    """The skipped share per phase between two route_phases readings ({"prompt": ..., "generated": ...},
    None for a phase with no token in between); None without both readings."""
    if before is None or after is None:
        return None
    out = {}
    for phase, name in (("prefill", "prompt"), ("decode", "generated")):
        d = {k: after.get(phase, {}).get(k, 0.0) - before.get(phase, {}).get(k, 0.0) for k in ("run", "project")}
        out[name] = d["project"] / (d["run"] + d["project"]) if d["run"] + d["project"] > 0 else None
        out[f"{name}_tokens"] = d["run"] + d["project"]
    return out


def free_port(low: int = 12000, high: int = 21999) -> int:
    """A port free now for a server started later, taken below the kernel's ephemeral range (as
    SGLang picks its own; its range starts at 22000): a port from bind(0) is ephemeral, so between
    this check and the server's bind the kernel may hand it to another socket (SGLang's own
    connections among them), and the server then fails with "address already in use"."""
    import random

    for port in random.sample(range(low, high + 1), 64):
        try:
            with socket.socket() as s:
                s.bind(("0.0.0.0", port))
            return port
        except OSError:
            continue
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """A server this process started (its own process group)."""

    name: str
    url: str
    proc: subprocess.Popen
    log_path: Path
    model_path: str
    cmd: list[str] = field(default_factory=list)
    _store: Path | None = None

    def log_tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_ready(self, timeout: float) -> None:
        """Until /health answers 200; EvalError with the end of the log if the server exits or is late."""
        import requests

        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise EvalError(f"the {self.name} server exited with code {self.proc.returncode} before it was "
                                f"ready; its log ({self.log_path}) ends:\n{self.log_tail()}")
            try:
                if requests.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1)
        raise EvalError(f"the {self.name} server was not ready within {timeout:.0f} s (log {self.log_path})")

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
            except ProcessLookupError:
                pass
        if self._store is not None:
            self._store.unlink(missing_ok=True)


class _ServeArgs(argparse.Namespace):
    """`vskipper serve`'s parsed flags as serve_command reads them: the ones given here, and None (what
    argparse gives a flag left out) for every other, including flags added to `vskipper serve` later."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return None


def start_server(name: str, *, model_path: str | None, skipper: str | None, execution: str | None = None,
                 sglang_args: str = "", log_dir: Path, timeout: float = 600.0, log=None) -> Server:
    """launch_server, then wait until /health answers (the server stopped if it does not)."""
    srv = launch_server(name, model_path=model_path, skipper=skipper, execution=execution, sglang_args=sglang_args,
                        log_dir=log_dir, log=log)
    try:
        srv.wait_ready(timeout)
    except BaseException:
        srv.stop()
        raise
    return srv


def launch_server(name: str, *, model_path: str | None, skipper: str | None, execution: str | None = None,
                  sglang_args: str = "", log_dir: Path, log=None) -> Server:
    """`vskipper serve` with these options on 127.0.0.1 and a free port, as a subprocess in its own
    process group (its output in LOG_DIR/server-NAME.log); returns at once (Server.wait_ready waits).
    Bad options fail here, before SGLang starts, as they do for `vskipper serve`."""
    from vskipper.serve import serve_command

    extra = shlex.split(sglang_args or "")
    if any(a == "--port" or a.startswith("--port=") for a in extra):
        raise EvalError("--sglang-args: leave --port out; vskipper eval picks a free port")
    port = free_port()
    if "--sleep-on-idle" not in extra:  # an idle server (the base, while the model works) stays off the CPU
        extra.append("--sleep-on-idle")
    if "--enable-metrics" not in extra:  # its skip by phase (route_phases)
        extra.append("--enable-metrics")
    ns = _ServeArgs(skipper=skipper, model_path=model_path, execution=execution)
    cmd = serve_command(ns, ["--port", str(port), *extra])
    env = ns._env
    # serve_command names the rendezvous file after this process; two servers started from here need
    # one each.
    store = Path(tempfile.gettempdir()) / "vskipper-dist" / f"eval-{os.getpid()}-{name}-{port}"
    store.parent.mkdir(exist_ok=True)
    store.unlink(missing_ok=True)
    if not any(a in ("--tp", "--tp-size", "--dp", "--dp-size", "--nnodes") for a in extra):
        env["SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE"] = f"file://{store}"
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"server-{name}.log"
    host = cmd[cmd.index("--host") + 1] if "--host" in cmd else "127.0.0.1"
    with open(log_path, "w") as f:
        f.write("vskipper eval: " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    srv = Server(name, f"http://{host}:{port}", proc, log_path, cmd[cmd.index("--model-path") + 1], cmd, store)
    if log:
        log(f"{name} server: starting on port {port} (log {log_path})")
    return srv
