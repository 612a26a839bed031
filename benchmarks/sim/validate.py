"""The simulator against real SGLang servers on this machine, through SGLang's own client.

    python -m benchmarks.sim.validate fit            # the fit workload: closed loop, fixed lengths, per system
    python -m benchmarks.sim.validate run --round 1  # one round of the held-out workload at every rate
    python -m benchmarks.sim.validate page           # simulate every measured trace; results.json + the page

Systems: upstream SGLang, RandomSkip 0.5 over layers 15-29 and the shipped FlexiDepth skipper on the bundled
SmolLM2-135M, every skipper in the routed body (VSKIPPER_EXECUTION=routed: what the step sweep timed), one
CPU thread per server, the servers of benchmarks/serving/servers.py (their flags: --max-total-tokens 32768,
SGLang's defaults otherwise: chunked prefill 4096, max prefill tokens 16384, 2048 running requests, the
overlap scheduler), one server measured at a time. Requests are random token ids with pinned output lengths
(SGLang's client, ignore_eos), sent by SGLang's request function (benchmarks/serving/client.py).

fit: per system, closed loop at concurrency 1, 4, 12 and 24 (prompt 64, output 24 tokens). The engine steps come
from the step tables (benchmarks/sim/step_sweep.py); what the server adds, the host work per step and the
way in and out, is fitted here and written into the tables: per concurrency the measured median ITL less the
simulated one with no host work is the host work per decode step at that batch size (a line in the batch
size; the same taken for a prefill step per row), and the measured TTFT at concurrency 1 less the simulated
one is the way in and out. Each run is simulated on its own trace (the send times the client recorded).

run: the held-out workload (prompts 24-160, outputs 8-40 tokens, uniform), Poisson arrivals at 0.6, 1.0 and
1.4 x upstream's latency knee as the fitted simulator predicts it (where its mean TPOT doubles; fixed at the
first round, in plan.json), each run sized to about `--seconds` of arrivals; one round = every system at
every rate, in random order.

page: every measured run simulated on its own trace; per system and rate, the rounds pooled (requests of all
rounds together; throughput = all tokens / all durations), measured beside simulated for mean, p50 and p90
TTFT, TPOT, ITL and e2e and output throughput, with the errors, and the criterion: the median absolute error
over the mean-TTFT, mean-TPOT and throughput cells at most 10%, p90 TPOT within 20%.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from benchmarks import results as R
from benchmarks.results import log
from benchmarks.sim.step_sweep import LABELS, TABLES

SPECS = {"upstream": None, "random0.5": "random:rate=0.5,layers=15-29,seed=0",
         "trained": "flexidepth:name=smollm2-135m-flexidepth"}
MAX_TOTAL = 32768  # benchmarks/serving/servers.py: start()'s default
FIT = {"prompt": 64, "output": 24, "runs": [(1, 6), (4, 12), (12, 24), (24, 48)]}  # (concurrency, requests)
HELD_OUT = {"prompt": (24, 160), "output": (8, 40), "load": (0.6, 1.0, 1.4)}
OUT = Path("out") / "sim-validate"


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.sim.validate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["fit", "run", "page"])
    ap.add_argument("--round", type=int, help="run: which round (its file: OUT/rounds/round-N.json)")
    ap.add_argument("--systems", nargs="+", default=list(SPECS), choices=list(SPECS))
    ap.add_argument("--seconds", type=float, default=100.0, help="run: arrivals per run, in seconds of the rate")
    ap.add_argument("--tables", type=Path, default=TABLES)
    ap.add_argument("--smoke", action="store_true", help="tiny runs (a few requests), nothing written to docs")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--docs", help="where the page goes (default docs/results; 'none': no page)")
    a = ap.parse_args(argv)
    if a.what == "run" and (a.round is None or a.round < 1):
        ap.error("run needs --round N (N >= 1)")
    return a


# --- measuring --------------------------------------------------------------------------------------
def system(name: str):
    from benchmarks.serving.servers import System
    from vskipper.models.smollm2 import smollm2_dir

    env = () if SPECS[name] is None else (("VSKIPPER_EXECUTION", "routed"),)
    return System(name, str(smollm2_dir()), SPECS[name], env, LABELS[name])


def rows_for(lengths: list[tuple[int, int]], seed: int) -> list:
    """SGLang DatasetRows of random token ids (as one_batch and the step sweep use), output pinned."""
    from sglang.benchmark.datasets.common import DatasetRow

    rng = random.Random(seed)
    return [DatasetRow(prompt=[rng.randint(1, 10000) for _ in range(p)], prompt_len=p, output_len=o)
            for p, o in lengths]


def measure(client, url: str, rows: list, concurrency: int | None, rate: float, seed: int) -> dict:
    """One run through SGLang's request function: per request (sent s, ttft, latency, itl, prompt, output)."""
    import asyncio

    import numpy as np

    from benchmarks.serving.client import _args, _arrivals

    sb = client.sb
    sb.set_global_args(_args(True))
    sb.flush_server_cache(url, "sglang")
    at = None if rate == float("inf") else _arrivals(len(rows), rate, np.random.default_rng(seed))
    outputs, duration = asyncio.run(client._drive(url, rows, concurrency, at))
    bad = [o.error for o in outputs if not o.success]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(outputs)} requests failed: {bad[0][:300]}")
    t0 = min(o.start_time for o in outputs)
    return {"concurrency": concurrency, "rate": rate, "duration": duration,
            "requests": [{"sent": o.start_time - t0, "ttft": o.ttft, "latency": o.latency, "itl": list(o.itl),
                          "prompt": r.prompt_len, "output": o.output_len} for o, r in zip(outputs, rows)]}


