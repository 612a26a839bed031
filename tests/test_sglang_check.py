"""benchmarks/gpu/sglang_check.sh cannot rot: its --smoke run (upstream and vskipper servers on CPU with a
tiny dummy-weight Llama, SGLang's own benchmark client, the route counters), its bad-input exits, and
the pieces it is built from (the model directory, the memory plan, the commands, the counters' checks,
the table)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu" / "sglang_check.sh"


def run_check(*args, out: Path, timeout: float = 60, **env) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, **env}
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=timeout)


def free_ports(n: int = 3) -> int:
    """A base port with n free ports from it (below the kernel's ephemeral range, as SGLang picks its own)."""
    import random

    for base in random.sample(range(12000, 21000), 200):
        try:
            for p in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no free ports")


def alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


# --- the whole run ------------------------------------------------------------------------------
@pytest.mark.sglang
@pytest.mark.slow
def test_smoke_run_serves_benchmarks_and_proves_the_routed_path(tmp_path):
    r = run_check("--smoke", "--port", str(free_ports()), out=tmp_path, timeout=420)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    page = (tmp_path / "sglang-check.md").read_text()
    record = json.loads((tmp_path / "results.json").read_text())
    res = record["results"]
    assert res["passed"] is True and record["name"] == "sglang-check"
    assert all(c["ok"] for c in res["checks"]) and len(res["checks"]) == 17
    assert f"Checks: {len(res['checks'])}/{len(res['checks'])} passed." in page
    assert page.rstrip().splitlines()[-1].startswith("| prefill-heavy")  # it ends with the table
    assert "| workload | system | output tok/s | vs upstream | mean TTFT (ms) |" in page
    rows = [x for x in page.splitlines() if x.startswith(("| decode-heavy", "| prefill-heavy"))]
    assert len(rows) == 6 and sum("| upstream SGLang | " in x for x in rows) == 2
    # every measured call went through SGLang's client and completed every request
    assert len(res["calls"]) == 6 and all(c["result"]["completed"] == 8 for c in res["calls"])
    for c in res["calls"]:
        log = (tmp_path / "bench" / f"{c['workload']}-{c['system']}-r0.log").read_text()
        assert log.startswith("$ python -m sglang.benchmark.serving --backend sglang") and "random-ids" in log
    # the counters: upstream none, rate 0 counted every token and skipped none, RandomSkip 0.5 about half
    counts = {(c["system"], c["workload"]): c for c in res["counts"]}
    assert not counts[("upstream", "decode-heavy")]["layers"]
    for system, lo, hi in (("vskipper-rate0", 0.0, 0.0), ("vskipper", 0.4, 0.6)):
        for w in ("decode-heavy", "prefill-heavy"):
            layers = counts[(system, w)]["layers"]
            assert sorted(int(k) for k in layers) == [2, 3], layers
            run, project = (sum(v[i] for v in layers.values()) for i in (0, 1))
            assert run + project > 0 and lo <= project / (run + project) <= hi, (system, w, layers)
            assert all(sum(v) > 0 for v in counts[(system, w)]["phases"].values())
    info = res["servers"]
    assert info["upstream"]["transform"] is None and "RandomSkip [random:rate=0.5" in info["vskipper"]["transform"]
    assert "execution='routed'" in info["vskipper"]["transform"]
    # every server it started is gone
    pids = [int(x.split()[0]) for x in (tmp_path / "servers.pids").read_text().splitlines()]
    assert len(pids) == 3 and not any(alive(p) for p in pids)


# --- bad input --------------------------------------------------------------------------------
def test_bad_arguments_exit_2(tmp_path):
    for args, msg in ((["--fast"], "unknown argument '--fast'"), (["--port", "abc"], "--port 'abc'"),
                      (["--port"], "--port needs a value"), (["--time-limit", "5"], "--time-limit '5'"),
                      (["--decode"], "--decode needs a value")):
        r = run_check(*args, out=tmp_path)
        assert r.returncode == 2 and msg in r.stderr, (args, r.stderr)


def test_missing_package_is_named(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")  # -S: no site-packages
    fake.chmod(0o755)
    r = run_check("--smoke", out=tmp_path / "out", PYTHON=str(fake))
    assert r.returncode == 2 and "missing python package(s): torch, sglang" in r.stderr, r.stderr


@pytest.mark.skipif(not __import__("importlib").util.find_spec("sglang"), reason="needs SGLang")
def test_plugin_left_out_port_in_use_and_no_gpu_exit_2(tmp_path):
    import torch

    r = run_check("--smoke", out=tmp_path, SGLANG_PLUGINS="other")
    assert r.returncode == 2 and "SGLANG_PLUGINS='other' leaves vskipper's plugin out" in r.stderr, r.stderr
    base = free_ports()
    with socket.socket() as s:
        s.bind(("127.0.0.1", base + 1))
        s.listen()
        r = run_check("--smoke", "--port", str(base), out=tmp_path)
    assert r.returncode == 2, r.stderr
    assert f"port {base + 1} is in use" in r.stderr and f"ports {base}-{base + 2}" in r.stderr and "--port" in r.stderr
    assert not (tmp_path / "servers.pids").exists()  # nothing was started
    if not torch.cuda.is_available():
        r = run_check("--port", str(base), out=tmp_path)
        assert r.returncode == 2 and "no CUDA device: this check needs a GPU" in r.stderr and "--smoke" in r.stderr


def test_bad_workloads_and_model_paths_exit_2(tmp_path):
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu.sglang_check", "--out", str(tmp_path), "--smoke",
                        "--decode", "16,32,8"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--decode '16,32,8': expected INPUT,OUTPUT,PROMPTS,CONCURRENCY" in r.stderr
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu.sglang_check", "--out", str(tmp_path), "--smoke",
                        "--prefill", "16,0,8,2"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "output_len=0 must be >= 1" in r.stderr
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu.sglang_check", "--out", str(tmp_path), "--smoke",
                        "--model-path", str(tmp_path / "nowhere")], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "no config.json there" in r.stderr


# --- the pieces ----------------------------------------------------------------------------------
def test_model_dir_and_its_tokenizer(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    from benchmarks.gpu import sglang_model as M

    path = M.write_model_dir(tmp_path / "m", M.SMOKE_SHAPE, "float32")
    cfg = AutoConfig.from_pretrained(path)
    assert cfg.architectures == ["LlamaForCausalLM"] and cfg.num_hidden_layers == 4 and cfg.vocab_size == 512
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.vocab_size == 512 and tok.num_special_tokens_to_add() == 0
    ids = [0, 5, 511, 7]
    assert tok.encode(tok.decode(ids)) == ids  # every id decodes, and the text reads back as the same ids
    assert M.routed_range(32) == "16-31" and M.routed_range(4) == "2-3"
    big = M.llama_config(M.LLAMA3_8B, "bfloat16")
    assert (big["hidden_size"], big["intermediate_size"], big["num_key_value_heads"], big["vocab_size"]) == \
        (4096, 14336, 8, 128256)


def test_memory_plan_for_three_8b_servers(tmp_path, monkeypatch):
    from benchmarks.gpu import sglang_check as C
    from benchmarks.gpu import sglang_model as M

    cfg = M.llama_config(M.LLAMA3_8B, "bfloat16")
    weights, per_token = C.model_bytes(cfg)
    assert 16.0e9 < weights < 16.1e9 and per_token == 32 * 8 * 128 * 2 * 2  # 8.03B params in bf16; 128 KiB
    args = C.parse(["--out", str(tmp_path)])

    def probe(free):
        return lambda *a, **k: subprocess.CompletedProcess(a, 0, f"{free} {free} NVIDIA H100 80GB HBM3\n", "")

    monkeypatch.setattr(C.subprocess, "run", probe(84.5e9))  # an idle H100
    tokens, what = C.gpu_kv_tokens(args, cfg)
    assert 40960 <= tokens <= 65536 and tokens % 1024 == 0 and "NVIDIA H100" in what
    monkeypatch.setattr(C.subprocess, "run", probe(150e9))  # an H200: capped
    assert C.gpu_kv_tokens(args, cfg)[0] == 65536
    monkeypatch.setattr(C.subprocess, "run", probe(60e9))
    with pytest.raises(C.BadInput, match="the workloads hold up to 40960 in flight"):
        C.gpu_kv_tokens(args, cfg)


def test_server_commands(tmp_path):
    from benchmarks.gpu import sglang_check as C

    def command(smoke, system):
        args = C.parse(["--out", str(tmp_path)] + (["--smoke"] if smoke else []) + ["--sglang-args", "--foo 1"])
        return C.server_command(system, args, 31000, tmp_path / "m", tmp_path / "t", "16-31", 49152, 64)

    up, rate0, half = C.SYSTEMS
    cmd, env = command(False, up)
    assert cmd[1:3] == ["-m", "sglang.launch_server"] and "vskipper" not in env["SGLANG_PLUGINS"].split(",")
    assert "--cuda-graph-max-bs-decode" in cmd and "--device" not in cmd and cmd[-2:] == ["--foo", "1"]
    assert "--disable-cuda-graph" not in cmd and "SGLANG_PLATFORM" not in env
    for system, spec in ((rate0, "random:rate=0,layers=16-31,seed=0"), (half, "random:rate=0.5,layers=16-31,seed=0")):
        cmd, env = command(False, system)
        assert cmd[1:4] == ["-m", "vskipper.cli", "serve"] and cmd[cmd.index("--skipper") + 1] == spec
        assert cmd[cmd.index("--execution") + 1] == "routed" and "SGLANG_PLUGINS" not in env
    for system in C.SYSTEMS:  # the same SGLang flags for every system
        cmd, env = command(True, system)
        i = cmd.index("--tokenizer-path")
        assert cmd[i:] == command(True, up)[0][command(True, up)[0].index("--tokenizer-path"):]
        assert env["SGLANG_PLATFORM"] == "vskipper_cpu" and cmd[cmd.index("--device") + 1] == "cpu"
        assert cmd[cmd.index("--max-total-tokens") + 1] == "49152" and "--enable-metrics" in cmd


METRICS = """# HELP vskipper_routed_layer_tokens_total Tokens
vskipper_routed_layer_tokens_total{layer="2",route="run"} 30.0
vskipper_routed_layer_tokens_total{layer="2",route="project"} 10.0
vskipper_routed_layer_tokens_total{layer="2",route="nonfinite"} 0.0
vskipper_routed_layer_tokens_total{layer="3",route="run"} 20.0
vskipper_routed_layer_tokens_total{layer="3",route="project"} 20.0
vskipper_routed_layer_tokens_total{layer="3",route="run"} 5.0
vskipper_routed_layer_phase_tokens_total{phase="prefill",route="run"} 40.0
vskipper_routed_layer_phase_tokens_total{phase="prefill",route="project"} 25.0
vskipper_routed_layer_phase_tokens_total{phase="decode",route="run"} 15.0
vskipper_routed_layer_phase_tokens_total{phase="decode",route="project"} 5.0
sglang:num_requests_total 3
"""


def test_counters_and_their_checks():
    from benchmarks.gpu import sglang_report as rep

    c = rep.parse_counts(METRICS)
    assert c.layers == {2: (30.0, 10.0), 3: (25.0, 20.0)} and c.series == 10  # a label set's series summed
    assert c.phases == {"prefill": (40.0, 25.0), "decode": (15.0, 5.0)}
    d = rep.counts_delta(c, rep.parse_counts(METRICS.replace(" 30.0", " 10.0")))
    assert d.layers[2] == (20.0, 0.0) and d.layers[3] == (0.0, 0.0)
    assert rep.add_counts(d, d).layers[2] == (40.0, 0.0)
    none = rep.parse_counts("sglang:num_requests_total 3\n")
    assert [x.ok for x in rep.check_counts("upstream", None, [2, 3], none)] == [True]
    assert [x.ok for x in rep.check_counts("upstream", None, [2, 3], c)] == [False]
    half = rep.parse_counts(METRICS.replace(" 30.0", " 10.0").replace('"3",route="run"} 5.0', '"3",route="run"} 0.0'))
    assert all(x.ok for x in rep.check_counts("vskipper", 0.5, [2, 3], half))  # 30 of 60 skipped
    checks = rep.check_counts("vskipper", 0.5, [2, 3, 4], c)
    assert [x.ok for x in checks] == [False, True, True]  # layer 4 counted nothing; 30 of 85 is within 4 sd of half
    assert "none at [4]" in checks[0].detail and "skipped 0.3529 of 85 (expected 0.5 +- 0.217)" in checks[2].detail
    big = rep.Counts({2: (3000.0, 1000.0), 3: (2000.0, 2000.0)}, c.phases, 4)
    assert not rep.check_counts("vskipper", 0.5, [2, 3], big)[2].ok  # 3000 of 8000: not half
    assert not rep.check_counts("vskipper-rate0", 0.0, [2, 3], c)[2].ok  # rate 0 skips nothing, exactly
    assert not rep.check_counts("vskipper", 0.5, [2], c)[0].ok  # a counter at an unrouted layer


def test_report_ratios_against_upstream():
    from benchmarks.gpu import sglang_check as C
    from benchmarks.gpu import sglang_report as rep

    w = C.Workload("decode-heavy", 16, 32, 8, 4)
    figures = {"upstream": (100.0, 40.0, 8.0), "vskipper-rate0": (100.0, 40.0, 8.0), "vskipper": (200.0, 20.0, 5.0)}
    calls = [{"workload": w.name, "system": n, "round": 0, "result": {"output_throughput": t, "mean_ttft_ms": f,
                                                                      "mean_tpot_ms": p, "completed": 8}}
             for n, (t, f, p) in figures.items()]
    c = rep.parse_counts(METRICS)
    md = rep.report([w], list(C.SYSTEMS), calls, {(w.name, "vskipper"): c}, [rep.Check("x", False, "why")], "head")
    row = [x for x in md.splitlines() if "| vskipper, RandomSkip 0.5 |" in x][0]
    assert "| 200.0 | 2.000x | 20.0 | 2.000x | 5.00 | 1.600x | 85 | 0.353 (0.385 / 0.250) |" in row
    assert "Checks: 0/1 passed; FAILED: x." in md and "- FAILED: x: why" in md
    assert md.splitlines()[-1] == row


def test_server_facts_and_the_gpu_checks():
    from benchmarks.gpu import sglang_check as C

    def facts(backend, log):
        info = {"version": "0.5.23", "max_total_num_tokens": 49152, "attention_backend": "fa3",
                "cuda_graph_config": {"decode": {"backend": backend, "bs": [1, 2, 4, 8]}}}
        return C.server_facts(json.dumps(info), log)

    captured = "[2026-01-01 00:00:00] Capture target decode CUDA graph end. bs=[1, 2, 4, 8], elapsed=3.1 s\n"
    transformed = "[2026-01-01 00:00:00] vskipper: transformed LlamaForCausalLM with RandomSkip [x]\n"
    up, vsk = facts("full", captured), facts("full", captured + transformed)
    assert vsk["transform"] == "transformed LlamaForCausalLM with RandomSkip [x]" and up["transform"] is None
    assert vsk["captured"] == ["Capture target decode CUDA graph end. bs=[1, 2, 4, 8], elapsed=3.1 s"]
    checks = C.server_checks({"upstream": up, "vskipper-rate0": vsk, "vskipper": vsk}, smoke=False)
    assert all(c.ok for c in checks) and sum("decode CUDA graphs captured" in c.name for c in checks) == 3
    bad = C.server_checks({"upstream": facts("disabled", ""), "vskipper-rate0": facts("full", transformed),
                           "vskipper": up}, smoke=False)
    assert [c.name for c in bad if not c.ok] == ["upstream: decode CUDA graphs captured",
                                                 "vskipper-rate0: decode CUDA graphs captured",
                                                 "vskipper: transformed by vskipper"]
    assert all(c.ok for c in C.server_checks({"upstream": facts("disabled", "")}, smoke=True))
