"""The serving benchmarks' arithmetic, without servers: throughput, knee search, tables, the quick
run's rounds and report (benchmarks/serving/; its statistics: tests/test_paired.py)."""
import dataclasses
import json
import math

import pytest

from benchmarks.serving import serving
from benchmarks.serving.client import LoadResult
from benchmarks.serving.servers import System
from benchmarks.serving.serving import Result, throughput


def _res(start, end, n=10, ok=True):
    return Result(ok, 0.1, 0.01, end - start, n, start, end)


def test_throughput_counts_completed_tokens_over_the_span():
    assert throughput([_res(0, 2), _res(1, 4)]) == pytest.approx(20 / 4)
    assert throughput([_res(0, 2), _res(1, 9, ok=False)]) == pytest.approx(10 / 2)  # failed: not counted
    assert throughput([_res(0, 2, ok=False)]) == 0.0


def test_knee_is_the_last_rate_that_still_grows(monkeypatch):
    """Fake server: output tok/s = min(rate, 3 req/s) * tokens; saturation gives 3 req/s."""
    s = serving.Settings(requests=8, max_new_tokens=10, repeats=1, seed=0)

    def fake_load(client, url, rate, n, max_new_tokens, seed):
        tp = min(rate, 3.0) * 10  # tok/s
        return [_res(0.0, 10 * n / tp, n=10)] * n

    monkeypatch.setattr(serving, "run_load", fake_load)
    knee, curve = serving.find_knee(None, type("S", (), {"url": "x"})(), s)
    rates = [r for r, _ in curve]
    assert rates == pytest.approx([f * 3.0 for f in serving.KNEE_FRACTIONS[:len(rates)]])
    assert knee == pytest.approx(3.0)  # 1.0x capacity: the next step (1.15x) no longer grows


def test_full_run_turns_sglang_outputs_into_per_request_results():
    class C:
        def prompt_rows(self, n, t, seed):
            return [("p", i) for i in range(n)]

        def run(self, url, rows, concurrency, rate, seed):
            assert concurrency is None and rate == 2.0 and seed == 5
            per = ((True, 0.5, 2.5, 10, 100.0), (True, 0.4, 1.0, 3, 101.0), (False, 0.0, 0.0, 0, 102.0))
            return LoadResult(3, 2, 3.0, 1.0, 1.0, 1.0, 1.0, ("", "", ""), ("", "", "boom"), per)

    ok, short, bad = serving.run_load(C(), "u", 2.0, 3, 10, 5)
    assert ok.ok and ok.ttft == 0.5 and ok.tpot == pytest.approx(2.0 / 9) and ok.e2e == 2.5 and ok.end == 102.5
    assert not short.ok and short.error == "3 of 10 tokens"
    assert not bad.ok and bad.error == "boom"
    assert throughput([ok, short, bad]) == pytest.approx(10 / 2.5)


def test_table_has_deltas_against_upstream():
    systems = [System("upstream", "m"), System("vskipper", "m", "random:rate=0.5,layers=1")]
    loads = [("1.0x knee (2.00/s)", 2.0)]
    results = {loads[0][0]: {"upstream": [[_res(0, 2.0), _res(0, 2.0)]], "vskipper": [[_res(0, 1.5), _res(0, 1.5)]]}}
    table = serving.summarize(results, systems, loads)
    row = next(line for line in table.splitlines() if "| vskipper |" in line)
    assert "1.50 ± 0.00" in row and "-25.0%" in row and "+33.3%" in row


# --- the quick run (benchmarks/serving/quick.py, report.py) ---

from benchmarks import stats  # noqa: E402
from benchmarks.serving import quick, report  # noqa: E402


def _delta(m, lo, hi):
    return stats.Delta(m, lo, hi, (m,))


