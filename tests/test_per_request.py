"""Per-request control (vskipper/control.py): the field's validation, the cap applied to a routed
layer's decisions, and, in real SGLang 0.5.23 on CPU, mixed batches where a `skip: false` request
gets upstream SGLang's greedy tokens, a `max_skip` request the eager reference's under its cap and
stays within it, and their neighbours the eager reference's."""
from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from vskipper.control import COUNTS, SETTINGS, RequestCap, RequestControl, parse
from vskipper.guard import NoHostSync

NEW = 12


# --- the field ---------------------------------------------------------------------------------
@pytest.mark.parametrize("value, max_skip", [(None, 1.0), ({}, 1.0), ({"skip": True}, 1.0), ({"skip": False}, 0.0),
                                             ({"max_skip": 0.25}, 0.25), ({"max_skip": 0}, 0.0), ({"max_skip": 1}, 1.0),
                                             ({"skip": False, "max_skip": 0}, 0.0),
                                             ({"skip": True, "max_skip": 0.5}, 0.5)])
def test_good_settings(value, max_skip):
    assert parse(value) == RequestControl(max_skip)


@pytest.mark.parametrize("value, message", [
    ({"max_skip": 1.5}, r"vskipper.max_skip must be a number in \[0, 1\], got 1.5"),
    ({"max_skip": -0.1}, r"vskipper.max_skip must be a number in \[0, 1\], got -0.1"),
    ({"max_skip": math.nan}, r"vskipper.max_skip must be a number in \[0, 1\], got nan"),
    ({"max_skip": "0.2"}, r"vskipper.max_skip must be a number in \[0, 1\], got '0.2'"),
    ({"max_skip": True}, r"vskipper.max_skip must be a number in \[0, 1\], got True"),
    ({"skip": "no"}, r"vskipper.skip must be true or false, got 'no'"),
    ({"skip": 0}, r"vskipper.skip must be true or false, got 0"),
    ({"skip": False, "max_skip": 0.3}, r"vskipper: skip false and max_skip 0.3 disagree"),
    ({"skips": False}, r"vskipper.skips is not a field; the fields are skip, max_skip"),
    (False, r"vskipper must be an object such as"),
    ([0.2], r"vskipper must be an object such as"),
])
def test_bad_settings_name_the_field(value, message):
    with pytest.raises(ValueError, match=message):
        parse(value)


@given(st.recursive(st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=5),
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.sampled_from(["skip", "max_skip", "x"]), c,
                                                                        max_size=3), max_leaves=6))
def test_fuzzed_settings_raise_only_value_error_naming_the_field(value):
    try:
        c = parse(value)
    except ValueError as e:
        assert str(e).startswith("vskipper"), str(e)
    else:
        assert 0.0 <= c.max_skip <= 1.0


@given(st.floats(0, 1), st.integers(1, 80))
def test_budget_never_exceeds_the_cap(max_skip, n_layers):
    k = RequestControl(max_skip).budget(n_layers)
    assert 0 <= k <= n_layers and k / n_layers <= max_skip
    assert k == n_layers or (k + 1) / n_layers > max_skip  # and it is the largest that fits


# --- the cap on one layer's decisions ------------------------------------------------------------
def test_cap_forces_run_with_gate_one_deepest_first_and_counts_per_setting():
    n = 4
    g = torch.tensor([0.1, 0.9, 0.2, 0.3, 0.7, 0.4])
    run = g > 0.5
    bad = torch.zeros(6, dtype=torch.bool)
    valid = torch.tensor([True, True, True, True, True, False])
    budget = torch.tensor([4, 4, 0, 2, 0, 0], dtype=torch.int32)  # default, default, no_skip, capped, no_skip, padding
    for rank in range(n):
        cap = RequestCap(rank, n)
        with NoHostSync(f"cap at rank {rank}"):
            g2, run2, bad2 = cap((g, run, bad), valid, budget)
        forced = budget <= rank
        assert torch.equal(run2, run | forced) and bad2 is bad
        assert torch.equal(g2, torch.where(forced, torch.ones_like(g), g))
        counts = dict(zip(SETTINGS, (dict(zip(COUNTS, r)) for r in cap.setting_counts())))
        assert counts["default"] == dict(tokens=0, run=0, project=0, forced=0)  # the RouteCounter counts those
        assert counts["no_skip"] == dict(tokens=2, run=2, project=0, forced=2)  # the padding row is not counted
        capped_forced = int(rank >= 2)
        assert counts["capped"] == dict(tokens=1, run=capped_forced, project=1 - capped_forced, forced=capped_forced)
    assert RequestCap(0, n)((g, run, bad), valid, None) == (g, run, bad)  # no budgets: the decisions as made


