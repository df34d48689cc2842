"""gemmgen.ops.versioned: values derived from a tensor, kept per tensor object and version; and the
attention mask's kernel copy (gemmgen.ops.attention._prepare_mask), made once per mask version."""
from __future__ import annotations

import gc

import torch

from gemmgen.ops import attention, versioned


def counted():
    made = []

    def make(t):
        made.append(t)
        return t.sum().item()
    return made, make


def test_a_value_is_made_once_per_version_and_key():
    cache = versioned.PerVersion(most=8)
    made, make = counted()
    t = torch.arange(6.0)
    for _ in range(3):
        assert cache.get(t, "a", lambda: make(t)) == 15
    assert len(made) == 1
    assert cache.get(t, "b", lambda: make(t)) == 15 and len(made) == 2, "another key, another value"
    t[0] = 10.0  # an in-place change moves the version on
    assert cache.get(t, "a", lambda: make(t)) == 25 and len(made) == 3
    twin = torch.arange(6.0)  # equal values, another tensor
    assert cache.get(twin, "a", lambda: make(twin)) == 15 and len(made) == 4
    view = t[:]  # a view is another object (it shares t's version counter)
    assert cache.get(view, "a", lambda: make(view)) == 25 and len(made) == 5


def test_an_entry_goes_with_its_tensor_and_the_cache_stays_bounded():
    cache = versioned.PerVersion(most=3)
    t = torch.ones(4)
    cache.get(t, None, lambda: 1)
    assert len(cache) == 1
    del t
    gc.collect()
    assert len(cache) == 0, "the entry of a tensor that has gone is dropped"
    kept = [torch.ones(2) for _ in range(5)]
    for x in kept:
        cache.get(x, None, lambda: 1)
    assert len(cache) <= 3


def test_nothing_is_kept_without_a_version_or_while_unsteady():
    cache = versioned.PerVersion(most=8)
    made, make = counted()
    with torch.inference_mode():
        t = torch.ones(3)
    for _ in range(2):
        cache.get(t, None, lambda: make(t))
    meta = torch.empty(3, device="meta")
    for _ in range(2):
        cache.get(meta, None, lambda: 0)
    assert len(made) == 2 and len(cache) == 0


def test_a_bool_masks_kernel_copy_is_made_once_per_mask_version():
    q = torch.zeros(2, 4, 16, 8, dtype=torch.float16)
    k = torch.zeros(2, 2, 24, 8, dtype=torch.float16)
    mask = torch.rand(2, 1, 16, 24) > 0.3
    first = attention._prepare_mask(mask, q, k)
    assert first.dtype == torch.float16 and first.shape == (2, 4, 16, 24) and first.stride(1) == 0
    assert torch.equal(first == 0, mask.expand(2, 4, 16, 24))
    assert torch.isneginf(first[~mask.expand(2, 4, 16, 24)]).all()
    assert attention._prepare_mask(mask, q, k) is first, "the same mask version: the same copy"
    mask[0, 0, 3, :] = False  # in place: the copy is made again
    second = attention._prepare_mask(mask, q, k)
    assert second is not first and torch.isneginf(second[0, :, 3]).all()
    assert attention._prepare_mask(mask, q.bfloat16(), k.bfloat16()).dtype == torch.bfloat16
    assert attention._prepare_mask(mask.clone(), q, k) is not second, "another mask tensor, another copy"
    base = torch.ones(2, 1, 16, 32, dtype=torch.bool)
    view = base[..., :24]  # a view shares its base's version counter
    kept = attention._prepare_mask(view, q, k)
    base[1, 0, 2, 5] = False  # changed through the base
    again = attention._prepare_mask(view, q, k)
    assert again is not kept and torch.isneginf(again[1, :, 2, 5]).all() and (kept[1, :, 2, 5] == 0).all()


def test_float_masks_read_in_place_are_not_copied_and_masks_with_grad_not_kept():
    q = torch.zeros(1, 2, 16, 8, dtype=torch.float16)
    k = torch.zeros(1, 2, 24, 8, dtype=torch.float16)
    aligned = torch.zeros(1, 1, 16, 24, dtype=torch.float16)
    bias = attention._prepare_mask(aligned, q, k)
    assert bias.data_ptr() == aligned.data_ptr(), "read where it lies"
    k17 = torch.zeros(1, 2, 17, 8, dtype=torch.float16)
    odd = torch.randn(1, 1, 16, 17, dtype=torch.float16)  # rows of 17: padded in a copy, kept
    copy = attention._prepare_mask(odd, q, k17)
    assert copy.data_ptr() != odd.data_ptr() and torch.equal(copy[0, 1], odd[0, 0])
    assert attention._prepare_mask(odd, q, k17) is copy
    grad = odd.clone().requires_grad_()
    assert attention._prepare_mask(grad, q, k17) is not attention._prepare_mask(grad, q, k17)


def test_a_copy_is_kept_per_stream(monkeypatch):
    """A copy made on one stream is not handed to a call on another (it may still be in the making)."""
    q = torch.zeros(1, 2, 16, 8, dtype=torch.float16)
    k = torch.zeros(1, 2, 24, 8, dtype=torch.float16)
    mask = torch.rand(1, 1, 16, 24) > 0.5
    monkeypatch.setattr(attention, "_stream_key", lambda t: 1)
    on_one = attention._prepare_mask(mask, q, k)
    monkeypatch.setattr(attention, "_stream_key", lambda t: 2)
    on_two = attention._prepare_mask(mask, q, k)
    assert on_two is not on_one and torch.equal(on_two, on_one)
    assert attention._prepare_mask(mask, q, k) is on_two

