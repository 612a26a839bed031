"""Routed prefill: the op (torch form and Triton kernel under TRITON_INTERPRET=1, against the
masked decode attention reference row by row), and the routed bodies through transformers'
generate and SGLang's extend batches (chunked prefill, radix-cache hits) against the eager reference.

Legend: T = query rows of an extend batch, B = requests, nh / kvh = heads, d = head dim.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import vskipper
from vskipper import ops
from vskipper.reference import reference_forward, reference_generate
from vskipper.triton_kernels import masked_decode_attention as MA
from vskipper.triton_kernels import routed_prefill_attention as RP
from vskipper.triton_kernels._common import HAS_TRITON, interpreted

from helpers import assert_close, assert_equal
from tiny import VOCAB, flexidepth_for, record_routes, tiny_llama, tiny_qwen3, transformed

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TRITON_RUNS = HAS_TRITON and (DEVICE.type == "cuda" or interpreted(RP._routed_prefill_attention_kernel))
needs_triton = pytest.mark.skipif(not TRITON_RUNS, reason="Triton needs CUDA or TRITON_INTERPRET=1 (set by conftest)")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# --- the op ------------------------------------------------------------------------------------
@st.composite
def extend_batches(draw):
    """An extend batch over a random paged pool: B requests, each a chunk of extend_lens[b] tokens
    after a cached prefix of prefix_lens[b] (0: a fresh prompt; > 0: a radix hit or a later chunk)."""
    B = draw(st.integers(1, 4))
    kvh = draw(st.sampled_from([1, 2]))
    G = draw(st.sampled_from([1, 3]))
    d = draw(st.sampled_from([1, 10, 16, 40]))
    seed = draw(st.integers(0, 2**16))
    dtype = draw(st.sampled_from(DTYPES))
    kind = draw(st.sampled_from(["all", "none", "mixed"]))
    g = torch.Generator().manual_seed(seed)
    pre = [draw(st.sampled_from([0, 0, 1, 5, 37])) for _ in range(B)]
    ext = [draw(st.sampled_from([0, 1, 2, 7, 19, 40])) for _ in range(B)]
    T, C = sum(ext), max(p + e for p, e in zip(pre, ext)) + 3
    P, R = B * C + 5, B + 2
    q = (torch.randn(T, G * kvh, d, generator=g)).to(dtype).to(DEVICE)
    k = torch.randn(P, kvh, d, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(P, kvh, d, generator=g).to(dtype).to(DEVICE)
    req_to_token = torch.randint(0, P, (R, C), generator=g, dtype=torch.int32).to(DEVICE)
    rpi = torch.randperm(R, generator=g)[:B].to(DEVICE)
    run = {"all": torch.ones(T, dtype=torch.bool), "none": torch.zeros(T, dtype=torch.bool),
           "mixed": torch.rand(T, generator=g) < 0.6}[kind].to(DEVICE)
    return (q, k, v, req_to_token, rpi, torch.tensor(pre, device=DEVICE),
            torch.tensor(ext, dtype=torch.int32, device=DEVICE), run, d ** -0.5)


def as_decode_rows(q, k, v, req_to_token, rpi, pre, ext, run, scale):
    """The same batch as decode rows: row i of request b is a decode row of sequence length p + 1."""
    req = torch.repeat_interleave(torch.arange(len(ext), device=q.device), ext.long())
    start = torch.cumsum(ext, 0) - ext
    i = torch.arange(q.shape[0], device=q.device) - start[req]
    return q, k, v, req_to_token, rpi[req], pre[req] + i + 1, run, scale


@given(extend_batches(), st.sampled_from([3, 16, RP.BLOCK_ROWS]))
@example((torch.zeros(0, 2, 8), torch.randn(4, 1, 8), torch.randn(4, 1, 8), torch.zeros(1, 4, dtype=torch.int32),
          torch.tensor([0]), torch.tensor([2]), torch.tensor([0]), torch.zeros(0, dtype=torch.bool), 0.3), 16)
def test_routed_prefill_attention(args, block_rows):
    want = MA.torch_op(*as_decode_rows(*args))
    saved, RP.BLOCK_ROWS = RP.BLOCK_ROWS, block_rows  # the reference's blocks of RUN rows, at small sizes too
    try:
        got = RP.torch_op(*args)
    finally:
        RP.BLOCK_ROWS = saved
    assert_close(got, want, "reference vs masked decode attention, row by row")
    assert_close(ops.routed_prefill_attention(*args, impl="torch"), want, "ops, torch")
    if TRITON_RUNS:
        got = ops.routed_prefill_attention(*args, impl="triton")
        assert_close(got, want, "kernel vs masked decode attention")
        skipped = ~args[7]
        assert_equal(got[skipped], torch.zeros_like(got[skipped]), "zeros for skipped rows")


def batch(pre, ext, run, kvh=1, G=2, d=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    T, C = sum(ext), max(p + e for p, e in zip(pre, ext))
    B = len(ext)
    return (torch.randn(T, G * kvh, d, generator=g).to(dtype), torch.randn(B * C, kvh, d, generator=g).to(dtype),
            torch.randn(B * C, kvh, d, generator=g).to(dtype),
            torch.arange(B * C, dtype=torch.int32).view(B, C), torch.arange(B), torch.tensor(pre),
            torch.tensor(ext), torch.tensor(run, dtype=torch.bool), d ** -0.5)


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("case", ["none_run", "all_run", "chunk_after_prefix", "several_requests", "long_chunk"])
def test_routed_prefill_attention_cases(impl, case):
    """The named cases, explicitly (beside the property test): zero RUN rows, all RUN, a chunk after
    a cached prefix, several requests of different prefixes in one batch (a decode row among them,
    as SGLang's mixed batches have), a chunk longer than the reference's blocks of rows."""
    pre, ext = {"none_run": ([0], [9]), "all_run": ([0], [33]), "chunk_after_prefix": ([64], [17]),
                "several_requests": ([0, 5, 30, 12], [20, 1, 9, 33]), "long_chunk": ([20], [300])}[case]
    T = sum(ext)
    run = {"none_run": [False] * T, "all_run": [True] * T}.get(case, [i % 3 != 1 for i in range(T)])
    args = batch(pre, ext, run)
    want = MA.torch_op(*as_decode_rows(*args))
    got = ops.routed_prefill_attention(*(a.to(DEVICE) if torch.is_tensor(a) else a for a in args), impl=impl)
    assert_close(got.cpu(), want, case)
    if case == "all_run" and pre == [0]:  # all RUN and no prefix: plain causal attention
        q, k, v = args[0], args[1][:T], args[2][:T]
        full = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1).expand(q.shape[1], -1, -1),
            v.transpose(0, 1).expand(q.shape[1], -1, -1), is_causal=True, scale=args[-1]).transpose(0, 1)
        assert_close(got.cpu(), full, "all RUN = causal attention")


@needs_triton
def test_routed_prefill_attention_opcheck():
    """The custom op (torch.ops.vskipper.routed_prefill_attention): schema, fake implementation."""
    args = batch([0, 5, 30], [20, 1, 9], [i % 3 != 1 for i in range(30)])
    torch.library.opcheck(torch.ops.vskipper.routed_prefill_attention.default,
                          tuple(a.to(DEVICE) if torch.is_tensor(a) else a for a in args))


def test_routed_prefill_attention_bad_input():
    args = list(batch([0, 2], [3, 4], [True] * 7))
    bad = args.copy()
    bad[6] = torch.tensor([3, 5])
    with pytest.raises(ValueError, match="extend_lens sum to 8 but q has T = 7"):
        ops.routed_prefill_attention(*bad, impl="torch")
    bad = args.copy()
    bad[7] = bad[7][:5]
    with pytest.raises(ValueError, match="run_mask has 5 entries but q has T = 7"):
        ops.routed_prefill_attention(*bad, impl="torch")
    bad = args.copy()
    bad[5] = torch.tensor([0, 9])
    with pytest.raises(ValueError, match="request 1: prefix 9 \\+ extend 4"):
        ops.routed_prefill_attention(*bad, impl="torch")
    with pytest.raises(ValueError, match="impl='cuda'"):
        ops.routed_prefill_attention(*args, impl="cuda")


# --- transformers: generate's prefill -----------------------------------------------------------
def prompts(lengths, seed=11):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g) for n in lengths]


def count_query_rows(model, layers):
    """{layer: [rows given to q_proj per call]} of a transformed transformers model."""
    seen = {l: [] for l in layers}
    for l in layers:
        proj = model.model.layers[l].self_attn.q_proj
        proj.register_forward_hook(lambda m, a, out, l=l: seen[l].append(a[0].shape[:-1].numel()))
    return seen


@pytest.mark.parametrize("family, attn", [("llama", "sdpa"), ("llama", "eager"), ("qwen3", "sdpa")])
def test_hf_prefill_queries_only_run_rows(family, attn, monkeypatch):
    """generate's prefill through the routed body: q_proj sees only the RUN rows of a routed layer,
    and the greedy tokens and route decisions are the eager reference's, for one long prompt, a
    left-padded batch, and a second turn that prefills after a cached prefix (DynamicCache); in
    blocks of 16 RUN rows (several per sequence)."""
    import vskipper.engines.hf as hf

    monkeypatch.setattr(hf, "PREFILL_BLOCK_ROWS", 16)
    base = (tiny_llama if family == "llama" else tiny_qwen3)()
    base.config._attn_implementation = attn
    sk = flexidepth_for(base, [1, 3, 4], gate="soft" if family == "llama" else "hard")
    m = transformed(base, sk, "routed")
    seen, calls = count_query_rows(m, sk.layers), record_routes(m)
    long, short = prompts((150, 37))
    with torch.no_grad():
        out = m.generate(long[None], max_new_tokens=6, do_sample=False, pad_token_id=0)[0]
    ref, dec = reference_generate(base, sk, long, 6)
    assert_equal(out, ref, "greedy tokens, one 150-token prompt")
    for l in sk.layers:
        runs = int(dec[l][:len(long)].sum())
        assert 0 < runs < len(long), f"layer {l}: the prompt should have RUN and PROJECT rows ({runs}/{len(long)})"
        assert seen[l][0] == runs, f"layer {l}: q_proj saw {seen[l][0]} prefill rows, {runs} run"
        assert_equal(sanitize(calls[l][0][0]), dec[l][:len(long)], f"prefill routes, layer {l}")
    # padded batch
    ids = torch.zeros(2, 150, dtype=torch.long)
    mask = torch.zeros(2, 150, dtype=torch.long)
    ids[0], mask[0] = long, 1
    ids[1, -37:], mask[1, -37:] = short, 1
    with torch.no_grad():
        out = m.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        logits = m(ids, attention_mask=mask).logits
    assert_close(logits[0], reference_forward(base, sk, long)[0], "padded batch, logits of sequence 0")
    assert_close(logits[1, -37:], reference_forward(base, sk, short)[0], "padded batch, logits of sequence 1")
    assert_equal(out[0, 150:], ref[150:], "padded batch, sequence 0")
    assert_equal(out[1, 150:], reference_generate(base, sk, short, 6)[0][37:], "padded batch, sequence 1")
    # a second turn: prefill of 40 new tokens after the cached first turn
    from transformers import DynamicCache

    cache = DynamicCache(config=m.config)
    first = torch.cat([long, prompts((40,), seed=3)[0]])
    with torch.no_grad():
        m(long[None], past_key_values=cache, use_cache=True)
        out = m.generate(first[None], past_key_values=cache, max_new_tokens=6, do_sample=False, pad_token_id=0)[0]
    assert_equal(out, reference_generate(base, sk, first, 6)[0], "prefill after a cached prefix")


def sanitize(g):
    from vskipper.skippers.base import sanitize_gate

    return sanitize_gate(g, 0.5)[1]


# --- SGLang: extend batches ---------------------------------------------------------------------
SG_NEW = 8


def sglang_prompt_waves(seed=7):
    """Two waves of prompts of 100-600 tokens: the first sent together (several requests, chunked
    at 64 tokens), the second extending the first's prompts (radix-cache hits: a cached prefix, then
    chunks after it)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda n: torch.randint(1, VOCAB, (n,), generator=g)  # noqa: E731
    first = [r(100), r(230), r(600), r(317)]
    second = [torch.cat([first[3], r(150)]), torch.cat([first[0][:80], r(45)]), r(420)]
    return first, second