# --- real SGLang on CPU ------------------------------------------------------------------------
def sampling(setting=None) -> dict:
    sp = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
    if setting is not None:
        sp["custom_params"] = {"vskipper": setting}
    return sp


def generate(eng, prompts, settings):
    outs = eng.generate(input_ids=[p.tolist() for p in prompts], sampling_params=[sampling(s) for s in settings])
    return [o["output_ids"] for o in outs]


def last_setting_stats(err: str) -> dict[str, tuple[float, int, int]]:
    """{setting: (skip ratio, tokens, forced)} from the last stats line the server logged."""
    lines = [x for x in err.splitlines() if "by request setting:" in x]
    assert lines, err[-3000:]
    found = re.findall(r"(\w+) ([\d.]+) over (\d+) \(forced to run (\d+)\)", lines[-1].split("by request setting:")[1])
    return {s: (float(r), int(t), int(f)) for s, r, t, f in found}


@pytest.mark.sglang
@pytest.mark.parametrize("static", ["0", "1"])
def test_mixed_batch_opted_out_request_is_upstream_and_neighbours_are_the_reference(tmp_path, capfd, static):
    """One batch of six requests: default, skip false and max_skip 0.25 (1 of the 4 routed layers may
    be skipped) mixed. Then a second batch whose skip-false requests extend prefixes that default
    requests put in the radix cache. Then a batch of skip-false requests only: its rows all have budget
    0, so the routed layers run as SGLang's own (which mixed batches never do), counted as forced.
    static=1: the graph-safe body (fixed shapes, the decode budgets read from the fixed buffer) under
    the host-sync guard."""
    from vskipper.models.hf_loader import save_checkpoint
    from vskipper.reference import reference_generate

    from sglang_util import engine
    from tiny import VOCAB, flexidepth_for, tiny_llama

    base = tiny_llama()
    sk = flexidepth_for(base, [1, 3, 4, 5], gate="soft")
    path = save_checkpoint(tmp_path / "ckpt", base, sk)
    base.save_pretrained(tmp_path / "stock", safe_serialization=True)
    g = torch.Generator().manual_seed(7)
    first = [torch.randint(1, VOCAB, (n,), generator=g) for n in (5, 11, 3, 17, 8, 1)]
    second = [torch.cat([first[i], torch.randint(1, VOCAB, (4,), generator=g)]) for i in (0, 2, 3)]
    third = [torch.randint(1, VOCAB, (n,), generator=g) for n in (9, 2, 14)]
    opt_out, capped = {"skip": False}, {"max_skip": 0.25}
    settings1 = [None, opt_out, None, capped, opt_out, capped]
    settings2 = [opt_out, opt_out, None]
    with engine(tmp_path / "stock") as eng:
        upstream1, upstream2 = generate(eng, first, [None] * 6), generate(eng, second, [None] * 3)
        upstream3 = generate(eng, third, [None] * 3)
    env = dict(VSKIPPER_EXECUTION="routed", VSKIPPER_STATIC_SHAPES=static, VSKIPPER_STATS_INTERVAL="1")
    if static == "1":
        env["VSKIPPER_CHECK_SYNC"] = "1"
    with engine(path, log_level="info", **env) as eng:
        capfd.readouterr()
        out1 = generate(eng, first, settings1)
        mixed = capfd.readouterr().err
        stats1 = last_setting_stats(mixed)
        generate(eng, first, [None] * 6)  # the prefixes, computed with skipping, in the radix cache
        out2 = generate(eng, second, settings2)
        mixed += capfd.readouterr().err
        out3 = generate(eng, third, [opt_out] * 3)
        plain = capfd.readouterr().err
    budgets = {None: None, "skip": 0, "max_skip": 1}  # of 4 routed layers
    waves = ((first, settings1, out1, upstream1), (second, settings2, out2, upstream2))
    for prompts, settings, outs, upstream in waves:
        for p, s, out, up in zip(prompts, settings, outs, upstream):
            if s is opt_out:
                assert out == up, f"skip false, prompt of {len(p)}: {out} != upstream {up}"
            else:
                ref = reference_generate(base, sk, p, NEW, budgets[None if s is None else next(iter(s))])[0]
                assert out == ref[len(p):].tolist(), f"{s}, prompt of {len(p)}: {out} != reference"
    skipped = [reference_generate(base, sk, p, NEW)[0][len(p):].tolist() for p in first]
    assert any(skipped[i] != upstream1[i] for i in (1, 4)), "the skipper changes no opted-out answer: a vacuous test"
    # measured: the capped requests skip at most 1 of 4 routed layers; their neighbours skip more
    assert stats1["capped"][0] <= 0.25 and stats1["capped"][0] > 0, stats1
    assert stats1["default"][0] > 0.25 and stats1["default"][2] == 0, stats1
    assert stats1["no_skip"][0] == 0 and stats1["no_skip"][2] == stats1["no_skip"][1] > 0, stats1
    assert out3 == upstream3, f"every request skip false: {out3} != upstream {upstream3}"
    assert "as SGLang's layers" not in mixed  # a batch with a row that may skip runs the routed layers
    steps = re.findall(r"; (\d+) layer-steps ran as SGLang's layers", plain)
    assert steps and int(steps[-1]) > 0 and int(steps[-1]) % 4 == 0, plain[-3000:]  # all 4 routed layers each time
    stats3 = last_setting_stats(plain)  # counted as the cap counts budget 0: every row forced, none skipped
    assert stats3["no_skip"][0] == 0 and stats3["no_skip"][2] == stats3["no_skip"][1] > stats1["no_skip"][1], stats3


