"""Elastic depth's trace (vskipper/elastic_trace.py) and its replay (benchmarks/serving/elastic_replay.py):
the events a controller saw, written and read back, replay the server's levels exactly under its own
rule and move the rise under a changed one. A real server's trace: tests/test_elastic_sglang.py."""
from __future__ import annotations

import pytest

from vskipper import elastic
from vskipper.elastic import DEBT, DWELL, Controller, StepModel, Target, ladder
from vskipper.elastic_trace import Recorder, read, replay

from tiny import synthetic_calibration

L = 4


def traced(path, now=0.0) -> Recorder:
    model = StepModel(synthetic_calibration(), ("routed",), n_layers=6, n_routed=L, run_fraction=0.5)
    return Recorder(Controller(Target(tpot_ms=10.0, period_s=0.05), ladder(L), model, now), path, now)


def busy_spell(c, now: float, ticks: int, ms: float, rows: int = 8) -> float:
    """`ticks` control ticks, each after DWELL decode steps of `ms` at the level of the moment (a tick a
    period apart), then idle."""
    for _ in range(ticks):
        k = ladder(L)[c.level]
        for _ in range(DWELL):
            now += ms / 1e3
            c.decode_step(now, [k] * rows, prefill=False, context=40 * rows)
        c.tick(now, [k] * rows, rows)
    c.idle()
    c.tick(now + 1.0, [], 0)
    return now + 2.0


def test_a_trace_replays_the_servers_levels_and_a_changed_rule_moves_the_rise(tmp_path):
    from benchmarks.serving.elastic_replay import report

    path = tmp_path / "tp0-1.jsonl"
    c = traced(path)
    now = busy_spell(c, 0.0, 8, 12.5)  # 25% over: 4 steps' worth a tick once it judges, a rise at the fourth
    now = busy_spell(c, now, 2, 5.0)  # light: level 0 throughout
    assert c.level == 0 and "over target" not in c.reason
    lives = read(path)
    assert len(lives) == 1 and lives[0][0]["budgets"] == list(ladder(L))
    head, events = lives[0]
    same = replay(head, events)
    ticks = [t for t in same if t[1] > 0]
    assert [t[2] for t in same] == [t[3] for t in same], "the server's own rule replays its levels exactly"
    server_rise = next(i for i, t in enumerate(ticks) if t[2] > 0)
    assert server_rise == 3 and f"missed by {DEBT:.1f} steps' worth" in ticks[server_rise][4], ticks[server_rise]
    sooner = replay(head, events, DEBT=4)
    assert next(i for i, t in enumerate(sooner) if t[3] > 0) < next(i for i, t in enumerate(same) if t[3] > 0)
    never = replay(head, events, DEBT=1000, SURGE=100)
    assert all(t[3] == 0 for t in never) and elastic.DEBT == DEBT and elastic.SURGE != 100, "constants restored"
    text = report(lives, {"DEBT": 4.0})
    assert "life 0 spell 0:" in text and "life 0 spell 1:" in text and "spell 2" not in text, text
    assert "server: a rise in 1 of 2 spells" in text and "replayed (changed: DEBT=4.0): a rise in 1 of 2" in text, text
    assert "; apart from +" in text.splitlines()[0] and "level 0 throughout" in text.splitlines()[1], text
    # a controller made again in the same process appends a second life to the same file
    traced(path, now)
    assert len(read(path)) == 2


def test_a_bad_trace_or_constant_is_refused_naming_it(tmp_path):
    bad = tmp_path / "x.jsonl"
    bad.write_text('["tick",[1.0,[],0],{},0]\n')
    with pytest.raises(ValueError, match=r"x.jsonl:1: not an elastic-depth trace line"):
        read(bad)
    bad.write_text("")
    with pytest.raises(ValueError, match="empty; a trace starts with its header"):
        read(bad)
    path = tmp_path / "t.jsonl"
    busy_spell(traced(path), 0.0, 1, 5.0)
    head, events = read(path)[0]
    with pytest.raises(ValueError, match="not a constant of vskipper.elastic: LADDER, slow"):
        replay(head, events, LADDER=1, slow=2)
    with pytest.raises(ValueError, match=r"DWELL=4.5: a count of steps, give a whole number"):
        replay(head, events, DWELL=4.5)
    assert elastic.DWELL == DWELL


def test_replay_cli_reads_a_directory_and_refuses_bad_settings(tmp_path, monkeypatch, capsys):
    from benchmarks.serving import elastic_replay

    busy_spell(traced(tmp_path / "tp0-7.jsonl"), 0.0, 8, 12.5)
    busy_spell(traced(tmp_path / "tp1-8.jsonl"), 0.0, 1, 5.0)  # a rank that follows: not read
    monkeypatch.setattr("sys.argv", ["elastic_replay", str(tmp_path), "--set", "DEBT=4"])
    elastic_replay.main()
    out = capsys.readouterr().out
    assert "tp0-7.jsonl" in out and "tp1-8" not in out and "server: a rise in 1 of 1 spells" in out, out
    for argv, message in ((["--set", "DEBT"], "give NAME=NUMBER"), (["--set", "NOPE=1"], "not a constant")):
        monkeypatch.setattr("sys.argv", ["elastic_replay", str(tmp_path), *argv])
        with pytest.raises(SystemExit):
            elastic_replay.main()
        assert message in capsys.readouterr().err
    for where, message in ((tmp_path / "none", "no such trace file or directory"), (tmp_path / "e", "no trace files")):
        (tmp_path / "e").mkdir(exist_ok=True)
        monkeypatch.setattr("sys.argv", ["elastic_replay", str(where)])
        with pytest.raises(SystemExit):
            elastic_replay.main()
        assert message in capsys.readouterr().err
