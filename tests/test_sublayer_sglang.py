"""Sublayer skippers (attention and MLP decided apart, SkipGPT-style) inside real SGLang 0.5.23 on CPU:
a SkipGPT-layout checkpoint through the plugin and the synthetic sublayer skipper on a stock model, in
the dynamic and fixed-shape bodies, with radix-cache hits, chunked prefill, per-request budgets and
tensor parallelism. Greedy tokens must equal the eager reference's (full recompute, no cache)."""
from __future__ import annotations

import re

import pytest
import torch

import vskipper
from vskipper.reference import reference_generate

from sglang_util import NEW, check_against_reference, engine, greedy, prompt_set
from tiny import VOCAB, skipgpt_checkpoint, tiny_llama

pytestmark = pytest.mark.sglang
LAYERS = [1, 3, 4, 5]


def checkpoint(tmp_path, max_positions=256):
    base = tiny_llama()
    base.config.max_position_embeddings = max_positions
    merged, sk = skipgpt_checkpoint(tmp_path / "ckpt", base, layers=LAYERS)
    return tmp_path / "ckpt", merged, sk


def routes_both_ways(base, sk, prompts, n=NEW):
    """The reference's decisions over these prompts run and skip both sublayers somewhere (else a test
    of them is vacuous)."""
    dec = torch.cat([d for p in prompts for d in reference_generate(base, sk, p, n)[1].values()])
    for col, what in enumerate(("attention", "MLP")):
        skipped = int((~dec[:, col]).sum())
        assert 0 < skipped < len(dec), f"{what}: {skipped} of {len(dec)} skipped"


@pytest.mark.parametrize("execution, static", [("dense", "0"), ("routed", "0"), ("routed", "1"), ("routed-mlp", "1")])
def test_skipgpt_checkpoint_serves_the_reference(tmp_path, capfd, execution, static):
    """The SkipGPT layout (PEFT prefix, base layers under .block., LoRA merged as the weights stream in)
    loads as SkipGPTLlamaForCausalLM; dense, dynamic and fixed-shape bodies serve the reference's greedy
    tokens, radix-cache hits included; the stats line counts each sublayer. The fixed-shape "routed"
    body runs under the host-sync guard ("routed-mlp" attends through SGLang's CPU backend, which reads
    lengths on the host)."""
    path, base, sk = checkpoint(tmp_path)
    env = dict(VSKIPPER_EXECUTION=execution, VSKIPPER_STATIC_SHAPES=static, VSKIPPER_STATS_INTERVAL="4")
    if static == "1" and execution == "routed":
        env["VSKIPPER_CHECK_SYNC"] = "1"
    with engine(path, log_level="info", **env) as eng:
        check_against_reference(eng, base, sk)
    routes_both_ways(base, sk, prompt_set()[0])
    err = capfd.readouterr().err
    assert "transformed SkipGPTLlamaForCausalLM with SkipGPT [the checkpoint's own]" in err, err[-3000:]
    assert re.search(r"of routed sublayers \(attention 0\.\d+, MLP 0\.\d+\)", err), err[-3000:]


def test_random_sublayers_on_a_stock_model_and_rate_0_is_upstream(tmp_path):
    """VSKIPPER_SKIPPER=random:attn_rate=..,mlp_rate=..: the reference's tokens (fixed-shape body); at
    rates 0 the server's tokens are upstream SGLang's, the same requests without vskipper."""
    base = tiny_llama()
    base.save_pretrained(tmp_path / "stock", safe_serialization=True)
    spec = "random:attn_rate=0.5,mlp_rate=0.3,layers=1-5,seed=3"
    with engine(tmp_path / "stock", VSKIPPER_SKIPPER=spec, VSKIPPER_EXECUTION="routed",
                VSKIPPER_STATIC_SHAPES="1") as eng:
        check_against_reference(eng, base, vskipper.parse_skipper(spec))
    prompts = prompt_set()[0]
    with engine(tmp_path / "stock") as eng:
        upstream, _ = greedy(eng, prompts, NEW)
    with engine(tmp_path / "stock", VSKIPPER_SKIPPER="random:attn_rate=0,mlp_rate=0,layers=1-5,seed=3",
                VSKIPPER_EXECUTION="routed") as eng:
        ours, _ = greedy(eng, prompts, NEW)
    assert ours == upstream


