"""The cost model prices a sublayer skipper's bodies (attention and MLP decided apart) from tables of
their own, and auto chooses among them; how, never what: auto gives the reference's tokens and routes."""
from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch

import vskipper
from vskipper import cost
from vskipper.api import chosen_bodies
from vskipper.calibrate import measure
from vskipper.routed_layer import AutoBody, FixedSublayerBody, SublayerDenseBody, SublayerRoutedBody

from helpers import assert_batch_matches_reference, assert_close, prompts
from tiny import synthetic_calibration, tiny_llama, transformed


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VSKIPPER_CACHE", str(tmp_path / "cache"))
    cost._warned.clear()


def sublayer_table(phase="decode", hidden=40, intermediate=72):
    """Sublayer tables for this machine in which, per row, attention is 0.4 of a dense layer and the MLP
    0.6; routing either costs 0.05 plus its share at its RUN fraction: on the diagonal f_attn = f_mlp = f,
    routed (0.1 + f) T and routed-mlp (0.45 + 0.6 f) T. Below T = 4 the routed bodies cost 2 T (dense wins)."""
    ts, fs = (1, 2, 4, 8, 16), (0.0, 0.5, 1.0)
    dense = tuple(tuple(1.0 * t for _ in fs) for t in ts)
    routed = tuple(tuple((2.0 if t < 4 else 0.1 + f) * t for f in fs) for t in ts)
    routed_mlp = tuple(tuple((2.0 if t < 4 else 0.45 + 0.6 * f) * t for f in fs) for t in ts)
    return cost.Calibration(cost.device_name("cpu"), cost.versions(), hidden, intermediate, ts, fs, dense, routed,
                            routed_mlp=routed_mlp, phase=phase, sublayers=True)


def save_sublayer_tables():
    for phase in cost.PHASES:
        cost.save(sublayer_table(phase))


def test_sublayer_tables_are_kept_beside_the_whole_layer_ones():
    whole, sub = synthetic_calibration(), sublayer_table()
    assert cost.save(whole) == cost.save(sub)  # one file per device, an entry per kind
    assert sub.key() == whole.key() + "|sublayers"
    assert cost.load("cpu", 40, 72) == whole and cost.load("cpu", 40, 72, sublayers=True) == sub
    again = dataclasses.replace(sub, dense=tuple(tuple(2 * t for t in row) for row in sub.dense))
    cost.save(again)  # replaces the sublayer entry only
    assert cost.load("cpu", 40, 72) == whole and cost.load("cpu", 40, 72, sublayers=True) == again
    assert cost.load("cpu", 40, 72, phase="prefill", sublayers=True) is None
    path = cost.cache_dir() / (cost.cache.slug(cost.device_name("cpu")) + ".json")
    entries = json.loads(path.read_text())
    assert [e["sublayers"] for e in entries] == [False, True]
    del entries[0]["sublayers"]  # an entry written before sublayer tables existed: a whole-layer one
    path.write_text(json.dumps(entries))
    assert cost.load("cpu", 40, 72) == whole


def test_sublayer_bodies_are_priced_from_both_fractions():
    cal = sublayer_table()
    # routed = routed-mlp(f_mlp) + routed(f_attn) - routed-mlp(f_attn) = (0.1 + 0.4 f_attn + 0.6 f_mlp) T
    assert cal.predict("routed", 8, (0.2, 0.9)) == pytest.approx((0.1 + 0.08 + 0.54) * 8)
    assert cal.predict("routed-mlp", 8, (0.2, 0.9)) == pytest.approx((0.45 + 0.54) * 8)  # attention for every row
    assert cal.predict("dense", 8, (0.2, 0.9)) == pytest.approx(8.0)
    assert cal.predict("routed", 8, 0.5) == cal.predict("routed", 8, (0.5, 0.5)) == pytest.approx(0.6 * 8)
    assert cal.choose(8, (0.2, 0.9)) == "routed"  # attention mostly skipped: routing it pays
    assert cal.predict("routed", 8, 0.9) == pytest.approx(8.0)  # (priced at the larger fraction, it would not)
    assert cal.choose(8, (1.0, 1.0)) == "dense"
    assert cal.choose(8, (1.0, 0.2)) == "routed-mlp"  # every row attends: route the MLP only
    assert cal.choose(1, (0.0, 0.0)) == "dense"
    with pytest.raises(TypeError):
        synthetic_calibration().predict("routed", 8, (0.2, 0.9))  # a whole-layer table reads one fraction


