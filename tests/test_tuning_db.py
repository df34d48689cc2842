"""The tuning database: round trip, merging, concurrent writers, corrupt and foreign files, sharing."""
from __future__ import annotations

import json
import math
import multiprocessing
import os

import pytest

from gemmgen.select import tuning_db
from gemmgen.errors import CacheError, GemmgenWarning, TuningDatabaseError

FP = {"gpu": "NVIDIA H200", "cc": "9.0", "sm_count": 132, "driver": "580.65.06", "cuda": "13.0",
      "gemmgen_version": "0.1.0"}
A100 = {**FP, "gpu": "NVIDIA A100-SXM4-80GB", "cc": "8.0", "sm_count": 108}


def rec(name: str, ms: float, at: float, reason: str | None = None) -> dict:
    return tuning_db.Record(name, ms, reason, 1e-4, "1,2,2,64,64,64", at).to_json()


def entries(bucket: str, chash: str, ms: float, at: float = 1.0, key: str = "bf16_d64_none_a16") -> dict:
    return {key: {bucket: {chash: rec(f"inst_{chash}", ms, at)}}}


def test_roundtrip_and_infinite_times():
    tuning_db.update(FP, entries("bhnd_g1_bh8_q64_k64", "h1", 0.25))
    tuning_db.update(FP, {"bf16_d64_none_a16": {"bhnd_g1_bh8_q64_k64": {
        "h2": rec("bad", math.inf, 2.0, "failed to run: boom")}}})
    path = tuning_db.path_for(FP)
    assert path.parent.name == "tuning" and path.name.startswith("NVIDIA_H200-sm90-")
    db = tuning_db.read(path)
    recs = db.buckets("bf16_d64_none_a16")["bhnd_g1_bh8_q64_k64"]
    assert recs["h1"].ms == 0.25 and recs["h1"].ok
    assert recs["h2"].ms == math.inf and recs["h2"].reason == "failed to run: boom"
    assert json.loads(path.read_text())["entries"]["bf16_d64_none_a16"]["bhnd_g1_bh8_q64_k64"]["h2"]["ms"] is None
    assert db.device == FP and db.count() == 2
    assert [p.name for p in path.parent.iterdir() if p.suffix == ".tmp"] == []


def test_short_run_time_roundtrips_and_is_optional():
    both = tuning_db.Record(name="g", ms=0.5, ms_short=0.4, at=1.0)
    assert tuning_db.Record.from_json(both.to_json()) == both
    one = tuning_db.Record(name="g", ms=0.5, at=1.0)
    assert "ms_short" not in one.to_json() and tuning_db.Record.from_json(one.to_json()).ms_short is None


def test_merge_keeps_the_most_recent_measurement():
    tuning_db.update(FP, entries("b", "h1", 2.0, at=20.0))
    tuning_db.update(FP, entries("b", "h1", 1.0, at=10.0))  # older: ignored
    tuning_db.update(FP, entries("b", "h2", 3.0, at=5.0))  # another instance: added
    recs = tuning_db.read(tuning_db.path_for(FP)).buckets("bf16_d64_none_a16")["b"]
    assert recs["h1"].ms == 2.0 and recs["h2"].ms == 3.0


def _writer(worker: int, count: int) -> None:
    for i in range(count):
        tuning_db.update(FP, entries(f"bhnd_g1_bh{worker}_q{i}_k1", f"w{worker}", 0.1 + i, at=float(i)))
        tuning_db.update(FP, entries("shared", f"w{worker}", float(worker), at=float(i)))


