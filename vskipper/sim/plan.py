"""`vskipper plan`: at my load, on my device, does skipping cut my latency, and by how much?

Simulates SGLang's scheduler (vskipper/sim) for upstream and for a skipper on a device's step tables, over a
rate or a sweep of rates, and prints per rate and metric upstream beside vskipper, the rate from which
skipping pays, each system's knee and its saturation throughput. The skipper is a system of the tables
(`--skipper`), one of them moved to another RUN fraction (`--run-fraction`, linear in the fraction between
upstream's steps and that system's), or a cost calibration of one routed layer (`--calibration`, with
`--routed-layers` and `--run-fraction`: each step less what the calibration says the routed layers save at
that batch size). Flags of this file; vskipper/cli.py only adds the subparser.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from vskipper.sim.engine import simulate
from vskipper.sim.metrics import knee
from vskipper.sim.server import ServerConfig
from vskipper.sim.steps import Host, StepModel, StepTables
from vskipper.sim.workload import Workload, poisson

__all__ = ["TABLES_DIR", "add_arguments", "calibrated", "main", "pays_from", "resolve_tables", "run_plan"]

TABLES_DIR = Path(__file__).resolve().parent / "tables"
SHOWN = [("ttft_mean", "mean TTFT ms"), ("ttft_p90", "p90 TTFT ms"), ("tpot_mean", "mean TPOT ms"),
         ("e2e_mean", "mean e2e ms"), ("e2e_p90", "p90 e2e ms"), ("output_tps", "output tok/s")]


def shipped_tables() -> list[str]:
    return sorted(p.stem for p in TABLES_DIR.glob("*.json"))


def resolve_tables(spec: str) -> StepTables:
    """A shipped table set by name (vskipper/sim/tables/NAME.json) or a step table file's path."""
    p = Path(spec)
    if p.suffix == ".json" or p.exists():
        return StepTables.load(p)
    if (TABLES_DIR / f"{spec}.json").is_file():
        return StepTables.load(TABLES_DIR / f"{spec}.json")
    raise ValueError(f"--tables {spec!r}: neither a file nor a shipped table set; shipped: "
                     f"{', '.join(shipped_tables()) or 'none'}")


def parse_rates(spec: str) -> list[float]:
    """'4' | '1,2,4' | '1:20' (integers 1..20) | '0.5:3:0.5' (start:stop:step, stop included)."""
    try:
        if ":" in spec:
            parts = [float(x) for x in spec.split(":")]
            if len(parts) not in (2, 3):
                raise ValueError
            a, b, step = parts[0], parts[1], parts[2] if len(parts) == 3 else 1.0
            if step <= 0 or b < a:
                raise ValueError
            n = int(round((b - a) / step))
            rates = [round(a + i * step, 9) for i in range(n + 1)]
        else:
            rates = [float(x) for x in spec.split(",")]
    except ValueError:
        raise ValueError(f"--rates {spec!r}: expected R, R1,R2,..., START:STOP or START:STOP:STEP") from None
    if not rates or any(not r > 0 for r in rates) or any(b <= a for a, b in zip(rates, rates[1:])):
        raise ValueError(f"--rates {spec!r}: rates must be > 0 and increasing")
    return rates


