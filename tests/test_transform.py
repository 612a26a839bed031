"""transform() against the untransformed model and against the eager reference."""
from __future__ import annotations

import os

import pytest
import torch

import vskipper
from vskipper.reference import reference_forward, reference_generate

from helpers import (
    NEW_TOKENS,
    assert_batch_matches_reference,
    assert_close,
    assert_equal,
    fast_decisions,
    greedy,
    left_pad,
    prompts,
)
from tiny import flexidepth_for, record_routes, synthetic_calibration, tiny_llama, tiny_qwen3, transformed

FAMILIES = {"llama": (tiny_llama, "soft"), "qwen3": (tiny_qwen3, "hard")}
BODIES = ("dense", "routed", "routed-mlp", "auto")


@pytest.fixture(autouse=True)
def _own_calibration(tmp_path, monkeypatch):
    """execution="auto" reads this test's own calibration (both bodies in use), never the machine's."""
    from vskipper import cost

    monkeypatch.setenv("VSKIPPER_CACHE", str(tmp_path / "cache"))
    for hidden, inter in ((40, 72), (36, 50)):  # tiny_llama, tiny_qwen3
        cost.save(synthetic_calibration(hidden, inter))


# --- a skipper that skips nothing reproduces the model bit for bit --------------------------
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("body", BODIES)
@pytest.mark.parametrize("kind", ["random0", "flexidepth_all_run"])
def test_skipping_nothing_is_the_base_model(family, body, kind):
    base = FAMILIES[family][0]()
    layers = [1, 2, 4]
    if kind == "random0":
        sk = vskipper.RandomSkip(0.0, layers)
    else:  # every gate is above the threshold, hard gate: every token runs every layer
        sk = flexidepth_for(base, layers, gate="hard", threshold=0.0)
    m = transformed(base, sk, body)
    ids, mask = left_pad(prompts())
    valid = mask.bool()  # padding rows pass through routed layers unchanged, so only real tokens compare
    with torch.no_grad():
        assert_equal(m(ids, attention_mask=mask).logits[valid], base(ids, attention_mask=mask).logits[valid], "logits")
        assert_equal(m(ids[:1, -5:]).logits, base(ids[:1, -5:]).logits, "logits, unpadded")
    assert_equal(greedy(m, ids, mask, 12), greedy(base, ids, mask, 12), "greedy tokens")
    st = vskipper.stats(m)
    assert all(s["project"] == 0 and s["run"] == s["tokens"] > 0 for s in st.values()), st


@pytest.mark.parametrize("body", ["routed", "routed-mlp"])
def test_a_step_where_every_row_runs_is_the_engine_layer(body, monkeypatch):
    """When every row of a step runs, the routed bodies run the decoder layer as the engine computes
    it: the engine's attention for all rows, no gathers (their row-subset attention never called)."""
    from vskipper.engines.hf import HFAttention

    subset = []
    attend_rows = HFAttention.attend_rows
    monkeypatch.setattr(HFAttention, "attend_rows", lambda self, x, rows, ctx: subset.append(rows.numel())
                        or attend_rows(self, x, rows, ctx))
    base = tiny_llama()
    m = transformed(base, vskipper.RandomSkip(0.0, [1, 2, 4]), body)
    ids = prompts((9,))[0][None]
    with torch.no_grad():
        assert_equal(m(ids).logits, base(ids).logits, "logits")
        out = m.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert_equal(out, base.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0), "greedy tokens")
    assert subset == [], f"the row-subset attention ran for {subset} rows"


