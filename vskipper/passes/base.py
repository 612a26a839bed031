"""Pass infrastructure: a pass is a class with requires / call / ensures (torch.fx style)."""
from __future__ import annotations

from torch import fx


class PassError(RuntimeError):
    """A pass found the graph in a state it cannot handle; names the pass and the layer."""

    def __init__(self, pass_name: str, where: str, message: str) -> None:
        super().__init__(f"vskipper pass {pass_name}, {where}: {message}")


class Pass:
    name = "pass"

    def requires(self, gm: fx.GraphModule) -> None:  # raise PassError if the input is not as expected
        pass

    def call(self, gm: fx.GraphModule) -> tuple[fx.GraphModule, bool]:
        raise NotImplementedError

    def ensures(self, gm: fx.GraphModule) -> None:  # raise PassError if the output is not as promised
        pass

    def __call__(self, gm: fx.GraphModule) -> tuple[fx.GraphModule, bool]:
        self.requires(gm)
        gm, modified = self.call(gm)
        self.ensures(gm)
        return gm, modified


def layer_index(node: fx.Node, prefix: str) -> int | None:
    """'layers.7' -> 7 for call_module nodes whose target is prefix.<int>."""
    if node.op != "call_module" or not isinstance(node.target, str):
        return None
    head, _, tail = node.target.rpartition(".")
    return int(tail) if head == prefix and tail.isdigit() else None


def run_passes(gm: fx.GraphModule, passes: list[Pass]) -> tuple[fx.GraphModule, list[bool]]:
    """Run passes in order; lint and recompile once at the end."""
    mods = []
    for p in passes:
        gm, m = p(gm)
        mods.append(m)
    gm.graph.lint()
    gm.recompile()
    return gm, mods