@pytest.mark.sglang
@pytest.mark.parametrize("family, execution, static", [("llama", "routed", "0"), ("qwen3", "routed", "0"),
                                                       ("llama", "routed", "1"), ("qwen3", "dense", "0")])
def test_sglang_routed_prefill_matches_reference(tmp_path, family, execution, static):
    """SGLang with --chunked-prefill-size 64: greedy tokens equal the eager reference for prompts whose
    prefill routes (RUN and PROJECT rows at every routed layer), chunked, batched and after radix hits;
    the dynamic body (static 0), the fixed-shape body (static 1, torch ops) and dense."""
    from vskipper.models.hf_loader import save_checkpoint

    from sglang_util import engine, greedy

    base = (tiny_llama if family == "llama" else tiny_qwen3)()
    base.config.max_position_embeddings = 1024
    sk = flexidepth_for(base, [1, 3, 4, 5], gate="soft" if family == "llama" else "hard")
    path = save_checkpoint(tmp_path / "ckpt", base, sk)
    first, second = sglang_prompt_waves()
    with engine(path, engine_args=dict(chunked_prefill_size=64), VSKIPPER_EXECUTION=execution,
                VSKIPPER_STATIC_SHAPES=static) as eng:
        outs = eng.generate(input_ids=[p.tolist() for p in first], return_logprob=True, logprob_start_len=0,
                            sampling_params={"max_new_tokens": SG_NEW, "temperature": 0, "ignore_eos": True})
        out1 = [o["output_ids"] for o in outs]
        out2, cached = greedy(eng, second, SG_NEW)
    assert cached[0] >= 317 and cached[1] >= 64, f"the second wave should hit the radix cache: {cached}"
    for p, o in zip(first, outs):  # every prefill row's output: the log-probability of the next prompt token
        got = torch.tensor([lp for lp, _, _ in o["meta_info"]["input_token_logprobs"][1:]])
        want = torch.log_softmax(reference_forward(base, sk, p)[0].double(), -1)[torch.arange(len(p) - 1), p[1:]]
        worst = (got.double() - want).abs().max().item()
        assert worst < 1e-3, f"prompt of {len(p)} tokens: prompt log-probabilities off the reference by {worst:.3g}"
    for p, out in zip(first + second, out1 + out2):
        ref, dec = reference_generate(base, sk, p, SG_NEW)
        for l, d in dec.items():
            runs = int(d[:len(p)].sum())
            assert 0 < runs < len(p), f"layer {l}: the prompt should have RUN and PROJECT rows ({runs}/{len(p)})"
        want = ref[len(p):].tolist()
        assert out == want, f"prompt of {len(p)} tokens: sglang {out} != reference {want}"


