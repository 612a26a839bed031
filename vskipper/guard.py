"""A guard that fails on host synchronisation: `.item()`, `.tolist()`, `bool(t)`, `nonzero`,
boolean-mask indexing, and other data-dependent-shape ops. It works on CPU tensors too, so the
CUDA-graph safety of a code path can be tested without a GPU."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
SYNC_OPS = {
    aten._local_scalar_dense,  # .item(), .tolist(), int(t), bool(t)
    aten.nonzero,
    aten.nonzero_static,
    aten.masked_select,
    aten.unique_dim,
    aten._unique2,
    aten.unique_consecutive,
    aten.repeat_interleave,
}


class HostSyncError(RuntimeError):
    pass


class NoHostSync(TorchDispatchMode):
    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in SYNC_OPS and func is not aten.nonzero_static.default:
            raise HostSyncError(f"host sync ({func}) in {self.where}")
        if packet in (aten.index, aten.index_put, aten.index_put_):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices):
                raise HostSyncError(f"boolean-mask indexing ({func}) in {self.where}: a data-dependent shape")
        return func(*args, **kwargs)
