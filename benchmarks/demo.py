"""The main job (`make demo`): how much faster the skipper shipped for the bundled SmolLM2-135M makes
SGLang, and what it costs in quality, in about ten minutes on 2 CPUs.

1. setup: the bundled model (converted once), the cost calibration at the servers' thread count
   (measured once, cached: vskipper.first_start.ensure_calibration);
2. speed, from the engine's own step (benchmarks/step/engine_step.py, in a process of its own): one
   SGLang ModelRunner, upstream's layers against vskipper's with nothing skipped (rate 0), the
   shipped trained skipper and RandomSkip 0.5 (all `auto`), on the same batches and KV pool, in
   paired rounds of random order, each system's fastest of five interleaved steps a round: decode
   at batch 8 and 32 continuing the held-out everyday prompts (a trained skipper skips by what it
   reads, so it is timed on text, not on random token ids), and one prefill of those prompts; each
   ratio to upstream with its rerun interval (benchmarks/stats.py), and the share of routed-layer
   work each skipper skipped in those steps;
3. the serving check and quality (benchmarks/serving/quick.py, closed loop only): upstream beside
   the trained skipper and beside RandomSkip, the two at once, waves of concurrency 32 through
   SGLang's own client (does the step's gain reach the client?), with rerun intervals; while the
   servers are up, quality through them (vskipper.eval): the multiple-choice facts task with
   lm-eval and greedy agreement with upstream on hand-written everyday prompts, with standard
   errors;
4. one verdict per skipper: step ratio, serving ratio, quality beside the base's, and one sentence.

Writes out/demo/results.json and keeps each run's verdict in out/demo/runs/ (the latest three, shown
side by side); the checkout is left as it was. With --docs it also writes the page docs/results/demo.md,
keeps the verdicts in docs/results/demo-runs/ instead (the latest three; older ones live in git history)
and rewrites the README's table of those runs ("at a glance"); --docs DIR writes the page and the runs
under DIR and leaves the README alone. A first run (model conversion and calibration) fits the same
budget: what it spends there, the rounds give up.

Skip is on generated tokens (the decode steps) unless it says otherwise; the prompt tokens' (the prefill
step's) beside it. "Keeps the base model's answers" is the card's bar (docs/training.md): greedy answers
agreeing with the base's for at least KEEP_SHARE of their tokens on average, and the facts score within
one standard error of the base's.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import results as R
from benchmarks.results import log
from benchmarks.stats import Delta

SKIPPERS = {"trained": "trained FlexiDepth (shipped)", "skip0.5": "RandomSkip 0.5 (the speed bound)"}
STEP_SYSTEMS = ["upstream", "rate0-auto", "trained-auto", "skip0.5-auto"]
SERVING = {"trained": "vskipper-trained", "skip0.5": "vskipper"}  # demo name -> serving system name
DECODE_BATCHES = (8, 32)
HEADLINE = 32
KEEP_RUNS = 3  # runs shown side by side: one run's interval should hold the others' medians
KEEP_SHARE = 20 / 48  # the card's bar for keeping the base's answers: an agreeing prefix of 20 of 48 tokens
README = R.ROOT / "README.md"
README_BEGIN, README_END = "<!-- demo runs: written by benchmarks/demo.py -->", "<!-- end of demo runs -->"


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=570.0, help="seconds for the whole job (default 570)")
    ap.add_argument("--step-rounds", type=int, default=12,
                    help=f"paired rounds of the decode step at batch {HEADLINE} (default 12; the smaller batches "
                         f"get two thirds of them)")
    ap.add_argument("--step-repeats", type=int, default=5,
                    help="interleaved decode steps per system and round, the fastest kept (default 5)")
    ap.add_argument("--facts", type=int, default=24, help="multiple-choice facts asked through each server")
    ap.add_argument("--prompts", type=int, default=10, help="everyday prompts for the greedy agreement")
    ap.add_argument("--answer-tokens", type=int, default=24, help="greedy answer length for the agreement")
    ap.add_argument("--out", type=Path, default=Path("out") / "demo", help="results.json, the runs kept and the "
                                                                          "run's other files (default out/demo)")
    ap.add_argument("--docs", nargs="?", const=str(R.DOCS), metavar="DIR",
                    help="also write the page (docs/results/demo.md), keep the run's verdict beside it "
                         "(docs/results/demo-runs/) and rewrite the README's table of the latest runs; with DIR: "
                         "the page and the runs there, the README left alone (default: none of these; the "
                         "checkout is left as it was)")
    return ap.parse_args(argv)


def docs_of(args) -> Path | None:
    """Where the page goes: None without --docs (or --docs none)."""
    return None if args.docs in (None, "none") else Path(args.docs)


def step_deltas(step_s: dict) -> dict:
    """{phase: {batch: {system: Delta with its rerun interval}}} from engine_step's step times."""
    from benchmarks.stats import paired_delta, rerun

    return {phase: {int(B): {n: rerun(paired_delta(t[n], t["upstream"])) for n in t if n != "upstream"}
                    for B, t in by_batch.items()} for phase, by_batch in step_s.items()}


