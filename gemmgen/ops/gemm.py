"""The batched GEMM API: C = alpha * A * op(B) per (batch, head), fp16/bf16 in, fp32 accumulation.

    batched_gemm(a, b)                      a [B, H, M, K], b [B, H, K, N]     -> [B, H, M, N]
    batched_gemm(q, k, b_transposed=True)   q [B, H, M, K], k [B, H, N, K]     -> [B, H, M, N]
    batched_gemm_ptrs(a_list, b_list)       B*H separate [M, K] and [K, N] matrices -> a list

Strided strategy: one descriptor, any strides (the last dim contiguous). Pointer-array strategy:
independently allocated matrices of one shape and one row stride, passed as device arrays of
pointers. gemmgen.select.gemm_select picks the compiled instance; its alignment comes from the data:
16-byte vectors when every pointer, stride and contiguous extent allows them, else the
alignment-1 instances (odd K or N).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from gemmgen.kernels import abi
from gemmgen.select import device, gemm_select, registry, selection
from gemmgen.errors import DeviceError, InputError
from gemmgen.select.gemm_select import GemmProblem
from gemmgen.ops.checks import check_bool, check_finite, check_instance, check_no_overlap, check_tensor_list
from gemmgen.ops.grad import check_no_grad
from gemmgen.kernels.launch import _raw_stream

DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
OUT_NAMES = {**DTYPES, torch.float32: "fp32"}
ALIGN_BYTES = 16  # data pointers: what the vectorized instances load; torch allocations have 256
INT32_MAX = 2**31 - 1
VECTOR_BYTES = 16


def _check_tensor(name: str, t: object, dims: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise InputError(f"{name} must be {dims}-D; got shape {tuple(t.shape)}")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise InputError(f"{name} must be contiguous in its last dim; its strides are {tuple(t.stride())} "
                         f"(call .contiguous())")
    if max(t.shape, default=0) > INT32_MAX:
        raise InputError(f"{name}'s sizes must fit in int32 (the largest K, M, N any instance runs); "
                         f"got {tuple(t.shape)}")
    return t


def _check_devices(names: str, tensors: Sequence[torch.Tensor]) -> None:
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise InputError(f"{names} must be on one device; got {', '.join(sorted(map(str, devices)))}")
    dev = next(iter(devices))
    if dev.type != "cuda":
        gpu = "" if torch.cuda.is_available() else f"; this torch ({torch.__version__}) sees no CUDA GPU"
        raise DeviceError(f"batched GEMM needs a CUDA GPU: the tensors are on {dev}{gpu}")


def _check_pointers(named: Sequence[tuple[str, torch.Tensor]]) -> None:
    for name, t in named:
        if t.numel() and t.data_ptr() % ALIGN_BYTES:
            raise InputError(f"{name}'s data pointer is not {ALIGN_BYTES}-byte aligned "
                             f"(storage offset {t.storage_offset()})")


def _check_out_overlap(name: str, t: torch.Tensor) -> None:
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n > 1)
    if (dims and dims[0][0] == 0) or any(s2 < s1 * n1 for (s1, n1), (s2, _) in zip(dims, dims[1:])):
        raise InputError(f"{name}'s elements overlap (strides {tuple(t.stride())})")


def _alignment(values: Sequence[int], elem_bytes: int) -> int:
    """The largest power-of-two element count up to one 16-byte vector dividing all `values`."""
    align = VECTOR_BYTES // elem_bytes
    while align > 1 and any(v % align for v in values):
        align //= 2
    return align


def _out_dtype(out_dtype: torch.dtype | None, dtype: torch.dtype) -> torch.dtype:
    out_dtype = dtype if out_dtype is None else out_dtype
    if out_dtype not in (dtype, torch.float32):
        raise InputError(f"out dtype must be the input dtype {dtype} or torch.float32; got {out_dtype}")
    return out_dtype


_kernels: dict[tuple[str, str], abi.Kernel] = {}  # (library, symbol) -> bound, ABI-checked entry points


def _kernel(cand: gemm_select.Candidate) -> abi.Kernel:
    key = (str(cand.library), cand.entry.symbol)
    if key not in _kernels:
        _kernels[key] = gemm_select.kernel(cand)
    return _kernels[key]


def _launch(problem: GemmProblem, args, index: int, instance: str | None) -> None:
    cand = selection.select(problem, instance)
    kernel = _kernel(cand)
    if torch.cuda.current_device() == index:
        kernel.run(args, _raw_stream(index))
    else:
        with torch.cuda.device(index):
            kernel.run(args, _raw_stream(index))


def strided_problem(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, *, b_transposed: bool,
                    strategy: str = "strided") -> GemmProblem:
    """The GemmProblem of validated [B, H, ., .] tensors."""
    bb, h, m, k = a.shape
    n = c.shape[3]
    elem, out_elem = a.element_size(), c.element_size()
    outer = lambda t: [s for s, size in zip(t.stride()[:3], t.shape[:3]) if size > 1]  # noqa: E731
    align = _alignment([k, k if b_transposed else n, *outer(a), *outer(b)], elem)
    align_c = _alignment([n, *outer(c)], out_elem)
    return GemmProblem(dtype=DTYPES[a.dtype], out_dtype=OUT_NAMES[c.dtype], b_transposed=bool(b_transposed),
                       strategy=strategy, device=device.facts(a.get_device()), m=m, n=n, k=k,
                       batch_count=bb * h, align=align, align_c=align_c)


def _strides(t: torch.Tensor, row: int) -> tuple[int, int, int]:
    """t's batch, head and row strides, with 0 (batch, head) or `row` (rows) where the dim is 1."""
    return tuple(s if size > 1 else (row if i == 2 else 0)
                 for i, (s, size) in enumerate(zip(t.stride()[:3], t.shape[:3])))