@pytest.mark.sglang
@pytest.mark.parametrize("family, static", [("llama", "0"), ("qwen3", "0"), ("llama", "1")])
def test_sglang_prefill_projects_queries_of_run_rows_only(tmp_path, family, static):
    """In an SGLang extend batch a routed layer projects the queries of its RUN rows only (PROJECT
    rows: K and V), and what it computes equals SGLang's own forward_prepare_native: q on the RUN
    rows, k and v on every row (Qwen3: its q/k norms too); the dynamic and the fixed-shape body."""
    from vskipper.models.hf_loader import save_checkpoint

    from sglang_util import run_script

    base = (tiny_llama if family == "llama" else tiny_qwen3)()
    sk = flexidepth_for(base, [1, 3, 4], gate="soft" if family == "llama" else "hard")
    path = save_checkpoint(tmp_path / "ckpt", base, sk)
    res = run_script("prefill_queries.py", path, tmp_path / "queries.json", VSKIPPER_EXECUTION="routed",
                     VSKIPPER_STATIC_SHAPES=static)
    calls = {c["layer"]: c for c in res["calls"]}
    assert sorted(calls) == list(sk.layers), f"every routed layer projects its queries by rows once: {res['calls']}"
    for l, c in calls.items():
        run = res["stats"][str(l)]["run"]
        assert c["T"] == 126 and c["rows"] == run and 0 < run < 126, f"layer {l}: {c}, {res['stats'][str(l)]}"
        assert max(c["q"], c["k"], c["v"]) < 1e-5 and c["q_off_rows_zero"], f"layer {l}: {c}"


