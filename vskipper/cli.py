"""`vskipper serve | inspect | calibrate | train | eval | plan`."""
from __future__ import annotations

import argparse
import json
import sys

from vskipper.config import EXECUTIONS
from vskipper.serve import CPU_DEFAULTS, MULTI_RANK_FLAGS, private_rendezvous, serve_command
from vskipper.serve import fail as _fail

__all__ = ["CPU_DEFAULTS", "MULTI_RANK_FLAGS", "main", "private_rendezvous", "serve_command"]


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
                                 epilog="also: vskipper calibrate [-h] ...", allow_abbrev=False)
    sub = ap.add_subparsers(dest="command", required=True)
    # no abbreviations: serve passes every flag it does not know to SGLang, and a prefix of one of its own
    # (SGLang's --tp read as --tpot-ms) would silently change what is served
    s = sub.add_parser("serve", help="launch SGLang with vskipper (any other flags go to SGLang)", allow_abbrev=False)
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
    from vskipper.sim.plan import add_arguments as add_plan_arguments

    add_plan_arguments(sub.add_parser("plan", help="simulate SGLang on a device's measured steps: upstream against a "
                                                   "skipper, per rate and metric"))
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
    if args.command == "plan":
        from vskipper.sim.plan import main as plan_main

        try:
            return plan_main(args)
        except ValueError as e:
            _fail(str(e))
    try:
        inspect_command(args)
    except ValueError as e:
        _fail(str(e))


if __name__ == "__main__":
    main()
