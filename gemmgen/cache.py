"""The cache directory: tuning databases (tuning/), instances compiled on demand (jit/) and the
record of build folders `gemmgen generate` wrote (builds.json).

$GEMMGEN_CACHE_DIR if set, else $XDG_CACHE_HOME/gemmgen, else ~/.cache/gemmgen.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
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


BUILDS_FILE = "builds.json"
BUILDS_KIND = "gemmgen-builds"


def builds_path() -> Path:
    """The record of build folders: <cache>/builds.json."""
    return cache_dir() / BUILDS_FILE


def _read_builds(path: Path) -> list[dict]:
    """The records of `path`, most recently written first; [] when it is missing, unreadable or
    not a build record (it is rewritten whole on the next record_build)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(data, dict) or data.get("kind") != BUILDS_KIND or not isinstance(data.get("builds"), list):
        return []
    return [b for b in data["builds"] if isinstance(b, dict) and isinstance(b.get("path"), str)
            and os.path.isabs(b["path"])]


def recorded_builds() -> list[Path]:
    """The build folders `gemmgen generate` recorded that still exist, most recently written first,
    each once (absolute paths). Never raises: an unreadable record counts as none."""
    found: list[Path] = []
    for record in _read_builds(builds_path()):
        path = Path(record["path"])
        if path not in found and path.is_dir():
            found.append(path)
    return found


def record_build(folder: str | os.PathLike) -> Path:
    """Record `folder` (made absolute) as a build folder, first in the list; returns the record's path.

    The record lists each folder once, drops folders that no longer exist, and is replaced
    atomically under a file lock (<cache>/builds.json.lock), so concurrent generates keep every
    folder. Raises CacheError when the cache directory cannot be written."""
    import filelock

    path = writable_dir() / BUILDS_FILE
    folder = Path(os.path.abspath(folder))
    try:
        with filelock.FileLock(str(path) + ".lock"):
            records = [{"path": str(folder), "recorded_at": time.time()}]
            for record in _read_builds(path):
                if record["path"] not in {r["path"] for r in records} and Path(record["path"]).is_dir():
                    records.append(record)
            atomic_write_text(path, json.dumps({"schema": 1, "kind": BUILDS_KIND, "builds": records},
                                               indent=1) + "\n")
    except OSError as exc:
        raise CacheError(f"cannot record the build folder in {path} ({exc.strerror or exc}); "
                         f"set GEMMGEN_CACHE_DIR to a writable folder") from exc
    return path
