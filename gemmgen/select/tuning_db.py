"""The tuning database: every measured time of every candidate, per GPU and size bucket.

One JSON file per GPU fingerprint (model, driver, CUDA, gemmgen version) in <cache>/tuning/:

    {"schema": 1, "kind": "gemmgen-tuning", "device": {fingerprint},
     "entries": {functional key: {bucket key: {instance content hash: record}}}}

A record is {"name", "ms" (null: failed), "reason", "error" (relative error of the check), "shape",
"at" (unix time)}. Keying by content hash keeps old measurements when instances are added, and
drops them from use when an instance's code changes. Writers take <file>.lock, re-read the file,
merge (per bucket and instance the most recent measurement wins) and replace it atomically, so
concurrent processes lose nothing. A corrupt or foreign file is reported with a GemmgenWarning,
renamed aside (<file>.corrupt-<time> / .foreign-<time>) and read as empty: it never fails an op.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import re
import time
import warnings
from pathlib import Path
from typing import Any, Iterable

import filelock

from gemmgen import cache
from gemmgen.errors import GemmgenWarning, TuningDatabaseError

SCHEMA = 1
KIND = "gemmgen-tuning"
BUNDLE_KIND = "gemmgen-tuning-bundle"
LOCK_TIMEOUT_S = 60.0

Entries = dict[str, dict[str, dict[str, dict[str, Any]]]]  # functional key -> bucket -> hash -> record


@dataclasses.dataclass(frozen=True)
class Record:
    """One measurement of one instance in one bucket."""

    name: str
    ms: float  # math.inf when it failed to launch or gave a wrong result
    reason: str | None = None
    error: float | None = None
    shape: str | None = None
    at: float = 0.0
    # Batched GEMM tuning (gemmgen.select.measure.measure with sustained_policy): ms is the time under sustained load in
    # rotation with the other candidates, ms_short per call over short runs, ms_alone under
    # sustained load with the GPU to itself (the finalists of long calls); None where not taken.
    ms_short: float | None = None
    ms_alone: float | None = None

    @property
    def ok(self) -> bool:
        """True when the measurement is a finite time."""
        return math.isfinite(self.ms)

    def to_json(self) -> dict[str, Any]:
        """The record as stored (ms null for infinity)."""
        out = {"name": self.name, "ms": self.ms if self.ok else None, "reason": self.reason,
               "error": self.error, "shape": self.shape, "at": self.at}
        if self.ms_short is not None:
            out["ms_short"] = self.ms_short
        if self.ms_alone is not None:
            out["ms_alone"] = self.ms_alone
        return out

    @staticmethod
    def from_json(data: Any) -> "Record":
        """The record of a stored dict, checked against the schema (RECORD_FIELDS: types, ranges);
        raise TuningDatabaseError naming the first field that does not fit."""
        if not isinstance(data, dict):
            raise TuningDatabaseError(f"malformed record {data!r}: not an object")
        if "ms" not in data:  # required, null for a failed candidate
            raise TuningDatabaseError(f"malformed record {data!r}: ms is missing")
        for key, (types, required, check) in RECORD_FIELDS.items():
            value = data.get(key)
            if value is None:
                if required:
                    raise TuningDatabaseError(f"malformed record {data!r}: {key} is missing")
                continue
            if isinstance(value, bool) or not isinstance(value, types) or not check(value):
                raise TuningDatabaseError(f"malformed record {data!r}: {key} {value!r} is not {_DESCRIBE[key]}")
        ms, short, alone = data["ms"], data.get("ms_short"), data.get("ms_alone")
        return Record(name=data["name"], ms=math.inf if ms is None else float(ms), reason=data.get("reason"),
                      error=None if data.get("error") is None else float(data["error"]), shape=data.get("shape"),
                      at=float(data.get("at") or 0.0), ms_short=None if short is None else float(short),
                      ms_alone=None if alone is None else float(alone))


@dataclasses.dataclass
class TuningDB:
    """The contents of one database file."""

    device: dict[str, Any]
    entries: Entries = dataclasses.field(default_factory=dict)
    path: Path | None = None

    def buckets(self, functional_key: str) -> dict[str, dict[str, Record]]:
        """bucket key -> content hash -> Record, for one functional key."""
        return {b: {h: Record.from_json(r) for h, r in recs.items()}
                for b, recs in self.entries.get(functional_key, {}).items()}

    def add(self, functional_key: str, bucket_key: str, content_hash: str, record: Record) -> None:
        """Add or replace one record (in memory)."""
        self.entries.setdefault(functional_key, {}).setdefault(bucket_key, {})[content_hash] = record.to_json()

    def count(self) -> int:
        """The number of records."""
        return sum(len(recs) for b in self.entries.values() for recs in b.values())

    def to_json(self) -> dict[str, Any]:
        """The file's JSON."""
        return {"schema": SCHEMA, "kind": KIND, "device": self.device, "entries": self.entries}


