"""The benchmarks' one table writer and one results writer (benchmarks/results.py)."""
import argparse
import json
from pathlib import Path

import pytest

from benchmarks import results


def test_table_is_a_header_its_rule_and_one_line_per_row():
    text = results.table(["a", "b", "c"], [[1, "x", 2.5], ["only two", ""]])
    assert text.splitlines() == ["| a | b | c |", "|---|---|---|", "| 1 | x | 2.5 |", "| only two |  |"]
    with pytest.raises(ValueError, match="a row of 3 cells under a header of 2"):
        results.table(["a", "b"], [[1, 2, 3]])


def test_results_json_holds_the_run_and_the_page_is_rendered_from_it(tmp_path, monkeypatch):
    import importlib.machinery
    import sys
    import types

    main = types.ModuleType("__main__")  # run as a file ...
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setattr(sys, "argv", ["benchmarks/step/layer.py", "--repeats", "3"])
    assert results.command() == "python benchmarks/step/layer.py --repeats 3"
    main.__spec__ = importlib.machinery.ModuleSpec("benchmarks.step.layer", None)  # ... and as a module
    assert results.command() == "python -m benchmarks.step.layer --repeats 3"
    main.__spec__ = None
    out, docs = tmp_path / "run", tmp_path / "docs"
    path = results.write_results("layer", {"times": [1.5, 2.0], "where": Path("/x")}, "| a |\n|---|\n| 1 |\n", out)
    record = json.loads(path.read_text())
    assert path == out / "results.json" and record["results"] == {"times": [1.5, 2.0], "where": "/x"}
    assert record["name"] == "layer" and record["table"].startswith("| a |")
    assert record["command"] == "python benchmarks/step/layer.py --repeats 3"
    assert "CPUs" in record["machine"] and record["date"][:2] == "20"
    assert not docs.exists()  # no docs directory given: no page (tests, smoke runs)

    page = results.render(out, docs)
    assert page == docs / "layer.md"
    lines = page.read_text().splitlines()
    assert "do not edit" in lines[0] and lines[2] == "# layer"
    assert lines[4] == f"{record['machine']}; {record['date']}; `python benchmarks/step/layer.py --repeats 3`"
    assert lines[6:] == ["| a |", "|---|", "| 1 |"]
    first = page.read_text()
    page.write_text("edited by hand")
    results.main([str(out), "--docs", str(docs)])  # python -m benchmarks.results OUT_DIR: the page again
    assert page.read_text() == first
    with pytest.raises(SystemExit):
        results.main([str(tmp_path / "nothing-here")])
    with pytest.raises(ValueError, match="lower-case"):
        results.write_results("Layer Results", {}, "", out)


def test_docs_dir_defaults_to_docs_results_except_for_smoke_runs():
    ns = argparse.Namespace
    assert results.docs_dir(ns(docs=None)) == results.DOCS
    assert results.docs_dir(ns(docs=None, smoke=True)) is None
    assert results.docs_dir(ns(docs="/tmp/pages", smoke=True)) == Path("/tmp/pages")
    assert results.docs_dir(ns(docs="none")) is None
    assert results.DOCS == Path(results.__file__).resolve().parents[1] / "docs" / "results"
