"""Head dims without tiles, run padded: any head dim from 1 to 256, as FlashAttention accepts them.

The default-built attention families have tiles for a few head dims (TILE_HEAD_DIMS: 32, 64, 96,
128, 160, 192, 256). A call with another head dim d gets q, k and v with zero columns up to the
next of those, dp, and O's extra columns cut off. Zero columns add nothing to Q Kᵀ, so the scores,
the softmax and the LSE are those of head dim d, at its scale (1/sqrt(d) unless the caller gives
one); O's first d columns are the answer. The padding and the cut are torch operations, so autograd
and torch.compile see through them: the gradients come back with head dim d. The cost is one copy
of q, k and v (and of O), against a family tuned for dp where d would otherwise run on mea_sm80's
generic tiles (built on demand) or, not being a multiple of 8, on nothing.

The backward pads the same way on its own account: a head dim whose backward is a slower family's
(fa2_bwd_sm80 for 96 on Hopper, where fmha_bwd_sm90 has tiles for 32, 64 and 128) runs padded to
another family's next head dim where selection weighs that faster, family speed against the extra
columns (gemmgen.select.selection.padded_backward_head_dim).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from gemmgen.generator import space
from gemmgen.generator.space import FAMILIES


def tile_head_dims() -> tuple[int, ...]:
    """The head dims the default-built attention families have tiles for, sorted."""
    return _tile_head_dims(space.version())


@functools.lru_cache(maxsize=1)
def _tile_head_dims(_families_version: int) -> tuple[int, ...]:
    return tuple(sorted({d for f in FAMILIES if f.KIND == "attention" and f.BUILT_BY_DEFAULT for d in f.HEAD_DIMS}))


def padded_head_dim(d: int) -> int:
    """The head dim a call of head dim `d` runs at: d where a tile has it, else the next tile head
    dim above it; d itself when it lies outside 1 .. the largest tile head dim (the checks report it)."""
    dims = tile_head_dims()
    if d in dims or not 1 <= d <= dims[-1]:
        return d
    return next(x for x in dims if x > d)


def describe() -> str:
    """The head dims the attention functions accept, in words, for error messages."""
    dims = tile_head_dims()
    return (f"from 1 to {dims[-1]} (tiles exist for {', '.join(map(str, dims))}; other head dims run "
            f"padded to the next of them)")


def needs_padding(*tensors: object, ndim: int = 4) -> int | None:
    """The padded head dim when every one of `tensors` is an `ndim`-D torch.Tensor with the same head
    dim (last size) and that head dim has no tile; else None (the call runs as it is, and its checks
    report what is wrong with it)."""
    first = tensors[0] if tensors else None
    if isinstance(first, torch.Tensor) and first.dim() == ndim and first.shape[-1] in tile_head_dims():
        return None  # the common case, first: a tile head dim (the others equal it, or the checks say so)
    d = None
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.dim() != ndim:
            return None
        if d is None:
            d = t.shape[-1]
        elif t.shape[-1] != d:
            return None
    if d is None:
        return None
    dp = padded_head_dim(d)
    return dp if dp != d else None


def pad(t: torch.Tensor, dp: int) -> torch.Tensor:
    """`t` with zero columns appended to its last dim up to `dp` (a new tensor, contiguous)."""
    return F.pad(t, (0, dp - t.shape[-1]))


def cut(o: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The first like.shape[-1] columns of the padded output `o`, in a new tensor with `like`'s
    layout (the functions return O in q's layout); differentiable."""
    return torch.empty_like(like).copy_(o[..., :like.shape[-1]])


def default_scale(scale: float | None, d: int) -> float:
    """The softmax scale of head dim `d`: the caller's, else 1/sqrt(d) (the padded call would use its
    own head dim's)."""
    return d ** -0.5 if scale is None else scale