def test_the_chooser_reads_both_sublayers_counts_on_the_host_and_from_the_device():
    from test_cost import LandingEvent

    chooser = cost.Chooser(sublayer_table(), expected=1.0)
    assert chooser.width == 2 and chooser.plan((1, 8)) == {1: "dense", 8: "dense"}  # (1, 1) planned
    assert chooser.choose(10, (2, 9)) == "routed"  # host counts (attention RUN, MLP RUN)
    assert chooser.choose(10, torch.tensor([10, 2])) == "routed-mlp"  # a CPU tensor: read directly
    with pytest.raises(ValueError, match=r"1 RUN count\(s\) \(3,\) for a table that reads 2"):
        chooser.choose(10, 3)
    on_device = cost.Chooser(sublayer_table(), expected=1.0, event=LandingEvent)
    LandingEvent.landed = False
    assert on_device.choose(8, torch.tensor([1, 8]), on_host=False) == "dense"  # nothing landed: (1, 1)
    LandingEvent.landed = True
    assert on_device.choose(8, torch.tensor([8, 8]), on_host=False) == "routed"  # the copy of (1, 8) landed
    assert on_device.fraction == {True: (1 / 8, 1.0)}
    on_device.choose(8, torch.tensor([8, 8]), on_host=False)
    assert on_device.fraction[True] == pytest.approx((0.5 * 1 + 0.5 / 8, 1.0))  # an EMA per sublayer


def test_measure_times_the_sublayer_bodies_on_one_layer():
    cal, bench = measure(32, 48, 4, 2, ts=(1, 8), fs=(0.0, 0.5, 1.0), repeats=1, passes=1, progress=False,
                         sublayers=True)
    assert cal.sublayers and cal.key().endswith("|sublayers") and cal.bodies() == ("dense", "routed", "routed-mlp")
    assert all(t > 0 for table in (cal.dense, cal.routed, cal.routed_mlp) for row in table for t in row)
    assert isinstance(bench.bodies["dense"], SublayerDenseBody)
    assert isinstance(bench.bodies["routed"], SublayerRoutedBody) and bench.bodies["routed"].name == "routed"
    assert bench.body.adapter is None and not bench.body.soft
    for phase, T in (("decode", 8), ("prefill", 16)):  # each sublayer's decisions: the cell's RUN rows
        args = bench.inputs(T, 0.5, phase)
        run = args[3].reshape(-1, 2)
        assert run.sum(0).tolist() == [cost.run_rows(T, 0.5)] * 2 and not torch.equal(run[:, 0], run[:, 1])
        if phase == "decode":
            continue  # (a decode step rewrites its cache slot: the bodies are compared on the prefill)
        with torch.no_grad():
            outs = {}
            for name in ("dense", "routed", "routed-mlp"):
                bench.body.body = bench.bodies[name]
                outs[name] = bench.body(*args[:6], **args[6])
        for name in ("routed", "routed-mlp"):
            assert_close(outs[name], outs["dense"], f"{name} vs dense on the bench's inputs")


def test_calibrate_times_sublayers_only_with_the_flag(monkeypatch):
    from vskipper import calibrate

    seen = []
    monkeypatch.setattr(calibrate, "measure", lambda *a, phase, sublayers=False, **k:
                        (seen.append((phase, sublayers)), (sublayer_table(phase) if sublayers
                                                           else synthetic_calibration(), None))[1])
    calibrate.main(["--shape", "40,72"])
    assert seen == [("decode", False), ("prefill", False)]  # a whole-layer calibration times no sublayer body
    calibrate.main(["--shape", "40,72", "--sublayers"])
    assert seen[2:] == [("decode", True), ("prefill", True)]
    assert cost.load("cpu", 40, 72).sublayers is False and cost.load("cpu", 40, 72, sublayers=True).sublayers


