"""The one dispatch point for vskipper's grouped-execution ops.

Shapes: T = rows (tokens) in the batch, H = hidden size.
"""
from __future__ import annotations

import torch


def route_maps(run_mask: torch.Tensor, valid: torch.Tensor | None = None):
    """run_mask [T] bool, valid [T] bool | None -> (run_rows [T] int32, project_rows [T] int32, counts [2] int32).

    run_rows[:counts[0]] are the indices where run_mask & valid, ascending; project_rows[:counts[1]]
    where ~run_mask & valid, ascending. A stable, deterministic compaction with no host sync."""
    run_mask = run_mask.reshape(-1)
    if valid is None:
        valid = torch.ones_like(run_mask)
    valid = valid.reshape(-1)
    run = run_mask & valid
    project = ~run_mask & valid
    run_rows = torch.argsort((~run).to(torch.int8), stable=True).to(torch.int32)
    project_rows = torch.argsort((~project).to(torch.int8), stable=True).to(torch.int32)
    counts = torch.stack([run.sum(), project.sum()]).to(torch.int32)
    return run_rows, project_rows, counts