def test_verdict_line_names_each_system_rate0_last_and_marks_unresolved():
    names = ["upstream", "vskipper-rate0", "vskipper", "vskipper-trained"]
    labels = {"vskipper-rate0": "rate 0", "vskipper": "vskipper RandomSkip(0.5)",
              "vskipper-trained": "trained FlexiDepth"}
    d = {"concurrency 32": {"vskipper-rate0": {"tok_s": _delta(0.01, -0.02, 0.03)},
                            "vskipper": {"tok_s": _delta(0.12, 0.08, 0.15)},
                            "vskipper-trained": {"tok_s": _delta(0.03, 0.01, 0.06)}},
         "open": {n: {"e2e_ms": _delta(-0.1, -0.2, -0.05)} for n in names[1:]}}
    q = {n: {"accuracy": a, "agreement": g, "prefix": g / 2} for n, a, g in
         zip(names, (0.5, 0.5, 0.25, 0.5), (1.0, 1.0, 0.375, 0.75))}
    line = report.verdict(d, q, names, labels, ("concurrency 32", "tok_s"), ("open", "e2e_ms"))
    assert line.startswith("verdict: vskipper RandomSkip(0.5): +12.0% [+8.0%, +15.0%] tok/s at concurrency 32")
    assert line.index("RandomSkip") < line.index("trained FlexiDepth") < line.index("rate 0:")
    assert "rate 0: +1.0% [-2.0%, +3.0%] not resolved tok/s" in line
    assert "quality 25% arithmetic (upstream 50%), 38% same answers as upstream, greedy agreement 19%" in line


def test_prefix_share_counts_tokens_before_the_first_divergence():
    assert report.prefix_share([[1, 2, 3], [4, 5]], [[1, 2, 9, 9], [4, 5]]) == pytest.approx(4 / 6)
    assert report.prefix_share([[1]], [[2, 3]]) == 0.0
    assert report.prefix_share([[1, 2, 3, 4]], [[1, 2]]) == 1.0  # a longer answer: the reference is all reproduced


def test_last_integer_reads_the_answer_like_quality_hf():
    assert report.last_integer("13 + 72 = 85.") == 85
    assert report.last_integer("It costs 1,250 dollars") == 1250
    assert report.last_integer("no digits") is None
    assert report.last_integer("from 5 to -3") == -3


def test_quick_settings_reject_bad_values_naming_the_field():
    with pytest.raises(ValueError, match="rounds=2 must be >= min_rounds=3"):
        quick.Settings(rounds=2)
    with pytest.raises(ValueError, match="min_rounds=2"):
        quick.Settings(min_rounds=2)
    with pytest.raises(ValueError, match="concurrencies"):
        quick.Settings(concurrencies=(8, 0))
    with pytest.raises(ValueError, match="output_len=3"):
        quick.Settings(output_len=3)
    with pytest.raises(ValueError, match="open_load"):
        quick.Settings(open_load=0)
    with pytest.raises(ValueError, match="min_rounds=3 must be >= lifetimes=5"):
        quick.Settings(lifetimes=5, rounds=8)
    with pytest.raises(ValueError, match=r"questions=100000: the shipped set has \d+"):
        quick.question_subset(100_000)


