"""RoutePass: at every routed layer, insert norm -> router -> route decisions -> route maps ->
route counter -> routed layer, in place of the plain decoder-layer call. For the fixed-shape bodies of a
whole-layer skipper with no request cap, decisions, maps and counts are one op (ops.route: one launch in
Triton), which in Triton also makes RandomSkip's decisions itself (its router then is not called).
Where the traced stack has a `budget` input (per-request control, vskipper/control.py), the request
cap rewrites the decisions right after they are made, so that maps, counters and the body all see
the capped ones.

Each routed layer comes with its body, already chosen (routed_layer.make_body); the graph records
it (node.meta["vskipper"]["body"]) and carries a route-maps node, in the ops implementation the
body names, only where the body needs one. The router reads x = input_layernorm(h), or the layer's
input h where the skipper says so (router_input "residual": SkipGPT); a sublayer skipper's decisions
([..., 2]: attention, MLP) go to its routed layer as they are, and its route maps (for the bodies that
take them) are the MLP's."""
from __future__ import annotations

import operator
from collections.abc import Callable

import torch
from torch import fx, nn

from vskipper import ops
from vskipper.passes.base import Pass, PassError, layer_index
from vskipper.skippers.base import Skipper, sanitize_gate

PLACEHOLDERS = ("token_ids", "positions", "valid")


class RoutePass(Pass):
    name = "route"

    def __init__(self, skipper: Skipper, make_routed: Callable[[int, nn.Module], nn.Module],
                 counters: nn.ModuleDict, input_norm: str, layers=None, caps: nn.ModuleDict | None = None) -> None:
        """make_routed(i, decoder layer) -> the RoutedLayer of layer i, its body chosen. layers: the
        routed layers this stack calls (default: all of the skipper's). caps: per layer, the
        control.RequestCap inserted when the stack has a `budget` input."""
        self.skipper, self.make_routed, self.counters, self.input_norm = skipper, make_routed, counters, input_norm
        self.caps = caps
        self.layers = tuple(skipper.layers if layers is None else layers)
        self.rewritten: list[int] = []

    def requires(self, gm: fx.GraphModule) -> None:
        names = {n.target for n in gm.graph.nodes if n.op == "placeholder"}
        missing = [p for p in PLACEHOLDERS if p not in names]
        if missing:
            raise PassError(self.name, "DecoderStack", f"the traced stack has no input(s) {missing}")
        found = {layer_index(n, "layers") for n in gm.graph.nodes}
        for i in self.layers:
            if i not in found:
                raise PassError(self.name, f"layers.{i}", "routed layer is not called by the traced stack")

    def call(self, gm: fx.GraphModule) -> tuple[fx.GraphModule, bool]:
        g = gm.graph
        ph = {n.target: n for n in g.nodes if n.op == "placeholder"}
        thr = self.skipper.threshold
        for node in list(g.nodes):
            i = layer_index(node, "layers")
            if i is None or i not in self.layers:
                continue
            layer = gm.get_submodule(node.target)
            if not hasattr(layer, self.input_norm):
                raise PassError(self.name, node.target, f"decoder layer has no {self.input_norm!r}")
            gm.add_submodule(f"routers.{i}", self.skipper.router(i))
            gm.add_submodule(f"counters.{i}", self.counters[str(i)])
            routed = self.make_routed(i, layer)
            gm.add_submodule(f"routed.{i}", routed)
            body = routed.body
            h = node.args[0]
            with g.inserting_before(node):
                x = g.call_module(f"{node.target}.{self.input_norm}", (h,))
                r = h if self.skipper.router_input == "residual" else x
                capped = self.caps is not None and "budget" in ph
                router = gm.get_submodule(f"routers.{i}")
                fused = body.needs_maps and not capped and not self.skipper.sublayers
                hashed = fused and body.maps_impl == "triton" and getattr(router, "hash_params", None) is not None
                raw = None if hashed else g.call_module(f"routers.{i}", (r, ph["positions"], ph["token_ids"]))
                decide = cap = maps = None
                if fused:  # decisions, route maps and counts in one op (one launch in Triton)
                    counts = g.get_attr(f"counters.{i}.counts")
                    onehot = g.get_attr(f"counters.{i}.phase.onehot")
                    src, extra = (ph["positions"], {"token_ids": ph["token_ids"], "hash_params": router.hash_params}) \
                        if hashed else (raw, {})
                    decide = dec = g.call_function(ops.route, (src, ph["valid"], counts, onehot, thr),
                                                   {**extra, "impl": body.maps_impl, "tuned": body.tuned})
                    maps = g.call_function(operator.getitem, (dec, 2))
                else:
                    decide = dec = g.call_function(sanitize_gate, (raw, thr))
                    if capped:
                        gm.add_submodule(f"caps.{i}", self.caps[str(i)])
                        cap = dec = g.call_module(f"caps.{i}", (dec, ph["valid"], ph["budget"]))
                gate = g.call_function(operator.getitem, (dec, 0))
                run = g.call_function(operator.getitem, (dec, 1))
                if not fused:
                    bad = g.call_function(operator.getitem, (dec, 2))
                    if body.needs_maps:  # a sublayer skipper's route maps are its MLP's
                        mask = g.call_function(torch.select, (run, -1, 1)) if self.skipper.sublayers else run
                        maps = g.call_function(ops.route_maps, (mask, ph["valid"]),
                                               {"impl": body.maps_impl, "tuned": body.tuned})
                    g.call_module(f"counters.{i}", (run, ph["valid"], bad))
                out = g.call_module(f"routed.{i}", (h, x, gate, run, ph["valid"], maps), dict(node.kwargs))
            for n, role in ((x, "input_norm"), (raw, "router"), (decide, "route" if fused else "decide"),
                            (cap, "request_cap"), (maps, "route_maps"), (out, "routed_layer")):
                if n is not None:
                    n.meta["vskipper"] = {"layer": i, "role": role}
            out.meta["vskipper"]["body"] = body.name
            node.replace_all_uses_with(out)
            g.erase_node(node)
            self.rewritten.append(i)
        return gm, bool(self.rewritten)

    def ensures(self, gm: fx.GraphModule) -> None:
        left = [i for i in (layer_index(n, "layers") for n in gm.graph.nodes) if i in self.layers]
        if left:
            raise PassError(self.name, f"layers.{left[0]}", "routed layer still called as a plain layer")
