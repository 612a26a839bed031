"""`vskipper eval`: does a served skipper keep the base model's quality? (docs/eval.md)

    vskipper eval --url http://127.0.0.1:30000                        # the tasks, against a running server
    vskipper eval --serve --skipper flexidepth:name=smollm2-135m-flexidepth --base
                                                                      # starts both servers itself
    vskipper eval --teacher-forced random:rate=0.3,layers=15-29 --tasks none   # in-process only

Three kinds of numbers, each with its standard error, printed as one markdown table and written to
OUT/results.json:
  tasks            lm-eval (local-completions) against the server's /v1/completions: vskipper_arithmetic
                   (greedy answers, last integer == answer) and vskipper_facts_mc (log-likelihood
                   multiple choice: acc, acc_norm); every question one user turn of the chat template
  greedy agreement with a base server (--base-url, or --base to start one): the held-out prompts
                   answered greedily by both; agreeing prefix length (mean, median), identical answers
  teacher-forced   (--teacher-forced SPEC|DIR) in-process with transformers: top-1 agreement and
                   KL(base || model) over the base's greedy answers to the same held-out prompts
Flags of this file; vskipper/cli.py only adds the subparser.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

from vskipper.config import EXECUTIONS

DEFAULT_OUT = "out/eval"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from vskipper.eval.agreement import PROMPT_SETS
    from vskipper.eval.harness import TASKS

    p.description = "Quality of a served model (with or without a skipper): lm-eval tasks, greedy agreement " \
                    "with the base model, teacher-forced KL. See docs/eval.md."
    g = p.add_argument_group("the model evaluated (one of)")
    m = g.add_mutually_exclusive_group()
    m.add_argument("--url", help="a running OpenAI-compatible server, e.g. http://127.0.0.1:30000 (vskipper serve)")
    m.add_argument("--serve", action="store_true",
                   help="start the server here, as `vskipper serve` would with the options below, and stop it after")
    s = p.add_argument_group("--serve / --base options (as for vskipper serve)")
    s.add_argument("--skipper", help="skipper spec for --serve (default as vskipper serve: the bundled model's "
                                     "shipped FlexiDepth skipper when no --model-path is given; 'none': no skipper)")
    s.add_argument("--model-path", help="model directory for --serve (default: the bundled SmolLM2-135M-Instruct)")
    s.add_argument("--execution", choices=list(EXECUTIONS), help="VSKIPPER_EXECUTION for --serve")
    s.add_argument("--sglang-args", default="", help="more SGLang flags for the started servers, one string, "
                                                     "e.g. \"--max-total-tokens 8192\"")
    s.add_argument("--server-timeout", type=float, default=600, help="seconds a started server may take to be ready")
    b = p.add_argument_group("the base model, for the agreement metrics")
    bm = b.add_mutually_exclusive_group()
    bm.add_argument("--base-url", help="a running server of the base model (greedy agreement)")
    bm.add_argument("--base", action="store_true",
                    help="start a server of the base model here (--base-model-path with --skipper none)")
    b.add_argument("--base-model-path", help="the base model's directory (--base, and --teacher-forced with a "
                                             "skipper spec); default: the evaluated server's model when it is a "
                                             "stock model, else the bundled SmolLM2-135M-Instruct")
    b.add_argument("--agreement-prompts", default="everyday",
                   help=f"held-out prompt sets, comma-separated, from {', '.join(PROMPT_SETS)} (default %(default)s: "
                        f"60 hand-written prompts; chat: the held-out split of the chat set, 433 prompts; prompts: "
                        f"the held-out word problems, 80, as benchmarks/quality_hf.py)")
    b.add_argument("--max-new-tokens", type=int, default=48, help="greedy answer length for the agreement metrics "
                                                                  "(default %(default)s; stops earlier at the end of "
                                                                  "sequence)")
    b.add_argument("--teacher-forced", metavar="SPEC_OR_DIR",
                   help="in-process teacher-forced top-1 agreement and KL of this skipper (spec, e.g. "
                        "random:rate=0.3,layers=15-29, or a skipper directory) over --base-model-path, or of a "
                        "skip-aware checkpoint directory against its own base weights")
    p.add_argument("--tasks", default=",".join(TASKS),
                   help=f"lm-eval tasks, comma-separated, from {', '.join(TASKS)}, or 'none' (default: both)")
    p.add_argument("--limit", type=int, help="at most N items per task and per held-out prompt set")
    p.add_argument("--tokenizer", help="tokenizer directory (default: the server's, as it reports it)")
    p.add_argument("--num-concurrent", type=int, default=8, help="lm-eval's concurrent requests (default %(default)s)")
    p.add_argument("--max-gen-toks", type=int, help="override the generation tasks' answer length (default: the "
                                                    "task's, 128)")
    p.add_argument("--threads", type=int, help="torch CPU threads for --teacher-forced")
    p.add_argument("--out", default=DEFAULT_OUT, help="results.json, per-item samples and server logs (default "
                                                      "%(default)s)")


class _Log:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        print(f"[vskipper eval {time.perf_counter() - self.t0:7.1f} s] {msg}", file=sys.stderr, flush=True)

    def since(self, t: float) -> float:
        return time.perf_counter() - t


def _plan(args: argparse.Namespace) -> dict:
    """Everything checkable before a server starts or a model loads; ValueError naming the flag."""
    from vskipper.eval.agreement import PROMPT_SETS, check_teacher_forced
    from vskipper.eval.harness import TASKS
    from vskipper.eval.server import root_url

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    tasks = [] if [t.lower() for t in tasks] in ([], ["none"]) else tasks
    bad = [t for t in tasks if t not in TASKS]
    if bad:
        raise ValueError(f"--tasks: unknown task(s) {', '.join(bad)}; the tasks are {', '.join(TASKS)} (or 'none')")
    sets = [x.strip() for x in args.agreement_prompts.split(",") if x.strip()]
    bad = [x for x in sets if x not in PROMPT_SETS]
    if bad or not sets:
        raise ValueError(f"--agreement-prompts={args.agreement_prompts!r}: expected held-out prompt sets among "
                         f"{', '.join(PROMPT_SETS)}, comma-separated")
    for flag, v in (("--limit", args.limit), ("--max-new-tokens", args.max_new_tokens),
                    ("--num-concurrent", args.num_concurrent), ("--max-gen-toks", args.max_gen_toks),
                    ("--threads", args.threads)):
        if v is not None and v <= 0:
            raise ValueError(f"{flag}={v} must be a positive integer")
    if not args.serve and (args.skipper or args.model_path or args.execution):
        raise ValueError("--skipper, --model-path and --execution are options of --serve (how it starts the "
                         "server); a server given by --url runs as it was started")
    base_wanted = bool(args.base_url or args.base)
    if (tasks or base_wanted) and not (args.url or args.serve):
        raise ValueError("give --url URL of a running server (vskipper serve) or --serve to start one"
                         + (" (or --tasks none with --teacher-forced alone)" if not base_wanted else ""))
    if not tasks and not base_wanted and not args.teacher_forced:
        raise ValueError("nothing to evaluate: --tasks none, and neither --base-url/--base nor --teacher-forced")
    tf = check_teacher_forced(args.teacher_forced) if args.teacher_forced else None
    return {"tasks": tasks, "sets": sets, "url": root_url(args.url) if args.url else None,
            "base_url": root_url(args.base_url) if args.base_url else None, "teacher_forced": tf}


def _stock_model(path) -> str | None:
    """`path` when it is a directory of a stock model (not a skip-aware checkpoint), else None."""
    from vskipper.eval.agreement import is_checkpoint

    if path and Path(path).is_dir() and (Path(path) / "config.json").is_file() and not is_checkpoint(path):
        return str(path)
    return None


def _base_model_path(args, served_model_path: str | None) -> tuple[str, str]:
    """(the base model directory, why): --base-model-path, else the evaluated server's model when it is
    a stock model (served with a skipper by environment or --skipper), else the bundled model."""
    if args.base_model_path:
        if not (Path(args.base_model_path) / "config.json").is_file():
            raise ValueError(f"--base-model-path {args.base_model_path}: no config.json there")
        return args.base_model_path, "--base-model-path"
    stock = _stock_model(served_model_path)
    if stock:
        return stock, "the evaluated server's model"
    if served_model_path and Path(served_model_path).is_dir():
        raise ValueError(f"{served_model_path} is a skip-aware checkpoint: give its base model with --base-model-path")
    from vskipper.models.smollm2 import smollm2_dir

    return str(smollm2_dir()), "the bundled SmolLM2-135M-Instruct"


def _tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise ValueError(f"no tokenizer loads from {path} ({e}); give one with --tokenizer DIR") from None
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"the tokenizer in {path} has no chat template; vskipper eval asks every question as one "
                         f"user turn of the model's chat template (give an instruct model's tokenizer with "
                         f"--tokenizer)")
    return tok


def _pct(v) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{100 * v:.1f}%"


def _num(fmt: str):
    return lambda v: "-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)


def table(results: dict) -> list[tuple[str, str, str, str]]:
    """(score, value, standard error, items) rows of the markdown table."""
    rows = []
    for name, r in results.get("tasks", {}).items():
        for metric in ("acc", "acc_norm"):
            if metric in r:
                rows.append((f"{name} {metric}", _pct(r[metric]), _pct(r[f"{metric}_stderr"]), str(r["n"])))
    a = results.get("agreement")
    if a:
        tok = _num("{:.1f}")
        rows += [(f"greedy agreement: mean agreeing prefix (tokens, of {a['base_len_mean']:.1f})",
                  tok(a["prefix_mean"]), tok(a["prefix_mean_stderr"]), str(a["n"])),
                 ("greedy agreement: median agreeing prefix (tokens)", tok(a["prefix_median"]),
                  tok(a["prefix_median_stderr"]), str(a["n"])),
                 ("greedy agreement: identical answers", _pct(a["identical"]), _pct(a["identical_stderr"]),
                  str(a["n"]))]
    t = results.get("teacher_forced")
    if t:
        rows += [("teacher-forced top-1 agreement", _pct(t["top1_mean"]), _pct(t["top1_stderr"]), str(t["n"])),
                 ("teacher-forced KL(base ‖ model), nats/token", _num("{:.4f}")(t["kl_mean"]),
                  _num("{:.4f}")(t["kl_stderr"]), str(t["n"]))]
        if t.get("skip") is not None:
            rows.append(("teacher-forced skip share (routed-layer token work)", _pct(t["skip"]), "-", str(t["n"])))
            for name in ("prompt", "generated"):
                if t.get(f"skip_{name}") is not None:
                    rows.append((f"teacher-forced skip share, {name} tokens", _pct(t[f"skip_{name}"]), "-",
                                 str(t["n"])))
    for part, what in (("tasks", "lm-eval tasks"), ("agreement", "greedy agreement")):
        sk = (results.get("server_skip") or {}).get(part)
        for name in ("prompt", "generated"):
            if sk and sk.get(name) is not None:
                rows.append((f"server skip share, {name} tokens ({what})", _pct(sk[name]), "-",
                             f"{sk[f'{name}_tokens']:.0f} routed-layer tokens"))
    return rows


def markdown(results: dict) -> str:
    lines = ["| score | value | std. error | items |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in table(results)]
    return "\n".join(lines)


def _chat_prompts(tok, records: list[dict]) -> list[list[int]]:
    from vskipper.training.data import chat_ids

    return [chat_ids(tok, r["prompt"]) for r in records]


def _run(args: argparse.Namespace, plan: dict, log: _Log, servers: list) -> dict:
    from vskipper.eval import server as srv

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv[1:],
                     "machine": f"{platform.machine()} {platform.node()}", "limit": args.limit,
                     "chat_template": True, "timings": {}}
    timings = results["timings"]

    # --- the servers: started ones launched together, then waited for -------------------------
    model_root = base_root = model_path = None
    started = []
    if plan["base_url"]:  # the given servers first: an unreachable one fails before anything starts
        base_root = plan["base_url"]
        results["base"] = {"url": base_root, "started": False, **srv.model_info(base_root)}
    if args.url:
        model_root = plan["url"]
        info = srv.model_info(model_root)
        results["model"] = {"url": model_root, "started": False, **info}
        model_path = info.get("model_path")
    elif args.serve:
        s = srv.launch_server("model", model_path=args.model_path, skipper=args.skipper, execution=args.execution,
                              sglang_args=args.sglang_args, log_dir=out_dir, log=log)
        servers.append(s)
        started.append(("model", s))
        model_root, model_path = s.url, s.model_path
    base_dir = None
    if args.base or (plan["teacher_forced"] and plan["teacher_forced"][0] == "spec"):
        base_dir, why = _base_model_path(args, model_path)
        log(f"base model: {base_dir} ({why})")
    if args.base:
        s = srv.launch_server("base", model_path=base_dir, skipper="none", sglang_args=args.sglang_args,
                              log_dir=out_dir, log=log)
        servers.append(s)
        started.append(("base", s))
        base_root = s.url
    if started:
        t = time.perf_counter()
        for key, s in started:
            s.wait_ready(max(1.0, args.server_timeout - log.since(t)))
            results[key] = {"url": s.url, "started": True, "command": s.cmd, "log": str(s.log_path),
                            **srv.model_info(s.url)}
        timings["server_start"] = log.since(t)
        log(f"{' and '.join(k for k, _ in started)} server{'s' if len(started) > 1 else ''} ready "
            f"({timings['server_start']:.0f} s)")

    # --- the tokenizer: the server's, or the one given ------------------------------------------
    tok_path = args.tokenizer or (results.get("model") or {}).get("tokenizer")
    if tok_path is None or not Path(tok_path).is_dir():
        if model_root is not None:
            raise ValueError(f"the server at {model_root} reports no local tokenizer directory "
                             f"({tok_path!r}); give one with --tokenizer DIR")
        tf_kind, tf_what = plan["teacher_forced"]
        tok_path = str(tf_what) if tf_kind == "checkpoint" else base_dir
    tok = _tokenizer(tok_path)
    results["tokenizer"] = str(tok_path)

    # --- the evaluated server's skip by phase, around each part that asks it (its /metrics) ------------
    phases = {"start": srv.route_phases(model_root)} if model_root is not None else {}
    results["server_skip"] = {}

    # --- lm-eval ---------------------------------------------------------------------------------
    if plan["tasks"]:
        import asyncio

        import aiohttp

        from vskipper.eval.harness import command_line, prepare_tasks, run_tasks

        t = time.perf_counter()
        task_dir = prepare_tasks(out_dir / "tasks", plan["tasks"])
        log(f"lm-eval: {', '.join(plan['tasks'])} against {model_root}/v1/completions"
            + (f", at most {args.limit} items each" if args.limit else "") + f" (task files: {task_dir})")
        results["lm_eval_command"] = command_line(f"{model_root}/v1/completions", results["model"]["name"],
                                                  str(tok_path), plan["tasks"], task_dir, args.limit,
                                                  args.num_concurrent, args.max_gen_toks)
        try:
            results["tasks"] = run_tasks(f"{model_root}/v1/completions", results["model"]["name"], str(tok_path),
                                         plan["tasks"], task_dir, limit=args.limit,
                                         num_concurrent=args.num_concurrent, max_gen_toks=args.max_gen_toks,
                                         samples_dir=out_dir)
        except (OSError, aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise srv.EvalError(f"lm-eval lost the server at {model_root}: {type(e).__name__}: {e}") from None
        timings["lm_eval"] = log.since(t)
        log(f"lm-eval: done in {timings['lm_eval']:.0f} s")
        phases["tasks"] = srv.route_phases(model_root)
        results["server_skip"]["tasks"] = srv.phase_shares(phases["start"], phases["tasks"])

    # --- greedy agreement with the base server ----------------------------------------------------
    records = prompts = None
    if base_root or plan["teacher_forced"]:
        from vskipper.eval.agreement import heldout_prompts

        records = heldout_prompts(plan["sets"], args.limit)
        prompts = _chat_prompts(tok, records)
    if base_root:
        from vskipper.eval.scoring import agreement

        t = time.perf_counter()
        log(f"greedy agreement: {len(prompts)} held-out prompts ({', '.join(plan['sets'])}), at most "
            f"{args.max_new_tokens} new tokens, answered by {model_root} and by the base at {base_root}")
        before = srv.route_phases(model_root)
        mine = srv.greedy(model_root, prompts, args.max_new_tokens, log=log)
        results["server_skip"]["agreement"] = srv.phase_shares(before, srv.route_phases(model_root))
        base = srv.greedy(base_root, prompts, args.max_new_tokens, log=log)
        a = agreement(mine, base)
        results["agreement"] = {k: v for k, v in a.items() if k != "prefix"} | {"prompt_sets": plan["sets"],
                                                                                 "max_new_tokens": args.max_new_tokens}
        with open(out_dir / "agreement.jsonl", "w") as f:
            for r, m, b, p in zip(records, mine, base, a["prefix"]):
                f.write(json.dumps({"id": r["id"], "prompt": r["prompt"], "prefix": p, "identical": m == b,
                                    "answer": tok.decode(m), "base_answer": tok.decode(b), "answer_ids": m,
                                    "base_answer_ids": b}) + "\n")
        timings["agreement"] = log.since(t)
        log(f"greedy agreement: done in {timings['agreement']:.0f} s")

    # --- teacher-forced, in-process (servers stopped first: their CPUs are free) ------------------
    if plan["teacher_forced"]:
        while servers:
            servers.pop().stop()
        import torch

        from vskipper.eval.agreement import load_teacher_forced, teacher_forced
        from vskipper.training.data import generate_greedy

        if args.threads:
            torch.set_num_threads(args.threads)
        t = time.perf_counter()
        kind, what = plan["teacher_forced"]
        log(f"teacher-forced: loading the base and the skip-aware model ({args.teacher_forced})")
        base_m, model = load_teacher_forced(kind, what, base_dir)
        log(f"teacher-forced: base greedy answers to {len(prompts)} held-out prompts, then both models over them")
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        answers = generate_greedy(base_m, prompts, args.max_new_tokens, tok.eos_token_id, pad, batch_size=16)
        seqs = [p + a for p, a in zip(prompts, answers)]
        tf = teacher_forced(base_m, model, seqs, [len(p) for p in prompts])
        results["teacher_forced"] = {k: v for k, v in tf.items() if k not in ("top1", "kl", "positions")} | {
            "what": args.teacher_forced, "kind": kind, "base": str(what) if kind == "checkpoint" else base_dir,
            "per_prompt": [{"id": r["id"], "top1": a, "kl": k, "positions": n}
                           for r, a, k, n in zip(records, tf["top1"], tf["kl"], tf["positions"])]}
        timings["teacher_forced"] = log.since(t)
        log(f"teacher-forced: done in {timings['teacher_forced']:.0f} s")
    timings["total"] = log.since(log.t0)
    return results


def main(args: argparse.Namespace) -> None:
    """Validate the flags, run what they ask, print the table, write OUT/results.json. Bad input, an
    unreachable server or one that fails to start: one line on stderr and exit code 2."""
    from vskipper.eval.server import EvalError

    log = _Log()
    servers: list = []
    try:
        plan = _plan(args)
        results = _run(args, plan, log, servers)
    except (EvalError, ValueError) as e:
        print(f"vskipper eval: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        print("vskipper eval: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        for s in servers:
            s.stop()
    md = markdown(results)
    results["table"] = md
    path = Path(args.out) / "results.json"
    path.write_text(json.dumps(results, indent=2, default=str))
    what = (results.get("model") or {}).get("url") or args.teacher_forced
    print(f"vskipper eval: {what}" + (f" vs base {results['base']['url']}" if results.get("base") else "")
          + f"; chat template; {'at most ' + str(args.limit) + ' items per set; ' if args.limit else ''}"
          f"{results['date']}, {results['timings']['total']:.0f} s\n")
    print(md)
    print(f"\n(results: {path})")
