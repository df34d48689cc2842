"""Autotune's parts that need no GPU: proxy problems, rotation plans, results and their storage."""
from __future__ import annotations

import math

import pytest

from gemmgen.select import tuner, device, registry, selection, timing, tuning_db
from gemmgen.errors import GemmgenWarning
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


def test_gemm_tuning_times_both_states_and_picks_the_best_in_both(monkeypatch):
    """measure.measure_states: sustained times for all, short-run times (two passes, alternating order)
    for the candidates within TUNE_PRUNE of the fastest; gemm_select.tuned_costs then prefers the
    candidate near the best in both states over the best in one. Calls this short (10 us) never
    hold the GPU at its power cap, so no candidate is timed alone."""
    from types import SimpleNamespace

    from gemmgen.select import measure
    from gemmgen.select import gemm_select

    sustained = {"fast_hot": 0.0100, "even": 0.0103, "fast_cool": 0.0125, "slow": 0.0200}
    short = {"fast_hot": 0.0095, "even": 0.0082, "fast_cool": 0.0080}
    monkeypatch.setattr(timing, "sustained_ms", lambda runs, **kw: {name: sustained[name] for name in runs})
    monkeypatch.setattr(timing, "steady_ms", lambda runs, **kw: pytest.fail("short calls timed alone"))
    order = []

    def fake_median(run, copies, **kw):
        name = run(0)
        order.append(name)
        return short[name]

    monkeypatch.setattr(timing, "median_ms", fake_median)
    cands = [SimpleNamespace(name=n, content_hash=f"h_{n}") for n in [*sustained, "broken"]]

    def call(name):
        if name == "broken":
            raise RuntimeError("cannot run this shape\nmore")
        return name

    rows, records, _ = measure.measure_states(cands, call, reps=20, shape="s")
    assert order == ["fast_hot", "even", "fast_cool", "fast_cool", "even", "fast_hot"]  # not "slow"
    got = {name: (ms, ms_short, ms_alone) for name, ms, ms_short, ms_alone, _ in rows}
    assert got == {"fast_hot": (0.01, 0.0095, None), "even": (0.0103, 0.0082, None),
                   "fast_cool": (0.0125, 0.008, None), "slow": (0.02, None, None), "broken": (math.inf, None, None)}
    assert records["h_broken"].reason == "cannot run this shape" and records["h_even"].ms_short == 0.0082
    costs = gemm_select.tuned_costs({r.name: r for r in records.values()})
    assert "broken" not in costs and math.isclose(costs["slow"], 2.0)
    assert math.isclose(costs["fast_hot"], 0.95 / 0.8) and math.isclose(costs["even"], 1.03)
    assert min(costs, key=costs.get) == "even"  # 1.03 and 1.025 of the best, not 1.0 and 1.19


def test_gemm_tuning_times_the_finalists_of_long_calls_alone(monkeypatch):
    """On calls long enough to hold the GPU at its power cap, the TUNE_FINALISTS candidates of
    lowest cost in both states are each timed alone under load (timing.steady_ms), and their load
    ratio is then taken among those times: here the rotation's fastest is the slowest alone and
    loses to the second."""
    from types import SimpleNamespace

    from gemmgen.select import measure
    from gemmgen.select import gemm_select, tuning_db

    sustained = {"a": 1.00, "b": 1.02, "c": 1.05, "d": 1.10, "slow": 2.0}
    alone = {"a": 1.12, "b": 1.00, "c": 1.03}
    monkeypatch.setattr(timing, "sustained_ms", lambda runs, **kw: {name: sustained[name] for name in runs})
    monkeypatch.setattr(timing, "median_ms", lambda run, copies, **kw: 1.0)  # a tie over short runs
    asked = []

    def fake_steady(runs, **kw):
        asked.append((sorted(runs), kw["seconds"]))
        return {name: alone[name] for name in runs}

    monkeypatch.setattr(timing, "steady_ms", fake_steady)
    cands = [SimpleNamespace(name=n, content_hash=f"h_{n}") for n in sustained]
    rows, records, _ = measure.measure_states(cands, lambda name: name, reps=20, shape="s")
    assert asked == [(["a", "b", "c"], measure.TUNE_ALONE_S)]
    assert {name: ms_alone for name, _, _, ms_alone, _ in rows} == {**alone, "d": None, "slow": None}
    assert tuning_db.Record.from_json(records["h_b"].to_json()).ms_alone == 1.0  # stored and read back
    costs = gemm_select.tuned_costs({r.name: r for r in records.values()})
    assert math.isclose(costs["a"], 1.12) and costs["b"] == 1.0 and math.isclose(costs["d"], 1.1)
    assert min(costs, key=costs.get) == "b"


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


def test_contenders_retimed_in_rotating_rounds():
    """Candidates within CONTEND_MARGIN of the fastest are timed again, each round starting with
    the next one; each keeps the median of its times; the others and failures are left alone."""
    calls = []
    later = {"a": [1.10, 1.10, 1.10], "b": [1.00, 1.00, 1.00]}

    def timer(name):
        def run():
            calls.append(name)
            return later[name].pop(0)
        return run

    result = [tuner.Measurement("a", "h1", 1.00), tuner.Measurement("b", "h2", 1.02),
              tuner.Measurement("slow", "h3", 2.00), tuner.Measurement("bad", "h4", math.inf, "wrong")]
    tuner._contend(result, [timer("a"), timer("b"), lambda: pytest.fail("not a contender"), None], None)
    assert calls == ["a", "b", "b", "a", "a", "b"]
    assert [m.ms for m in result[:3]] == [1.10, 1.00, 2.00]
    assert not result[3].ok
    # A single candidate close to the best is not re-timed.
    alone = [tuner.Measurement("a", "h1", 1.0), tuner.Measurement("slow", "h3", 2.0)]
    tuner._contend(alone, [lambda: pytest.fail("re-timed"), None], None)
    # A failure while re-timing (a broken CUDA context) keeps the first pass's times.
    def broken():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    kept = [tuner.Measurement("a", "h1", 1.0), tuner.Measurement("b", "h2", 1.01)]
    with pytest.warns(GemmgenWarning, match="first-pass times kept"):
        tuner._contend(kept, [broken, broken], None)
    assert [m.ms for m in kept] == [1.0, 1.01]
