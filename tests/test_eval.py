"""`vskipper eval`: the agreement and standard-error arithmetic on hand-made token lists, the
teacher-forced metrics in-process, bad input in one line; and lm-eval really called against a real
SGLang server on CPU (a tiny random Llama with SmolLM2's tokenizer and chat template), both task
kinds, the greedy agreement of a server with itself, and the lm-eval log-likelihoods checked
against transformers."""
from __future__ import annotations

import copy
import json
import math
import shutil
import statistics

import pytest
import torch

import vskipper
from vskipper.eval import agreement, last_integer, mean_stderr, median_stderr, prefix_length, teacher_forced

from tiny import flexidepth_for, tiny_llama


# --- the arithmetic of the scores -------------------------------------------------------------
def test_agreement_on_hand_made_answers():
    base = [[1, 2, 3], [1, 2, 3], [6, 7], [4, 4, 4]]
    mine = [[1, 2, 3], [1, 9, 3], [5], [4, 4, 4, 4]]  # identical, diverges at 1, at 0, longer than the base
    a = agreement(mine, base)
    assert a["prefix"] == [3, 1, 0, 3]  # capped at the base's length
    assert a["n"] == 4 and a["prefix_mean"] == pytest.approx(7 / 4) and a["prefix_median"] == 2.0
    # sample standard deviation of [3, 1, 0, 3] over sqrt(4), by hand: deviations 1.25, -0.75, -1.75, 1.25
    assert a["prefix_mean_stderr"] == pytest.approx(math.sqrt((1.5625 + 0.5625 + 3.0625 + 1.5625) / 3) / 2)
    assert a["identical"] == pytest.approx(0.25)  # the longer answer is not identical
    assert a["identical_stderr"] == pytest.approx(math.sqrt((0.5625 + 3 * 0.0625) / 3) / 2)
    assert a["base_len_mean"] == pytest.approx(11 / 4)
    same = agreement(base, base)
    assert same["identical"] == 1.0 and same["identical_stderr"] == 0.0 and same["prefix_mean"] == 11 / 4
    assert prefix_length([], [1, 2]) == 0 and prefix_length([1, 2], []) == 0
    with pytest.raises(ValueError, match="3 answers for 2 base answers"):
        agreement([[1]] * 3, [[1]] * 2)


def test_standard_errors():
    v = [0.0, 1.0, 1.0, 0.0, 1.0]
    m, se = mean_stderr(v)
    assert m == 0.6 and se == pytest.approx(statistics.stdev(v) / math.sqrt(5))
    assert mean_stderr([2.0]) == (2.0, 0.0) and all(math.isnan(x) for x in mean_stderr([]))
    med, mse = median_stderr([5.0] * 9)
    assert med == 5.0 and mse == 0.0
    spread = [float(x) for x in range(1, 30)]
    assert median_stderr(spread) == median_stderr(spread)  # seeded
    assert 0 < median_stderr(spread)[1] < 10 and median_stderr(spread)[0] == 15.0


def test_last_integer():
    assert last_integer("3 + 4 = 7, so the answer is 12.") == 12
    assert last_integer("It costs 1,250 dollars") == 1250 and last_integer("-5 degrees") == -5
    assert last_integer("no number here") is None


# --- teacher-forced, in-process ---------------------------------------------------------------
def test_teacher_forced_is_zero_against_itself_and_positive_with_skipping():
    base = tiny_llama()
    seqs = [[3, 7, 9, 11, 20, 21, 22], [5, 6, 40, 41], [8, 9]]  # the last has no answer tokens
    n_prompt = [4, 2, 2]
    same = teacher_forced(base, copy.deepcopy(base), seqs, n_prompt)
    assert same["n"] == 2 and same["positions"] == [3, 2] and same["skip"] is None
    assert same["top1_mean"] == 1.0 and same["kl_mean"] == pytest.approx(0.0, abs=1e-6)
    # top-1 against the base's *greedy* tokens: make the sequences the base's own greedy answers
    with torch.no_grad():
        seqs = [s[:n] for s, n in zip(seqs, n_prompt)]
        for s in seqs:
            for _ in range(4):
                s.append(int(base(torch.tensor([s])).logits[0, -1].argmax()))
    skipped = vskipper.transform(copy.deepcopy(base), vskipper.RandomSkip(0.5, [1, 2, 3, 4], seed=0))
    tf = teacher_forced(base, skipped, seqs, n_prompt)
    assert tf["n"] == 3 and tf["kl_mean"] > 1e-3 and 0 <= tf["top1_mean"] <= 1
    assert 0.2 < tf["skip"] < 0.8 and tf["kl_stderr"] > 0
    ref = teacher_forced(base, copy.deepcopy(base), seqs, n_prompt)
    assert ref["top1_mean"] == 1.0  # the base agrees with its own greedy tokens
    # by phase: the prompt's positions and the generated ones (the answer's tokens but its last), as the
    # reference decides them
    from vskipper.reference import reference_forward
    from vskipper.training.data import generated

    sk = skipped.vskipper.skipper
    counts = {"prompt": [0, 0], "generated": [0, 0]}
    for s, n in zip(seqs, n_prompt):
        _, dec, _ = reference_forward(base, sk, torch.tensor(s))
        for name, m in (("prompt", torch.arange(len(s)) < n), ("generated", generated(n, len(s)))):
            counts[name][0] += sum(int((~d[m]).sum()) for d in dec.values())
            counts[name][1] += sum(int(m.sum()) for _ in dec)
    for name, (k, d) in counts.items():
        assert tf[f"skip_{name}"] == pytest.approx(k / d), name
    assert same["skip_prompt"] is None and same["skip_generated"] is None


