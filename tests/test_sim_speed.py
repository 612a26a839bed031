"""The simulator is fast enough for `vskipper plan`: a 10-minute trace at 50 requests/s (30,000 requests of
GSM8K-like lengths, batches of hundreds of rows) in at most 10 s of one core; guarded here at half that."""
import time

from vskipper.sim import Host, ServerConfig, StepModel, Workload, poisson, simulate

LIMIT_S = 5.0  # the 10 s, with a margin for a slower or busier machine


def test_ten_minutes_at_50_per_second_is_fast():
    m = StepModel("gpu-like", {1: (7.0, 6e-5), 16: (7.8, 3e-5), 64: (8.3, 2.8e-5), 256: (10.8, 2.9e-5),
                               1024: (30.0, 2.9e-5)},
                  {"e0": 4.0, "per_token": 0.02, "per_pair": 2e-6, "per_row": 0.0})
    w = Workload("normal:mean=490,sd=40,min=400,max=700", "lognormal:mean=180,sd=80,min=10,max=512", max_new_tokens=512)
    reqs = w.requests(poisson(50.0, duration=600.0, seed=0), seed=0)
    t0 = time.process_time()
    r = simulate(reqs, m, Host(serial=False), ServerConfig(max_total_tokens=800_000, max_running_requests=4096))
    s = r.summary()
    took = time.process_time() - t0
    assert s["completed"] == len(reqs) > 29_000
    assert len(r.steps) > 10_000  # it did simulate every step
    assert took < LIMIT_S, f"{took:.1f} s of CPU for {len(reqs)} requests and {len(r.steps)} steps"
