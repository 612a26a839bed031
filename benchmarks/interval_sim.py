"""How often three runs of the quick benchmark agree, by interval, on synthetic rounds.

The issue's check on `make demo`: three runs in a row, every run's interval for every system
holds the other two runs' medians, and resolved deltas agree in sign. This simulates it: each
run draws `--rounds` per-round ratios per system, true effect + a lifetime offset (one per run
and system, sd `--lifetime-sd`) + round noise (sd `--round-sd`), then scores the percentile
bootstrap CI of the median (benchmarks.stats.paired_delta) and the rerun interval
(stats.rerun, what the quick run reports). Pure Python, about 20 s at the defaults.

    python -m benchmarks.interval_sim [--rounds 5] [--round-sd 0.10] [--lifetime-sd 0.0] [--trials 300]
"""
from __future__ import annotations

import argparse
import random

from benchmarks import results as R
from benchmarks import stats

EFFECTS = (0.20, 0.08, -0.05)  # about RandomSkip(0.5), trained FlexiDepth and rate 0 on the 2-CPU VM


def agree(ivs: list[list[stats.Delta]]) -> bool:
    """ivs[run][system]: every interval holds the other runs' medians; resolved signs agree."""
    for k in range(len(EFFECTS)):
        signs = {ivs[i][k].lo > 0 for i in range(len(ivs)) if ivs[i][k].resolved}
        if len(signs) > 1:
            return False
        for i, run in enumerate(ivs):
            if any(not (run[k].lo <= other[k].median <= run[k].hi) for j, other in enumerate(ivs) if j != i):
                return False
    return True


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.interval_sim", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--round-sd", type=float, default=0.10)
    ap.add_argument("--lifetime-sd", type=float, default=0.0)
    ap.add_argument("--trials", type=int, default=300)
    ap.add_argument("--seed", type=int, default=1)
    R.add_arguments(ap, "interval-sim")
    a = ap.parse_args(argv)
    if a.rounds < 3 or a.trials < 1 or a.round_sd < 0 or a.lifetime_sd < 0:
        raise SystemExit("need --rounds >= 3, --trials >= 1 and non-negative spreads")
    r = random.Random(a.seed)
    passed = {"percentile bootstrap": 0, "rerun interval": 0}
    resolved = {m: [0] * len(EFFECTS) for m in passed}
    for t in range(a.trials):
        boot, rerun = [], []
        for _ in range(3):
            ds = []
            for effect in EFFECTS:
                off = r.gauss(0, a.lifetime_sd)
                ds.append(stats.paired_delta([1 + effect + off + r.gauss(0, a.round_sd) for _ in range(a.rounds)],
                                              [1.0] * a.rounds, seed=t))
            boot.append(ds)
            rerun.append([stats.rerun(d) for d in ds])
        for m, ivs in (("percentile bootstrap", boot), ("rerun interval", rerun)):
            passed[m] += agree(ivs)
            for k in range(len(EFFECTS)):
                resolved[m][k] += sum(run[k].resolved for run in ivs)
    rows = [[m, f"{passed[m] / a.trials:.0%}",
             ", ".join(f"{e:+.0%}: {n / (3 * a.trials):.0%}" for e, n in zip(EFFECTS, resolved[m]))] for m in passed]
    text = (f"{a.trials} triples of runs, {a.rounds} rounds each, round sd {a.round_sd:.0%}, lifetime sd "
            f"{a.lifetime_sd:.0%}, true effects {', '.join(f'{e:+.0%}' for e in EFFECTS)}\n\n"
            + R.table(["interval", "triples that agree", "share of runs resolving each effect"], rows) + "\n")
    print(text)
    R.write_results("interval-sim", {"args": vars(a), "agree": passed, "resolved": resolved}, text, a.out,
                    R.docs_dir(a))


if __name__ == "__main__":
    main()
