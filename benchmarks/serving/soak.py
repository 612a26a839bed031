"""Soak: SGLang + vskipper kept at twice its capacity for a while; no request may be lost.

1. start the server (SmolLM2-135M and `random:rate=0.5,layers=15-29,seed=0` unless told
   otherwise; on CPU through the vskipper_cpu platform);
2. choose the offered rate: `--rate` (req/s), else 2x the knee of a serving-benchmark
   results.json (`--knee-from`; the knee is converted through output tokens, since its requests
   were shorter), else 2x the capacity measured by a short saturation probe (SGLang's client,
   client.py);
3. warm up (the probe above, plus a burst with long prompts), then take the server's RSS (its
   whole process tree) as the baseline, and the probe set's greedy answers on the idle server,
   one request at a time, after flushing the radix cache;
4. offer seeded Poisson arrivals for `--duration` seconds: shipped prompts and long ones made by
   joining several, 16/32/64 output tokens (ignore_eos), streaming and non-streaming requests,
   and streaming clients that disconnect mid-stream; four times (`--probe-every`) the probe set
   rides along, its tokens counted in the offered load; then wait for every accepted request to
   finish (the backlog of an overload);
5. check and print: failed = 0; every completed request has exactly its requested token count;
   RSS stays within 10% of the baseline; the idle probe answers after the load equal those
   before it; the server is still healthy. Probes answered during the load are compared too and
   their agreement rate printed (not a pass condition: see docs/reliability.md).
With elastic depth (`--tpot-ms`): the server runs the controller to that TPOT target (priced by this
CPU's cost calibration, measured first if there is none) with /metrics on, and the summary gives
the tokens served at each level. `--opted-out 0.25`: one request in four (and a copy of each probe
round) is sent with {"vskipper": {"skip": false}}; after the load an upstream SGLang server (no
vskipper) answers the probe set, and the skip-false probe answers on the idle server, before and
after the load, must equal upstream's (a check); those answered during the load are compared with
upstream's too, reported like the others.
Exit code 0 when every check passes, 1 otherwise. The summary and every request's outcome go to
--out (results.json), the summary also to the page docs/results/soak.md.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks import results as R
from benchmarks.results import log
from benchmarks.serving.servers import Server, System, start, stop
from benchmarks.serving.soak_traffic import (
    PROBE_NEW,
    Job,
    Outcome,
    RssSampler,
    idle_answers,
    long_prompt,
    mean_new_tokens,
    mixed_jobs,
    probe_jobs,
    probe_set,
    run_jobs,
    shipped_prompts,
    tree_rss,
)

DEFAULT_SKIPPER = "random:rate=0.5,layers=15-29,seed=0"
RSS_TOLERANCE = 0.10
SAT_REQUESTS, SAT_NEW = 16, 32  # the saturation probe when no rate or knee is given


# --- the run ----------------------------------------------------------------------------------------
@dataclass
class Report:
    model: str
    skipper: str
    rate: float
    rate_source: str
    duration: float
    loadavg_start: tuple[float, float, float]
    threads: int | None = None
    outcomes: list[Outcome] = field(default_factory=list)
    wall: float = 0.0  # s from the first arrival to the last answer
    rss_baseline: int = 0
    rss_samples: list[tuple[float, int]] = field(default_factory=list)
    idle_before: list = field(default_factory=list)
    idle_after: list = field(default_factory=list)
    healthy_after: bool = False
    tpot_ms: float | None = None  # elastic depth's target
    opted_out: float = 0.0
    off_before: list = field(default_factory=list)  # the skip-false probe answers at idle, before the load
    off_after: list = field(default_factory=list)
    upstream: list = field(default_factory=list)  # an upstream SGLang server's answers to the probe set
    levels: dict = field(default_factory=dict)  # elastic depth: routed-layer tokens per level (/metrics)


def choose_rate(args, url: str | None, client) -> tuple[float, str]:
    """The offered rate and where it came from: --rate, 2x the knee of --knee-from (the full serving
    benchmark's results.json), else 2x the capacity a saturation probe through `client` measures."""
    if args.rate:
        return args.rate, "--rate"
    if args.knee_from:
        d = json.loads(Path(args.knee_from).read_text())["results"]
        knee, n = float(d["knee"]), int(d["settings"]["max_new_tokens"])
        rate = 2 * knee * n / mean_new_tokens()
        return rate, (f"2x the knee of {args.knee_from} ({knee:.2f} req/s of {n} output tokens = "
                      f"{knee * n:.1f} tok/s)")
    sat = client.run(url, client.prompt_rows(SAT_REQUESTS, SAT_NEW, args.seed), concurrency=None)
    tp = sat.output_throughput
    if sat.completed < sat.requests or tp <= 0:
        raise RuntimeError(f"saturation probe failed: {[e for e in sat.errors if e][:3]}")
    return 2 * tp / mean_new_tokens(), (f"2x the capacity from a saturation probe ({SAT_REQUESTS} requests x "
                                        f"{SAT_NEW} tokens: {tp:.1f} tok/s)")


def soak(args) -> Report:
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` stops the server
    prompts = shipped_prompts()
    probes = probe_set(prompts)
    model = args.model_path
    if model is None:
        from vskipper.models.smollm2 import smollm2_dir

        model = str(smollm2_dir())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    loadavg = os.getloadavg()
    if not args.rate and args.knee_from:
        choose_rate(args, None, None)  # a bad results.json fails before the server starts
    log(f"starting SGLang + vskipper ({args.skipper}) on {model}")
    env = (("OMP_NUM_THREADS", str(args.threads)),) if args.threads else ()
    extra = ()
    if args.tpot_ms:
        import torch

        from vskipper.first_start import ensure_calibration

        if not torch.cuda.is_available():  # the controller prices its levels by it
            ensure_calibration(model, "cpu", "float32", args.threads or torch.get_num_threads(), 64, log)
        env += (("VSKIPPER_TPOT_MS", f"{args.tpot_ms:g}"), ("VSKIPPER_STATS_INTERVAL", "8"))  # 8: /metrics export
        extra = ("--enable-metrics",)
    # with elastic depth, log at info: the server log then holds the controller's decisions and their reasons
    server: Server = start(System("soak", model, args.skipper, env, args=extra), out,
                           log_level="info" if args.tpot_ms else "warning")
    try:
        from benchmarks.serving.client import Client

        rate, source = choose_rate(args, server.url, None if args.rate or args.knee_from else Client(model, out))
        log(f"offered rate {rate:.2f} req/s: {source}")
        r = random.Random(args.seed + 7)  # warm-up: long prompts at once, so the big prefill batches run first
        warm = [Job(0.0, long_prompt(r, prompts), 4, "full") for _ in range(8)]
        warm += [Job(0.0, r.choice(prompts), 16, "stream") for _ in range(8)]
        bad = [o for o in run_jobs(server.url, warm, limit=900) if o.status != "completed"]
        if bad:
            raise RuntimeError(f"warm-up failed: {bad[0].error}")
        report = Report(model, args.skipper, rate, source, args.duration, loadavg, args.threads, tpot_ms=args.tpot_ms,
                        opted_out=args.opted_out)
        report.idle_before = idle_answers(server.url, probes)
        if args.opted_out:
            report.off_before = idle_answers(server.url, probes, skip=False)
        report.rss_baseline = statistics.median(_sleep_then(1.0, tree_rss, server.proc.pid) for _ in range(3))
        log(f"warm: RSS of the server's process tree {report.rss_baseline / 2**20:.0f} MiB")
        riders = probe_jobs(probes, args.duration, args.probe_every, opted_out=args.opted_out > 0)
        # the probes are part of the offered load: the mix gets what is left of it (at least half)
        probe_rate = len(riders) * PROBE_NEW / args.duration / mean_new_tokens()
        jobs = sorted(mixed_jobs(prompts, max(rate / 2, rate - probe_rate), args.duration, args.seed,
                                 args.opted_out) + riders, key=lambda j: j.arrival)
        log(f"load: {sum(j.kind != 'probe' for j in jobs)} requests + {sum(j.kind == 'probe' for j in jobs)} probes "
            f"over {args.duration:.0f} s, then the backlog drains")

        def progress(t, sent, inflight):
            log(f"  t={t:5.0f} s: sent {sent}, in flight {inflight}, RSS {tree_rss(server.proc.pid) / 2**20:.0f} MiB")

        t0 = time.perf_counter()
        with RssSampler(server.proc.pid) as rss:
            report.outcomes = run_jobs(server.url, jobs, limit=args.duration + args.drain_limit, progress=progress)
        report.wall = time.perf_counter() - t0
        report.rss_samples = rss.samples
        alive = server.proc.poll() is None
        report.healthy_after = alive and _healthy(server.url)
        if report.healthy_after:
            report.idle_after = idle_answers(server.url, probes)
            if args.opted_out:
                report.off_after = idle_answers(server.url, probes, skip=False)
            if args.tpot_ms:
                from benchmarks.serving.elastic_ramp import metric

                report.levels = metric(server.url, "vskipper_elastic_tokens_total", "level")
    finally:
        stop(server)
    if args.opted_out:  # upstream's answers, from a server of its own once the soak's is gone
        log("upstream SGLang's answers to the probe set (skip false must give them)")
        up = start(System("upstream", model, None, env[:1] if args.threads else ()), out)  # no vskipper settings
        try:
            report.upstream = idle_answers(up.url, probes)
        finally:
            stop(up)
    return report


def _sleep_then(s: float, fn, *args):
    time.sleep(s)
    return fn(*args)


def _healthy(url: str) -> bool:
    import requests

    try:
        return requests.get(url + "/health", timeout=30).status_code == 200
    except requests.RequestException:
        return False


# --- the summary -----------------------------------------------------------------------------------
def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else (xs[0] if xs else math.nan)


def checks(rep: Report) -> tuple[list[tuple[str, bool, str]], dict]:
    load = [o for o in rep.outcomes if o.job.kind != "probe"]
    probes = [o for o in rep.outcomes if o.job.kind == "probe"]
    count = {s: sum(o.status == s for o in rep.outcomes) for s in ("completed", "cancelled", "failed")}
    completed = [o for o in rep.outcomes if o.status == "completed"]
    wrong = [o for o in completed if not o.exact]
    peak = max((b for _, b in rep.rss_samples), default=0)
    growth = peak / rep.rss_baseline - 1 if rep.rss_baseline else math.nan
    answered = [o for o in probes if o.status == "completed" and o.output_ids is not None and o.job.skip]
    same = [o for o in answered if o.output_ids == rep.idle_before[o.job.probe]]
    diverge = [first_difference(o.output_ids, rep.idle_before[o.job.probe]) for o in answered if o not in same]
    off = [o for o in probes if o.status == "completed" and o.output_ids is not None and not o.job.skip]
    off_same = [o for o in off if rep.upstream and o.output_ids == rep.upstream[o.job.probe]]
    facts = dict(load=load, probes=probes, count=count, wrong=wrong, peak=peak, growth=growth,
                 answered=answered, same=same, diverge=diverge, off=off, off_same=off_same)
    out = [
        ("no request failed", count["failed"] == 0, f"{count['failed']} failed"),
        ("every completed request has its requested token count", not wrong,
         f"{len(wrong)} of {len(completed)} differ"),
        (f"server RSS within {RSS_TOLERANCE:.0%} of the warm baseline", growth <= RSS_TOLERANCE, f"peak {growth:+.1%}"),
        ("idle probe answers after the load equal those before", rep.idle_after == rep.idle_before,
         f"{sum(a == b for a, b in zip(rep.idle_after, rep.idle_before))}/{len(rep.idle_before)} equal"),
        ("server healthy after the load", rep.healthy_after, "/health"),
    ]
    if rep.opted_out:
        idle = rep.off_before + rep.off_after
        equal = sum(a == b for a, b in zip(rep.off_before, rep.upstream)) + sum(
            a == b for a, b in zip(rep.off_after, rep.upstream))
        out.append(("skip-false probes at idle, before and after the load, equal upstream SGLang's answers",
                    bool(rep.upstream) and len(idle) == 2 * len(rep.upstream) and equal == len(idle),
                    f"{equal}/{len(idle)} equal"))
    return out, facts


def peak_in_flight(outcomes: list[Outcome]) -> int:
    events = sorted([(o.span[0], 1) for o in outcomes] + [(o.span[1], -1) for o in outcomes],
                    key=lambda e: (e[0], e[1]))
    n = peak = 0
    for _, d in events:
        n += d
        peak = max(peak, n)
    return peak


def summary(rep: Report) -> tuple[str, bool]:
    result, f = checks(rep)
    ok = all(passed for _, passed, _ in result)
    load, count = f["load"], f["count"]
    by = lambda kind, status: sum(o.job.kind == kind and o.status == status for o in load)  # noqa: E731
    done = [o for o in load if o.status == "completed"]
    tokens = sum(o.tokens for o in rep.outcomes)  # completed, cancelled (partial) and probes
    cpus = os.cpu_count()
    busy = rep.loadavg_start[0] > 0.5 * (cpus or 1)
    kinds = [[("non-streaming" if kind == "full" else kind), sum(o.job.kind == kind for o in load),
              by(kind, "completed"), by(kind, "cancelled"), by(kind, "failed")]
             for kind in ("stream", "full", "disconnect")]
    kinds.append([f"probes (greedy, {PROBE_NEW} tokens)", len(f["probes"]),
                  sum(o.status == "completed" for o in f["probes"]), 0, sum(o.status == "failed" for o in f["probes"])])
    kinds.append(["**all**", len(rep.outcomes), count["completed"], count["cancelled"], count["failed"]])
    ttft, e2e = [o.ttft for o in done], [o.e2e for o in done]
    lines = [
        f"## Soak: SGLang + vskipper, {rep.duration:.0f} s of load at {rep.rate:.2f} req/s",
        "",
        f"load average at start {rep.loadavg_start[0]:.2f}"
        + (" (more than half the CPUs busy at the start)" if busy else ""),
        f"model {Path(rep.model).name}, skipper `{rep.skipper}`"
        + (f", server OMP_NUM_THREADS={rep.threads}" if rep.threads else "") + f"; rate: {rep.rate_source}"
        + (f"; elastic depth to a TPOT target of {rep.tpot_ms:g} ms" if rep.tpot_ms else "")
        + (f"; one request in {round(1 / rep.opted_out)} sent with skip false" if rep.opted_out else ""),
        "",
        R.table(["requests", "sent", "completed", "cancelled (client left mid-stream)", "failed"], kinds),
        "",
        f"served {tokens / rep.wall:.1f} output tok/s over {rep.wall:.0f} s (offered "
        f"{rep.rate * mean_new_tokens():.1f} tok/s during {rep.duration:.0f} s); up to "
        f"{peak_in_flight(rep.outcomes)} requests in flight; "
        f"TTFT p50 {pct(ttft, 50):.1f} s, p99 {pct(ttft, 99):.1f} s; "
        f"e2e p50 {pct(e2e, 50):.1f} s, p99 {pct(e2e, 99):.1f} s",
        f"server RSS (process tree): warm {rep.rss_baseline / 2**20:.0f} MiB, peak {f['peak'] / 2**20:.0f} MiB "
        f"({f['growth']:+.1%}), last {rep.rss_samples[-1][1] / 2**20 if rep.rss_samples else 0:.0f} MiB",
        f"probes during the load equal to the idle server's answers: {len(f['same'])}/{len(f['answered'])} "
        f"({len(f['same']) / max(1, len(f['answered'])):.0%})"
        + (f"; the others first differ at token {sorted(f['diverge'])}" if f["diverge"] else ""),
    ]
    if rep.opted_out:
        lines.append(f"skip-false probes during the load equal to upstream SGLang's answers: {len(f['off_same'])}/"
                     f"{len(f['off'])}")
    if rep.levels:
        total = sum(rep.levels.values()) or 1
        lines.append("elastic depth, routed-layer tokens per level: " + ", ".join(
            f"level {k} {v / total:.1%}" for k, v in sorted(rep.levels.items(), key=lambda kv: int(kv[0]))))
    lines += [
        "",
        R.table(["check", "result", ""], [[name, "pass" if passed else "**FAIL**", detail]
                                          for name, passed, detail in result]),
    ]
    errors = sorted({o.error for o in rep.outcomes if o.status == "failed"})
    if errors:
        lines += ["", "failures (distinct errors):"] + [f"- {e[:300]}" for e in errors[:10]]
    lines += ["", f"**{'PASS' if ok else 'FAIL'}**"]
    return "\n".join(lines) + "\n", ok


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.serving.soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", help="base model (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--skipper", default=DEFAULT_SKIPPER, help=f"skipper spec (default {DEFAULT_SKIPPER})")
    ap.add_argument("--rate", type=float, help="offered load in req/s (default: 2x the knee or 2x measured capacity)")
    ap.add_argument("--knee-from", help="results.json of the full serving benchmark: offer 2x its knee")
    ap.add_argument("--duration", type=float, default=600, help="seconds of offered load (default 600)")
    ap.add_argument("--quick", action="store_true", help="2 minutes of load instead of 10")
    ap.add_argument("--probe-every", type=float, help="seconds between probe rounds (default duration / 4)")
    ap.add_argument("--drain-limit", type=float,
                    help="seconds after the load ends that the backlog may take (default 4x duration + 300)")
    ap.add_argument("--threads", type=int,
                    help="OMP_NUM_THREADS for the server (default: torch's own choice; on a CPU shared with other "
                         "busy processes, give the number of free cores)")
    ap.add_argument("--tpot-ms", type=float, help="elastic depth: the server's TPOT target in ms (default off)")
    ap.add_argument("--opted-out", type=float, default=0.0,
                    help="share of requests sent with skip false, e.g. 0.25 for one in four (default 0)")
    ap.add_argument("--seed", type=int, default=0)
    R.add_arguments(ap, "soak")
    args = ap.parse_args(argv)
    if args.quick:
        args.duration = 120
    if args.rate is not None and not args.rate > 0:
        ap.error(f"--rate must be > 0, got {args.rate}")
    if args.knee_from and not Path(args.knee_from).is_file():
        ap.error(f"--knee-from {args.knee_from}: no such file")
    if args.threads is not None and args.threads < 1:
        ap.error(f"--threads must be >= 1, got {args.threads}")
    if args.tpot_ms is not None and not args.tpot_ms > 0:
        ap.error(f"--tpot-ms must be > 0, got {args.tpot_ms}")
    if not 0 <= args.opted_out <= 0.5:
        ap.error(f"--opted-out must be between 0 and 0.5 (one request in two), got {args.opted_out}")
    args.probe_every = args.probe_every or args.duration / 4
    args.drain_limit = args.drain_limit if args.drain_limit is not None else 4 * args.duration + 300
    from vskipper.skippers import parse_skipper

    try:
        parse_skipper(args.skipper)  # fail now, not after the server started
    except ValueError as e:
        ap.error(str(e))
    rep = soak(args)
    text, ok = summary(rep)
    R.write_results("soak-elastic" if args.tpot_ms else "soak", {
        "passed": ok, "rate": rep.rate, "rate_source": rep.rate_source, "duration": rep.duration,
        "rss_baseline": rep.rss_baseline, "rss_samples": rep.rss_samples,
        "idle_before": rep.idle_before, "idle_after": rep.idle_after, "tpot_ms": rep.tpot_ms,
        "opted_out": rep.opted_out, "off_before": rep.off_before, "off_after": rep.off_after,
        "upstream": rep.upstream, "levels": rep.levels,
        "outcomes": [{**asdict(o.job), **{k: v for k, v in asdict(o).items() if k != "job"}} for o in rep.outcomes]},
        text, args.out, R.docs_dir(args))
    print(text)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
