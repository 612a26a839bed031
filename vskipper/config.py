"""`vskipper.Config`: how a transformed model executes, as one typed, validated object. What it
says is resolved once, at transform time, into one body per routed layer (vskipper/routed_layer.py)."""
from __future__ import annotations

from dataclasses import dataclass

EXECUTIONS = ("auto", "dense", "routed", "routed-mlp")
IMPLS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class Config:
    """How routed layers execute. Every choice computes the same function.

    execution: "dense"  -> every row computes attention, the MLP and the adapter, then a mask selects;
               "routed" -> RUN rows are gathered, run through attention + MLP, scattered back;
                           PROJECT rows likewise through the adapter;
               "routed-mlp" -> attention for every row (as the engine computes it), the MLP and the
                           adapter routed as above;
               "auto"   -> the cost model picks one of these per layer and batch.
    impl:      the implementation of vskipper's ops (route maps, the fixed-shape routed body):
               "triton" kernels, the "torch" references, or "auto" = triton for a model on CUDA,
               torch elsewhere.
    static_shapes: the routed body keeps fixed shapes and device-side counts (no host sync,
               CUDA-graph safe). None = on for a model on CUDA, off elsewhere (on CPU the routed
               body slices to the real counts, which is what makes it fast there).
    check_sync: fail with HostSyncError on any host sync inside a routed layer during decode
               (a guard for tests; slows things down).
    tuned_kernels: Triton launches use this GPU's tuned launch configs where a trusted table has
               them (vskipper/kernel_configs/); False pins every kernel to its untuned defaults.
    """

    execution: str = "auto"
    impl: str = "auto"
    static_shapes: bool | None = None
    check_sync: bool = False
    tuned_kernels: bool = True

    def __post_init__(self) -> None:
        if self.execution not in EXECUTIONS:
            raise ValueError(
                f"Config.execution={self.execution!r} is not one of {', '.join(map(repr, EXECUTIONS))}"
            )
        if self.impl not in IMPLS:
            raise ValueError(f"Config.impl={self.impl!r} is not one of {', '.join(map(repr, IMPLS))}")
        if self.static_shapes not in (None, True, False):
            raise ValueError(f"Config.static_shapes={self.static_shapes!r} must be None, True or False")
        for name in ("check_sync", "tuned_kernels"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Config.{name}={getattr(self, name)!r} must be True or False")