def with_servers(args, names: list[str], work) -> None:
    from benchmarks.serving import servers as S
    from benchmarks.serving.client import Client
    from vskipper.models.smollm2 import smollm2_dir

    client = Client(str(smollm2_dir()), args.out / "client")
    live = S.start_all([system(n) for n in names], args.out / "logs", max_total_tokens=MAX_TOTAL,
                       threads=S.SERVER_THREADS)
    try:
        work(client, {n: s.url for n, s in live.items()})
    finally:
        for s in live.values():
            S.stop(s)


def fit_cmd(args) -> None:
    runs = FIT["runs"][:1] if args.smoke else FIT["runs"]
    got = {}

    def work(client, urls):
        for n in args.systems:
            got[n] = []
            for c, k in runs:
                rows = rows_for([(FIT["prompt"], FIT["output"])] * (2 if args.smoke else k), seed=c)
                got[n].append(measure(client, urls[n], rows, c, float("inf"), 0))
                itl = statistics.median(i for q in got[n][-1]["requests"] for i in q["itl"])
                log(f"fit {n} c={c}: median ITL {itl * 1e3:.0f} ms")

    with_servers(args, args.systems, work)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fit.json").write_text(json.dumps({"machine": R.machine(), "date": time.strftime("%Y-%m-%d %H:%M %Z"),
                                                   "runs": got}, indent=1))
    hosts = {n: fit_host(args.tables, n, got[n]) for n in args.systems}
    if not args.smoke:
        data = json.loads(args.tables.read_text())
        for n, h in hosts.items():
            data["systems"][n]["host"] = h
        data["host"] = hosts["upstream"] if "upstream" in hosts else data["host"]
        data["server"] = ["--max-total-tokens", str(MAX_TOTAL)]
        args.tables.write_text(json.dumps(data, indent=1) + "\n")
    for n, h in hosts.items():
        log(f"host {n}: {h}")


def trace_of(run: dict) -> list:
    from vskipper.sim import Request

    return [Request(q["sent"], q["prompt"], q["output"], q["output"], True) for q in run["requests"]]


def sim_run(tables, name: str, run: dict, host=None):
    from vskipper.sim import ServerConfig, simulate

    return simulate(trace_of(run), tables.model(name), host or tables.host_for(name),
                    ServerConfig(max_total_tokens=MAX_TOTAL))


def fit_host(path: Path, name: str, runs: list[dict]) -> dict:
    """Host work per step (h0 + h1 B) from median ITLs, the way in and out from TTFT at concurrency 1."""
    import numpy as np

    from vskipper.sim import Host, StepTables
    from vskipper.sim.steps import nnls

    tables = StepTables.load(path)
    missing = sorted({r["concurrency"] for r in runs} - set(tables.model(name).decode_fit))
    if missing:
        log(f"fit {name}: concurrency {', '.join(map(str, missing))} is no batch size of the step tables: its "
            f"residual carries the interpolation's error into the host (sweep them: step_sweep --batch)")
    zero = Host(serial=True)
    xs, ys = [], []
    for run in runs:
        meas = statistics.median(i for q in run["requests"] for i in q["itl"])
        sim = float(np.median(sim_run(tables, name, run, zero).itl))
        xs.append(run["concurrency"])
        ys.append((meas - sim) * 1e3)
    h0, h1 = nnls([[1.0, x] for x in xs], ys) if len(xs) > 1 else (max(ys[0], 0.0), 0.0)
    host = Host((h0, h1), (h0, h1), 0.0, 0.0, True)
    one = min(runs, key=lambda r: r["concurrency"])
    s = sim_run(tables, name, one, host)
    ingress = max(statistics.mean(q["ttft"] for q in one["requests"]) - float(s.ttft.mean()), 0.0) * 1e3
    src = (f"benchmarks/sim/validate.py fit: median ITL at concurrency {', '.join(str(x) for x in xs)} less the "
           f"simulated engine steps ({', '.join(f'{y:.1f}' for y in ys)} ms); TTFT at concurrency {one['concurrency']}")
    return Host((h0, h1), (h0, h1), ingress, 0.0, True, src).to_dict()


