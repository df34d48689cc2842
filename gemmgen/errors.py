"""Exception types: every error gemmgen raises is a GemmgenError, so callers can catch them all."""
from __future__ import annotations


class GemmgenError(Exception):
    """Base class of all gemmgen errors."""


class ToolchainError(GemmgenError, RuntimeError):
    """nvcc, ninja or the CUTLASS headers are missing or unusable."""


class ManifestError(GemmgenError, ValueError):
    """A manifest.json is missing, unreadable or does not follow the schema."""


class InputError(GemmgenError, ValueError):
    """Tensors or arguments passed to fused_attention that it cannot run."""


class DeviceError(GemmgenError, RuntimeError):
    """The call needs a CUDA GPU (or a different one) than the one available."""


class NoInstanceError(GemmgenError, RuntimeError):
    """No built instance can run the problem; the message lists why each was rejected."""


class GemmgenLaunchError(GemmgenError, RuntimeError):
    """A compiled instance returned a non-zero status; the message is the library's."""


class CacheError(GemmgenError, OSError):
    """The cache directory ($GEMMGEN_CACHE_DIR) cannot be created or written."""


class TuningDatabaseError(GemmgenError, ValueError):
    """A tuning database or export file is unreadable, corrupt or for another GPU or version."""


class GemmgenWarning(UserWarning):
    """Something gemmgen worked around (a corrupt tuning database set aside, a tuning not stored)."""
