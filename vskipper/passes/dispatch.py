"""DispatchPass: choose, per routed layer, the body that computes it (dense-masked or routed).

Both bodies compute the same function (the one principle); "auto" asks the cost model at run
time, so its layers keep the route maps node."""
from __future__ import annotations

from torch import fx

from vskipper.config import Config
from vskipper.passes.base import Pass, layer_index


class DispatchPass(Pass):
    name = "dispatch"

    def __init__(self, config: Config) -> None:
        self.config = config
        self.bodies: dict[int, str] = {}

    def call(self, gm: fx.GraphModule) -> tuple[fx.GraphModule, bool]:
        body = "dense" if self.config.execution == "dense" else "routed"
        for node in list(gm.graph.nodes):
            i = layer_index(node, "routed")
            if i is None:
                continue
            gm.get_submodule(node.target).body = body
            node.meta["vskipper"]["body"] = body
            self.bodies[i] = body
            if body == "dense":  # the dense body needs no route maps: drop that node
                maps = node.args[5]
                node.args = node.args[:5] + (None,)
                if not maps.users:
                    gm.graph.erase_node(maps)
        return gm, bool(self.bodies)