def run_step(args, out: Path) -> tuple[dict, dict]:
    """engine_step's step times {phase: {batch: {system: [s per round]}}} and the share of routed-layer
    work each skipper skipped {phase: {batch: {system: fraction}}}."""
    rounds = [args.step_rounds if B == HEADLINE else max(3, round(args.step_rounds * 2 / 3)) for B in DECODE_BATCHES]
    cmd = [sys.executable, "-m", "benchmarks.step.engine_step", "--phase", "both", "--threads", "1", "--systems",
           *STEP_SYSTEMS, "--batch", *map(str, DECODE_BATCHES), "--rounds", *map(str, rounds), "--repeats",
           str(args.step_repeats), "--prompts", "everyday", "--prefill-len", "256", "--prefill-rounds", "3",
           "--prefill-repeats", "2", "--no-routing", "--out", str(out), "--docs", "none"]
    log("phase 2/4: speed, the engine's own step: " + " ".join(cmd[2:]))
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    got = json.loads((out / "results.json").read_text())["results"]
    return got["step_s"], got["skipped"]


def quality_through(urls: dict[str, str], out: Path, args) -> dict:
    """Facts (lm-eval, multiple choice) and greedy agreement with upstream, through the servers of
    upstream and the trained skipper (RandomSkip, the speed bound, is left out: its answers are garbage)."""
    from concurrent.futures import ThreadPoolExecutor

    from transformers import AutoTokenizer

    from vskipper.eval import harness, server
    from vskipper.eval.agreement import heldout_prompts
    from vskipper.eval.scoring import agreement
    from vskipper.models.smollm2 import smollm2_dir
    from vskipper.training.data import chat_ids

    tok_dir = str(smollm2_dir())
    tok = AutoTokenizer.from_pretrained(tok_dir)
    prompts = [chat_ids(tok, r["prompt"]) for r in heldout_prompts(["everyday"], args.prompts)]
    names = ["upstream", SERVING["trained"]]
    task_dir = harness.prepare_tasks(out / "tasks", ["vskipper_facts_mc"])

    def measure(n: str) -> tuple[dict, list[list[int]]]:
        root = urls[n]
        info = server.model_info(root)
        facts = harness.run_tasks(f"{root}/v1/completions", info["name"], tok_dir, ["vskipper_facts_mc"], task_dir,
                                  limit=args.facts, num_concurrent=8)["vskipper_facts_mc"]
        return facts, server.greedy(root, prompts, args.answer_tokens)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(2) as pool:  # the two servers at once, one CPU each
        got = dict(zip(names, pool.map(measure, names)))
    q = {}
    for n in names:
        facts, answers = got[n]
        q[n] = {"facts": facts["acc"], "facts_stderr": facts["acc_stderr"], "facts_n": facts["n"],
                **{k: v for k, v in agreement(answers, got["upstream"][1]).items() if k != "prefix"}}
    log(f"quality through the servers: {time.perf_counter() - t0:.0f} s")
    return q


