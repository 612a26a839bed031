"""Sublayer skippers (attention and MLP decided separately, SkipGPT-style) against the eager reference."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

import vskipper
from vskipper.reference import reference_forward, reference_generate
from vskipper.skippers.base import SUBLAYERS, Skipper
from vskipper.skippers.random_skip import hash_uniform

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
from tiny import LORA_TARGETS, record_routes, skipgpt_checkpoint, tiny_llama, tiny_qwen3, transformed

FAMILIES = {"llama": tiny_llama, "qwen3": tiny_qwen3}
BODIES = ("dense", "routed", "routed-mlp", "auto")
RATES = {"both": (0.5, 0.5), "attention only": (0.5, 0.0), "mlp only": (0.0, 0.5)}


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """execution="auto" reads this test's own (empty) cache, never the machine's calibrations."""
    monkeypatch.setenv("VSKIPPER_CACHE", str(tmp_path / "cache"))


class ResidualRouter(torch.nn.Module):
    """A float router over the layer's input h, as SkipGPT's: gates [..., 2] = sigmoid(h @ w), NaN for
    token ids divisible by 7 (that sublayer then RUNs)."""

    def __init__(self, hidden: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.proj = torch.nn.Linear(hidden, 2, bias=False)
        torch.nn.init.normal_(self.proj.weight, 0, 3.0)

    def forward(self, h, positions, token_ids):
        g = torch.sigmoid(self.proj(h))  # [..., 2]
        return torch.where((token_ids % 7 == 0).unsqueeze(-1), torch.full_like(g, math.nan), g)


class ResidualSublayerSkip(Skipper):
    def __init__(self, layers, hidden: int) -> None:
        super().__init__(layers, gate="hard", sublayers=SUBLAYERS, router_input="residual")
        self.routers = torch.nn.ModuleDict({str(l): ResidualRouter(hidden, l) for l in self.layers})

    def router(self, layer):
        return self.routers[str(layer)]


def _check_against_reference(base, sk, body, lengths=(5, 11, 1)):
    """Greedy tokens, route decisions and logits of each prompt equal the reference's; returns the
    reference decisions of the last prompt."""
    for p in prompts(lengths):
        m = transformed(base, sk, body)
        calls = record_routes(m)
        out = greedy(m, p[None])[0]
        ref_tokens, ref_dec = reference_generate(base, sk, p, NEW_TOKENS)
        for l in sk.layers:
            assert_equal(fast_decisions(calls, l), ref_dec[l], f"route decisions, layer {l}")
        assert_equal(out, ref_tokens, f"greedy tokens ({len(p)}-token prompt)")
        with torch.no_grad():
            logits = m(ref_tokens[None]).logits[0]
        assert_close(logits, reference_forward(base, sk, ref_tokens)[0], "logits")
    return ref_dec


@pytest.mark.parametrize("family, rates", [("llama", "both"), ("qwen3", "both"), ("llama", "attention only"),
                                           ("qwen3", "mlp only")])
@pytest.mark.parametrize("body", BODIES)
def test_random_sublayers_match_reference(family, body, rates):
    base = FAMILIES[family]()
    attn_rate, mlp_rate = RATES[rates]
    sk = vskipper.RandomSublayerSkip(attn_rate, mlp_rate, [1, 3, 4, 5], seed=2)
    dec = torch.cat(list(_check_against_reference(base, sk, body).values()))  # [n, 2]
    for col, rate in enumerate(RATES[rates]):  # the routes exercised: some skip where the rate says so
        skipped = int((~dec[:, col]).sum())
        assert (0 < skipped < dec.shape[0]) if rate else skipped == 0, (SUBLAYERS[col], skipped, dec.shape)
    with torch.no_grad():  # and skipping changes the model's function
        ids = prompts((9,))[0][None]
        assert not torch.equal(transformed(base, sk, body)(ids).logits, base(ids).logits)


@pytest.mark.parametrize("body", ["dense", "routed", "routed-mlp"])
def test_residual_router_with_nonfinite_gates_matches_reference(body):
    """A float router that reads the layer's input h (router_input "residual"): decisions and tokens
    as the reference; NaN gates RUN that sublayer and are counted."""
    base = tiny_llama()
    sk = ResidualSublayerSkip([0, 2, 5], base.config.hidden_size)
    dec = torch.cat(list(_check_against_reference(base, sk, body, (12, 3)).values()))
    assert 0 < int((~dec).sum()) < dec.numel()
    m = transformed(base, sk, body)
    ids = torch.tensor([[7, 14, 3, 5, 21, 9, 70, 11]])
    with torch.no_grad():
        m(ids)
    for l, s in vskipper.stats(m).items():
        assert s["nonfinite"] == 4 and s["tokens"] == 8, (l, s)
        assert s["attention_run"] >= 4 and s["mlp_run"] >= 4, (l, s)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("body", ["dense", "routed", "routed-mlp"])
def test_sublayers_match_reference_padded_batch(family, body):
    base = FAMILIES[family]()
    sk = vskipper.RandomSublayerSkip(0.4, 0.6, [0, 2, 5], seed=5)
    seqs = prompts((7, 2, 12, 5))
    m = transformed(base, sk, body)
    assert_batch_matches_reference(m, base, sk, seqs)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("body", BODIES)
def test_rates_zero_is_the_base_model(family, body):
    base = FAMILIES[family]()
    m = transformed(base, vskipper.parse_skipper("random:attn_rate=0,mlp_rate=0,layers=1,2,4"), body)
    ids, mask = left_pad(prompts())
    valid = mask.bool()
    with torch.no_grad():
        assert_equal(m(ids, attention_mask=mask).logits[valid], base(ids, attention_mask=mask).logits[valid], "logits")
    assert_equal(greedy(m, ids, mask, 12), greedy(base, ids, mask, 12), "greedy tokens")
    st = vskipper.stats(m)
    assert all(s["attention_run"] == s["mlp_run"] == s["tokens"] > 0 for s in st.values()), st


def test_stats_count_each_sublayer_as_the_reference_decides():
    base = tiny_llama()
    sk = vskipper.RandomSublayerSkip(0.3, 0.6, [1, 4], seed=1)
    m = transformed(base, sk, "routed")
    with torch.no_grad():
        for p in prompts((6, 13)):
            m(p[None])
    st = vskipper.stats(m, reset=True)
    for l in sk.layers:
        dec = torch.cat([reference_forward(base, sk, p)[1][l] for p in prompts((6, 13))])  # [19, 2]
        want = dict(tokens=19, attention_run=int(dec[:, 0].sum()), attention_skip=int((~dec[:, 0]).sum()),
                    mlp_run=int(dec[:, 1].sum()), mlp_skip=int((~dec[:, 1]).sum()), run=int(dec.sum()),
                    project=int((~dec).sum()), nonfinite=0)
        # forwards over whole prompts: every token counted as prefill, none as decode
        assert st[l] == want | {f"prefill_{k}": v for k, v in want.items()} | {f"decode_{k}": 0 for k in want}, st[l]
    assert all(s["tokens"] == 0 for s in vskipper.stats(m).values())


def test_random_sublayer_rates_are_independent():
    pos, ids = torch.arange(20000), torch.randint(0, 50000, (20000,))
    run = vskipper.RandomSublayerSkip(0.3, 0.6, [3], seed=9).router(3)(None, pos, ids)  # [T, 2] bool
    assert run.dtype == torch.bool and run.shape == (20000, 2)
    skip = (~run).float()
    assert abs(skip[:, 0].mean() - 0.3) < 0.02 and abs(skip[:, 1].mean() - 0.6) < 0.02
    assert abs((skip[:, 0] * skip[:, 1]).mean() - 0.18) < 0.02  # independent columns
    assert_equal(run[:, 0], hash_uniform(9, 3, pos, ids) >= 0.3, "attention: RandomSkip's own decisions")


def test_explain_names_the_sublayer_bodies():
    base = tiny_llama()
    sk = vskipper.RandomSublayerSkip(0.5, 0.5, [1, 2])
    for body, what in (("dense", "dense-masked sublayers"), ("routed", "routed sublayers"),
                       ("routed-mlp", "routed-mlp sublayers")):
        text = vskipper.explain(transformed(base, sk, body))
        assert "RandomSublayerSkip(attn_rate=0.5, mlp_rate=0.5" in text and f"layers 1-2: {what}" in text, text
    text = vskipper.explain(transformed(base, sk, "routed", static_shapes=True))
    assert "layers 1-2: routed sublayers (attention for its rows, the MLP for its rows), " \
           "fixed shapes (torch ops; no host sync)" in text and "no fixed-shape masked" not in text, text
    assert "does not time sublayer bodies" in vskipper.explain(transformed(base, sk, "auto"))


TRITON_RUNS = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("body, impl", [("routed", "torch"), ("routed-mlp", "torch"),
                                        pytest.param("routed", "triton", marks=pytest.mark.skipif(
                                            not TRITON_RUNS, reason="Triton needs CUDA or TRITON_INTERPRET=1"))])
def test_fixed_shape_sublayer_body_matches_reference_without_host_sync(family, body, impl):
    """The graph-safe form: fixed shapes, the MLP's rows from route maps of its own decisions, grouped
    SwiGLU, no host sync at decode (guarded); padded batches, greedy tokens and routes as the reference;
    in vskipper's torch ops and its Triton kernels (route maps, grouped SwiGLU; interpreted on CPU)."""
    base = FAMILIES[family]()
    sk = vskipper.RandomSublayerSkip(0.4, 0.6, [1, 3, 4], seed=7)
    seqs = prompts((6, 3, 9))
    m = transformed(base, sk, body, static_shapes=True, check_sync=True, impl=impl)  # decode steps are guarded
    assert f"{impl} ops" in vskipper.explain(m)
    maps = [n for n in m.vskipper.graphs[0].graph.nodes if n.meta.get("vskipper", {}).get("role") == "route_maps"]
    assert len(maps) == 3 and all(n.args[0].target is torch.select and n.args[0].args[1:] == (-1, 1) for n in maps)
    assert_batch_matches_reference(m, base, sk, seqs, 12)