def test_server_skip_by_phase_from_metrics(monkeypatch):
    import requests

    from vskipper.eval import server
    from vskipper.eval.cli import table

    def metrics(run_d, proj_d, run_p):
        text = "\n".join([
            "# TYPE vskipper_routed_layer_phase_tokens_total counter",
            f'vskipper_routed_layer_phase_tokens_total{{phase="decode",route="run"}} {run_d}',
            f'vskipper_routed_layer_phase_tokens_total{{phase="decode",route="project"}} {proj_d}',
            f'vskipper_routed_layer_phase_tokens_total{{phase="prefill",route="run"}} {run_p}',
            'vskipper_routed_layer_phase_created{phase="prefill",route="run"} 1.7e9'])
        return type("R", (), {"ok": True, "text": text})()

    readings = iter([metrics(10.0, 2.0, 50.0), metrics(40.0, 12.0, 90.0)])
    monkeypatch.setattr(requests, "get", lambda *a, **k: next(readings))
    before, after = server.route_phases("http://x"), server.route_phases("http://x")
    assert before == {"decode": {"run": 10.0, "project": 2.0}, "prefill": {"run": 50.0}}
    shares = server.phase_shares(before, after)
    assert shares == {"prompt": 0.0, "prompt_tokens": 40.0, "generated": 0.25, "generated_tokens": 40.0}
    assert server.phase_shares(None, after) is None
    rows = table({"server_skip": {"agreement": shares}})
    assert ("server skip share, generated tokens (greedy agreement)", "25.0%", "-", "40 routed-layer tokens") in rows
    monkeypatch.setattr(requests, "get", lambda *a, **k: type("R", (), {"ok": True, "text": "# nothing"})())
    assert server.route_phases("http://x") is None  # no skipper, or no --enable-metrics


def test_teacher_forced_loads_a_checkpoint_against_its_own_base(tmp_path):
    from vskipper.eval.agreement import check_teacher_forced, load_teacher_forced
    from vskipper.models.hf_loader import save_checkpoint

    base = tiny_llama()
    path = save_checkpoint(tmp_path / "ckpt", base, flexidepth_for(base, [1, 3], gate="soft"))
    kind, what = check_teacher_forced(str(path))
    assert kind == "checkpoint"
    b, m = load_teacher_forced(kind, what, None)
    ids = torch.tensor([[3, 4, 5, 6]])
    torch.testing.assert_close(b(ids).logits, base(ids).logits)
    assert hasattr(m, "vskipper") and not hasattr(b, "vskipper")


# --- bad input: one line, exit code 2, before anything slow ----------------------------------
def _eval(argv, capsys):
    from vskipper import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["eval", *argv])
    err = capsys.readouterr().err
    return e.value.code, err


