"""A simulator of SGLang 0.5.23's scheduler, priced by measured step tables: what a server's latency and
throughput would be for a workload, per system (upstream, a skipper), on a device whose steps were measured.

    ServerConfig          the server's scheduling flags, SGLang's names and defaults (server.py)
    Request, Workload, Lengths, poisson, read_trace    what arrives (workload.py)
    StepTables, StepModel, Host    a device's measured steps and the server's own work per step (steps.py)
    simulate(requests, steps, host, server) -> SimResult    the run (engine.py)
    SimResult.summary(), knee    TTFT / TPOT / ITL / e2e, throughput, batch size (metrics.py)

The loop is our own, not simpy's or vidur's: engine.py's docstring says why.
"""
from vskipper.sim.engine import simulate
from vskipper.sim.metrics import METRICS, SimResult, knee
from vskipper.sim.server import ServerConfig
from vskipper.sim.steps import Host, StepModel, StepTables, fit_decode, fit_extend
from vskipper.sim.workload import Lengths, Request, Workload, poisson, read_trace, write_trace

__all__ = [
    # the server and its steps
    "ServerConfig",
    "StepTables",
    "StepModel",
    "Host",
    "fit_decode",
    "fit_extend",
    # what arrives
    "Request",
    "Workload",
    "Lengths",
    "poisson",
    "read_trace",
    "write_trace",
    # the run and what it reports
    "simulate",
    "SimResult",
    "METRICS",
    "knee",
]
