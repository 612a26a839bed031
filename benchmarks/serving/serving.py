"""The side-by-side serving benchmark: upstream SGLang vs SGLang + vskipper, same requests.

The full run (`python -m benchmarks.serving.serving`; the quick paired run behind `--quick` is
benchmarks/serving/quick.py):

1. start the servers (upstream: the stock model; vskipper at rate 0: the same engine path with
   nothing skipped, so engine-level gains and skipping gains are reported apart; vskipper: the
   skipper under test; on the bundled SmolLM2-135M also vskipper-trained, the FlexiDepth skipper
   shipped for it; vskipper-half-opted-out: the skipper under test, every other request sent with
   {"vskipper": {"skip": false}}, so mixed batches of skipping and base-model requests), all with
   --sleep-on-idle so idle ones stay off the CPU, one CPU thread each (servers.SERVER_THREADS);
   requests are generated, sent and timed by SGLang's own benchmark client (client.py);
2. find the knee of upstream's load curve: the last offered rate whose output throughput still
   grows by >= 1% (rates are fractions of upstream's saturated capacity);
3. run every system at 0.75x, 1x, 1.25x the knee and at saturation, with the same prompts, the same
   seeded Poisson arrivals and pinned output lengths (ignore_eos), interleaved, `repeats` times;
4. print a markdown table (means with 95% confidence intervals, deltas against upstream), write
   it with the raw results (results.json) and a plot of latency against load (PNG) to --out, and
   the page docs/results/serving.md.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks import results as R
from benchmarks.results import log
from benchmarks.serving.servers import SERVER_THREADS, System, default_systems, start_all, stop

KNEE_FRACTIONS = (0.4, 0.55, 0.7, 0.85, 1.0, 1.15, 1.3, 1.5)
LOADS = (0.75, 1.0, 1.25, math.inf)  # multiples of the knee; inf = saturation


@dataclass(frozen=True)
class Settings:
    requests: int
    max_new_tokens: int
    repeats: int
    seed: int
    knee_fractions: tuple[float, ...] = KNEE_FRACTIONS
    max_total_tokens: int = 16384  # KV pool per server: 48 x (70 + 64) tokens fit; four servers fit in 24 GiB


@dataclass(frozen=True)
class Result:
    """One request of the full run, from SGLang's client's per-request record."""

    ok: bool
    ttft: float  # s
    tpot: float  # s per output token after the first
    e2e: float  # s
    output_tokens: int
    start: float
    end: float
    error: str = ""


def throughput(results: list[Result]) -> float:
    """Output tokens per second over the span of the run."""
    ok = [r for r in results if r.ok]
    if not ok:
        return 0.0
    span = max(r.end for r in ok) - min(r.start for r in results)
    return sum(r.output_tokens for r in ok) / span


def mean_ci(xs: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% confidence interval (normal approximation)."""
    if not xs:
        return math.nan, math.nan
    m = statistics.fmean(xs)
    return m, (1.96 * statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else math.nan)


def run_load(client, url: str, rate: float, n: int, max_new_tokens: int, seed: int,
             opted_out: float = 0.0) -> list[Result]:
    """n shipped prompts (seeded), sent by SGLang's own benchmark client (client.py)
    with seeded Poisson arrivals at `rate` req/s (inf: all at once), as per-request Results; the share
    `opted_out` of them with {"vskipper": {"skip": false}}."""
    from benchmarks.serving.client import opt_out

    rows = client.prompt_rows(n, max_new_tokens, seed)
    res = client.run(url, opt_out(rows, opted_out) if opted_out else rows, concurrency=None, rate=rate, seed=seed)
    return [Result(ok and out == max_new_tokens, ttft, (e2e - ttft) / max(1, out - 1), e2e, out, start, start + e2e,
                   err or ("" if out == max_new_tokens else f"{out} of {max_new_tokens} tokens"))
            for (ok, ttft, e2e, out, start), err in zip(res.per_request, res.errors)]


