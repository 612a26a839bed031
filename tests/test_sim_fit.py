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
