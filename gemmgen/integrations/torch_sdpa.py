"""gemmgen as the flash-attention implementation behind torch's scaled_dot_product_attention.

torch.nn.attention keeps a registry of flash-attention implementations (torch 2.10 and later).
Importing gemmgen registers one named "gemmgen" there; it does nothing until activated:

    torch.nn.attention.activate_flash_attention_impl("gemmgen")   # or gemmgen.activate()
    torch.nn.attention.restore_flash_attention_impl()             # or gemmgen.deactivate()

Activation replaces the CUDA kernels of torch's flash-attention ops (torch.library, "aten" IMPL):

    aten::_scaled_dot_product_flash_attention, and its _backward   SDPA's flash path, [B, H, N, d]
    aten::_flash_attention_forward / _flash_attention_backward      [B, N, H, d]; packed [T, H, d] with
                                                                    cum_seq_q/k (varlen_attn)
    aten::_flash_attention_forward_no_dropout_inplace               varlen_attn_out (where torch has it)

The ops keep torch's conventions: is_causal is FlashAttention's bottom-right mask (torch sends SDPA's
top-left is_causal here only when Nq == Nk, where the two agree; causal_lower_right relies on it);
the LSE is float32 natural log, [B, H, Nq] (packed: [H, Tq]); outputs take the layout torch's meta
function gives them (torch.compile checks it). With dropout the forward draws (seed, offset) from
torch's CUDA generator, as gemmgen.fused_attention does, and returns them as the op's philox outputs,
on the CPU and marked as gemmgen's, so the backward regenerates the same mask without a device sync.

A call gemmgen cannot run (NoInstanceError, InputError, an argument it does not support) runs on
the kernel that was registered before activation, torch's own, with one warning per distinct reason
on the logger "gemmgen.sdpa"; fallback_reasons() lists them and counts() says which kernel ran how
often. A backward whose forward ran elsewhere with dropout follows it (only that implementation
regenerates its mask).
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import sys
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from gemmgen.errors import CacheError, GemmgenError, GemmgenLaunchError, NoInstanceError, ToolchainError

IMPL_NAME = "gemmgen"
MIN_TORCH = "2.10"
logger = logging.getLogger("gemmgen.sdpa")

# FlashAttention's causal alignment, which torch's flash ops follow: query i sees keys j <= i + Nk - Nq.
_ALIGNMENT = "bottom_right"
# The philox offset output of a forward gemmgen ran with dropout holds this ("gemmgen!" as int64).
_TAG = int.from_bytes(b"gemmgen!", "little", signed=True)
# Failures that depend on the call's metadata only and cost a selection (or a compile) to find.
_METADATA_FAILURES = (NoInstanceError, ToolchainError, CacheError)
_MAX_CACHED = 4096


class UnsupportedTorchError(GemmgenError, RuntimeError):
    """This torch lacks the API that plugs a flash-attention implementation into SDPA."""


# ---- the user-facing switch ---------------------------------------------------------------------

def _torch_attention() -> Any:
    """torch.nn.attention, or None where this torch has none."""
    try:
        return importlib.import_module("torch.nn.attention")
    except ImportError:
        return None


def missing_api() -> list[str]:
    """The parts of torch's API the integration needs that this torch lacks (empty: none)."""
    attention = _torch_attention()
    missing = [f"torch.nn.attention.{name}" for name in ("register_flash_attention_impl",
                                                          "activate_flash_attention_impl")
               if not hasattr(attention, name)]
    if not hasattr(torch.library, "get_kernel"):
        missing.append("torch.library.get_kernel")
    if "with_keyset" not in inspect.signature(torch.library.Library.impl).parameters:
        missing.append("torch.library.Library.impl(with_keyset=...)")
    return missing


def _require_api(what: str) -> None:
    missing = missing_api()
    if missing:
        raise UnsupportedTorchError(
            f"{what} needs torch {MIN_TORCH} or newer (its torch.nn.attention registry of flash-attention "
            f"implementations); this torch ({torch.__version__}) lacks {', '.join(missing)}")


def register() -> bool:
    """Register "gemmgen" with torch's registry of flash-attention implementations, without
    activating it (idempotent). Returns False, changing nothing, where this torch has no registry."""
    if missing_api():
        logger.debug("torch %s has no flash-attention registry: gemmgen is not registered", torch.__version__)
        return False
    _torch_attention().register_flash_attention_impl(IMPL_NAME, register_fn=_install)
    return True


def activate() -> None:
    """Route torch's flash-attention ops (SDPA's flash path, varlen_attn) to gemmgen, through torch's
    registry (the same as torch.nn.attention.activate_flash_attention_impl("gemmgen")). Raises
    UnsupportedTorchError on a torch without that registry."""
    _require_api("gemmgen.activate()")
    register()
    _torch_attention().activate_flash_attention_impl(IMPL_NAME)


def deactivate() -> None:
    """Give torch's flash-attention ops back the kernels they had before activation (torch's own);
    nothing when gemmgen is not active."""
    if _active is None:
        return
    attention = _torch_attention()
    current = getattr(attention, "current_flash_attention_impl", lambda: None)()
    restore = getattr(attention, "restore_flash_attention_impl", None)
    if restore is not None and current == IMPL_NAME:
        restore()  # calls our handle's remove()
    if _active is not None:  # a registry without restore, or an activation outside the registry
        _active.remove()
        _forget_in_registry()