def _nonneg(x: float) -> bool:
    return math.isfinite(x) and x >= 0


# The record schema: field -> (JSON types, required, range check). "ms" is required but may be null
# (a failed candidate); every other field may be absent or null.
RECORD_FIELDS: dict[str, tuple[tuple[type, ...], bool, Any]] = {
    "name": ((str,), True, lambda x: x != ""),
    "ms": ((int, float), False, _nonneg),
    "reason": ((str,), False, lambda x: True),
    "error": ((int, float), False, _nonneg),
    "shape": ((str,), False, lambda x: True),
    "at": ((int, float), False, _nonneg),
    "ms_short": ((int, float), False, _nonneg),
    "ms_alone": ((int, float), False, _nonneg),
}
_DESCRIBE = {"name": "a non-empty string", "ms": "a finite number >= 0 or null", "reason": "a string",
             "error": "a finite number >= 0", "shape": "a string", "at": "a finite number >= 0",
             "ms_short": "a finite number >= 0", "ms_alone": "a finite number >= 0"}


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "_", text).strip("_") or "gpu"


def path_for(fingerprint: dict[str, Any], folder: Path | None = None) -> Path:
    """The database file of a GPU fingerprint: <cache>/tuning/<gpu>-sm<cc>-<hash>.json."""
    return (folder or cache.cache_dir() / "tuning") / _file_name(json.dumps(fingerprint, sort_keys=True))


@functools.lru_cache(maxsize=64)
def _file_name(fingerprint_json: str) -> str:
    fingerprint = json.loads(fingerprint_json)
    digest = hashlib.sha256(fingerprint_json.encode()).hexdigest()[:12]
    return f"{_slug(fingerprint['gpu'])}-sm{str(fingerprint['cc']).replace('.', '')}-{digest}.json"


def merge_entries(into: Entries, other: Entries) -> int:
    """Merge `other` into `into`, the most recent record per (key, bucket, hash) winning; returns how
    many records of `other` were taken."""
    taken = 0
    for fkey, bucket_map in other.items():
        for bkey, recs in bucket_map.items():
            mine = into.setdefault(fkey, {}).setdefault(bkey, {})
            for chash, rec in recs.items():
                if chash not in mine or float(rec.get("at", 0)) >= float(mine[chash].get("at", 0)):
                    mine[chash] = rec
                    taken += 1
    return taken