class FakeClient:
    """Stands in for SGLang's client: a system's tok/s = its speed x the round's mood (a slow spell
    hits every system of a round alike) x its server's offset for that server's life (url
    "<system>@<lifetime>"); answers: upstream right, 'slow' wrong on every other one."""

    speed = {"upstream": 100.0, "fast": 112.0, "slow": 95.0}
    offset: dict = {}
    calls: list = []
    clock = [0.0]  # fake seconds: every call takes 10

    def __init__(self, model_path, work_dir):
        self.mood = 1.0
        self.tokenizer = type("Chars", (), {"encode": lambda self, t, add_special_tokens=False: [ord(c) for c in t]})()

    def prompt_rows(self, n, output_len, seed):
        self.mood = [1.0, 0.5, 1.3, 0.7, 1.0][seed // 1000 % 5]  # round r's rows have seeds 1000 r + ...
        return [("prompt", seed, i, output_len) for i in range(n)]

    def question_rows(self, prompts, max_new_tokens):
        return [("question", p) for p in prompts]

    def run(self, url, rows, concurrency, rate=math.inf, seed=0, ignore_eos=True):
        FakeClient.calls.append((url, tuple(rows), concurrency, rate, seed))
        FakeClient.clock[0] += 10.0
        if rows[0][0] == "question":  # the 8 questions' answers; slow is wrong on every other one
            qs = {q["prompt"]: (int(q["answer"]), i % 2) for i, q in enumerate(quick.question_subset(8))}
            texts = tuple(f"= {qs[p][0] + (url.startswith('slow') and qs[p][1])}" for _, p in rows)
            return LoadResult(len(rows), len(rows), 1.0, 1.0, 1.0, 1.0, 1.0, texts, ("",) * len(rows))
        tp = self.speed[url.split("@")[0]] * self.mood * self.offset.get(url, 1.0)
        return LoadResult(len(rows), len(rows), 1.0, tp, 1e4 / tp, 1e4 / tp, 2e4 / tp, (), ())


def fake_quick(monkeypatch):
    from benchmarks.serving import client

    FakeClient.calls, FakeClient.clock, FakeClient.offset = [], [0.0], {}
    monkeypatch.setattr(client, "Client", FakeClient)
    lives = []

    def start_all(systems, *a, **k):  # each call: a new lifetime of every server
        lives.append(len(lives))
        return {s.name: type("S", (), {"url": f"{s.name}@{lives[-1]}"})() for s in systems}

    monkeypatch.setattr(quick, "start_all", start_all)
    monkeypatch.setattr(quick, "stop", lambda srv: None)
    monkeypatch.setattr(quick, "memory_gb", lambda srv: 1.0)
    monkeypatch.setattr(quick, "transform_line", lambda srv: None)
    return [System("upstream", "m"), System("fast", "m", "x", label="Fast"), System("slow", "m", "y", label="Slow")]


def test_quick_run_pairs_rounds_same_requests_fresh_orders_and_reports(monkeypatch, tmp_path):
    """Each round, at each load, upstream runs beside each other system in turn (the two calls at
    once, each in its own thread), in a fresh random order, on the same requests."""
    import threading

    systems = fake_quick(monkeypatch)
    threads = []
    real = FakeClient.run
    both = threading.Barrier(2, timeout=10)  # a call off the main thread waits for its pair's other call

    def run(self, url, rows, *a, **k):
        threads.append((rows[0][:2], threading.get_ident()))
        if threading.current_thread() is not threading.main_thread():
            both.wait()
        return real(self, url, rows, *a, **k)

    monkeypatch.setattr(FakeClient, "run", run)
    s = quick.Settings(rounds=5, concurrencies=(4, 8), open_requests=6, output_len=10, questions=8)
    text = quick.run(systems, s, tmp_path)

    warm = [c for c in FakeClient.calls if c[1][0][:2] == ("prompt", quick.WARM_UP_SEED + 1)]
    calls = [c for c in FakeClient.calls if c[1][0][0] == "prompt" and c not in warm]  # the measured calls
    assert len(calls) == 5 * 3 * 2 * 2  # rounds x loads x pairs x 2
    measured = {t for kind, t in threads if kind[0] == "prompt" and kind[1] < quick.WARM_UP_SEED}
    assert len(measured) == 2 and threading.get_ident() not in measured  # two at once (the barrier), off main
    res = json.loads((tmp_path / "results.json").read_text())["results"]
    res_lives = res["lifetimes"]
    assert res_lives == [0, 0, 1, 1, 1]  # 5 rounds fit: 2 on the first servers, the rest after the restart
    questions = [c for c in FakeClient.calls if c[1][0][0] == "question"]  # every question through every system
    assert sorted(c[0] for c in questions) == ["fast@0", "slow@0", "upstream@0"]
    assert all(len(c[1]) == 8 for c in questions)
    # the restarted servers get one unmeasured wave at the highest concurrency, after the last round on the
    # first servers and before their own first measured call
    assert sorted(c[0] for c in warm) == ["fast@1", "slow@1", "upstream@1"] and all(c[2] == 8 for c in warm)
    at = FakeClient.calls.index
    assert max(at(c) for c in calls if c[0].endswith("@0")) < min(map(at, warm))
    assert max(map(at, warm)) < min(at(c) for c in calls if c[0].endswith("@1"))
    orders = stats.round_orders(["fast", "slow"], 5, 0)
    assert len({tuple(o) for o in orders}) == 2  # both orders occur
    by_round = {}  # a round's requests carry its seeds (1000 r + ...)
    for c in calls:
        by_round.setdefault(c[1][0][1] // 1000, []).append(c)
    assert sorted(by_round) == [0, 1, 2, 3, 4]
    for r, rnd in by_round.items():
        life = res_lives[r]
        pairs = [rnd[i: i + 2] for i in range(0, 12, 2)]
        for k, pair in enumerate(pairs):  # loads 4, 8, open; within each, the round's order
            assert sorted(c[0] for c in pair) == sorted([f"upstream@{life}", f"{orders[r][k % 2]}@{life}"])
            assert len({(c[1], c[2], c[3], c[4]) for c in pair}) == 1  # the very same requests, rate, arrival seed
        for conc in (4, 8):  # every system of the round got the very same requests
            assert len({c[1] for c in rnd if c[2] == conc}) == 1
        opened = rnd[8:]
        assert len({(c[1], c[3], c[4]) for c in opened}) == 1
        assert all(c[2] is None and math.isfinite(c[3]) for c in opened)
    assert len({c[1] for c in calls if c[2] == 8}) == 5  # fresh prompts every round
    rates = {c[3] for c in calls if c[2] is None}  # one open-loop rate for the run:
    assert len(rates) == 1 and rates.pop() == pytest.approx(0.75 * 100.0 / 10)  # 0.75 x round 1's capacity at c=8

    fast = res["deltas"]["concurrency 8"]["fast"]["tok_s"]
    assert fast["median"] == pytest.approx(0.12) and fast["lo"] == pytest.approx(0.12)  # the moods cancel
    q = res["quality"]["slow"]
    assert (q["correct"], q["same"], q["questions"], q["accuracy"], q["agreement"]) == (4, 4, 8, 0.5, 0.5)
    assert 0 < q["prefix"] < 1 and res["quality"]["fast"]["prefix"] == 1.0
    line = text.strip().splitlines()[-2]
    assert line.startswith("verdict: Fast: +12.0% [+12.0%, +12.0%] tok/s at concurrency 8, quality 100%")
    assert "Slow: -5.0% [-5.0%, -5.0%] tok/s" in line and "quality 50% arithmetic (upstream 100%)" in line
    assert (tmp_path / "serving-quick.png").stat().st_size > 10_000


def test_a_servers_whole_life_offset_enters_the_ci(monkeypatch, tmp_path):
    """fast's second server lifetime runs 8% faster throughout: the rounds on both lifetimes put both
    ratios (+12% and +21%) inside the CI, with the median between; one lifetime would report the
    first server's ratio alone, with a CI of zero width."""
    systems = fake_quick(monkeypatch)
    FakeClient.offset = {"fast@1": 1.08}
    s = quick.Settings(rounds=6, concurrencies=(8,), open_requests=6, output_len=10, questions=8)
    quick.run(systems, s, tmp_path)
    res = json.loads((tmp_path / "results.json").read_text())["results"]
    fast = res["deltas"]["concurrency 8"]["fast"]["tok_s"]
    assert res["lifetimes"] == [0, 0, 0, 1, 1, 1]
    assert fast["median"] == pytest.approx((0.12 + 1.12 * 1.08 - 1) / 2)  # half the rounds on each lifetime
    slow = res["deltas"]["concurrency 8"]["slow"]["tok_s"]["ratios"]
    hw = stats.lifetime_half_width({"fast": fast["ratios"], "slow": slow},
                                    res["lifetimes"])  # fast's lifetimes differ by 8%, slow's not: 2 df pooled
    assert hw == pytest.approx(stats.t975(2) * ((2 * (0.0448 ** 2) / 2 / 2) ** 0.5), rel=1e-2)
    wide = 2 ** 0.5 * hw  # a rerun's median carries its own lifetimes' offsets too; wider than the rounds' spread here
    assert wide > stats.rerun_half_width(fast["ratios"])
    assert fast["lo"] == pytest.approx(fast["median"] - wide) and fast["hi"] == pytest.approx(fast["median"] + wide)
    assert fast["lo"] < 0.12 and fast["hi"] > 1.12 * 1.08 - 1  # both lifetimes' ratios inside
    quick.run(systems, dataclasses.replace(s, lifetimes=1), tmp_path)
    one = json.loads((tmp_path / "results.json").read_text())["results"]["deltas"]["concurrency 8"]["fast"]["tok_s"]
    assert one["lo"] == pytest.approx(0.12) and one["hi"] == pytest.approx(0.12)


def test_quick_run_plans_rounds_and_lifetimes_to_the_time_budget_but_not_below_min_rounds(monkeypatch, tmp_path):
    """Each fake call takes 10 s (side by side or not) and start-up none: quality 30 s (3 systems), a
    round 120 s (2 pairs x 3 loads x 2 calls), a restart's warm-up 30 s (planned at 40: the
    highest load's share of a round, 3 systems in 2 pairs for 2 systems compared)."""
    systems = fake_quick(monkeypatch)
    monkeypatch.setattr(quick.time, "perf_counter", lambda: FakeClient.clock[0])

    def lives_of(budget, min_rounds=4):
        s = quick.Settings(rounds=8, min_rounds=min_rounds, budget_s=budget, concurrencies=(4, 8), open_requests=6,
                           output_len=10, questions=8)
        FakeClient.clock[0] = 0.0
        quick.run(systems, s, tmp_path, started=0.0)
        res = json.loads((tmp_path / "results.json").read_text())["results"]
        assert len(res["rounds"]["concurrency 8"]["fast"]) == len(res["lifetimes"])
        return res["lifetimes"]

    # after round 1 (t = 150): 560 s left = a restart (40) + 4 more rounds
    assert lives_of(150 + 10 + 40 + 4 * 120) == [0, 0, 1, 1, 1]
    # 380 s left: with a restart 3 rounds in all, fewer than min_rounds; without, 4
    assert lives_of(150 + 10 + 380) == [0, 0, 0, 0]
    assert lives_of(1.0) == [0, 0, 0, 0]  # never fewer than min_rounds
    # 300 s left: a restart and 2 more rounds would meet min_rounds 3, but leave one round on a lifetime
    assert lives_of(150 + 10 + 300, min_rounds=3) == [0, 0, 0]


def test_quick_run_names_a_server_that_died_mid_run(monkeypatch, tmp_path):
    systems = fake_quick(monkeypatch)
    dead = type("P", (), {"poll": lambda self: -15})()
    monkeypatch.setattr(quick, "start_all", lambda systems, *a, **k: {
        s.name: type("S", (), {"url": s.name + "@0", "log_path": tmp_path / f"server-{s.name}.log",
                               "proc": dead if s.name == "slow" else type("P", (), {"poll": lambda self: None})()})()
        for s in systems})

    real = FakeClient.run

    def run(self, url, rows, *a, **k):
        if url == "slow@0":
            raise ConnectionError("Connection reset by peer")
        return real(self, url, rows, *a, **k)

    monkeypatch.setattr(FakeClient, "run", run)
    with pytest.raises(RuntimeError,
                       match=r"server slow exited with -15 in the middle of the run \(see .*server-slow.log\)"):
        quick.run(systems, quick.Settings(questions=8), tmp_path)


def test_start_all_interrupted_stops_every_server_it_launched(monkeypatch, tmp_path):
    """A SIGTERM (here: Ctrl-C) while servers start must not leave the ones still starting behind."""
    import threading
    import time as _time

    from benchmarks.serving import servers

    stopped, release = [], threading.Event()

    def fake_start(system, log_dir, max_total_tokens, timeout, launched=None, **kw):
        srv = type("Srv", (), {"name": system.name})()
        launched.append(srv)
        if system.name != "a":
            release.wait(5)  # still "waiting for /health" when the interrupt comes
        return srv

    def interrupt(name):
        _time.sleep(0.1)  # let the others launch
        raise KeyboardInterrupt

    monkeypatch.setattr(servers, "start", fake_start)
    monkeypatch.setattr(servers, "stop", lambda srv: (stopped.append(srv.name), release.set()))
    with pytest.raises(KeyboardInterrupt):
        servers.start_all([System(n, "m") for n in "abc"], tmp_path, on_ready=interrupt)
    assert sorted(stopped) == ["a", "b", "c"]


def test_open_loop_arrivals_are_seeded_per_call_poisson_from_zero():
    """Two calls side by side each draw their own arrival times (SGLang's get_request would share
    numpy's global generator between them): same seed, same times; gaps exponential, mean 1 / rate."""
    import numpy as np

    from benchmarks.serving.client import _arrivals

    a = _arrivals(4000, 5.0, np.random.default_rng(3))
    assert a == _arrivals(4000, 5.0, np.random.default_rng(3)) and a != _arrivals(4000, 5.0, np.random.default_rng(4))
    assert a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:]))
    gaps = np.diff(a)
    assert gaps.mean() == pytest.approx(0.2, rel=0.05) and gaps.std() == pytest.approx(0.2, rel=0.08)
    assert _arrivals(1, 5.0, np.random.default_rng(0)) == [0.0]


