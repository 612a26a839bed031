"""Skipper contract, built-ins, spec strings, and bad input."""
from __future__ import annotations

import copy
import math

import pytest
import torch

import vskipper
from vskipper.skippers.random_skip import hash_uniform

from helpers import assert_equal, greedy, left_pad, prompts
from tiny import VOCAB, flexidepth_for, tiny_llama, tiny_qwen3, transformed


def test_random_skip_fraction_matches_rate():
    pos = torch.arange(4000)
    ids = torch.randint(0, 50000, (4000,))
    for rate in (0.1, 0.25, 0.5, 0.9):
        for layer in (0, 17):
            frac = (hash_uniform(7, layer, pos, ids) < rate).float().mean().item()
            assert abs(frac - rate) <= 0.05, (rate, layer, frac)
    # and through a model: stats count what the routers decided
    base = tiny_llama()
    m = transformed(base, vskipper.RandomSkip(0.3, [1, 2, 3, 4]), "routed")
    with torch.no_grad():
        m(torch.randint(1, VOCAB, (8, 100)))
    st = vskipper.stats(m)
    total = sum(s["tokens"] for s in st.values())
    assert total == 4 * 800
    assert abs(sum(s["project"] for s in st.values()) / total - 0.3) <= 0.05


def test_random_skip_is_a_pure_function():
    pos, ids = torch.arange(64), torch.arange(64) * 31
    assert_equal(hash_uniform(3, 5, pos, ids), hash_uniform(3, 5, pos.flip(0), ids.flip(0)).flip(0), "order")
    assert not torch.equal(hash_uniform(3, 5, pos, ids), hash_uniform(4, 5, pos, ids))
    assert not torch.equal(hash_uniform(3, 5, pos, ids), hash_uniform(3, 6, pos, ids))
    u = hash_uniform(0, 0, torch.arange(10**5), torch.zeros(10**5, dtype=torch.long))
    assert 0.0 <= u.min() and u.max() < 1.0


def test_random_skip_router_gives_hash_uniform_decisions_as_bools():
    from vskipper.counters import DECODE, RouteCounter
    from vskipper.skippers.base import sanitize_gate

    pos = torch.cat([torch.arange(3000), torch.tensor([2**31 - 1, 2**32 - 1, -5])])  # big and negative too
    ids = torch.cat([torch.randint(0, 50000, (3000,)), torch.tensor([2**31 - 1, 7, -1])])
    for rate in (0.0, 0.3, 0.5, 1.0):
        sk = vskipper.RandomSkip(rate, [2, 9], seed=4)
        for layer in sk.layers:
            run = sk.router(layer)(torch.zeros(len(pos), 8), pos, ids)
            assert run.dtype == torch.bool
            assert_equal(run, hash_uniform(4, layer, pos, ids) >= rate, f"rate {rate} layer {layer}")
            assert_equal(run, sk.router(layer)(None, pos.int(), ids.int()), "int32 inputs")
    g, run2, nonfinite = sanitize_gate(run, 0.5)  # a router's decisions pass through, nothing non-finite
    assert g is run and run2 is run and nonfinite is None
    counter, valid = RouteCounter(), torch.arange(len(run)) % 3 > 0
    counter(run, valid, None)  # a prefill (a counter's own phase starts there)
    counter.phase.set(DECODE)
    counter(torch.ones(4, dtype=torch.bool), torch.ones(4, dtype=torch.bool), torch.tensor([True, False, False, True]))
    n = int(valid.sum())
    prefill = dict(tokens=n, run=int((run & valid).sum()), project=int((~run & valid).sum()), nonfinite=0)
    decode = dict(tokens=4, run=4, project=0, nonfinite=2)
    assert counter.read() == {k: prefill[k] + decode[k] for k in prefill} | {
        f"prefill_{k}": v for k, v in prefill.items()} | {f"decode_{k}": v for k, v in decode.items()}


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen3])
def test_random_skip_batch_invariant(make):
    base = make()
    seqs = prompts((6, 3, 10))
    sk = vskipper.RandomSkip(0.5, [1, 2, 3, 4, 5], seed=11)
    m = transformed(base, sk, "routed")
    ids, mask = left_pad(seqs)
    batch = greedy(m, ids, mask, 16)
    for b, p in enumerate(seqs):
        alone = greedy(m, p[None], None, 16)[0]
        assert_equal(batch[b, ids.shape[1]:], alone[len(p):], f"sequence {b} alone vs in a batch")
    st = vskipper.stats(m)
    assert all(0 < s["project"] < s["tokens"] for s in st.values())


