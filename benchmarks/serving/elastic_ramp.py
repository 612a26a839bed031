"""Elastic depth under a load ramp (issue: elastic depth), through SGLang's own client (client.py).

1. Upstream first, on this machine in this run, the ramp's servers already up beside it (all but the
   elastic one, which takes the target at start): its saturated capacity, then the highest offered rate
   (a fraction of that capacity, `SEARCH`) at which its p90 TPOT still meets the target: R. Each rate
   is measured up to three times and judged by the majority (two meeting, or two missing, settle it):
   one noisy p90 must neither end the search nor carry it past the knee; the grid's step above R is
   then halved once (R to within 0.05x capacity, so that 1.1x R is past the knee, not inside the step).
   `--tpot-ms auto` places the target at the knee of upstream's latency: `MARGIN` x its p90 TPOT at
   `KNEE` x its capacity (the median of three measurements: near the knee one p90 moved from 200 to 330
   ms between two runs), so `KNEE` x capacity meets it by two of three and the search starts above it.
   (A knee placed nearer capacity puts R so close to it that the skipper at fixed depth, the most any
   level gives, can itself miss the target from 1.1x R, and the ramp cannot show a target held past R;
   on a noisy machine a run can still land there: its page says what fixed depth reached.) `MARGIN` sets
   how far above the knee: upstream's p90 climbs so steeply there that a looser target moves R little,
   while fixed depth, whose steps are only 15-20% shorter for RandomSkip 0.5 over half the layers, gets
   room under it from R up.
   (Below the knee a CPU server's p90 TPOT hardly moves with load, so a target set there was met at
   every step of the ramp.)
2. Servers side by side (one CPU thread each, --sleep-on-idle, /metrics on): upstream; vskipper held
   at level 0 (rate 0 over the routed layers: vskipper's engine path, nothing skipped); per skipper
   (RandomSkip 0.5 over the second half of the layers, and on the bundled model the shipped trained
   FlexiDepth skipper) vskipper with the skipper alone ("fixed") and vskipper with elastic depth to
   the target ("elastic"). Elastic servers price their levels by the cost calibration, measured here
   first if this CPU has none.
3. `--rounds` rounds over the steps; in each, the steps in a random order and, per step, the servers in a
   random order (seeded). A step offers `STEPS` x R req/s (seeded Poisson arrivals, pinned output lengths;
   the same requests to every server in a round, new ones in the next): `--warmup-seconds` of arrivals that
   are not counted, then `--step-seconds` of measured ones (at least `--requests`). The warm-up makes a
   step's figures the server's steady state at that load: every step starts from an idle server, and
   elastic depth starts every busy spell at level 0 and rises only once its streams' p90 TPOT misses the
   target: near R its server logs show that 20-25 s into the load, and the rows admitted at level 0
   meanwhile leave the batch a request's lifetime later, so a step measured from 20 s judged that transient
   more than the load (the p90 over every request, warm-up included, is reported beside it). (A fixed count
   at every step would keep the lowest step's arrivals going 6x as long as the highest's.) Per step and
   system, over the measured requests of all its rounds (one 30 s step's p90 moved by 20-30% between runs):
   p50/p90 TPOT and TTFT, output tok/s, the skip fraction of routed-layer work (the servers' route counters
   on /metrics, read when the first measured request is sent and after the run), tokens per elastic level,
   greedy agreement with upstream on a fixed probe subset (the first `--probes` measured requests of every
   step are the same prompts), and each round's own p90.
4. A table per skipper with the issue's criterion read off its pooled steps (elastic_page.py: which parts
   the steps judge, and how), results.json, a figure (p90 TPOT and skip fraction against offered load, the
   target drawn) and the page docs/results/elastic-ramp.md. Each elastic server's controller events go to
   <out>/traces/<skipper>/ (vskipper/elastic_trace.py): elastic_replay.py replays other rules over them.
`--smoke`: tiny sizes, RandomSkip only (a check that the script runs, not a measurement).
"""
from __future__ import annotations

import argparse
import math
import random
import re

from benchmarks import results as R
from benchmarks.results import log
from benchmarks.serving.elastic_page import plot, table, verdict
from benchmarks.serving.report import prefix_share
from benchmarks.serving.servers import SERVER_THREADS, System, start_all, stop

