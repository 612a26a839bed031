"""The step tables shipped with the simulator trace to the pages they were derived from."""
import json
import re
from pathlib import Path

import pytest

from vskipper.sim import StepTables
from vskipper.sim.plan import TABLES_DIR

ROOT = Path(__file__).resolve().parents[1]
H200 = TABLES_DIR / "h200-llama3-8b.json"


def test_h200_tables_are_what_the_gpu_pages_give(tmp_path):
    """Rebuilt from docs/results/gpu-decode.md and gpu-kernels.md, the shipped H200 tables come out the same."""
    from benchmarks.sim.gpu_tables import main

    out = tmp_path / "h200.json"
    main(["--tables", str(out), "--out", str(tmp_path / "run"), "--docs", "none"])
    assert json.loads(out.read_text()) == json.loads(H200.read_text())


def test_h200_measured_cells_match_the_page_and_every_cell_names_its_source():
    page = (ROOT / "docs" / "results" / "gpu-decode.md").read_text()
    measured = {}
    for line in page.splitlines():
        m = re.match(r"\| (\d+) \| (\d+) \| .* \| ([\d.]+) / ([\d.]+) \|$", line)
        if m:
            measured[(int(m.group(1)), int(m.group(2)))] = float(m.group(4))
    assert len(measured) == 7
    data = json.loads(H200.read_text())
    up = {(c[0], c[1]): c for c in data["systems"]["upstream"]["decode"]}
    for key, ms in measured.items():
        assert up[key][2] == pytest.approx(ms) and up[key][3] == "measured"
    for name, s in data["systems"].items():
        for B, C, ms, tag, source in s["decode"]:
            assert tag and "docs/results/gpu-decode.md" in source, (name, B, C)
            assert tag.startswith("measured") == ((B, C) in measured and name != "ideal0.5"), (name, B, C, tag)
        assert "modelled from FLOPs" in s["extend"]["source"]
    t = StepTables.load(H200)
    assert t.model("upstream").measured_max == 256 and t.host_for("random0.5").serial is False


def test_cpu_tables_trace_to_the_step_sweep_page():
    path = TABLES_DIR / "cpu-smollm2-135m.json"
    if not path.is_file():
        pytest.skip("no CPU step tables yet")
    data = json.loads(path.read_text())
    for name, s in data["systems"].items():
        assert all("docs/results/sim-steps-cpu.md" in c[4] for c in s["decode"]), name
        assert all("docs/results/sim-steps-cpu.md" in c[5] for c in s["extend"]["cells"]), name
    t = StepTables.load(path)
    assert t.host.serial and set(t.systems) == {"upstream", "random0.5", "trained"}
