"""The cost model chooses how, never what: auto == dense == routed in decisions and tokens."""
from __future__ import annotations

import json
import warnings

import pytest
import torch

import vskipper
from vskipper import cost
from vskipper.calibrate import LayerBench, measure
from vskipper.routed_layer import AutoBody, DenseBody

from helpers import assert_equal, fast_decisions, greedy, left_pad, prompts
from tiny import flexidepth_for, record_routes, synthetic_calibration, tiny_llama, transformed


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VSKIPPER_CACHE", str(tmp_path / "cache"))
    cost._warned.clear()


synthetic = synthetic_calibration


def test_interpolation_and_hysteresis():
    cal = synthetic()
    assert cal.predict("dense", 4, 0.25) == pytest.approx(4.0)
    assert cal.predict("routed", 8, 0.25) == pytest.approx((0.3 + 0.2) * 8)
    assert cal.predict("routed", 32, 0.0) == pytest.approx(0.3 * 16 * 2)  # linear beyond the grid
    assert cal.choose(1, 0.5) == "dense" and cal.choose(16, 0.5) == "routed"
    assert cal.choose(8, 0.25) == "routed" and cal.choose(8, 0.75) == "routed-mlp"  # three bodies
    assert cal.bodies() == ("dense", "routed", "routed-mlp")
    # near a crossover the current body stays unless another is clearly cheaper
    f_cross = (1.0 - 0.3) / 0.8
    assert cal.choose(16, f_cross + 0.01, current="routed") == "routed"
    assert cal.choose(16, f_cross + 0.01) == "dense"
    assert cal.choose(8, 0.51, current="routed") == "routed" and cal.choose(8, 0.51) == "routed-mlp"


def test_cells_at_their_real_fraction_and_ratios_against_the_rows_dense_time():
    # T=2 with fs (0, .3, .7, 1): 0, 1, 1 and 2 RUN rows. The f=.7 cell ran in a slow spell of the
    # machine (both bodies 2x): its routed/dense ratio still counts, its absolute times do not.
    ts, fs = (1, 2), (0.0, 0.3, 0.7, 1.0)
    dense = ((1.0, 1.0, 1.0, 1.0), (2.0, 2.0, 4.0, 2.0))
    routed = ((0.5, 0.5, 1.0, 1.0), (1.0, 1.0, 2.0, 3.0))
    cal = cost.Calibration("x", {}, 8, 8, ts, fs, dense, routed)
    assert cal.predict("dense", 2, 0.7) == pytest.approx(2.0)  # the row's median, whatever f
    assert cal.predict("routed", 2, 0.5) == pytest.approx(1.0)  # n=1: cells .3 and .7 merged
    assert cal.predict("routed", 2, 0.25) == pytest.approx(1.0)  # between n=0 (1.0) and n=1 (1.0)
    assert cal.predict("routed", 2, 0.75) == pytest.approx(2.0)  # between n=1 (1.0) and n=2 (3.0)
    # T=1: the cells f=0 and .3 both had 0 RUN rows, f=.7 and 1 one: fractions 0 and 1 only
    assert cal.predict("routed", 1, 0.3) == pytest.approx(0.5 * 0.7 + 1.0 * 0.3)
    assert cal.choose(2, 0.5) == "routed" and cal.choose(2, 1.0) == "dense"


def test_routed_time_is_made_nondecreasing_in_the_run_fraction():
    assert cost._nondecreasing([1.0, 3.0, 2.0, 4.0, 0.5]) == pytest.approx([1.0, 2.375, 2.375, 2.375, 2.375])
    assert cost._nondecreasing([1.0, 2.0, 2.0]) == [1.0, 2.0, 2.0]
    # a noisy dip at T=8: 2 RUN rows measured dearer than 4; the fit pools them
    fs = (0.0, 0.25, 0.5, 1.0)
    cal = cost.Calibration("x", {}, 8, 8, (4, 8), fs, ((1.0,) * 4, (2.0,) * 4), ((1.0,) * 4, (0.4, 2.2, 1.8, 2.4)))
    assert cal.predict("routed", 8, 0.25) == pytest.approx(2.0) and cal.predict("routed", 8, 0.5) == pytest.approx(2.0)


