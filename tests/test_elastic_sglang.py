"""Elastic depth in real SGLang 0.5.23 on CPU (integrations/sglang/elastic.py): one server under a tight
target, idle at level 0 with upstream's greedy tokens, rising under a queue, a request keeping the level it
was admitted at, the stricter of request field and level winning, and falling again once the load goes;
the level, target and tokens per level over /metrics. The rule itself: tests/test_elastic.py."""
from __future__ import annotations

import asyncio
import re

import pytest
import torch

from vskipper.elastic import DWELL

NEW = 10


def sampling(n, setting=None) -> dict:
    sp = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    if setting is not None:
        sp["custom_params"] = {"vskipper": setting}
    return sp


@pytest.mark.sglang
def test_a_tight_target_rises_under_a_queue_and_falls_when_the_load_goes(tmp_path, capfd):
    """A tiny skip-aware model, 4 routed layers, the routed body priced by a synthetic calibration, at
    most 4 requests running, and a TPOT target no step can meet (1 us). Idle, level 0: greedy tokens
    are upstream's. A long request admitted at level 0, then a queue: the level goes to the top; requests
    admitted then get the skipper alone (no field), upstream's tokens (skip false) or the reference under
    1 of 4 layers (max_skip 0.25, stricter than the level); the long request keeps level 0 to its last
    token, and the queue's last request, which arrived at level 0 but left the queue after the rise, gets
    the skipper alone. Level 0 again when the load goes, upstream's tokens again."""
    from vskipper.models.hf_loader import save_checkpoint
    from vskipper.reference import reference_generate

    from sglang_util import calibrated_cache, engine
    from tiny import VOCAB, flexidepth_for, tiny_llama

    base = tiny_llama()
    sk = flexidepth_for(base, [1, 3, 4, 5], gate="soft")
    path = save_checkpoint(tmp_path / "ckpt", base, sk)
    base.save_pretrained(tmp_path / "stock", safe_serialization=True)
    g = torch.Generator().manual_seed(11)
    probes = [torch.randint(1, VOCAB, (n,), generator=g) for n in (6, 9, 4, 13)]
    long = torch.randint(1, VOCAB, (5,), generator=g)
    wave = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in [3, 7, 5, 9] * 4]
    cal = calibrated_cache(tmp_path, base)
    with engine(tmp_path / "stock") as eng:
        outs = eng.generate(input_ids=[p.tolist() for p in probes + [long]],
                            sampling_params=[sampling(NEW)] * 4 + [sampling(60)])
        upstream = [o["output_ids"] for o in outs]
    env = dict(VSKIPPER_EXECUTION="routed", VSKIPPER_TPOT_MS="0.001", VSKIPPER_CONTROL_PERIOD_MS="1",
               VSKIPPER_STATS_INTERVAL="4", VSKIPPER_ELASTIC_TRACE=str(tmp_path / "trace"), **cal)
    with engine(path, log_level="info", engine_args={"max_running_requests": 4}, **env) as eng:
        idle = [o["output_ids"] for o in eng.generate(input_ids=[p.tolist() for p in probes],
                                                      sampling_params=[sampling(NEW)] * 4)]
        log = [capfd.readouterr().err]

        async def under_load():
            kept = asyncio.ensure_future(eng.async_generate(input_ids=long.tolist(), sampling_params=sampling(60)))
            await asyncio.sleep(0.05)
            load = asyncio.ensure_future(eng.async_generate(input_ids=wave, sampling_params=sampling(40)))
            during = []
            for _ in range(600):  # until the level has risen (at most 30 s)
                await asyncio.sleep(0.05)
                during.append(capfd.readouterr().err)
                if "elastic depth level 0 -> 4" in "".join(during):
                    break
            log.extend(during)
            settings = [None, {"skip": False}, {"max_skip": 0.25}, None]
            probed = await eng.async_generate(input_ids=[p.tolist() for p in probes],
                                              sampling_params=[sampling(NEW, s) for s in settings])
            return (await kept)["output_ids"], [o["output_ids"] for o in probed], await load

        kept, loaded, waited = eng.loop.run_until_complete(under_load())
        log.append(capfd.readouterr().err)
        after = eng.generate(input_ids=probes[0].tolist(), sampling_params=sampling(NEW))["output_ids"]
        eng.generate(input_ids=probes[1].tolist(), sampling_params=sampling(NEW))  # a stats line after the fall
        log.append(capfd.readouterr().err)
    err = "".join(log)
    assert "elastic depth on: target TPOT 0.001 ms" in err, err[-3000:]
    assert idle == upstream[:4], "idle server: level 0 is the base model's function"
    # straight to the top: no level is predicted to meet 1 us
    assert re.search(r"elastic depth level 0 -> 4: TPOT [\d.]+ ms at level 0 over target 0.001 ms, no level "
                     r"predicted within 0.85 x target: the top", err), err[-3000:]
    assert kept == upstream[4], "the request admitted at level 0 changed depth under the load"
    skipped = reference_generate(base, sk, probes[0], NEW)[0][len(probes[0]):].tolist()
    levels = "\n".join(x for x in err.splitlines() if "elastic depth level" in x)
    assert loaded[0] == skipped != upstream[0], f"top level: the skipper alone {loaded} {skipped} {upstream}\n{levels}"
    assert loaded[3] == reference_generate(base, sk, probes[3], NEW)[0][len(probes[3]):].tolist()
    assert loaded[1] == upstream[1], "skip false under the top level: upstream's tokens"
    capped = reference_generate(base, sk, probes[2], NEW, budget=1)[0][len(probes[2]):].tolist()
    assert loaded[2] == capped, "max_skip 0.25 is stricter than the top level"
    last = torch.tensor(wave[-1])
    alone, full = (reference_generate(base, sk, last, 40, budget=b)[0][len(last):].tolist() for b in (None, 0))
    assert waited[-1]["output_ids"] == alone != full, "queued at level 0, admitted at the top: the skipper alone"
    assert re.search(r"elastic depth level 4 -> 0: idle", err), levels
    assert after == upstream[0], "after the load: level 0 again"
    line = [x for x in err.splitlines() if "elastic level" in x][-1]
    assert re.search(r"elastic level 0/4 .*target TPOT 0.001 ms; observed stream p90 TPOT [\d.]+ ms; "
                     r"time per level 0:", line)
    tokens = dict(re.findall(r"(\d+):(\d+)", line.split("tokens per level")[1]))
    assert int(tokens.get("0", 0)) > 0 and int(tokens.get("4", 0)) > 0, line
    # the trace: the server's events replay its levels exactly (vskipper/elastic_trace.py)
    from vskipper.elastic_trace import read, replay

    (trace,) = (tmp_path / "trace").glob("tp0-*.jsonl")
    assert f"elastic depth's events are traced to {trace}" in err
    ((head, events),) = read(trace)
    ticks = replay(head, events)
    assert [t[2] for t in ticks] == [t[3] for t in ticks] and {0, 4} <= {t[2] for t in ticks}