@pytest.mark.sglang
def test_bad_settings_through_the_engine_name_the_field(tmp_path):
    from sglang_util import engine
    from tiny import tiny_llama

    tiny_llama().save_pretrained(tmp_path / "stock", safe_serialization=True)
    with engine(tmp_path / "stock", VSKIPPER_SKIPPER="random:rate=0.5,layers=1-4,seed=0") as eng:
        for bad, message in (({"max_skip": 2}, r"sampling_params.custom_params.vskipper.max_skip must be a number"),
                             ({"skip": "false"}, r"sampling_params.custom_params.vskipper.skip must be true or false")):
            with pytest.raises(ValueError, match=message):
                eng.generate(input_ids=[3, 5, 7], sampling_params=sampling(bad))
        ok = eng.generate(input_ids=[3, 5, 7], sampling_params=sampling({"max_skip": 0.5}))
        assert len(ok["output_ids"]) == NEW


# --- the serving benchmark's system "vskipper, half the requests opted out" --------------------
def test_benchmark_opts_out_every_other_request_on_the_vskipper_server():
    from sglang.benchmark.datasets.common import DatasetRow

    from benchmarks.serving.client import opt_out
    from benchmarks.serving.servers import System
    from benchmarks.serving.serving import server_of

    rows = [DatasetRow(prompt=[1, 2, i], prompt_len=3, output_len=8) for i in range(6)]
    out = opt_out(rows, 0.5)
    sent = [r.extra_request_body for r in out]
    assert [bool(b) for b in sent] == [False, True] * 3
    assert sent[1] == {"sampling_params": {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True,
                                           "custom_params": {"vskipper": {"skip": False}}}}
    assert [r.prompt for r in out] == [r.prompt for r in rows] and not rows[1].extra_request_body  # copies
    assert sum(bool(r.extra_request_body) for r in opt_out(rows * 5, 0.2)) == 6
    with pytest.raises(ValueError, match="share=1.5"):
        opt_out(rows, 1.5)
    systems = [System("upstream", "m"), System("vskipper", "m", "random:rate=0.5,layers=1"),
               System("vskipper-half-opted-out", "m", "random:rate=0.5,layers=1", opted_out=0.5)]
    assert server_of(systems) == {"upstream": "upstream", "vskipper": "vskipper", "vskipper-half-opted-out": "vskipper"}