# --- specs and the contract: bad input refused with its message ---------------------------------
def test_sublayer_spec_strings():
    sk = vskipper.parse_skipper("random:attn_rate=0.5,mlp_rate=0.25,layers=1-3,seed=4")
    assert isinstance(sk, vskipper.RandomSublayerSkip) and sk.sublayers == ("attention", "mlp")
    assert (sk.attn_rate, sk.mlp_rate, sk.layers, sk.seed) == (0.5, 0.25, (1, 2, 3), 4)
    assert (vskipper.parse_skipper("random:attn_rate=0.5,layers=2").mlp_rate,
            vskipper.parse_skipper("random:mlp_rate=0.5,layers=2").attn_rate) == (0.0, 0.0)
    assert vskipper.parse_skipper("random:rate=0.5,layers=2").sublayers == ()


@pytest.mark.parametrize("spec, msg", [
    ("random:attn_rate=x,layers=1", "attn_rate='x' is not a number"),
    ("random:attn_rate=0.5,mlp_rate=1.5,layers=1", r"mlp_rate=1.5 must be a number in \[0, 1\]"),
    ("random:attn_rate=nan,layers=1", r"attn_rate=nan must be a number in \[0, 1\]"),
    ("random:rate=0.5,attn_rate=0.5,layers=1", "rate= .* and attn_rate= .* cannot both be given"),
    ("random:layers=1", "random needs rate= .* or attn_rate=/mlp_rate="),
    ("random:mlp_rate=0.5,mlp_rate=0.1,layers=1", "field 'mlp_rate' given twice"),
    ("random:attn_rate=0.5,layers=1,seed=-1", "seed=-1 must be an integer >= 0"),
    ("random:attn_rate=0.5", r"missing field\(s\) \['layers'\]"),
    ("random:attn_rates=0.5,layers=1", "unknown field 'attn_rates'"),
])
def test_bad_sublayer_specs(spec, msg):
    with pytest.raises(ValueError, match=msg) as e:
        vskipper.parse_skipper(spec)
    assert "skipper spec" in str(e.value)