# --- the cost model's prefill table --------------------------------------------------------------
def phase_tables():
    """A decode table where dense always wins and a prefill table where routed wins from T = 4."""
    import dataclasses

    from tiny import synthetic_calibration

    cal = synthetic_calibration()
    decode = dataclasses.replace(cal, routed=tuple(tuple(2 * t for t in row) for row in cal.dense))
    return decode, dataclasses.replace(cal, phase="prefill")


def test_auto_prices_each_phase_by_its_own_table(tmp_path, monkeypatch):
    from vskipper import cost

    monkeypatch.setenv("VSKIPPER_CACHE", str(tmp_path / "cache"))
    decode, prefill = phase_tables()
    counts = torch.tensor([8, 8], dtype=torch.int32)  # T = 16, f = 0.5
    chooser = cost.Chooser(decode, prefill=prefill)
    assert chooser.choose(16, counts, decode=True) == "dense" and chooser.choose(16, counts, decode=False) == "routed"
    assert cost.Chooser(decode).choose(16, counts, decode=False) == "dense"  # no prefill table: the decode one
    # kept apart in the cache: one file, a table per phase
    cost.save(decode)
    assert cost.load("cpu", 40, 72, phase="prefill") is None
    cost.save(prefill)
    assert cost.load("cpu", 40, 72) == decode and cost.load("cpu", 40, 72, phase="prefill") == prefill
    with pytest.raises(ValueError, match="phase='extend' is not one of"):
        cost.load("cpu", 40, 72, phase="extend")


