"""An elastic-depth ramp's page (benchmarks/serving/elastic_ramp.py): the table of one skipper's pooled
steps, the issue's criterion read off them, and the figure (p90 TPOT and skip fraction against offered
load, the target drawn)."""
from __future__ import annotations

from pathlib import Path

from benchmarks import results as R


def table(steps: list[dict], names: list[str], target_ms: float) -> str:
    rows = []
    for st in steps:
        for name in names:
            m = st["systems"][name]
            n = f", {st['requests']} req" if "requests" in st else ""
            rows.append([f"{st['multiple']:g}x ({st['rate']:.3f}/s{n})", name, f"{m['tpot_p50_ms']:.0f}",
                         f"{m['tpot_p90_ms']:.0f}" + (" *" if m["tpot_p90_ms"] > target_ms else ""),
                         "-" if m.get("tpot_p90_all_ms") is None else f"{m['tpot_p90_all_ms']:.0f}",
                         f"{m['ttft_p50_s']:.2f}", f"{m['ttft_p90_s']:.2f}", f"{m['tok_s']:.1f}",
                         "-" if m.get("skip") is None else f"{m['skip']:.3f}",
                         "-" if m.get("agreement") is None else f"{m['agreement']:.2f}", m.get("levels") or "-",
                         m["failed"], "/".join(f"{p:.0f}" for p in m.get("round_p90_ms", [])) or "-"])
    return R.table(["offered load (x R)", "system", "TPOT p50 ms", "TPOT p90 ms", "with warm-up", "TTFT p50 s",
                    "TTFT p90 s", "output tok/s", "skip fraction", "agreement", "tokens per level", "failed",
                    "p90 TPOT per round ms"], rows)


def verdict(steps: list[dict], names: list[str], target_ms: float) -> str:
    """The issue's criterion read off one skipper's pooled steps: (b) where upstream's p90 TPOT meets the
    target, elastic skips at most 5% of routed-layer work; (a) from the first step upstream misses it (the
    load where it stops meeting it) to the first step at or past 1.1x that load, elastic's p90 meets it,
    while at that last step upstream's and level 0's do not. A part the steps cannot judge says so."""
    (el,) = [n for n in names if n.startswith("elastic")]
    p90 = {st["multiple"]: {n: st["systems"][n]["tpot_p90_ms"] for n in names} for st in steps}
    skip = {st["multiple"]: st["systems"][el].get("skip") or 0.0 for st in steps}
    loads = sorted(p90)
    met = [f for f in loads if p90[f]["upstream"] <= target_ms]
    b = ("(b) not judged: upstream missed the target at every step" if not met else
         f"(b) {'met' if all(skip[f] <= 0.05 for f in met) else 'NOT met'}: where upstream met the target ("
         + ", ".join(f"{f:g}x R" for f in met) + ") elastic skipped "
         + ", ".join(f"{skip[f]:.1%}" for f in met) + " (at most 5%)")
    stop = next((f for f in loads if p90[f]["upstream"] > target_ms), None)
    reach = None if stop is None else next((f for f in loads if f >= 1.1 * stop - 1e-9), None)
    if stop is None:
        return f"Criterion: {b}; (a) not judged: upstream met the target at every step."
    if reach is None:
        return (f"Criterion: {b}; (a) not judged: upstream first missed the target at {stop:g}x R, and no step "
                f"reached 1.1x that load.")
    span = [f for f in loads if stop <= f <= reach]
    others = {n: p90[reach][n] > target_ms for n in ("upstream", "level0") if n in p90[reach]}
    ok = all(p90[f][el] <= target_ms for f in span) and all(others.values())
    return (f"Criterion: {b}; (a) {'met' if ok else 'NOT met'}: upstream first missed the target at {stop:g}x R; "
            f"elastic's p90 TPOT from there to {reach:g}x R " + ", ".join(f"{p90[f][el]:.0f}" for f in span)
            + f" ms (target {target_ms:.1f}); at {reach:g}x R "
            + ", ".join(f"{n} {'over' if over else 'WITHIN'}" for n, over in others.items()) + ".")


def plot(steps: list[dict], names: list[str], target_ms: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [st["multiple"] for st in steps]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for i, name in enumerate(names):  # one colour per system in both panels
        a.plot(xs, [st["systems"][name]["tpot_p90_ms"] for st in steps], marker="o", label=name, color=f"C{i}")
        if name != "upstream":
            b.plot(xs, [st["systems"][name].get("skip") or 0.0 for st in steps], marker="o", label=name,
                   color=f"C{i}")
    a.axhline(target_ms, color="k", ls="--", lw=1, label="target")
    a.set(xlabel="offered load (x upstream's rate at the target)", ylabel="p90 TPOT (ms)", title="latency")
    b.set(xlabel="offered load (x upstream's rate at the target)", ylabel="skip fraction of routed-layer work",
          title="depth used", ylim=(0, 1))
    a.legend(fontsize=7)
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