def calibrated(upstream: StepModel, entries: list[dict], routed_layers: int, run_fraction: float) -> StepModel:
    """upstream's steps less what `routed_layers` routed layers save at `run_fraction`, priced by a cost
    calibration (vskipper calibrate's JSON: per T rows, dense and routed ms of one routed layer over RUN
    fractions): per decode batch B, L (dense(T=B) - cheapest body(T=B, f)); per prefill token, the saving of
    its largest T over T (the prefill table's where present, else the decode table's)."""
    if not 0 <= run_fraction <= 1:
        raise ValueError(f"--run-fraction {run_fraction!r}: expected a number in [0, 1]")
    if routed_layers < 1:
        raise ValueError(f"--routed-layers {routed_layers!r}: expected an integer >= 1")
    by_phase = {}
    for e in entries:
        if not isinstance(e, dict) or not all(k in e for k in ("ts", "fs", "dense", "routed")):
            raise ValueError("--calibration: an entry is not a cost calibration (needs ts, fs, dense, routed)")
        if not e.get("sublayers", False):
            by_phase.setdefault(e.get("phase", "decode"), e)
    if "decode" not in by_phase:
        raise ValueError("--calibration: no whole-layer decode table in it")

    def saving(e: dict, i: int) -> float:
        d = statistics.median(e["dense"][i])
        best = d
        for body in ("routed", "routed_mlp"):
            if not e.get(body):
                continue
            fs, row = e["fs"], [r / dd * d for r, dd in zip(e[body][i], e["dense"][i])]
            j = max(k for k in range(len(fs)) if fs[k] <= run_fraction) if run_fraction >= fs[0] else 0
            j = min(j, len(fs) - 2)
            w = min(max((run_fraction - fs[j]) / (fs[j + 1] - fs[j]), 0.0), 1.0)
            best = min(best, row[j] * (1 - w) + row[j + 1] * w)
        return max(d - best, 0.0)

    dec = by_phase["decode"]
    save = {int(T): routed_layers * saving(dec, i) for i, T in enumerate(dec["ts"])}
    bs = sorted(set(upstream.decode_fit) | set(save))
    upstream._grow(max(bs))
    fit = {}
    for B in bs:
        s = save.get(B)
        if s is None:  # between calibrated T: linear
            lo = max((t for t in save if t < B), default=min(save))
            hi = min((t for t in save if t > B), default=max(save))
            s = save[lo] if hi == lo else save[lo] + (save[hi] - save[lo]) * (B - lo) / (hi - lo)
        fit[B] = (max(upstream._t0[B] - s, 0.0), upstream._k[B])
    pre = by_phase.get("prefill", dec)
    i = len(pre["ts"]) - 1
    per_token = routed_layers * saving(pre, i) / pre["ts"][i]
    ext = dict(upstream.extend, per_token=max(upstream.extend["per_token"] - per_token, 0.0))
    return StepModel("calibrated", fit, ext, {"decode": run_fraction, "extend": run_fraction},
                     {B: f"upstream less the calibration's saving of {routed_layers} layers" for B in fit},
                     f"{routed_layers} routed layers at RUN fraction {run_fraction:g} (cost calibration)")


def pays_from(rates: list[float], up: list[float], sk: list[float], margin: float = 0.01) -> float | None:
    """The lowest rate from which the skipper's value is at least `margin` under upstream's at that rate and
    at every higher rate swept; None if it is not so at the highest."""
    out = None
    for r, u, s in reversed(list(zip(rates, up, sk))):
        if s <= u * (1 - margin):
            out = r
        else:
            break
    return out


def run_plan(tables: StepTables, skipper: tuple[StepModel, Host], workload: Workload, rates: list[float],
             requests: int | None, duration: float | None, seeds: int, server: ServerConfig) -> dict:
    """{system: [per rate: {metric: median over seeds}, ...]} and the spread, for upstream and the skipper."""
    if seeds < 1:
        raise ValueError(f"--seeds {seeds}: expected >= 1")
    systems = {"upstream": (tables.model("upstream"), tables.host_for("upstream")), "vskipper": skipper}
    out = {}
    for name, (model, host) in systems.items():
        per_rate = []
        for rate in rates:
            runs = []
            for seed in range(seeds):
                arr = poisson(rate, n=requests, seed=seed) if requests else poisson(rate, duration=duration, seed=seed)
                runs.append(simulate(workload.requests(arr, seed), model, host, server, record_batches=True).summary())
            per_rate.append({k: statistics.median(r[k] for r in runs) for k in runs[0]}
                            | {f"{k}_range": (min(r[k] for r in runs), max(r[k] for r in runs)) for k in runs[0]})
        out[name] = per_rate
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tables", required=True,
                   help="a device's step tables: a shipped set by name (" + (", ".join(shipped_tables()) or "none")
                        + ") or a step table file (JSON, format vskipper-step-tables/1)")
    p.add_argument("--prompt", required=True, help="prompt lengths: fixed:N, uniform:A-B, normal:mean=M,sd=S, "
                                                   "lognormal:mean=M,sd=S (optionally ,min=,max=)")
    p.add_argument("--output", required=True, help="output lengths, the same forms")
    p.add_argument("--max-new-tokens", type=int,
                   help="the cap requests are sent with (outputs end at EOS, drawn from --output, at most this)")
    p.add_argument("--ignore-eos", action="store_true", help="outputs pinned at their drawn length (as SGLang's "
                                                             "benchmark client sends them)")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--rate", help="requests per second (Poisson)")
    g.add_argument("--rates", help="a sweep: R1,R2,... or START:STOP[:STEP] (integer steps by default)")
    p.add_argument("--requests", type=int, default=1000, help="requests per simulated run (default 1000)")
    p.add_argument("--duration", type=float, help="seconds of arrivals per run instead of --requests")
    p.add_argument("--skipper", help="the tables' system to compare with upstream (default: its first skipping one)")
    p.add_argument("--run-fraction", type=float,
                   help="the skipper's RUN fraction of routed-layer rows: the --skipper system moved to it (or, with "
                        "--calibration, the fraction priced)")
    p.add_argument("--calibration", type=Path, help="a cost calibration file (vskipper calibrate's cache, JSON) of one "
                                                    "routed layer: the skipper is upstream less its saving")
    p.add_argument("--routed-layers", type=int, help="with --calibration: how many layers the skipper routes")
    p.add_argument("--server", help="SGLang flags of the server, e.g. \"--max-total-tokens 200000 "
                                    "--chunked-prefill-size 4096\" (default: the tables' own)")
    p.add_argument("--seeds", type=int, default=3,
                   help="runs per rate (arrivals and lengths), median shown (default 3)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")