def test_transform_with_auto_uses_both_tables_and_says_so(tmp_path, monkeypatch):
    """auto over a skipper whose every step routes half the rows: prefill runs routed (its table),
    decode dense (its table); with no prefill table, a warning names the command and explain says
    that the decode table prices prefill."""
    import warnings

    from vskipper import cost

    monkeypatch.setenv("VSKIPPER_CACHE", str(tmp_path / "cache"))
    cost._warned.clear()
    decode, prefill = phase_tables()
    cost.save(decode)
    base, sk = tiny_llama(), vskipper.RandomSkip(0.5, [1, 2])
    with pytest.warns(UserWarning,
                      match=r"no prefill cost calibration.*vskipper calibrate --phase prefill --shape 40,72"):
        m = transformed(base, sk, "auto")
    assert "no prefill calibration: prefill priced by the decode table" in vskipper.explain(m)
    cost.save(prefill)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = transformed(base, sk, "auto")
    assert "prefill calibration 'cpu: " in vskipper.explain(m)
    chosen = []
    for l in sk.layers:
        body = m.vskipper.bodies[l]
        body.select = lambda layer, h, x, *rest, _s=body.select: chosen.append(
            (x.shape[1] > 1, _s(layer, h, x, *rest).name)) or _s(layer, h, x, *rest)
    ids = torch.randint(1, VOCAB, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = m.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert (True, "routed") in chosen and (False, "dense") in chosen and (True, "dense") not in chosen, chosen
    assert_equal(out, reference_generate(base, sk, ids[0], 3)[0][None], "greedy tokens")


def test_calibrate_prefill_phase(tmp_path, monkeypatch):
    from vskipper import calibrate

    monkeypatch.setenv("VSKIPPER_CACHE", str(tmp_path / "cache"))
    cal, bench = calibrate.measure(32, 48, 4, 2, ts=(16, 64), fs=(0.0, 0.5, 1.0), repeats=1, passes=1,
                                   progress=False, phase="prefill")
    assert cal.phase == "prefill" and cal.ts == (16, 64) and all(t > 0 for row in cal.routed for t in row)
    h, x, *_ = bench.inputs(64, 0.5, "prefill")
    assert h.shape == (1, 64, 32)  # one prompt of T tokens
    assert calibrate.measure(32, 48, 4, 2, ts=(1,), fs=(0.5,), repeats=1, passes=1, progress=False)[0].phase == "decode"
    seen = []
    monkeypatch.setattr(calibrate, "measure", lambda *a, phase, **k: seen.append(phase) or (cal, None))
    calibrate.main(["--shape", "40,72"])
    calibrate.main(["--shape", "40,72", "--phase", "prefill"])
    assert seen == ["decode", "prefill", "prefill"]