def find_knee(client, server, s: Settings) -> tuple[float, list[tuple[float, float]]]:
    sat = run_load(client, server.url, math.inf, s.requests, s.max_new_tokens, s.seed)
    capacity = throughput(sat) / s.max_new_tokens  # req/s at saturation
    log(f"upstream saturated throughput {throughput(sat):.1f} tok/s = {capacity:.2f} req/s")
    curve, knee = [], None
    for f in s.knee_fractions:
        rate = f * capacity
        tp = throughput(run_load(client, server.url, rate, s.requests, s.max_new_tokens, s.seed + 1))
        log(f"  knee search: {rate:.2f} req/s -> {tp:.1f} tok/s")
        if curve and tp < curve[-1][1] * 1.01:
            knee = curve[-1][0]
            curve.append((rate, tp))
            break
        curve.append((rate, tp))
    return (knee if knee is not None else curve[-1][0]), curve


def summarize(results: dict, systems: list[System], loads: list[tuple[str, float]]) -> str:
    rows = []
    for label, _ in loads:
        base = None
        for sysm in systems:
            runs = results[label][sysm.name]
            ok = [r for run in runs for r in run if r.ok]
            failed = sum(1 for run in runs for r in run if not r.ok)
            e2e, ci = mean_ci([r.e2e for r in ok])
            ttft = statistics.fmean(r.ttft for r in ok) if ok else math.nan
            tpot = statistics.fmean(r.tpot for r in ok) * 1e3 if ok else math.nan
            tp = statistics.fmean(throughput(run) for run in runs)
            if base is None:
                base = (e2e, tp)
                d1 = d2 = "-"
            else:
                d1, d2 = f"{e2e / base[0] - 1:+.1%}", f"{tp / base[1] - 1:+.1%}"
            rows.append([label, sysm.name, f"{e2e:.2f} ± {ci:.2f}", f"{ttft:.2f}", f"{tpot:.0f}", f"{tp:.1f}", failed,
                         d1, d2])
    return R.table(["load", "system", "e2e latency s (95% CI)", "TTFT s", "TPOT ms", "output tok/s", "failed",
                    "e2e vs upstream", "tok/s vs upstream"], rows)