def batched_gemm(a: torch.Tensor, b: torch.Tensor, *, b_transposed: bool = False,
                 out: torch.Tensor | None = None, alpha: float = 1.0, out_dtype: torch.dtype | None = None,
                 instance: str | None = None) -> torch.Tensor:
    """C[b, h] = alpha * A[b, h] @ B[b, h] (or @ B[b, h]^T with b_transposed), strided strategy.

    a: [B, H, M, K]; b: [B, H, K, N], or [B, H, N, K] with b_transposed; fp16 or bf16, any strides
    with a contiguous last dim and 16-byte aligned data pointers. C: `out` if given ([B, H, M, N],
    the input dtype or float32, written in place), else a new contiguous tensor of `out_dtype`
    (default: the input dtype). fp32 accumulation. `instance` forces a built instance by name.
    There is no backward pass: with grad mode on, inputs that require grad raise InputError.
    """
    hit = _fast_path(a, b, out, b_transposed, alpha, out_dtype, instance)
    if hit is not None:
        return hit
    check_no_grad("batched_gemm", a=a, b=b, out=out)
    new_out = out is None
    check_bool("b_transposed", b_transposed)
    check_instance(instance)
    alpha = check_finite("alpha", alpha)
    _check_tensor("a", a, 4)
    _check_tensor("b", b, 4)
    if a.dtype not in DTYPES or b.dtype != a.dtype:
        raise InputError(f"a and b must share one dtype among torch.float16, torch.bfloat16; got {a.dtype}, {b.dtype}")
    bb, h, m, k = a.shape
    n, kb = (b.shape[2], b.shape[3]) if b_transposed else (b.shape[3], b.shape[2])
    if b.shape[:2] != a.shape[:2] or kb != k:
        want = "[B, H, N, K]" if b_transposed else "[B, H, K, N]"
        raise InputError(f"b must be {want} matching a's [B, H, M, K] = {tuple(a.shape)}; got {tuple(b.shape)}")
    launches = bb * h * m * n > 0 and k > 0  # else C is empty or zeroed: no operand is read
    if out is None:
        dtype = _out_dtype(out_dtype, a.dtype)
        if launches:
            _check_pointers((("a", a), ("b", b)))
        _check_devices("a, b", (a, b))  # before allocating C
        out = torch.empty(bb, h, m, n, dtype=dtype, device=a.device)
    else:
        _check_tensor("out", out, 4)
        if tuple(out.shape) != (bb, h, m, n) or out.dtype not in (a.dtype, torch.float32):
            raise InputError(f"out must be [B, H, M, N] = {(bb, h, m, n)} of {a.dtype} or torch.float32; got "
                             f"{tuple(out.shape)} {out.dtype}")
        if out_dtype is not None and out_dtype != out.dtype:
            raise InputError(f"out_dtype {out_dtype} disagrees with out's dtype {out.dtype}")
        _check_out_overlap("out", out)
        check_no_overlap([("out", out)], [("a", a), ("b", b)])
        if launches:
            _check_pointers((("a", a), ("b", b), ("out", out)))
        _check_devices("a, b, out", (a, b, out))
    if out.numel() == 0:
        return out
    if k == 0:
        return out.zero_()
    problem = strided_problem(a, b, out, b_transposed=b_transposed)
    # A stride over a dim of size 1 is never stepped: pass one that cannot break an alignment check.
    sa, sb, sc = _strides(a, k), _strides(b, k if b_transposed else n), _strides(out, n)
    args = abi.BatchedGemmStridedArgs(a.data_ptr(), b.data_ptr(), out.data_ptr(), m, n, k, bb, h,
                                      sa[0], sa[1], sa[2], sb[0], sb[1], sb[2], sc[0], sc[1], sc[2],
                                      int(bool(b_transposed)), float(alpha))
    _launch(problem, args, a.get_device(), instance)
    if len(_calls) >= _MAX_CALLS:
        _calls.clear()
    entry = (_kernel(selection.select(problem, instance)), (m, n, k, bb, h, *sa, *sb, *sc, int(bool(b_transposed))))
    _calls[_call_key(a, b, out, b_transposed, instance)] = entry
    if new_out:  # a repeat with out=None allocates the same contiguous C
        _calls[_call_key(a, b, None, b_transposed, instance, out.dtype)] = entry
    return out


