"""The host-work fit of benchmarks/sim/validate.py recovers a known host from runs simulated with it."""
import json

import numpy as np
import pytest

from benchmarks.sim.validate import fit_host
from vskipper.sim import Host, Request, ServerConfig, simulate
from vskipper.sim.steps import FORMAT


def test_fit_host_recovers_the_host_it_was_simulated_with(tmp_path):
    tables = {"format": FORMAT, "host": {}, "systems": {"upstream": {
        "decode": [[1, 80, 70.0, "measured", "t"], [4, 80, 115.0, "measured", "t"], [12, 80, 160.0, "measured", "t"],
                   [24, 80, 230.0, "measured", "t"]],
        "extend": {"coef": {"e0": 60.0, "per_token": 2.0, "per_pair": 0.004, "per_row": 30.0}}}}}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(tables))
    from vskipper.sim import StepTables

    model = StepTables.load(path).model("upstream")
    truth = Host((20.0, 0.8), (20.0, 0.8), 70.0, 0.0, True)
    runs = []
    for c in (1, 4, 12, 24):
        reqs = [Request(0.0, 64, 24, 24, True) for _ in range(c)]
        r = simulate(reqs, model, truth, ServerConfig(max_total_tokens=32768))
        itl = list(r.itl)
        per = len(itl) // c
        runs.append({"concurrency": c, "requests": [
            {"sent": 0.0, "ttft": float(r.ttft[k]), "latency": float(r.e2e[k]), "itl": itl[k * per:(k + 1) * per],
             "prompt": 64, "output": 24} for k in range(c)]})
    got = fit_host(path, "upstream", runs)
    assert got["decode_ms"][0] == pytest.approx(20.0, abs=1.0)
    assert got["decode_ms"][1] == pytest.approx(0.8, abs=0.1)
    assert got["ingress_ms"] == pytest.approx(70.0, abs=2.0)
    assert np.isfinite(got["decode_ms"]).all() and "median ITL" in got["source"]


def test_validation_page_of_runs_the_simulator_reproduces_meets_the_criterion(tmp_path, capsys):
    """Rounds whose 'measured' runs are the simulator's own on the same traces: every error is 0 and the
    page says the criterion is met (the pooling and the page's cells, end to end)."""
    from benchmarks.sim.validate import main, sim_run

    tables = tmp_path / "t.json"
    d = {"format": FORMAT, "host": {"decode_ms": [10.0, 0.5], "extend_ms": [10.0, 0.5], "ingress_ms": 50.0,
                                    "serial": True},
         "systems": {n: {"run_fraction": f, "decode": [[1, 80, 70.0 * f, "measured", "t"],
                                                        [16, 80, 200.0 * f, "measured", "t"]],
                         "extend": {"coef": {"e0": 60.0, "per_token": 2.0 * f, "per_pair": 0.0, "per_row": 30.0}}}
                     for n, f in (("upstream", 1.0), ("random0.5", 0.8))}}
    tables.write_text(json.dumps(d))
    from vskipper.sim import StepTables, Workload, poisson

    t = StepTables.load(tables)
    plan = {"knee_rps": 2.0, "tpot_low_ms": 80.0, "rates": [1.0, 2.0], "load": [0.5, 1.0]}
    runs = []
    for rnd in (1, 2):
        for n in ("upstream", "random0.5"):
            for rate in plan["rates"]:
                reqs = Workload("uniform:20-60", "uniform:4-12", ignore_eos=True).requests(
                    poisson(rate, n=30, seed=rnd), seed=rnd)
                run = {"requests": [{"sent": q.arrival, "prompt": q.prompt, "output": q.output} for q in reqs]}
                r = sim_run(t, n, run)
                itl, k0 = list(r.itl), 0
                for q, ttft, e2e, o in zip(run["requests"], r.ttft, r.e2e, r.output):
                    q.update(ttft=float(ttft), latency=float(e2e), itl=itl[k0:k0 + int(o) - 1])
                    k0 += int(o) - 1
                run.update(system=n, rate=rate, round=rnd, duration=r.duration)
                runs.append(run)
    out = tmp_path / "out"
    (out / "rounds").mkdir(parents=True)
    for rnd in (1, 2):
        (out / "rounds" / f"round-{rnd}.json").write_text(json.dumps(
            {"date": "test", "plan": plan, "runs": [r for r in runs if r["round"] == rnd]}))
    main(["page", "--tables", str(tables), "--out", str(out), "--docs", "none"])
    text = capsys.readouterr().out
    assert "**Criterion: MET.** Median absolute error over the mean-TTFT, mean-TPOT and throughput cells 0.0%" in text
    res = json.loads((out / "page" / "results.json").read_text())["results"]
    assert len(res["cells"]) == 2 * 2 * 13 and max(abs(c["error"]) for c in res["cells"]) < 1e-9