def plot(results: dict, systems: list[System], loads: list[tuple[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = [r for _, r in loads if math.isfinite(r)]
    xs = [r if math.isfinite(r) else max(finite) * 1.5 for _, r in loads]
    fig, ax = plt.subplots(figsize=(6, 4))
    for sysm in systems:
        ms, cis = zip(*[mean_ci([x.e2e for run in results[label][sysm.name] for x in run if x.ok])
                        for label, _ in loads])
        ax.errorbar(xs, ms, yerr=cis, marker="o", capsize=3, label=sysm.name)
    ax.set_xticks(xs, [label.replace(" (", "\n(") for label, _ in loads], fontsize=8)
    ax.set_xlabel("offered load (req/s)")
    ax.set_ylabel("mean end-to-end latency (s)")
    ax.set_title("SGLang vs SGLang + vskipper")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def server_of(systems: list[System]) -> dict[str, str]:
    """{system: the system whose server it is measured on}: a system that only changes what its
    requests ask for (opted_out) shares the server of the first system started the same way."""
    key = lambda x: (x.model_path, x.skipper, x.env)  # noqa: E731
    return {x.name: next((y.name for y in systems if not y.opted_out and key(y) == key(x)), x.name) for x in systems}


def run(systems: list[System], s: Settings, out: Path, docs: Path | None = None) -> str:
    """docs: where the page serving.md is rendered (None: no page)."""
    import signal

    from benchmarks.serving.client import Client

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` stops the servers
    out.mkdir(parents=True, exist_ok=True)
    client = Client(systems[0].model_path, out)
    servers = {}
    try:
        log("starting " + ", ".join(f"{x.name} ({x.skipper or 'no skipper'})" for x in systems))
        served = server_of(systems)
        servers = start_all([x for x in systems if served[x.name] == x.name], out, s.max_total_tokens,
                            threads=SERVER_THREADS)
        for srv in servers.values():
            run_load(client, srv.url, math.inf, 4, 8, 0)  # warm up
        knee, curve = find_knee(client, servers[systems[0].name], s)
        log(f"knee of upstream's load curve: {knee:.2f} req/s")
        loads = [(f"{f}x knee ({knee * f:.2f}/s)" if math.isfinite(f) else "saturation", knee * f) for f in LOADS]
        results = {label: {sysm.name: [] for sysm in systems} for label, _ in loads}
        for rep in range(s.repeats):
            for i, (label, rate) in enumerate(loads):
                order = systems[rep % len(systems):] + systems[:rep % len(systems)]  # interleave
                for sysm in order:
                    res = run_load(client, servers[served[sysm.name]].url, rate, s.requests, s.max_new_tokens,
                                   s.seed + 100 * rep + i, sysm.opted_out)
                    results[label][sysm.name].append(res)
                    log(f"repeat {rep + 1}/{s.repeats} {label} {sysm.name}: {throughput(res):.1f} tok/s, "
                        f"{sum(not r.ok for r in res)} failed")
    finally:
        for srv in servers.values():
            stop(srv)
    header = (f"{s.requests} requests x {s.repeats} repeats, {s.max_new_tokens} output tokens each, "
              f"{SERVER_THREADS} CPU thread(s) per server, knee {knee:.2f} req/s")
    plot(results, systems, loads, out / "latency_vs_load.png")
    text = f"{header}\n\n{summarize(results, systems, loads)}\n"
    R.write_results("serving", {
        "settings": asdict(s), "systems": [asdict(x) for x in systems], "knee": knee, "knee_curve": curve,
        "loads": {label: {name: [[asdict(r) for r in run] for run in runs] for name, runs in d.items()}
                  for label, d in results.items()}}, text, out, docs)
    return text


def main(argv=None, started: float | None = None) -> None:
    """started: time.perf_counter() when the job began (the quick run's time budget counts from it)."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.serving.serving", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", help="base model (default: the bundled SmolLM2-135M-Instruct, which also "
                                         "runs its shipped trained skipper as vskipper-trained)")
    ap.add_argument("--skipper", default=None,
                    help="skipper spec under test (default: random:rate=0.5 over the second half of the layers)")
    ap.add_argument("--quick", action="store_true",
                    help="the main job: paired rounds through SGLang's own client plus quality, under 10 minutes "
                         "on 2 CPUs (quick.py); without it, the full run with the knee search")
    ap.add_argument("--rounds", type=int, help="quick run: at most this many paired rounds (default 12; fewer if the "
                                               "time budget runs out, never fewer than 3)")
    ap.add_argument("--budget", type=float, help="quick run: seconds for the whole job (default 570)")
    ap.add_argument("--requests", type=int, default=48, help="full run: requests per load")
    ap.add_argument("--max-new-tokens", type=int,
                    help="output tokens per request (default: 64 in the full run, 16 in the quick one)")
    ap.add_argument("--repeats", type=int, default=3, help="full run: interleaved repeats per load")
    ap.add_argument("--seed", type=int, default=0)
    R.add_arguments(ap, None)
    args = ap.parse_args(argv)
    try:
        systems = default_systems(args.model_path, args.skipper)
    except ValueError as e:
        ap.error(str(e))
    model, spec, label = systems[0].model_path, systems[2].skipper, systems[2].label.removeprefix("vskipper ")
    if args.quick:
        from benchmarks.serving import quick

        try:
            qs = quick.Settings(**{k: v for k, v in (("rounds", args.rounds), ("output_len", args.max_new_tokens),
                                                     ("budget_s", args.budget)) if v is not None}, seed=args.seed)
        except ValueError as e:
            ap.error(str(e))
        text = quick.run(systems, qs, args.out or Path("out/serving-quick"), started=started, docs=R.docs_dir(args))
        print(text)
        return
    # the same server as "vskipper", half of its requests opting out of skipping (per-request control)
    systems.append(System("vskipper-half-opted-out", model, spec,
                          label=f"vskipper {label}, half the requests opted out",
                          opted_out=0.5))
    out = args.out or Path("out/serving")
    settings = Settings(args.requests, args.max_new_tokens or 64, args.repeats, args.seed, KNEE_FRACTIONS)
    text = run(systems, settings, out, R.docs_dir(args))
    print(text)
    print(f"plot: {out / 'latency_vs_load.png'}")


if __name__ == "__main__":
    main()