def _skipper(args, tables: StepTables) -> tuple[StepModel, Host, str]:
    up = tables.model("upstream")
    if args.calibration is not None:
        if args.routed_layers is None or args.run_fraction is None:
            raise ValueError("--calibration needs --routed-layers and --run-fraction")
        try:
            entries = json.loads(Path(args.calibration).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"--calibration {args.calibration}: cannot read it as JSON ({e})") from None
        m = calibrated(up, entries if isinstance(entries, list) else [entries], args.routed_layers, args.run_fraction)
        return m, tables.host_for("upstream"), m.label
    skippers = [n for n, m in tables.systems.items() if n != "upstream"]
    name = args.skipper or (skippers[0] if skippers else None)
    if name is None:
        raise ValueError("the tables have no skipping system: give --calibration, or tables with one")
    m = tables.model(name)
    if name == "upstream":
        raise ValueError("--skipper upstream: compare a skipper with upstream, not upstream with itself")
    if args.run_fraction is not None:
        s = m.scaled(up, args.run_fraction, f"{name}@{args.run_fraction:g}")
        return s, tables.host_for(name), s.label
    return m, tables.host_for(name), f"{m.label} (RUN fraction decode {m.run_fraction['decode']:.2f}, " \
                                     f"prefill {m.run_fraction['extend']:.2f})"


def main(args: argparse.Namespace) -> None:
    tables = resolve_tables(args.tables)
    rates = parse_rates(args.rates) if args.rates else parse_rates(args.rate)
    if args.duration is not None and not args.duration > 0:
        raise ValueError(f"--duration {args.duration}: expected seconds > 0")
    if args.requests < 1:
        raise ValueError(f"--requests {args.requests}: expected >= 1")
    if not args.ignore_eos and args.max_new_tokens is None:
        raise ValueError("give --max-new-tokens (outputs end at EOS, capped there) or --ignore-eos (pinned outputs)")
    workload = Workload(args.prompt, args.output, args.max_new_tokens, args.ignore_eos)
    server = ServerConfig.from_flags(args.server if args.server is not None else tables.server)
    model, host, label = _skipper(args, tables)
    res = run_plan(tables, (model, host), workload, rates, None if args.duration else args.requests, args.duration,
                   args.seeds, server)
    up, sk = res["upstream"], res["vskipper"]
    pays = pays_from(rates, [x["e2e_mean"] for x in up], [x["e2e_mean"] for x in sk])
    knees = {n: knee(rates, [x["output_tps"] for x in res[n]]) for n in res}
    if args.json:
        json.dump({"tables": tables.meta, "skipper": label, "rates": rates, "results": res, "pays_from": pays,
                   "knee": knees}, sys.stdout, indent=1, default=str)
        print()
        return
    m = tables.meta
    run = f"{args.requests} requests" if not args.duration else f"{args.duration:g} s of arrivals"
    print(f"vskipper plan: {m['model']} on {m['device']} ({m['engine']}); step tables: {m['source']}")
    print(f"workload: prompts {args.prompt}, outputs {args.output}"
          + (" (pinned)" if args.ignore_eos else f" (EOS, at most {args.max_new_tokens})")
          + f"; Poisson arrivals, {run} per run, median of {args.seeds} seed(s)")
    print(f"server: {' '.join(server.flags())}")
    print(f"vskipper: {label}\n")
    head = ["req/s"] + [h for _, h in SHOWN]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for rate, u, s in zip(rates, up, sk):
        cells = (f"{u[k]:.1f} -> {s[k]:.1f} ({s[k] / u[k] - 1:+.1%})" for k, _ in SHOWN)
        print(f"| {rate:g} | " + " | ".join(cells) + " |")
    print("\n(upstream -> vskipper, the change)")
    print("skipping pays (mean e2e at least 1% lower, there and at every higher rate swept): "
          + (f"from {pays:g} req/s" if pays is not None else "at none of the rates swept"))
    if len(rates) > 1:
        print(f"knee (the last rate whose output tok/s beats the running maximum by >= 1%): upstream "
              f"{knees['upstream']:g} req/s, vskipper {knees['vskipper']:g} req/s")
        print(f"output tok/s at the highest rate: upstream {up[-1]['output_tps']:.1f}, vskipper "
              f"{sk[-1]['output_tps']:.1f} ({sk[-1]['output_tps'] / up[-1]['output_tps'] - 1:+.1%})")
