"""ctypes side of the C ABI in templates/include/gemmgen/abi.h (keep the two in step)."""
from __future__ import annotations

import ctypes
import functools
import os
import threading
from pathlib import Path

from gemmgen.errors import GemmgenLaunchError
from gemmgen.generator.manifest import ABI_VERSION  # noqa: F401 (the version the bindings follow)

INFO_NEEDS_LSE = 1  # GEMMGEN_INFO_NEEDS_LSE
INFO_KV_CACHE = 4  # GEMMGEN_INFO_KV_CACHE: reads seqlens_k, block_table, num_splits; exports <symbol>_workspace
INFO_WORKSPACE = 16  # GEMMGEN_INFO_WORKSPACE: exports <symbol>_workspace (a forward that needs one)
ERR_LEN = 1024  # bytes of the message buffer handed to the entry points
_local = threading.local()


def _err_buffer() -> ctypes.Array:
    """This thread's message buffer, emptied: one allocation per thread, not one per launch."""
    buf = getattr(_local, "err", None)
    if buf is None:
        buf = _local.err = ctypes.create_string_buffer(ERR_LEN)
    buf[0] = b"\0"
    return buf
STATUS_NAMES = {0: "GEMMGEN_OK", 1: "GEMMGEN_INVALID_ARGUMENT", 2: "GEMMGEN_CUDA_ERROR"}


def _strides(*names: str) -> list[tuple[str, type]]:
    """The batch, head and row strides (int64, in elements) of each named tensor, in abi.h's order."""
    return [(f"{n}_{dim}_stride", ctypes.c_int64) for n in names for dim in ("batch", "head", "row")]


# Fields that GemmgenAttnParams and GemmgenAttnBwdParams declare alike: the sizes, and dropout's
# probability and Philox (seed, offset).
_SIZES = [(n, ctypes.c_int32) for n in ("batch", "heads", "heads_kv", "seqlen_q", "seqlen_k", "head_dim")]
_DROPOUT = [("dropout_p", ctypes.c_float), ("dropout_seed", ctypes.c_uint64), ("dropout_offset", ctypes.c_uint64)]


class AttnParams(ctypes.Structure):
    """GemmgenAttnParams: pointers, sizes, strides in elements, scale, causal offset."""

    _fields_ = [
        *[(n, ctypes.c_void_p) for n in ("q", "k", "v", "o", "lse")],  # lse: float*, may be NULL
        *_SIZES,
        *_strides("q", "k", "v", "o"),
        ("scale", ctypes.c_float),
        ("causal_offset", ctypes.c_int32),
        ("bias", ctypes.c_void_p), *_strides("bias"),  # bias NULL: no additive mask
        *_DROPOUT,
        ("cu_seqlens_q", ctypes.c_void_p),  # int32*, NULL: fixed lengths
        ("cu_seqlens_k", ctypes.c_void_p),
        ("seqlens_k", ctypes.c_void_p),  # int32*, NULL: seqlen_k keys each
        ("block_table", ctypes.c_void_p),  # int32*, NULL: not paged
        ("block_table_batch_stride", ctypes.c_int64),
        *[(n, ctypes.c_int32) for n in ("page_size", "num_pages", "num_splits")],
        ("workspace", ctypes.c_void_p),
        ("workspace_bytes", ctypes.c_int64),
        ("local", ctypes.c_int32),  # 1: the sliding window below (left/right, -1 unbounded) applies
        ("window_left", ctypes.c_int32),
        ("window_right", ctypes.c_int32),
        ("softcap", ctypes.c_float),  # > 0: scaled scores s become softcap * tanh(s / softcap); 0: none
        ("align_per_sequence", ctypes.c_int32),  # varlen: 1 shifts each sequence's diagonal by len_k - len_q
        ("total_q", ctypes.c_int64),  # varlen: rows of the packed q and o
        ("total_k", ctypes.c_int64),  # varlen: rows of the packed k and v
        # fp8: float32 [B, Hkv] factors of q, k, v (NULL: 1)
        *[(n, ctypes.c_void_p) for n in ("descale_q", "descale_k", "descale_v")],
    ]


class KvAppendArgs(ctypes.Structure):
    """GemmgenKvAppendArgs (templates/include/gemmgen/decode_sm80/append.h): new tokens' keys and
    values, the caches, the lengths and block table, sizes, strides in elements."""

    _fields_ = [
        *[(n, ctypes.c_void_p) for n in ("k", "v", "k_cache", "v_cache", "seqlens", "block_table")],
        ("block_table_batch_stride", ctypes.c_int64),
        *[(n, ctypes.c_int32) for n in ("batch", "new_tokens", "heads_kv", "head_dim", "capacity", "page_size",
                                        "num_pages", "elem_bytes")],
        *[(f"{t}_{dim}_stride", ctypes.c_int64) for t in ("k", "v", "kc", "vc") for dim in ("batch", "row", "head")],
    ]


