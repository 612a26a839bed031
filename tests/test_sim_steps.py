"""The simulator's step models and their fits, its server flags and its workloads."""
import json
import random

import pytest

from vskipper.sim import Lengths, ServerConfig, StepTables, Workload, fit_decode, fit_extend, poisson, read_trace
from vskipper.sim.steps import FORMAT, StepModel, nnls


def test_fit_decode_recovers_known_parameters():
    """Synthetic decode steps t = t0(B) + k(B) B C (with noise of 0.1%) give back t0 and k per B; a batch
    size measured at one context takes k from the fit over all cells."""
    rng = random.Random(0)
    truth = {1: (7.0, 6e-5), 16: (7.8, 3e-5), 64: (8.3, 2.8e-5)}
    cells = [(B, C, (t0 + k * B * C) * (1 + rng.uniform(-1e-3, 1e-3))) for B, (t0, k) in truth.items()
             for C in (512, 1024, 2048, 4096)]
    fit = fit_decode(cells)
    for B, (t0, k) in truth.items():
        assert fit[B][0] == pytest.approx(t0, rel=0.01)
        assert fit[B][1] == pytest.approx(k, rel=0.05)
    one = fit_decode(cells + [(256, 1024, 10.8 + 2.9e-5 * 256 * 1024)])
    assert one[256][1] == pytest.approx(3e-5, rel=0.2)  # the common slope
    with pytest.raises(ValueError, match="B >= 1"):
        fit_decode([(0, 10, 1.0)])


def test_fit_extend_recovers_known_coefficients():
    rng = random.Random(1)
    e = {"e0": 12.0, "per_token": 0.9, "per_pair": 2e-3, "per_row": 5.0}
    cells = []
    for n in (16, 64, 128, 256, 512):
        for rows in (1, 2, 4):
            pairs = rows * (n / rows) * (n / rows + 1) / 2
            ms = e["e0"] + e["per_token"] * n + e["per_pair"] * pairs + e["per_row"] * rows
            cells.append((n, rows, pairs, ms * (1 + rng.uniform(-1e-3, 1e-3))))
    fit = fit_extend(cells)
    for k, v in e.items():
        assert fit[k] == pytest.approx(v, rel=0.1, abs=0.2 if k == "e0" else 0)
    with pytest.raises(ValueError, match="at least 2"):
        fit_extend(cells[:1])


def test_nnls_drops_a_negative_coefficient():
    X = [[1.0, x, -x] for x in range(1, 9)]
    y = [2.0 + 3.0 * x for x in range(1, 9)]
    c = nnls(X, y)
    assert min(c) >= 0 and c[0] == pytest.approx(2.0) and c[1] == pytest.approx(3.0)


def test_decode_interpolates_between_table_batch_sizes_and_says_where():
    m = StepModel("m", {1: (10.0, 0.0), 11: (20.0, 0.0), 21: (40.0, 1e-3)},
                  {"e0": 0, "per_token": 1, "per_pair": 0, "per_row": 0}, tags={21: "modelled: roofline"})
    assert m.decode_ms(6, 0) == pytest.approx(15.0)
    assert m.decode_ms(16, 1000) == pytest.approx(30.0 + 0.5e-3 * 1000)
    assert m.decode_ms(31, 0) == pytest.approx(60.0)  # along the last segment
    assert m.where(21) == "modelled: roofline"
    assert m.where(16).startswith("interpolated between B=11 (measured) and B=21 (modelled: roofline)")
    assert m.where(40).startswith("extrapolated")


def test_scaled_moves_linearly_in_the_run_fraction():
    up = StepModel("up", {1: (10.0, 1e-3)}, {"e0": 5, "per_token": 1.0, "per_pair": 0, "per_row": 0})
    sk = StepModel("sk", {1: (8.0, 1e-3)}, {"e0": 5, "per_token": 0.6, "per_pair": 0, "per_row": 0},
                   {"decode": 0.5, "extend": 0.5})
    half = sk.scaled(up, 0.75, "x")
    assert half.decode_ms(1, 0) == pytest.approx(9.0)
    assert half.extend_ms(100, 1, 0) == pytest.approx(5 + 80)
    with pytest.raises(ValueError, match="skips nothing"):
        up.scaled(up, 0.5, "y")
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        sk.scaled(up, 1.5, "y")


def tables(**over):
    d = {"format": FORMAT, "device": "test", "host": {"decode_ms": [1.0, 0.1], "serial": True},
         "systems": {"upstream": {"decode": [[1, 100, 10.0, "measured", "t"], [8, 100, 20.0, "measured", "t"]],
                                  "extend": {"coef": {"e0": 1, "per_token": 1, "per_pair": 0, "per_row": 0}}}}}
    d.update(over)
    return d