# --- a real skipper matches the eager reference ---------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("body", BODIES)
def test_flexidepth_matches_reference_single_prompts(family, body):
    make, gate = FAMILIES[family]
    base = make()
    sk = flexidepth_for(base, [1, 3, 4, 5], gate=gate)
    for p in prompts():
        m = transformed(base, sk, body)
        calls = record_routes(m)
        out = greedy(m, p[None])[0]
        ref_tokens, ref_dec = reference_generate(base, sk, p, NEW_TOKENS)
        for l in sk.layers:
            assert_equal(fast_decisions(calls, l), ref_dec[l], f"route decisions, layer {l}")
        assert_equal(out, ref_tokens, f"greedy tokens ({len(p)}-token prompt)")
        assert 0 < sum(int(d.sum()) for d in ref_dec.values()) < sum(d.numel() for d in ref_dec.values())
        with torch.no_grad():
            logits = m(ref_tokens[None]).logits[0]
        assert_close(logits, reference_forward(base, sk, ref_tokens)[0], "logits")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("body", ["dense", "routed", "routed-mlp"])
def test_flexidepth_matches_reference_padded_batch(family, body):
    make, gate = FAMILIES[family]
    base = make()
    sk = flexidepth_for(base, [0, 2, 5], gate=gate)
    seqs = prompts((7, 2, 12, 5))
    m = transformed(base, sk, body)
    assert_batch_matches_reference(m, base, sk, seqs)


def test_dense_and_routed_agree_on_logits():
    base = tiny_llama()
    sk = flexidepth_for(base, [1, 2, 3, 4], gate="soft")
    ids, mask = left_pad(prompts((9, 4, 13)))
    with torch.no_grad():
        d = transformed(base, sk, "dense")(ids, attention_mask=mask).logits
        r = transformed(base, sk, "routed")(ids, attention_mask=mask).logits
    valid = mask.bool()
    assert_close(r[valid], d[valid], "routed vs dense logits")


def test_decode_attention_runs_over_the_cache_in_place_per_run_of_rows():
    from vskipper.engines.hf import _runs

    assert _runs([]) == [] and _runs([4]) == [(4, 5)]
    assert _runs([0, 1, 2, 5, 7, 8]) == [(0, 3), (5, 6), (7, 9)]
    base = tiny_llama()  # a decode batch whose RUN rows form several runs, with a per-row padding mask
    sk = vskipper.RandomSkip(0.5, [1, 2, 3, 4], seed=1)
    ids, mask = left_pad(prompts((9, 4, 13, 2, 6, 8, 3, 11)))
    dense, routed = (greedy(transformed(base, sk, body), ids, mask, 8) for body in ("dense", "routed"))
    assert_equal(routed, dense, "greedy tokens, routed vs dense")


def test_the_routed_mlp_of_7_to_15_cpu_rows_runs_as_16():
    from vskipper.routed_layer import _mlp_rows

    mlp = tiny_llama().model.layers[0].mlp
    seen = []
    mlp.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[0]))
    y = torch.randn(10, mlp.gate_proj.in_features)
    with torch.no_grad():
        assert_close(_mlp_rows(mlp, y, 20), mlp(y), "10 of 20 rows, padded to 16")
        _mlp_rows(mlp, y, 12)  # the batch has fewer than 16 rows: as they are
        _mlp_rows(mlp, y[:6], 20)  # 6 rows: the small path is the cheaper one
    assert seen == [16, 10, 10, 6]


def test_pass_rewrites_every_routed_layer_and_tags_nodes():
    base = tiny_llama()
    m = transformed(base, vskipper.RandomSkip(0.5, [0, 3, 5]), "routed")
    assert m.vskipper.rewritten == [0, 3, 5]
    gm = m.vskipper.graphs[0]
    roles = [(n.meta["vskipper"]["layer"], n.meta["vskipper"]["role"]) for n in gm.graph.nodes if "vskipper" in n.meta]
    for l in (0, 3, 5):
        for role in ("input_norm", "router", "decide", "routed_layer"):
            assert (l, role) in roles
        assert (l, "route_maps") not in roles  # the dynamic body finds its own rows
    fixed = transformed(base, vskipper.RandomSkip(0.5, [0, 3, 5]), "routed", static_shapes=True).vskipper.graphs[0]
    assert {n.meta["vskipper"]["layer"] for n in fixed.graph.nodes
            if n.meta.get("vskipper", {}).get("role") == "route_maps"} == {0, 3, 5}  # the fixed-shape body: maps
    assert [n.target for n in gm.graph.nodes if n.op == "call_module" and n.target.startswith("layers.")
            and n.target.count(".") == 1] == ["layers.1", "layers.2", "layers.4"]
    dense = transformed(base, vskipper.RandomSkip(0.5, [0, 3, 5]), "dense")
    assert not any(n.meta.get("vskipper", {}).get("role") == "route_maps" for n in dense.vskipper.graphs[0].graph.nodes)
    assert {b.name for b in dense.vskipper.bodies.values()} == {"dense"}
    for n in gm.graph.nodes:  # the graph records each routed layer's body
        if n.meta.get("vskipper", {}).get("role") == "routed_layer":
            assert n.meta["vskipper"]["body"] == "routed"


