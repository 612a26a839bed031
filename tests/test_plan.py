"""`vskipper plan`: its output, its errors, and the skipper models it builds."""
import json
import re

import pytest

from vskipper import cli
from vskipper.sim.plan import calibrated, parse_rates, pays_from
from vskipper.sim.steps import FORMAT, StepModel


def tables_file(tmp_path, skip_ratio=0.8):
    """Step tables of round numbers: upstream, and a skipper whose steps cost skip_ratio of upstream's."""
    def system(r, f):
        return {"label": f"x{r}", "run_fraction": {"decode": f, "extend": f},
                "decode": [[1, 100, 20.0 * r, "measured", "test"], [8, 100, 40.0 * r, "measured", "test"],
                           [64, 100, 160.0 * r, "measured", "test"]],
                "extend": {"coef": {"e0": 5.0, "per_token": 0.5 * r, "per_pair": 0.0, "per_row": 1.0}}}

    d = {"format": FORMAT, "device": "Test GPU", "engine": "test", "model": "tiny", "source": "tests/test_plan.py",
         "host": {"decode_ms": [1.0, 0.0], "serial": False}, "server": ["--max-total-tokens", "100000"],
         "systems": {"upstream": system(1.0, 1.0), "skip": system(skip_ratio, 0.5)}}
    p = tmp_path / "tables.json"
    p.write_text(json.dumps(d))
    return p


def plan(argv, capsys):
    cli.main(["plan", *argv])
    return capsys.readouterr().out


BASE = ["--prompt", "uniform:20-60", "--output", "uniform:10-40", "--ignore-eos", "--requests", "150", "--seeds", "2"]


def test_plan_prints_upstream_against_the_skipper_per_rate(tmp_path, capsys):
    out = plan(["--tables", str(tables_file(tmp_path)), "--rates", "5:30:5", *BASE], capsys)
    lines = [x for x in out.splitlines() if x.startswith("| ")]
    assert lines[0].startswith("| req/s | mean TTFT ms") and len(lines) == 1 + 6
    assert "Test GPU" in out and "x0.8 (RUN fraction decode 0.50" in out
    assert "skipping pays (mean e2e at least 1% lower, there and at every higher rate swept): from 5 req/s" in out
    assert "knee (the last rate whose output tok/s beats the running maximum by >= 1%): upstream" in out
    # a skipper 20% faster at every step: lower e2e at every rate, more throughput once saturated
    cells = [line.split(" | ") for line in lines[1:]]
    assert all("(-" in c[4] for c in cells)


def test_plan_skipper_that_costs_more_never_pays(tmp_path, capsys):
    out = plan(["--tables", str(tables_file(tmp_path, skip_ratio=1.1)), "--rates", "5,20", *BASE], capsys)
    assert "at none of the rates swept" in out


def test_plan_run_fraction_moves_the_skipper(tmp_path, capsys):
    out = plan(["--tables", str(tables_file(tmp_path)), "--rate", "10", "--run-fraction", "0.75", *BASE], capsys)
    assert "RUN fraction 0.75 (scaled from x0.8)" in out


def test_plan_json(tmp_path, capsys):
    out = plan(["--tables", str(tables_file(tmp_path)), "--rates", "5,10", "--json", *BASE], capsys)
    d = json.loads(out)
    assert d["rates"] == [5.0, 10.0] and len(d["results"]["upstream"]) == 2
    assert d["results"]["vskipper"][1]["e2e_mean"] < d["results"]["upstream"][1]["e2e_mean"]


@pytest.mark.parametrize("argv, msg", [
    (["--tables", "no-such-device"], "neither a file nor a shipped table set"),
    (["--rates", "3,2"], "increasing"),
    (["--rates", "a:b"], "expected R, R1,R2"),
    (["--skipper", "nope"], "not in the step tables"),
    (["--skipper", "upstream"], "not upstream with itself"),
    (["--run-fraction", "1.5"], r"\[0, 1\]"),
    (["--server", "--mem-fraction-static 0.9"], "not one the simulator reads"),
    (["--calibration", "x.json"], "needs --routed-layers and --run-fraction"),
    (["--requests", "0"], "--requests 0"),
    (["--seeds", "0"], "--seeds 0"),
])
def test_plan_bad_input_is_one_line(tmp_path, capsys, argv, msg):
    args = ["--tables", str(tables_file(tmp_path)), *([] if "--rates" in argv else ["--rate", "5"]), *BASE]
    for i in range(0, len(argv), 2):  # replace or add the flag
        if argv[i] in args:
            args[args.index(argv[i]) + 1] = argv[i + 1]
        else:
            args += argv[i:i + 2]
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("vskipper: error:") and len(err.strip().splitlines()) == 1
    assert re.search(msg, err), err


def test_plan_needs_max_new_tokens_or_ignore_eos(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["plan", "--tables", str(tables_file(tmp_path)), "--rate", "5", "--prompt", "fixed:10",
                  "--output", "fixed:10"])
    assert "--max-new-tokens" in capsys.readouterr().err


def test_plan_on_the_shipped_tables(capsys):
    from vskipper.sim.plan import shipped_tables

    names = shipped_tables()
    if not names:
        pytest.skip("no shipped step tables")
    for name in names:
        rate = "0.3" if "cpu" in name else "5"
        out = plan(["--tables", name, "--rate", rate, "--prompt", "uniform:30-80", "--output", "uniform:8-24",
                    "--ignore-eos", "--requests", "40", "--seeds", "1"], capsys)
        assert "vskipper plan:" in out and f"| {rate} |" in out


def test_pays_from_and_rates():
    assert pays_from([1, 2, 3, 4], [10, 10, 10, 10], [11, 9, 10.5, 9]) == 4
    assert pays_from([1, 2, 3], [10, 10, 10], [9, 9, 9]) == 1
    assert pays_from([1, 2], [10, 10], [9, 10]) is None
    assert parse_rates("1:4") == [1, 2, 3, 4] and parse_rates("0.5:1.5:0.5") == [0.5, 1.0, 1.5]


def test_calibrated_skipper_is_upstream_less_the_layers_saving():
    up = StepModel("up", {1: (10.0, 0.0), 8: (20.0, 0.0)}, {"e0": 0, "per_token": 1.0, "per_pair": 0, "per_row": 0})
    cal = {"ts": [1, 8], "fs": [0.0, 0.5, 1.0], "dense": [[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]],
           "routed": [[0.2, 0.6, 1.1], [0.5, 1.5, 2.2]], "phase": "decode"}
    m = calibrated(up, [cal], routed_layers=4, run_fraction=0.5)
    assert m.decode_ms(1, 0) == pytest.approx(10.0 - 4 * (1.0 - 0.6))
    assert m.decode_ms(8, 0) == pytest.approx(20.0 - 4 * (2.0 - 1.5))
    assert m.extend["per_token"] == pytest.approx(1.0 - 4 * 0.5 / 8)
    with pytest.raises(ValueError, match="no whole-layer decode table"):
        calibrated(up, [dict(cal, phase="prefill")], 4, 0.5)
    with pytest.raises(ValueError, match="not a cost calibration"):
        calibrated(up, [{"ts": []}], 4, 0.5)