def _validate(data: Any, where: Path | str, dropped: list[str] | None = None) -> TuningDB:
    """The database in `data`. A file whose frame is wrong (kind, schema, device, the entries'
    nesting) raises TuningDatabaseError; a record that does not fit the schema is left out and,
    when `dropped` is given, described there (else it raises too)."""
    if not isinstance(data, dict) or data.get("kind") != KIND:
        raise TuningDatabaseError(f"{where}: not a gemmgen tuning database")
    if data.get("schema") != SCHEMA:
        raise TuningDatabaseError(f"{where}: schema {data.get('schema')}, this gemmgen reads {SCHEMA}")
    device, entries = data.get("device"), data.get("entries")
    if not isinstance(device, dict) or not isinstance(entries, dict) or not {"gpu", "cc"} <= set(device):
        raise TuningDatabaseError(f"{where}: lacks its device (gpu, cc) or entries")
    if not all(isinstance(device.get(k), str if k == "gpu" else (str, int, float)) for k in ("gpu", "cc")):
        raise TuningDatabaseError(f"{where}: its device's gpu and cc are malformed")
    kept: Entries = {}
    for fkey, bucket_map in entries.items():
        if not isinstance(bucket_map, dict) or not all(isinstance(r, dict) for r in bucket_map.values()):
            raise TuningDatabaseError(f"{where}: entries[{fkey!r}] is malformed")
        for bkey, recs in bucket_map.items():
            for chash, rec in recs.items():
                try:
                    Record.from_json(rec)
                except TuningDatabaseError as exc:
                    if dropped is None:
                        raise TuningDatabaseError(f"{where}: in {fkey} {bkey}: {exc}") from None
                    dropped.append(f"{fkey} {bkey} {chash}: {exc}")
                    continue
                kept.setdefault(fkey, {}).setdefault(bkey, {})[chash] = rec
    return TuningDB(device=device, entries=kept, path=Path(where) if isinstance(where, Path) else None)


def _report_dropped(where: Path | str, dropped: list[str]) -> None:
    if dropped:
        more = f" (and {len(dropped) - 3} more)" if len(dropped) > 3 else ""
        warnings.warn(f"gemmgen: tuning database {where}: left out {len(dropped)} malformed record(s): "
                      f"{'; '.join(dropped[:3])}{more}", GemmgenWarning, stacklevel=3)


def _read_json(path: Path) -> object:
    try:
        return json.loads(Path(path).read_text())
    except OSError as exc:
        raise TuningDatabaseError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TuningDatabaseError(f"{path}: not valid JSON ({exc})") from exc


def read(path: Path) -> TuningDB:
    """Read and validate a database file: malformed records are left out with a GemmgenWarning;
    raise TuningDatabaseError if the file is not a database at all."""
    dropped: list[str] = []
    db = _validate(_read_json(path), Path(path), dropped)
    _report_dropped(path, dropped)
    return db


def _is_bad(path: Path, fingerprint: dict[str, Any]) -> bool:
    try:
        return _validate(_read_json(path), Path(path), []).device != fingerprint
    except TuningDatabaseError:
        return path.exists()


def _set_aside(path: Path, fingerprint: dict[str, Any], tag: str, why: str) -> None:
    """Rename a corrupt or foreign file out of the way (re-checked under the lock, since another
    process may have replaced it meanwhile) and warn."""
    aside: Path | None = path.with_name(f"{path.name}.{tag}-{time.strftime('%Y%m%dT%H%M%S')}")
    try:
        with filelock.FileLock(str(path) + ".lock", timeout=5):
            if not _is_bad(path, fingerprint):
                return
            path.rename(aside)
    except (OSError, filelock.Timeout):
        aside = None
    where = f"moved to {aside}" if aside else "left in place (could not move it)"
    warnings.warn(f"gemmgen: ignoring tuning database {path}: {why}; {where}", GemmgenWarning, stacklevel=3)


def read_any(path: Path) -> TuningDB | None:
    """The database at `path`, whatever GPU it was made on, read as load() reads this GPU's: its
    malformed records left out with a warning; a file that is not a database reported, renamed aside
    (<file>.corrupt-<time>) and None returned. For the commands that look at every database (tune
    show and export, explain for another GPU)."""
    path = Path(path)
    try:
        return read(path)
    except TuningDatabaseError as exc:
        aside: Path | None = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}")
        try:
            with filelock.FileLock(str(path) + ".lock", timeout=5):
                try:  # another process may have replaced it meanwhile
                    _validate(_read_json(path), path, [])
                    return read(path)
                except TuningDatabaseError:
                    path.rename(aside)
        except (OSError, filelock.Timeout):
            aside = None
        where = f"moved to {aside}" if aside else "left in place (could not move it)"
        warnings.warn(f"gemmgen: ignoring tuning database {path}: {str(exc).removeprefix(f'{path}: ')}; {where}",
                      GemmgenWarning, stacklevel=2)
        return None