def sentence(step, serving, q_sk, q_base, skipped: float | None = None) -> str:
    """faster and as good / faster and worse by X / slower by X / not resolved and why. "As good" needs
    both: the facts score within one standard error of the base's, and greedy answers that mostly agree
    with the base's (at least half of its tokens before the first divergence, on average). `skipped`:
    the share of routed-layer work it skipped in the steps timed."""
    faster = step.hi < 0
    if not faster:
        if step.lo <= 0 <= step.hi:
            return "not resolved: the decode step's rerun interval includes no change"
        why = "" if skipped is None else (f": it skipped {skipped:.1%} of routed-layer work, which saves less than "
                                          f"its router and skip path cost")
        return f"slower by {step.median:.1%} at batch {HEADLINE}{why}"
    if q_sk is None:
        return "faster; its answers are not the base model's (the speed bound, not a usable skipper)"
    diff = q_sk["facts"] - q_base["facts"]
    se = math.sqrt(q_sk["facts_stderr"] ** 2 + q_base["facts_stderr"] ** 2)
    agree = f"greedy answers agree with upstream's for {q_sk['prefix_mean']:.1f} of {q_base['prefix_mean']:.0f} tokens"
    if abs(diff) > se:
        return f"faster and {'worse' if diff < 0 else 'better'} by {abs(diff):.0%} on the facts task; {agree}"
    if q_sk["prefix_mean"] < KEEP_SHARE * q_base["prefix_mean"]:
        return (f"faster, but its answers are not the base model's: {agree}, under the card's bar of "
                f"{KEEP_SHARE * q_base['prefix_mean']:.1f} (the facts score is within one standard error, "
                f"+-{se:.0%} at this size)")
    return (f"faster and keeps the base model's answers as the card's bar asks: {agree} (the bar "
            f"{KEEP_SHARE * q_base['prefix_mean']:.1f}), the facts score within one standard error (+-{se:.0%})")


def main(argv=None) -> None:
    t0 = time.perf_counter()
    args = parse(argv)
    import torch

    from benchmarks.serving import quick
    from benchmarks.serving.servers import SERVER_THREADS, default_systems
    from vskipper import first_start
    from vskipper.models.smollm2 import smollm2_dir

    out = Path(args.out)
    path = str(smollm2_dir())
    log(f"phase 1/4: setup: the bundled model, and this CPU's cost calibration at {SERVER_THREADS} thread(s)")
    torch.set_num_threads(SERVER_THREADS)  # the cost model is keyed on the thread count: as the servers run
    first_start.ensure_calibration(path, "cpu" if not torch.cuda.is_available() else "cuda", "float32",
                                   SERVER_THREADS, max(DECODE_BATCHES), log)  # the batches it times and serves
    setup_s = time.perf_counter() - t0
    step_s, skipped = run_step(args, out / "step")
    steps = step_deltas(step_s)
    step_time = time.perf_counter() - t0 - setup_s
    log(f"phase 3/4: the serving check and quality ({time.perf_counter() - t0:.0f} s spent)")
    systems = [x for x in default_systems() if x.name in ("upstream", *SERVING.values())]
    settings = quick.Settings(open_requests=0, lifetimes=1, budget_s=args.budget)
    quick.run(systems, settings, out / "serving", started=t0, docs=None,
              quality_fn=lambda urls: quality_through(urls, out, args), name="demo-serving")
    serving = json.loads((out / "serving" / "results.json").read_text())["results"]
    quality = serving["quality"]
    serve_d = {n: Delta(**{**v["tok_s"], "ratios": tuple(v["tok_s"]["ratios"])})
               for n, v in serving["deltas"]["concurrency 32"].items()}
    wall = time.perf_counter() - t0
    rows, verdicts = [], []
    for key, label in SKIPPERS.items():
        st = steps["decode"][HEADLINE][f"{key}-auto"]
        sv = serve_d[SERVING[key]]
        q = quality.get(SERVING[key]) if key == "trained" else None
        skip = skipped["decode"][str(HEADLINE)][f"{key}-auto"]
        prompt_skip = skipped["prefill"]["1"][f"{key}-auto"]
        said = sentence(st, sv, q, quality["upstream"], skip)
        verdicts.append(f"{label}: {said}")
        qtext = (f"facts {q['facts']:.0%} +- {q['facts_stderr']:.0%} (upstream {quality['upstream']['facts']:.0%} +- "
                 f"{quality['upstream']['facts_stderr']:.0%}); agreeing prefix {q['prefix_mean']:.1f} +- "
                 f"{q['prefix_mean_stderr']:.1f} tokens, {q['identical']:.0%} identical" if q else "not measured")
        rows.append([label, f"{skip:.1%}", f"{prompt_skip:.1%}"] + [
            steps["decode"][B][f"{key}-auto"].ratio_text() for B in DECODE_BATCHES]
                    + [steps["prefill"][1][f"{key}-auto"].ratio_text(), sv.ratio_text(), qtext, said])
    rate0 = [steps["decode"][B]["rate0-auto"].ratio_text() for B in DECODE_BATCHES]
    header = ["skipper", f"skipped, generated tokens (decode, batch {HEADLINE})",
              "skipped, prompt tokens (prefill)"] + [
        f"decode step, batch {B} / upstream" for B in DECODE_BATCHES] + [
        "prefill step (256 tokens) / upstream", "serving tok/s, concurrency 32 / upstream", "quality", "verdict"]
    text = (f"The main job: SmolLM2-135M-Instruct in SGLang 0.5.23, {SERVER_THREADS} CPU thread per engine; "
            f"ratios to upstream SGLang: median of per-round ratios [95% rerun interval: where another run's "
            f"median would fall]. Engine step: paired rounds in one process ({args.step_rounds} at batch {HEADLINE}, "
            f"two thirds of that at smaller ones, 3 of the prefill), each system's fastest of "
            f"{args.step_repeats} interleaved steps a round (2 extends), decode continuing the held-out everyday "
            f"prompts (skipped: the share of routed-layer work the skipper skipped there, on the generated tokens "
            f"the decode steps feed and, apart, on the prompt tokens of the prefill step; rate 0, vskipper "
            f"with nothing skipped, at batch {', '.join(map(str, DECODE_BATCHES))}: {', '.join(rate0)}). Serving: "
            f"{len(serving['orders'])} rounds of concurrency-32 waves, upstream beside each skipper. Quality "
            f"through the servers: {args.facts} multiple-choice facts (lm-eval), greedy agreement on "
            f"{args.prompts} everyday prompts ({args.answer_tokens} tokens). {wall:.0f} s in all (setup "
            f"{setup_s:.0f} s, engine step {step_time:.0f} s).\n\n" + R.table(header, rows)
            + "\n\nverdict: " + "; ".join(verdicts) + "\n")
    docs = docs_of(args)
    runs = record_run(docs if docs is not None else out, {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"), "machine": R.machine(), "wall_s": round(wall),
        "setup_s": round(setup_s), "decode_b32": steps["decode"][HEADLINE]["trained-auto"].ratio_text(),
        "quality": rows[0][7], "skipped": rows[0][1], "skipped_prompt": rows[0][2],
        "verdict": verdicts[0].split(": ", 1)[1]}, "demo-runs" if docs is not None else "runs")
    text += "\n" + runs_table(runs) + "\n"
    print(text)
    R.write_results("demo", {"step_s": step_s, "serving": serving, "quality": quality, "verdicts": verdicts,
                             "setup_s": setup_s, "step_phase_s": step_time, "wall_s": wall}, text, out, docs)
    if docs is not None and docs.resolve() == R.DOCS.resolve():
        write_readme_block(README, runs_table(runs, dates=False))
    log(f"demo: {wall:.0f} s in all")


