"""Argument checks shared by the operations: every failure is an InputError naming the argument,
raised before any allocation the call makes."""
from __future__ import annotations

import math
from typing import Sequence

import torch

from gemmgen.errors import InputError

INT32_MAX = 2**31 - 1


def check_bool(name: str, value: object) -> bool:
    """`value` if it is a bool (a string such as 'no' is not coerced to True)."""
    if not isinstance(value, bool):
        raise InputError(f"{name} must be a bool (True or False), got {value!r}")
    return value


def check_instance(value: object) -> str | None:
    """An instance name: None or a string."""
    if value is not None and not isinstance(value, str):
        raise InputError(f"instance must be an instance name (str) or None, got {type(value).__name__}")
    return value


def check_finite(name: str, value: object) -> float:
    """`value` as a finite float; bools, non-numbers, infinities, NaN and ints beyond float range fail."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"{name} must be a float, got {type(value).__name__}")
    try:
        result = float(value)
    except OverflowError:
        raise InputError(f"{name} must be a finite float; the int given is beyond float range") from None
    if not math.isfinite(result):
        raise InputError(f"{name} must be finite, got {value}")
    return result


def check_tensor_list(name: str, value: object) -> list[torch.Tensor]:
    """`value` as a list of tensors (a list or tuple of torch.Tensor)."""
    if not isinstance(value, (list, tuple)):
        raise InputError(f"{name} must be a list or tuple of torch.Tensor, got {type(value).__name__}")
    for i, t in enumerate(value):
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{name}[{i}] must be a torch.Tensor, got {type(t).__name__}")
    return list(value)


def check_4d(dims: str, **tensors: object) -> None:
    """Each of `tensors` a 4-D torch.Tensor; `dims` names the four dims in the message."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise InputError(f"{name} must be 4-D ([{dims}]); got shape {tuple(t.shape)}")


def check_dense(name: str, t: torch.Tensor) -> None:
    """A strided (dense) tensor: the kernels read memory through strides."""
    if t.layout != torch.strided:
        raise InputError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, past the last byte] of the memory `t` reaches (empty for no elements)."""
    if t.numel() == 0:
        return 0, 0
    start = t.data_ptr()
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 1)
    return start, start + (last + 1) * t.element_size()


def check_no_overlap(outputs: Sequence[tuple[str, torch.Tensor]], inputs: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Outputs never share memory with an input or with each other (the kernels read inputs while
    writing outputs, in no defined order). Judged by the byte ranges the tensors reach, which is
    conservative for interleaved views; meta and fake tensors have no memory to compare."""
    real = [(n, t) for n, t in (*outputs, *inputs) if t.device.type != "meta"
            and not type(t).__name__ == "FakeTensor" and t.numel()]
    spans = {n: (_span(t), t.device) for n, t in real}
    out_names = [n for n, _ in outputs if n in spans]
    for i, name in enumerate(out_names):
        (lo, hi), dev = spans[name]
        for other in out_names[i + 1:] + [n for n, _ in inputs if n in spans]:
            (olo, ohi), odev = spans[other]
            if dev == odev and lo < ohi and olo < hi:
                raise InputError(f"{name} overlaps {other} in memory; outputs must not share memory with "
                                 f"inputs or other outputs")


def check_window(window, causal: bool) -> tuple[bool, tuple[int, int] | None]:
    """(causal, window) as the ops take them: a window (left, right) of ints >= -1 (-1: unbounded)
    normalized so that the masks with instances of their own keep them: (-1, -1) is no window and
    (-1, 0) is causal; with causal=True the right side must be 0 or -1 (the diagonal bounds it)."""
    if window is None:
        return causal, None
    if (not isinstance(window, (tuple, list)) or len(window) != 2 or
            any(isinstance(w, bool) or not isinstance(w, int) for w in window)):
        raise InputError(f"window must be a (left, right) pair of ints (-1: unbounded); got {window!r}")
    left, right = window
    if left < -1 or right < -1 or max(left, right) > INT32_MAX:
        raise InputError(f"window sides must be -1 (unbounded) or in [0, 2**31); got {tuple(window)}")
    if causal:
        if right > 0:
            raise InputError(f"window {tuple(window)} with causal=True: the causal mask hides every key right of "
                             "the diagonal, so the right side must be 0 or -1 (or pass causal=False)")
        right = 0
    if left == -1 and right == -1:
        return False, None
    if left == -1 and right == 0:
        return True, None
    return False, (left, right)


def check_softcap(softcap: object) -> float:
    """The logit softcap as the ops take it: a finite float >= 0 (0: none; torch.float32 holds it)."""
    value = check_finite("softcap", softcap)
    if value < 0 or value > 3.0e38:
        raise InputError(f"softcap must be 0 (none) or a positive float32 (scores become softcap * tanh(s / softcap)); "
                         f"got {softcap}")
    return value


def check_strides(name: str, t: torch.Tensor, align: int) -> None:
    """A 4-D tensor's strides as the kernels read it: its last dim contiguous, the others multiples
    of `align` elements (16 bytes) where the dim is stepped over (a dim of size 1 never is)."""
    (n0, n1, n2, n3), (s0, s1, s2, s3) = t.shape, t.stride()
    if n3 > 1 and s3 != 1:
        raise InputError(f"{name} must be contiguous in its last dim (head_dim); its strides are "
                         f"{(s0, s1, s2, s3)}")
    if (n0 > 1 and s0 % align) or (n1 > 1 and s1 % align) or (n2 > 1 and s2 % align):
        raise InputError(f"{name}'s strides {(s0, s1, s2, s3)} must be multiples of {align} "
                         f"elements (16 bytes) outside the last dim")