STEPS = (0.25, 0.5, 0.75, 1.0, 1.1, 1.25, 1.5)  # multiples of R, upstream's highest rate meeting the target
KNEE, MARGIN = 0.7, 1.2  # --tpot-ms auto: MARGIN x upstream's p90 TPOT at KNEE x its saturated capacity
# of upstream's capacity, req/s: R is as fine as this grid. It runs past 1: the capacity is measured
# with a burst of requests all at once, and a server fed at a steady rate met the target above it.
SEARCH = tuple(round(0.1 * i, 1) for i in range(2, 21))


def quantile(xs: list[float], q: float) -> float:
    if not xs:
        return math.nan
    s = sorted(xs)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def measure(client, url: str, rows: list, rate: float, seed: int, warm: int = 0) -> dict:
    """One load on one server: per-request TPOT (s per token after the first) and TTFT, output tok/s,
    the generated texts (greedy), failures. The first `warm` rows are the warm-up: sent at the same rate
    before the measured ones and not counted (but for `tpot_p90_all_ms`, over every request, and failures)."""
    res = client.run(url, rows, concurrency=None, rate=rate, seed=seed)
    ok = [(i >= warm, ttft, e2e, n) for i, ((good, ttft, e2e, n, _), row) in enumerate(zip(res.per_request, rows))
          if good and n == row.output_len]
    every = [(e2e - ttft) / max(1, n - 1) for _, ttft, e2e, n in ok]
    tpot = [t for t, (counted, *_) in zip(every, ok) if counted]
    ttfts = [ttft for counted, ttft, _, _ in ok if counted]
    return {"tpot_p50_ms": quantile(tpot, 0.5) * 1e3, "tpot_p90_ms": quantile(tpot, 0.9) * 1e3,
            "tpot_p90_all_ms": quantile(every, 0.9) * 1e3,
            "ttft_p50_s": quantile(ttfts, 0.5), "ttft_p90_s": quantile(ttfts, 0.9),
            "tok_s": res.output_throughput, "failed": len(rows) - len(ok), "texts": list(res.texts[warm:]),
            "tpot_s": tpot, "tpot_all_s": every, "ttft_s": ttfts}


def pool(rounds: list[dict], probes: int) -> dict:
    """One step's figures for one system from its rounds: quantiles over every request of every round,
    output tok/s averaged, failures, route counts and tokens per level summed; `texts` the probes'."""
    tpot = [x for m in rounds for x in m["tpot_s"]]
    every = [x for m in rounds for x in m["tpot_all_s"]]
    ttft = [x for m in rounds for x in m["ttft_s"]]
    levels: dict[str, float] = {}
    for m in rounds:
        for k, v in m["levels"].items():
            levels[k] = levels.get(k, 0.0) + v
    run, project = (sum(m["routes"][i] for m in rounds) for i in (0, 1))
    return {"tpot_p50_ms": quantile(tpot, 0.5) * 1e3, "tpot_p90_ms": quantile(tpot, 0.9) * 1e3,
            "tpot_p90_all_ms": quantile(every, 0.9) * 1e3,
            "ttft_p50_s": quantile(ttft, 0.5), "ttft_p90_s": quantile(ttft, 0.9),
            "tok_s": sum(m["tok_s"] for m in rounds) / len(rounds), "failed": sum(m["failed"] for m in rounds),
            "skip": project / (run + project) if run + project else None, "levels": shares(levels, {}),
            "round_p90_ms": [m["tpot_p90_ms"] for m in rounds],
            "texts": [t for m in rounds for t in m["texts"][:probes]]}


def metric(url: str, name: str, label: str) -> dict[str, float]:
    """{value of `label`: the series' value} for the counter `name` on the server's /metrics."""
    import requests

    got: dict[str, float] = {}
    for m in re.finditer(rf'^{name}\{{([^}}]*)\}} (\S+)$', requests.get(url + "/metrics", timeout=10).text, re.M):
        key = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1))).get(label)
        if key is not None:
            got[key] = got.get(key, 0.0) + float(m.group(2))
    return got


def route_counts(url: str) -> tuple[float, float]:
    """(run, project) summed over the routed layers, from vskipper_routed_layer_tokens_total on /metrics."""
    got = metric(url, "vskipper_routed_layer_tokens_total", "route")
    return got.get("run", 0.0), got.get("project", 0.0)


def level_tokens(url: str) -> dict[str, float]:
    """An elastic server's routed-layer tokens per level, from vskipper_elastic_tokens_total on /metrics."""
    return metric(url, "vskipper_elastic_tokens_total", "level")


