"""gemmgen: a CUTLASS-based fused-attention kernel generator.

    import gemmgen
    o = gemmgen.fused_attention(q, k, v, causal=True)
    o = gemmgen.fused_attention(q, k, v, dropout_p=0.1, attn_mask=mask)   # dropout, additive mask
    o = gemmgen.fused_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k)  # packed sequences

The torch-facing pieces load lazily, so `gemmgen generate` does not pay for importing torch.
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from gemmgen.errors import (CacheError, DeviceError, GemmgenError, GemmgenLaunchError, GemmgenWarning,
                            InputError, ManifestError, NoInstanceError, ToolchainError, TuningDatabaseError)
from gemmgen.integrations import activate, deactivate  # noqa: F401 (exported; registers torch SDPA's "gemmgen" impl)

__version__ = "0.1.0"

# Installed, the wheel maps the checkout's generator/ and templates/ folders to gemmgen.generator and
# gemmgen.templates. Run from a checkout that is not installed (PYTHONPATH=<checkout>), the folder
# holding them is searched for gemmgen's subpackages too, so the same names resolve.
_checkout = Path(__file__).resolve().parent.parent
if not (Path(__file__).resolve().parent / "generator").is_dir() and (_checkout / "generator" / "__init__.py").is_file():
    __path__.append(str(_checkout))  # noqa: F821 (a package's __path__)

_LAZY_ATTRS = {
    "fused_attention": "gemmgen.ops.attention",
    "fused_attention_varlen": "gemmgen.ops.attention",
    "fused_attention_with_kvcache": "gemmgen.ops.kvcache",
    "selected_instance": "gemmgen.ops.attention",
    "explain": "gemmgen.ops.attention",
    "autotune": "gemmgen.select.tuner",
    "attention_reference": "gemmgen.ops.reference",
    "set_build_dirs": "gemmgen.select.registry",
    "refresh": "gemmgen.select.registry",
    "cache_dir": "gemmgen.cache",
    "Shape": "gemmgen.select.shapes",
    "parse_shape": "gemmgen.select.shapes",
    "batched_gemm": "gemmgen.ops.gemm",
    "batched_gemm_ptrs": "gemmgen.ops.gemm",
    "unfused_attention": "gemmgen.ops.unfused",
}
# The subpackages: the code generator, and the runtime's selection, operations, kernels and CLI.
_SUBMODULES = {"arch", "cache", "errors", "generator", "select", "ops", "kernels", "cli", "distributed"}

__all__ = ["fused_attention", "fused_attention_varlen", "fused_attention_with_kvcache", "selected_instance", "explain", "autotune", "attention_reference",
           "set_build_dirs", "refresh", "cache_dir", "Shape", "parse_shape",
           "batched_gemm", "batched_gemm_ptrs", "unfused_attention",
           "GemmgenError", "ToolchainError", "ManifestError", "InputError", "DeviceError",
           "NoInstanceError", "GemmgenLaunchError", "CacheError", "TuningDatabaseError",
           "GemmgenWarning", "__version__"]


def __getattr__(name: str) -> Any:
    """Import the torch-facing API on first use, and bind it here: later lookups (every
    `gemmgen.fused_attention(...)` call) find it in the module without coming back."""
    if name in _LAZY_ATTRS:
        value = globals()[name] = getattr(importlib.import_module(_LAZY_ATTRS[name]), name)
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"gemmgen.{name}")
    raise AttributeError(f"module 'gemmgen' has no attribute {name!r}")