def record_run(where: Path, run: dict, folder: str = "demo-runs") -> list[dict]:
    """Keep this run's verdict in where/folder/ (the latest KEEP_RUNS files); returns those runs."""
    folder = Path(where) / folder
    folder.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    (folder / f"{stamp}.json").write_text(json.dumps(run, indent=1) + "\n")
    files = sorted(folder.glob("*.json"))
    for old in files[:-KEEP_RUNS]:
        old.unlink()
    return [json.loads(f.read_text()) for f in files[-KEEP_RUNS:]]


def runs_table(runs: list[dict], dates: bool = True) -> str:
    """The latest runs of the main job, oldest first: the shipped trained skipper's verdict in each
    (for the README: numbered instead of dated, whose dates live on the linked page, and no lead)."""
    rows = [[r["date"] if dates else str(i), f"{r['wall_s']} s (setup {r['setup_s']} s)", r.get("skipped", "-"),
             r.get("skipped_prompt", "-"), r["decode_b32"], r["quality"], r["verdict"]] for i, r in enumerate(runs, 1)]
    table = R.table(["run", "wall time", "skipped, generated tokens", "skipped, prompt tokens",
                     f"decode step, batch {HEADLINE} / upstream", "quality", "verdict"], rows)
    if not dates:
        return table
    lead = f"The latest {len(runs)} runs of `make demo` ({runs[-1]['machine']}), the shipped trained skipper:"
    return f"{lead}\n\n{table}"


def write_readme_block(readme: Path, block: str) -> None:
    """Replace the README's generated block (between README_BEGIN and README_END) with `block`."""
    text = readme.read_text()
    head, sep, rest = text.partition(README_BEGIN)
    _, sep2, tail = rest.partition(README_END)
    if not sep or not sep2:
        log(f"demo: {readme} has no '{README_BEGIN}' ... '{README_END}' block; the README is left as it is")
        return
    readme.write_text(f"{head}{README_BEGIN}\n{block.strip()}\n{README_END}{tail}")


if __name__ == "__main__":
    main()