class InstanceInfo(ctypes.Structure):
    """GemmgenInstanceInfo: the static facts of one compiled instance."""

    _fields_ = [(name, ctypes.c_int32) for name in
                ("abi_version", "head_dim", "block_m", "block_n", "threads", "smem_bytes", "causal", "flags")]

    def as_dict(self) -> dict[str, int]:
        """The fields as a plain dict."""
        return {name: getattr(self, name) for name, _ in self._fields_}


class Instance:
    """The two entry points of one instance library: `<symbol>` (run) and `<symbol>_info`."""

    params_type: type = AttnParams  # what <symbol> takes

    def __init__(self, library: ctypes.CDLL, symbol: str) -> None:
        self.symbol = symbol
        self._run = getattr(library, symbol)
        self._run.argtypes = [ctypes.POINTER(self.params_type), ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
        self._run.restype = ctypes.c_int
        self._info = getattr(library, f"{symbol}_info")
        self._info.argtypes = [ctypes.POINTER(InstanceInfo)]
        self._info.restype = ctypes.c_int
        flags = self.info().flags
        self.needs_lse = bool(flags & INFO_NEEDS_LSE)
        self.kv_cache = bool(flags & INFO_KV_CACHE)
        self._workspace = self._append = None
        if self.kv_cache or flags & INFO_WORKSPACE:
            self._workspace = getattr(library, f"{symbol}_workspace")
            self._workspace.argtypes = [ctypes.POINTER(self.params_type)]
            self._workspace.restype = ctypes.c_int64
        if self.kv_cache:
            self._append = getattr(library, f"{symbol}_append")
            self._append.argtypes = [ctypes.POINTER(KvAppendArgs), ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
            self._append.restype = ctypes.c_int

    def info(self) -> InstanceInfo:
        """Call `<symbol>_info`; raise GemmgenLaunchError on a non-zero status."""
        info = InstanceInfo()
        status = self._info(ctypes.byref(info))
        if status != 0:
            raise GemmgenLaunchError(f"{self.symbol}_info returned {STATUS_NAMES.get(status, status)}")
        return info

    def workspace_bytes(self, params: ctypes.Structure) -> int:
        """Bytes of workspace `params` needs (0: none, or an instance without a workspace); negative
        from the library is an error."""
        if self._workspace is None:
            return 0
        n = int(self._workspace(ctypes.byref(params)))
        if n < 0:
            raise GemmgenLaunchError(f"{self.symbol}_workspace returned {n}")
        return n

    def append(self, args: "KvAppendArgs", stream: int | None) -> None:
        """Write new keys and values into a cache (`<symbol>_append`, key-value-cache instances only);
        raises GemmgenLaunchError with the library's message on failure."""
        if self._append is None:
            raise GemmgenLaunchError(f"{self.symbol} has no key-value-cache append entry point")
        _call(self._append, f"{self.symbol}_append", args, stream)

    def run(self, params: ctypes.Structure, stream: int | None) -> None:
        """Launch on `stream` (a cudaStream_t as an int; 0 or None is the default stream).

        Raises GemmgenLaunchError with the library's message on a non-zero status.
        """
        _call(self._run, self.symbol, params, stream)


def _call(entry, symbol: str, args: ctypes.Structure, stream: int | None) -> None:
    """Call a run entry point with `args` on `stream`; raise GemmgenLaunchError with the library's
    message on a non-zero status."""
    err = _err_buffer()
    status = entry(ctypes.byref(args), ctypes.c_void_p(stream or None), err, ERR_LEN)
    if status != 0:
        message = err.value.decode(errors="replace") or "no message"
        raise GemmgenLaunchError(f"{symbol}: {message} ({STATUS_NAMES.get(status, status)})")


@functools.lru_cache(maxsize=None)
def _load_library(path: str) -> ctypes.CDLL:
    # RTLD_LOCAL: each instance's static cudart and CUTLASS symbols stay out of the global namespace.
    return ctypes.CDLL(path, mode=os.RTLD_LOCAL | os.RTLD_NOW)


def load_library(path: Path) -> ctypes.CDLL:
    """Load a compiled instance library once per process (later calls return the cached handle)."""
    try:
        return _load_library(str(Path(path).resolve()))
    except OSError as exc:
        raise GemmgenLaunchError(f"cannot load {path}: {exc}") from exc


@functools.lru_cache(maxsize=None)
def _bind(path: str, symbol: str, kind: type[Instance]) -> Instance:
    return kind(load_library(Path(path)), symbol)


def bind(path: Path, symbol: str) -> Instance:
    """Load `path` (cached) and bind its `symbol` entry points (cached); raise GemmgenLaunchError if absent."""
    try:
        return _bind(str(path), symbol, Instance)
    except AttributeError as exc:
        raise GemmgenLaunchError(f"{path} does not export {symbol} / {symbol}_info: {exc}") from exc


# Batched GEMM and the unfused path's softmax (the structs appended to abi.h).

GEMM_STRIDED = 0  # GEMMGEN_GEMM_STRIDED
GEMM_PTR_ARRAY = 1  # GEMMGEN_GEMM_PTR_ARRAY

_STRIDES = [(f"stride_{op}_{dim}", ctypes.c_int64) for op in "abc" for dim in ("batch", "head", "row")]


class BatchedGemmStridedArgs(ctypes.Structure):
    """GemmgenBatchedGemmStridedArgs: the seed's BatchedGemmStridedArgs plus alpha."""

    _fields_ = [("A", ctypes.c_void_p), ("B", ctypes.c_void_p), ("C", ctypes.c_void_p),
                *[(n, ctypes.c_uint32) for n in ("M", "N", "K", "batch", "num_heads")],
                *_STRIDES, ("b_transposed", ctypes.c_int32), ("alpha", ctypes.c_float)]


class BatchedGemmPtrArgs(ctypes.Structure):
    """GemmgenBatchedGemmPtrArgs: device arrays of pointers, one row stride per operand, alpha."""

    _fields_ = [("A_ptrs", ctypes.c_void_p), ("B_ptrs", ctypes.c_void_p), ("C_ptrs", ctypes.c_void_p),
                *[(n, ctypes.c_uint32) for n in ("M", "N", "K", "batch", "num_heads")],
                ("stride_a_row", ctypes.c_int64), ("stride_b_row", ctypes.c_int64),
                ("stride_c_row", ctypes.c_int64), ("b_transposed", ctypes.c_int32), ("alpha", ctypes.c_float)]


class GemmInfo(ctypes.Structure):
    """GemmgenGemmInfo: the static facts of one compiled GEMM instance."""

    _fields_ = [(name, ctypes.c_int32) for name in
                ("abi_version", "tile_m", "tile_n", "tile_k", "stages", "threads", "smem_bytes",
                 "alignment", "b_transposed", "strategy", "out_bytes")]

    def as_dict(self) -> dict[str, int]:
        """The fields as a plain dict."""
        return {name: getattr(self, name) for name, _ in self._fields_}


class SoftmaxArgs(ctypes.Structure):
    """GemmgenSoftmaxArgs: fp32 scores in, probabilities in the instance's dtype out."""

    _fields_ = [("s", ctypes.c_void_p), ("p", ctypes.c_void_p),
                ("rows", ctypes.c_uint32), ("cols", ctypes.c_uint32), ("matrices", ctypes.c_uint32),
                ("s_matrix_stride", ctypes.c_int64), ("s_row_stride", ctypes.c_int64),
                ("p_matrix_stride", ctypes.c_int64), ("p_row_stride", ctypes.c_int64),
                ("causal", ctypes.c_int32), ("causal_offset", ctypes.c_int32)]


class Kernel:
    """The entry points of a GEMM or softmax library: `<symbol>(const Args*, stream, err, err_len)`
    and, for GEMMs, `<symbol>_info(GemmgenGemmInfo*)`."""

    def __init__(self, library: ctypes.CDLL, symbol: str, args_type: type, *, has_info: bool) -> None:
        self.symbol = symbol
        self.args_type = args_type
        self._run = getattr(library, symbol)
        self._run.argtypes = [ctypes.POINTER(args_type), ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
        self._run.restype = ctypes.c_int
        self._info = None
        if has_info:
            self._info = getattr(library, f"{symbol}_info")
            self._info.argtypes = [ctypes.POINTER(GemmInfo)]
            self._info.restype = ctypes.c_int

    def info(self) -> GemmInfo:
        """Call `<symbol>_info`; raise GemmgenLaunchError on a non-zero status or when there is none."""
        if self._info is None:
            raise GemmgenLaunchError(f"{self.symbol} has no _info entry point")
        info = GemmInfo()
        status = self._info(ctypes.byref(info))
        if status != 0:
            raise GemmgenLaunchError(f"{self.symbol}_info returned {STATUS_NAMES.get(status, status)}")
        return info

    def run(self, args: ctypes.Structure, stream: int | None) -> None:
        """Launch on `stream`; raise GemmgenLaunchError with the library's message on failure."""
        if not isinstance(args, self.args_type):
            raise TypeError(f"{self.symbol} takes {self.args_type.__name__}, got {type(args).__name__}")
        _call(self._run, self.symbol, args, stream)


@functools.lru_cache(maxsize=None)
def _bind_kernel(path: str, symbol: str, args_type: type, has_info: bool) -> Kernel:
    return Kernel(load_library(Path(path)), symbol, args_type, has_info=has_info)


def bind_gemm(path: Path, symbol: str, strategy: int) -> Kernel:
    """Bind a GEMM instance's entry points (cached); `strategy` picks the args struct."""
    args_type = BatchedGemmPtrArgs if strategy == GEMM_PTR_ARRAY else BatchedGemmStridedArgs
    try:
        return _bind_kernel(str(path), symbol, args_type, True)
    except AttributeError as exc:
        raise GemmgenLaunchError(f"{path} does not export {symbol} / {symbol}_info: {exc}") from exc


def bind_softmax(path: Path, symbol: str) -> Kernel:
    """Bind a softmax instance's entry point (cached)."""
    try:
        return _bind_kernel(str(path), symbol, SoftmaxArgs, False)
    except AttributeError as exc:
        raise GemmgenLaunchError(f"{path} does not export {symbol}: {exc}") from exc


# Fused attention backward (GemmgenAttnBwdParams of abi.h).

INFO_BACKWARD = 2  # GEMMGEN_INFO_BACKWARD
INFO_READS_GQA = 8  # GEMMGEN_INFO_READS_GQA: a backward reading K and V at their own heads (dK, dV per query head)


class AttnBwdParams(ctypes.Structure):
    """GemmgenAttnBwdParams: the forward's tensors, dO, the gradients, a workspace, sizes, strides
    in elements, scale, causal offset, the forward's mask, dropout and lengths, determinism."""

    _fields_ = [
        *[(n, ctypes.c_void_p) for n in ("q", "k", "v", "o", "d_o", "lse", "dq", "dk", "dv", "workspace")],
        ("workspace_bytes", ctypes.c_int64),
        *_SIZES,
        *_strides("q", "k", "v", "o", "do", "dq", "dk", "dv"),
        ("scale", ctypes.c_float),
        ("causal_offset", ctypes.c_int32),
        ("bias", ctypes.c_void_p), *_strides("bias"),
        ("dbias", ctypes.c_void_p), *_strides("dbias"),
        *_DROPOUT,
        ("cu_seqlens_q", ctypes.c_void_p),
        ("cu_seqlens_k", ctypes.c_void_p),
        ("deterministic", ctypes.c_int32),
        ("local", ctypes.c_int32),  # 1: the forward's sliding window (GemmgenAttnParams' fields) applies
        ("window_left", ctypes.c_int32),
        ("window_right", ctypes.c_int32),
        ("softcap", ctypes.c_float),  # the forward's logit softcap (0: none)
        ("align_per_sequence", ctypes.c_int32),  # the forward's per-sequence alignment (varlen)
        ("total_q", ctypes.c_int64),  # varlen: rows of the packed q, o, d_o, dq
        ("total_k", ctypes.c_int64),  # varlen: rows of the packed k, v, dk, dv
    ]


class BwdInstance(Instance):
    """The three entry points of one backward instance library: `<symbol>` (run, with
    AttnBwdParams), `<symbol>_workspace` (bytes a call needs) and `<symbol>_info`."""

    params_type = AttnBwdParams

    def __init__(self, library: ctypes.CDLL, symbol: str) -> None:
        super().__init__(library, symbol)
        self._workspace = getattr(library, f"{symbol}_workspace")
        self._workspace.argtypes = [ctypes.POINTER(AttnBwdParams)]
        self._workspace.restype = ctypes.c_int64
        # K and V at their own heads (query head h reads h // group), dK and dV per query head.
        self.reads_gqa = bool(self.info().flags & INFO_READS_GQA)


def bind_bwd(path: Path, symbol: str) -> BwdInstance:
    """Bind a backward instance's entry points (cached); raise GemmgenLaunchError if absent."""
    try:
        return _bind(str(path), symbol, BwdInstance)
    except AttributeError as exc:
        raise GemmgenLaunchError(f"{path} does not export {symbol} / {symbol}_workspace / {symbol}_info: {exc}") from exc
