"""The fx passes over a model's decoder stack: trace, route, verify. (What each routed layer runs is
chosen before them, once, by vskipper.routed_layer.make_body; the route pass records it.)"""
from vskipper.passes.base import Pass, PassError, run_passes
from vskipper.passes.route import RoutePass
from vskipper.passes.trace import trace_stack
from vskipper.passes.verify import VerifyPass

__all__ = ["Pass", "PassError", "run_passes", "trace_stack", "RoutePass", "VerifyPass"]