def test_dense_routed_auto_same_decisions_and_tokens():
    base = tiny_llama()
    sk = flexidepth_for(base, [1, 2, 3, 4, 5], gate="soft")
    cost.save(synthetic())
    seqs = prompts((5, 9, 2, 13, 7))
    ids, mask = left_pad(seqs)
    outs, decisions = {}, {}
    for body in ("dense", "routed", "routed-mlp", "auto"):
        m = transformed(base, sk, body)
        calls = record_routes(m)
        outs[body] = greedy(m, ids, mask)
        decisions[body] = {l: [fast_decisions(calls, l, b, ids.shape[1] - len(p)) for b, p in enumerate(seqs)]
                           for l in sk.layers}
        if body == "auto":
            assert isinstance(m.vskipper.graphs[0].routed.get_submodule("1").body, AutoBody)
    for body in ("routed", "routed-mlp", "auto"):
        assert_equal(outs[body], outs["dense"], f"{body} vs dense tokens")
        for l in sk.layers:
            for b in range(len(seqs)):
                assert_equal(decisions[body][l][b], decisions["dense"][l][b], f"{body} routes, layer {l}, seq {b}")


def test_auto_uses_all_three_bodies_as_the_model_predicts():
    base = tiny_llama()
    cost.save(synthetic())
    seen = []

    def watched(rate):
        m = transformed(base, vskipper.RandomSkip(rate, [2]), "auto")
        chooser = m.vskipper.graphs[0].routed.get_submodule("2").body.chooser
        orig = chooser.choose
        chooser.choose = lambda T, counts, *a, **k: seen.append((T, orig(T, counts, *a, **k))) or seen[-1][1]
        return m

    with torch.no_grad():
        m = watched(0.5)
        m(torch.randint(1, 100, (1, 1)))  # T = 1: dense
        m(torch.randint(1, 100, (4, 8)))  # T = 32: routed
        watched(0.0)(torch.randint(1, 100, (1, 8)))  # T = 8, every row RUN: routed-mlp
    assert [b for _, b in seen] == ["dense", "routed", "routed-mlp"]


def test_no_calibration_runs_dense_with_one_warning():
    base = tiny_llama()
    with pytest.warns(UserWarning,
                      match=r"no cost calibration for .*runs the dense-masked body.*vskipper calibrate --shape 40,72"):
        m = transformed(base, vskipper.RandomSkip(0.5, [1, 2]), "auto")
    assert {b.name for b in m.vskipper.bodies.values()} == {"dense"}
    assert "without a cost calibration" in vskipper.explain(m)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        transformed(base, vskipper.RandomSkip(0.5, [1, 2]), "auto")  # warned once per device


def test_stale_calibration_is_ignored_with_a_warning():
    path = cost.save(synthetic())
    entries = json.loads(path.read_text())
    entries[0]["versions"]["torch"] = "0.0.1"
    path.write_text(json.dumps(entries))
    with pytest.warns(UserWarning, match="ignoring a stale cost calibration"):
        assert cost.load("cpu", 40, 72) is None


def test_nearest_shape_is_used_and_said():
    cost.save(synthetic(40, 72))
    cost.save(synthetic(576, 1536))
    with pytest.warns(UserWarning, match=r"no cost calibration for hidden=512, intermediate=1400 .*nearest shape, "
                                         r"576x1536.*vskipper calibrate --shape 512,1400"):
        assert cost.load("cpu", 512, 1400).hidden == 576
    with pytest.warns(UserWarning, match="nearest shape, 40x72"):
        assert cost.load("cpu", 48, 64).hidden == 40
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cost.load("cpu", 40, 72).hidden == 40  # the exact shape: nothing to say


def test_a_calibration_at_another_thread_count_is_named_in_the_warning():
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        cost.save(synthetic())
    finally:
        torch.set_num_threads(threads)
    with pytest.warns(UserWarning, match=rf"calibrations of this CPU at other thread counts: .*{threads + 1} threads.*"
                                         rf"--shape 40,72 --threads {threads}"):
        m = transformed(tiny_llama(), vskipper.RandomSkip(0.5, [1]), "auto")
    assert {b.name for b in m.vskipper.bodies.values()} == {"dense"}


