"""VerifyPass: invariants of a transformed stack.

- every decoder layer is called exactly once, as itself or as its routed layer (so K/V are
  written for every token at every layer: routed layers write K/V for all rows);
- the routed layers are exactly the skipper's;
- each routed layer's node records the body its module runs, and is given route maps exactly
  when that body needs them.
(Host syncs cannot be seen here: all compute sits inside fx leaves. The runtime guard
vskipper.guard.NoHostSync, Config(check_sync=True), checks them.)"""
from __future__ import annotations

from torch import fx

from vskipper.passes.base import Pass, PassError, layer_index


class VerifyPass(Pass):
    name = "verify"

    def __init__(self, layers, routed) -> None:
        """layers: the indices of the decoder layers the stack calls; routed: those the skipper routes."""
        self.layers, self.routed = tuple(layers), set(routed)

    def call(self, gm: fx.GraphModule) -> tuple[fx.GraphModule, bool]:
        seen: dict[int, list[str]] = {}
        for n in gm.graph.nodes:
            for prefix in ("layers", "routed"):
                i = layer_index(n, prefix)
                if i is not None:
                    seen.setdefault(i, []).append(n.target)
            if layer_index(n, "routed") is not None:
                body = gm.get_submodule(n.target).body
                if n.meta.get("vskipper", {}).get("body") != body.name:
                    raise PassError(self.name, n.target, f"graph records body {n.meta.get('vskipper')}, "
                                                         f"the module runs {body.name!r}")
                if (n.args[5] is not None) != body.needs_maps:
                    raise PassError(self.name, n.target, f"route maps {'missing' if body.needs_maps else 'given'} "
                                                         f"for body {body.name!r}")
        for i in self.layers:
            calls = seen.get(i, [])
            if len(calls) != 1:
                raise PassError(self.name, f"layers.{i}", f"called {len(calls)} times ({calls}); expected once")
            if (calls[0].startswith("routed.")) != (i in self.routed):
                raise PassError(self.name, f"layers.{i}", f"is {calls[0]}, which disagrees with the skipper")
        return gm, False
