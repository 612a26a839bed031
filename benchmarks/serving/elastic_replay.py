"""Replay elastic depth's rule over a traced server's events (vskipper/elastic_trace.py): when would the rule,
its constants changed, have moved the level in each busy spell? Minutes, where a ramp takes an hour and a half.

    python -m benchmarks.serving.elastic_replay out/elastic-ramp/traces/random --set DEBT=4

For every busy spell (ticks with rows running or queued, between idle ones) of every controller life in the
trace files (a directory: its tp0-*.jsonl, the ranks that decide): the server's level changes and the
replayed ones, in seconds from the spell's start, and the spell's peak rows. The steps are the server's,
run at its levels: up to the first tick where the replayed level differs, the replay is exactly what the
changed rule would have done; after it, what it would have decided from steps that ran at the server's
levels (a rise the server made earlier has shortened them). So a replayed first rise before the server's
is exact, one after it a lower bound. A summary counts spells with a rise and the median first rise."""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from vskipper.elastic_trace import read, replay


def spells(ticks: list[tuple[float, int, int, int, str]]) -> list[list[tuple[float, int, int, int, str]]]:
    """The ticks grouped into busy spells: runs of ticks with rows running or queued."""
    out, cur = [], []
    for t in ticks:
        if t[1] > 0:
            cur.append(t)
        elif cur:
            out, cur = out + [cur], []
    return out + [cur] if cur else out


def changes(spell, col: int) -> list[tuple[float, int, int]]:
    """(seconds from the spell's start, from, to) of each level change in column `col` of its ticks."""
    t0, out, last = spell[0][0], [], 0
    for tick in spell:
        if tick[col] != last:
            out.append((tick[0] - t0, last, tick[col]))
            last = tick[col]
    return out


def first_rise(moves) -> float | None:
    return next((t for t, a, b in moves if b > a), None)


def describe(moves) -> str:
    return ", ".join(f"+{t:.1f}s {a}->{b}" for t, a, b in moves) or "level 0 throughout"


def report(lives, constants: dict) -> str:
    lines, served, replayed = [], [], []
    for n, (head, events) in enumerate(lives):
        for k, spell in enumerate(spells(replay(head, events, **constants))):
            rec, rep = changes(spell, 2), changes(spell, 3)
            served.append(first_rise(rec))
            replayed.append(first_rise(rep))
            split = next((t[0] - spell[0][0] for t in spell if t[2] != t[3]), None)
            lines.append(f"life {n} spell {k}: {spell[-1][0] - spell[0][0]:.0f} s, peak {max(t[1] for t in spell)} "
                         f"rows; server: {describe(rec)}; replayed: {describe(rep)}"
                         + (f"; apart from +{split:.1f}s" if split is not None else ""))

    def summary(who: str, rises: list) -> str:
        got = [r for r in rises if r is not None]
        return (f"{who}: a rise in {len(got)} of {len(rises)} spells"
                + (f", the first at a median +{statistics.median(got):.1f} s" if got else ""))

    changed = ", ".join(f"{k}={v}" for k, v in constants.items()) or "none"
    return "\n".join(lines + [summary("server", served), summary(f"replayed (changed: {changed})", replayed)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", nargs="+", type=Path, help="trace files, or directories of them (their tp0-*.jsonl)")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="a constant of vskipper.elastic changed for the replay (DEBT, DOWN, SURGE, DWELL, ...)")
    args = ap.parse_args()
    constants = {}
    for item in args.set:
        name, eq, value = item.partition("=")
        try:
            constants[name] = float(value)
        except ValueError:
            eq = ""
        if not eq:
            ap.error(f"--set {item!r}: give NAME=NUMBER, e.g. DEBT=4")
    missing = [str(p) for p in args.trace if not p.exists()]
    if missing:
        ap.error(f"no such trace file or directory: {', '.join(missing)}")
    files = [f for p in args.trace for f in (sorted(p.glob("tp0-*.jsonl")) if p.is_dir() else [p])]
    if not files:
        ap.error(f"no trace files (tp0-*.jsonl) in {', '.join(map(str, args.trace))}")
    try:
        for f in files:
            print(f"{f}:\n{report(read(f), constants)}")
    except ValueError as e:
        ap.error(str(e))


if __name__ == "__main__":
    main()
