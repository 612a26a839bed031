"""What a quick paired run prints: tables of medians and paired deltas, the quality table, the
one-line verdict, and the figure (latency against load beside the per-round ratios).

`rounds[load][system]` is a list with one measurement per round (a dict of metric -> value; the
quick run's baseline has one per system it ran beside, and `beside` pairs them up);
`quality[system]` holds accuracy and agreement with the baseline. The first system is the
baseline every delta is taken against.
"""
from __future__ import annotations

import statistics
from pathlib import Path

from benchmarks.results import table
from benchmarks.stats import Delta, lifetime_half_width, paired_delta, rerun
from vskipper.eval.scoring import last_integer  # noqa: F401  (a reply's answer, re-exported)

__all__ = ["deltas", "last_integer", "plot", "prefix_share", "quality_table", "tables", "verdict"]

# metric -> (column title, short name, unit scale, format); every metric's delta is value / baseline - 1:
# positive is better for tok/s, negative is better for the latencies.
METRICS = {"tok_s": ("output tok/s", "tok/s", 1.0, "{:.1f}"), "tpot_ms": ("mean TPOT ms", "TPOT", 1.0, "{:.0f}"),
           "e2e_ms": ("mean e2e s", "e2e", 1e-3, "{:.2f}"), "ttft_ms": ("mean TTFT s", "TTFT", 1e-3, "{:.2f}")}


def prefix_share(gen: list[list[int]], ref: list[list[int]]) -> float:
    """Share of the reference tokens reproduced before the first divergence, over all references
    (the greedy agreement; benchmarks/quality_hf.py uses it too)."""
    same = total = 0
    for g, r in zip(gen, ref):
        n = 0
        while n < min(len(g), len(r)) and g[n] == r[n]:
            n += 1
        same, total = same + n, total + len(r)
    return same / max(1, total)


def deltas(rounds: dict, names: list[str], metrics_of: dict[str, tuple[str, ...]], lives: list[int] | None = None,
           beside: dict | None = None) -> dict:
    """{load: {system: {metric: Delta}}} for every system but the baseline (names[0]), each interval
    where a rerun's median would fall (stats.rerun). lives[r]: the server lifetime round r ran on;
    with several, the intervals also hold the lifetime offsets' spread (stats.lifetime_half_width,
    pooled over the systems of that load and metric).
    beside[load][system]: the baseline's measurements a system is compared with, round by round
    (the quick run's baseline runs beside each system in turn); default rounds[load][names[0]]."""
    base = names[0]
    out = {}
    for load, per_sys in rounds.items():
        out[load] = {name: {} for name in names[1:]}
        ref = {name: (beside[load][name] if beside is not None else per_sys[base]) for name in names[1:]}
        for m in metrics_of[load]:
            d = {name: paired_delta([r[m] for r in per_sys[name]], [r[m] for r in ref[name]]) for name in names[1:]}
            hw = None if lives is None else lifetime_half_width({n: list(x.ratios) for n, x in d.items()}, lives)
            for name in names[1:]:
                out[load][name][m] = rerun(d[name], hw)
    return out


def _median(rows: list[dict], metric: str) -> float:
    return statistics.median(r[metric] for r in rows)


