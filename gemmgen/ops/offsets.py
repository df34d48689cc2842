"""The values of cu_seqlens offsets tensors, read to the host once per tensor and version.

Reading a device tensor's values is a sync: the GPU idles while the host waits. Every layer of a
model step passes the same offsets, so their values are read once per tensor version (an in-place
change moves the version on and they are read again) and kept with a weak reference to the tensor
(bench/NOTES.md 82). While torch.compile traces, a CUDA graph is captured, or for meta and fake
tensors, the values cannot be read: `entry` then returns None and callers assume the worst case.
"""
from __future__ import annotations

import dataclasses
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensor

# Entries kept at most; a model passes a few offsets tensors, a long-running server many over time.
_MOST = 256


@dataclasses.dataclass
class Offsets:
    """One tensor version's offsets, with what has been derived from them."""

    ref: weakref.ref
    version: int
    values: tuple[int, ...]
    lengths: tuple[int, ...]
    checked: set = dataclasses.field(default_factory=set)  # (total, max_seqlen) pairs the values passed
    short_keys: dict = dataclasses.field(default_factory=dict)  # (id(key-side entry), masked) -> (it, flag)


_seen: dict[int, Offsets] = {}


def _version(cu: torch.Tensor) -> int | None:
    """cu's version counter; None for a tensor without one (inference mode): read every call."""
    try:
        return cu._version
    except RuntimeError:
        return None


def readable(cu: torch.Tensor) -> bool:
    """Whether cu's values can be read now: not while tracing (checked first: tracing cannot
    evaluate is_current_stream_capturing), not from a meta or fake tensor, not while capturing."""
    return not (torch.compiler.is_compiling() or isinstance(cu, FakeTensor) or cu.is_meta
                or (cu.is_cuda and torch.cuda.is_current_stream_capturing()))


def entry(cu: torch.Tensor) -> Offsets | None:
    """cu's values (a device-to-host read for a new tensor or version), or None when unreadable."""
    if not readable(cu):
        return None
    version = _version(cu)
    seen = _seen.get(id(cu))
    if version is not None and seen is not None and seen.ref() is cu and seen.version == version:
        return seen
    values = tuple(cu.tolist())
    e = Offsets(weakref.ref(cu) if version is not None else (lambda: None), -1 if version is None else version,
                values, tuple(b - a for a, b in zip(values, values[1:])))
    if version is not None:
        if len(_seen) >= _MOST:
            _seen.clear()
        _seen[id(cu)] = e
    return e


def short_keys(cu_q: torch.Tensor, cu_k: torch.Tensor, masked: bool) -> bool:
    """Whether some sequence with queries has no keys, or with a mask (causal or a window) fewer
    keys than queries; True when the offsets cannot be read now (the case a kernel that cannot run
    such sequences must assume)."""
    eq, ek = entry(cu_q), entry(cu_k)
    if eq is None or ek is None:
        return True
    found = eq.short_keys.get((id(ek), masked))
    if found is None or found[0] is not ek:  # (holding ek keeps its id from being reused)
        flag = any(lq > 0 and (lk <= 0 or (masked and lk < lq)) for lq, lk in zip(eq.lengths, ek.lengths))
        found = eq.short_keys[id(ek), masked] = (ek, flag)
    return found[1]
