"""The values of cu_seqlens offsets tensors, read to the host once per tensor and version.

Reading a device tensor's values is a sync: the GPU idles while the host waits. Every layer of a
model step passes the same offsets, so their values are read once per tensor version
(gemmgen.ops.versioned; bench/NOTES.md 82). While torch.compile traces, a CUDA graph is captured,
or for meta and fake tensors, the values cannot be read: `entry` then returns None and callers
assume the worst case.
"""
from __future__ import annotations

import dataclasses

import torch

from gemmgen.ops import versioned

# Entries kept at most; a model passes a few offsets tensors, a long-running server many over time.
_seen = versioned.PerVersion(most=256)


@dataclasses.dataclass
class Offsets:
    """One tensor version's offsets, with what has been derived from them."""

    values: tuple[int, ...]
    lengths: tuple[int, ...]
    checked: set = dataclasses.field(default_factory=set)  # (total, max_seqlen) pairs the values passed
    short_keys: dict = dataclasses.field(default_factory=dict)  # (id(key-side entry), masked) -> (it, flag)


def _read(cu: torch.Tensor) -> Offsets:
    values = tuple(cu.tolist())
    return Offsets(values, tuple(b - a for a, b in zip(values, values[1:])))


def entry(cu: torch.Tensor) -> Offsets | None:
    """cu's values (a device-to-host read for a new tensor or version), or None when unreadable."""
    if not versioned.steady(cu):
        return None
    return _seen.get_steady(cu, None, lambda: _read(cu))


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
