"""Trace a model's DecoderStack with its decoder layers as fx leaves."""
from __future__ import annotations

from torch import fx, nn


class StackTracer(fx.Tracer):
    def __init__(self, leaves) -> None:
        super().__init__()
        self._leaves = {id(m) for m in leaves}

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return id(m) in self._leaves or super().is_leaf_module(m, qualname)


def trace_stack(stack: nn.Module) -> fx.GraphModule:
    """stack.layers (a ModuleList, or a ModuleDict keyed by layer index) are the leaves; returns a
    GraphModule whose call_module nodes target layers.<i>."""
    graph = StackTracer(stack.layers.children()).trace(stack)
    return fx.GraphModule(stack, graph, class_name="DecoderStack")