def test_explain_says_what_each_routed_layer_runs_and_why():
    base = tiny_llama()
    sk = vskipper.RandomSkip(0.5, [0, 1, 2, 4])
    text = vskipper.explain(transformed(base, sk, "auto"))
    assert "rewritten 4/4 routed layers" in text
    assert "layers 0-2: auto: dense-masked (every row through attention, MLP and adapter; a mask selects) or " \
           "routed (attention, MLP and adapter for their rows only), dynamic shapes" in text and "layer 4: auto" in text
    assert "calibration 'cpu: " in text
    m = transformed(base, sk, "routed", static_shapes=True)
    assert repr(m.vskipper) == vskipper.explain(m)
    assert "layers 0-2: routed (attention, MLP and adapter for their rows only), fixed shapes (torch ops; no " \
           "host sync; prefill gathered)  [execution='routed', static_shapes=True, impl='torch']" in repr(m.vskipper)
    with pytest.raises(ValueError, match="vskipper.explain: this model was not transformed"):
        vskipper.explain(base)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("execution", ["dense", "routed", "routed-mlp"])
def test_explain_names_the_attention_that_runs(execution, static, monkeypatch):
    """What print(model.vskipper) says a layer runs is what runs: the attention part's methods called
    in a step that skips some rows match the description."""
    from vskipper.engines.hf import HFAttention

    calls = set()
    for name in ("attend_all", "attend_rows", "attend_masked"):
        method = getattr(HFAttention, name)
        monkeypatch.setattr(HFAttention, name, lambda self, *a, _n=name, _m=method: calls.add(_n) or _m(self, *a))
    m = transformed(tiny_llama(), vskipper.RandomSkip(0.5, [1, 2, 4]), execution, static_shapes=static)
    ids, mask = left_pad(prompts((7, 5, 9)))
    greedy(m, ids, mask, 3)
    assert all(0 < s["project"] < s["tokens"] for s in vskipper.stats(m).values())
    text = vskipper.explain(m)
    if "layers 1-2: routed (attention, MLP and adapter for their rows only), fixed shapes" in text:
        assert calls == {"attend_masked", "attend_rows"}, (calls, text)  # decode masked; prefill by its rows
    elif "layers 1-2: routed (attention, MLP and adapter for their rows only)" in text:
        assert calls == {"attend_rows"}, (calls, text)
    else:
        assert ("dense-masked" in text or "routed-mlp (attention for every row" in text) and calls == {"attend_all"}, \
            (calls, text)
    assert ("attend_masked" in calls) == (execution == "routed" and static)


def test_state_dict_keys_of_the_base_model_are_unchanged():
    base = tiny_llama()
    m = transformed(base, vskipper.RandomSkip(0.5, [1]), "routed")
    keys = set(m.state_dict())
    assert set(base.state_dict()) <= keys
    assert keys - set(base.state_dict()) == set()  # RandomSkip has no weights; counters are not persistent


# --- the static (graph-safe) routed body: fixed shapes, device-side counts, no host sync ----
TRITON_RUNS = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("body, impl", [("routed", "torch"), ("routed-mlp", "torch"),
                                        pytest.param("routed", "triton", marks=pytest.mark.skipif(
                                            not TRITON_RUNS, reason="Triton needs CUDA or TRITON_INTERPRET=1"))])
