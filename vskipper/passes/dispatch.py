"""DispatchPass: choose, per routed layer, the body that computes it (dense-masked or routed).

Both bodies compute the same function (the one principle); "auto" asks the cost model at run
time, so its layers keep the route maps node. "auto" without a calibration for this device runs
dense-masked (the caller warns)."""
from __future__ import annotations

from torch import fx

from vskipper.config import Config
from vskipper.cost import AutoBody, Calibration
from vskipper.passes.base import Pass, layer_index


class DispatchPass(Pass):
    name = "dispatch"

    def __init__(self, config: Config, calibration: Calibration | None = None) -> None:
        self.config, self.calibration = config, calibration
        self.bodies: dict[int, str] = {}

    def call(self, gm: fx.GraphModule) -> tuple[fx.GraphModule, bool]:
        body = self.config.execution
        if body == "auto" and self.calibration is None:
            body = "dense"
        for node in list(gm.graph.nodes):
            i = layer_index(node, "routed")
            if i is None:
                continue
            module = gm.get_submodule(node.target)
            module.body = body
            module.chooser = AutoBody(self.calibration) if body == "auto" else None
            node.meta["vskipper"]["body"] = body
            self.bodies[i] = body
            if body == "dense":  # the dense body needs no route maps: drop that node
                maps = node.args[5]
                node.args = node.args[:5] + (None,)
                if not maps.users:
                    gm.graph.erase_node(maps)
        return gm, bool(self.bodies)
