"""Elastic depth's rules judged in the simulator (issue: elastic depth decided where it can be resolved).
Simulated, not measured: SGLang 0.5.23's scheduler (vskipper/sim) priced by a device's step tables, the
level applied to each row's budget (vskipper/sim/elastic.py).

    python -m benchmarks.sim.elastic_rules              # both step models, 20 seeds a load
    python -m benchmarks.sim.elastic_rules --smoke      # tiny sizes, no page: a check that it runs

Per step model (CPU: SmolLM2-135M on 2 CPUs, RandomSkip 0.5 over 15 of 30 layers; H200: Llama-3-8B shape,
RandomSkip 0.5 over 16 of 32 at the bytes/FLOPs ideal, the one H200 system whose steps are shorter than
upstream's):
1. The target, as benchmarks/serving/elastic_ramp.py's `--tpot-ms auto` sets it: MARGIN x upstream's p90 TPOT
   at KNEE x its saturated request rate (all of a run's requests at once), the mean over the seeds.
2. R, upstream's SLO capacity: the highest rate whose p90 TPOT, the mean over the seeds, meets the target
   (bisection between KNEE and 1.5 x the saturated rate, to 0.5%).
3. The ramp: LOADS x R, each load `--seeds` seeds of Poisson arrivals over the model's trace length (the same
   requests for every system on a seed), the requests sent in the first `warmup` s not counted (every run
   starts from an idle server). Systems: upstream; the skipper alone ("fixed"); today's rule (the server's
   vskipper.elastic.Controller, unchanged; its prior the step model at the workload's mean context); the
   model-predictive candidate (vskipper.sim.elastic.Predictive, margins below); the rate-keyed candidate
   (vskipper.sim.elastic.Capacity), which reads each level's SLO capacity: R's bisection with the level pinned.
4. Per load and system: p90 TPOT and the share of routed-layer work skipped (prompt and generated tokens),
   the mean over seeds with a 95% percentile-bootstrap interval of that mean. Criteria: (a) p90 TPOT within
   the target at every load up to 1.10 x R; (b) at most 5% of routed-layer work skipped at every load where
   upstream meets the target. "met" reads the seed mean; "sure" where the interval's far end meets it too.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks import results as R
from benchmarks.results import log

TABLES = Path(__file__).resolve().parents[2] / "vskipper" / "sim" / "tables"
KNEE, MARGIN = 0.7, 1.2  # the target: MARGIN x upstream's p90 TPOT at KNEE x its saturated rate (elastic_ramp's auto)
LOADS = (0.5, 0.75, 0.9, 1.0, 1.05, 1.1, 1.25)  # multiples of R
SMOKE_LOADS = (0.75, 1.0, 1.1)
A_UP_TO, B_SKIP = 1.10, 0.05  # criterion (a): the target held to this x R; (b): at most this share skipped
# n_routed from the tables' labels: "RandomSkip 0.5 (layers 15-29, routed)" of SmolLM2's 30; 16 of Llama-3-8B's 32
MODELS = {
    "cpu": {"label": "CPU (SmolLM2-135M, 2 CPUs)", "tables": "cpu-smollm2-135m.json", "skipper": "random0.5",
            "routed": 15, "prompt": "uniform:32-96", "output": "fixed:32", "max_new": None,
            "duration": 300.0, "warmup": 60.0, "saturate": 300,
            "why": "prompts and pinned 32-token outputs as benchmarks/serving/elastic_ramp.py sends them"},
    "h200": {"label": "H200 (Llama-3-8B shape)", "tables": "h200-llama3-8b.json", "skipper": "ideal0.5",
             "routed": 16, "prompt": "normal:mean=492,sd=32,min=450,max=644",
             "output": "lognormal:mean=150,sd=70,min=16,max=512", "max_new": 512,
             "duration": 60.0, "warmup": 15.0, "saturate": 3000,
             "why": "GSM8K-like lengths (benchmarks/sim/project.py: WORKLOADS, where they come from)"},
    "h200-measured": {"label": "H200 (Llama-3-8B shape), the measured RandomSkip 0.5 steps",
                      "tables": "h200-llama3-8b.json", "skipper": "random0.5", "routed": 16,
                      "prompt": "normal:mean=492,sd=32,min=450,max=644",
                      "output": "lognormal:mean=150,sd=70,min=16,max=512", "max_new": 512,
                      "duration": 60.0, "warmup": 15.0, "saturate": 3000,
                      "why": "as above; the skipper's measured steps run 4-7% longer than upstream's from 16 rows: "
                             "no level can help, and a rule should not make it worse"},
}
RULES = {"upstream": "upstream SGLang", "fixed": "the skipper alone (level top throughout)",
         "today": "today's rule (vskipper.elastic.Controller)",
         "predictive": "model-predictive (Predictive: margin 0.9, hysteresis 0.9, the rows of the moment)",
         "predictive-1.0": "model-predictive (margin 1.0, hysteresis 0.9, the rows of the moment)",
         "predictive-hold": "model-predictive (margin 0.9, hysteresis 0.9, down only after a stream's length of "
                            "steps at the level)",
         "predictive-smooth": "model-predictive (margin 1.0, hysteresis 0.9, the rows averaged over a stream's life)",
         "predictive-adapt": "model-predictive (margin 1.0, hysteresis 0.9, the band scaled to hold the streams' p90 "
                             "at 0.95 x target; down as predictive-hold)",
         "capacity-step": "rate-keyed, stepped (Capacity: the lowest level whose SLO capacity is >= 0.97 x the arrival "
                          "rate, EWMA 120 s; down by a band of 5%, after 10 s at the level)",
         "capacity": "rate-keyed (Capacity: the arrival rate, EWMA 120 s, less 0.6 standard errors, read off the "
                     "levels' SLO capacities, times 3, admitted as a mix of the two levels around it)"}
CAPACITY = {"tau_s": 120.0, "z": 0.6, "slope": 3.0}  # the rule "capacity"
STEPPED = {"tau_s": 120.0, "z": 0.0, "mix": False, "margin": 0.97, "band": 0.05, "hold_s": 10.0}


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.sim.elastic_rules", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--rules", nargs="+", default=list(RULES), choices=list(RULES))
    ap.add_argument("--seeds", type=int, default=20, help="seeds per load (default 20)")
    ap.add_argument("--loads", default=",".join(f"{x:g}" for x in LOADS), help="multiples of R, comma-separated")
    ap.add_argument("--scale", type=float, default=1.0, help="trace length and warm-up x this (default 1)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, no page")
    ap.add_argument("--resume", action="store_true",
                    help="keep the step models already in --out's results.json (run with the same settings); "
                         "results.json is rewritten after every step model")
    R.add_arguments(ap, "sim-elastic-rules")
    a = ap.parse_args(argv)
    a.loads = [float(x) for x in a.loads.split(",")]
    if a.smoke:
        a.seeds, a.loads, a.scale = 2, list(SMOKE_LOADS), 0.1
    if a.seeds < 2:
        ap.error("--seeds must be at least 2 (the intervals need them)")
    for need in ("upstream",):
        if need not in a.rules:
            ap.error(f"--rules must include {need}")
    return a


class Model:
    """One step model's tables, levels, workload and server."""

    def __init__(self, key: str, scale: float):
        from vskipper.elastic import ladder
        from vskipper.sim import ServerConfig, StepTables, Workload
        from vskipper.sim.elastic import LevelSteps

        spec = MODELS[key]
        self.key, self.spec = key, spec
        self.tables = StepTables.load(TABLES / spec["tables"])
        self.levels = LevelSteps.from_tables(self.tables, spec["skipper"], spec["routed"])
        self.budgets = ladder(spec["routed"])
        self.server = ServerConfig.from_flags(self.tables.server)
        self.workload = Workload(spec["prompt"], spec["output"], spec["max_new"], ignore_eos=spec["max_new"] is None)
        self.context = self.workload.prompt.mean + self.workload.output.mean / 2  # a row's mean context
        self.duration, self.warmup = spec["duration"] * scale, spec["warmup"] * scale
        self.saturate = max(20, int(spec["saturate"] * scale))

    def requests(self, rate: float, seed: int):
        from vskipper.sim import poisson

        arr = [0.0] * self.saturate if rate == float("inf") else poisson(rate, duration=self.duration, seed=seed)
        return self.workload.requests(arr, seed)

    def rule(self, name: str, tpot_ms: float, capacity=None):
        from vskipper.elastic import Controller, Target
        from vskipper.sim.elastic import Capacity, Pinned, Predictive

        t = Target(tpot_ms)
        if name.startswith("level-"):
            return Pinned(self.budgets, int(name[6:]))
        if name.startswith("capacity"):
            return Capacity(t, self.budgets, capacity, 0.0, **(CAPACITY if name == "capacity" else STEPPED))
        if name == "today":
            return Controller(t, self.budgets, self.levels.prior(self.context), 0.0)
        if name.startswith("predictive"):
            margin = 0.9 if name in ("predictive", "predictive-hold") else 1.0
            return Predictive(t, self.budgets, self.levels.decode_ms, 0.0, margin=margin, hysteresis=0.9,
                              smooth=name.endswith("smooth"), adapt=name.endswith("adapt"),
                              hold=name.endswith(("hold", "adapt")))
        raise ValueError(name)

    def run(self, name: str, rate: float, seed: int, tpot_ms: float | None = None, capacity=None) -> dict:
        """One run: p90 TPOT (ms) and skipped share of the counted requests, output tok/s, time per level."""
        from vskipper.sim import simulate
        from vskipper.sim.elastic import simulate_elastic, stream_tpot_p90

        reqs = self.requests(rate, seed)
        since = 0.0 if rate == float("inf") else self.warmup
        if name in ("upstream", "fixed"):
            steps = self.tables.model("upstream" if name == "upstream" else self.spec["skipper"])
            host = self.tables.host_for("upstream" if name == "upstream" else self.spec["skipper"])
            res = simulate(reqs, steps, host, self.server, record_batches=False)
            f = steps.run_fraction
            m = res.arrival >= since
            dec, pre = np.maximum(res.output[m] - 1, 0).sum(), sum(r.prompt for r in reqs if r.arrival >= since)
            skip = 0.0 if name == "upstream" else ((1 - f["decode"]) * dec + (1 - f["extend"]) * pre) / (dec + pre)
            levels = None
        else:
            rule = self.rule(name, tpot_ms, capacity)
            er = simulate_elastic(reqs, self.levels, rule, self.server, record_batches=False)
            res, skip = er.result, er.skipped(since)["all"]
            end = float((res.arrival + res.e2e).max())
            levels = [s / end for s in rule.time_per_level(end)]
        s = res.summary()
        return {"p90": stream_tpot_p90(res, since), "skip": float(skip), "output_tps": s["output_tps"],
                "request_tps": s["request_tps"], "levels": levels}


