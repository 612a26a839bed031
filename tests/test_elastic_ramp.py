"""The elastic-depth ramp benchmark (benchmarks/serving/elastic_ramp.py): its table and figure, its
rounds pooled in random order, the search for upstream's rate R. A fake client; no server."""
from __future__ import annotations

import pytest


def test_ramp_table_marks_steps_over_the_target_and_draws_the_figure(tmp_path):
    from benchmarks.serving.elastic_page import plot, table
    from benchmarks.serving.elastic_ramp import quantile, shares

    assert quantile([5, 1, 4, 2, 3], 0.9) == 5 and quantile([5, 1, 4, 2, 3], 0.5) == 3
    m = lambda p90, skip: dict(tpot_p50_ms=p90 / 2, tpot_p90_ms=p90, ttft_p50_s=0.1, ttft_p90_s=0.2, tok_s=9.0,  # noqa: E731
                               failed=0, skip=skip, agreement=None if skip is None else 1 - skip)
    steps = [{"multiple": f, "rate": f * 2, "systems": {"upstream": m(30 * f, None), "elastic-random": m(30, s)}}
             for f, s in ((0.5, 0.0), (1.5, 0.4))]
    md = table(steps, ["upstream", "elastic-random"], target_ms=40.0)
    assert "| 1.5x (3.000/s) | upstream | 22 | 45 * |" in md and "| 1.5x (3.000/s) | elastic-random | 15 | 30 |" in md
    assert "0.400" in md and "0.60" in md
    steps[1]["requests"] = 18
    steps[1]["systems"]["upstream"]["levels"] = shares({"0": 30.0, "4": 90.0, "2": 10.0}, {"0": 20.0, "4": 60.0})
    assert steps[1]["systems"]["upstream"]["levels"] == "0:20% 2:20% 4:60%" and shares({"0": 1.0}, {"0": 1.0}) is None
    assert "| 1.5x (3.000/s, 18 req) | upstream |" in table(steps, ["upstream"], target_ms=40.0)
    assert "| 0:20% 2:20% 4:60% | 0 |" in table(steps, ["upstream"], target_ms=40.0)
    plot(steps, ["upstream", "elastic-random"], 40.0, tmp_path / "f.png")
    assert (tmp_path / "f.png").stat().st_size > 1000


def test_ramp_reads_the_criterion_off_the_pooled_steps_and_says_what_it_cannot_judge():
    from benchmarks.serving.elastic_page import verdict

    def steps(rows):  # (multiple, upstream p90, level 0 p90, elastic p90, elastic skip)
        return [{"multiple": f, "systems": {"upstream": {"tpot_p90_ms": u}, "level0": {"tpot_p90_ms": z},
                                             "elastic-random": {"tpot_p90_ms": e, "skip": k}}}
                for f, u, z, e, k in rows]

    names = ["upstream", "level0", "elastic-random"]
    held = steps([(0.9, 80, 82, 81, 0.0), (1.0, 95, 97, 96, 0.04), (1.1, 120, 121, 99, 0.3), (1.25, 140, 150, 99, 0.4)])
    v = verdict(held, names, 100.0)
    assert "(b) met" in v and "(0.9x R, 1x R) elastic skipped 0.0%, 4.0%" in v, v
    assert "(a) met: upstream first missed the target at 1.1x R" in v and "to 1.25x R 99, 99 ms" in v, v
    assert "upstream over, level0 over" in v, v
    v = verdict(steps([(1.0, 95, 97, 96, 0.074), (1.1, 120, 121, 130, 0.3), (1.25, 140, 150, 99, 0.4)]), names, 100.0)
    assert "(b) NOT met" in v and "7.4%" in v and "(a) NOT met" in v and "130, 99 ms" in v, v
    v = verdict(steps([(0.9, 80, 82, 81, 0.0), (1.1, 90, 101, 92, 0.0)]), names, 100.0)
    assert "(b) met" in v and "(a) not judged: upstream met the target at every step" in v, v
    v = verdict(steps([(0.9, 80, 82, 81, 0.0), (1.0, 120, 101, 92, 0.2)]), names, 100.0)
    assert "(a) not judged: upstream first missed the target at 1x R, and no step reached 1.1x" in v, v
    v = verdict(steps([(1.0, 120, 130, 92, 0.2), (1.1, 130, 99, 95, 0.3)]), names, 100.0)
    assert "(b) not judged" in v and "(a) NOT met" in v and "level0 WITHIN" in v, v


