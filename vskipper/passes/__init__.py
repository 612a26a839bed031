"""The fx passes over a model's decoder stack: trace, route, dispatch, verify."""
from vskipper.passes.base import Pass, PassError, run_passes
from vskipper.passes.dispatch import DispatchPass
from vskipper.passes.route import RoutePass
from vskipper.passes.trace import trace_stack
from vskipper.passes.verify import VerifyPass

__all__ = ["Pass", "PassError", "run_passes", "trace_stack", "RoutePass", "DispatchPass", "VerifyPass"]