def test_a_slow_spell_in_one_pass_does_not_move_the_calibration(monkeypatch):
    from vskipper import calibrate

    calls = []

    def fake(bench, bodies, args, sync, rounds, rng):  # routed is half of dense, 4x in pass 2
        calls.append(rounds)
        spell = 4.0 if 4 <= len(calls) <= 6 else 1.0  # 3 cells per pass: the second pass
        return {"dense": [2.0] * rounds, "routed": [1.0 * spell] * rounds, "routed-mlp": [1.5] * rounds}

    monkeypatch.setattr(calibrate, "side_by_side", fake)
    cal, _ = measure(32, 48, 4, 2, ts=(1, 64, 128), fs=(0.5,), repeats=6, passes=3, contexts=(256,), progress=False)
    assert len(calls) == 9 and calls[:3] == [64, 2, 2]  # 6 rounds x 32/T below T=32, over 3 passes
    assert cal.dense == ((2.0,),) * 3 and cal.routed == ((1.0,),) * 3 and cal.routed_mlp == ((1.5,),) * 3


def test_measure_a_tiny_grid():
    cal, _ = measure(32, 48, 4, 2, ts=(1, 8), fs=(0.0, 1.0), repeats=2, contexts=(16, 64), progress=False)
    assert len(cal.dense) == 2 and len(cal.dense[0]) == 2 and all(t > 0 for row in cal.routed for t in row)
    assert cal.contexts == (16, 64) and cal.by_context[0].ts == (1, 4) and cal.by_context[0].fs == cost.CONTEXT_F
    assert cost.load("cpu", 32, 48) is None  # measure alone caches nothing
    cost.save(cal)
    assert cost.load("cpu", 32, 48) == cal


def test_calibration_times_cpu_steps_eagerly(monkeypatch):
    class NoGraphs:  # a class, not a function: transformers annotates with `torch.cuda.CUDAGraph | None`
        def __init__(self, *a, **k):
            raise AssertionError("a CPU step was captured")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", NoGraphs)
    monkeypatch.setattr(torch.cuda, "graph", NoGraphs)
    calls = []
    monkeypatch.setattr(DenseBody, "__call__", lambda self, *a, _f=DenseBody.__call__: calls.append(1) or _f(self, *a))
    bench = LayerBench(32, 48, 4, 2, "cpu", context=16)
    for phase in ("decode", "prefill"):
        calls.clear()
        ms = bench.time("dense", bench.inputs(16, 0.5, phase), lambda: None, inner=3)
        assert ms > 0 and len(calls) == 1 + 3, (phase, ms, len(calls))  # one untimed call, then each timed one


def test_auto_plans_captured_graphs_from_the_declared_fraction_and_keeps_state_per_phase_and_size():
    cal = synthetic()
    chooser = cost.Chooser(cal, expected=0.25)
    assert chooser.declared and chooser.plan((1, 2, 4, 16)) == {1: "dense", 2: "dense", 4: "routed", 16: "routed"}
    assert cost.Chooser(cal).expected == 0.5 and not cost.Chooser(cal).declared
    assert cost.Chooser(cal, expected=1.0).planned(16) == "dense"  # routed at f = 1 costs 1.1 x dense here
    # hysteresis per (phase, batch size): a decode step at T = 16 does not move prefill's state
    near = torch.tensor([15, 1], dtype=torch.int32)  # f = 15/16, where dense wins
    assert chooser.choose(16, near, decode=True) == "dense"
    assert chooser.choose(16, torch.tensor([2, 14], dtype=torch.int32), decode=False) == "routed"
    assert chooser.current == {(True, 16): "dense", (False, 16): "routed"}


class LandingEvent:
    """A stand-in for torch.cuda.Event: its copies have landed when the test says so (the accelerator
    branch of Chooser, run on CPU tensors: the same code, pinned buffer and event aside)."""

    landed = False

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return LandingEvent.landed


