"""Two captured forms per batch size and the host's choice of which to replay (vskipper/replay.py), and
SGLang's decode graph runner hooks that use it (integrations/sglang/graphs.py), on CPU: the choice
against the calibration's V*, the EMA of the route counts (copied without a read on the device: a
stand-in event), lockstep over ranks, both forms computing the reference's function."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from test_cost_context import context_table, vstar

import vskipper
from vskipper import cost, replay
from vskipper.replay import ReplayChooser, forced, replay_form
from vskipper.routed_layer import AutoBody

from helpers import assert_batch_matches_reference, prompts
from tiny import tiny_llama, transformed


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VSKIPPER_CACHE", str(tmp_path / "cache"))
    cost._warned.clear()


class Event:
    """A stand-in for torch.cuda.Event: `done` says whether the copy recorded last has landed."""

    done = True
    made: list = []

    def __init__(self) -> None:
        self.recorded = self.waited = 0
        Event.made.append(self)

    def record(self) -> None:
        self.recorded += 1

    def query(self) -> bool:
        return Event.done

    def synchronize(self) -> None:
        self.waited += 1


def test_the_form_follows_v_star_with_hysteresis():
    cal = context_table()
    v = vstar(8, 0.5)
    assert replay_form(cal, 8, int(0.8 * v), 0.5) == "dense"
    assert replay_form(cal, 8, int(1.25 * v), 0.5) == "routed"
    assert replay_form(cal, 8, None, 0.5) == "dense"  # unknown: the smallest context, below V*
    assert replay_form(cal, 8, int(1.25 * v), 1.0) == "dense"  # every row runs: routing never pays
    # a padded step: 8 captured rows, 4 real ones holding the K/V; the context per row is the real rows'
    assert replay_form(cal, 8, int(0.6 * v), 0.5, rows=4) == "routed"
    assert replay_form(cal, 8, int(0.6 * v), 0.5) == "dense"
    # hysteresis: just past V*, the form replayed last stays unless the other is cheaper by the margin
    assert replay_form(cal, 8, int(1.01 * v), 0.5, current="dense") == "dense"
    assert replay_form(cal, 8, int(1.01 * v), 0.5, current="routed") == "routed"
    assert replay_form(cal, 8, int(0.99 * v), 0.5, current="routed") == "routed"
    assert replay_form(cal, 8, int(0.99 * v), 0.5, routed="routed-mlp") == "dense"
    with pytest.raises(ValueError, match="current='auto' is not one of"):
        replay_form(cal, 8, 1000, 0.5, current="auto")
    with pytest.raises(ValueError, match="a 'prefill' table"):
        ReplayChooser(context_table(phase="prefill"))


def auto_model(static_shapes=True, layers=(1, 3, 4)):
    cost.save(context_table(contexts=(16, 256, 1024, 4096)))
    base = tiny_llama()
    sk = vskipper.RandomSkip(0.5, list(layers), seed=3)
    return base, sk, transformed(base, sk, "auto", static_shapes=static_shapes)


def test_both_forms_compute_the_reference_s_function():
    base, sk, m = auto_model()
    autos = [b for b in m.vskipper.bodies.values() if isinstance(b, AutoBody)]
    assert len(autos) == 3 and all(b.routed_form == "routed" for b in autos)
    for form in replay.FORMS:
        before = [dict(b.chosen) for b in autos]
        with forced(m, form):
            assert all(b.forced == form for b in autos)
            assert_batch_matches_reference(m, base, sk, prompts((7, 2, 12, 5)), 6)
        assert all(b.forced is None for b in autos)  # restored
        ran = [{k: b.chosen[k] - was[k] for k in b.chosen if b.chosen[k] != was[k]} for b, was in zip(autos, before)]
        assert all(list(r) == [form] for r in ran), ran  # every step of every layer ran the forced body
    with pytest.raises(ValueError, match="form 'fast' is not one of"):
        with forced(m, "fast"):
            pass


def test_the_chooser_of_a_model_folds_the_route_counts_into_its_ema():
    base, sk, m = auto_model()
    ch = ReplayChooser.for_model(m)
    assert ch is not None and ch.routed == "routed" and len(ch.counters) == 3 and ch.f() == 0.5
    assert ReplayChooser.for_model(transformed(base, sk, "dense")) is None  # no auto layer: one form
    ids = torch.randint(1, 100, (8, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = m(ids, use_cache=True)
        cache = out.past_key_values
        ch.observe()  # the first fold only sets the baseline (the prefill's counts are not decode counts)
        assert ch.fraction is None
        nxt = ids[:, -1:]
        for _ in range(3):
            cache = m(nxt, past_key_values=cache, use_cache=True).past_key_values
            ch.observe()
    st = vskipper.stats(m)
    seen = sum(st[l]["decode_run"] for l in st) / sum(st[l]["decode_tokens"] for l in st)
    assert ch.fraction is not None and 0 < ch.f() < 1
    assert ch.f() == pytest.approx(seen, abs=0.2)  # an EMA of the steps' fractions, around their mean
    # the choice reads the EMA: at the fraction it holds, the form V* says at this resident K/V
    ch.current.clear()
    ch.fraction = (0.5,)
    v = vstar(8, 0.5)
    assert ch.choose(8, int(0.7 * v)) == "dense" and ch.choose(8, int(1.5 * v)) == "routed"
    ch.ran("routed")
    assert ch.replays == {"dense": 0, "routed": 1}
    assert all(b.chosen["routed"] >= 1 for b in ch.bodies)
    assert "resident K/V" in ch.describe()


def test_counts_are_read_only_once_their_copy_has_landed():
    """On a device the copy is non-blocking: a fold reads the copy that has landed, never waits."""
    base, sk, m = auto_model()
    ch = ReplayChooser.for_model(m, event=Event)
    counters = ch.counters
    Event.made.clear()
    Event.done = False
    for c in counters:
        c.counts[1] = torch.tensor([8, 4, 0])  # one decode step of 8 rows, 4 RUN
    ch.observe()
    ch.observe()  # not landed: nothing folded
    assert ch.fraction is None and all(e.waited == 0 for e in Event.made)
    Event.done = True
    ch.observe()  # lands: the baseline
    for c in counters:
        c.counts[1] += torch.tensor([8, 2, 0])  # a step of 8 rows, 2 RUN
    ch.observe()  # reads the copy pushed by the previous call (counts before this step)
    assert ch.fraction is None
    ch.observe()
    assert ch.f() == pytest.approx(2 / 8)
    assert all(e.waited == 0 for e in Event.made)


def test_lockstep_folds_the_step_lag_back_on_every_rank():
    """Under tensor parallelism every rank folds the same step's counts: the one LAG steps back,
    waiting for its copy, so that all ranks replay the same form."""
    ranks = []
    for _ in range(2):
        base, sk, m = auto_model()
        ranks.append(ReplayChooser.for_model(m, lockstep=True, event=Event))
    Event.done = False  # landed or not, lockstep folds by step count
    steps = [(8, 4), (8, 2), (8, 8), (8, 0), (8, 6)]
    history = {id(r): [] for r in ranks}
    for n, (rows, run) in enumerate(steps):
        for r in ranks:
            for c in r.counters:
                c.counts[1] += torch.tensor([rows, run, 0])
            r.observe()
            history[id(r)].append(r.fraction)
    a, b = (history[id(r)] for r in ranks)
    assert a == b  # the same folds on both ranks
    assert a[:replay.LAG + 1] == [None] * (replay.LAG + 1)  # step LAG folds step 0: the baseline
    assert a[replay.LAG + 1] == pytest.approx((steps[1][1] / 8,))  # then step 1's fraction, LAG steps late
    assert all(e.waited for e in Event.made[-2 * (replay.LAG + 1):])


def test_sglang_graph_runner_hooks_capture_both_forms_and_replay_the_chosen_one(monkeypatch):
    from sglang.srt.model_executor.runner.shape_key import ShapeKey

    from vskipper.integrations.sglang import graphs

    monkeypatch.setattr(graphs, "tp_size", lambda: 1)
    base, sk, m = auto_model()
    runner = type("Runner", (), {})()
    runner.model_runner = type("MR", (), {"model": m})()
    runner.capture_bs = [1, 8]
    captured = []

    def make_key(self, size, stream_idx=None, variant_label=None):
        return ShapeKey(size=size, stream_idx=stream_idx, variant_label=variant_label)

    def capture(self, bs, stream_idx=None, variant_label=None):  # SGLang's capture_one_shape: keys its graph
        autos = [b for b in m.vskipper.bodies.values() if isinstance(b, AutoBody)]
        key = graphs.around_make_graph_key(make_key, self, bs, stream_idx, variant_label)
        captured.append((key, {b.forced for b in autos}))

    graphs.around_capture_one_shape(capture, runner, 8, None, "lora")
    assert [(k.size, k.variant_label, f) for k, f in captured] == [(8, "lora|vskipper:dense", {"dense"}),
                                                                  (8, "lora|vskipper:routed", {"routed"})]
    assert all(b.forced is None for b in graphs.forms_of(runner).chooser.bodies)
    assert graphs.with_form(graphs.with_form(ShapeKey(size=8), "dense"), "routed").variant_label == "vskipper:routed"

    v = vstar(8, 0.5)
    for resident, want in ((int(0.7 * v), "dense"), (int(1.5 * v), "routed")):
        batch = type("FB", (), {"batch_size": 8, "seq_lens_sum": resident})()
        runner._replay_graph_key = ShapeKey(size=8)
        graphs.after_load_batch(None, runner, batch)
        assert runner._replay_graph_key.variant_label == f"vskipper:{want}"
        assert graphs.after_execute("logits", runner) == "logits"
    assert graphs.forms_of(runner).chooser.replays == {"dense": 1, "routed": 1}
    assert graphs.resident_tokens(type("FB", (), {"seq_lens_cpu": torch.tensor([3, 4])})()) == 7

    other = type("Runner", (), {"model_runner": type("MR", (), {"model": transformed(base, sk, "dense")})()})()
    seen = []
    graphs.around_capture_one_shape(lambda self, bs: seen.append(bs), other, 4)
    assert seen == [4] and graphs.forms_of(other) is None  # no auto layer: one form, SGLang's own capture
    key = ShapeKey(size=4)
    assert graphs.around_make_graph_key(lambda self, size: key, other, 4) is key


def test_the_hooks_name_sglang_s_graph_runner():
    """The hook targets exist in the SGLang installed (a rename would silently leave every batch size
    with one form)."""
    import pkgutil

    from vskipper.integrations.sglang import graphs

    runner = pkgutil.resolve_name(graphs.RUNNER)
    for target in (graphs.CAPTURE_ONE, graphs.GRAPH_KEY, graphs.LOAD_BATCH, graphs.EXECUTE):
        assert callable(getattr(runner, target.rsplit(".", 1)[1])), target
    assert "variant_label" in {f.name for f in dataclasses.fields(
        pkgutil.resolve_name("sglang.srt.model_executor.runner.shape_key.ShapeKey"))}
