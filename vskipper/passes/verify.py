"""VerifyPass: invariants of a transformed stack.

- every decoder layer is called exactly once, as itself or as its routed layer (so K/V are
  written for every token at every layer: routed layers write K/V for all rows);
- the routed layers are exactly the skipper's;
- no host-sync op in the graph itself (.item(), .tolist(), nonzero, .cpu())."""
from __future__ import annotations

import torch
from torch import fx

from vskipper.passes.base import Pass, PassError, layer_index

HOST_SYNC_METHODS = {"item", "tolist", "nonzero", "cpu", "numpy"}
HOST_SYNC_FUNCTIONS = {torch.nonzero, torch.Tensor.item, torch.Tensor.tolist}


class VerifyPass(Pass):
    name = "verify"

    def __init__(self, num_layers: int, routed: tuple[int, ...]) -> None:
        self.num_layers, self.routed = num_layers, set(routed)

    def call(self, gm: fx.GraphModule) -> tuple[fx.GraphModule, bool]:
        seen: dict[int, list[str]] = {}
        for n in gm.graph.nodes:
            for prefix in ("layers", "routed"):
                i = layer_index(n, prefix)
                if i is not None:
                    seen.setdefault(i, []).append(n.target)
            if (n.op == "call_method" and n.target in HOST_SYNC_METHODS) or (
                n.op == "call_function" and n.target in HOST_SYNC_FUNCTIONS
            ):
                raise PassError(self.name, n.name, f"host-sync op {n.target} in the stack graph")
        for i in range(self.num_layers):
            calls = seen.get(i, [])
            if len(calls) != 1:
                raise PassError(self.name, f"layers.{i}", f"called {len(calls)} times ({calls}); expected once")
            if (calls[0].startswith("routed.")) != (i in self.routed):
                raise PassError(self.name, f"layers.{i}", f"is {calls[0]}, which disagrees with the skipper")
        return gm, False