def test_static_body_matches_reference_without_host_sync(family, body, impl):
    """The graph-safe body on transformers: at decode, attention for the RUN rows only over the cache
    (cache_decode_attention: torch form, or the Triton kernel under the interpreter), grouped SwiGLU;
    no host sync at decode (guarded); padded batches' greedy tokens and routes as the reference."""
    make, gate = FAMILIES[family]
    base = make()
    sk = flexidepth_for(base, [1, 3, 4], gate=gate)
    seqs = prompts((6, 3, 9))
    m = transformed(base, sk, body, static_shapes=True, check_sync=True, impl=impl)  # decode steps are guarded
    assert f"{body} (attention" in vskipper.explain(m) and f"{impl} ops" in vskipper.explain(m)
    assert_batch_matches_reference(m, base, sk, seqs, 12)


@pytest.mark.skipif(not TRITON_RUNS, reason="Triton needs CUDA or TRITON_INTERPRET=1")
def test_fixed_shape_triton_random_skip_makes_its_decisions_in_the_route_op():
    """In Triton, RandomSkip's decisions, the maps and the counts are one launch per routed layer
    (ops.route in hash mode: the router is not called), with the reference's tokens and routes."""
    base = tiny_llama()
    sk = vskipper.RandomSkip(0.5, [1, 3, 4], seed=3)
    m = transformed(base, sk, "routed", static_shapes=True, check_sync=True, impl="triton")
    roles = [n.meta["vskipper"]["role"] for n in m.vskipper.graphs[0].graph.nodes if "vskipper" in n.meta]
    assert roles.count("route") == 3 and "router" not in roles and "decide" not in roles, roles
    seqs, n = prompts((6, 3, 9)), 8
    ids, mask = left_pad(seqs)
    out = greedy(m, ids, mask, n)
    runs = dict.fromkeys(sk.layers, 0)
    for b, p in enumerate(seqs):  # no router call to record: the counts must be the reference's decisions'
        ref_tokens, ref_dec = reference_generate(base, sk, p, n)
        assert_equal(out[b, ids.shape[1]:], ref_tokens[len(p):], f"greedy tokens of sequence {b}")
        for l in sk.layers:
            runs[l] += int(ref_dec[l][:len(p) + n - 1].sum())  # the last token is generated, never forwarded
    st = vskipper.stats(m)
    assert {l: st[l]["run"] for l in sk.layers} == runs
    assert all(0 < s["project"] < s["tokens"] for s in st.values())


def test_host_sync_guard_catches_the_dynamic_body():
    from vskipper.guard import HostSyncError

    m = transformed(tiny_llama(), vskipper.RandomSkip(0.5, [2]), "routed", static_shapes=False, check_sync=True)
    with pytest.raises(HostSyncError, match="host sync .* in routed layer 2"):
        greedy(m, prompts((4,))[0][None], None, 3)


def test_verify_pass_checks_the_recorded_body_and_its_maps():
    from vskipper.passes import PassError, VerifyPass
    from vskipper.routed_layer import DenseBody

    m = transformed(tiny_llama(), vskipper.RandomSkip(0.5, [1, 3]), "routed", static_shapes=True)  # given route maps
    gm = m.vskipper.graphs[0]
    verify = VerifyPass(range(6), (1, 3))
    verify(gm)  # as transform left it
    node = next(n for n in gm.graph.nodes if n.target == "routed.3")
    node.meta["vskipper"]["body"] = "dense"
    with pytest.raises(PassError, match=r"pass verify, routed.3: graph records body .*the module runs 'routed'"):
        verify(gm)
    node.meta["vskipper"]["body"] = "dense"
    gm.get_submodule("routed.3").body = DenseBody()  # a dense body handed route maps
    with pytest.raises(PassError, match=r"routed.3: route maps given for body 'dense'"):
        verify(gm)
