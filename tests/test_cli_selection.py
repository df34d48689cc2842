"""`gemmgen explain`, `profile` and `tune` on the command line: parsing, output and errors."""
from __future__ import annotations

import importlib.util
import json
import time

import pytest
import torch

from conftest import make_entry, run_cli, write_build_dir
from gemmgen.select import device, tuning_db
from gemmgen.generator.families.fa2_sm80 import DType, Fa2Sm80Instance, Mask

DEFAULT = Fa2Sm80Instance(DType.BF16, 128, Mask.NONE, 128, 64, 4)
TWO_STAGE = Fa2Sm80Instance(DType.BF16, 128, Mask.NONE, 128, 64, 4, 2)
OTHER = Fa2Sm80Instance(DType.FP16, 64, Mask.CAUSAL, 128, 64, 4)
H200 = ["--cc", "9.0", "--sms", "132", "--gpu", "NVIDIA H200"]
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")


@pytest.fixture
def build(tmp_path):
    return write_build_dir(tmp_path / "build", [make_entry(i) for i in (DEFAULT, TWO_STAGE, OTHER)])


def cli(*args, cache=None):
    env = {"GEMMGEN_CACHE_DIR": str(cache)} if cache else {}
    return run_cli(*args, env=env, timeout=300)


def test_explain_heuristic(build, tmp_path):
    proc = cli("explain", "--shape", "16,16,4096,4096,128", "--build-dir", str(build), *H200, cache=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "problem: bf16 head_dim=128 no mask on sm_90, B*H=256 Nq=4096 Nk=4096, layout bhnd" in out
    assert "bucket: bhnd_g1_bh256_q4096_k4096" in out
    assert f"* {DEFAULT.name}" in out and f"  {TWO_STAGE.name}" in out
    assert f"{OTHER.name} ({build / 'sm80'}): dtype fp16, the problem is bf16" in out
    assert f"winner: {DEFAULT.name}" in out and "decided by: heuristic" in out


def test_explain_uses_an_imported_database(build, tmp_path):
    facts = device.synthetic((9, 0), 132, "NVIDIA H200")
    fp = {**facts.fingerprint(), "driver": "580.65.06", "cuda": "13.0"}  # made on the GPU machine
    recs = {i.content_hash(): tuning_db.Record(i.name, ms, at=time.time()).to_json()
            for i, ms in ((DEFAULT, 2.0), (TWO_STAGE, 1.5))}
    bundle = tmp_path / "team.json"
    bundle.write_text(json.dumps({"schema": 1, "kind": "gemmgen-tuning-bundle", "databases": [
        {"schema": 1, "kind": "gemmgen-tuning", "device": fp,
         "entries": {"bf16_d128_none_a16": {"bhnd_g1_bh256_q4096_k4096": recs}}}]}))
    cache = tmp_path / "cache"
    proc = cli("tune", "import", str(bundle), cache=cache)
    assert proc.returncode == 0 and "merged 2 records into" in proc.stdout, proc.stderr
    shape = ("--shape", "16,16,4000,4096,128", "--build-dir", str(build), *H200)
    proc = cli("explain", *shape, cache=cache)
    assert proc.returncode == 0, proc.stderr
    assert f"* {TWO_STAGE.name}  [1.5000 ms]" in proc.stdout
    assert "decided by: tuned bucket bhnd_g1_bh256_q4096_k4096 (2 of 2 candidates measured)" in proc.stdout
    proc = cli("explain", "--shape", "16,16,2048,2048,128", "--build-dir", str(build), *H200, cache=cache)
    assert "decided by: nearest tuned bucket bhnd_g1_bh256_q4096_k4096, 2 doublings away" in proc.stdout
    shown = cli("tune", "show", "-v", cache=cache)
    assert "NVIDIA H200 sm 9.0, driver 580.65.06" in shown.stdout and f"best {TWO_STAGE.name}" in shown.stdout
    out = tmp_path / "export.json"
    assert cli("tune", "export", str(out), "--gpu", "h200", cache=cache).returncode == 0
    assert json.loads(out.read_text())["databases"][0]["device"] == fp


@pytest.mark.parametrize("args, words", [
    (("--shape", "16,16,4096"), "malformed shape '16,16,4096': expected B,H,N,d or B,H,Nq,Nk,d"),
    (("--shape", "a,b,c,d"), "malformed shape"),
    (("--shape", "2,16,64,0"), "head dim 0 in shape '2,16,64,0': it must be positive"),
    (("--shape", "2,16,64,64", "--heads-kv", "3"), "heads_kv 3 must divide heads 16"),
    (("--shape", "2,16,64,64", "--instance", "nope"), "no instance named 'nope'"),
    (("--shape", "2,16,64,64", "--cc", "9", "--sms", "132"), "malformed --cc '9'"),
    (("--shape", "2,16,64,64", "--cc", "9.0"), "--cc needs --sms N"),
])
def test_explain_usage_errors(build, tmp_path, args, words):
    extra = () if "--cc" in args else H200
    proc = cli("explain", *args, *extra, "--build-dir", str(build), cache=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert words in proc.stderr and "Traceback" not in proc.stderr


def test_explain_no_candidate_gives_the_command(build, tmp_path):
    proc = cli("explain", "--shape", "2,16,64,64,32", "--dtype", "fp16", *H200, "--build-dir", str(build),
               cache=tmp_path)
    assert proc.returncode == 1
    assert "No gemmgen instance can run fp16 head_dim=32 no mask on sm_90" in proc.stderr
    assert "Build one with: gemmgen generate --arch sm80" in proc.stderr


@NO_GPU
def test_explain_without_gpu_needs_cc(build, tmp_path):
    proc = cli("explain", "--shape", "2,16,64,64", "--build-dir", str(build), cache=tmp_path)
    assert proc.returncode == 1 and "no CUDA GPU visible" in proc.stderr and "--cc X.Y --sms N" in proc.stderr


@pytest.mark.parametrize("args, words", [
    (("--arch", "sm80", "--shapes", "1,2,3"), "malformed shape '1,2,3'"),
    (("--arch", "sm80", "--shapes", "1,2,64,64,causal,x"), "malformed shape"),
    (("--arch", "sm80"), "give either --shapes"),
    (("--arch", "sm80", "--shapes", "1,2,64,64", "--sweep", "fa"), "give either --shapes"),
    (("--arch", "sm75", "--shapes", "1,2,64,64"), "unknown arch 'sm75'"),
    (("--arch", "sm80", "--shapes", "1,2,64,64", "--instance", "nope"), "unknown instance name(s): nope"),
])
def test_profile_usage_errors(build, tmp_path, args, words):
    proc = cli("profile", *args, "--build-dir", str(build), cache=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert words in proc.stderr and "Traceback" not in proc.stderr


def test_unwritable_cache_dir(build, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = cli("profile", "--arch", "sm80", "--shapes", "1,2,64,64", "--build-dir", str(build), cache=blocker / "c")
    assert proc.returncode == 1 and "is not writable" in proc.stderr and "GEMMGEN_CACHE_DIR" in proc.stderr
    bundle = tmp_path / "b.json"
    bundle.write_text(json.dumps({"schema": 1, "kind": "gemmgen-tuning", "device": {"gpu": "x", "cc": "9.0"},
                                  "entries": {}}))
    proc = cli("tune", "import", str(bundle), cache=blocker / "c")
    assert proc.returncode == 1 and "is not writable" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is not None, reason="matplotlib is installed")
def test_profile_plot_without_matplotlib(build, tmp_path):
    proc = cli("profile", "--arch", "sm80", "--shapes", "1,2,64,64", "--plot", str(tmp_path / "p.png"),
               "--build-dir", str(build), cache=tmp_path)
    assert proc.returncode == 2 and "--plot needs matplotlib" in proc.stderr and "gemmgen[plot]" in proc.stderr


@NO_GPU
def test_profile_without_gpu(build, tmp_path):
    proc = cli("profile", "--arch", "sm80", "--sweep", "fa", "--build-dir", str(build), cache=tmp_path)
    assert proc.returncode == 1 and "needs a CUDA GPU" in proc.stderr and "Traceback" not in proc.stderr


def test_tune_commands_errors(tmp_path):
    proc = cli("tune", "export", str(tmp_path / "x.json"), cache=tmp_path)
    assert proc.returncode == 2 and "no tuning databases" in proc.stderr
    bad = tmp_path / "bad.json"
    bad.write_text("{oops")
    proc = cli("tune", "import", str(bad), cache=tmp_path)
    assert proc.returncode == 1 and "not valid JSON" in proc.stderr
    assert cli("tune", "show", cache=tmp_path).stdout.startswith("no tuning databases")
    assert f"cache directory: {tmp_path}" in cli("tune", "path", cache=tmp_path).stdout
    assert cli("tune").returncode == 2


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed")
def test_plot_draws_a_png(tmp_path):
    import math

    from gemmgen.select import tuner
    from gemmgen.cli import plot
    from gemmgen.select.problem import Problem
    from gemmgen.select.shapes import Shape

    shape = Shape(2, 16, 1024, 1024, 128)
    result = tuner.TuneResult(shape, Problem("bf16", 128, False, device.synthetic((9, 0), 132)), [
        tuner.Measurement("a", "h1", 0.5), tuner.Measurement("b", "h2", 0.6),
        tuner.Measurement("c", "h3", math.inf, "failed to run: x")])
    plot.draw([(shape, result, {"flash": (0.45, None), "efficient": (0.9, None), "cudnn": (math.inf, "no")})],
              str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_explain_and_profile_take_op_gemm():
    """`explain --op gemm` is `explain-gemm` (the old name stays); `profile --op gemm` is
    `profile-gemm`; without --op (or with --op attention) the attention forms run."""
    from gemmgen.cli.app import route_op

    assert route_op(["explain", "--op", "gemm", "--m", "64"]) == ["explain-gemm", "--m", "64"]
    assert route_op(["profile", "--m", "64", "--op=gemm"]) == ["profile-gemm", "--m", "64"]
    assert route_op(["explain", "--shape", "1,2,64,64", "--op", "attention"]) == \
        ["explain", "--shape", "1,2,64,64", "--op", "attention"]
    assert route_op(["tune", "--op", "gemm"]) == ["tune", "--op", "gemm"]
    shape = ("--cc", "9.0", "--sms", "132", "--m", "256", "--n", "128", "--k", "64", "--b-transposed")
    new, old = run_cli("explain", "--op", "gemm", *shape), run_cli("explain-gemm", *shape)
    assert (new.returncode, new.stdout, new.stderr) == (old.returncode, old.stdout, old.stderr)
    assert "batched GEMM A*B^T" in new.stdout + new.stderr


def test_explain_sends_decode_shapes_to_the_decode_family(tmp_path):
    """With a causal prefill tile and the decode family's default tiles built, one query row against a
    long cache (bottom-right) goes to the 16-row decode tile, a chunk of 1024 rows to the prefill
    tile; top-left, the one row sees one key and the prefill tile wins."""
    from gemmgen.generator.families import decode_sm80

    causal = Fa2Sm80Instance(DType.BF16, 128, Mask.CAUSAL, 128, 64, 4)
    decode = [i for i in decode_sm80.DEFAULT if i.dtype is DType.BF16 and i.head_dim == 128]
    build = write_build_dir(tmp_path / "build", [make_entry(i) for i in (causal, *decode)])
    small = next(i for i in decode if i.block_m == 16)

    def winner(shape, *extra):
        proc = cli("explain", "--shape", shape, "--heads-kv", "8", "--causal", *extra, "--build-dir", str(build),
                   *H200, cache=tmp_path)
        assert proc.returncode == 0, proc.stderr
        return next(line.split()[1] for line in proc.stdout.splitlines() if line.startswith("winner:"))

    assert winner("4,32,1,65536,128", "--causal-alignment", "bottom_right") == small.name
    assert winner("1,32,1024,8192,128", "--causal-alignment", "bottom_right") == causal.name
    assert winner("4,32,1,65536,128") == causal.name


def test_explain_a_key_value_cache_call(tmp_path):
    """--kv-cache: only the decode family runs it; the report ends with the split count the launch
    passes, which for a paged cache follows its own rule (heuristic.num_splits, paged=True)."""
    from gemmgen.generator.families import decode_sm80
    from gemmgen.select import heuristic

    causal = Fa2Sm80Instance(DType.BF16, 128, Mask.CAUSAL, 128, 64, 4)
    decode = [i for i in decode_sm80.DEFAULT if i.dtype is DType.BF16 and i.head_dim == 128]
    build = write_build_dir(tmp_path / "build", [make_entry(i) for i in (causal, *decode)])
    small = next(i for i in decode if i.block_m == 16)

    def report(*extra):
        proc = cli("explain", "--shape", "32,32,1,8192,128", "--heads-kv", "8", "--causal", *extra,
                   "--build-dir", str(build), "--cc", "9.0", "--sms", "132", "--gpu", "NVIDIA H100", cache=tmp_path)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    for paged in (False, True):
        out = report("--kv-cache", *(["--paged"] if paged else []))
        assert next(line.split()[1] for line in out.splitlines() if line.startswith("winner:")) == small.name
        assert f"{causal.name} (" in out and "has no kv cache" in out  # rejected: a prefill family
        splits = heuristic.num_splits(256, 128, heuristic.ctas_per_sm(
            small.cost_inputs.smem_bytes, small.cost_inputs.threads, _problem_h100(), small.cost_inputs.regs_per_thread),
            132, paged=paged)
        assert (splits, paged) in ((1, False), (3, True))
        cache = "a paged cache" if paged else "a contiguous cache"
        assert f"launch: {splits} key split(s) per row tile (1 row tile(s) per KV head, 256 KV heads), {cache}" in out
    for bad, words in ((["--paged"], "add --kv-cache"), (["--kv-cache", "--backward"], "drop --backward"),
                       (["--kv-cache", "--causal-alignment", "top_left"], "bottom-right"),
                       (["--kv-cache", "--layout", "bhnd"], "drop --layout")):
        proc = cli("explain", "--shape", "32,32,1,8192,128", "--heads-kv", "8", *bad, "--build-dir", str(build),
                   "--cc", "9.0", "--sms", "132", cache=tmp_path)
        assert proc.returncode != 0 and words in proc.stderr, (bad, proc.stderr)


def _problem_h100():
    from gemmgen.select.problem import Problem

    return Problem(dtype="bf16", head_dim=128, causal=True, device=device.synthetic((9, 0), 132, "NVIDIA H100"))

