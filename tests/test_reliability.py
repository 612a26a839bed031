"""Reliability of SGLang + vskipper on CPU, through the real HTTP server (`vskipper serve`):

- faults: the server SIGKILLed mid-run loses only its in-flight requests, and a restart answers
  the probe set exactly as before; a router that outputs NaN for some rows serves finite,
  reference-equal greedy tokens and counts those rows as "nonfinite";
- bad input at the serving boundary: a clear 400 naming the problem, then the server keeps
  answering correctly;
- security: the HTTP socket is bound to 127.0.0.1 only, and no process of the server listens on
  all interfaces;
- the soak's (benchmarks/serving/soak.py) request mix and its checks, without a server: each check can fail.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import vskipper
from benchmarks.serving import soak_traffic
from benchmarks.serving.servers import free_port, wait_healthy
from benchmarks.serving.soak import Report, summary
from benchmarks.serving.soak_traffic import Job, Outcome
from vskipper.models.hf_loader import save_checkpoint
from vskipper.reference import reference_generate

from tiny import VOCAB, flexidepth_for, tiny_llama

requests = pytest.importorskip("requests")
psutil = pytest.importorskip("psutil")

NEW = 12  # output tokens of a probe
CONTEXT = 256  # tiny models' max_position_embeddings: SGLang's context length


# --- one server: `vskipper serve` in its own process group ---------------------------------
@dataclass
class Served:
    proc: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:]


def launch(model: Path, log: Path, port: int | None = None, *extra: str, timeout: float = 240) -> Served:
    """`vskipper serve` for a tiny model (no tokenizer), waited on until /health answers 200."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "vskipper.cli", "serve", "--model-path", str(model), "--skip-tokenizer-init",
           "--no-calibrate", "--port", str(port), "--max-total-tokens", "4096", *extra]
    env = {k: v for k, v in os.environ.items() if not k.startswith("VSKIPPER_")}
    srv = Served(subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env,
                                  start_new_session=True), port, log)
    problem = wait_healthy(srv.url, srv.proc, timeout)
    if problem is None:
        return srv
    shutdown(srv)
    raise AssertionError(f"server {problem}:\n{srv.tail()}")


def group_alive(pgid: int, wait: float = 0.0) -> list[str]:
    """Live (not zombie) processes of a process group, after waiting up to `wait` s for them to go."""
    t0 = time.time()
    while True:
        alive = []
        for p in psutil.process_iter(["name", "status"]):
            try:
                if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                    alive.append(f"{p.pid} {p.info['name']}")
            except (ProcessLookupError, psutil.Error):
                pass
        if not alive or time.time() - t0 >= wait:
            return alive
        time.sleep(0.5)


def shutdown(srv: Served) -> None:
    """SIGTERM to the whole process group, SIGKILL after 30 s; nothing is left behind."""
    if srv.proc.poll() is None:
        os.killpg(srv.proc.pid, signal.SIGTERM)
        try:
            srv.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    if group_alive(srv.proc.pid, wait=5):
        os.killpg(srv.proc.pid, signal.SIGKILL)
    srv.proc.wait()


# --- requests --------------------------------------------------------------------------------
def sampling(n: int) -> dict:
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}


def probes(seed: int = 11) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g) for n in (1, 5, 13, 30)]


def generate(url: str, prompts: list[torch.Tensor], n: int = NEW, **extra) -> list[dict]:
    """One batched /generate request; every answer must have exactly n tokens."""
    body = {"input_ids": [p.tolist() for p in prompts], "sampling_params": sampling(n), **extra}
    r = requests.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [len(o["output_ids"]) for o in out] == [n] * len(prompts), out
    return out


def greedy(url: str, prompts: list[torch.Tensor], n: int = NEW) -> list[list[int]]:
    return [o["output_ids"] for o in generate(url, prompts, n)]