@pytest.mark.parametrize("static", ["0", "1"])
def test_skipgpt_chunked_prefill_matches_the_reference(tmp_path, static):
    """--chunked-prefill-size 64 with prompts of 100-600 tokens (batched, chunked, then extending cached
    prefixes): the attention-skipping rows of an extend batch still write K/V that later chunks read."""
    from test_prefill import SG_NEW, sglang_prompt_waves

    path, base, sk = checkpoint(tmp_path, max_positions=1024)
    first, second = sglang_prompt_waves()
    with engine(path, engine_args=dict(chunked_prefill_size=64), VSKIPPER_EXECUTION="routed",
                VSKIPPER_STATIC_SHAPES=static) as eng:
        out1, _ = greedy(eng, first, SG_NEW)
        out2, cached = greedy(eng, second, SG_NEW)
    assert cached[0] >= 317, f"the second wave should hit the radix cache: {cached}"
    for p, out in zip(first + second, out1 + out2):
        want = reference_generate(base, sk, p, SG_NEW)[0][len(p):].tolist()
        assert out == want, f"prompt of {len(p)} tokens: sglang {out} != reference {want}"
    routes_both_ways(base, sk, first[:1], SG_NEW)


@pytest.mark.parametrize("static", ["0", "1"])
def test_per_request_budgets_count_layers_of_both_sublayers(tmp_path, capfd, static):
    """skip false: upstream's tokens; max_skip 0.25 (1 of the 4 routed layers may skip a sublayer): the
    reference's under budget 1; the per-setting counts are sublayer decisions, forced rows run both.
    A batch of skip-false requests only runs SGLang's own layers and counts its rows as forced."""
    from test_per_request import NEW as N
    from test_per_request import generate, last_setting_stats

    path, base, sk = checkpoint(tmp_path)
    base.save_pretrained(tmp_path / "stock", safe_serialization=True)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g) for n in (5, 11, 3, 17, 8, 1)]
    opt_out, capped = {"skip": False}, {"max_skip": 0.25}
    settings = [None, opt_out, None, capped, opt_out, capped]
    with engine(tmp_path / "stock") as eng:
        upstream = generate(eng, prompts, [None] * 6)
        upstream_plain = generate(eng, prompts[:3], [None] * 3)
    env = dict(VSKIPPER_EXECUTION="routed", VSKIPPER_STATIC_SHAPES=static, VSKIPPER_STATS_INTERVAL="1")
    with engine(path, log_level="info", **env) as eng:
        capfd.readouterr()
        outs = generate(eng, prompts, settings)
        stats = last_setting_stats(capfd.readouterr().err)
        plain = generate(eng, prompts[:3], [opt_out] * 3)
        plain_err = capfd.readouterr().err
    assert plain == upstream_plain and "as SGLang's layers" in plain_err
    plain_stats = last_setting_stats(plain_err)
    assert plain_stats["no_skip"][0] == 0 and plain_stats["no_skip"][2] > stats["no_skip"][2], plain_stats
    budgets = {None: None, "max_skip": 1}
    for p, s, out, up in zip(prompts, settings, outs, upstream):
        if s is opt_out:
            assert out == up, f"skip false, prompt of {len(p)}: {out} != upstream {up}"
        else:
            ref = reference_generate(base, sk, p, N, budgets[None if s is None else next(iter(s))])[0]
            assert out == ref[len(p):].tolist(), f"{s}, prompt of {len(p)}: {out} != reference"
    assert any(reference_generate(base, sk, prompts[i], N)[0][len(prompts[i]):].tolist() != upstream[i]
               for i in (1, 4)), "the skipper changes no opted-out answer: a vacuous test"
    assert 0 < stats["capped"][0] <= 0.25 and stats["default"][0] > 0.25, stats
    assert stats["no_skip"][0] == 0 and stats["no_skip"][2] == stats["no_skip"][1] > 0, stats


@pytest.mark.slow
@pytest.mark.parametrize("static", ["0", "1"])
def test_tensor_parallel_2_skipgpt_serves_the_reference_and_ranks_route_alike(tmp_path, static):
    from test_parallel import TWO_RANKS, digests

    path, base, sk = checkpoint(tmp_path)
    with engine(path, engine_args={"tp_size": 2}, VSKIPPER_EXECUTION="routed", VSKIPPER_STATIC_SHAPES=static,
                VSKIPPER_ROUTE_DIGEST=str(tmp_path / "routes"), **TWO_RANKS) as eng:
        check_against_reference(eng, base, sk)
    d = digests(tmp_path / "routes")
    assert set(d) == {"tp0", "tp1"}, d.keys()
    assert d["tp0"] and d["tp0"] == d["tp1"], "ranks made different route decisions"