def provenance(path: Path) -> str:
    """The tables file's content hash, the last commit that touched it and whether the working copy differs."""
    import hashlib
    import subprocess

    sha = hashlib.sha256(path.read_bytes()).hexdigest()[:12]

    def git(*a):
        try:
            done = subprocess.run(["git", *a], cwd=path.parent, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return ""
        return done.stdout.strip()

    commit = git("log", "-1", "--format=%h", "--", path.name)
    dirty = bool(git("status", "--porcelain", "--", path.name))
    return f"sha256 {sha}, last committed in {commit or '?'}" + (", with uncommitted changes" if dirty else "")


def mean_ci(xs: list[float], seed: int = 0, n: int = 2000) -> tuple[float, float, float]:
    """The mean and a 95% percentile-bootstrap interval of it."""
    rng = random.Random(seed)
    k = len(xs)
    boots = sorted(sum(rng.choice(xs) for _ in range(k)) / k for _ in range(n))
    return statistics.fmean(xs), boots[int(0.025 * n)], boots[int(0.975 * n) - 1]


def upstream_p90(model: Model, rate: float, seeds: int, name: str = "upstream") -> float:
    return statistics.fmean(model.run(name, rate, s)["p90"] for s in range(seeds))


def capacity(model: Model, name: str, target: float, lo: float, hi: float, seeds: int, smoke: bool) -> float:
    """The highest rate in [lo, hi] at which `name` meets the target (p90 TPOT, the mean over the seeds), by
    bisection to 0.5% (lo where it does not meet it even there)."""
    if upstream_p90(model, lo, seeds, name) > target:
        return lo
    while hi - lo > (0.05 if smoke else 0.005) * lo:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if upstream_p90(model, mid, seeds, name) <= target else (lo, mid)
    return lo


def calibrate(model: Model, seeds: int, smoke: bool) -> dict:
    """Saturated rate, target and R for a step model."""
    sat = statistics.median(model.run("upstream", float("inf"), s)["request_tps"] for s in range(min(3, seeds)))
    target = MARGIN * upstream_p90(model, KNEE * sat, seeds)
    if upstream_p90(model, 1.5 * sat, seeds) <= target:
        raise RuntimeError(f"{model.key}: upstream meets the target {target:.1f} ms even at 1.5 x its saturated rate")
    return {"saturated_rps": sat, "target_ms": target, "R": capacity(model, "upstream", target, KNEE * sat, 1.5 * sat,
                                                                     seeds, smoke)}


def capacities(model: Model, cal: dict, seeds: int, smoke: bool) -> list[float]:
    """Each level's SLO capacity (req/s): R's bisection with the level pinned (level 0 is upstream: R)."""
    sat = cal["saturated_rps"]
    return [cal["R"]] + [capacity(model, f"level-{j}", cal["target_ms"], KNEE * sat, 1.5 * sat, seeds, smoke)
                         for j in range(1, len(model.budgets))]


def judge(rows: dict, loads: list[float], target: float) -> dict:
    """Criteria (a) and (b) per rule from the ramp's cells {rule: {load: {"p90": (m, lo, hi), "skip": ...}}}."""
    up = rows["upstream"]
    meets = [x for x in loads if up[x]["p90"][0] <= target]
    out = {}
    for name, cells in rows.items():
        a_loads = [x for x in loads if x <= A_UP_TO + 1e-9]
        a = all(cells[x]["p90"][0] <= target for x in a_loads)
        a_sure = all(cells[x]["p90"][2] <= target for x in a_loads)
        b = all(cells[x]["skip"][0] <= B_SKIP for x in meets)
        b_sure = all(cells[x]["skip"][2] <= B_SKIP for x in meets)
        held = 0.0
        for x in loads:
            if cells[x]["p90"][0] > target:
                break
            held = x
        out[name] = {"a": a, "a_sure": a_sure, "b": b, "b_sure": b_sure, "held_to": held, "upstream_meets": meets}
    return out


def word(ok: bool, sure: bool) -> str:
    return "**met** (sure)" if ok and sure else "met (mean only)" if ok else "not met"


def ramp(model: Model, cal: dict, args) -> tuple[dict, str]:
    caps = None
    if any(n.startswith("capacity") for n in args.rules):
        t0 = time.perf_counter()
        caps = capacities(model, cal, args.seeds, args.smoke)
        shown = " ".join(f"{c / cal['R']:.3f}" for c in caps)
        log(f"{model.key}: levels' SLO capacities {shown} x R "
            f"({time.perf_counter() - t0:.0f} s)")
    rows: dict = {n: {} for n in args.rules}
    raw: dict = {n: {} for n in args.rules}
    table = []
    for load in args.loads:
        rate = load * cal["R"]
        t0 = time.perf_counter()
        for n in args.rules:
            runs = [model.run(n, rate, s, cal["target_ms"], caps) for s in range(args.seeds)]
            raw[n][load] = runs
            cell = {"p90": mean_ci([r["p90"] for r in runs]), "skip": mean_ci([r["skip"] for r in runs]),
                    "output_tps": statistics.fmean(r["output_tps"] for r in runs)}
            if runs[0]["levels"] is not None:
                cell["levels"] = [statistics.fmean(r["levels"][j] for r in runs) for j in range(len(model.budgets))]
            rows[n][load] = cell
            p, s = cell["p90"], cell["skip"]
            star = " *" if p[0] > cal["target_ms"] else ""
            lv = (" ".join(f"{j}:{v:.0%}" for j, v in enumerate(cell["levels"]) if v >= 0.005)
                  if "levels" in cell else "-")
            table.append([f"{load:g}x ({rate:.2f}/s)", n, f"{p[0]:.1f} [{p[1]:.1f}, {p[2]:.1f}]{star}",
                          f"{s[0]:.1%} [{s[1]:.1%}, {s[2]:.1%}]", f"{cell['output_tps']:.1f}", lv])
        log(f"{model.key}: load {load:g}x R ({rate:.3f}/s) done in {time.perf_counter() - t0:.1f} s")
    verdicts = judge(rows, args.loads, cal["target_ms"])
    vt = [[n, RULES[n], word(v["a"], v["a_sure"]), word(v["b"], v["b_sure"]), f"{v['held_to']:g}x"]
          for n, v in verdicts.items()]
    sp = model.spec
    text = (f"## {sp['label']}\n\nStep tables `vskipper/sim/tables/{sp['tables']}` ({model.tables.meta['source']}; "
            f"{provenance(TABLES / sp['tables'])}); "
            f"skipper `{sp['skipper']}` ({model.tables.model(sp['skipper']).label}; RUN fraction decode "
            f"{model.levels.f[0]:.3f}, prefill {model.levels.f[1]:.3f}) over {sp['routed']} routed layers, levels' "
            f"budgets {list(model.budgets)}; server `{' '.join(model.tables.server)}`; prompts `{sp['prompt']}`, "
            f"outputs `{sp['output']}`" + (" (pinned)" if sp["max_new"] is None else f" (EOS, at most {sp['max_new']})")
            + f": {sp['why']}. Each run {model.duration:g} s of Poisson arrivals, the first {model.warmup:g} s not "
            f"counted; {args.seeds} seeds a load.\n\n"
            f"Upstream saturates at {cal['saturated_rps']:.2f} req/s; target p90 TPOT **{cal['target_ms']:.1f} ms** "
            f"({MARGIN:g} x upstream's at {KNEE:g} x that rate); **R = {cal['R']:.3f} req/s**, the highest rate at "
            f"which upstream's p90 TPOT (mean over the seeds) meets it."
            + (" Levels' SLO capacities (each level pinned, the same bisection; what the rate-keyed rules read): "
               + ", ".join(f"{j}: {c / cal['R']:.3f}" for j, c in enumerate(caps)) + " x R." if caps else "")
            + "\n\n"
            + R.table(["rule", "what", f"(a) p90 TPOT within target to {A_UP_TO:g}x R",
                       f"(b) <= {B_SKIP:.0%} skipped where upstream meets it", "target held to (mean)"], vt)
            + "\n\nPer load (the mean over the seeds [95% bootstrap interval of the mean]; * over the target):\n\n"
            + R.table(["offered load (x R)", "rule", "p90 TPOT ms", "routed-layer work skipped", "output tok/s",
                       "time per level"], table))
    return {"calibration": cal, "capacity": caps, "cells": rows, "verdicts": verdicts, "runs": raw}, text


HEAD = ("**Simulated, not measured.** SGLang 0.5.23's scheduler simulated (vskipper/sim) over each device's "
        "measured step tables; elastic depth's level applied as each row's budget (a row at budget k of L "
        "routed layers priced k / L of the way from upstream's step to the skipper's: "
        "vskipper/sim/elastic.py). Today's rule is the server's own controller code, run unchanged; the "
        "model-predictive rules are candidates that read the step model the simulator prices with (a best "
        "case for them: the server's would be its step tables or calibration, corrected by the same measured "
        "ratio); the rate-keyed rules read each level's SLO capacity, found here from the same step model and "
        "workload (a server would need them from a plan of its own workload). "
        "Criteria of the issue: (a) p90 TPOT within the target up to 1.10 x R, R the load at which "
        "upstream's p90 TPOT stops meeting it; (b) at most 5% of routed-layer work skipped where upstream "
        "meets the target. 'met' reads the mean over the seeds, '(sure)' where the 95% interval's far end "
        "meets it too.\n\n")
SAME = ("seeds", "loads", "scale", "rules", "smoke")  # a --resume'd model counts only if these match


def page(args, out: dict) -> str:
    done = [k for k in args.models if k in out]
    summary = [[n, RULES[n]] + [f"(a) {word(out[k]['verdicts'][n]['a'], out[k]['verdicts'][n]['a_sure'])}; "
                                f"(b) {word(out[k]['verdicts'][n]['b'], out[k]['verdicts'][n]['b_sure'])}"
                                for k in done] for n in args.rules]
    missing = [k for k in args.models if k not in out]
    return (HEAD + "Which rule meets which criterion, per step model:\n\n"
            + R.table(["rule", "what"] + [MODELS[k]["label"] for k in done], summary) + "\n\n"
            + (f"Not run yet: {', '.join(missing)}.\n\n" if missing else "")
            + "\n\n".join(out[k]["text"] for k in done))


def main(argv=None) -> None:
    args = parse(argv)
    out, cals, resumed = {}, {}, []
    mine = {k: str(getattr(args, k)) for k in SAME}
    prev = Path(args.out) / "results.json" if args.out else None
    if args.resume and prev is not None and prev.is_file():
        rec = json.loads(prev.read_text())["results"]
        if {k: rec["args"].get(k) for k in SAME} == mine:
            out = {k: v for k, v in rec["results"].items() if k in args.models}
            resumed = [*rec.get("resumed", []), *(k for k in out if k not in rec.get("resumed", []))]
            log(f"resumed {', '.join(out) or 'nothing'} from {prev}")
        else:
            log(f"{prev}: run with other settings; not resumed")
    for key in args.models:
        if key in out:
            continue
        t0 = time.perf_counter()
        model = Model(key, args.scale)
        same = (model.spec["tables"], model.spec["prompt"], model.spec["output"])  # upstream's: the same R
        done = next((v["calibration"] for k, v in out.items() if (MODELS[k]["tables"], MODELS[k]["prompt"],
                                                                   MODELS[k]["output"]) == same), None)
        cal = cals[same] = cals.get(same) or done or calibrate(model, args.seeds, args.smoke)
        log(f"{key}: saturated {cal['saturated_rps']:.2f} req/s, target {cal['target_ms']:.1f} ms, R {cal['R']:.3f} "
            f"req/s ({time.perf_counter() - t0:.0f} s)")
        out[key], text = ramp(model, cal, args)
        out[key]["text"] = text
        write(args, out, None, resumed)  # after every step model: a run cut short keeps what it did (--resume)
    text = page(args, out)
    print(text)
    write(args, out, R.docs_dir(args), resumed)


def write(args, out: dict, docs, resumed=()) -> None:
    R.write_results("sim-elastic-rules", {"args": {k: str(v) for k, v in vars(args).items()}, "models": MODELS,
                                          "results": out, "resumed": resumed}, page(args, out), args.out, docs)


if __name__ == "__main__":
    main()