def plan_rates(args) -> dict:
    """The held-out rates, fixed at the first round: HELD_OUT['load'] x upstream's latency knee as the fitted
    simulator predicts it: the lowest rate (a 0.05 req/s grid) at which its mean TPOT is twice the TPOT at
    0.1 req/s. (The paper's knee, where output tok/s stops growing, does not exist on this CPU within any
    latency a user would wait for: a bigger batch keeps costing less per token, so tok/s grows while TPOT
    runs to seconds.)"""
    path = args.out / "plan.json"
    if path.is_file():
        return json.loads(path.read_text())
    from vskipper.sim import ServerConfig, StepTables, Workload, poisson, simulate

    tables = StepTables.load(args.tables)
    w = Workload(f"uniform:{HELD_OUT['prompt'][0]}-{HELD_OUT['prompt'][1]}",
                 f"uniform:{HELD_OUT['output'][0]}-{HELD_OUT['output'][1]}", ignore_eos=True)

    def tpot(rate: float) -> float:
        reqs = w.requests(poisson(rate, n=max(40, round(rate * 300)), seed=0), seed=0)
        return simulate(reqs, tables.model("upstream"), tables.host_for("upstream"),
                        ServerConfig(max_total_tokens=MAX_TOTAL)).summary()["tpot_mean"]

    low = tpot(0.1)
    knee = next(r / 20 for r in range(2, 100) if tpot(r / 20) >= 2 * low)
    plan = {"knee_rps": knee, "tpot_low_ms": low, "rates": [round(x * knee, 3) for x in HELD_OUT["load"]],
            "load": HELD_OUT["load"]}
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plan, indent=1))
    return plan


def run_cmd(args) -> None:
    plan = plan_rates(args)
    rates = plan["rates"][:1] if args.smoke else plan["rates"]
    order = [(n, r) for n in args.systems for r in rates]
    random.Random(args.round).shuffle(order)
    got = []

    def work(client, urls):
        for n, rate in order:
            k = 3 if args.smoke else max(8, round(rate * args.seconds))
            rng = random.Random(args.round * 100 + rates.index(rate))
            rows = rows_for([(rng.randint(*HELD_OUT["prompt"]), rng.randint(*HELD_OUT["output"])) for _ in range(k)],
                            seed=args.round * 100 + rates.index(rate))
            run = measure(client, urls[n], rows, None, rate, seed=args.round * 100 + rates.index(rate))
            run.update(system=n, round=args.round)
            got.append(run)
            m = statistics.mean(q["ttft"] for q in run["requests"])
            log(f"round {args.round} {n} at {rate} req/s: {k} requests, mean TTFT {m * 1e3:.0f} ms, "
                f"{sum(q['output'] for q in run['requests']) / run['duration']:.1f} tok/s")

    with_servers(args, args.systems, work)
    d = args.out / "rounds"
    d.mkdir(parents=True, exist_ok=True)
    (d / f"round-{args.round}.json").write_text(json.dumps({"machine": R.machine(), "date": time.strftime(
        "%Y-%m-%d %H:%M %Z"), "plan": plan, "runs": got}, indent=1))


# --- the page -----------------------------------------------------------------------------------------
CELLS = [("ttft", "mean"), ("ttft", "p50"), ("ttft", "p90"), ("tpot", "mean"), ("tpot", "p50"), ("tpot", "p90"),
         ("itl", "mean"), ("itl", "p50"), ("itl", "p90"), ("e2e", "mean"), ("e2e", "p50"), ("e2e", "p90")]
JUDGED = {("ttft", "mean"), ("tpot", "mean"), ("throughput", "")}