# A call's kernel and its size/stride fields, keyed by everything the checks and the selection read
# (shapes, strides, dtypes, devices, b_transposed, instance; with out=None, the dtype of the C it
# allocates): a repeated call skips straight to the launch, as cuBLAS's host path does
# (bench/NOTES.md, experiments 8 and 63). refresh() empties it.
_calls: dict[tuple, tuple[abi.Kernel, tuple[int, ...]]] = {}
_MAX_CALLS = 4096
registry.on_refresh(_calls.clear)


def _call_key(a, b, out, b_transposed, instance, new_dtype=None) -> tuple:
    """The key of a call with `out`, or with out=None and a new C of `new_dtype`."""
    return (a.shape, a.stride(), a.dtype, a.device, b.shape, b.stride(), b.dtype, b.device,
            new_dtype if out is None else (out.shape, out.stride(), out.dtype, out.device), bool(b_transposed),
            instance)


def _fast_path(a, b, out, b_transposed, alpha, out_dtype, instance) -> torch.Tensor | None:
    """Launch a call seen before (same key; with out=None, that of the dtype it allocates) and return
    C, or None when the call is new or needs the full checks (non-tensors, alpha not a float, an
    out_dtype that disagrees with out, unaligned data)."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or type(alpha) not in (int, float):
        return None
    if type(b_transposed) is not bool or not (instance is None or isinstance(instance, str)) or not (
            (type(alpha) is float and math.isfinite(alpha)) or (type(alpha) is int and abs(alpha) < 2**63)):
        return None  # the full path names the argument
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad or (
            isinstance(out, torch.Tensor) and out.requires_grad)):
        return None  # the full path raises
    if out is not None and (not isinstance(out, torch.Tensor) or out_dtype not in (None, out.dtype)):
        return None
    hit = _calls.get(_call_key(a, b, out, b_transposed, instance, out_dtype or a.dtype))
    if hit is None:
        return None
    kernel, fields = hit
    if out is None:
        out = torch.empty(fields[3], fields[4], fields[0], fields[1], dtype=out_dtype or a.dtype, device=a.device)
    if (a.data_ptr() | b.data_ptr() | out.data_ptr()) % 16:
        return None
    args = abi.BatchedGemmStridedArgs(a.data_ptr(), b.data_ptr(), out.data_ptr(), *fields, float(alpha))
    index = a.get_device()
    if torch.cuda.current_device() == index:
        kernel.run(args, _raw_stream(index))
    else:
        with torch.cuda.device(index):
            kernel.run(args, _raw_stream(index))
    return out


class PointerArrays:
    """The device arrays of pointers of one pointer-array call, built once (a host-to-device copy)
    and reusable for as long as the tensors live: `batched_gemm_ptrs` builds one per call; a caller
    that repeats a call on the same tensors can keep one and call run()."""

    def __init__(self, a_list: Sequence[torch.Tensor], b_list: Sequence[torch.Tensor],
                 out_list: Sequence[torch.Tensor] | None = None, *, b_transposed: bool = False,
                 out_dtype: torch.dtype | None = None) -> None:
        a_list, b_list = check_tensor_list("a_list", a_list), check_tensor_list("b_list", b_list)
        if out_list is not None:
            out_list = check_tensor_list("out_list", out_list)
        check_bool("b_transposed", b_transposed)
        if not a_list or len(a_list) != len(b_list) or (out_list is not None and len(out_list) != len(a_list)):
            lens = (len(a_list), len(b_list), None if out_list is None else len(out_list))
            raise InputError(f"a_list, b_list (and out_list) must be non-empty and of one length; got {lens}")
        for i, (a, b) in enumerate(zip(a_list, b_list)):
            check_no_grad("batched_gemm_ptrs", **{f"a_list[{i}]": a, f"b_list[{i}]": b})
            _check_tensor(f"a_list[{i}]", a, 2)
            _check_tensor(f"b_list[{i}]", b, 2)
        a0, b0 = a_list[0], b_list[0]
        if a0.dtype not in DTYPES:
            raise InputError(f"dtype must be torch.float16 or torch.bfloat16; got {a0.dtype}")
        m, k = a0.shape
        n, kb = (b0.shape[0], b0.shape[1]) if b_transposed else (b0.shape[1], b0.shape[0])
        if kb != k:
            raise InputError(f"b_list[0] {tuple(b0.shape)} does not match a_list[0] {tuple(a0.shape)} "
                             f"({'b_transposed: [N, K]' if b_transposed else '[K, N]'})")
        for name, items, ref in (("a_list", a_list, a0), ("b_list", b_list, b0)):
            for i, t in enumerate(items):
                if t.shape != ref.shape or t.dtype != a0.dtype:
                    raise InputError(f"{name}[{i}] is {tuple(t.shape)} {t.dtype}; every matrix must be "
                                     f"{tuple(ref.shape)} {a0.dtype}")
                if t.stride(0) != ref.stride(0) and t.shape[0] > 1:
                    raise InputError(f"{name}[{i}] has row stride {t.stride(0)}, {name}[0] {ref.stride(0)}: "
                                     f"one row stride per operand")
        if out_list is None:
            dtype = _out_dtype(out_dtype, a0.dtype)
            _check_devices("a_list, b_list", a_list + b_list)  # before allocating the outputs
            out_list = [torch.empty(m, n, dtype=dtype, device=a0.device) for _ in a_list]
        c0 = out_list[0]
        for i, c in enumerate(out_list):
            check_no_grad("batched_gemm_ptrs", **{f"out_list[{i}]": c})
            _check_tensor(f"out_list[{i}]", c, 2)
            if tuple(c.shape) != (m, n) or c.dtype != c0.dtype or c.dtype not in (a0.dtype, torch.float32) \
                    or (c.stride(0) != c0.stride(0) and m > 1):
                raise InputError(f"out_list[{i}] must be [M, N] = {(m, n)} of {a0.dtype} or torch.float32, one "
                                 f"dtype and row stride for all; got {tuple(c.shape)} {c.dtype}")
            _check_out_overlap(f"out_list[{i}]", c)
        check_no_overlap([(f"out_list[{i}]", c) for i, c in enumerate(out_list)],
                         [(f"a_list[{i}]", t) for i, t in enumerate(a_list)] +
                         [(f"b_list[{i}]", t) for i, t in enumerate(b_list)])
        _check_devices("a_list, b_list, out_list", a_list + b_list + out_list)
        named = [(f"a_list[{i}]", t) for i, t in enumerate(a_list)] + \
                [(f"b_list[{i}]", t) for i, t in enumerate(b_list)] + \
                [(f"out_list[{i}]", t) for i, t in enumerate(out_list)]
        _check_pointers(named)
        self.a_list, self.b_list, self.out_list = a_list, b_list, out_list
        self.m, self.n, self.k, self.b_transposed = m, n, k, bool(b_transposed)
        self.index = a0.get_device()
        ptrs = [t.data_ptr() for t in a_list + b_list + out_list]
        self._ptrs = torch.tensor(ptrs, dtype=torch.int64).pin_memory().to(a0.device, non_blocking=True)
        count = len(a_list)
        elem, out_elem = a0.element_size(), c0.element_size()
        rows = lambda t: [t.stride(0)] if t.shape[0] > 1 else []  # noqa: E731
        self.problem = GemmProblem(
            dtype=DTYPES[a0.dtype], out_dtype=OUT_NAMES[c0.dtype], b_transposed=self.b_transposed, strategy="ptr",
            device=device.facts(self.index), m=m, n=n, k=k, batch_count=count,
            align=_alignment([k, k if b_transposed else n, *rows(a0), *rows(b0)], elem),
            align_c=_alignment([n, *rows(c0)], out_elem))
        base, step = self._ptrs.data_ptr(), 8 * count
        row = lambda t, extent: t.stride(0) if t.shape[0] > 1 else extent  # noqa: E731
        self.args = abi.BatchedGemmPtrArgs(base, base + step, base + 2 * step, m, n, k, count, 1,
                                           row(a0, k), row(b0, k if b_transposed else n), row(c0, n),
                                           int(self.b_transposed), 1.0)

    def run(self, *, alpha: float = 1.0, instance: str | None = None) -> list[torch.Tensor]:
        """Launch on the current stream; returns out_list."""
        if self.out_list[0].numel() == 0:
            return self.out_list
        if self.k == 0:
            for c in self.out_list:
                c.zero_()
            return self.out_list
        self.args.alpha = check_finite("alpha", alpha)
        check_instance(instance)
        _launch(self.problem, self.args, self.index, instance)
        return self.out_list


def batched_gemm_ptrs(a_list: Sequence[torch.Tensor], b_list: Sequence[torch.Tensor], *,
                      b_transposed: bool = False, out_list: Sequence[torch.Tensor] | None = None,
                      alpha: float = 1.0, out_dtype: torch.dtype | None = None,
                      instance: str | None = None) -> list[torch.Tensor]:
    """C_i = alpha * A_i @ B_i (or @ B_i^T) for independently allocated matrices, pointer-array
    strategy (one launch for all). Every A_i is [M, K], every B_i [K, N] ([N, K] with b_transposed),
    one dtype (fp16/bf16), one row stride per operand, contiguous rows, 16-byte aligned data. Returns
    `out_list` (written in place) or new [M, N] tensors of `out_dtype` (default: the input dtype)."""
    alpha = check_finite("alpha", alpha)
    check_instance(instance)
    if out_list is not None and out_dtype is not None:
        if any(c.dtype != out_dtype for c in check_tensor_list("out_list", out_list)):
            raise InputError(f"out_dtype {out_dtype} disagrees with out_list's dtype")
    arrays = PointerArrays(a_list, b_list, out_list, b_transposed=b_transposed, out_dtype=out_dtype)
    return arrays.run(alpha=alpha, instance=instance)
