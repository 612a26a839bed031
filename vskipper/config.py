"""`vskipper.Config`: how a transformed model executes, as one typed, validated object."""
from __future__ import annotations

from dataclasses import dataclass

EXECUTIONS = ("auto", "dense", "routed")


@dataclass(frozen=True)
class Config:
    """How routed layers execute. Every choice computes the same function.

    execution: "dense"  -> every row computes the MLP and the adapter, then a mask selects;
               "routed" -> RUN rows are gathered, run through attention + MLP, scattered back;
                           PROJECT rows likewise through the adapter;
               "auto"   -> the cost model picks dense or routed per layer and batch.
    static_shapes: the routed body keeps fixed shapes and device-side counts (no host sync,
               CUDA-graph safe). None = on for CUDA tensors, off elsewhere (on CPU the routed
               body slices to the real counts, which is what makes it fast there).
    check_sync: fail with HostSyncError on any host sync inside a routed layer during decode
               (a guard for tests; slows things down).
    """

    execution: str = "auto"
    static_shapes: bool | None = None
    check_sync: bool = False

    def __post_init__(self) -> None:
        if self.execution not in EXECUTIONS:
            raise ValueError(
                f"Config.execution={self.execution!r} is not one of {', '.join(map(repr, EXECUTIONS))}"
            )
        if self.static_shapes not in (None, True, False):
            raise ValueError(f"Config.static_shapes={self.static_shapes!r} must be None, True or False")
        if not isinstance(self.check_sync, bool):
            raise ValueError(f"Config.check_sync={self.check_sync!r} must be True or False")