def shares(after: dict[str, float], before: dict[str, float]) -> str | None:
    """`level:share` of the tokens counted between two readings, e.g. '0:70% 4:30%' (None: no tokens)."""
    d = {k: v - before.get(k, 0.0) for k, v in after.items()}
    total = sum(d.values())
    return " ".join(f"{k}:{v / total:.0%}" for k, v in sorted(d.items(), key=lambda kv: int(kv[0])) if v > 0) \
        if total > 0 else None


def capacity(client, url: str, rows: list, seed: int) -> float:
    """Upstream's saturated capacity in req/s: output tok/s with `rows` all at once, per request."""
    sat = measure(client, url, rows, math.inf, seed)
    log(f"upstream saturated: {sat['tok_s']:.1f} tok/s = {sat['tok_s'] / rows[0].output_len:.3f} req/s")
    return sat["tok_s"] / rows[0].output_len


def find_rate(client, url: str, rows_for, target_ms: float, cap: float, seed: int, search=SEARCH,
              strict: bool = True, floor: float | None = None, refine: bool = False) -> tuple[float, list]:
    """Upstream's highest rate (of `search` x its saturated capacity `cap`) whose p90 TPOT meets the
    target by the majority of up to three measurements, the first rate missing it by that majority
    ending the search; `refine`: then the rate halfway between that one and R is judged the same way,
    and is R if met (the grid's step halved); `floor` (req/s): a rate already known to meet it, R when no
    rate searched does (strict=False, for a smoke run: the lowest rate searched when none does and there
    is no floor). rows_for(rate): (the requests to offer at that rate, how many at their head are the
    warm-up)."""
    best, curve = floor, []

    def met(rate: float) -> bool:
        ok = missed = 0
        for attempt in range(3):
            rows, warm = rows_for(rate)
            m = measure(client, url, rows, rate, seed + 1 + attempt, warm)
            curve.append((rate, m["tpot_p90_ms"]))
            log(f"  {rate:.3f} req/s ({rate / cap:.3g}x capacity): p90 TPOT {m['tpot_p90_ms']:.1f} ms")
            ok, missed = (ok + 1, missed) if m["tpot_p90_ms"] <= target_ms else (ok, missed + 1)
            if max(ok, missed) == 2:
                break
        return missed < 2

    for f in search:
        if not met(f * cap):
            if refine and best is not None and met((best + f * cap) / 2):
                best = (best + f * cap) / 2
            break
        best = f * cap
    if best is None and not strict:
        log("  upstream meets the target at no rate searched: a smoke run goes on from the lowest")
        best = search[0] * cap
    if best is None:
        raise SystemExit(f"upstream misses the {target_ms:g} ms target even at {search[0]:g}x its capacity: "
                         f"give a larger --tpot-ms" + (" or a lower --search-from" if search[0] > SEARCH[0] else ""))
    return best, curve


def systems_for(model: str, name: str, spec: str, target_ms: float | None, level0: str | None = None,
                trace: str | None = None) -> list[System]:
    """One skipper's servers: upstream, vskipper at level 0 (when `level0`: its spec), the skipper at
    fixed depth and elastic (when `target_ms` is given; `trace`: the directory its controller's events go
    to, vskipper/elastic_trace.py)."""
    on = (("VSKIPPER_STATS_INTERVAL", "8"),)
    out = [System("upstream", model, label="upstream", args=("--enable-metrics",))]
    if level0:
        out.append(System("level0", model, level0, env=on, label="vskipper, level 0 (nothing skipped)",
                          args=("--enable-metrics",)))
    out.append(System(f"fixed-{name}", model, spec, env=on, label=f"{name}, fixed depth", args=("--enable-metrics",)))
    if target_ms is not None:
        traced = (("VSKIPPER_ELASTIC_TRACE", trace),) if trace else ()
        out.append(System(f"elastic-{name}", model, spec, env=on + (("VSKIPPER_TPOT_MS", f"{target_ms:.3f}"),) + traced,
                          label=f"{name}, elastic", args=("--enable-metrics",)))
    return out