def test_static_skips_every_token_and_matches_reference():
    from vskipper.reference import reference_generate

    base = tiny_llama()
    sk = vskipper.Static([2, 4])
    m = transformed(base, sk, "routed")
    p = prompts((8,))[0]
    out = greedy(m, p[None])[0]
    ref, dec = reference_generate(base, sk, p, 24)
    assert_equal(out, ref, "tokens")
    assert not any(d.any() for d in dec.values())
    st = vskipper.stats(m)
    assert all(s["run"] == 0 and s["project"] == s["tokens"] > 0 for s in st.values())


def test_stats_counts_and_reset():
    base = tiny_llama()
    m = transformed(base, vskipper.RandomSkip(0.5, [0, 5]), "dense")
    ids, mask = left_pad(prompts((4, 9)))
    with torch.no_grad():
        m(ids, attention_mask=mask)
    st = vskipper.stats(m, reset=True)
    assert set(st) == {0, 5}
    for s in st.values():
        assert s["tokens"] == 13 and s["run"] + s["project"] == 13 and s["nonfinite"] == 0
    assert all(s["tokens"] == 0 for s in vskipper.stats(m).values())


# --- NaN / Inf from a router: documented behaviour -----------------------------------------
class BrokenRouter(torch.nn.Module):
    """Gives NaN on even positions and -Inf on positions divisible by 3, else 0 (skip)."""

    def forward(self, x, positions, token_ids):
        g = torch.zeros(x.shape[:-1], dtype=x.dtype)
        g = torch.where(positions % 3 == 0, torch.full_like(g, -math.inf), g)
        return torch.where(positions % 2 == 0, torch.full_like(g, math.nan), g)


@pytest.mark.parametrize("body", ["dense", "routed"])
def test_nonfinite_router_output_runs_the_layer(body):
    from vskipper.reference import reference_generate

    base = tiny_llama()
    sk = vskipper.RandomSkip(0.0, [2, 3])
    for l in sk.layers:
        sk.routers[str(l)] = BrokenRouter()
    m = transformed(base, sk, body)
    p = prompts((9,))[0]
    out = greedy(m, p[None], None, 6)[0]
    ref, dec = reference_generate(base, sk, p, 6)
    assert_equal(out, ref, "tokens")
    with torch.no_grad():
        assert torch.isfinite(m(out[None]).logits).all()
    st = vskipper.stats(m)
    for l, d in dec.items():
        pos = torch.arange(d.numel())
        assert_equal(d, (pos % 2 == 0) | (pos % 3 == 0), "NaN/Inf rows run, finite 0 rows skip")
        assert st[l]["nonfinite"] > 0 and st[l]["nonfinite"] == st[l]["run"]


# --- bad input: each with its message -----------------------------------------------------
def test_unsupported_model_class():
    with pytest.raises(TypeError,
                       match=r"unsupported model class .*Linear.*supported: .*LlamaForCausalLM.*Qwen3ForCausalLM"):
        vskipper.transform(torch.nn.Linear(2, 2), vskipper.RandomSkip(0.5, [0]))


def test_routed_layer_out_of_range():
    with pytest.raises(ValueError, match=r"routed layer indices \[6, 9\] are out of range .* 6 layers \(valid: 0..5\)"):
        vskipper.transform(tiny_llama(), vskipper.RandomSkip(0.5, [1, 6, 9]))


@pytest.mark.parametrize("rate", [-0.1, 1.5, math.nan, "0.5", True])
def test_rate_outside_unit_interval(rate):
    with pytest.raises(ValueError, match=r"RandomSkip: rate=.* must be a number in \[0, 1\]"):
        vskipper.RandomSkip(rate, [0])


@pytest.mark.parametrize("layers, msg", [([], "layers is empty"), ([1, 1], r"\[1\] appear more than once"),
                                         ([-1], "is not an integer >= 0"), ([1.5], "is not an integer >= 0")])
def test_bad_layer_lists(layers, msg):
    with pytest.raises(ValueError, match=msg):
        vskipper.Static(layers)


def test_bad_config_and_skipper_types():
    with pytest.raises(ValueError, match=r"Config.execution='fast' is not one of 'auto', 'dense', 'routed'"):
        vskipper.Config(execution="fast")
    with pytest.raises(TypeError, match="skipper must be a vskipper.Skipper"):
        vskipper.transform(tiny_llama(), "random:rate=0.5,layers=1")
    with pytest.raises(ValueError, match="gate='medium' is not one of 'soft', 'hard'"):
        vskipper.FlexiDepth([1], hidden_size=40, intermediate_size=72, gate="medium")


