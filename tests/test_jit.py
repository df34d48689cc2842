"""Compiling on demand: one build for N processes (a fake nvcc stands in for the compile), a killed
build leaves nothing loadable, GEMMGEN_JIT=0 and a missing nvcc give the command to run."""
from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time

import pytest

from conftest import ROOT, fake_nvcc
from gemmgen.select import device, jit, registry
from gemmgen.errors import NoInstanceError
from gemmgen.select.problem import Problem

NAME = "fa2_sm80_fp16_d32_none_m128n128w4s1"  # the default instance for fp16, d32, no mask
# Stands in for nvcc: logs each compile, sleeps $FAKE_NVCC_SLEEP s, writes the depfile and a library.
FAKE_NVCC = fake_nvcc("""echo "$src" >> "$FAKE_NVCC_LOG"
sleep "${FAKE_NVCC_SLEEP:-0}"
echo "$target: $src" > "$dep"
: > "$out"
""")
BUILD = ("from gemmgen.select import device, jit; from gemmgen.select.problem import Problem; "
         "print(jit.ensure_built(Problem('fp16', 32, False, device.synthetic((9, 0), 132))))")


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A fake nvcc, an empty build directory and a shared cache directory, here and for children."""
    nvcc = tmp_path / "nvcc"
    nvcc.write_text(FAKE_NVCC)
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IXUSR)
    (tmp_path / "build").mkdir()
    values = {"GEMMGEN_NVCC": str(nvcc), "GEMMGEN_CACHE_DIR": str(tmp_path / "cache"),
              "GEMMGEN_BUILD_DIR": str(tmp_path / "build"), "FAKE_NVCC_LOG": str(tmp_path / "compiles.log"),
              "PYTHONPATH": str(ROOT)}
    for key, value in values.items():
        monkeypatch.setenv(key, value)
    registry.set_build_dirs(None)
    yield tmp_path
    registry.refresh()


def problem() -> Problem:
    return Problem("fp16", 32, False, device.synthetic((9, 0), 132))


def compiles(tmp_path) -> list[str]:
    log = tmp_path / "compiles.log"
    return log.read_text().splitlines() if log.exists() else []


def test_n_processes_build_once(env):
    procs = [subprocess.Popen([sys.executable, "-c", BUILD], cwd=ROOT, env={**os.environ, "FAKE_NVCC_SLEEP": "3"},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    assert [out.strip() for out, _ in outs] == [NAME] * 3
    assert len(compiles(env)) == 1
    errs = "".join(err for _, err in outs)
    assert errs.count(f"gemmgen: compiling {NAME}") == 1 and "waiting for another process" in errs
    assert [c.name for c in registry.candidates(problem())[0]] == [NAME]  # found in <cache>/jit


def test_killed_build_leaves_nothing_loadable(env):
    proc = subprocess.Popen([sys.executable, "-c", BUILD], cwd=ROOT, env={**os.environ, "FAKE_NVCC_SLEEP": "60"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not compiles(env) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert compiles(env), "the fake nvcc never started"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the process, its ninja and the fake nvcc
        proc.wait(timeout=60)
    folder = env / "cache" / "jit" / "sm80"
    assert not (folder / "lib" / f"{NAME}.so").exists()
    assert not jit.is_built(folder, NAME)
    assert registry.candidates(problem())[0] == []
    assert jit.ensure_built(problem()) == NAME  # the next process builds it
    assert len(compiles(env)) == 2 and jit.is_built(folder, NAME)


def test_select_or_build(env):
    cand = jit.select_or_build(problem())
    assert cand.name == NAME and cand.build_dir == env / "cache" / "jit" / "sm80"
    assert jit.select_or_build(problem()) is cand  # built once, then selected
    assert len(compiles(env)) == 1


def test_jit_off_gives_the_command(env, monkeypatch):
    monkeypatch.setenv("GEMMGEN_JIT", "0")
    assert not jit.enabled()
    with pytest.raises(NoInstanceError) as info:
        jit.select_or_build(problem())
    text = str(info.value)
    assert f"Build one with: gemmgen generate --arch sm80 --out {env / 'build'} --filter {NAME}" in text
    assert "Compiling on demand is off (GEMMGEN_JIT=0)" in text
    assert compiles(env) == []


def test_no_nvcc_gives_the_command(env, monkeypatch):
    monkeypatch.setenv("GEMMGEN_NVCC", "/nonexistent")
    with pytest.raises(NoInstanceError) as info:
        jit.select_or_build(problem())
    assert "Build one with: gemmgen generate" in str(info.value)
    assert "Cannot compile it on demand: GEMMGEN_NVCC=/nonexistent is not an executable" in str(info.value)


def test_no_family_no_build(env):
    with pytest.raises(NoInstanceError, match="No gemmgen family supports"):
        jit.select_or_build(Problem("fp16", 32, False, device.synthetic((7, 5), 40)))