@pytest.mark.slow
def test_unused_model_modules_keeps_every_module_naming_the_architecture(tmp_path):
    """SGLANG_DISABLED_MODEL_ARCHS for a server: SGLang's model modules that never name the
    checkpoint's architecture; none when a name is found nowhere (SGLang then searches as usual)."""
    from benchmarks.serving.servers import unused_model_modules

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    unused = unused_model_modules(str(tmp_path))
    assert "llama" not in unused and "registry" not in unused and "qwen3" in unused and len(unused) > 100
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    assert "qwen3" not in unused_model_modules(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NoSuchModelForCausalLM"]}))
    assert unused_model_modules(str(tmp_path)) == []
    assert unused_model_modules(str(tmp_path / "missing")) == []


# --- the main job (benchmarks/demo.py): its verdict from step times and quality -----------------
def test_demo_verdict_from_step_rounds_and_quality():
    from benchmarks import demo

    up = [1.0, 1.02, 0.98, 1.01, 0.99, 1.0]
    noise = (0.1, -0.1, 0.12, -0.12, 0.0, 0.05)
    step_s = {"decode": {"32": {"upstream": up, "trained-auto": [0.9 * t for t in up],
                                "skip0.5-auto": [t * (1 + e) for t, e in zip(up, noise)]}}}
    d = demo.step_deltas(step_s)["decode"][32]
    assert abs(d["trained-auto"].median + 0.1) < 1e-9 and d["trained-auto"].hi < 0  # resolved: 0.90x
    assert d["skip0.5-auto"].lo < 0 < d["skip0.5-auto"].hi  # noisy rounds: not resolved
    base = {"facts": 0.50, "facts_stderr": 0.05, "prefix_mean": 24.0}
    same = {"facts": 0.47, "facts_stderr": 0.05, "prefix_mean": 10.0}  # the card's bar: 20 of 48, 10 of 24
    drifts = {"facts": 0.47, "facts_stderr": 0.05, "prefix_mean": 9.9}
    worse = {"facts": 0.30, "facts_stderr": 0.05, "prefix_mean": 3.0}
    said = demo.sentence(d["trained-auto"], None, same, base)
    assert said.startswith("faster and keeps the base model's answers as the card's bar asks"), said
    assert "(the bar 10.0)" in said
    said = demo.sentence(d["trained-auto"], None, drifts, base)
    assert said.startswith("faster, but its answers are not the base") and "under the card's bar of 10.0" in said
    assert demo.sentence(d["trained-auto"], None, worse, base).startswith("faster and worse by 20% on the facts task")
    assert demo.sentence(d["skip0.5-auto"], None, same, base).startswith("not resolved")
    assert "speed bound" in demo.sentence(d["trained-auto"], None, None, base)
    slow = demo.step_deltas({"decode": {"32": {"upstream": up, "trained-auto": [1.06 * t for t in up]}}})
    said = demo.sentence(slow["decode"][32]["trained-auto"], None, worse, base, skipped=0.074)
    assert said.startswith("slower by 6.0% at batch 32: it skipped 7.4% of routed-layer work"), said


def test_demo_keeps_the_latest_three_runs_and_writes_them_into_the_readme_block(tmp_path):
    from benchmarks import demo

    def run(i):
        return {"date": f"2026-01-0{i} 10:00 UTC", "machine": "cpu", "wall_s": 500 + i, "setup_s": 3,
                "decode_b32": f"0.9{i} [0.88, 0.94]", "quality": "facts 46%", "verdict": f"verdict {i}"}

    for i in range(1, 6):
        demo.record_run(tmp_path, run(i))
        (tmp_path / "demo-runs" / sorted(p.name for p in (tmp_path / "demo-runs").iterdir())[-1]).rename(
            tmp_path / "demo-runs" / f"2026010{i}-100000.json")  # distinct stamps within one second
    kept = sorted(p.name for p in (tmp_path / "demo-runs").iterdir())
    assert kept == ["20260103-100000.json", "20260104-100000.json", "20260105-100000.json"]
    runs = [json.loads((tmp_path / "demo-runs" / k).read_text()) for k in kept]
    table = demo.runs_table(runs)
    assert "The latest 3 runs" in table and "verdict 5" in table and "verdict 2" not in table
    firsts = [line.split(" | ")[0] for line in table.splitlines()[-3:]]
    assert firsts == [f"| 2026-01-0{i} 10:00 UTC" for i in (3, 4, 5)]
    assert "2026-" not in demo.runs_table([run(3)], dates=False)  # the README's copy: numbered, not dated
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\nbefore\n{demo.README_BEGIN}\nold table\n{demo.README_END}\nafter\n")
    demo.write_readme_block(readme, demo.runs_table(runs, dates=False))
    text = readme.read_text()
    assert "old table" not in text and "verdict 5" in text and text.startswith("# x\n\nbefore\n")
    assert text.endswith(f"{demo.README_END}\nafter\n") and "| 3 |" in text
    readme.write_text("# no block\n")
    demo.write_readme_block(readme, table)  # a README without the block is left alone
    assert readme.read_text() == "# no block\n"


# --- the engine step's prompts (benchmarks/step/engine_step.py) ---------------------------------
def test_engine_step_text_prompts_are_the_everyday_prompts_in_the_chat_template():
    from transformers import AutoTokenizer

    from benchmarks.step import engine_step
    from vskipper.eval.agreement import heldout_prompts
    from vskipper.models.smollm2 import smollm2_dir
    from vskipper.training.data import chat_ids

    d = str(smollm2_dir())
    tok = AutoTokenizer.from_pretrained(d)
    texts = [r["prompt"] for r in heldout_prompts(["everyday"])]
    decode = engine_step.text_prompts(d, "decode", len(texts) + 2, 128)
    assert decode[0] == chat_ids(tok, texts[0]) and decode[len(texts) + 1] == decode[1]  # cycled past the set
    prefill = engine_step.text_prompts(d, "prefill", 2, 256)
    assert [len(p) for p in prefill] == [256, 256] and prefill[0] != prefill[1]  # each from its own start
    assert f"user\n{texts[1]}\n{texts[2]}" in tok.decode(prefill[1])  # one user turn, the set from prompt 1 on
    with pytest.raises(ValueError, match="prompts of 1000000 tokens"):
        engine_step.text_prompts(d, "prefill", 1, 1_000_000)
    args = engine_step.parse(["--prompts", "everyday", "--repeats", "2"])
    assert (args.prompts, args.repeats) == ("everyday", 2)
    with pytest.raises(SystemExit):
        engine_step.parse(["--repeats", "0"])
    both = engine_step.parse(["--phase", "both", "--batch", "8", "32", "--rounds", "8", "12", "--prefill-rounds", "3"])
    assert engine_step.settings(both, "decode")[3] == {8: 8, 32: 12}  # rounds per batch size
    assert engine_step.settings(both, "prefill")[3] == {1: 3}
    one = engine_step.parse(["--batch", "8", "32", "--rounds", "9"])
    assert engine_step.settings(one, "decode")[3] == {8: 9, 32: 9}
    with pytest.raises(SystemExit):
        engine_step.parse(["--batch", "8", "32", "--rounds", "4", "5", "6"])  # neither one nor one per batch size


def test_engine_step_compares_each_skipper_with_its_own_rate_0():
    """Whole-layer skippers against rate 0 of their execution; a sublayer skipper against its own rates
    0 in the same body (the fixed-shape one attends through vskipper's masked attention at rates 0 too)."""
    import vskipper
    from benchmarks.step.engine_step import FIXED_SHAPES, SYSTEMS, rate0_of

    assert rate0_of("skip0.5-routed") == "rate0-routed" and rate0_of("trained-auto") == "rate0-auto"
    assert rate0_of("sub-attn0.5-fixed") == "sub-rate0-fixed" and rate0_of("sub-mlp0.5-routed") == "sub-rate0-routed"
    assert rate0_of("upstream") is None and rate0_of("sub-rate0-fixed") is None
    for name, (spec, _, _) in SYSTEMS.items():
        if name.startswith("sub-"):
            assert name.startswith("sub-rate0") or rate0_of(name) in SYSTEMS, name
            sk = vskipper.parse_skipper(spec)
            assert sk.sublayers and (sk.attn_rate > 0) == ("attn" in name or "both" in name), name
            assert (name in FIXED_SHAPES) == name.endswith("-fixed")


def test_demo_leaves_the_checkout_as_it_found_it_unless_asked(tmp_path, monkeypatch):
    """`make demo` (no --docs): results and the runs kept under out/, the README and docs/results untouched;
    --docs: the page, the runs beside it and the README's block; --docs DIR: there, the README left alone."""
    import types

    from benchmarks import demo
    from benchmarks import results as R
    from benchmarks.serving import quick, servers
    from vskipper import first_start
    from vskipper.models import smollm2

    docs, readme = tmp_path / "checkout" / "docs" / "results", tmp_path / "checkout" / "README.md"
    docs.mkdir(parents=True)
    readme.write_text(f"# x\n{demo.README_BEGIN}\nold\n{demo.README_END}\n")
    monkeypatch.setattr(R, "DOCS", docs)
    monkeypatch.setattr(demo, "README", readme)
    monkeypatch.setattr(first_start, "ensure_calibration", lambda *a, **k: None)
    monkeypatch.setattr(smollm2, "smollm2_dir", lambda: tmp_path)
    monkeypatch.setattr(servers, "default_systems", lambda: [types.SimpleNamespace(name=n) for n in
                                                             ("upstream", "vskipper-trained", "vskipper")])
    up = [1.0, 1.02, 0.98, 1.01, 0.99, 1.0]
    times = {"upstream": up, "rate0-auto": up, "trained-auto": [0.9 * t for t in up],
             "skip0.5-auto": [0.8 * t for t in up]}
    step_s = {"decode": {"8": times, "32": times}, "prefill": {"1": times}}
    fractions = {"trained-auto": 0.16, "skip0.5-auto": 0.5}
    monkeypatch.setattr(demo, "run_step", lambda args, out: (step_s, {"decode": {"8": fractions, "32": fractions},
                                                                      "prefill": {"1": fractions}}))
    q = {"facts": 0.5, "facts_stderr": 0.1, "prefix_mean": 12.0, "prefix_mean_stderr": 1.0, "identical": 0.2}

    def serve(systems, settings, out, **kw):
        d = {"median": 0.1, "lo": 0.05, "hi": 0.15, "ratios": [1.1] * 3}
        R.write_results("demo-serving", {"quality": {"upstream": {**q, "prefix_mean": 24.0},
                                                     "vskipper-trained": q},
                                         "deltas": {"concurrency 32": {n: {"tok_s": d} for n in demo.SERVING.values()}},
                                         "orders": [1, 2, 3]}, "", out)

    monkeypatch.setattr(quick, "run", serve)
    before = sorted(p.name for p in docs.rglob("*"))
    demo.main(["--out", str(tmp_path / "out")])
    assert readme.read_text() == f"# x\n{demo.README_BEGIN}\nold\n{demo.README_END}\n"
    assert sorted(p.name for p in docs.rglob("*")) == before
    assert (tmp_path / "out" / "results.json").is_file() and len(list((tmp_path / "out" / "runs").iterdir())) == 1
    elsewhere = tmp_path / "pages"
    demo.main(["--out", str(tmp_path / "out"), "--docs", str(elsewhere)])
    assert (elsewhere / "demo.md").is_file() and (elsewhere / "demo-runs").is_dir()
    assert "old" in readme.read_text()
    demo.main(["--out", str(tmp_path / "out"), "--docs"])
    page = (docs / "demo.md").read_text()
    assert "| 16.0% | 16.0% |" in page and "keeps the base model's answers" in page
    assert "old" not in readme.read_text() and "| 1 |" in readme.read_text()