def pooled_measured(runs: list[dict]) -> dict:
    """Metrics over the requests of every round pooled, as SGLang's client computes them per run."""
    import numpy as np

    qs = [q for r in runs for q in r["requests"]]
    ttft = np.array([q["ttft"] for q in qs])
    e2e = np.array([q["latency"] for q in qs])
    tpot = np.array([(q["latency"] - q["ttft"]) / (q["output"] - 1) for q in qs if q["output"] > 1])
    itl = np.array([i for q in qs for i in q["itl"]])
    tokens = sum(q["output"] for q in qs)
    return _stats(ttft, tpot, itl, e2e) | {"throughput": tokens / sum(r["duration"] for r in runs)}


def pooled_simulated(results: list) -> dict:
    import numpy as np

    cat = lambda f: np.concatenate([f(s) for s in results])  # noqa: E731
    tokens = sum(float(s.output.sum()) for s in results)
    return _stats(cat(lambda s: s.ttft), cat(lambda s: s.tpot), cat(lambda s: s.itl), cat(lambda s: s.e2e)) | {
        "throughput": tokens / sum(s.duration for s in results)}


def _stats(ttft, tpot, itl, e2e) -> dict:
    import numpy as np

    out = {}
    for name, x in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e)):
        x = x * 1e3
        out[(name, "mean")] = float(x.mean())
        out[(name, "p50")] = float(np.percentile(x, 50))
        out[(name, "p90")] = float(np.percentile(x, 90))
    return out


def alone_itl(runs: list[dict]) -> tuple[int, float | None]:
    """Requests alone in the server their whole life (no other request sent before they ended or ending after
    they were sent): how many, and the median of their ITLs (ms), i.e. of served decode steps of one row."""
    import numpy as np

    alone = []
    for r in runs:
        life = [(q["sent"], q["sent"] + q["latency"]) for q in r["requests"]]
        alone += [q for j, (q, (a, b)) in enumerate(zip(r["requests"], life))
                  if not any(k != j and a2 <= b and b2 >= a for k, (a2, b2) in enumerate(life))]
    itl = [i * 1e3 for q in alone for i in q["itl"]]
    return len(alone), (float(np.median(itl)) if itl else None)


