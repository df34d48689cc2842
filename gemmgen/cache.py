"""The cache directory: tuning databases (tuning/) and instances compiled on demand (jit/).

$GEMMGEN_CACHE_DIR if set, else $XDG_CACHE_HOME/gemmgen, else ~/.cache/gemmgen.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from gemmgen.errors import CacheError


def cache_dir() -> Path:
    """The cache directory (not created here)."""
    env = os.environ.get("GEMMGEN_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "gemmgen"


def writable_dir(sub: str = "") -> Path:
    """<cache>/<sub>, created if needed; raise CacheError when it cannot be created or written."""
    path = cache_dir() / sub if sub else cache_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
            pass
    except OSError as exc:
        raise CacheError(f"cache directory {path} is not writable ({exc.strerror or exc}); "
                         f"set GEMMGEN_CACHE_DIR to a writable folder") from exc
    return path


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` through a unique temporary file in the same folder and os.replace:
    a reader sees the old file or the new one, never half of one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
