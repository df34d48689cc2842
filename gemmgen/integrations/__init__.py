"""gemmgen behind other libraries' extension points.

torch_sdpa: gemmgen as the flash-attention implementation of torch's scaled_dot_product_attention.
Importing this package registers it with torch.nn.attention's registry under the name "gemmgen",
without activating it; activate() and deactivate() switch it on and off (as do
torch.nn.attention.activate_flash_attention_impl("gemmgen") and restore_flash_attention_impl()).

This package does not import torch itself (`gemmgen generate` runs without it): where torch is loaded
already it registers at once, else right after torch's own import finishes.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import logging
import sys
from typing import Any, Callable

logger = logging.getLogger("gemmgen.sdpa")


def activate() -> None:
    """Serve torch's flash-attention ops (F.scaled_dot_product_attention's flash path, varlen_attn)
    with gemmgen: gemmgen.integrations.torch_sdpa.activate()."""
    importlib.import_module("gemmgen.integrations.torch_sdpa").activate()


def deactivate() -> None:
    """Give torch's flash-attention ops their own kernels back: gemmgen.integrations.torch_sdpa.deactivate()."""
    importlib.import_module("gemmgen.integrations.torch_sdpa").deactivate()


def _register_with_torch() -> None:
    """Register "gemmgen" with torch's registry. Never raises: a torch without the registry, or any
    failure here, leaves torch as it is (activate() then says why)."""
    try:
        importlib.import_module("gemmgen.integrations.torch_sdpa").register()
    except Exception as exc:  # importing gemmgen or torch must not fail because of this
        logger.debug("gemmgen is not registered with torch's flash-attention registry: %s", exc)


class _AfterImport(importlib.abc.MetaPathFinder):
    """A one-shot import hook: runs `callback` right after the top-level module `name` has been
    executed, the first time it is imported. It finds nothing itself: it asks the other finders
    for the module's spec and wraps the loader's exec_module."""

    def __init__(self, name: str, callback: Callable[[], None]) -> None:
        self.name, self.callback = name, callback

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        self._uninstall()  # before asking the other finders, which may come back here
        try:
            spec = importlib.util.find_spec(fullname)
            loader = getattr(spec, "loader", None)
            exec_module = getattr(loader, "exec_module", None)
            if exec_module is None:
                return spec
        except Exception:  # the normal import then finds (or fails to find) it as always
            return None

        def exec_then_call(module: Any) -> None:
            exec_module(module)
            self.callback()

        loader.exec_module = exec_then_call
        return spec

    def _uninstall(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


def _register_when_torch_loads() -> None:
    if "torch" in sys.modules:
        _register_with_torch()
    else:
        sys.meta_path.insert(0, _AfterImport("torch", _register_with_torch))


_register_when_torch_loads()
