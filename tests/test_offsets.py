"""gemmgen.ops.offsets: cu_seqlens values read once per tensor version, and the short-keys flag that
keeps packed calls with sequences outside fmha_sm90's contract on a family that runs them."""
from __future__ import annotations

import inspect

import pytest
import torch

from gemmgen.kernels import launch
from gemmgen.ops import offsets
from gemmgen.select import calls


def cu(lengths) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


@pytest.mark.parametrize("lens_q, lens_k, masked, short", [
    ([4, 0, 7], [4, 3, 9], False, False),
    ([4, 0, 7], [4, 3, 9], True, False),
    ([4, 0, 7], [4, 0, 9], True, False),  # no queries, no keys: nothing to run
    ([4, 5], [4, 0], False, True),  # queries without keys
    ([4, 5], [4, 2], False, False),  # fewer keys than queries: fine without a mask
    ([4, 5], [4, 2], True, True),  # ... not under a causal mask or a window
    ([1], [1], True, False),
])
def test_short_keys(lens_q, lens_k, masked, short):
    assert offsets.short_keys(cu(lens_q), cu(lens_k), masked) is short


def test_values_read_once_per_version(monkeypatch):
    cu_q, cu_k = cu([3, 4]), cu([3, 4])
    reads = []
    real_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(self) or real_tolist(self))
    for _ in range(3):
        assert offsets.short_keys(cu_q, cu_k, True) is False
    assert len(reads) == 2, "each tensor read once"
    cu_k[2] = 5  # the second sequence now has 2 keys for 4 queries
    assert offsets.short_keys(cu_q, cu_k, True) is True
    assert offsets.short_keys(cu_q, cu_k, False) is False
    assert len(reads) == 3, "only the changed tensor read again"
    assert offsets.entry(cu_k).lengths == (3, 2)


def test_unreadable_offsets_count_as_short():
    """Meta tensors (as under tracing or graph capture) cannot be read: the flag assumes the worst."""
    meta = torch.empty(3, dtype=torch.int32, device="meta")
    assert offsets.entry(meta) is None
    assert offsets.short_keys(meta, meta, False) is True


def test_problem_and_params_of_a_packed_call():
    assert inspect.signature(calls.problem_for_varlen).parameters["short_keys"].default is True, \
        "a caller that did not read the offsets gets the worst case"
    q = torch.zeros(11, 4, 64, dtype=torch.float16)
    k = torch.zeros(13, 2, 64, dtype=torch.float16)
    o = torch.empty_like(q)
    p = launch.params_varlen(q, k, k, o, None, cu([5, 6]), cu([6, 7]), 6, 7, causal=True, scale=None)
    assert (p.total_q, p.total_k) == (11, 13), "the packed tensors' rows bound the TMA descriptors"