def test_device_counts_are_read_a_step_late_per_phase_over_their_own_T():
    """On an accelerator the chooser never waits: a step's counts are read at a later step of the same
    phase, divided by the T they were counted over (a prefill step's count never reaches decode)."""
    chooser = cost.Chooser(synthetic(), expected=0.5, event=LandingEvent)
    LandingEvent.landed = False
    chooser.choose(16, torch.tensor([2, 14], dtype=torch.int32), decode=True, on_host=False)
    chooser.choose(512, torch.tensor([500, 12], dtype=torch.int32), decode=False, on_host=False)
    assert chooser.fraction == {}  # nothing has landed: both phases plan with the declared 0.5
    LandingEvent.landed = True
    chooser.choose(8, torch.tensor([8, 0], dtype=torch.int32), decode=True, on_host=False)
    assert chooser.fraction == {True: (2 / 16,)}  # decode's own copy, over its own T, not 500 / 8
    chooser.choose(256, torch.tensor([0, 256], dtype=torch.int32), decode=False, on_host=False)
    assert chooser.fraction == {True: (2 / 16,), False: (500 / 512,)}
    chooser.choose(16, torch.tensor([16, 0], dtype=torch.int32), decode=True, on_host=False)
    assert chooser.fraction[True] == pytest.approx((0.5 * 8 / 8 + 0.5 * 2 / 16,))  # EMA of the steps seen


def test_explain_shows_auto_s_graph_plan():
    cost.save(synthetic())
    m = transformed(tiny_llama(), vskipper.RandomSkip(0.75, [2]), "auto")
    assert "auto inside captured CUDA graphs, body per batch size at RUN fraction 0.25 (declared by the skipper): " \
           "1:dense 2:dense 4:routed" in vskipper.explain(m)


def test_auto_with_the_fixed_shape_body_passes_the_host_sync_guard():
    """auto's choice is host-side logic outside the guard; the body it picks runs under it."""
    cost.save(synthetic())
    m = transformed(tiny_llama(), vskipper.RandomSkip(0.5, [1, 2]), "auto", static_shapes=True, check_sync=True)
    ids, mask = left_pad(prompts((5, 9, 3, 7)))
    out = greedy(m, ids, mask, 6)
    assert out.shape[1] == ids.shape[1] + 6


def test_calibrate_threads_flag(monkeypatch, capsys):
    from vskipper import calibrate

    seen = []
    monkeypatch.setattr(calibrate, "measure",
                        lambda *a, **k: (seen.append(cost.device_name("cpu")) or synthetic(), None))
    threads = torch.get_num_threads()
    try:
        calibrate.main(["--shape", "40,72", "--threads", "1"])
    finally:
        torch.set_num_threads(threads)
    assert seen and seen[0].endswith(", 1 threads")
    with pytest.raises(SystemExit):
        calibrate.main(["--shape", "40,72", "--threads", "0"])
    assert "--threads 0: expected an integer >= 1" in capsys.readouterr().err


def test_calibrations_are_kept_per_dtype():
    import dataclasses

    cost.save(synthetic())
    assert cost.load("cpu", 40, 72, "bfloat16") is None  # an f32 table does not price a bf16 model
    cost.save(dataclasses.replace(synthetic(), dtype="bfloat16"))
    assert cost.load("cpu", 40, 72, "bfloat16").dtype == "bfloat16"
    assert cost.load("cpu", 40, 72).dtype == "float32"  # both kept
    with pytest.warns(UserWarning, match=r"\(hidden=40, intermediate=72, float16\).*--shape 40,72 --dtype float16"):
        cost.warn_uncalibrated(torch.device("cpu"), 40, 72, "float16")


def test_calibrate_max_batch_limits_the_decode_grid_only(monkeypatch, capsys, tmp_path):
    """--max-batch times the decode batch sizes a server sees, up to that size; prefill keeps its grid."""
    from vskipper import calibrate

    monkeypatch.setenv("VSKIPPER_CACHE", str(tmp_path))
    seen = []
    monkeypatch.setattr(calibrate, "measure",
                        lambda *a, phase, ts=None, **k: (seen.append((phase, ts)), (synthetic(), None))[1])
    calibrate.main(["--shape", "40,72", "--max-batch", "64"])
    assert seen == [("decode", (1, 2, 4, 8, 16, 32, 64)), ("prefill", None)]
    with pytest.raises(SystemExit):
        calibrate.main(["--shape", "40,72", "--max-batch", "1"])
    assert "--max-batch 1: expected an integer >= 2" in capsys.readouterr().err