def test_concurrent_writers_lose_nothing():
    workers, count = 4, 15
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(w, count)) for w in range(workers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0
    db = tuning_db.read(tuning_db.path_for(FP))
    buckets = db.buckets("bf16_d64_none_a16")
    assert len(buckets) == workers * count + 1
    assert all(buckets[f"bhnd_g1_bh{w}_q{i}_k1"][f"w{w}"].ms == 0.1 + i for w in range(workers) for i in range(count))
    assert {h: r.ms for h, r in buckets["shared"].items()} == {f"w{w}": float(w) for w in range(workers)}


def test_corrupt_file_is_set_aside():
    path = tuning_db.path_for(FP)
    path.parent.mkdir(parents=True)
    path.write_text('{"schema": 1, "kind": "gemmgen-tuning", "device": {"gpu"')
    with pytest.warns(GemmgenWarning, match="ignoring tuning database .*not valid JSON.*moved to"):
        db = tuning_db.load(path, FP)
    assert db.count() == 0 and not path.exists()
    assert len(list(path.parent.glob(f"{path.name}.corrupt-*"))) == 1
    tuning_db.update(FP, entries("b", "h1", 1.0))  # a fresh file replaces it
    assert tuning_db.read(path).count() == 1


@pytest.mark.parametrize("mutate, words", [
    (lambda d: d.update(schema=99), "schema 99"),
    (lambda d: d.update(kind="other"), "not a gemmgen tuning database"),
    (lambda d: d.update(entries=[]), "lacks its device"),
])
def test_invalid_files_are_corrupt(mutate, words):
    tuning_db.update(FP, {"k": {"b": {"h": rec("x", 1.0, 1.0)}}})
    path = tuning_db.path_for(FP)
    data = json.loads(path.read_text())
    mutate(data)
    path.write_text(json.dumps(data))
    with pytest.raises(TuningDatabaseError, match=words):
        tuning_db.read(path)
    with pytest.warns(GemmgenWarning, match=words):
        assert tuning_db.cached(FP).count() == 0
    assert not path.exists()


@pytest.mark.parametrize("field, value", [("ms", "fast"), ("reason", 5), ("name", 3), ("at", "now"),
                                          ("ms", -1.0), ("error", [1]), ("ms_short", True), ("shape", {})])
def test_records_of_the_wrong_type_are_left_out_and_reported(field, value):
    """A record that is valid JSON but not of the schema (a reason of 5 once crashed selection) is
    left out with a warning; the file's other records load, and the file stays where it is."""
    tuning_db.update(FP, {"k": {"b": {"h": rec("x", 1.0, 1.0), "good": rec("y", 2.0, 1.0)}}})
    path = tuning_db.path_for(FP)
    data = json.loads(path.read_text())
    data["entries"]["k"]["b"]["h"][field] = value
    path.write_text(json.dumps(data))
    with pytest.warns(GemmgenWarning, match=f"left out 1 malformed record.*{field}"):
        db = tuning_db.read(path)
    assert {h: r.name for h, r in db.buckets("k")["b"].items()} == {"good": "y"}
    with pytest.warns(GemmgenWarning, match="left out 1 malformed record"):
        assert tuning_db.cached(FP).count() == 1
    assert path.exists()
    tuning_db.update(FP, {"k": {"b2": {"h": rec("z", 1.0, 1.0)}}})  # the next write drops it for good
    assert tuning_db.read(path).count() == 2


def test_foreign_file_is_set_aside():
    tuning_db.update(A100, entries("b", "h1", 1.0))
    path = tuning_db.path_for(FP)
    os.replace(tuning_db.path_for(A100), path)  # copied into the H200's place
    with pytest.warns(GemmgenWarning, match=r"another GPU or version \(gpu 'NVIDIA A100-SXM4-80GB' != 'NVIDIA H200'"):
        assert tuning_db.load(path, FP).count() == 0
    assert len(list(path.parent.glob(f"{path.name}.foreign-*"))) == 1


def test_other_versions_get_their_own_file():
    newer = {**FP, "gemmgen_version": "0.2.0"}
    assert tuning_db.path_for(newer) != tuning_db.path_for(FP)
    assert tuning_db.path_for({**FP, "driver": "590.1"}) != tuning_db.path_for(FP)


def test_unwritable_cache_dir(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("GEMMGEN_CACHE_DIR", str(blocker / "cache"))
    with pytest.raises(CacheError, match="is not writable.*set GEMMGEN_CACHE_DIR"):
        tuning_db.update(FP, entries("b", "h1", 1.0))
    assert tuning_db.cached(FP).count() == 0  # reading never fails


def test_export_import_merges(tmp_path, monkeypatch):
    tuning_db.update(FP, entries("b1", "h1", 1.0, at=10.0))
    tuning_db.update(A100, entries("b1", "h1", 2.0))
    bundle = tmp_path / "team.json"
    assert tuning_db.export_bundle(tuning_db.database_files(), bundle) == 2
    monkeypatch.setenv("GEMMGEN_CACHE_DIR", str(tmp_path / "other-machine"))
    tuning_db.update(FP, entries("b1", "h1", 5.0, at=1.0))  # older than the imported one
    tuning_db.update(FP, entries("b2", "h9", 7.0))  # only here
    done = tuning_db.import_file(bundle)
    assert sorted(p.name for p, _ in done) == sorted(p.name for p in tuning_db.database_files())
    h200 = tuning_db.read(tuning_db.path_for(FP)).buckets("bf16_d64_none_a16")
    assert h200["b1"]["h1"].ms == 1.0 and h200["b2"]["h9"].ms == 7.0
    tuning_db.import_file(bundle)  # again: nothing duplicated
    assert tuning_db.read(tuning_db.path_for(FP)).count() == 2
    single = tmp_path / "single.json"
    single.write_text(tuning_db.path_for(A100).read_text())
    assert tuning_db.import_file(single) == [(tuning_db.path_for(A100), 1)]


def test_import_rejects_garbage(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(TuningDatabaseError, match="not a gemmgen tuning database"):
        tuning_db.import_file(bad)
    with pytest.raises(TuningDatabaseError, match="cannot read"):
        tuning_db.import_file(tmp_path / "missing.json")


def _corrupt_next_to_a_good_one():
    tuning_db.update(FP, entries("b", "h1", 1.0))
    good = tuning_db.path_for(FP)
    bad = good.with_name("NVIDIA_H100-sm90-000000000000.json")
    bad.write_text('{"schema": 1, "kind": "gemmgen-tuning", "dev')
    return good, bad


@pytest.mark.parametrize("args", [("tune", "show"), ("tune", "export", "{out}"),
                                  ("explain", "--shape", "1,2,64,64", "--cc", "9.0", "--sms", "132")])
def test_every_command_sets_a_corrupt_database_aside(args, tmp_path):
    """tune show, tune export and explain --cc read the databases as the library does: a file that
    is not one is reported and renamed aside, the others are used (export writes the good one)."""
    from conftest import run_cli

    good, bad = _corrupt_next_to_a_good_one()
    out = tmp_path / "bundle.json"
    proc = run_cli(*(a.format(out=out) for a in args), env={"GEMMGEN_CACHE_DIR": os.environ["GEMMGEN_CACHE_DIR"]})
    if args[0] == "explain":  # no instances are built here: the decision ends in the build command
        assert proc.returncode == 1 and "Build one with: gemmgen generate" in proc.stderr, proc.stderr
    else:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"ignoring tuning database {bad}: not valid JSON" in proc.stderr and "moved to" in proc.stderr
    assert "Traceback" not in proc.stderr and not bad.exists() and good.exists()
    assert len(list(bad.parent.glob(f"{bad.name}.corrupt-*"))) == 1
    if args[1] == "export":
        assert [db["device"]["gpu"] for db in json.loads(out.read_text())["databases"]] == ["NVIDIA H200"]