def reference(base, skipper, prompts, n: int = NEW) -> list[list[int]]:
    return [reference_generate(base, skipper, p, n)[0][len(p):].tolist() for p in prompts]


def assert_answers(url: str, prompts, expected: list[list[int]]) -> None:
    got = greedy(url, prompts)
    for p, a, b in zip(prompts, got, expected):
        assert a == b, f"prompt of {len(p)} tokens: server {a} != expected {b}"


def post_error(url: str, payload: dict) -> str:
    """POST /generate with bad input: must answer HTTP 400 with an error object, or, streaming (the
    status line is already sent), an error event with code 400 and nothing else; returns its message."""
    r = requests.post(url + "/generate", json=payload, timeout=60)
    if not payload.get("stream"):
        assert r.status_code == 400, f"HTTP {r.status_code}: {r.text[:500]}"
        return r.json()["error"]["message"]
    events = [line[5:].strip() for line in r.text.splitlines() if line.startswith("data:")]
    assert len(events) == 2 and events[1] == "[DONE]", r.text[:500]
    error = json.loads(events[0])["error"]
    assert error["code"] == 400, error
    return error["message"]


def assert_healthy(url: str) -> None:
    assert requests.get(url + "/health", timeout=30).status_code == 200


# --- faults: SIGKILL mid-run, restart ----------------------------------------------------------
@dataclass
class Streamed:
    tokens: int = 0
    finished: bool = False
    error: str = ""


def stream(url: str, prompt: torch.Tensor, n: int, first: threading.Event, out: Streamed) -> None:
    payload = {"input_ids": prompt.tolist(), "sampling_params": sampling(n), "stream": True}
    try:
        with requests.post(url + "/generate", json=payload, stream=True, timeout=(5, 60)) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                msg = json.loads(line[5:])
                out.tokens = msg["meta_info"]["completion_tokens"]
                out.finished = msg["meta_info"]["finish_reason"] is not None
                first.set()
    except Exception as e:  # what a client sees when the server dies under it
        out.error = repr(e)
    finally:
        first.set()