def counted(client, srv, rows: list, rate: float, seed: int, warm: int) -> dict:
    """measure() on one server, with its route counters and tokens per level over the measured requests:
    read before the run, or, with a warm-up, when the first measured request is sent (its arrival time,
    drawn as the client draws it), and after the run."""
    import threading

    import numpy as np

    from benchmarks.serving.client import _arrivals

    before: dict = {}

    def read():
        before.update(routes=route_counts(srv.url), levels=level_tokens(srv.url))

    timer = None
    if warm:
        timer = threading.Timer(_arrivals(len(rows), rate, np.random.default_rng(seed))[warm], read)
        timer.start()
    else:
        read()
    try:
        m = measure(client, srv.url, rows, rate, seed, warm)
    finally:
        if timer is not None:
            timer.cancel()
            timer.join()
    if not before:  # every request was sent before the timer's thread ran: count from here (nothing)
        read()
    m["routes"] = [a - b for a, b in zip(route_counts(srv.url), before["routes"])]
    m["levels"] = {k: v - before["levels"].get(k, 0.0) for k, v in level_tokens(srv.url).items()}
    return m


def ramp(client, servers: dict, steps, rate: float, rows_for, probes: int, seed: int, rounds: int = 1) -> list[dict]:
    """`rounds` rounds over the steps, each round's steps in a random order and each step's servers in a
    random order (seeded), every server offered the same requests at the same arrival times in a round
    (new ones in the next); per step and system the rounds' requests pooled (`pool`), and greedy agreement
    with upstream on the first `probes` measured requests of every round. rows_for(rate, seed): (the
    requests, how many of them, at their head, are the warm-up)."""
    rng = random.Random(seed)
    names = list(servers)
    got: dict[float, dict[str, list]] = {f: {name: [] for name in names} for f in steps}
    count = dict.fromkeys(steps, 0)
    for r in range(rounds):
        for f in rng.sample(list(steps), len(steps)):
            s = seed + 10 + steps.index(f) + 1000 * r
            rows, warm = rows_for(f * rate, s)
            count[f] += len(rows) - warm
            for name in rng.sample(names, len(names)):
                m = counted(client, servers[name], rows, f * rate, s, warm)
                got[f][name].append(m)
                run, project = m["routes"]
                skip = f"{project / (run + project):.2f}" if run + project else "-"
                log(f"round {r + 1}/{rounds}, {f:g}x R, {name}: p90 TPOT {m['tpot_p90_ms']:.1f} ms "
                    f"({m['tpot_p90_all_ms']:.1f} with the warm-up), skip {skip}"
                    + (f", levels {shares(m['levels'], {})}" if shares(m["levels"], {}) else ""))
    done = []
    for f in steps:
        step = {"multiple": f, "rate": f * rate, "requests": count[f], "rounds": rounds,
                "systems": {name: pool(got[f][name], probes) for name in names}}
        ref = [client.tokenizer.encode(t) for t in step["systems"]["upstream"]["texts"]]
        for name in names:
            m = step["systems"][name]
            gen = [client.tokenizer.encode(t) for t in m.pop("texts")]
            m["agreement"] = prefix_share(gen, ref) if name != "upstream" else None
        done.append(step)
    return done


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.serving.elastic_ramp", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--tpot-ms", default="auto", help="the TPOT target in ms, or 'auto' (see above)")
    ap.add_argument("--rate", type=float, default=None,
                    help="R in req/s, given (with a numeric --tpot-ms): no search; e.g. the trained skipper's ramp "
                         "at an earlier run's target and R")
    ap.add_argument("--search-from", type=float, default=SEARCH[0],
                    help=f"the lowest multiple of upstream's capacity searched for R (default {SEARCH[0]:g}; the grid "
                         f"steps by 0.1, and the step above R is halved once)")
    ap.add_argument("--requests", type=int, default=12, help="the fewest requests per step and system")
    ap.add_argument("--step-seconds", type=float, default=60.0,
                    help="seconds of arrivals per step and system (default 60)")
    ap.add_argument("--skippers", default="random,trained",
                    help="which skippers: random (RandomSkip 0.5), trained (the shipped one), or both")
    ap.add_argument("--warmup-seconds", type=float, default=60.0,
                    help="seconds of arrivals before each step's measured ones, not counted (default 60)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--probes", type=int, default=8, help="fixed prompts at the head of every step (agreement)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds over the steps, in random order; each step's figures pool its rounds' requests")
    ap.add_argument("--steps", default=",".join(f"{f:g}" for f in STEPS),
                    help="the steps, as multiples of R, comma-separated (default all of them; e.g. 1,1.1,1.25 with "
                         "more --rounds where one round's p90 cannot tell the systems apart)")
    ap.add_argument("--page", default=None,
                    help="the results page's name (default elastic-ramp, or elastic-ramp-trained for the trained "
                         "skipper alone): another name keeps a partial ramp beside the full one")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, RandomSkip only: a check that it runs")
    R.add_arguments(ap, "elastic-ramp")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: give at least 1")
    if args.rate is not None and not (args.rate > 0 and args.tpot_ms != "auto"):
        ap.error(f"--rate {args.rate}: give a positive rate in req/s, with the target it was found for (--tpot-ms MS)")
    from benchmarks.serving.client import Client
    from vskipper.first_start import ensure_calibration
    from vskipper.models.checkpoint import read_config

    trained = None
    if args.model is None:
        from vskipper.models.smollm2 import smollm2_dir
        from vskipper.skippers.shipped import DEFAULT

        args.model, trained = str(smollm2_dir()), f"flexidepth:name={DEFAULT}"
    steps, search = parse_steps(ap, args.steps), tuple(f for f in SEARCH if f >= args.search_from - 1e-9)
    if args.page is not None and not re.fullmatch(r"[a-z0-9][a-z0-9-]*", args.page):
        ap.error(f"--page {args.page!r}: give a name of lowercase letters, digits and dashes (the page is <name>.md)")
    if not search:
        ap.error(f"--search-from {args.search_from:g}: give a multiple of capacity up to {SEARCH[-1]:g}")
    if args.smoke:
        args.requests, args.max_new_tokens, args.probes, steps, search, trained = 4, 8, 2, (0.5, 1.5), (0.3, 0.6), None
        args.step_seconds, args.warmup_seconds, args.rounds = 1.0, 1.0, 2
    n = read_config(args.model)["num_hidden_layers"]
    wanted = args.skippers.split(",")
    if not wanted or not set(wanted) <= {"random", "trained"}:
        ap.error(f"--skippers {args.skippers!r}: give random, trained or random,trained")
    layers = f"{n // 2}-{n - 1}"
    skippers = {"random": f"random:rate=0.5,layers={layers},seed=0"}  # RandomSkip 0.5
    if trained:
        skippers["trained"] = trained
    skippers = {k: v for k, v in skippers.items() if k in wanted}
    if not skippers:
        ap.error("--skippers trained: only on the bundled model (no --model)")
    if not _cuda():  # the elastic servers price their levels by it (on a GPU: `vskipper calibrate` first)
        ensure_calibration(args.model, "cpu", "float32", SERVER_THREADS, 64, log)
    client = Client(args.model, args.out / "client")
    probe_rows = client.prompt_rows(args.probes, args.max_new_tokens, args.seed + 999)

    def rows_at(rate: float, seed: int) -> tuple[list, int]:
        """The requests offered at `rate` (req/s; inf: all at once, twice the fewest) and how many at their
        head are the warm-up: --warmup-seconds of arrivals, then --step-seconds of them (at least
        --requests), the probes first."""
        n = 2 * args.requests if math.isinf(rate) else max(args.requests, round(rate * args.step_seconds))
        warm = 0 if math.isinf(rate) else round(rate * args.warmup_seconds)
        warmup = client.prompt_rows(warm, args.max_new_tokens, seed + 500) if warm else []
        return warmup + probe_rows + client.prompt_rows(max(1, n - args.probes), args.max_new_tokens, seed), warm

    def at_rate(rate: float, seed: int) -> tuple:  # measure()'s rows, rate, seed, warm
        rows, warm = rows_at(rate, seed)
        return rows, rate, seed, warm

    level0 = f"random:rate=0,layers={layers},seed=0"
    runs, rate, md, cap, curve = {}, args.rate, "", None, []
    if rate is not None:
        target = float(args.tpot_ms)
        md = head(args, target, cap, rate, curve)
    for name, spec in skippers.items():
        # Elastic takes the target at start: the others first, and on the first skipper's round the target and
        # R are found on that upstream, the ramp's other servers up beside it (the ramp's conditions).
        others = systems_for(args.model, name, spec, None, level0 if name == "random" else None)
        servers = start_all(others, args.out / "logs", threads=SERVER_THREADS, log_level="info")
        try:
            if rate is None:
                up = servers["upstream"].url
                cap = capacity(client, up, rows_at(math.inf, args.seed)[0], args.seed)
                if args.tpot_ms == "auto":
                    knee = sorted(measure(client, up, *at_rate(KNEE * cap, args.seed + 100 + i))["tpot_p90_ms"]
                                  for i in range(3))
                    target = MARGIN * knee[1]  # met by two of these three: KNEE x cap is R's floor
                    log(f"upstream's p90 TPOT at {KNEE:g}x capacity: {', '.join(f'{p:.1f}' for p in knee)} ms "
                        f"(median kept)")
                else:
                    target = float(args.tpot_ms)
                log(f"target: p90 TPOT <= {target:.1f} ms")
                auto = args.tpot_ms == "auto" and not args.smoke
                rate, curve = find_rate(client, up, lambda r: rows_at(r, args.seed), target, cap, args.seed,
                                        tuple(f for f in search if f > KNEE) if auto else search,
                                        strict=not args.smoke, floor=KNEE * cap if auto else None,
                                        refine=not args.smoke)
                md = head(args, target, cap, rate, curve)
            trace = str((args.out / "traces" / name).resolve())
            (elastic,) = [s for s in systems_for(args.model, name, spec, target, trace=trace)
                          if s.name.startswith("elastic")]
            servers.update(start_all([elastic], args.out / "logs", threads=SERVER_THREADS, log_level="info"))
            runs[name] = ramp(client, servers, steps, rate, rows_at, args.probes, args.seed, args.rounds)
        finally:
            for srv in servers.values():
                stop(srv)
        page, name = md, args.page or ("elastic-ramp" if "random" in skippers else "elastic-ramp-trained")
        for skipper, done in runs.items():  # one skipper: the page's name; two: the trained one's suffixed
            png = f"{name}.png" if skipper == "random" or len(runs) == 1 else f"{name}-{skipper}.png"
            names = list(done[0]["systems"])
            page += f"\n\n## {skipper} (figure: {png})\n\n" + table(done, names, target)
            if any(n.startswith("elastic") for n in names) and "upstream" in names:
                page += "\n\n" + verdict(done, names, target)
            plot(done, names, target, args.out / png)
        print(page)
        R.write_results(name,
                        {"target_ms": target, "capacity": cap, "rate": rate, "search": curve, "runs": runs,
                         "smoke": args.smoke}, page, args.out, R.docs_dir(args))