@pytest.mark.parametrize("kw, msg", [
    (dict(sublayers=("mlp",)), r"sublayers=\('mlp',\) must be \(\) .* or \('attention', 'mlp'\)"),
    (dict(sublayers=("attention", "mlp", "mlp")), "sublayers=.* must be"),
    (dict(sublayers=3), r"sublayers=\(3,\) must be"),
    (dict(sublayers=SUBLAYERS, gate="soft"), "a sublayer skipper is hard-gated"),
    (dict(router_input="hidden"), r"router_input='hidden' is not one of \['normed', 'residual'\]"),
])
def test_bad_sublayer_contract(kw, msg):
    with pytest.raises(ValueError, match=msg):
        Skipper([1], **{"gate": "hard", **kw})


def test_a_sublayer_skipper_with_an_adapter_is_refused():
    class WithAdapter(ResidualSublayerSkip):
        def adapter(self, layer):
            return torch.nn.Identity()

    base = tiny_llama()
    with pytest.raises(ValueError, match=r"WithAdapter: a sublayer skipper has no adapter .* adapter\(1\) is a module"):
        vskipper.transform(base, WithAdapter([1], base.config.hidden_size))


def test_inputs_embeds_with_random_sublayers_is_refused():
    m = transformed(tiny_llama(), vskipper.RandomSublayerSkip(0.5, 0.5, [1]), "dense")
    with pytest.raises(ValueError, match="RandomSkip needs token ids and positions"):
        m(inputs_embeds=torch.randn(1, 3, 40))