# --- the HTTP server: OpenAI routes, /generate, 400s, /metrics per setting ----------------------
def setting_metrics(url: str) -> dict[tuple[str, str], float]:
    import requests

    text = requests.get(url + "/metrics", timeout=10).text
    out = {}
    for m in re.finditer(r'^vskipper_request_setting_tokens_total\{([^}]*)\} (\S+)$', text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        out[labels["setting"], labels["route"]] = float(m.group(2))
    return out


@pytest.mark.sglang
def test_http_routes_take_the_field_refuse_bad_values_with_400_and_metrics_split_by_setting(tmp_path):
    """`vskipper serve` (the bundled SmolLM2-135M and its shipped FlexiDepth skipper): the field through
    the OpenAI client's extra_body on /v1/completions and /v1/chat/completions and in /generate's
    sampling params; bad values are 400s naming the field (streamed too), the server keeps serving;
    /metrics counts per setting; the benchmark client's opted-out requests reach the server as such."""
    import os
    import signal
    import subprocess
    import sys

    import openai
    import requests

    from benchmarks.serving.client import Client, opt_out
    from benchmarks.serving.servers import free_port, wait_healthy
    from vskipper.models.smollm2 import smollm2_dir

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("VSKIPPER_")}
    log = open(tmp_path / "server.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "vskipper.cli", "serve", "--port", str(port), "--no-calibrate",
                             "--stats-interval", "1", "--enable-metrics", "--max-total-tokens", "4096"], stdout=log,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        problem = wait_healthy(url, proc, 300)
        assert problem is None, problem + open(tmp_path / "server.log").read()[-3000:]
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        r = client.completions.create(model="default", prompt="1, 2, 3, 4,", max_tokens=8, temperature=0,
                                      extra_body={"vskipper": {"skip": False}})
        assert r.usage.completion_tokens == 8
        m = setting_metrics(url)
        assert m.get(("no_skip", "forced"), 0) > 0 and m.get(("no_skip", "project"), 0) == 0, m
        c = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Name a colour."}],
                                           max_tokens=8, temperature=0,
                                           extra_body={"vskipper": {"max_skip": 0.2}, "ignore_eos": True})
        assert c.usage.completion_tokens == 8
        m = setting_metrics(url)
        capped = m.get(("capped", "run"), 0) + m.get(("capped", "project"), 0)
        assert capped > 0 and m.get(("capped", "project"), 0) <= 0.2 * capped and m[("capped", "forced")] > 0, m
        default = m.get(("default", "run"), 0) + m.get(("default", "project"), 0)
        assert m.get(("default", "project"), 0) > 0.2 * default, m

        for bad, field in (({"max_skip": 2}, "vskipper.max_skip"), ({"skip": "no"}, "vskipper.skip"),
                           ({"speed": 1}, "vskipper.speed is not a field"), ("fast", "vskipper must be an object")):
            with pytest.raises(openai.BadRequestError, match=re.escape(field)):
                client.completions.create(model="default", prompt="Hi", max_tokens=4, extra_body={"vskipper": bad})
            with pytest.raises(openai.BadRequestError, match=re.escape(field)):
                client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=4, stream=True, extra_body={"vskipper": bad})
        with pytest.raises(openai.BadRequestError, match="custom_params.vskipper.max_skip"):
            client.completions.create(model="default", prompt="Hi", max_tokens=4,
                                      extra_body={"custom_params": {"vskipper": {"max_skip": -1}}})
        sp = {"max_new_tokens": 4, "temperature": 0}
        bad = requests.post(url + "/generate", json={"text": "Hi", "sampling_params": {
            **sp, "custom_params": {"vskipper": {"max_skip": 1.5}}}}, timeout=60)
        assert bad.status_code == 400 and "sampling_params.custom_params.vskipper.max_skip" in bad.text, bad.text
        good = requests.post(url + "/generate", json={"text": "Hi", "sampling_params": {
            **sp, "custom_params": {"vskipper": {"skip": False}}}}, timeout=60)
        assert good.status_code == 200, good.text

        before = setting_metrics(url)
        bench = Client(str(smollm2_dir()), tmp_path / "bench")
        res = bench.run(url, opt_out(bench.prompt_rows(4, 8, 0), 0.5), concurrency=None)
        assert res.completed == 4, res.errors
        after = setting_metrics(url)
        assert after[("no_skip", "forced")] > before[("no_skip", "forced")]
        rows = lambda m: m[("default", "run")] + m[("default", "project")]  # noqa: E731
        assert rows(after) > rows(before)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
