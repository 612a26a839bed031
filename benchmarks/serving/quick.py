"""The quick serving benchmark (`make demo`): paired rounds through SGLang's own client, with
quality measured beside speed, in under 10 minutes on 2 CPUs.

1. start every system's server (in parallel), one CPU thread each (see Settings);
2. quality, which also warms every server up: a spread of the shipped arithmetic questions,
   greedy, through every server (two at a time): accuracy (the answer's last integer, as
   benchmarks/quality_hf.py scores it), how often that answer equals upstream's, and greedy agreement
   (the share of upstream's answer tokens a system reproduces before its first divergence);
3. paired rounds, as many as the time budget allows (at least min_rounds; how many, and over how
   many server lifetimes, is planned from what start-up and round 1 took): each round samples
   fresh shipped prompts, and at each load runs upstream beside each other system in turn (in a
   fresh random order), the two at once on the same requests, one CPU each (see Settings:
   `side by side`): closed loop at each concurrency (output tok/s, TPOT), then one open-loop load,
   Poisson arrivals at `open_load` x upstream's capacity (e2e, TTFT); capacity = upstream's output
   throughput at the highest concurrency in round 1 / output length, then fixed for the run. The
   rounds are shared out over `lifetimes` server lifetimes: midway every server is stopped and
   started afresh (then warmed up by one wave of requests at the highest concurrency), because a
   server is a few percent faster or slower for its whole life;
4. per metric the median of per-round ratios against the upstream run beside it, with the interval
   another run's median would fall in, 95% of the time (benchmarks.stats.rerun: what a user
   who reruns the demo can check), tables, one verdict line and a figure, written to --out
   (results.json; the page docs/results/serving-quick.md).
"""
from __future__ import annotations

import os
import platform
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.results import log, write_results
from benchmarks.serving import report
from benchmarks.serving.servers import SERVER_THREADS, System, memory_gb, start_all, stop, transform_line
from benchmarks.stats import round_orders

CLOSED_METRICS = ("tok_s", "tpot_ms")
OPEN_METRICS = ("e2e_ms", "ttft_ms")
WARM_UP_SEED = 10**6  # + lifetime: a restarted server's unmeasured first wave (rounds use seeds below)


@dataclass(frozen=True)
class Settings:
    """What a quick run does. Why each value is what it is, with the runs that showed it:
    benchmarks/README.md, "Measurements behind the settings"."""

    rounds: int = 12  # at most; fewer when the time budget runs out, never fewer than min_rounds
    min_rounds: int = 3
    budget_s: float = 570.0  # the whole job, from `started` (calibration included): make demo <= 10 min
    # Closed loop, one wave of `concurrency` requests per call. One concurrency, the headline's: a
    # second one left too few rounds in the budget for an interval worth the name.
    concurrencies: tuple[int, ...] = (32,)
    open_load: float = 0.75  # x upstream's capacity
    open_requests: int = 8  # 0: no open loop (the demo's serving check is the closed loop alone)
    output_len: int = 16  # pinned (ignore_eos)
    questions: int = 32
    answer_tokens: int = 64
    seed: int = 0
    max_total_tokens: int = 8192  # KV pool per server (unset, SGLang sizes it from free RAM); 32 x (70 + 64) fits
    server_threads: int = SERVER_THREADS  # (servers.py says why one)
    # Side by side: upstream and the system compared with it run at the same time, each call of the
    # client in its own thread, the OS giving each server's one thread a CPU of its own, so a slow
    # spell of the shared machine hits both of a pair (a ratio's spread: 3% side by side, 8% one
    # after the other). Server lifetimes per run, the rounds shared out over them: a server is a few
    # percent faster or slower for its whole life, and restarting midway puts that spread inside
    # each run's interval.
    lifetimes: int = 2

    def __post_init__(self) -> None:
        for name in ("questions", "answer_tokens", "max_total_tokens", "server_threads", "lifetimes"):
            if getattr(self, name) < 1:
                raise ValueError(f"Settings.{name}={getattr(self, name)} must be >= 1")
        if self.open_requests < 0:
            raise ValueError(f"Settings.open_requests={self.open_requests} must be >= 0")
        if self.min_rounds < 3:
            raise ValueError(f"Settings.min_rounds={self.min_rounds} must be >= 3 "
                             f"(a median and its interval need a few rounds)")
        if self.min_rounds < self.lifetimes:
            raise ValueError(f"Settings.min_rounds={self.min_rounds} must be >= lifetimes={self.lifetimes} "
                             f"(a round per lifetime)")
        if self.rounds < self.min_rounds:
            raise ValueError(f"Settings.rounds={self.rounds} must be >= min_rounds={self.min_rounds}")
        if not self.concurrencies or any(c < 1 for c in self.concurrencies):
            raise ValueError(f"Settings.concurrencies={self.concurrencies} must be non-empty, each >= 1")
        if not 0 < self.open_load < 1.5:
            raise ValueError(f"Settings.open_load={self.open_load} must be in (0, 1.5)")
        if self.output_len < 4:
            raise ValueError(f"Settings.output_len={self.output_len} must be >= 4 (SGLang's client minimum)")
        if not self.budget_s > 0:
            raise ValueError(f"Settings.budget_s={self.budget_s} must be > 0")