# --- SkipGPT checkpoints ------------------------------------------------------------------------
_skipgpt_checkpoint = skipgpt_checkpoint


@pytest.mark.parametrize("body", ["dense", "routed"])
def test_skipgpt_checkpoint_with_lora_matches_reference(tmp_path, body):
    base = tiny_llama()
    merged, sk = _skipgpt_checkpoint(tmp_path / "ckpt", base)
    m = vskipper.from_pretrained(tmp_path / "ckpt", vskipper.Config(execution=body))
    assert isinstance(m.vskipper.skipper, vskipper.SkipGPT) and m.vskipper.skipper.layers == tuple(range(6))
    calls = record_routes(m)
    for p in prompts((5, 11)):
        for v in calls.values():
            v.clear()
        out = greedy(m, p[None])[0]
        ref_tokens, ref_dec = reference_generate(merged, sk, p, NEW_TOKENS)
        for l in sk.layers:
            assert_equal(fast_decisions(calls, l), ref_dec[l], f"route decisions, layer {l}")
        assert_equal(out, ref_tokens, "greedy tokens")
    dec = torch.cat(list(ref_dec.values()))
    assert 0 < int((~dec[:, 0]).sum()) < len(dec) and 0 < int((~dec[:, 1]).sum()) < len(dec), dec.float().mean(0)


def test_skipgpt_lora_is_merged_as_peft_applies_it(tmp_path):
    """The merged weight computes what PEFT's unmerged LoRA layer does at evaluation:
    x W^T + (alpha / r) (x A^T) B^T; and the router's gates are SkipGPT's formula."""
    from safetensors.torch import load_file

    base = tiny_llama()
    _skipgpt_checkpoint(tmp_path / "ckpt", base, lora=(4, 8.0))
    t = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    m = vskipper.from_pretrained(tmp_path / "ckpt")
    x = torch.randn(7, base.config.hidden_size)
    pre = "base_model.model.model.layers.2.block."
    for target in LORA_TARGETS:
        w, a, b = (t[f"{pre}{target}.{k}"] for k in ("base_layer.weight", "lora_A.default.weight",
                                                     "lora_B.default.weight"))
        with torch.no_grad():
            assert_close(m.model.layers[2].get_submodule(target)(x), x @ w.T + 2.0 * (x @ a.T) @ b.T, target)
    assert_equal(m.model.layers[2].self_attn.k_proj.weight, t[pre + "self_attn.k_proj.weight"], "k_proj untouched")
    r = "base_model.model.model.layers.2.router_mlp."
    logits = torch.relu(x @ t[r + "hidden_layer.weight"].T + t[r + "hidden_layer.bias"]) @ \
        t[r + "weight_predictor.weight"].T + t[r + "weight_predictor.bias"]
    logits[0] = torch.tensor([1.5, 1.5])  # a tie: argmax picks "execute"
    with torch.no_grad():
        router = m.vskipper.skipper.router(2).router_mlp
        d = router(x)[1:]
        assert_equal(d, logits[1:, 0] >= logits[1:, 1], "MLP decisions: SkipGPT's argmax")
        assert 0 < int(d.sum()) < len(d), d  # both decisions occur
        router.logits = lambda h: torch.tensor([[1.5, 1.5], [math.nan, 0.0], [-1.0, 0.0]])
        assert router(x).tolist() == [True, True, False]  # a tie RUNs, a NaN RUNs


def test_skipgpt_routers_stay_float32_in_a_bf16_model(tmp_path):
    """SkipGPT runs its routers in fp32 on a bf16 model (inputs to fp32, logits back to bf16): so do we."""
    base = tiny_llama()
    _skipgpt_checkpoint(tmp_path / "ckpt", base)
    m = vskipper.from_pretrained(tmp_path / "ckpt", vskipper.Config(execution="routed"), dtype=torch.bfloat16)
    assert m.model.embed_tokens.weight.dtype == torch.bfloat16
    assert {p.dtype for p in m.vskipper.skipper.parameters()} == {torch.float32}
    with torch.no_grad():
        h = torch.randn(3, 40, dtype=torch.bfloat16)
        tr = m.vskipper.skipper.router(1).router_attention
        expected = tr.weight_predictor(torch.relu(tr.hidden_layer(h.float()))).to(torch.bfloat16)
        assert_equal(tr(h), ~(expected[:, 1] > expected[:, 0]), "decisions from bf16 logits of fp32 routers")
        out = greedy(m, prompts((6,))[0][None], n=4)
    assert out.shape == (1, 10) and sum(s["tokens"] for s in vskipper.stats(m).values()) > 0