@pytest.mark.parametrize("argv, expected", [
    (["--url", "http://127.0.0.1:9", "--tasks", "vskipper_arithmetic,mmlu"],
     "unknown task(s) mmlu; the tasks are vskipper_arithmetic, vskipper_facts_mc"),
    (["--url", "http://127.0.0.1:9", "--limit", "0"], "--limit=0 must be a positive integer"),
    (["--tasks", "vskipper_facts_mc"], "give --url URL of a running server (vskipper serve) or --serve"),
    (["--url", "127.0.0.1:30000"], "expected http://HOST:PORT"),
    (["--url", "http://127.0.0.1:9", "--agreement-prompts", "everyday,gsm8k"], "expected held-out prompt sets among"),
    (["--url", "http://127.0.0.1:9", "--skipper", "none"], "are options of --serve"),
    (["--tasks", "none", "--teacher-forced", "random:rate=0.5"], "missing field(s) ['layers']"),
    (["--tasks", "none"], "nothing to evaluate"),
])
def test_bad_input_is_one_line(argv, expected, capsys):
    code, err = _eval(argv, capsys)
    assert code == 2 and expected in err, err
    assert err.startswith("vskipper eval: error: ") and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_unreachable_url_names_it_and_says_what_was_expected(capsys, tmp_path):
    from vskipper.eval.server import free_port

    url = f"http://127.0.0.1:{free_port()}"
    code, err = _eval(["--url", url, "--out", str(tmp_path)], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"no server answers at {url}" in err and "OpenAI-compatible" in err and "vskipper serve" in err


# --- against a real SGLang server on CPU ------------------------------------------------------
def tiny_model_dir(path):
    """A tiny random Llama with SmolLM2's vocabulary, tokenizer and chat template (fast on CPU)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from vskipper.models.smollm2 import smollm2_dir

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    model.save_pretrained(path)
    src = smollm2_dir()
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "chat_template")):
            shutil.copy(f, path / f.name)
    return path, model


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    """The tiny model served as `vskipper eval --serve` starts a server (vskipper.eval.server)."""
    pytest.importorskip("sglang")
    from vskipper.eval.server import start_server

    d = tmp_path_factory.mktemp("eval")
    path, model = tiny_model_dir(d / "tiny")
    srv = start_server("model", model_path=str(path), skipper="none", sglang_args="--max-total-tokens 4096",
                       log_dir=d, timeout=300)
    try:
        yield srv, path, model
    finally:
        srv.stop()
        assert srv.proc.poll() is not None


@pytest.mark.sglang
@pytest.mark.slow
def test_eval_against_a_real_server(tiny_server, tmp_path, capsys):
    import requests
    from transformers import AutoTokenizer

    from vskipper import cli

    srv, path, model = tiny_server
    # what lm-eval's local-completions relies on: echo + logprobs gives every prompt token's log-prob
    # (the first None) plus the generated one
    r = requests.post(f"{srv.url}/v1/completions", json={"model": str(path), "prompt": [1, 504, 3545, 28, 2],
                                                        "max_tokens": 1, "logprobs": 1, "echo": True,
                                                        "temperature": 0}, timeout=60).json()
    lp = r["choices"][0]["logprobs"]["token_logprobs"]
    assert len(lp) == 5 + 1 and lp[0] is None and all(isinstance(x, float) for x in lp[1:])

    out = tmp_path / "out"
    cli.main(["eval", "--url", srv.url + "/v1", "--base-url", srv.url, "--limit", "2", "--max-new-tokens", "8",
              "--max-gen-toks", "12", "--num-concurrent", "2", "--teacher-forced", "random:rate=0.5,layers=1-2",
              "--out", str(out)])
    printed = capsys.readouterr().out
    res = json.loads((out / "results.json").read_text())
    arith, mc = res["tasks"]["vskipper_arithmetic"], res["tasks"]["vskipper_facts_mc"]
    assert arith["n"] == 2 and mc["n"] == 2
    for row, metrics in ((arith, ["acc"]), (mc, ["acc", "acc_norm"])):
        for m in metrics:
            assert row[m] in (0.0, 0.5, 1.0) and row[f"{m}_stderr"] is not None
    # a server against itself: every greedy answer identical
    a = res["agreement"]
    assert a["n"] == 2 and a["identical"] == 1.0 and a["identical_stderr"] == 0.0
    assert a["prefix_mean"] == a["base_len_mean"] > 0
    tf = res["teacher_forced"]
    assert tf["n"] == 2 and tf["kl_mean"] > 0 and tf["base"] == str(path)
    assert "| vskipper_facts_mc acc_norm |" in printed and "| greedy agreement: identical answers | 100.0% |" in printed

    # what lm-eval sent and got: the chat template applied, and each choice's log-likelihood equal to
    # transformers' on the same tokens (so the slicing of the echoed log-probs is right)
    tok = AutoTokenizer.from_pretrained(str(path))
    gen = [json.loads(x) for x in (out / "samples_vskipper_arithmetic.jsonl").read_text().splitlines()]
    q = json.loads((out / "tasks" / "arithmetic.jsonl").read_text().splitlines()[0])
    assert gen[0]["id"] == q["id"] and "<|im_start|>user\n" + q["prompt"] + "<|im_end|>" in json.dumps(
        gen[0]["arguments"], ensure_ascii=False).replace("\\n", "\n")
    mcs = [json.loads(x) for x in (out / "samples_vskipper_facts_mc.jsonl").read_text().splitlines()]
    args = mcs[0]["arguments"]
    pairs = [(v["arg_0"], v["arg_1"]) for v in args.values()] if isinstance(args, dict) else [tuple(x) for x in args]
    assert len(pairs) == 4 and all(ctx.endswith("<|im_start|>assistant\n") for ctx, _ in pairs)
    for (ctx, cont), (ll, _) in zip(pairs, mcs[0]["response"]):
        c = tok(ctx.rstrip(), add_special_tokens=False).input_ids  # lm-eval moves the trailing "\n" to the choice
        whole = tok(ctx + cont, add_special_tokens=False).input_ids
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), -1)
        expected = sum(float(logp[i - 1, whole[i]]) for i in range(len(c), len(whole)))
        assert ll == pytest.approx(expected, abs=2e-3), (ctx[-40:], cont)