def is_active() -> bool:
    """Whether gemmgen's kernels serve torch's flash-attention ops now."""
    return _active is not None


def _forget_in_registry() -> None:
    """Clear the registry's note that "gemmgen" is active, where torch has no restore function:
    its activate returns early for the active name, and would then not install the kernels again."""
    registry = sys.modules.get("torch.nn.attention._registry")
    active = getattr(registry, "_FLASH_ATTENTION_ACTIVE", None)
    if active == IMPL_NAME or (isinstance(active, tuple) and active and active[0] == IMPL_NAME):
        registry._FLASH_ATTENTION_ACTIVE = None
    handles = getattr(registry, "_FLASH_ATTENTION_HANDLES", None)
    if isinstance(handles, dict):
        handles.pop(IMPL_NAME, None)


# ---- what ran: counts and fallback reasons ------------------------------------------------------

_lock = threading.Lock()
_counts: dict[str, dict[str, int]] = {}
_reasons: dict[str, int] = {}
_known_failures: dict[tuple, str] = {}
_refresh_hooked = False


def fallback_reasons() -> list[str]:
    """The distinct reasons, in the order first seen, for which a call ran on torch's kernel
    instead of gemmgen's ("aten::<op>: <reason>")."""
    with _lock:
        return list(_reasons)


def counts() -> dict[str, dict[str, int]]:
    """Calls per overridden op, by the kernel that ran them: {"_flash_attention_forward":
    {"gemmgen": 3, "torch": 1}, ...}."""
    with _lock:
        return {op: dict(by) for op, by in _counts.items()}


def reset() -> None:
    """Forget the counts, the fallback reasons (each is logged again), the remembered failures and
    the remembered forwards."""
    with _lock:
        _counts.clear()
        _reasons.clear()
        _known_failures.clear()
    _repeats.clear()


def _count(op: str, kernel: str) -> None:
    with _lock:
        by = _counts.setdefault(op, {"gemmgen": 0, "torch": 0})
        by[kernel] += 1


def _note_fallback(op: str, reason: str) -> None:
    """Count a call torch's kernel runs; log its reason the first time it is seen."""
    text = f"aten::{op}: {reason}"
    with _lock:
        by = _counts.setdefault(op, {"gemmgen": 0, "torch": 0})
        by["torch"] += 1
        first = text not in _reasons
        _reasons[text] = _reasons.get(text, 0) + 1
    if first:
        logger.warning("gemmgen does not run %s; torch's own kernel does (logged once per reason)", text)


def _remember_failure(key: tuple, reason: str) -> None:
    """Skip gemmgen for calls like this one from now on: finding the failure again costs a selection
    (or a compile on demand). A registry refresh (a new build) forgets them."""
    global _refresh_hooked
    if not _refresh_hooked:
        from gemmgen.select import registry

        registry.on_refresh(_known_failures.clear)
        _refresh_hooked = True
    if len(_known_failures) >= _MAX_CACHED:
        _known_failures.clear()
    _known_failures[key] = reason