def test_skipgpt_router_only_checkpoint_some_layers(tmp_path):
    """SkipGPT's first stage (routers only, no PEFT prefix, no LoRA), routing layers 1 and 3."""
    base = tiny_llama()
    merged, sk = _skipgpt_checkpoint(tmp_path / "ckpt", base, layers=[3, 1], lora=None, peft=False)
    m = vskipper.from_pretrained(tmp_path / "ckpt", vskipper.Config(execution="routed"))
    assert m.vskipper.skipper.layers == (1, 3)
    p = prompts((9,))[0]
    assert_equal(greedy(m, p[None])[0], reference_generate(base, sk, p, NEW_TOKENS)[0], "greedy tokens")


@pytest.mark.parametrize("edit, msg", [
    (lambda cfg, t: t.pop("model.layers.1.router_mlp.weight_predictor.bias"),
     r"missing router tensor 'model.layers.1.router_mlp.weight_predictor.bias' \(expected shape \[2\]\)"),
    (lambda cfg, t: t.update({"model.layers.1.router_attention.hidden_layer.weight": torch.zeros(3, 40)}),
     r"router tensor 'model.layers.1.router_attention.hidden_layer.weight' has shape \[3, 40\], expected \[10, 40\]"),
    (lambda cfg, t: cfg["skipgpt"].pop("lora"), r"LoRA tensors for .* but config.json has no skipgpt.lora"),
    (lambda cfg, t: cfg["skipgpt"].update(lora={"r": 4}), r"skipgpt.lora=\{'r': 4\} must be"),
    (lambda cfg, t: cfg["skipgpt"]["lora"].update(r=5), r"lora_A \[4, 40\], lora_B \[.*\] do not fit .* at r=5"),
    (lambda cfg, t: t.pop("model.layers.0.block.self_attn.q_proj.lora_B.default.weight"),
     r"LoRA module 'model.layers.0.self_attn.q_proj' has no lora_B weight"),
    (lambda cfg, t: cfg["skipgpt"].update(layers=[1, 9]), r"routed layer indices \[9\] are out of range"),
    (lambda cfg, t: cfg["skipgpt"].update(layers=[1]), "router weights for layer 0, which skipgpt.layers does not"),
    (lambda cfg, t: cfg["skipgpt"].update(depth=3), "skipgpt.depth is not a field"),
    (lambda cfg, t: cfg.update(architectures=["SkipGPTLlama"]), "architectures=.* expected"),
])
def test_bad_skipgpt_checkpoints(tmp_path, edit, msg):
    from vskipper.models.checkpoint import load_tensors, save_tensors
    from vskipper.skippers.skipgpt import load_skipgpt

    d = tmp_path / "ckpt"
    _skipgpt_checkpoint(d, tiny_llama(), peft=False)
    cfg, t = json.loads((d / "config.json").read_text()), load_tensors(d)
    edit(cfg, t)
    (d / "config.json").write_text(json.dumps(cfg))
    save_tensors(t, d / "model.safetensors")
    with pytest.raises(ValueError, match=msg):
        load_skipgpt(d)


def test_pickled_skipgpt_weights_are_refused(tmp_path):
    d = tmp_path / "ckpt"
    _skipgpt_checkpoint(d, tiny_llama())
    (d / "model.safetensors").rename(d / "model.pth")
    with pytest.raises(ValueError, match=r"holds only pickled weights \['model.pth'\]; vskipper loads safetensors"):
        vskipper.from_pretrained(d)


def test_request_cap_forces_both_sublayers_and_counts_sublayer_decisions():
    """A budget counts layers: at a layer past a row's budget both its sublayers RUN; the per-budget
    counts are sublayer decisions (two per row), forced rows once each, padding never."""
    from vskipper.control import RequestCap

    run = torch.tensor([[False, False], [True, False], [False, True], [False, False], [False, False]])
    valid = torch.tensor([True, True, True, True, False])
    budget = torch.tensor([4, 0, 2, 1, 0], dtype=torch.int32)  # default, no_skip, capped, capped, padding
    cap = RequestCap(1, 4, sublayers=True)  # the second-shallowest of 4 routed layers
    g, run2, bad = cap((run, run, None), valid, budget)
    assert run2.tolist() == [[False, False], [True, True], [False, True], [True, True], [True, True]]
    assert g.tolist() == run2.tolist() and bad is None
    c = cap.counts.tolist()  # per budget: tokens, run, project, forced
    assert c[0] == [1, 2, 0, 1] and c[1] == [1, 2, 0, 1] and c[2] == [1, 1, 1, 0] and c[4] == [0, 0, 0, 0], c