@pytest.mark.sglang
def test_metrics_give_the_level_the_target_and_tokens_per_level_over_http(tmp_path):
    """`vskipper serve --tpot-ms` with --enable-metrics and no --stats-interval (vskipper's counters are
    exported all the same, with no log line): /metrics carries the elastic gauges (level, target), the
    route counters, and counts tokens per level; a
    wave under a target no step meets puts tokens at the top level, and the first request (admitted
    idle) at level 0."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from concurrent.futures import ThreadPoolExecutor

    import requests

    from benchmarks.serving.elastic_ramp import metric
    from benchmarks.serving.servers import free_port, wait_healthy
    from vskipper.models.hf_loader import save_checkpoint

    from sglang_util import calibrated_cache
    from tiny import VOCAB, flexidepth_for, tiny_llama

    base = tiny_llama()
    path = save_checkpoint(tmp_path / "ckpt", base, flexidepth_for(base, [1, 3, 4, 5], gate="soft"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("VSKIPPER_")}
    env.update(calibrated_cache(tmp_path, base), VSKIPPER_EXECUTION="routed", VSKIPPER_CONTROL_PERIOD_MS="1")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "server.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "vskipper.cli", "serve", "--model-path", str(path),
                             "--skip-tokenizer-init", "--no-calibrate", "--port", str(port), "--max-total-tokens",
                             "4096", "--enable-metrics", "--tpot-ms", "0.001",
                             "--max-running-requests", "4"],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    g = torch.Generator().manual_seed(5)

    def ask(ids: list[int], n: int = 30) -> int:
        r = requests.post(url + "/generate", json={"input_ids": ids, "sampling_params": sampling(n)}, timeout=300)
        assert r.status_code == 200, r.text
        return len(r.json()["output_ids"])

    def level() -> float | None:
        m = re.search(r"^vskipper_elastic_level(?:\{[^}]*\})? (\S+)$", requests.get(url + "/metrics", timeout=10).text,
                      re.M)
        return float(m.group(1)) if m else None

    try:
        problem = wait_healthy(url, proc, 240)
        assert problem is None, problem + open(tmp_path / "server.log").read()[-3000:]
        wave = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in [5, 6] + [3, 7, 5, 9] * 4]
        assert ask(wave[0], DWELL // 2) == DWELL // 2  # idle: admitted at level 0 (too short to decide on)
        with ThreadPoolExecutor(16) as pool:
            load = [pool.submit(ask, w, 80) for w in wave[2:]]  # a queue the target cannot hold
            for _ in range(600):  # until the level has risen (at most 60 s)
                if level() == 4.0:
                    break
                time.sleep(0.1)
            assert level() == 4.0, open(tmp_path / "server.log").read()[-3000:]
            assert ask(wave[1]) == 30  # admitted at the top level
            assert [f.result() for f in load] == [80] * 16
        text = requests.get(url + "/metrics", timeout=10).text
        tokens = metric(url, "vskipper_elastic_tokens_total", "level")
        assert tokens.get("0", 0) > 0 and tokens.get("4", 0) > 0, (tokens, text[-3000:])
        assert re.search(r"^vskipper_elastic_target_tpot_ms(\{[^}]*\})? 0\.001$", text, re.M), text[-3000:]
        assert sum(metric(url, "vskipper_elastic_seconds_total", "level").values()) > 0
        assert sum(metric(url, "vskipper_routed_layer_tokens_total", "route").values()) > 0, text[-3000:]
        assert "vskipper: after " not in open(tmp_path / "server.log").read()  # no stats line was asked for
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