@pytest.mark.parametrize("static_shapes", [False, True])
def test_auto_with_sublayer_tables_matches_the_reference_and_routes(static_shapes):
    base = tiny_llama()
    sk = vskipper.RandomSublayerSkip(0.5, 0.6, [0, 2, 5], seed=5)
    save_sublayer_tables()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # sublayer tables and no whole-layer one: nothing to warn about
        m = transformed(base, sk, "auto", static_shapes=static_shapes, check_sync=static_shapes)
    body = m.vskipper.bodies[2]
    assert isinstance(body, AutoBody) and body.chooser.width == 2
    assert set(body.bodies) == {"dense", "routed", "routed-mlp"}  # (fixed shapes: HFAttention's masked form)
    for routed in ("routed", "routed-mlp"):
        assert isinstance(body.bodies[routed], FixedSublayerBody if static_shapes else SublayerRoutedBody)
    text = vskipper.explain(m)
    assert "from the attention's and the MLP's RUN fractions" in text and "float32|sublayers'" in text, text
    assert "dense-masked sublayers" in text and "routed sublayers" in text, text
    assert_batch_matches_reference(m, base, sk, prompts((7, 2, 12, 5)), 8)
    used = chosen_bodies(m, reset=True)
    assert used[routed] > 0, used  # a batch of 4 and its prefill: routed bodies are predicted cheaper
    assert_batch_matches_reference(m, base, sk, prompts((6,)), 8)
    assert chosen_bodies(m)["dense"] > 0  # one sequence: T = 1 decode steps run dense


def test_auto_without_sublayer_tables_runs_dense_and_warns_once():
    base = tiny_llama()
    sk = vskipper.RandomSublayerSkip(0.5, 0.5, [1, 2])
    cost.save(synthetic_calibration())  # a whole-layer table does not price a sublayer skipper
    with pytest.warns(UserWarning, match=r"no sublayer cost calibration for .*runs a sublayer skipper's layers "
                                         r"dense-masked.*vskipper calibrate --shape 40,72 --sublayers"):
        m = transformed(base, sk, "auto")
    assert all(isinstance(b, SublayerDenseBody) for b in m.vskipper.bodies.values())
    assert "does not time sublayer bodies on this device yet, so dense-masked (run `vskipper calibrate --sublayers`)" \
        in vskipper.explain(m)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        transformed(base, sk, "auto")  # warned once per device
    cost.save(sublayer_table())  # a decode table alone: prefill priced by it, and said
    with pytest.warns(UserWarning, match=r"no sublayer prefill cost calibration .*--phase prefill --shape 40,72 "
                                         r"--sublayers"):
        m = transformed(base, sk, "auto")
    assert "no prefill calibration: prefill priced by the decode table" in vskipper.explain(m)


def test_serve_calibrates_sublayer_tables_for_a_sublayer_skipper(monkeypatch, tmp_path):
    from vskipper import calibrate, first_start
    from vskipper.integrations.sglang.settings import Settings

    model = tmp_path / "model"
    model.mkdir()
    cfg = dict(architectures=["LlamaForCausalLM"], hidden_size=40, intermediate_size=72, num_attention_heads=4,
               num_key_value_heads=2, num_hidden_layers=6)
    (model / "config.json").write_text(json.dumps(cfg))
    seen = []

    def fake_measure(*a, phase, sublayers, **k):
        seen.append((phase, sublayers))
        return sublayer_table(phase) if sublayers else dataclasses.replace(synthetic_calibration(), phase=phase), None

    monkeypatch.setattr(calibrate, "measure", fake_measure)
    threads = torch.get_num_threads()  # (the server's: the calibration is kept per thread count)

    def prepare(spec):
        settings = Settings.from_env({"VSKIPPER_SKIPPER": spec} if spec else {})
        return first_start.prepare(["x"], {}, settings, str(model), True, threads, False, log=lambda m: None)

    line = prepare("random:attn_rate=0.5,mlp_rate=0.5,layers=1-3")
    assert seen == [("decode", True), ("prefill", True)] and "measured now" in line, line
    assert "bodies chosen by the cost model" in prepare("random:attn_rate=0.5,layers=1") and len(seen) == 2  # reused
    prepare("random:rate=0.5,layers=1")
    assert seen[2:] == [("decode", False), ("prefill", False)]  # a whole-layer skipper: whole-layer tables
    cfg.update(architectures=["SkipGPTLlamaForCausalLM"], skipgpt={"layers": [1, 3]})
    (model / "config.json").write_text(json.dumps(cfg))
    line = prepare(None)  # a SkipGPT checkpoint: its own sublayer skipper, priced by the tables above
    assert "its own SkipGPT skipper on layers 1-3" in line and "reused" in line and len(seen) == 4, line
