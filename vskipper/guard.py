"""A guard that fails on host synchronisation: `.item()`, `.tolist()`, `bool(t)`, `int(t)`,
`nonzero`, boolean-mask indexing and other data-dependent-shape ops. It works on CPU tensors
too, so the CUDA-graph safety of a code path can be tested without a GPU.

Two layers: a TorchFunctionMode sees Python-level tensor methods (`tolist` on a CPU tensor never
reaches the dispatcher), a TorchDispatchMode sees aten ops, including those inside vskipper's own
custom ops."""
from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
SYNC_OPS = {
    aten._local_scalar_dense,  # .item(), int(t), bool(t) on any device
    aten.nonzero,
    aten.masked_select,
    aten.unique_dim,
    aten._unique2,
    aten.unique_consecutive,
    aten.repeat_interleave,
}
SYNC_METHODS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.numpy, torch.Tensor.__bool__,
                torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.nonzero,
                torch.nonzero}


class HostSyncError(RuntimeError):
    pass


class _Functions(TorchFunctionMode):
    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in SYNC_METHODS:
            raise HostSyncError(f"host sync ({getattr(func, '__name__', func)}) in {self.where}")
        return func(*args, **(kwargs or {}))


class _Dispatch(TorchDispatchMode):
    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "vskipper":  # look inside vskipper's own ops too: run their body under a guard
            from torch._library.custom_ops import _maybe_get_opdef

            opdef = _maybe_get_opdef(func)
            if opdef is not None:
                with NoHostSync(self.where):
                    return opdef._init_fn(*args, **kwargs)
        if func.overloadpacket in SYNC_OPS:
            raise HostSyncError(f"host sync ({func}) in {self.where}")
        if func.overloadpacket in (aten.index, aten.index_put, aten.index_put_):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices):
                raise HostSyncError(f"boolean-mask indexing ({func}) in {self.where}: a data-dependent shape")
        return func(*args, **kwargs)


@contextlib.contextmanager
def NoHostSync(where: str):  # noqa: N802  (used like a class)
    with _Functions(where), _Dispatch(where):
        yield
