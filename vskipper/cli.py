"""`vskipper serve | inspect | calibrate | train | eval`."""
from __future__ import annotations

import argparse
import json
import os
import sys

from vskipper.config import EXECUTIONS

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


def _fail(msg: str) -> None:
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
                _fail(str(e))
            env[var] = value
    if args.ttft_ms is not None and not env.get("VSKIPPER_TPOT_MS"):
        _fail("--ttft-ms is a target of elastic depth, which --tpot-ms turns on; give --tpot-ms too")
    try:
        settings = Settings.from_env(env)  # a malformed skipper spec fails here, naming the field
    except ValueError as e:
        _fail(str(e))
    model_path = args.model_path
    if model_path is None:
        from vskipper.models.smollm2 import smollm2_dir

        model_path = str(smollm2_dir())
        arch = None
    else:
        try:
            arch = (read_config(model_path).get("architectures") or [None])[0]
        except CheckpointError as e:
            _fail(str(e))
        if arch in SKIPPER_ARCHITECTURES and settings.skipper_spec:
            _fail(f"{model_path} is a skip-aware checkpoint ({arch}) with its own skipper; drop --skipper")
        if arch in SKIPPER_ARCHITECTURES and args.skipper == "none":
            _fail(f"{model_path} is a skip-aware checkpoint ({arch}): its skipper is part of it, --skipper none "
                  f"cannot remove it; serve its base model for the plain model")
    if settings.tpot_ms is not None and arch not in SKIPPER_ARCHITECTURES and not settings.skipper_spec:
        _fail("--tpot-ms sets a latency target for elastic depth, which needs a skipper; this server has none "
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
        _fail(str(e))
    args._env = env
    return cmd


def inspect_command(args: argparse.Namespace) -> None:
    """Print what vskipper reads from a checkpoint directory, or fail naming what is wrong."""
    from vskipper.models.checkpoint import load_tensors, read_config, skipper_fields
    from vskipper.skippers.flexidepth import FlexiDepth

    f = skipper_fields(read_config(args.path), args.path)
    sk = FlexiDepth.from_fields(f)
    sk.load_flexidepth_state_dict(load_tensors(args.path, keys=sk.expected_shapes()), source=str(args.path))
    print(json.dumps({k: v for k, v in f.items()}, indent=2))
    print(f"skipper tensors: {len(sk.expected_shapes())} present with the expected shapes")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["calibrate"]:
        from vskipper.calibrate import main as calibrate_main

        return calibrate_main(argv[1:])
    ap = argparse.ArgumentParser(prog="vskipper", description="Dynamic layer skipping for LLM serving",
                                 epilog="also: vskipper calibrate [-h] ...")
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="launch SGLang with vskipper (any other flags go to SGLang)")
    s.add_argument("--skipper", help="skipper spec for a stock model, e.g. random:rate=0.5,layers=15-29,seed=0; "
                                     "'none' serves the model unchanged (default: the bundled model's shipped "
                                     "FlexiDepth skipper, flexidepth:name=smollm2-135m-flexidepth, when no "
                                     "--model-path is given)")
    s.add_argument("--model-path", help="model directory (default: the bundled SmolLM2-135M-Instruct, served with "
                                        "its trained FlexiDepth skipper)")
    s.add_argument("--execution", choices=list(EXECUTIONS))
    s.add_argument("--stats-interval", type=int, help="log skip statistics every N decode steps")
    s.add_argument("--threads", type=int, help="CPU threads of the server (default: OMP_NUM_THREADS, else torch's "
                                                "default; the cost calibration is measured and kept per count)")
    s.add_argument("--no-calibrate", action="store_true",
                   help="do not measure a cost calibration before serving when there is none (the server then runs "
                        "the dense-masked body)")
    s.add_argument("--threshold", help="the FlexiDepth router's threshold (default 0.5): a token runs a routed "
                                       "layer when its gate is above it, so a higher one skips more")
    s.add_argument("--tpot-ms", "--vskipper-tpot-ms", dest="tpot_ms",
                   help="elastic depth: a latency target in ms per output token; the server then skips only as much "
                        "as its load needs to meet it (level 0, the base model's function, when it can afford it; "
                        "needs a skipper and a cost calibration)")
    s.add_argument("--ttft-ms", "--vskipper-ttft-ms", dest="ttft_ms",
                   help="elastic depth: a time-to-first-token target in ms as well (with --tpot-ms)")
    i = sub.add_parser("inspect", help="check a skip-aware checkpoint directory")
    i.add_argument("path")
    from vskipper.training.cli import add_arguments as add_train_arguments

    add_train_arguments(sub.add_parser("train", help="train a FlexiDepth skipper over a frozen base model"))
    from vskipper.eval.cli import add_arguments as add_eval_arguments

    add_eval_arguments(sub.add_parser("eval", help="quality of a served model: lm-eval tasks, agreement with the base"))
    args, rest = ap.parse_known_args(argv)
    if args.command == "serve":
        from vskipper.first_start import flag_value, run

        cmd = serve_command(args, rest)
        print("vskipper: " + " ".join(cmd), file=sys.stderr, flush=True)
        raise SystemExit(run(cmd, args._env, flag_value(cmd, "--host", "127.0.0.1"),
                             int(flag_value(cmd, "--port", 30000)), args._announce))
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "train":
        from vskipper.training.cli import main as train_main

        return train_main(args)
    if args.command == "eval":
        from vskipper.eval.cli import main as eval_main

        return eval_main(args)
    try:
        inspect_command(args)
    except ValueError as e:
        _fail(str(e))


if __name__ == "__main__":
    main()
