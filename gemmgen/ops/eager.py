"""The eager fast path shared by the operations.

A small call (decode, a short sequence) costs more on the host than on the GPU, so the operations
skip two things that cannot change the outcome of a plain eager call:

- runs_directly: torch's dispatcher. When nothing is traced, no torch function or dispatch mode
  is active, no functorch transform runs, every tensor is a plain torch.Tensor and no autograd
  graph is recorded (grad mode off, or no input requires grad), the dispatcher would only route
  the call to the op's CUDA implementation; the operation calls that implementation itself.
  Everything else (torch.compile, torch.jit.trace, FakeTensor, DTensor, vmap) goes through the op.
  An eager call that records a graph (training) runs the op's forward and backward pieces in a
  torch.autograd.Function (runs_eagerly), not through torch.library's autograd wrapper.
- Checked: metadata checks already passed. The checks that read only the tensors' metadata
  (shape, strides, dtype, device, requires_grad) give the same answer for the same signature, so
  a signature that passed once passes again; the arguments' checks (cheap) and the per-call facts
  (data pointers' alignment, overlap, lengths read from the GPU) run on every call.
"""
from __future__ import annotations

from typing import Hashable

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from gemmgen.generator import space

_Tensor = torch.Tensor
_strided = torch.strided
_is_compiling = torch.compiler.is_compiling
_is_tracing = torch.jit.is_tracing
_function_mode = torch._C._is_torch_function_mode_enabled
_functorch = torch._C._are_functorch_transforms_active


def runs_eagerly(*tensors: torch.Tensor | None) -> bool:
    """Whether a call on `tensors` (None entries ignored) is plain eager: nothing traced, no torch
    function or dispatch mode, no functorch transform, every tensor a plain torch.Tensor. Such a
    call may record an autograd graph with a torch.autograd.Function of the op's own pieces."""
    # Plain loops, not generator expressions: this runs on every small call (bench/NOTES.md, 72).
    if _is_compiling() or _is_tracing() or _function_mode() or is_in_torch_dispatch_mode() or _functorch():
        return False
    for t in tensors:
        if t is not None and type(t) is not _Tensor:
            return False
    return True


def runs_directly(*tensors: torch.Tensor | None) -> bool:
    """Whether an eager call on `tensors` (None entries ignored) may run the op's implementation
    without torch's dispatcher (see the module doc): plain eager, and no autograd graph to record."""
    if not runs_eagerly(*tensors):
        return False
    if not torch.is_grad_enabled():
        return True
    for t in tensors:
        if t is not None and t.requires_grad:
            return False
    return True


def signature(*tensors: torch.Tensor | None) -> tuple | None:
    """What the metadata checks read of `tensors` (plain tensors or None): shape, strides, dtype,
    device, requires_grad; None when one is not strided (it has no strides: the checks report it)."""
    parts = []
    for t in tensors:
        if t is None:
            parts.append(None)
        elif t.layout is not _strided:
            return None
        else:
            parts.append((t.shape, t.stride(), t.dtype, t.device, t.requires_grad))
    return tuple(parts)


class Checked:
    """The tensor signatures (signature()) whose metadata checks passed; bounded, forgotten all at
    once when full or when the family list changes (the head dims the checks accept come from it)."""

    def __init__(self, limit: int = 4096) -> None:
        self._seen: set[Hashable] = set()
        self._limit = limit
        self._families = space.version()

    def __contains__(self, key: Hashable) -> bool:
        if self._families != space.version():
            self._seen.clear()
            self._families = space.version()
        return key in self._seen

    def add(self, key: Hashable) -> None:
        if len(self._seen) >= self._limit:
            self._seen.clear()
        self._seen.add(key)