def tables(rounds: dict, d: dict, names: list[str], metrics_of: dict[str, tuple[str, ...]],
           failed: dict[str, dict[str, int]]) -> str:
    """One markdown table per group of loads that share their metrics (closed loops, open loop)."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for load in rounds:
        groups.setdefault(metrics_of[load], []).append(load)
    parts = []
    for ms, loads in groups.items():
        head = (["load", "system"] + [f"{METRICS[m][0]} (median)" for m in ms]
                + [f"{METRICS[m][1]} vs {names[0]} [95% rerun interval]" for m in ms] + ["failed"])
        rows = []
        for load in loads:
            for name in names:
                med = [METRICS[m][3].format(_median(rounds[load][name], m) * METRICS[m][2]) for m in ms]
                dl = ["-"] * len(ms) if name == names[0] else [d[load][name][m].text() for m in ms]
                rows.append([load, name] + med + dl + [failed[load][name]])
        parts.append(table(head, rows))
    return "\n\n".join(parts)


def short(load: str) -> str:
    """A tick label: "concurrency 32" -> "c=32", "open loop 0.75x capacity" -> "open 0.75x"."""
    return load.replace("concurrency ", "c=").replace("open loop ", "open ").replace(" capacity", "")


def quality_table(quality: dict, names: list[str]) -> str:
    base = names[0]
    rows = [[name, f"{q['accuracy']:.1%} ({q['correct']}/{q['questions']})",
             f"{q['agreement']:.1%} ({q['same']}/{q['questions']})", f"{q['prefix']:.1%}"]
            for name, q in ((n, quality[n]) for n in names)]
    return table(["system", "arithmetic accuracy", f"same answer as {base}",
                  f"greedy agreement with {base} (tokens)"], rows)


def verdict(d: dict, quality: dict, names: list[str], labels: dict[str, str], headline: tuple[str, str],
            latency: tuple[str, str] | None) -> str:
    """`label: +x% tok/s [lo, hi] at concurrency 32, ...; next label: ...` (baseline excluded)."""
    order = sorted(names[1:], key=lambda n: ("rate 0" in labels.get(n, ""), names.index(n)))  # rate 0 last
    parts = []
    for name in order:
        load, metric = headline
        s = f"{labels.get(name) or name}: {d[load][name][metric].text()} tok/s at {load}"
        if latency is not None:
            s += f", e2e {d[latency[0]][name][latency[1]].text()} at {latency[0]}"
        q, b = quality[name], quality[names[0]]
        s += (f", quality {q['accuracy']:.0%} arithmetic ({names[0]} {b['accuracy']:.0%}), "
              f"{q['agreement']:.0%} same answers as {names[0]}, greedy agreement {q['prefix']:.0%}")
        parts.append(s)
    return "verdict: " + "; ".join(parts)


def plot(rounds: dict, d: dict, names: list[str], curve: dict[str, list[tuple[float, float]]], path: Path,
         title: str) -> None:
    """Left: mean e2e latency against load (req/s: achieved for closed loops, offered for the open
    loop), medians over rounds. Right: every round's ratio to the baseline, per metric, with the
    median and its 95% rerun interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in names:
        pts = sorted(curve[name])
        ax1.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=name)
    ax1.set_xlabel("load (req/s)")
    ax1.set_ylabel("mean end-to-end latency (s)")
    ax1.set_title("latency against load")
    ax1.legend(fontsize=8)
    cats = [(load, m) for load in d for m in next(iter(d[load].values()))]
    width = 0.8 / max(1, len(names) - 1)
    for k, name in enumerate(names[1:]):
        for i, (load, m) in enumerate(cats):
            delta: Delta = d[load][name][m]
            x = i + (k - (len(names) - 2) / 2) * width
            ax2.scatter([x] * len(delta.ratios), [100 * r for r in delta.ratios], s=12, alpha=0.6,
                        color=f"C{k + 1}", label=name if i == 0 else None)
            ax2.errorbar([x], [100 * delta.median],
                         yerr=[[100 * (delta.median - delta.lo)], [100 * (delta.hi - delta.median)]],
                         fmt="_", markersize=14, capsize=4, color=f"C{k + 1}")
    ax2.axhline(0, color="gray", lw=0.8)
    ax2.set_xticks(range(len(cats)), [f"{METRICS[m][1]}\n{short(load)}" for load, m in cats], fontsize=7)
    ax2.set_ylabel(f"per-round change vs {names[0]} (%)")
    ax2.set_title("paired rounds: a dot per round; bar: median, 95% rerun interval")
    ax2.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