def test_ramp_pools_its_rounds_in_random_order_and_sums_route_counts(monkeypatch):
    """ramp: every round offers every step to every server, steps and servers shuffled per round, the
    same requests to every server within a round; a step's p90 is over the requests of all its rounds,
    each round's own p90 listed; skip fraction and tokens per level from the summed counters."""
    from types import SimpleNamespace

    import benchmarks.serving.elastic_ramp as er

    calls, counters = [], {"up": [0.0, 0.0], "el": [0.0, 0.0]}

    def measure(client, url, rows, rate, seed, warm):
        assert warm == 0
        calls.append((url, rate, seed))
        r = sum(1 for u, _, _ in calls if u == url)  # this server's r-th run
        if url == "el":
            counters["el"][0] += 30.0
            counters["el"][1] += 10.0 * r
        tpot = [0.010 * r] * 9 + [0.100 * r]
        return {"tpot_p90_ms": 1e3 * er.quantile(tpot, 0.9), "tpot_p90_all_ms": 0.0, "tpot_s": tpot,
                "tpot_all_s": tpot, "ttft_s": [0.5] * 10, "tok_s": 6.0 * r,
                "failed": 0, "texts": ["zzzz" if url == "el" and r == 2 else "abcd"] * 10}

    monkeypatch.setattr(er, "measure", measure)
    monkeypatch.setattr(er, "route_counts", lambda url: tuple(counters[url]))
    monkeypatch.setattr(er, "level_tokens", lambda url: {"0": counters[url][0], "4": counters[url][1]})
    client = SimpleNamespace(tokenizer=SimpleNamespace(encode=lambda t: [ord(c) for c in t]))
    rows_for = lambda rate, seed: ([seed] * 10, 0)  # noqa: E731
    done = er.ramp(client, {"upstream": SimpleNamespace(url="up"), "elastic": SimpleNamespace(url="el")},
                   (0.5,), 2.0, rows_for, probes=2, seed=0, rounds=2)
    assert [(u, s) for u, _, s in calls] == [(calls[0][0], 10), (calls[1][0], 10), (calls[2][0], 1010),
                                             (calls[3][0], 1010)] and {calls[0][0], calls[1][0]} == {"up", "el"}
    (step,) = done
    assert step["requests"] == 20 and step["rounds"] == 2
    el = step["systems"]["elastic"]
    assert el["round_p90_ms"] == pytest.approx([10.0, 20.0])  # each round: 9 of 10 requests at 10 r ms
    assert el["tpot_p90_ms"] == pytest.approx(20.0) and el["tpot_p50_ms"] == pytest.approx(20.0)  # pooled
    assert el["skip"] == pytest.approx(30 / 90) and el["levels"] == "0:67% 4:33%" and el["tok_s"] == 9.0
    assert el["agreement"] == pytest.approx(0.5) and step["systems"]["upstream"]["agreement"] is None


def test_ramp_search_judges_each_rate_by_the_majority_of_three_and_reports_every_measurement():
    """find_rate: a rate counts as met when two of its measurements meet the target (one miss among
    them does not end the search), as missed when two miss (one lucky p90 does not carry the search
    past the knee); the search ends at the first rate missed; R is the last rate met."""
    from types import SimpleNamespace

    from benchmarks.serving.elastic_ramp import find_rate

    class Fake:  # a p90 TPOT of (e2e - ttft) / (n - 1) per request, scripted per call
        def __init__(self, tpots):
            self.tpots, self.calls = list(tpots), []

        def run(self, url, rows, concurrency, rate, seed):
            self.calls.append(rate)
            t = self.tpots.pop(0)
            return SimpleNamespace(per_request=[(True, 0.0, t * (r.output_len - 1), r.output_len, 0.0) for r in rows],
                                   output_throughput=1.0, texts=())

    rows = lambda rate: ([SimpleNamespace(output_len=5)] * 3, 0)  # noqa: E731
    # 1: met, met; 2: miss, met, met; 3: met, miss, miss (one lucky p90, then the knee); 4 never tried
    fake = Fake([0.010, 0.020, 0.050, 0.020, 0.030, 0.030, 0.060, 0.070, 0.001])  # seconds per token
    rate, curve = find_rate(fake, "u", rows, target_ms=40.0, cap=10.0, seed=0, search=(0.1, 0.2, 0.3, 0.4))
    assert rate == 2.0 and fake.calls == [1.0, 1.0, 2.0, 2.0, 2.0, 3.0, 3.0, 3.0]
    assert [round(p) for _, p in curve] == [10, 20, 50, 20, 30, 30, 60, 70]
    # refined: 3 missed, so 2.5 (halfway to R) is judged: met, met -> R
    fake = Fake([0.010, 0.020, 0.020, 0.030, 0.060, 0.070, 0.030, 0.035])
    rate, curve = find_rate(fake, "u", rows, target_ms=40.0, cap=10.0, seed=0, search=(0.1, 0.2, 0.3, 0.4),
                            refine=True)
    assert rate == 2.5 and fake.calls == [1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 2.5, 2.5], fake.calls
    fake = Fake([0.010, 0.020, 0.020, 0.030, 0.060, 0.070, 0.050, 0.030, 0.045])  # 2.5 missed: R stays 2
    rate, _ = find_rate(fake, "u", rows, target_ms=40.0, cap=10.0, seed=0, search=(0.1, 0.2, 0.3, 0.4), refine=True)
    assert rate == 2.0 and fake.calls[-3:] == [2.5, 2.5, 2.5]
    with pytest.raises(SystemExit, match="larger --tpot-ms"):
        find_rate(Fake([0.050, 0.050]), "u", rows, target_ms=40.0, cap=10.0, seed=0, search=(0.1, 0.2))
    rate, _ = find_rate(Fake([0.050, 0.050]), "u", rows, target_ms=40.0, cap=10.0, seed=0, search=(0.1, 0.2),
                        strict=False)  # a smoke run goes on from the lowest rate searched
    assert rate == 1.0