def page_cmd(args) -> None:
    from vskipper.sim import StepTables

    tables = StepTables.load(args.tables)
    rounds = sorted((args.out / "rounds").glob("round-*.json"))
    if not rounds:
        raise SystemExit(f"no rounds under {args.out / 'rounds'}: run `python -m benchmarks.sim.validate run "
                         f"--round 1`")
    recs = [json.loads(p.read_text()) for p in rounds]
    runs = [r for rec in recs for r in rec["runs"]]
    plan = recs[0]["plan"]
    cells, errs = [], {"judged": [], "p90_tpot": []}
    rows = []
    for n in [s for s in SPECS if any(r["system"] == s for r in runs)]:
        for rate in plan["rates"]:
            mine = [r for r in runs if r["system"] == n and r["rate"] == rate]
            if not mine:
                continue
            meas = pooled_measured(mine)
            sim = pooled_simulated([sim_run(tables, n, r) for r in mine])
            for key in [*CELLS, ("throughput", "")]:
                k = "throughput" if key[0] == "throughput" else key
                m, s = meas[k], sim[k]
                e = s / m - 1
                cells.append({"system": n, "rate": rate, "metric": key[0], "stat": key[1], "measured": m,
                              "simulated": s, "error": e, "rounds": len(mine),
                              "requests": sum(len(r["requests"]) for r in mine)})
                if key in JUDGED:
                    errs["judged"].append(abs(e))
                    if key[0] != "throughput":
                        errs.setdefault("latency", []).append(abs(e))
                if key == ("tpot", "p90"):
                    errs["p90_tpot"].append(abs(e))
            rows.append([LABELS[n], f"{rate:g}", sum(len(r["requests"]) for r in mine)]
                        + [f"{meas[k]:.0f} / {sim[k]:.0f} ({sim[k] / meas[k] - 1:+.0%})" for k in CELLS]
                        + [f"{meas['throughput']:.1f} / {sim['throughput']:.1f} "
                           f"({sim['throughput'] / meas['throughput'] - 1:+.0%})"])
    med = statistics.median(errs["judged"])
    med_lat = statistics.median(errs["latency"])
    lone = []  # per round and system: served one-row decode steps beside the table's step at B=1 plus the host
    for rec, path in zip(recs, rounds):
        for n in [s for s in SPECS if any(r["system"] == s for r in rec["runs"])]:
            k, itl = alone_itl([r for r in rec["runs"] if r["system"] == n])
            m, h = tables.model(n), tables.host_for(n)
            step = m.decode_ms(1, 100.0) + h.decode_ms[0] + h.decode_ms[1]
            lone.append([path.stem, rec["date"], n, k, "-" if itl is None else f"{itl:.1f}", f"{step:.1f}",
                         "-" if itl is None else f"{step / itl - 1:+.0%}"])
    worst_p90 = max(errs["p90_tpot"])
    ok = med <= 0.10 and worst_p90 <= 0.20
    fit = json.loads((args.out / "fit.json").read_text()) if (args.out / "fit.json").is_file() else {}
    hosts = {n: tables.host_for(n) for n in tables.systems}
    text = (f"Measured (SGLang 0.5.23 servers on this machine, one CPU thread each, one at a time, SGLang's client, "
            f"{len(recs)} round(s) pooled: {', '.join(rec['date'] for rec in recs)}; fit workload measured "
            f"{fit.get('date', '?')}) beside simulated (vskipper/sim on each run's own trace: its send times and "
            f"lengths), held-out workload: prompts {HELD_OUT['prompt'][0]}-{HELD_OUT['prompt'][1]} and outputs "
            f"{HELD_OUT['output'][0]}-{HELD_OUT['output'][1]} tokens (uniform, random ids, pinned outputs), Poisson "
            f"arrivals at {', '.join(f'{x:g}' for x in plan['load'])} x upstream's latency knee as the simulator "
            f"fitted before the first round predicted it (fixed then, in plan.json; its mean TPOT twice that at "
            f"0.1 req/s, {plan['tpot_low_ms']:.0f} ms: "
            f"{plan['knee_rps']:g} req/s): {', '.join(f'{r:g}' for r in plan['rates'])} req/s. "
            f"Fitted on another workload (closed loop at concurrency "
            f"{', '.join(str(c) for c, _ in FIT['runs'])}, prompt {FIT['prompt']}, output {FIT['output']}) and the "
            f"step sweep (docs/results/sim-steps-cpu.md).\n\n"
            f"**Criterion: {'MET' if ok else 'NOT MET'}.** Median absolute error over the mean-TTFT, mean-TPOT and "
            f"throughput cells {med:.1%} (at most 10%); p90 TPOT within {worst_p90:.1%} at worst (at most 20%; "
            f"median {statistics.median(errs['p90_tpot']):.1%}). Over the mean-TTFT and mean-TPOT cells alone the "
            f"median absolute error is {med_lat:.1%}: at these rates every server keeps up with its arrivals, so "
            f"output tok/s is the offered load's in both (the throughput cells check the trace, not the steps).\n\n"
            "Each cell: measured / simulated (simulated over measured - 1); latencies in ms, throughput in output "
            "tok/s.\n\n"
            + R.table(["system", "req/s", "requests"] + [f"{m} {s}" for m, s in CELLS] + ["output tok/s"], rows)
            + "\n\nHost work per step and way in and out, fitted on the fit workload (ms; decode h0 + h1 B, the "
            "same per prefill row):\n\n"
            + R.table(["system", "h0", "h1", "ingress", "source"],
                      [[n, f"{h.decode_ms[0]:.1f}", f"{h.decode_ms[1]:.2f}", f"{h.ingress_ms:.0f}", h.source]
                       for n, h in hosts.items()])
            + "\n\nThe machine's speed per round: the median ITL of the requests that were alone in the server (served "
            "decode steps of one row) beside what the tables price such a step at (B=1, 100 tokens of context, plus "
            "the host):\n\n"
            + R.table(["round", "measured", "system", "requests alone", "their median ITL ms", "tables' step ms",
                       "tables over served"], lone))
    print(text)
    R.write_results("sim-validation", {"plan": plan, "cells": cells, "median_abs_error_judged": med,
                                       "median_abs_error_ttft_tpot": med_lat, "alone": lone,
                                       "worst_p90_tpot_error": worst_p90, "met": ok,
                                       "rounds": [str(p) for p in rounds]},
                    text, args.out / "page", None if args.docs == "none" else Path(args.docs or R.DOCS))


def main(argv=None) -> None:
    args = parse(argv)
    {"fit": fit_cmd, "run": run_cmd, "page": page_cmd}[args.what](args)


if __name__ == "__main__":
    main()
