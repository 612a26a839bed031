"""`vskipper serve`'s command line: the flags validated, the skipper and checkpoint checked, SGLang's
server command and environment built (`serve_command`), before SGLang starts. Used by `vskipper serve`
(vskipper/cli.py) and by `vskipper eval --serve` (vskipper/eval/server.py); it imports neither."""
from __future__ import annotations

import argparse
import os
import sys

CPU_DEFAULTS = {  # SGLang flags for a machine without a GPU (docs/architecture.md), unless the user gives them
    "--device": "cpu",
    "--dtype": "float32",
    "--attention-backend": "torch_native",
    "--max-total-tokens": "16384",
}


MULTI_RANK_FLAGS = ("--tp", "--tp-size", "--dp", "--dp-size", "--pp", "--pp-size", "--nnodes", "--dist-init-addr")


def private_rendezvous(env: dict) -> None:
    """One rank: torch.distributed rendezvous through a private file instead of a TCPStore, which
    listens on every interface whatever host SGLang gives it. The file is named after this process,
    which runs the server as its child and lives as long as it; files of dead servers are removed here."""
    if "SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE" in env:
        return
    import tempfile
    from pathlib import Path

    import psutil

    d = Path(tempfile.gettempdir()) / "vskipper-dist"
    d.mkdir(exist_ok=True)
    for f in d.glob("store-*"):
        pid = f.name.removeprefix("store-")
        if not (pid.isdigit() and psutil.pid_exists(int(pid))):
            f.unlink(missing_ok=True)
    env["SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE"] = f"file://{d / f'store-{os.getpid()}'}"


def _has_flag(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def fail(msg: str) -> None:
    print(f"vskipper: error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def serve_command(args: argparse.Namespace, sglang_args: list[str]) -> list[str]:
    """Validate everything we can before SGLang starts, then return the server command line."""
    import torch

    from vskipper.integrations.sglang.settings import Settings
    from vskipper.models.checkpoint import SKIPPER_ARCHITECTURES, CheckpointError, read_config

    env = dict(os.environ)
    if args.skipper == "none":  # the plain model, whatever the default or the environment says
        env.pop("VSKIPPER_SKIPPER", None)
    elif args.skipper:
        env["VSKIPPER_SKIPPER"] = args.skipper
    elif args.model_path is None and not env.get("VSKIPPER_SKIPPER"):
        from vskipper.skippers.shipped import DEFAULT  # trained for the bundled model

        env["VSKIPPER_SKIPPER"] = f"flexidepth:name={DEFAULT}"  # first contact: the bundled model, skipping
    if args.execution:
        env["VSKIPPER_EXECUTION"] = args.execution
    if args.stats_interval is not None:
        env["VSKIPPER_STATS_INTERVAL"] = str(args.stats_interval)
    if args.threshold is not None:
        env["VSKIPPER_THRESHOLD"] = args.threshold
    from vskipper.elastic import parse_ms

    for flag, value, var in (("--tpot-ms", args.tpot_ms, "VSKIPPER_TPOT_MS"),
                             ("--ttft-ms", args.ttft_ms, "VSKIPPER_TTFT_MS")):
        if value is not None:
            try:
                parse_ms(flag, value)
            except ValueError as e:
                fail(str(e))
            env[var] = value
    if args.ttft_ms is not None and not env.get("VSKIPPER_TPOT_MS"):
        fail("--ttft-ms is a target of elastic depth, which --tpot-ms turns on; give --tpot-ms too")
    try:
        settings = Settings.from_env(env)  # a malformed skipper spec fails here, naming the field
    except ValueError as e:
        fail(str(e))
    model_path = args.model_path
    if model_path is None:
        from vskipper.models.smollm2 import smollm2_dir

        model_path = str(smollm2_dir())
        arch = None
    else:
        try:
            arch = (read_config(model_path).get("architectures") or [None])[0]
        except CheckpointError as e:
            fail(str(e))
        if arch in SKIPPER_ARCHITECTURES and settings.skipper_spec:
            fail(f"{model_path} is a skip-aware checkpoint ({arch}) with its own skipper; drop --skipper")
        if arch in SKIPPER_ARCHITECTURES and args.skipper == "none":
            fail(f"{model_path} is a skip-aware checkpoint ({arch}): its skipper is part of it, --skipper none "
                  f"cannot remove it; serve its base model for the plain model")
    if settings.tpot_ms is not None and arch not in SKIPPER_ARCHITECTURES and not settings.skipper_spec:
        fail("--tpot-ms sets a latency target for elastic depth, which needs a skipper; this server has none "
              "(give --skipper, or drop --tpot-ms)")
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path]
    if not any(_has_flag(sglang_args, f) for f in MULTI_RANK_FLAGS):
        private_rendezvous(env)
    if not _has_flag(sglang_args, "--host"):
        cmd += ["--host", "127.0.0.1"]
    on_cpu = not torch.cuda.is_available()
    if on_cpu:
        env["SGLANG_PLATFORM"] = "vskipper_cpu"
        for flag, value in CPU_DEFAULTS.items():
            if not _has_flag(sglang_args, flag):
                cmd += [flag, value]
    cmd += sglang_args
    from vskipper.first_start import prepare

    try:  # the server's threads, its cost calibration (measured now if there is none), what it will do
        args._announce = prepare(cmd, env, settings, model_path, on_cpu, getattr(args, "threads", None),
                                 getattr(args, "no_calibrate", False))
    except ValueError as e:
        fail(str(e))
    args._env = env
    return cmd