def parse_steps(ap: argparse.ArgumentParser, text: str) -> tuple[float, ...]:
    """--steps: distinct positive multiples of R, lowest first."""
    try:
        steps = tuple(float(x) for x in text.split(","))
    except ValueError:
        steps = ()
    if not steps or not all(math.isfinite(f) and f > 0 for f in steps) or len(set(steps)) != len(steps):
        ap.error(f"--steps {text!r}: give distinct positive multiples of R, comma-separated (e.g. 1,1.1,1.25)")
    return tuple(sorted(steps))


def head(args, target: float, cap: float, rate: float, curve: list) -> str:
    """The page's first paragraph: how the target and R were found, how the steps were offered."""
    how = (f"{MARGIN:g}x upstream's median p90 TPOT of 3 runs at {KNEE:g}x its saturated capacity of {cap:.3f} req/s"
           if args.tpot_ms == "auto" else "given")
    floor = (f"; {KNEE:g}x capacity meets it by that construction, so the search starts above it"
             if args.tpot_ms == "auto" and not args.smoke else "")
    curve_s = ", ".join(f"{r:.3f}: {p:.0f}" for r, p in curve)
    top = ("; upstream met it at every rate searched, so R is the grid's top, not its knee"
           if args.rate is None and curve and rate >= max(r for r, _ in curve) else "")
    found = ("given (--rate: found by an earlier run at this target)" if args.rate is not None else
             f"upstream's highest rate meeting it by the majority of up to 3 runs (search on the ramp's upstream, "
             f"its other servers up, from {args.search_from:g}x capacity in steps of 0.1x, the step above R halved "
             f"once{floor}; req/s: p90 TPOT ms: {curve_s}{top})")
    return (f"Target p90 TPOT {target:.1f} ms ({how}); R = {rate:.3f} req/s, {found}; {args.rounds} rounds, "
            f"steps and servers in random order; each step {args.warmup_seconds:g} s of warm-up arrivals (not "
            f"counted) then {args.step_seconds:g} s of measured ones (at least {args.requests} requests), so a "
            f"step's figures are the server's steady state at that load, not a burst from idle ('with warm-up': "
            f"p90 TPOT over every request of the step); a step's figures pool its rounds' requests; "
            f"{args.max_new_tokens} output tokens, the first {args.probes} measured the same prompts every step "
            f"(agreement: greedy tokens reproduced before the first divergence from upstream's). * = p90 TPOT over "
            f"the target. One skipper at a time, beside its own upstream.")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