def load(path: Path, fingerprint: dict[str, Any]) -> TuningDB:
    """The database at `path` for this GPU; an empty one if missing. A corrupt file or one for
    another fingerprint is reported, set aside and read as empty (never raises)."""
    path = Path(path)
    if not path.exists():
        return TuningDB(device=dict(fingerprint), path=path)
    try:
        db = read(path)
    except TuningDatabaseError as exc:
        if path.exists():
            _set_aside(path, fingerprint, "corrupt", str(exc).removeprefix(f"{path}: "))
        return TuningDB(device=dict(fingerprint), path=path)
    if db.device != fingerprint:
        diff = ", ".join(f"{k} {db.device.get(k)!r} != {v!r}" for k, v in fingerprint.items()
                         if db.device.get(k) != v)
        _set_aside(path, fingerprint, "foreign", f"made for another GPU or version ({diff or 'other fields'})")
        return TuningDB(device=dict(fingerprint), path=path)
    return db


_cached: dict[Path, tuple[tuple[int, int], TuningDB]] = {}


def cached(fingerprint: dict[str, Any]) -> TuningDB:
    """The database of this GPU, re-read only when its file changed (for selection)."""
    path = path_for(fingerprint)
    try:
        st = path.stat()
        stamp = (st.st_mtime_ns, st.st_size)
    except OSError:
        stamp = (0, 0)
    hit = _cached.get(path)
    if hit is None or hit[0] != stamp:
        hit = (stamp, load(path, fingerprint))
        _cached[path] = hit
    return hit[1]


def remember(fingerprint: dict[str, Any], entries: Entries) -> None:
    """Merge `entries` into this process's copy of the database only (when it cannot be written)."""
    db = cached(fingerprint)
    merge_entries(db.entries, entries)


def update(fingerprint: dict[str, Any], entries: Entries, path: Path | None = None) -> TuningDB:
    """Merge `entries` into the database of `fingerprint` under its file lock and write it back
    atomically; returns the merged database. Raises CacheError when the folder is not writable."""
    path = Path(path) if path is not None else path_for(fingerprint, cache.writable_dir("tuning"))
    path.parent.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(path) + ".lock", timeout=LOCK_TIMEOUT_S):
        db = load(path, fingerprint)
        merge_entries(db.entries, entries)
        cache.atomic_write_text(path, json.dumps(db.to_json(), indent=1, sort_keys=True) + "\n")
    _cached.pop(path, None)
    return db


def database_files(folder: Path | None = None) -> list[Path]:
    """The database files in <cache>/tuning (or `folder`)."""
    folder = folder or cache.cache_dir() / "tuning"
    return sorted(p for p in folder.glob("*.json") if p.is_file())


def export_bundle(paths: Iterable[Path], out: Path) -> int:
    """Write the databases at `paths` into one bundle file; returns the number of databases. A file
    that is not a database is set aside with a GemmgenWarning (read_any); the rest are exported."""
    dbs = [db.to_json() for db in map(read_any, paths) if db is not None]
    text = json.dumps({"schema": SCHEMA, "kind": BUNDLE_KIND, "databases": dbs}, indent=1, sort_keys=True)
    cache.atomic_write_text(Path(out), text + "\n")
    return len(dbs)


def import_file(path: Path) -> list[tuple[Path, int]]:
    """Merge a bundle (or a single database file) into the cache, each database into the file of
    its own fingerprint; returns (database file, records taken) per database."""
    data = _read_json(path)
    if isinstance(data, dict) and data.get("kind") == BUNDLE_KIND:
        if data.get("schema") != SCHEMA or not isinstance(data.get("databases"), list):
            raise TuningDatabaseError(f"{path}: unsupported bundle (schema {data.get('schema')})")
        dropped: list[str] = []
        dbs = [_validate(d, f"{path} database #{i}", dropped) for i, d in enumerate(data["databases"])]
    else:
        dropped = []
        dbs = [_validate(data, path, dropped)]
    _report_dropped(path, dropped)
    done = []
    for db in dbs:
        target = path_for(db.device, cache.writable_dir("tuning"))
        done.append((target, db.count()))
        update(db.device, db.entries, target)
    return done