@pytest.mark.sglang
def test_sigkill_mid_run_fails_only_in_flight_requests_and_a_restart_answers_as_before(tmp_path):
    base = tiny_llama()
    sk = flexidepth_for(base, [1, 3, 4, 5], gate="soft")
    path = save_checkpoint(tmp_path / "ckpt", base, sk)
    ps = probes()
    expected = reference(base, sk, ps)
    srv = launch(path, tmp_path / "first.log")
    restarted = None
    try:
        before = greedy(srv.url, ps)
        assert before == expected, f"before the kill: server {before} != reference {expected}"
        # requests that finish before the kill: concurrent, each must complete in full
        g = torch.Generator().manual_seed(3)
        early = [torch.randint(1, VOCAB, (n,), generator=g) for n in (2, 7, 19, 4, 11, 3)]
        done = [Streamed() for _ in early]
        threads = [threading.Thread(target=stream, args=(srv.url, p, 24, threading.Event(), d))
                   for p, d in zip(early, done)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert [(d.tokens, d.finished, d.error) for d in done] == [(24, True, "")] * len(early)

        # requests in flight at the kill: long streams, each seen producing tokens first
        long_n = CONTEXT - 40
        flight = [Streamed() for _ in range(4)]
        firsts = [threading.Event() for _ in flight]
        threads = [threading.Thread(target=stream, args=(srv.url, early[i], long_n, firsts[i], flight[i]))
                   for i in range(len(flight))]
        for t in threads:
            t.start()
        assert all(e.wait(timeout=60) for e in firsts), "in-flight requests never started streaming"
        assert not any(f.finished or f.error for f in flight), [vars(f) for f in flight]
        os.killpg(srv.proc.pid, signal.SIGKILL)
        t_kill = time.time()
        for t in threads:
            t.join(timeout=30)
        assert not any(t.is_alive() for t in threads), "a client hung on a killed server"
        assert time.time() - t_kill < 30
        for f in flight:  # each in-flight client sees a failure, never a complete answer
            assert not f.finished and f.tokens < long_n, vars(f)
        srv.proc.wait(timeout=10)
        left = group_alive(srv.proc.pid, wait=10)
        assert not left, f"processes of the killed server survived SIGKILL to its group: {left}"

        restarted = launch(path, tmp_path / "restarted.log", srv.port)  # same port: SO_REUSEADDR after a kill
        assert greedy(restarted.url, ps) == before
    finally:
        shutdown(srv)
        if restarted is not None:
            shutdown(restarted)


# --- faults: a router that outputs NaN ---------------------------------------------------------
def metric(text: str, layer: int, route: str) -> float:
    m = re.search(rf'vskipper_routed_layer_tokens_total\{{layer="{layer}",route="{route}"\}} (\S+)', text)
    return float(m.group(1)) if m else 0.0


@pytest.mark.sglang
def test_router_with_nan_rows_serves_finite_reference_tokens_and_counts_them(tmp_path):
    """FlexiDepth's router ends in a sigmoid, so weights with Inf/NaN make its output NaN (a
    router cannot output Inf through it). Layer 1: router_head has +Inf and -Inf entries, so a row
    gets NaN (Inf - Inf) or sigmoid(+-Inf) = 1 / 0 depending on signs: NaN for some rows. Layer 3:
    a NaN in router_norm: NaN for every row. Defined behaviour: NaN rows run the layer with g = 1."""
    base = tiny_llama()
    sk = flexidepth_for(base, [1, 3, 4], gate="soft")
    with torch.no_grad():
        sk.router(1).router_head.weight[0, :2] = torch.tensor([math.inf, -math.inf])
        sk.router(3).router_norm.weight[0] = math.nan
    path = save_checkpoint(tmp_path / "ckpt", base, sk)
    ps = probes()
    # the test exercises what it claims: layer 1's router gives NaN for some rows, not all
    x = []
    hook = base.model.layers[1].input_layernorm.register_forward_hook(lambda m, a, out: x.append(out[0]))
    with torch.no_grad():
        for p in ps:
            base(p[None])
        hook.remove()
        g1 = sk.router(1)(torch.cat(x))
        g3 = sk.router(3)(torch.cat(x))
    assert g1.isnan().any() and (~g1.isnan()).any() and g3.isnan().all()
    expected = reference(base, sk, ps)

    srv = launch(path, tmp_path / "server.log", None, "--enable-metrics", "--stats-interval", "1")
    try:
        out = generate(srv.url, ps, return_logprob=True)
        for p, o, e in zip(ps, out, expected):
            assert o["output_ids"] == e, f"prompt of {len(p)} tokens: server {o['output_ids']} != reference {e}"
            lp = [t[0] for t in o["meta_info"]["output_token_logprobs"]]
            assert len(lp) == NEW and all(math.isfinite(v) for v in lp), lp
        text = requests.get(srv.url + "/metrics", timeout=10).text
        nf1, nf3 = metric(text, 1, "nonfinite"), metric(text, 3, "nonfinite")
        assert nf3 > 0 and nf3 == metric(text, 3, "run") and metric(text, 3, "project") == 0, text[-3000:]
        assert 0 < nf1 < metric(text, 1, "run") and metric(text, 1, "project") > 0, text[-3000:]
        assert metric(text, 4, "nonfinite") == 0
        assert_healthy(srv.url)
    finally:
        shutdown(srv)


# --- bad input and security: one server for the module ----------------------------------------
SPEC = "random:rate=0.5,layers=1-5,seed=3"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`vskipper serve` (default host) of a stock tiny Llama with a random skipper, and the
    reference answers to the probe set."""
    d = tmp_path_factory.mktemp("served")
    base = tiny_llama()
    base.save_pretrained(d / "stock", safe_serialization=True)
    srv = launch(d / "stock", d / "server.log", None, "--skipper", SPEC)
    try:
        yield srv, reference(base, vskipper.parse_skipper(SPEC), probes())
    finally:
        shutdown(srv)


@pytest.mark.sglang
def test_prompt_longer_than_the_context_is_refused_and_the_server_keeps_answering(served):
    srv, expected = served
    msg = post_error(srv.url, {"input_ids": [7] * (CONTEXT + 44), "sampling_params": sampling(4)})
    assert msg == (f"The input ({CONTEXT + 44} tokens) is longer than the model's context length "
                   f"({CONTEXT} tokens)."), msg
    msg = post_error(srv.url, {"input_ids": [7] * (CONTEXT - 6), "sampling_params": sampling(8)})
    assert f"exceeds the model's maximum context length of {CONTEXT} tokens" in msg, msg
    assert f"a total of {CONTEXT + 2} tokens" in msg, msg
    assert_healthy(srv.url)
    assert_answers(srv.url, probes(), expected)


@pytest.mark.sglang
def test_empty_prompt_is_refused_and_the_server_keeps_answering(served):
    srv, expected = served
    for payload in ({"input_ids": []}, {"input_ids": [], "stream": True}):
        msg = post_error(srv.url, {**payload, "sampling_params": sampling(4)})
        assert msg == "input_ids cannot be empty.", msg
    msg = post_error(srv.url, {"text": "", "sampling_params": sampling(4)})  # no tokenizer: text is refused
    assert "cannot accept text prompts" in msg, msg
    assert_healthy(srv.url)
    assert_answers(srv.url, probes(), expected)


@pytest.mark.sglang
def test_empty_prompt_inside_a_batch_is_refused(served):
    """SGLang 0.5.23 alone answers it with the logits of the request before it
    (GenerateReqInput._determine_batch_size rejects only an empty outer list); the plugin's check
    before TokenizerManager._validate_one_request refuses it."""
    srv, expected = served
    msg = post_error(srv.url, {"input_ids": [[3, 4], []], "sampling_params": sampling(4)})
    assert "empty prompt" in msg, msg
    assert_healthy(srv.url)
    assert_answers(srv.url, probes(), expected)


@pytest.mark.sglang
def test_http_socket_is_bound_to_loopback_only(served):
    srv, _ = served
    tree = [psutil.Process(srv.proc.pid)] + psutil.Process(srv.proc.pid).children(recursive=True)
    on_port = [c.laddr.ip for p in tree for c in p.net_connections(kind="inet")
               if c.status == psutil.CONN_LISTEN and c.laddr.port == srv.port]
    assert on_port == ["127.0.0.1"], on_port
    # and from the outside: the port refuses connections on every non-loopback address of this host
    others = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
              if a.family == socket.AF_INET and not a.address.startswith("127.")]
    for ip in others:
        with socket.socket() as s:
            s.settimeout(2)
            assert s.connect_ex((ip, srv.port)) != 0, f"port {srv.port} answers on {ip}"
    assert_healthy(srv.url)


@pytest.mark.sglang
def test_no_server_process_listens_on_all_interfaces(served):
    """SGLang's one-rank init_process_group(tcp://127.0.0.1:<port>) makes a torch TCPStore that
    listens on '::' whatever host it is given; `vskipper serve` rendezvouses through a file instead."""
    srv, _ = served
    tree = [psutil.Process(srv.proc.pid)] + psutil.Process(srv.proc.pid).children(recursive=True)
    wild = [(p.name(), c.laddr) for p in tree for c in p.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.ip in ("0.0.0.0", "::")]
    assert not wild, wild


@pytest.mark.sglang
def test_out_of_vocabulary_token_ids_are_refused_and_the_server_keeps_answering(served):
    """SGLang 0.5.23 alone does not range-check input_ids: an id >= vocab_size raised IndexError in
    the scheduler's embedding, and the whole server exited with every request in flight. Last in
    this module, so that a regression shows here and not as a dead server in the tests after it."""
    srv, expected = served
    for bad in (VOCAB, VOCAB + 5000, -4):
        try:
            msg = post_error(srv.url, {"input_ids": [1, bad, 3], "sampling_params": sampling(4)})
        except requests.RequestException as e:
            pytest.fail(f"the server died on token id {bad}: {e!r}")
        assert f"[{bad}]" in msg and f"vocabulary [0, {VOCAB})" in msg, msg
    msg = post_error(srv.url, {"input_ids": [[1, 2], [3, VOCAB]], "sampling_params": sampling(4)})
    assert f"[{VOCAB}]" in msg, msg
    assert_healthy(srv.url)
    assert_answers(srv.url, probes(), expected)


# --- the soak, without a server ------------------------------------------------------------------
def test_soak_mix_is_seeded_poisson_with_every_kind_of_request():
    prompts = [f"prompt {i}." for i in range(50)]
    jobs = soak_traffic.mixed_jobs(prompts, rate=2.0, duration=300, seed=0)
    assert jobs == soak_traffic.mixed_jobs(prompts, rate=2.0, duration=300, seed=0)
    assert jobs != soak_traffic.mixed_jobs(prompts, rate=2.0, duration=300, seed=1)
    assert abs(len(jobs) - 600) < 4 * math.sqrt(600), len(jobs)
    assert all(0 <= j.arrival < 300 for j in jobs) and [j.arrival for j in jobs] == sorted(j.arrival for j in jobs)
    for kind, share in soak_traffic.KINDS.items():
        assert abs(sum(j.kind == kind for j in jobs) / len(jobs) - share) < 0.07, kind
    long = [j for j in jobs if j.prompt not in prompts]
    assert abs(len(long) / len(jobs) - soak_traffic.LONG_FRACTION) < 0.07
    assert all(j.prompt.count("prompt") >= soak_traffic.LONG_PARTS[0] for j in long)
    assert {j.max_new_tokens for j in jobs} == set(soak_traffic.NEW_TOKENS)
    assert all(1 <= j.cancel_after <= j.max_new_tokens // 2 for j in jobs if j.kind == "disconnect")
    probes = soak_traffic.probe_jobs(soak_traffic.probe_set(prompts), duration=120, every=30)
    assert sorted({j.arrival for j in probes}) == [15, 45, 75, 105] and len(probes) == 4 * 6


def soak_report(**edit):
    """A passing soak report: 3 completed requests, 1 cancelled, 2 probes equal to the idle answers."""
    idle = [[1, 2, 3], [4, 5, 6]]
    outs = [Outcome(Job(0.5 * i, "p", 16, kind), "completed", 16, "length", None, 0.1, 1.0, span=(0.5 * i, 0.5 * i + 1))
            for i, kind in enumerate(["stream", "full", "stream"])]
    outs.append(Outcome(Job(2.0, "p", 32, "disconnect", cancel_after=5), "cancelled", 5, span=(2.0, 2.5)))
    outs += [Outcome(Job(1.0, "q", 3, "probe", probe=i, round=0), "completed", 3, "length", list(ids), 0.1, 0.2,
                     span=(1.0, 1.2)) for i, ids in enumerate(idle)]
    rep = Report("m", "random:rate=0.5,layers=1,seed=0", rate=1.0, rate_source="--rate", duration=10,
                 loadavg_start=(0.1, 0.1, 0.1), outcomes=outs, wall=4.0, rss_baseline=1000,
                 rss_samples=[(0, 1000), (2, 1050)], idle_before=idle, idle_after=[list(x) for x in idle],
                 healthy_after=True)
    for k, v in edit.items():
        setattr(rep, k, v(rep.outcomes) if callable(v) else v)
    return rep


def first_answer(tokens: int, finish: str):
    """Replace the first request's outcome with a completed one of `tokens` tokens."""
    return lambda outs: [Outcome(outs[0].job, "completed", tokens, finish, span=(0, 1))] + outs[1:]


@pytest.mark.parametrize("edit, failing", [
    (dict(outcomes=lambda outs: outs + [Outcome(outs[0].job, "failed", error="boom", span=(1, 2))]),
     "no request failed"),
    (dict(outcomes=first_answer(15, "length")), "every completed request has its requested token count"),
    (dict(outcomes=first_answer(16, "abort")), "every completed request has its requested token count"),
    (dict(rss_samples=[(0, 1000), (2, 1101)]), "server RSS within 10% of the warm baseline"),
    (dict(idle_after=[[1, 2, 3], [4, 5, 7]]), "idle probe answers after the load equal those before"),
    (dict(healthy_after=False), "server healthy after the load"),
], ids=["failed", "short", "stopped-early", "rss", "idle-changed", "died"])
def test_soak_checks_each_fail_when_they_should(edit, failing):
    text, ok = summary(soak_report())
    assert ok and text.rstrip().endswith("**PASS**") and "**FAIL**" not in text, text
    assert "| **all** | 6 | 5 | 1 | 0 |" in text, text
    text, ok = summary(soak_report(**edit))
    assert not ok and text.rstrip().endswith("**FAIL**"), text
    assert f"| {failing} | **FAIL** |" in text, text
    assert text.count("| **FAIL** |") == 1, text


def test_soak_reports_probe_disagreement_under_load_without_failing():
    def disagree(outs):
        outs[-1].output_ids = [4, 9, 9]
        return outs

    text, ok = summary(soak_report(outcomes=disagree))
    assert ok, text
    assert "equal to the idle server's answers: 1/2 (50%); the others first differ at token [1]" in text, text


def test_soak_with_opted_out_requests_checks_skip_false_probes_against_upstream():
    prompts = [f"prompt {i}." for i in range(50)]
    plain = soak_traffic.mixed_jobs(prompts, rate=2.0, duration=60, seed=0)
    quarter = soak_traffic.mixed_jobs(prompts, rate=2.0, duration=60, seed=0, opted_out=0.25)
    assert [dataclasses.replace(j, skip=True) for j in quarter] == plain  # the same mix, only the field differs
    assert [i for i, j in enumerate(quarter) if not j.skip] == list(range(3, len(quarter), 4))  # one in four
    riders = soak_traffic.probe_jobs(soak_traffic.probe_set(prompts), duration=120, every=30, opted_out=True)
    assert len(riders) == 2 * 4 * 6 and sum(not j.skip for j in riders) == 4 * 6

    up = [[1, 2, 3], [4, 5, 8]]  # upstream's answers (the skipper's idle answers: [4, 5, 6] for the second)
    off = lambda outs: outs + [Outcome(Job(1.5, "q", 3, "probe", probe=i, round=0, skip=False), "completed", 3,  # noqa: E731
                                       "length", list(ids), 0.1, 0.2, span=(1.5, 1.7)) for i, ids in enumerate(up)]
    good = dict(opted_out=0.25, upstream=up, off_before=[list(x) for x in up], off_after=[list(x) for x in up],
                tpot_ms=40.0, levels={"0": 30.0, "3": 10.0})
    text, ok = summary(soak_report(outcomes=off, **good))
    assert ok, text
    assert "before and after the load, equal upstream SGLang's answers | pass | 4/4 equal |" in text, text
    assert "skip-false probes during the load equal to upstream SGLang's answers: 2/2" in text
    assert "equal to the idle server's answers: 2/2" in text  # the skip-false probes are not compared with those
    assert "tokens per level: level 0 75.0%, level 3 25.0%" in text and "TPOT target of 40 ms" in text
    text, ok = summary(soak_report(outcomes=off, **{**good, "off_after": [[1, 2, 3], [4, 5, 6]]}))
    assert not ok and "| **FAIL** | 3/4 equal |" in text, text