def test_step_tables_load_and_errors(tmp_path):
    t = StepTables(tables())
    assert t.host.decode_ms == (1.0, 0.1) and t.model("upstream").decode_ms(1, 100) == pytest.approx(10.0)
    p = tmp_path / "t.json"
    p.write_text(json.dumps(tables()))
    assert StepTables.load(p).meta["device"] == "test"
    with pytest.raises(ValueError, match="not a step table file"):
        StepTables({"format": "x"})
    with pytest.raises(ValueError, match="at least \"upstream\""):
        StepTables(tables(systems={}))
    bad = tables()
    bad["systems"]["upstream"]["extend"] = {}
    with pytest.raises(ValueError, match="systems.upstream.extend"):
        StepTables(bad)
    bad = tables()
    bad["systems"]["upstream"]["run_fraction"] = {"decode": 2, "extend": 1}
    with pytest.raises(ValueError, match="run_fraction"):
        StepTables(bad)
    with pytest.raises(ValueError, match="host.decode_ms"):
        StepTables(tables(host={"decode_ms": 3}))
    with pytest.raises(ValueError, match="not in the step tables"):
        t.model("nope")
    p.write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        StepTables.load(p)
    with pytest.raises(ValueError, match="no such file"):
        StepTables.load(tmp_path / "missing.json")


def test_server_config_from_flags():
    c = ServerConfig.from_flags("--max-total-tokens 32768 --chunked-prefill-size=512 --max-running-requests 64 "
                                "--disable-overlap-schedule --schedule-conservativeness 0.5")
    assert (c.max_total_tokens, c.chunked_prefill_size, c.max_running_requests, c.overlap) == (32768, 512, 64, False)
    assert c.ratio_init == pytest.approx(0.35) and c.ratio_min == pytest.approx(0.35 * 0.14)
    assert ServerConfig.from_flags(["--chunked-prefill-size", "-1"]).chunked_prefill_size is None
    assert ServerConfig.from_flags(c.flags()) == c
    with pytest.raises(ValueError, match="not one the simulator reads"):
        ServerConfig.from_flags("--mem-fraction-static 0.9")
    with pytest.raises(ValueError, match="expected a number"):
        ServerConfig.from_flags("--max-total-tokens lots")
    with pytest.raises(ValueError, match="expected a value"):
        ServerConfig.from_flags("--max-total-tokens")
    with pytest.raises(ValueError, match="max_running_requests"):
        ServerConfig(max_running_requests=0)
    with pytest.raises(ValueError, match="fcfs"):
        ServerConfig(schedule_policy="lpm")


def test_lengths_and_workloads():
    rng = random.Random(0)
    assert Lengths("fixed:7").draw(rng) == 7
    u = [Lengths("uniform:3-5").draw(rng) for _ in range(200)]
    assert set(u) == {3, 4, 5}
    ln = Lengths("lognormal:mean=200,sd=100,min=10,max=500")
    xs = [ln.draw(rng) for _ in range(4000)]
    assert 10 <= min(xs) and max(xs) <= 500 and 185 < sum(xs) / len(xs) < 210
    for bad, msg in (("fixed:0", ">= 1"), ("uniform:5-3", "A must be <= B"), ("normal:mean=5", "needs mean= and sd="),
                     ("poisson:3", "expected one of"), ("normal:mean=5,sd=1,foo=2", "not one of")):
        with pytest.raises(ValueError, match=msg):
            Lengths(bad)
    w = Workload("fixed:10", "uniform:1-900", max_new_tokens=512)
    reqs = w.requests(poisson(5.0, n=50, seed=1), seed=1)
    assert all(r.output <= 512 and r.max_new_tokens == 512 and not r.ignore_eos for r in reqs)
    with pytest.raises(ValueError, match="max_new_tokens"):
        Workload("fixed:10", "fixed:10")
    arr = poisson(10.0, duration=100.0, seed=2)
    assert arr[0] == 0.0 and 900 < len(arr) < 1100 and max(arr) < 100
    with pytest.raises(ValueError, match="rate"):
        poisson(0, n=3)


def test_trace_round_trip_and_errors(tmp_path):
    from vskipper.sim import Request, write_trace

    p = tmp_path / "trace.jsonl"
    reqs = [Request(0.5, 10, 4, 4, True), Request(0.0, 3, 2, 8, False)]
    write_trace(p, reqs)
    assert read_trace(p) == sorted(reqs, key=lambda r: r.arrival)
    p.write_text('{"arrival": 0, "prompt": 3}\n')
    with pytest.raises(ValueError, match=r":1: missing output"):
        read_trace(p)
    p.write_text('{"arrival": 0, "prompt": 3, "output": 0}\n')
    with pytest.raises(ValueError, match="output=0"):
        read_trace(p)
