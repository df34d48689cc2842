"""Values derived from a tensor, kept per tensor object and version.

Every layer of a model step passes the same tensors for its cu_seqlens offsets and its attention
mask; what gemmgen derives from them (the offsets' values, read to the host; a bool mask's additive
copy in q's dtype) is made once per tensor object and version: an in-place change through torch
moves the version on, and the value is made again. An entry holds a weak reference to its tensor
and goes when the tensor does.

Nothing is kept while torch.compile traces or a CUDA graph is captured (a replay must redo the work:
its inputs may change in place between replays), nor for meta and fake tensors or tensors without a
version counter (inference mode): `get` then makes the value on every call. A change torch does not
count (through `.data`, or a kernel writing to the tensor's memory on its own) leaves the version
as it was and goes unseen, as it does for torch's own checks of tensors saved for the backward.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Hashable

import torch
from torch._subclasses.fake_tensor import FakeTensor


def steady(t: torch.Tensor) -> bool:
    """Whether a value derived from t may be read or kept now: not while tracing (checked first:
    tracing cannot evaluate is_current_stream_capturing), not for a meta or fake tensor, not while
    a CUDA graph is captured."""
    return not (torch.compiler.is_compiling() or isinstance(t, FakeTensor) or t.is_meta
                or (t.is_cuda and torch.cuda.is_current_stream_capturing()))


def version(t: torch.Tensor) -> int | None:
    """t's version counter; None for a tensor without one (inference mode)."""
    try:
        return t._version
    except RuntimeError:
        return None


class PerVersion:
    """Values made from tensors, at most `most` of them (all dropped when full), each kept for its
    tensor object and version and a key of the caller's (what else the value depends on)."""

    def __init__(self, most: int):
        self._most = most
        self._entries: dict[tuple[int, Hashable], tuple[weakref.ref, int, Any]] = {}

    def get(self, t: torch.Tensor, key: Hashable, make: Callable[[], Any]) -> Any:
        """The value kept for (t, its version, key), or make()'s, kept where t is steady and has a
        version counter."""
        return self.get_steady(t, key, make) if steady(t) else make()

    def get_steady(self, t: torch.Tensor, key: Hashable, make: Callable[[], Any]) -> Any:
        """get() for a caller that has found t steady itself (a call's hot path asks once)."""
        seen = version(t)
        if seen is None:
            return make()
        slot = (id(t), key)
        entry = self._entries.get(slot)
        if entry is not None and entry[0]() is t and entry[1] == seen:
            return entry[2]
        value = make()
        if len(self._entries) >= self._most:
            self._entries.clear()
        self._entries[slot] = (weakref.ref(t, lambda ref, slot=slot: self._drop(slot, ref)), seen, value)
        return value

    def _drop(self, slot: tuple[int, Hashable], ref: weakref.ref) -> None:
        """The entry of a tensor that has gone (not a newer entry under the same id)."""
        entry = self._entries.get(slot)
        if entry is not None and entry[0] is ref:
            del self._entries[slot]

    def __len__(self) -> int:
        return len(self._entries)