def _summary(exc: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


# ---- activation: the kernels installed and the ones they replace ---------------------------------

class _Handle:
    """What an activation installed: a torch.library.Library holding gemmgen's kernels, and the
    kernels they replaced (calls gemmgen cannot run go there). torch's registry calls remove() on
    restore; it is idempotent."""

    def __init__(self, dispatch_key: str) -> None:
        self.dispatch_key = dispatch_key
        self.originals: dict[str, Any] = {}
        self.library: Any = None

    def remove(self) -> None:
        global _active
        library, self.library = self.library, None
        if library is not None:
            # Destroying the library deregisters its kernels; the dispatcher falls back to the ones
            # registered before (torch's own).
            destroy = getattr(library, "_destroy", None)
            if destroy is not None:
                destroy()
        if _active is self:
            _active = None


_active: _Handle | None = None


@dataclass(frozen=True)
class _OpSpec:
    """An overridden op: its aten name (default overload), the names this module gives its positional
    arguments (torch renamed some across versions), and the function serving a call on gemmgen."""
    name: str
    positional: tuple[str, ...]
    serve: Callable[["_Call"], Any]


def _aten_op(name: str) -> Any:
    """torch.ops.aten.<name>.default, or None where this torch has no such op."""
    try:
        return getattr(torch.ops.aten, name).default
    except (AttributeError, RuntimeError):
        return None


def _compatible(spec: _OpSpec, op: Any) -> bool:
    """Whether the op's schema has the positional arguments this module reads (else it stays torch's)."""
    return sum(not a.kwarg_only for a in op._schema.arguments) == len(spec.positional)


def _original_kernel(op: Any, dispatch_key: str) -> Any:
    """The kernel `op` runs for `dispatch_key` now (to fall back on), or None where there is none
    (a torch built without CUDA)."""
    try:
        return torch.library.get_kernel(op, dispatch_key)
    except RuntimeError:
        return None


def _install(dispatch_key: str = "CUDA") -> _Handle:
    """Register gemmgen's kernels for torch's flash-attention ops under `dispatch_key`, after taking
    the kernels they replace; returns the handle whose remove() undoes it. torch's registry calls
    this on activate_flash_attention_impl("gemmgen")."""
    global _active
    _require_api("Activating gemmgen's flash attention")
    if _active is not None:  # a registry that does not restore before activating again
        _active.remove()
    handle = _Handle(dispatch_key)
    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        # Replacing torch's kernel is the point; torch warns about it once per process.
        warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
        for spec in _SPECS:
            op = _aten_op(spec.name)
            if op is None or not _compatible(spec, op):
                logger.debug("aten::%s is missing or has another schema in torch %s: not overridden",
                             spec.name, torch.__version__)
                continue
            handle.originals[spec.name] = _original_kernel(op, dispatch_key)
            library.impl(spec.name, _kernel_for(spec, op, handle), dispatch_key, with_keyset=True)
    handle.library = library
    _active = handle
    return handle


def _kernel_for(spec: _OpSpec, op: Any, handle: _Handle) -> Callable[..., Any]:
    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        return _run(spec, op, handle, keyset, args, kwargs)

    kernel.__name__ = f"gemmgen_{spec.name}"
    return kernel


# ---- dispatch: gemmgen first, torch's kernel for what gemmgen cannot run -----------------------

class _Fallback(Exception):
    """A call gemmgen does not serve; the message says why. remember=True: calls with the same
    metadata skip gemmgen from now on (finding out again would cost a selection)."""

    def __init__(self, reason: str, *, remember: bool = False) -> None:
        super().__init__(reason)
        self.remember = remember


_local = threading.local()


def _run(spec: _OpSpec, op: Any, handle: _Handle, keyset: Any, args: tuple, kwargs: dict) -> Any:
    """Serve one call of an overridden op on gemmgen, or else on the kernel it replaced."""
    if getattr(_local, "bypass", 0):  # inside torch's own kernel of an outer call that fell back
        return _call_original(spec, handle, keyset, args, kwargs, "an enclosing call fell back")
    signature = _signature(args, kwargs)
    # Grad mode and determinism decide whether (and which) backward instance the forward checks for.
    key = (spec.name, torch.is_grad_enabled(), torch.are_deterministic_algorithms_enabled(), signature)
    repeat = _repeats.get(key)
    if repeat is not None:
        try:
            result = _serve_again(repeat, args)
        except GemmgenLaunchError:
            raise  # a kernel that failed on the device, as below
        except GemmgenError:
            result = None  # the full path decides: it reports the problem or falls back
        if result is not None:
            _count(spec.name, "gemmgen")
            return result
    reason = _known_failures.get(key)
    if reason is None:
        try:
            result = spec.serve(_Call(op, spec.positional, args, kwargs, signature, key))
        except _Fallback as exc:
            reason = str(exc)
            if exc.remember:
                _remember_failure(key, reason)
        except GemmgenLaunchError:
            raise  # a kernel that failed on the device: not a call to route elsewhere
        except GemmgenError as exc:
            reason = _summary(exc)
            if isinstance(exc, _METADATA_FAILURES):
                _remember_failure(key, reason)
        else:
            _count(spec.name, "gemmgen")
            return result
    _note_fallback(spec.name, reason)
    return _call_original(spec, handle, keyset, args, kwargs, reason)


def _call_original(spec: _OpSpec, handle: _Handle, keyset: Any, args: tuple, kwargs: dict, reason: str) -> Any:
    """Run the call on the kernel activation replaced. torch's SDPA-level kernels call the
    flash-level ops through the dispatcher: while one runs, those go straight to torch's too."""
    original = handle.originals.get(spec.name)
    if original is None:
        raise RuntimeError(f"gemmgen cannot run this aten::{spec.name} call ({reason}), and this torch "
                           f"({torch.__version__}) has no {handle.dispatch_key} kernel of its own for it")
    _local.bypass = getattr(_local, "bypass", 0) + 1
    try:
        return original.call_boxed(keyset, *args, **kwargs)
    finally:
        _local.bypass -= 1


def _signature(args: tuple, kwargs: dict) -> tuple:
    """The call's metadata, hashable: tensors by dtype, shape, strides, device and requires_grad;
    other values as they are."""
    def one(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return (a.dtype, tuple(a.shape), a.stride(), a.device, a.requires_grad)
        return tuple(a) if isinstance(a, list) else a

    return tuple(one(a) for a in args) + tuple((n, one(a)) for n, a in sorted(kwargs.items()))


class _Call:
    """One call of an overridden op: its arguments by name (`call["query"]`), and the layouts torch's
    meta function gives its outputs."""

    def __init__(self, op: Any, positional: tuple[str, ...], args: tuple, kwargs: dict, signature: tuple,
                 key: tuple | None = None) -> None:
        self.op, self.args, self.kwargs, self.signature, self.key = op, args, kwargs, signature, key
        self.values: dict[str, Any] = {}
        for i, (name, schema_name, positional_arg, default) in enumerate(_arguments(op, positional)):
            if positional_arg and i < len(args):
                self.values[name] = args[i]
            else:  # the dispatcher leaves out keyword arguments at their defaults
                self.values[name] = kwargs.get(schema_name, default)

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def get(self, name: str) -> Any:
        """An argument this torch's schema may lack (None then)."""
        return self.values.get(name)

    def layout(self, index: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """(shape, strides) of output `index` by torch's meta function, or None if it gives none."""
        layouts = _meta_layouts(self.op, self.signature, self.args, self.kwargs)
        return layouts[index] if index < len(layouts) else None


_schemas: dict[tuple, list[tuple[str, str, bool, Any]]] = {}


def _arguments(op: Any, positional: tuple[str, ...]) -> list[tuple[str, str, bool, Any]]:
    """(our name, the schema's name, positional?, default) of each argument of `op`'s schema, read
    once per op (every call of an overridden op names its arguments through this)."""
    key = (op, positional)
    found = _schemas.get(key)
    if found is None:
        names, found = iter(positional), []
        for a in op._schema.arguments:
            found.append((a.name if a.kwarg_only else next(names), a.name, not a.kwarg_only,
                          a.default_value if a.has_default_value() else None))
        _schemas[key] = found
    return found


_layouts: dict[tuple, tuple] = {}


def _meta_layouts(op: Any, signature: tuple, args: tuple, kwargs: dict) -> tuple:
    """The (shape, strides) of each tensor output of `op` for a call like this one, from its meta
    function (run once per signature): torch.compile traces the op with it and asserts the real
    outputs match."""
    key = (op, signature)
    layouts = _layouts.get(key)
    if layouts is None:
        def meta(a: Any) -> Any:
            if isinstance(a, torch.Tensor):
                return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
            return a

        try:
            outs = op(*map(meta, args), **{n: meta(a) for n, a in kwargs.items()})
        except Exception:  # no meta function: the outputs keep the layouts gemmgen gives them
            outs = ()
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        layouts = tuple((tuple(o.shape), tuple(o.stride())) if isinstance(o, torch.Tensor) else None
                        for o in outs)
        if len(_layouts) >= _MAX_CACHED:
            _layouts.clear()
        _layouts[key] = layouts
    return layouts


def _allocate(call: _Call, index: int, like: torch.Tensor) -> torch.Tensor:
    """An uninitialized output `index` in the layout torch's meta function gives it (like's dtype
    and device; empty_like(like) without one)."""
    layout = call.layout(index)
    if layout is None:
        return torch.empty_like(like)
    shape, strides = layout
    return torch.empty_strided(shape, strides, dtype=like.dtype, device=like.device)


def _in_layout(call: _Call, index: int, t: torch.Tensor) -> torch.Tensor:
    """t with the strides torch's meta function gives output `index`: t itself, a view of it where
    the strides differ only on dims of size 1 (never stepped over), else a copy."""
    layout = call.layout(index)
    if layout is None or layout[0] != tuple(t.shape) or layout[1] == t.stride():
        return t
    shape, strides = layout
    if all(n == 1 or a == b for n, a, b in zip(shape, strides, t.stride())):
        return t.as_strided(shape, strides, t.storage_offset())
    return torch.empty_strided(shape, strides, dtype=t.dtype, device=t.device).copy_(t)


# ---- gemmgen's entry points (imported on first use: importing gemmgen stays light) ---------------

def _attention() -> Any:
    """gemmgen.ops.attention: fused_attention, fused_attention_varlen."""
    return importlib.import_module("gemmgen.ops.attention")


def _torch_op() -> Any:
    """gemmgen.ops.torch_op: the operations' implementations (_run launches one attention)."""
    return importlib.import_module("gemmgen.ops.torch_op")


def _eager() -> Any:
    """gemmgen.ops.eager: runs_eagerly."""
    return importlib.import_module("gemmgen.ops.eager")


def _space() -> Any:
    """gemmgen.generator.space: the family list's version."""
    return importlib.import_module("gemmgen.generator.space")


def _launch() -> Any:
    """gemmgen.kernels.launch: draw_seed, expanded_layout."""
    return importlib.import_module("gemmgen.kernels.launch")


def _gemmgen_ops() -> Any:
    """torch.ops.gemmgen, its ops defined (gemmgen.ops.torch_op)."""
    importlib.import_module("gemmgen.ops.torch_op")
    return torch.ops.gemmgen


# ---- the arguments gemmgen does not take --------------------------------------------------------

def _refuse_unsupported(call: _Call) -> None:
    """Raise _Fallback for what gemmgen's kernels do not compute: the attention weights, sliding
    windows, ALiBi, and paged or partly used key caches."""
    if call.get("return_debug_mask"):
        raise _Fallback("return_debug_mask=True (gemmgen does not return the attention weights)")
    left, right = call.get("window_size_left"), call.get("window_size_right")
    # FlashAttention's causal mask is the window (-1, 0): varlen_attn passes it with is_causal.
    causal_window = bool(call.get("is_causal")) and right == 0
    if left not in (None, -1) or (right not in (None, -1) and not causal_window):
        raise _Fallback(f"a sliding window (window_size_left={left}, window_size_right={right})")
    for name in ("alibi_slopes", "seqused_k", "block_table"):
        if call.get(name) is not None:
            raise _Fallback(f"{name} (gemmgen does not take it)")


def _grad_expected(*tensors: torch.Tensor) -> bool:
    """Whether autograd will ask for this call's backward: torch's autograd kernel hands the op the
    tensors themselves, requires_grad included (views made here, below autograd, do not carry it)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _no_debug_mask(q: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=q.dtype, device=q.device)


def _bhnd(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """[B, N, H, d] tensors as the [B, H, N, d] views gemmgen takes (and back)."""
    return tuple(t.transpose(1, 2) for t in tensors)


# ---- dropout: the philox outputs -----------------------------------------------------------------

@contextlib.contextmanager
def _dropout_seed(q: torch.Tensor, dropout_p: float, draws: int) -> Iterator[tuple[int | None, int]]:
    """(seed, offset) of a call's dropout mask, drawn from torch's CUDA generator as
    gemmgen.fused_attention draws it (torch.manual_seed makes it reproducible); (None, 0) without
    dropout. Should the call then not run on gemmgen, the generator is rewound: torch's kernel,
    running it instead, draws the mask it would have drawn without gemmgen."""
    if dropout_p <= 0.0:
        yield None, 0
        return
    index = q.get_device()
    seed, offset = _launch().draw_seed(index, draws)
    try:
        yield seed, offset
    except Exception:
        try:
            torch.cuda.default_generators[index].set_offset(offset)
        except (RuntimeError, IndexError):  # a generator in CUDA graph capture; no CUDA generator
            pass
        raise


def _philox_outputs(device: torch.device, dropout_p: float, seed: int | None,
                    offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (rng_state, unused) outputs. With dropout: [seed, offset] and the gemmgen tag, uint64 on
    the CPU, so that the backward reads them without a device sync. Without: uninitialized uint64
    tensors on the device, as torch's own kernel returns them then."""
    if dropout_p > 0.0:
        state = torch.tensor([seed, offset], dtype=torch.int64).view(torch.uint64)
        return state, torch.tensor(_TAG, dtype=torch.int64).view(torch.uint64)
    return (torch.empty(2, dtype=torch.uint64, device=device),
            torch.empty((), dtype=torch.uint64, device=device))


def _philox_of_gemmgen(state: Any, tag: Any) -> tuple[int, int] | None:
    """(seed, offset) when the forward's philox outputs are gemmgen's, else None."""
    if not (isinstance(state, torch.Tensor) and isinstance(tag, torch.Tensor)):
        return None
    if state.device.type != "cpu" or tag.device.type != "cpu" or state.numel() != 2 or tag.numel() != 1 \
            or state.element_size() != 8 or tag.element_size() != 8:
        return None
    if int(tag.view(torch.int64)) != _TAG:
        return None
    seed, offset = state.view(torch.int64).tolist()
    return seed, offset


def _philox_for_backward(dropout_p: float, state: Any, tag: Any) -> tuple[int, int]:
    """The (seed, offset) a backward passes to gemmgen. With dropout, only the implementation that
    ran the forward regenerates its mask: a forward torch's kernel ran sends the backward there too."""
    ours = _philox_of_gemmgen(state, tag)
    if dropout_p > 0.0 and ours is None:
        raise _Fallback("dropout, and torch's kernel ran the forward (only its backward regenerates "
                        "that mask)")
    return ours or (0, 0)


@contextlib.contextmanager
def _mask_is_gemmgens(dropout_p: float) -> Iterator[None]:
    """With dropout, a backward whose forward gemmgen ran cannot go to torch's kernel (another mask):
    what stops gemmgen's backward is then an error, not a fallback."""
    try:
        yield
    except (GemmgenError, _Fallback) as exc:
        if dropout_p > 0.0:
            raise RuntimeError(f"gemmgen ran this attention's forward with dropout, and only gemmgen's "
                               f"backward regenerates that mask, but it cannot run: {exc}") from exc
        raise


@contextlib.contextmanager
def _backward_check() -> Iterator[None]:
    """A missing backward instance, found at a forward with dropout, as a remembered fallback."""
    try:
        yield
    except _METADATA_FAILURES as exc:
        raise _Fallback(f"dropout on inputs that require grad, and no gemmgen backward serves the call "
                        f"({_summary(exc)})", remember=True) from exc


def _backward_serves(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float | None,
                     dropout_p: float) -> None:
    """Fall back where no gemmgen backward serves a dropout call whose inputs will get gradients,
    as gemmgen.fused_attention checks at such a forward: only the backward of the implementation
    that ran the forward regenerates its mask, and torch's kernel has one."""
    select = importlib.import_module("gemmgen.ops.torch_op")._bwd_kernel
    kk = _launch().expanded_layout(k, q.shape[1] // k.shape[1], "meta")
    with _backward_check():
        select(q, kk, causal, _ALIGNMENT, scale, dropout_p, None, False, torch.are_deterministic_algorithms_enabled())


def _varlen_backward_serves(q: torch.Tensor, k: torch.Tensor, batch: int, max_q: int, max_k: int,
                            causal: bool, scale: float | None, dropout_p: float, alignment: str) -> None:
    """_backward_serves for packed sequences: raise when gemmgen has no backward for them."""
    select = importlib.import_module("gemmgen.ops.torch_op")._varlen_bwd_kernel
    group = q.shape[1] // k.shape[1]
    kk = _launch().expanded_layout(k.unsqueeze(0).transpose(1, 2), group, "meta").transpose(1, 2).squeeze(0)
    with _backward_check():
        select(q, kk, batch, max_q, max_k, causal, scale, dropout_p, (), alignment if causal else "top_left",
               deterministic=torch.are_deterministic_algorithms_enabled())


# ---- repeated forward calls ----------------------------------------------------------------------
#
# A forward without dropout whose key in _run (op, grad mode, determinism, the call's metadata)
# served on gemmgen once is served again without redoing what that metadata decided: the argument
# and fallback tests, the checks gemmgen.fused_attention passed for these shapes and strides, and the
# outputs' layouts by torch's meta function (a decode loop calls the op with one key per step and
# layer count). What depends on the call itself still runs: whether it is plain eager (no mode or
# transform, plain tensors) and the data pointers' alignment; where either fails, the full path
# serves it. O is allocated here, so it shares no memory with an input.

@dataclass(frozen=True)
class _Repeat:
    bnhd: bool                            # aten::_flash_attention_forward's [B, N, H, d] (else SDPA's [B, H, N, d])
    out_layout: tuple                     # (shape, strides) of O by torch's meta function
    lse_view: tuple | None                # (shape, strides) the LSE is viewed with, None: as gemmgen returns it
    causal: bool
    scale: float | None
    run: Callable[..., None]              # gemmgen.ops.torch_op._run: selects (cached plan) and launches
    lse_like: Callable[..., torch.Tensor]  # gemmgen.ops.torch_op._lse_like: the LSE output
    runs_eagerly: Callable[..., bool]     # gemmgen.ops.eager.runs_eagerly


class _Repeats:
    """The remembered forwards by key; forgotten all at once when full, on a registry refresh (a new
    build) and when the family list changes (the checks' head dims come from it)."""

    def __init__(self) -> None:
        self._by_key: dict[tuple, _Repeat] = {}
        self._families = -1
        self._hooked = False

    def get(self, key: tuple) -> _Repeat | None:
        if not self._by_key:
            return None
        if self._families != _space().version():
            self._by_key.clear()
            return None
        return self._by_key.get(key)

    def add(self, key: tuple, repeat: _Repeat) -> None:
        if not self._hooked:
            from gemmgen.select import registry

            registry.on_refresh(self.clear)
            self._hooked = True
        if not self._by_key:
            self._families = _space().version()
        if len(self._by_key) >= _MAX_CACHED:
            self._by_key.clear()
        self._by_key[key] = repeat

    def clear(self) -> None:
        self._by_key.clear()


_repeats = _Repeats()


def _remember(call: _Call, bnhd: bool, causal: bool, scale: float | None, dropout_p: float) -> None:
    """After `call` (a forward) ran on gemmgen: how to serve its key again, where that holds."""
    q = call["query"]
    if call.key is None or dropout_p > 0.0 or not q.is_cuda:
        return
    if q.shape[-1] not in importlib.import_module("gemmgen.ops.padding").tile_head_dims():
        return  # fused_attention pads such a head dim (gemmgen.ops.padding); the direct launch would not
    out_layout, lse_layout = call.layout(0), call.layout(1)
    if out_layout is None:
        return
    lse_shape = (q.shape[0], q.shape[2], q.shape[1]) if bnhd else tuple(q.shape[:3])
    lse_strides = (lse_shape[1] * lse_shape[2], lse_shape[2], 1)
    lse_view = None
    if lse_layout is not None and lse_layout[0] == lse_shape and lse_layout[1] != lse_strides:
        if not all(n == 1 or a == b for n, a, b in zip(*lse_layout, lse_strides)):
            return  # _in_layout copies it: not worth a second path
        lse_view = lse_layout
    op = _torch_op()
    _repeats.add(call.key, _Repeat(bnhd, out_layout, lse_view, bool(causal), None if scale is None else float(scale),
                                   op._run, op._lse_like, _eager().runs_eagerly))


def _serve_again(r: _Repeat, args: tuple) -> tuple | None:
    """A remembered forward's outputs (the op's tuple), or None where the full path must serve it."""
    q, k, v = args[0], args[1], args[2]
    if not r.runs_eagerly(q, k, v) or (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16:  # ALIGN_BYTES
        return None
    shape, strides = r.out_layout
    out = torch.empty_strided(shape, strides, dtype=q.dtype, device=q.device)
    qq, kk, vv, oo = _bhnd(q, k, v, out) if r.bnhd else (q, k, v, out)
    lse = r.lse_like(qq, True)
    r.run(qq, kk, vv, oo, lse, r.causal, _ALIGNMENT, r.scale, None)
    if r.lse_view is not None:
        lse = lse.as_strided(*r.lse_view)
    state, unused = _philox_outputs(q.device, 0.0, None, 0)
    if r.bnhd:
        return out, lse, state, unused, _no_debug_mask(q)
    return out, lse, None, None, q.shape[2], k.shape[2], state, unused, _no_debug_mask(q)


# ---- fixed-length attention ----------------------------------------------------------------------

def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, causal: bool,
             scale: float | None, dropout_p: float, grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gemmgen.fused_attention of [B, H, N, d] views into `out` (grad: autograd will ask for the
    backward); returns (LSE [B, H, Nq], rng_state, unused)."""
    draws = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]
    with _dropout_seed(q, dropout_p, draws) as (seed, offset):
        if dropout_p > 0.0 and grad:
            _backward_serves(q, k, causal, scale, dropout_p)
        with torch.no_grad():  # below autograd already; no_grad lets fused_attention write into out=
            _, lse = _attention().fused_attention(q, k, v, causal=causal, causal_alignment=_ALIGNMENT, scale=scale,
                                                  return_lse=True, out=out, dropout_p=dropout_p, seed=seed,
                                                  offset=offset)
    return (lse, *_philox_outputs(q.device, dropout_p, seed, offset))


def _backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, causal: bool, scale: float | None, dropout_p: float, state: Any,
              tag: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch.ops.gemmgen.fused_attention_backward of [B, H, N, d] views: (dQ, dK, dV)."""
    seed, offset = _philox_for_backward(dropout_p, state, tag)
    deterministic = torch.are_deterministic_algorithms_enabled()
    with torch.no_grad(), _mask_is_gemmgens(dropout_p):
        dq, dk, dv, _ = _gemmgen_ops().fused_attention_backward.default(
            grad_out, q, k, v, out, lse, bool(causal), _ALIGNMENT, scale, dropout_p, seed, offset, None, False,
            deterministic)
    return dq, dk, dv


def _sdpa_forward(call: _Call) -> tuple:
    """aten::_scaled_dot_product_flash_attention: q, k, v [B, H, N, d]."""
    _refuse_unsupported(call)
    q, k, v = call["query"], call["key"], call["value"]
    out = _allocate(call, 0, q)
    lse, state, tag = _forward(q, k, v, out, call["is_causal"], call["scale"], call["dropout_p"],
                               _grad_expected(q, k, v))
    _remember(call, False, call["is_causal"], call["scale"], call["dropout_p"])
    return (out, _in_layout(call, 1, lse), None, None, q.shape[2], k.shape[2], state, tag, _no_debug_mask(q))


def _sdpa_backward(call: _Call) -> tuple:
    """aten::_scaled_dot_product_flash_attention_backward: [B, H, N, d]."""
    grads = _backward(call["grad_out"], call["query"], call["key"], call["value"], call["out"], call["logsumexp"],
                      call["is_causal"], call["scale"], call["dropout_p"], call["philox_seed"],
                      call["philox_offset"])
    return tuple(_in_layout(call, i, g) for i, g in enumerate(grads))


def _flash_forward(call: _Call) -> tuple:
    """aten::_flash_attention_forward: q, k, v [B, N, H, d], or packed [T, H, d] with cum_seq_q/k."""
    _refuse_unsupported(call)
    if call["cum_seq_q"] is not None:
        out, lse, state, tag = _varlen_forward(call)
        return _in_layout(call, 0, out), _in_layout(call, 1, lse), state, tag, _no_debug_mask(out)
    q, k, v = call["query"], call["key"], call["value"]
    out = _allocate(call, 0, q)
    lse, state, tag = _forward(*_bhnd(q, k, v, out), call["is_causal"], call["scale"], call["dropout_p"],
                               _grad_expected(q, k, v))
    _remember(call, True, call["is_causal"], call["scale"], call["dropout_p"])
    return out, _in_layout(call, 1, lse), state, tag, _no_debug_mask(q)


def _flash_forward_inplace(call: _Call) -> torch.Tensor:
    """aten::_flash_attention_forward_no_dropout_inplace: O written into `out`, LSE returned."""
    _refuse_unsupported(call)
    if call["dropout_p"] > 0.0:
        raise _Fallback("dropout_p > 0 in the op without dropout")
    out = call["out"]
    if call["cum_seq_q"] is not None:
        o, lse, _, _ = _varlen_forward(call)
        out.copy_(o)
        return _in_layout(call, 0, lse)
    lse, _, _ = _forward(*_bhnd(call["query"], call["key"], call["value"], out), call["is_causal"], call["scale"],
                         0.0, False)
    return _in_layout(call, 0, lse)


def _flash_backward(call: _Call) -> tuple:
    """aten::_flash_attention_backward: [B, N, H, d], or packed [T, H, d] with cum_seq_q/k."""
    _refuse_unsupported(call)
    if call["cum_seq_q"] is not None:
        grads = _varlen_backward(call)
    else:
        views = _bhnd(call["grad_out"], call["query"], call["key"], call["value"], call["out"])
        grads = _bhnd(*_backward(*views, call["logsumexp"], call["is_causal"], call["scale"], call["dropout_p"],
                                 call["philox_seed"], call["philox_offset"]))
    return tuple(_in_layout(call, i, g) for i, g in enumerate(grads))


# ---- packed sequences ----------------------------------------------------------------------------

def _varlen_alignment(cu_q: torch.Tensor, cu_k: torch.Tensor) -> str:
    """gemmgen's causal alignment for FlashAttention's causal mask within each packed sequence, which
    is bottom-right: "bottom_right" (fa2_sm80 and fa2_bwd_sm80 run it), or "top_left" where one
    offsets tensor serves both sides, every sequence as long on each, so that the two agree and the
    families that run top-left only (mea_sm80's dropout) serve it too. Separate tensors are not
    compared (a device-to-host read per call)."""
    return "top_left" if cu_q is cu_k else "bottom_right"


def _rows(cu_q: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each packed query row's sequence and position in it, computed on the device (no sync)."""
    starts = cu_q.to(torch.int64)
    rows = torch.arange(total, dtype=torch.int64, device=cu_q.device)
    seq = torch.searchsorted(starts[1:].contiguous(), rows, right=True)
    return seq, rows - starts[seq]


def _packed_lse(lse: torch.Tensor, cu_q: torch.Tensor, total: int) -> torch.Tensor:
    """gemmgen's varlen LSE [B, H, max_q] as torch's [H, Tq]."""
    seq, pos = _rows(cu_q, total)
    return lse[seq, :, pos].t().contiguous()


def _batched_lse(lse: torch.Tensor, cu_q: torch.Tensor, batch: int, max_q: int) -> torch.Tensor:
    """torch's packed LSE [H, Tq] as gemmgen's [B, H, max_q] (-inf past each sequence's end)."""
    seq, pos = _rows(cu_q, lse.shape[1])
    out = torch.full((batch, lse.shape[0], max_q), float("-inf"), dtype=torch.float32, device=lse.device)
    out[seq, :, pos] = lse.t().to(torch.float32)
    return out


def _varlen_sizes(call: _Call) -> tuple[torch.Tensor, torch.Tensor, int, int, int]:
    """(cum_seq_q, cum_seq_k, batch, max_q, max_k), after the checks gemmgen's varlen path needs."""
    cu_q, cu_k = call["cum_seq_q"], call["cum_seq_k"]
    if cu_k is None:
        raise _Fallback("packed queries without cum_seq_k (keys from seqused_k or a block table)")
    return cu_q, cu_k, cu_q.shape[0] - 1, int(call["max_q"]), int(call["max_k"])


def _varlen_forward(call: _Call) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """gemmgen.fused_attention_varlen: (O [Tq, H, d], LSE [H, Tq], rng_state, unused)."""
    q, k, v = call["query"], call["key"], call["value"]
    cu_q, cu_k, batch, max_q, max_k = _varlen_sizes(call)
    causal, scale, dropout_p = bool(call["is_causal"]), call["scale"], call["dropout_p"]
    alignment = _varlen_alignment(cu_q, cu_k)
    with _dropout_seed(q, dropout_p, batch * q.shape[1] * max_q * max_k) as (seed, offset):
        if dropout_p > 0.0 and _grad_expected(q, k, v):
            _varlen_backward_serves(q, k, batch, max_q, max_k, causal, scale, dropout_p, alignment)
        with torch.no_grad():
            o, lse = _attention().fused_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal,
                                                         scale=scale, return_lse=True, dropout_p=dropout_p,
                                                         seed=seed, offset=offset, causal_alignment=alignment)
    return (o, _packed_lse(lse, cu_q, q.shape[0]), *_philox_outputs(q.device, dropout_p, seed, offset))


def _varlen_backward(call: _Call) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch.ops.gemmgen.fused_attention_varlen_backward: (dQ, dK, dV) packed like the inputs."""
    cu_q, cu_k, batch, max_q, max_k = _varlen_sizes(call)
    dropout_p = call["dropout_p"]
    seed, offset = _philox_for_backward(dropout_p, call["philox_seed"], call["philox_offset"])
    with torch.no_grad(), _mask_is_gemmgens(dropout_p):
        lse = _batched_lse(call["logsumexp"], cu_q, batch, max_q)
        dq, dk, dv = _gemmgen_ops().fused_attention_varlen_backward.default(
            call["grad_out"], call["query"], call["key"], call["value"], call["out"], lse, cu_q, cu_k, max_q, max_k,
            bool(call["is_causal"]), call["scale"], dropout_p, seed, offset, _varlen_alignment(cu_q, cu_k), None, 0.0,
            torch.are_deterministic_algorithms_enabled())
    return dq, dk, dv


_FLASH_FORWARD_ARGS = ("query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p",
                       "is_causal", "return_debug_mask")
_BACKWARD_ARGS = ("grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q", "cum_seq_k", "max_q",
                  "max_k", "dropout_p", "is_causal", "philox_seed", "philox_offset")
_SPECS = (
    _OpSpec("_scaled_dot_product_flash_attention",
            ("query", "key", "value", "dropout_p", "is_causal", "return_debug_mask"), _sdpa_forward),
    _OpSpec("_scaled_dot_product_flash_attention_backward", _BACKWARD_ARGS, _sdpa_backward),
    _OpSpec("_flash_attention_forward", _FLASH_FORWARD_ARGS, _flash_forward),
    _OpSpec("_flash_attention_forward_no_dropout_inplace", ("out",) + _FLASH_FORWARD_ARGS, _flash_forward_inplace),
    _OpSpec("_flash_attention_backward", _BACKWARD_ARGS, _flash_backward),
)
