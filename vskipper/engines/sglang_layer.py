"""The layer that stands in SGLang's decoder stack for a routed layer, in SGLang's conventions.

SGLang's layers carry the residual in `forward_batch.residual_stream` and fuse its add into the
next RMSNorm. At its entry `residual_batch.fold` completes the hidden state (h = residual + the
previous layer's output); at its exit `residual_batch.set_written` hands the routed layer's output
on as a complete value, which the next layer's boundary reads as it reads an embedding. Auxiliary
hidden-state capture (EAGLE3) receives the complete input, as SGLang's boundary gives it. Rows
the CUDA-graph runner pads are never routed or counted (`valid_rows`); per-request budgets are
read from the buffer the plugin fills (`request_budgets`). A batch in which every row has a budget of
0 (every request `skip: false`, or admitted at elastic depth's level 0) runs the decoder layer as
SGLang runs it: the function the routed layer would compute with every row RUN, without the router,
the cap and the body's work around the layer (what they cost a CPU server: docs/architecture.md); its
rows are counted as the cap and the counter would have counted them.
(Eager batches only: a captured graph keeps the routed layer it was captured with, which computes
the same.) Shapes: T = tokens, H = hidden."""
from __future__ import annotations

import torch
from torch import nn


def valid_rows(forward_batch, T: int, device) -> torch.Tensor:
    """[T] bool: the rows that are tokens, without a host sync (read at every replay of a graph).
    The CUDA-graph runner pads a batch up to a captured size; where SGLang enables it, it gives the
    real count in `num_token_non_padded`; otherwise its padding convention tells: padded rows write
    their K/V to the pool's reserved padding slot 0 (`out_cache_loc == 0`), which no token is ever
    given."""
    n = getattr(forward_batch, "num_token_non_padded", None)
    if n is not None:
        return torch.arange(T, device=device) < n
    loc = getattr(forward_batch, "out_cache_loc", None)
    if loc is not None and loc.shape[0] == T:
        return loc != 0
    return torch.ones(T, dtype=torch.bool, device=device)


def request_budgets(budgets, T: int) -> torch.Tensor | None:
    """[T] int32: per row, how many routed layers its request may skip (vskipper/control.py), or None:
    no per-request control installed, or an eager batch in which no request has a setting (the
    common case costs no cap at all). `budgets` (integrations/sglang/requests.py: BatchBudgets) holds
    one device buffer that the plugin fills for each batch before its forward: SGLang's runners hand
    the model a copy of the ForwardBatch they were given, so the budgets cannot travel on it. While
    SGLang captures a graph the cap is always in it, and the graph reads the buffer at every replay
    (rows the graph runner pads read stale entries, which matter to no one: padding is never routed
    or counted)."""
    if budgets is None:
        return None
    if not budgets.active and not _capturing():
        return None
    fixed = budgets.rows
    if T > fixed.shape[0]:
        raise RuntimeError(f"vskipper: a batch of {T} rows, more than the {fixed.shape[0]} rows of the "
                           f"per-request budget buffer")
    return fixed[:T]


class SGLangRoutedLayer(nn.Module):
    """Stands in `model.model.layers[i]` for a routed layer (see the module docstring). It holds
    the decoder layer's own children under their own names, so the model's state-dict keys are
    SGLang's; the traced routed layer (`graph`) is kept beside them, not as a submodule (its modules
    are these). `budgets`: the batches' per-row budget buffer (request_budgets), or None."""

    def __init__(self, layer: nn.Module, graph, budgets=None, index: int | None = None) -> None:
        super().__init__()
        for name, child in layer.named_children():
            self.add_module(name, child)
        self.layer_id = getattr(layer.self_attn.attn, "layer_id", None)
        object.__setattr__(self, "graph", graph)
        object.__setattr__(self, "plain_layer", layer)  # SGLang's own layer (its children are these)
        self.budgets = budgets
        self.index = self.layer_id if index is None else index
        self.plain_steps = 0  # forwards run as SGLang's layer (host-side count: the stats log)

    def forward(self, positions, hidden_states, forward_batch, post_residual_addition=None, capture_output=None):
        from sglang.srt.layers.layer_boundary.residual import batch as residual_batch

        if post_residual_addition is not None:
            raise NotImplementedError(f"vskipper: routed layer {self.layer_id} got post_residual_addition "
                                      "(deepstack inputs of a vision-language model): not supported")
        if self.budgets is not None and self.budgets.plain and not _capturing():
            self.plain_steps += 1
            # (hidden_states may be an output still owed its all-reduce under TP: the rows from positions)
            self._count_plain(valid_rows(forward_batch, positions.shape[-1], positions.device))
            return self.plain_layer(positions, hidden_states, forward_batch, capture_output=capture_output)
        h = residual_batch.fold(hidden_states, forward_batch)  # the complete hidden state [T, H]
        if capture_output is not None:
            capture_output(h)
        valid = valid_rows(forward_batch, h.shape[0], h.device)
        budget = request_budgets(self.budgets, h.shape[0])
        out = self.graph(h, forward_batch.input_ids, positions, valid, budget, forward_batch)
        return residual_batch.set_written(out, forward_batch)

    def _count_plain(self, valid: torch.Tensor) -> None:
        """Count a plain forward's rows as the graph's cap and route counter count a batch whose rows
        all have budget 0: every real row forced to RUN (the router is not asked)."""
        from vskipper.counters import SublayerRouteCounter

        counter = self.graph.get_submodule(f"counters.{self.index}")
        shape = valid.shape + ((2,) if isinstance(counter, SublayerRouteCounter) else ())  # sublayer decisions
        run = torch.ones(shape, dtype=torch.bool, device=valid.device)
        if hasattr(self.graph, "caps"):
            budget = torch.zeros(valid.shape, dtype=torch.int32, device=valid.device)
            self.graph.get_submodule(f"caps.{self.index}")((run.float(), run, None), valid, budget)
        counter(run, valid, None)


def _capturing() -> bool:
    from sglang.srt.model_executor.runner_utils.capture_mode import get_is_capture_mode

    return get_is_capture_mode()