def test_measure_leaves_the_warm_up_out_of_the_figures_but_not_out_of_failures_or_the_whole_step_p90():
    from types import SimpleNamespace

    from benchmarks.serving.elastic_ramp import measure

    per = [(True, 1.0, 1.0 + 0.9 * 9, 10, 0.0), (False, 0.0, 0.0, 0, 0.0)] + \
          [(True, 0.1, 0.1 + 0.01 * 9, 10, 0.0)] * 8  # two warm-up rows (one slow, one failed), eight measured
    client = SimpleNamespace(run=lambda url, rows, concurrency, rate, seed: SimpleNamespace(
        per_request=per, output_throughput=5.0, texts=tuple("wwabcdefgh")))
    rows = [SimpleNamespace(output_len=10)] * 10
    m = measure(client, "u", rows, 2.0, 0, warm=2)
    assert m["tpot_p90_ms"] == pytest.approx(10.0) and m["tpot_p90_all_ms"] == pytest.approx(900.0)
    assert m["ttft_p90_s"] == pytest.approx(0.1) and len(m["tpot_s"]) == 8 and m["failed"] == 1
    assert m["texts"] == list("abcdefgh")
    assert measure(client, "u", rows, 2.0, 0)["tpot_p90_ms"] == pytest.approx(900.0)  # no warm-up: all counted


def test_counted_reads_the_route_counters_when_the_first_measured_request_is_sent(monkeypatch):
    """counted: with a warm-up the counters are read at the first measured request's arrival (a timer,
    while the load runs), so the skip fraction and tokens per level are the measured requests'; a run
    that ends before that time counts nothing."""
    import time
    from types import SimpleNamespace

    import benchmarks.serving.elastic_ramp as er

    readings = iter([(10.0, 0.0), (30.0, 10.0), (50.0, 10.0), (50.0, 10.0)])
    seen = []
    monkeypatch.setattr(er, "route_counts", lambda url: (seen.append(time.monotonic()), next(readings))[1])
    monkeypatch.setattr(er, "level_tokens", lambda url: {"0": float(len(seen))})

    def measure(client, url, rows, rate, seed, warm):
        t0 = time.monotonic()
        while len(seen) < 1 and time.monotonic() - t0 < 5:  # the load runs until the timer has read
            time.sleep(0.01)
        return {"ran": (t0, time.monotonic())}

    monkeypatch.setattr(er, "measure", measure)
    srv = SimpleNamespace(url="u")
    m = er.counted(None, srv, [0] * 10, 1000.0, 0, warm=2)  # the third arrival: a few ms in
    assert seen[0] > m["ran"][0] and m["routes"] == [20.0, 10.0] and m["levels"] == {"0": 1.0}
    monkeypatch.setattr(er, "measure", lambda client, url, rows, rate, seed, warm: {})
    m = er.counted(None, srv, [0] * 10, 0.001, 0, warm=2)  # the warm-up would last an hour: cancelled
    assert m["routes"] == [0.0, 0.0]


def test_ramp_search_starts_from_a_floor_known_to_meet_the_target():
    from types import SimpleNamespace

    from benchmarks.serving.elastic_ramp import find_rate

    warms = []

    def run(url, rows, concurrency, rate, seed):
        return SimpleNamespace(per_request=[(True, 0.0, 0.060 * 4, 5, 0.0)] * len(rows), output_throughput=1.0,
                               texts=())

    def rows(rate):
        warms.append(rate)
        return [SimpleNamespace(output_len=5)] * 4, 1
    rate, curve = find_rate(SimpleNamespace(run=run), "u", rows, target_ms=40.0, cap=10.0, seed=0, search=(0.9, 1.0),
                            floor=8.0)
    assert rate == 8.0 and len(curve) == 2 and warms == [9.0, 9.0]  # 0.9x missed twice: R stays at the floor


@pytest.mark.parametrize("argv", [["--rate", "2"], ["--rate", "0", "--tpot-ms", "300"], ["--rounds", "0"],
                                  ["--steps", "1,x"], ["--steps", "1,1"], ["--steps", "0,1"], ["--steps", ""],
                                  ["--page", "../elastic"], ["--page", "Ramp"]])
def test_ramp_refuses_a_given_rate_without_its_target_bad_steps_rounds_and_page_names(argv, capsys):
    from benchmarks.serving.elastic_ramp import main

    with pytest.raises(SystemExit):
        main(argv)
    assert argv[0] in capsys.readouterr().err


def test_ramp_steps_are_read_lowest_first():
    import argparse

    from benchmarks.serving.elastic_ramp import STEPS, parse_steps

    assert parse_steps(argparse.ArgumentParser(), "1.25,1,1.1") == (1.0, 1.1, 1.25)
    assert parse_steps(argparse.ArgumentParser(), ",".join(f"{f:g}" for f in STEPS)) == STEPS