def test_transform_twice_is_refused():
    m = vskipper.transform(tiny_llama(), vskipper.RandomSkip(0.5, [1]))
    with pytest.raises(ValueError, match="already transformed"):
        vskipper.transform(m, vskipper.RandomSkip(0.5, [2]))


def test_flexidepth_hidden_size_mismatch():
    sk = vskipper.FlexiDepth([1], hidden_size=64, intermediate_size=72)
    with pytest.raises(ValueError, match="built for hidden_size=64, but the model has hidden_size=40"):
        vskipper.transform(tiny_llama(), sk)


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen3])
def test_empty_batch(make):
    m = vskipper.transform(make(), vskipper.RandomSkip(0.5, [1]))
    for shape in ((0, 4), (2, 0)):
        with pytest.raises(ValueError, match=r"empty batch \(input shape \[.*\]\)"):
            m(torch.zeros(shape, dtype=torch.long))


def test_inputs_embeds_with_a_router_that_needs_token_ids():
    base = tiny_llama()
    m = vskipper.transform(copy.deepcopy(base), vskipper.RandomSkip(0.5, [1]))
    with pytest.raises(ValueError, match="RandomSkip needs token ids"):
        m(inputs_embeds=torch.randn(1, 3, 40))


# --- spec strings -----------------------------------------------------------------------
def test_spec_strings():
    sk = vskipper.parse_skipper("random:rate=0.5,layers=15-17,20,seed=3")
    assert isinstance(sk, vskipper.RandomSkip) and sk.layers == (15, 16, 17, 20) and sk.seed == 3 and sk.rate == 0.5
    assert vskipper.parse_skipper("static:layers=2,4-5").layers == (2, 4, 5)


@pytest.mark.parametrize("spec, msg", [
    ("", "is empty"),
    ("magic:rate=1", "unknown kind 'magic'"),
    ("random:rate=0.5", r"missing field\(s\) \['layers'\]"),
    ("random:rate=x,layers=1", "rate='x' is not a number"),
    ("random:rate=2,layers=1", r"rate=2.0 must be a number in \[0, 1\]"),
    ("random:rate=0.5,layers=3-1", "layers item '3-1' is not an index or an inclusive range"),
    ("random:rate=0.5,layers=1,speed=3", "unknown field 'speed'"),
    ("random:rate=0.5,rate=0.2,layers=1", "field 'rate' given twice"),
    ("random:rate=0.5,layers=1,seed=-2", "seed=-2 must be an integer >= 0"),
    ("random:0.5", "item '0.5' is not key=value"),
    ("flexidepth:path=/nonexistent/dir", "does not exist"),
    ("flexidepth:name=nope", r"no shipped skipper 'nope'; shipped: \['smollm2-135m-flexidepth'\]"),
    ("flexidepth:gate=hard", "exactly one of path=DIR or name=SHIPPED"),
    ("flexidepth:path=/x,name=y", "exactly one of path=DIR or name=SHIPPED"),
])
def test_bad_spec_strings(spec, msg):
    with pytest.raises(ValueError, match=msg) as e:
        vskipper.parse_skipper(spec)
    assert "skipper spec" in str(e.value)


def test_flexidepth_threshold_moves_its_decisions_and_only_its():
    """threshold= in a flexidepth spec: a token RUNs a layer when g > threshold; a higher threshold
    runs more tokens, the same gates (the router is not touched)."""
    sk = vskipper.parse_skipper("flexidepth:name=smollm2-135m-flexidepth,threshold=0.7")
    assert sk.threshold == 0.7 and vskipper.parse_skipper("flexidepth:name=smollm2-135m-flexidepth").threshold == 0.5
    base = tiny_llama()
    runs = {}
    for t in (0.3, 0.5, 0.7):
        m = transformed(base, flexidepth_for(base, [1, 2, 4], gate="hard", head_scale=2.0, threshold=t), "routed")
        ids, mask = left_pad(prompts((9, 6)))
        greedy(m, ids, mask, 4)
        runs[t] = sum(s["run"] for s in vskipper.stats(m).values())
    assert runs[0.3] > runs[0.5] > runs[0.7], runs
    for bad in ("x", "1.5"):
        with pytest.raises(ValueError, match="threshold"):
            vskipper.parse_skipper(f"flexidepth:name=smollm2-135m-flexidepth,threshold={bad}")


def test_shipped_skipper_by_name():
    sk = vskipper.parse_skipper("flexidepth:name=smollm2-135m-flexidepth")
    assert isinstance(sk, vskipper.FlexiDepth) and list(sk.layers) == list(range(15, 30)) and sk.gate == "hard"
