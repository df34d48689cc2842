"""Autotune's parts that need no GPU: proxy problems, rotation plans, timing states, results and their
storage (the measuring itself: tests/test_measure.py)."""
from __future__ import annotations

import math

import pytest

from gemmgen.select import tuner, device, registry, selection, timing, tuning_db
from gemmgen.select.problem import Problem
from gemmgen.select.shapes import Shape

H200 = device.synthetic((9, 0), 132, "NVIDIA H200")
MB = 1024 * 1024


def test_proxy_keeps_the_functional_key():
    shape = Shape(8, 32, 4096, 4096, 128, causal=True, dtype="fp16", heads_kv=8, layout="bnhd")
    small = tuner.proxy_shape(shape)
    assert (small.head_dim, small.causal, small.dtype, small.layout) == (128, True, "fp16", "bnhd")
    assert small.heads // small.kv_heads == 4 and small.batch == 1
    assert small.seqlen_q == small.seqlen_k == tuner.PROXY_LEN
    odd = tuner.proxy_shape(Shape(1, 2, 1, 4096, 64))
    assert (odd.seqlen_q, odd.seqlen_k) == (1, tuner.PROXY_LEN_K)


def test_rotation_plan():
    assert timing.plan_copies(256 * MB, 60 * MB, 100_000 * MB) == (1, False)  # one copy outgrows L2
    assert timing.plan_copies(16 * MB, 60 * MB, 100_000 * MB) == (8, False)
    assert timing.plan_copies(64 * 1024, 60 * MB, 100_000 * MB) == (1, True)  # tiny: flush L2 instead
    assert timing.plan_copies(16 * MB, 60 * MB, 32 * MB) == (1, True)  # no memory for copies


def test_sustained_bursts_last_long_enough_unless_host_bound():
    assert timing.burst_calls(1.0, 10, 40.0) == 40  # 1 ms calls: a 40 ms burst
    assert timing.burst_calls(0.3, 10, 40.0) == 134
    assert timing.burst_calls(8.0, 10, 40.0) == 10  # never below the fixed count
    assert timing.burst_calls(0.01, 10, 40.0) == 10  # 10 us calls: the host path would be timed
    assert timing.burst_calls(1.0, 10, 0.0) == 10  # no minimum asked
    assert timing.burst_calls(math.inf, 10, 40.0) == 10  # a failing run


def test_sustained_rounds_skip_runs_that_cannot_win(monkeypatch):
    """After the settling pass, runs slower than `prune` x the fastest candidate keep that pass's
    time and are not re-timed; a `fixed` reference is always timed, and is not the yardstick."""
    per_call = {"a": 1.0, "b": 1.2, "slow": 2.0, "ref": 0.2}
    bursts = []

    def fake_burst(run, calls):
        bursts.append((run(), calls))
        return per_call[run()]

    monkeypatch.setattr(timing, "burst_ms", fake_burst)
    runs = {name: (lambda name=name: name) for name in per_call}
    got = timing.sustained_ms(runs, rounds=2, settle_s=0, min_burst_ms=40, prune=1.3, fixed=("ref",))
    assert got == per_call
    rounds = bursts[len(per_call):]  # after one settling pass of every run
    assert [name for name, _ in rounds] == ["a", "b", "ref", "ref", "b", "a"]  # forward, then backward
    assert dict(rounds) == {"a": 40, "b": 34, "ref": 200}  # bursts of >= 40 ms


def test_steady_times_each_run_alone_over_the_last_window(monkeypatch):
    """steady_ms: each run has a turn of `seconds` to itself, turns in the order A B B A; a turn's
    time is the median burst that started in its last `window_s` (the bursts before the clock
    settles are left out), and a run's result the median of its turns."""
    t = [0.0]
    bursts = []

    def fake_burst(run, calls):
        name = run()
        bursts.append((name, calls))
        t[0] += 0.125  # every burst lasts 1/8 s of the fake clock
        # a turn (from its 10-call estimate on) slows down burst by burst: 1.0, 1.1, 1.2, ...
        k = len(bursts) - 1 - max(i for i, (_, c) in enumerate(bursts) if c == 10)
        return {"a": 1.0, "b": 2.0}[name] * (1.0 + 0.1 * k)

    monkeypatch.setattr(timing, "burst_ms", fake_burst)
    runs = {name: (lambda name=name: name) for name in ("a", "b")}
    got = timing.steady_ms(runs, seconds=1.0, window_s=0.4, rounds=2, min_burst_ms=40, clock=lambda: t[0])
    # 8 timed bursts per turn (1.1 ... 1.8); those that started in its last 0.4 s: 1.6, 1.7, 1.8
    assert got == pytest.approx({"a": 1.7, "b": 3.4})
    turns = [name for name, calls in bursts if calls == 10]  # each turn starts with a 10-call estimate
    assert turns == ["a", "b", "b", "a"]
    assert {name: calls for name, calls in bursts if calls != 10} == {"a": 40, "b": 20}  # >= 40 ms bursts


def test_results_are_stored_and_failures_never_win(tmp_path):
    problem = Problem("bf16", 64, False, H200, batch_heads=64, seqlen_q=512, seqlen_k=512)
    result = tuner.TuneResult(Shape(2, 32, 512, 512, 64), problem, [
        tuner.Measurement("fast_but_wrong", "h1", math.inf, f"{selection.WRONG_RESULT}: relative error 1e+00"),
        tuner.Measurement("ok", "h2", 0.5, None, 1e-4),
        tuner.Measurement("crashed", "h3", math.inf, "failed to run: illegal address")])
    assert result.winner.name == "ok"
    path = tuner.store(result)
    recs = tuning_db.read(path).buckets("bf16_d64_none_a16")["bhnd_g1_bh64_q512_k512"]
    assert recs["h1"].ms == math.inf and recs["h1"].reason.startswith("wrong result")
    assert recs["h2"].ms == 0.5 and recs["h2"].shape == "2,32,32,512,512,64"


def test_unwritable_cache_keeps_results_in_memory(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("GEMMGEN_CACHE_DIR", str(blocker / "cache"))
    problem = Problem("bf16", 64, False, H200, batch_heads=64, seqlen_q=512, seqlen_k=512)
    result = tuner.TuneResult(Shape(2, 32, 512, 512, 64), problem, [tuner.Measurement("ok", "h2", 0.5)])
    import pytest

    with pytest.warns(UserWarning, match="tuning results not stored"):
        assert tuner.store(result, strict=False) is None
    assert tuning_db.cached(H200.fingerprint()).count() == 1
    registry.refresh()


def test_autotune_is_the_function_after_its_module_is_imported():
    import gemmgen
    from gemmgen.select import tuner  # noqa: F401  (importing a submodule sets an attribute on a package)
    assert callable(gemmgen.autotune) and gemmgen.autotune is tuner.autotune
