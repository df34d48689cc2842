"""Manifest schema: round trip and clear errors on bad files."""
from __future__ import annotations

import dataclasses
import json

import pytest

from gemmgen.kernels import abi
from gemmgen.generator import manifest
from gemmgen.errors import GemmgenError, ManifestError


def sample() -> manifest.Manifest:
    entry = manifest.InstanceEntry(
        name="fa2_sm80_fp16_d64_none_m128n128w4s1", family="fa2_sm80",
        params={"dtype": "fp16", "head_dim": 64, "mask": "none", "block_m": 128, "block_n": 128, "warps": 4},
        arch="sm80", gencode=["-gencode=arch=compute_80,code=sm_80"],
        library="lib/fa2_sm80_fp16_d64_none_m128n128w4s1.so", symbol="gemmgen_fa2_sm80_fp16_d64_none_m128n128w4s1",
        smem_bytes=49152, threads=128, content_hash="0123456789abcdef", state="built")
    failed = manifest.InstanceEntry(**{**entry.__dict__, "name": "x", "library": "lib/x.so", "state": "failed",
                                       "error": "boom"})
    return manifest.Manifest(gemmgen_version="0.1.0", arch="sm80", nvcc_version="13.0.88",
                             cutlass_version="4.2.0", flags=["-O3"], instances=[entry, failed])


def test_roundtrip(tmp_path):
    path = tmp_path / "sm80" / "manifest.json"
    manifest.write(path, sample())
    data = json.loads(path.read_text())
    assert list(data) == ["schema", "gemmgen_version", "arch", "abi_version", "nvcc_version",
                          "cutlass_version", "flags", "created", "instances"]
    assert data["schema"] == 1 and data["abi_version"] == abi.ABI_VERSION
    assert manifest.load(path) == dataclasses.replace(sample(), created=data["created"])
    assert [p.name for p in path.parent.iterdir()] == ["manifest.json"]  # no temporary file left


@pytest.mark.parametrize("mutate, words", [
    (lambda d: d.pop("arch"), "lacks the field 'arch'"),
    (lambda d: d.update(schema=2), "schema 2"),
    (lambda d: d.update(abi_version=7), "ABI version 7"),
    (lambda d: d.update(instances={}), "'instances' has the wrong type"),
])
def test_bad_manifest(tmp_path, mutate, words):
    path = tmp_path / "manifest.json"
    data = sample().to_json()
    mutate(data)
    path.write_text(json.dumps(data))
    with pytest.raises(ManifestError, match=words.replace("(", r"\(")) as info:
        manifest.load(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("mutate, words", [
    (lambda e: e.update(state="half"), "state 'half'"),
    (lambda e: e.update(smem_bytes="big"), "'smem_bytes' has the wrong type"),
    (lambda e: e.pop("symbol"), "lacks the field 'symbol'"),
    (lambda e: e.update(library="../../elsewhere/evil.so"), "library '../../elsewhere/evil.so'"),
    (lambda e: e.update(library="/tmp/x.so"), "library '/tmp/x.so'"),
    (lambda e: e.update(name="a b"), "not an identifier"),
    (lambda e: e.update(threads=0), "out of range"),
    (lambda e: e.update(params={"dtype": {"nested": 1}}), "params that are not plain values"),
])
def test_bad_entries_are_left_out_and_reported(tmp_path, mutate, words):
    """An entry that does not fit the schema is left out (named in `dropped`); the others load."""
    path = tmp_path / "manifest.json"
    data = sample().to_json()
    mutate(data["instances"][0])
    path.write_text(json.dumps(data))
    loaded = manifest.load(path)
    assert [e.name for e in loaded.instances] == ["x"]
    assert len(loaded.dropped) == 1 and words in loaded.dropped[0] and "instance #0" in loaded.dropped[0]


def test_unreadable_manifest(tmp_path):
    path = tmp_path / "manifest.json"
    path.write_text("{not json")
    with pytest.raises(ManifestError, match="not a readable JSON manifest"):
        manifest.load(path)
    path.write_text("[]")
    with pytest.raises(ManifestError, match="not a JSON object"):
        manifest.load(path)
    with pytest.raises(GemmgenError, match="no such manifest"):
        manifest.load(tmp_path / "missing.json")