def bar(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, mininterval=1.0)


def measure(res, load: str) -> dict:
    if load.startswith("open"):
        return {"e2e_ms": res.mean_e2e_ms, "ttft_ms": res.mean_ttft_ms, "tok_s": res.output_throughput}
    return {"tok_s": res.output_throughput, "tpot_ms": res.mean_tpot_ms, "e2e_ms": res.mean_e2e_ms}


def question_subset(n: int) -> list[dict]:
    """n of the shipped arithmetic questions, spread evenly over the set."""
    from vskipper.data import load

    qs = load("arithmetic")
    if n > len(qs):
        raise ValueError(f"questions={n}: the shipped set has {len(qs)}")
    return [qs[i * len(qs) // n] for i in range(n)]


def run(systems: list[System], s: Settings, out: Path, started: float | None = None, docs: Path | None = None,
        quality_fn=None, name: str = "serving-quick") -> str:
    """started: time.perf_counter() when the job began (the demo's calibration counts against
    s.budget_s); default now. docs: where the page serving-quick.md is rendered (None: no page).
    quality_fn({system: url}) -> {system: {...}}: measures quality through the servers once they are
    up, instead of the arithmetic pass (its result lands in results.json as "quality")."""
    import signal
    from concurrent.futures import ThreadPoolExecutor

    from benchmarks.serving.client import Client

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` stops the servers
    if len({x.name for x in systems}) != len(systems) or len(systems) < 2:
        raise ValueError(f"systems {[x.name for x in systems]}: need >= 2 with distinct names, the baseline first")
    t_start = time.perf_counter() if started is None else started
    deadline = t_start + s.budget_s
    out.mkdir(parents=True, exist_ok=True)
    names = [x.name for x in systems]
    base, others = names[0], names[1:]
    client = Client(systems[0].model_path, out)
    closed = [f"concurrency {c}" for c in s.concurrencies]
    open_label = f"open loop {s.open_load}x capacity"
    metrics_of = {**{c: CLOSED_METRICS for c in closed}, **({open_label: OPEN_METRICS} if s.open_requests else {})}
    # rounds[load][system]: one measurement per round (the baseline: one per pair it ran in);
    # beside[load][system]: the baseline's measurement in that system's pair, round by round
    rounds = {load: {n: [] for n in names} for load in metrics_of}
    beside = {load: {n: [] for n in others} for load in metrics_of}
    failed = {load: {n: 0 for n in names} for load in metrics_of}
    servers, transforms, orders, lives, rate = {}, {}, [], [], None
    questions = question_subset(s.questions)
    qrows = client.question_rows([q["prompt"] for q in questions], s.answer_tokens)
    texts, up_s, warm_s = {}, [], []  # seconds each start of the servers took, and each warm-up
    measured_quality = {}
    two, coin = ThreadPoolExecutor(2), random.Random(s.seed)

    def send(n: str, rows, **kw):
        try:
            return client.run(servers[n].url, rows, **kw)
        except Exception as e:
            code = servers[n].proc.poll()
            if code is None:
                raise
            raise RuntimeError(f"server {n} exited with {code} in the middle of the run "
                               f"(see {servers[n].log_path})") from e

    def side_by_side(a: str, b: str | None, rows, **kw):
        """a and b on the same requests at the same time, two one-thread servers on two CPUs (see
        Settings: side by side); which of the two is sent first, a few ms ahead, is drawn afresh."""
        if b is None:
            return send(a, rows, **kw), None
        first, second = (a, b) if coin.random() < 0.5 else (b, a)
        f1 = two.submit(send, first, rows, **kw)
        f2 = two.submit(send, second, rows, **kw)
        res = {first: f1.result(), second: f2.result()}
        return res[a], res[b]

    def in_twos(xs: list[str]) -> list[tuple[str, str | None]]:
        return [(xs[i], xs[i + 1] if i + 1 < len(xs) else None) for i in range(0, len(xs), 2)]

    def start_life(life: int, of: int) -> None:
        """Start every server (again): the first time, put the questions through them; after a
        restart, warm them up with one unmeasured wave."""
        nonlocal servers
        t0 = time.perf_counter()
        what = f"lifetime {life + 1}/{of}"
        if life:
            for srv in servers.values():
                stop(srv)
            log(f"servers restarted ({what}): {len(systems)} SGLang servers, then one warm-up wave each")
        with bar(len(systems), f"servers up ({what})") as b:
            servers = start_all(systems, out, s.max_total_tokens, on_ready=lambda n: b.update(1),
                                threads=s.server_threads, log_level="info")
        up_s.append(time.perf_counter() - t0)
        if life:
            t0, c = time.perf_counter(), max(s.concurrencies)
            rows = client.prompt_rows(c, s.output_len, seed=WARM_UP_SEED + life)
            with bar(len(systems), f"warm-up ({what})") as b:
                for a, a2 in in_twos(names):
                    side_by_side(a, a2, rows, concurrency=c)
                    b.update(1 + (a2 is not None))
            warm_s.append(time.perf_counter() - t0)
            return
        log("server memory (PSS): " + ", ".join(f"{n} {memory_gb(srv):.1f} GB" for n, srv in servers.items()))
        for n, srv in servers.items():
            transforms[n] = transform_line(srv)
            if transforms[n]:
                log(f"{n}: {transforms[n]}")
        if quality_fn is not None:
            log("phase 2/4: quality (and warm-up), through the servers")
            measured_quality.update(quality_fn({n: srv.url for n, srv in servers.items()}))
            return
        log(f"phase 2/4: quality (and warm-up): {s.questions} arithmetic questions, greedy, <= {s.answer_tokens} "
            f"new tokens, through every server, two servers at a time")
        with bar(len(systems), "quality") as b:
            for a, a2 in in_twos(names):
                for n, res in zip((a, a2), side_by_side(a, a2, qrows, concurrency=len(qrows), ignore_eos=False)):
                    if n is None:
                        continue
                    if res.completed != res.requests:
                        bad = next(e for e in res.errors if e)
                        raise RuntimeError(f"quality: {res.requests - res.completed} questions failed on {n}: "
                                           f"{bad[-500:]}")
                    texts[n] = res.texts
                    b.update(1)

    def plan(round_s: float) -> tuple[int, int]:
        """After round 1: (rounds, lifetimes) that fit what is left of the budget. The lifetimes
        are s.lifetimes if that many restarts still leave min_rounds and two rounds per lifetime,
        else 1 (one round on a lifetime says nothing of its spread); a restart costs a start-up as
        measured plus a warm-up (one wave per pair of servers: about the round's share of its
        highest-concurrency load, times pairs / systems compared)."""
        left = deadline - time.perf_counter() - 10  # 10 s: stop the servers, report
        warm = round_s / len(metrics_of) * len(in_twos(names)) / len(others)

        def fit(lives: int) -> int:
            return min(s.rounds, 1 + max(0, int((left - (lives - 1) * (up_s[0] + warm)) // round_s)))

        if s.lifetimes > 1 and fit(s.lifetimes) >= max(s.min_rounds, 2 * s.lifetimes):
            return fit(s.lifetimes), s.lifetimes
        return max(s.min_rounds, fit(1)), 1

    try:
        log(f"phase 1/4: starting {len(systems)} SGLang servers ({', '.join(names)}) in parallel, "
            f"{s.server_threads} CPU thread(s) each")
        start_life(0, s.lifetimes)
        log(f"phase 3/4: paired rounds ({s.min_rounds} to {s.rounds}, as the {s.budget_s:.0f} s budget allows): each "
            f"round, at each of {len(metrics_of)} loads, {base} beside each other system in turn (the two at once, "
            f"same requests), {s.output_len} output tokens per request")
        life, in_life, per_life, n_lives, round_times = 0, 0, None, s.lifetimes, []
        with bar(s.rounds * len(others) * len(metrics_of), "paired rounds") as b:
            for r, order in enumerate(round_orders(others, s.rounds, s.seed)):
                per_round = sum(round_times) / max(1, len(round_times))
                if r >= s.rounds or (r >= s.min_rounds and life == n_lives - 1 and in_life
                                     and time.perf_counter() + per_round + 10 > deadline):  # 10 s: stop, report
                    log(f"time budget: stopping after {r} rounds ({per_round:.0f} s each)")
                    break
                if life < n_lives - 1 and in_life == per_life:
                    life, in_life = life + 1, 0
                    start_life(life, n_lives)
                t_round = time.perf_counter()
                orders.append(order)
                rows = {c: client.prompt_rows(c, s.output_len, seed=s.seed + 1000 * r + c) for c in s.concurrencies}

                def measure_pairs(load, rows, **kw):
                    for n in order:
                        rb, rx = side_by_side(base, n, rows, **kw)
                        for who, res in ((base, rb), (n, rx)):
                            rounds[load][who].append(measure(res, load))
                            failed[load][who] += res.requests - res.completed
                        beside[load][n].append(rounds[load][base][-1])
                        b.update(1)

                for c, load in zip(s.concurrencies, closed):
                    measure_pairs(load, rows[c], concurrency=c)
                if s.open_requests:
                    if rate is None:
                        top = statistics.median(x["tok_s"] for x in rounds[closed[-1]][base])
                        rate = s.open_load * top / s.output_len
                        log(f"{base} capacity at {closed[-1]}: {top:.1f} tok/s = {top / s.output_len:.2f} req/s; "
                            f"open loop at {rate:.2f} req/s")
                    open_rows = client.prompt_rows(s.open_requests, s.output_len, seed=s.seed + 1000 * r + 7)
                    measure_pairs(open_label, open_rows, concurrency=None, rate=rate, seed=s.seed + r)
                lives.append(life)
                in_life += 1
                round_times.append(time.perf_counter() - t_round)
                if per_life is None:  # after round 1: the rounds that fit, shared out over the lifetimes
                    round_s = round_times[0]
                    fit, n_lives = plan(round_s)
                    per_life = fit // n_lives  # the last lifetime takes the rest, as long as the budget allows
                    b.total = fit * len(others) * len(metrics_of)
                    log(f"about {fit} rounds of {round_s:.0f} s fit the budget"
                        + (f": {per_life} per server lifetime, {n_lives} lifetimes" if n_lives > 1 else
                           " with no restart (one server lifetime: the intervals cannot see a server's "
                           "lifetime offset)"))
                b.set_postfix_str(" ".join(f"{n}={rounds[closed[-1]][n][-1]['tok_s']:.0f}" for n in names))
    finally:
        two.shutdown(wait=False, cancel_futures=True)
        for srv in servers.values():
            stop(srv)

    log("phase 4/4: report")
    d = report.deltas(rounds, names, metrics_of, lives, beside)
    labels = {x.name: x.label for x in systems}
    wall = time.perf_counter() - t_start
    loop = (f", open loop {s.open_requests} requests at {rate:.2f} req/s ({s.open_load}x upstream's capacity)"
            if s.open_requests else "")
    header = (f"Quick paired run: {len(orders)} rounds, closed loop at concurrency "
              f"{', '.join(map(str, s.concurrencies))} (one wave each){loop}, {s.output_len} output tokens per "
              f"request, SGLang's benchmark client, {s.server_threads} CPU thread(s) per server, {names[0]} beside "
              f"each other system in turn, the two at once, {max(lives) + 1} server lifetime(s), rounds per lifetime "
              f"{[lives.count(x) for x in range(max(lives) + 1)]}; deltas: median of per-round ratios vs {names[0]} "
              f"[95% rerun interval: where another run's median would fall]; "
              f"{wall:.0f} s (servers included)")
    text = f"{header}\n\n{report.tables(rounds, d, names, metrics_of, failed)}\n"
    saved = {"settings": asdict(s), "systems": [asdict(x) for x in systems], "transforms": transforms,
             "open_rate": rate, "rounds": rounds, "beside": beside, "orders": orders, "lifetimes": lives,
             "failed": failed, "start_s": up_s, "warm_up_s": warm_s, "round_s": round_times, "wall_s": wall,
             "deltas": {load: {n: {m: asdict(v) for m, v in dm.items()} for n, dm in dl.items()}
                        for load, dl in d.items()}}
    if quality_fn is not None:  # the caller reports quality and the verdict (benchmarks/demo.py)
        write_results(name, {**saved, "quality": measured_quality}, text, out, docs)
        return text
    quality = {}
    encode = lambda t: client.tokenizer.encode(t, add_special_tokens=False)  # noqa: E731
    base_ids = [encode(t) for t in texts[names[0]]]
    for n in names:
        correct = sum(report.last_integer(t) == int(q["answer"]) for t, q in zip(texts[n], questions))
        same = sum(report.last_integer(b) is not None and report.last_integer(a) == report.last_integer(b)
                   for a, b in zip(texts[n], texts[names[0]]))
        quality[n] = {"correct": correct, "same": same, "questions": len(questions),
                      "accuracy": correct / len(questions), "agreement": same / len(questions),
                      "prefix": report.prefix_share([encode(t) for t in texts[n]], base_ids)}
    # The verdict carries the closed-loop headline only: a few Poisson arrivals per round are too few
    # to trust (benchmarks/README.md, "Measurements behind the settings"); the open loop stays in the tables.
    line = report.verdict(d, quality, names, labels, (closed[-1], "tok_s"), None)
    curve = {n: sorted([(_median(rounds[c][n], "tok_s") / s.output_len, _median(rounds[c][n], "e2e_ms") / 1e3)
                        for c in closed] + ([(rate, _median(rounds[open_label][n], "e2e_ms") / 1e3)]
                                            if s.open_requests else [])) for n in names}
    fig = out / "serving-quick.png"
    report.plot(rounds, d, names, curve, fig, f"SGLang vs SGLang + vskipper, {time.strftime('%Y-%m-%d')}, "
                f"{platform.machine()} {os.cpu_count()} CPUs: {len(orders)} paired rounds, "
                f"{s.output_len} output tokens")
    text += f"\n{report.quality_table(quality, names)}\n\n{line}\n"
    write_results(name, {**saved, "quality": quality, "verdict": line,
                         "answers": {n: list(t) for n, t in texts.items()}}, text, out, docs)
    return text + f"plot: {fig}\n"


def _median(rows: list[dict], metric: str) -> float:
    return statistics.median(r[metric] for r in rows)
