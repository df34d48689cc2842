"""The one measure (gemmgen.select.measure.measure) without a GPU: fake workloads and fake timings
show the gate, the order of the rounds, the records and the peers, and that the attention tuner and
`gemmgen profile` for every kind go through it."""
from __future__ import annotations

import contextlib
import csv
import math
from types import SimpleNamespace

import pytest
import torch

from gemmgen.errors import GemmgenWarning
from gemmgen.select import device, gemm_select, measure, registry, timing, tuner, tuning_db
from gemmgen.select.shapes import Shape

H100 = device.synthetic((9, 0), 132, "NVIDIA H100")


def cands(*names: str) -> list:
    return [SimpleNamespace(name=n, content_hash=f"h_{n}", entry=SimpleNamespace(arch="sm80")) for n in names]


class FakeWorkload:
    """Runs return their candidate's name (the fake timings read it); `wrong` fail the check,
    `unloadable` fail to load."""

    label, flops, problem, copies, flush = "fake", 2e9, None, 2, None

    def __init__(self, wrong=(), unloadable=(), peers=None):
        self.wrong, self.unloadable = set(wrong), set(unloadable)
        self.peers = peers or {}
        self.checked = []

    def prepare(self, cand):
        if cand.name in self.unloadable:
            raise OSError(f"cannot load {cand.name}.so\nmore detail")

        def run(i, name=cand.name):
            return name
        self.checked.append(run(0))
        if cand.name in self.wrong:
            raise measure.WrongResult("wrong result: relative error 1e+00")
        return run, 1e-4


def fake_median(monkeypatch, times: dict):
    """timing.median_ms answering from `times` (name -> a number, or a list popped per timing)."""
    asked = []

    def median(run, copies, **kw):
        name = run(0)
        asked.append((name, copies, kw))
        t = times[name].pop(0) if isinstance(times[name], list) else times[name]
        if isinstance(t, Exception):
            raise t
        return t

    monkeypatch.setattr(timing, "median_ms", median)
    return asked


def test_the_gate_keeps_failures_as_infinite_times_with_their_reasons(monkeypatch):
    """A wrong result and a candidate that cannot load get inf and their reasons and are never
    timed; the others keep the order given, their check's error and their records; a peer that
    cannot run is 'not run' with its reason; a peer's scope is entered around each of its timings."""
    scopes = []

    @contextlib.contextmanager
    def scope():
        scopes.append("in")
        yield

    def unsupported(_i):
        raise RuntimeError("No available kernel. Aborting execution.\ndetails")

    peers = {"ref": measure.Peer(lambda i: "ref", scope), "other": measure.Peer(unsupported)}
    work = FakeWorkload(wrong={"wrong"}, unloadable={"unloadable"}, peers=peers)
    asked = fake_median(monkeypatch, {"a": 1.0, "b": 2.0, "ref": 0.5})
    got = measure.measure(cands("a", "wrong", "unloadable", "b"), work, measure.Policy(reps=7, warmup=2))
    assert [m.name for m in got.measurements] == ["a", "wrong", "unloadable", "b"]
    by = {m.name: m for m in got.measurements}
    assert by["wrong"].ms == math.inf and by["wrong"].reason == "wrong result: relative error 1e+00"
    assert by["unloadable"].ms == math.inf and by["unloadable"].reason == "failed to run: cannot load unloadable.so"
    assert (by["a"].ms, by["a"].error, by["b"].ms) == (1.0, 1e-4, 2.0)
    assert got.winner.name == "a" and got.tflops(1.0) == 2.0
    assert work.checked == ["a", "wrong", "b"]  # one real-size call each in the gate
    assert {name for name, _, _ in asked} == {"a", "b", "ref"}  # no failed candidate timed
    assert all(copies == 2 and kw["reps"] == 7 and kw["warmup"] == 2 for _, copies, kw in asked)
    assert got.peers["ref"].ms == 0.5 and got.peers["other"].reason == "No available kernel. Aborting execution."
    assert len(scopes) == 1 + sum(name == "ref" for name, _, _ in asked)  # the gate's call, then each timing
    recs = got.records
    assert set(recs) == {"h_a", "h_wrong", "h_unloadable", "h_b"}
    assert recs["h_wrong"].ms == math.inf and recs["h_wrong"].reason.startswith("wrong result")
    assert recs["h_a"].shape == "fake" and recs["h_a"].error == 1e-4


def test_close_candidates_are_retimed_in_alternating_rounds(monkeypatch):
    """Candidates within the margin of the fastest are timed again in `rounds` rounds (forward,
    then backward), each keeping the median of all its times; the others and failures are left
    alone; one close candidate without peers is not re-timed; a failure while re-timing (a broken
    CUDA context) keeps the first pass's times."""
    asked = fake_median(monkeypatch, {"a": [1.00, 1.10, 1.10, 1.10], "b": [1.02, 1.00, 1.00, 1.00], "slow": [2.0]})
    got = measure.measure(cands("a", "b", "slow", "bad"), FakeWorkload(wrong={"bad"}), tuner.policy())
    assert [name for name, _, _ in asked] == ["a", "b", "slow", "a", "b", "b", "a", "a", "b"]
    assert [m.ms for m in got.measurements[:3]] == [1.10, 1.00, 2.00]
    assert not got.measurements[3].ok

    fake_median(monkeypatch, {"a": [1.0], "slow": [2.0]})  # a list: a second timing would fail
    got = measure.measure(cands("a", "slow"), FakeWorkload(), tuner.policy())
    assert [m.ms for m in got.measurements] == [1.0, 2.0]

    broken = RuntimeError("CUDA error: an illegal memory access was encountered")
    fake_median(monkeypatch, {"a": [1.0, broken], "b": [1.01, broken]})  # the re-timing finds the context broken
    with pytest.warns(GemmgenWarning, match="first-pass times kept"):
        got = measure.measure(cands("a", "b"), FakeWorkload(), tuner.policy())
    assert [m.ms for m in got.measurements] == [1.0, 1.01]


def test_gemm_tuning_times_both_states_and_picks_the_best_in_both(monkeypatch):
    """Sustained load (measure.sustained_policy): sustained times for all, short-run times (two
    passes, alternating order) for the candidates within TUNE_PRUNE of the fastest;
    gemm_select.tuned_costs then prefers the candidate near the best in both states over the best in
    one. Calls this short (10 us) never hold the GPU at its power cap, so no candidate is timed alone."""
    sustained = {"fast_hot": 0.0100, "even": 0.0103, "fast_cool": 0.0125, "slow": 0.0200, "peer:torch": 0.011}
    short = {"fast_hot": 0.0095, "even": 0.0082, "fast_cool": 0.0080}
    seen = {}

    def fake_sustained(runs, **kw):
        seen.update(kw, names=sorted(runs))
        return {name: sustained[name] for name in runs}

    monkeypatch.setattr(timing, "sustained_ms", fake_sustained)
    monkeypatch.setattr(timing, "steady_ms", lambda runs, **kw: pytest.fail("short calls timed alone"))
    order, called = [], []

    def fake_median(run, copies, **kw):
        run(0)
        order.append(called[-1])
        return short[order[-1]]

    monkeypatch.setattr(timing, "median_ms", fake_median)

    def call(name):
        called.append(name)
        if name == "broken":
            raise RuntimeError("cannot run this shape\nmore")

    work = measure.CallWorkload("s", 1.0, call, peers={"torch": measure.Peer(lambda i: "peer:torch")})
    got = measure.measure(cands(*[n for n in sustained if ":" not in n], "broken"), work,
                          measure.sustained_policy(20))
    assert seen["rounds"] == 2 and seen["prune"] == measure.TUNE_PRUNE and seen["fixed"] == ("peer:torch",)
    assert "peer:broken" not in seen["names"] and "broken" not in seen["names"]
    assert order == ["fast_hot", "even", "fast_cool", "fast_cool", "even", "fast_hot"]  # not "slow"
    rows = {m.name: (m.ms, m.ms_short, m.ms_alone) for m in got.measurements}
    assert rows == {"fast_hot": (0.01, 0.0095, None), "even": (0.0103, 0.0082, None),
                    "fast_cool": (0.0125, 0.008, None), "slow": (0.02, None, None), "broken": (math.inf, None, None)}
    assert got.peers["torch"].ms == 0.011
    records = got.records
    assert records["h_broken"].reason == "failed to run: cannot run this shape"
    assert records["h_even"].ms_short == 0.0082
    costs = gemm_select.tuned_costs({r.name: r for r in records.values()})
    assert "broken" not in costs and math.isclose(costs["slow"], 2.0)
    assert math.isclose(costs["fast_hot"], 0.95 / 0.8) and math.isclose(costs["even"], 1.03)
    assert min(costs, key=costs.get) == "even"  # 1.03 and 1.025 of the best, not 1.0 and 1.19


def test_gemm_tuning_times_the_finalists_of_long_calls_alone(monkeypatch):
    """On calls long enough to hold the GPU at its power cap, the TUNE_FINALISTS candidates of
    lowest cost in both states are each timed alone under load (timing.steady_ms), and their load
    ratio is then taken among those times: here the rotation's fastest is the slowest alone and
    loses to the second."""
    sustained = {"a": 1.00, "b": 1.02, "c": 1.05, "d": 1.10, "slow": 2.0}
    alone = {"a": 1.12, "b": 1.00, "c": 1.03}
    monkeypatch.setattr(timing, "sustained_ms", lambda runs, **kw: {name: sustained[name] for name in runs})
    monkeypatch.setattr(timing, "median_ms", lambda run, copies, **kw: 1.0)  # a tie over short runs
    asked = []

    def fake_steady(runs, **kw):
        asked.append((sorted(runs), kw["seconds"]))
        return {name: alone[name] for name in runs}

    monkeypatch.setattr(timing, "steady_ms", fake_steady)
    got = measure.measure(cands(*sustained), measure.CallWorkload("s", 1.0, lambda name: None),
                          measure.sustained_policy(20))
    assert asked == [(["a", "b", "c"], measure.TUNE_ALONE_S)]
    assert {m.name: m.ms_alone for m in got.measurements} == {**alone, "d": None, "slow": None}
    records = got.records
    assert tuning_db.Record.from_json(records["h_b"].to_json()).ms_alone == 1.0  # stored and read back
    costs = gemm_select.tuned_costs({r.name: r for r in records.values()})
    assert math.isclose(costs["a"], 1.12) and costs["b"] == 1.0 and math.isclose(costs["d"], 1.1)
    assert min(costs, key=costs.get) == "b"


def test_a_failure_under_sustained_load_fails_the_runs_timed_together(monkeypatch):
    def broken(runs, **kw):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(timing, "sustained_ms", broken)
    got = measure.measure(cands("a", "b"), measure.CallWorkload("s", 1.0, lambda name: None),
                          measure.sustained_policy(20))
    assert [m.ms for m in got.measurements] == [math.inf, math.inf]
    assert got.measurements[0].reason == "failed while timed with the others: CUDA error: an illegal memory " \
                                         "access was encountered"


def test_a_repeated_name_is_measured_on_its_own_and_peers_without_candidates(monkeypatch):
    """Two builds of one instance name (two build folders) are two measurements with their own
    records; with no candidate left after the gate the peers are still timed."""
    same = cands("a", "a")
    same[1].content_hash = "h_a_other"

    def median(run, copies, **kw):
        return {"a": 1.0, "ref": 0.5}[run(0)]

    monkeypatch.setattr(timing, "median_ms", median)
    got = measure.measure(same, FakeWorkload(peers={"ref": measure.Peer(lambda i: "ref")}), tuner.policy())
    assert [(m.name, m.content_hash, m.ms) for m in got.measurements] == [("a", "h_a", 1.0), ("a", "h_a_other", 1.0)]
    assert set(got.records) == {"h_a", "h_a_other"}
    got = measure.measure(cands("a"), FakeWorkload(wrong={"a"}, peers={"ref": measure.Peer(lambda i: "ref")}),
                          tuner.policy())
    assert got.winner is None and got.peers["ref"].ms == 0.5


def test_policy_loads_are_checked():
    with pytest.raises(ValueError, match="load 'warm'"):
        measure.Policy(load="warm")


# --- both kinds through the one measure --------------------------------------------------------


@pytest.fixture
def fake_gpu(monkeypatch):
    """torch sees one CUDA device (a synthetic H100); nothing runs on it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(device, "facts", lambda index: H100)
    spy = []
    real = measure.measure

    def measure_spy(cands, work, policy=measure.Policy(), progress=None):
        spy.append((type(work).__name__, policy.load))
        return real(cands, work, policy, progress)

    monkeypatch.setattr(measure, "measure", measure_spy)
    yield spy
    registry.refresh()


def test_the_attention_tuner_measures_through_the_one_measure(fake_gpu, monkeypatch):
    class Workload(FakeWorkload):
        def __init__(self, shape, index, *, graph=False):
            super().__init__(wrong={"wrong"})
            self.label = shape.spec()

    monkeypatch.setattr(tuner, "AttentionWorkload", Workload)
    asked = fake_median(monkeypatch, {"a": 1.0, "wrong": 0.1})
    got = tuner.measure(cands("a", "wrong"), Shape(2, 16, 512, 512, 64), index=0, reps=9, graph=True)
    assert fake_gpu == [("Workload", "calls")]
    assert [(m.name, m.ms) for m in got] == [("a", 1.0), ("wrong", math.inf)]
    assert isinstance(got[0], tuner.Measurement) and got[1].reason.startswith("wrong result")
    assert asked[0][2]["reps"] == 9 and asked[0][2]["graph"] is True


def test_profile_serves_the_attention_through_the_one_measure(fake_gpu, monkeypatch, tmp_path, capsys):
    from gemmgen.cli import app, profile

    class Workload(FakeWorkload):
        def __init__(self, shape, index, *, graph=False):
            super().__init__(wrong={"wrong"})
            self.label, self.flops, self.problem, self.inputs = shape.spec(), shape.flops, None, []

    monkeypatch.setattr(tuner, "AttentionWorkload", Workload)
    monkeypatch.setattr(registry, "candidates", lambda problem: (cands("fast", "wrong", "slow"), []))
    monkeypatch.setattr(profile, "sdpa_peers", lambda shape, inputs: {
        "flash": measure.Peer(lambda i: "flash"), "cudnn": measure.Peer(lambda i: (_ for _ in ()).throw(
            RuntimeError("cuDNN is not available")))})
    fake_median(monkeypatch, {"fast": 1.0, "slow": 3.0, "flash": 2.0})
    out = tmp_path / "p.csv"
    assert app.main(["profile", "--arch", "sm80", "--shapes", "2,16,512,64", "--csv", str(out)]) == 0
    text = capsys.readouterr().out
    assert fake_gpu == [("Workload", "calls")]
    assert "* fast" in text and "failed: wrong result" in text and "winner: fast" in text
    assert "torch sdpa flash" in text and "not run: cuDNN is not available" in text
    assert "stored in" in text
    rows = list(csv.DictReader(out.open()))
    assert [(r["kind"], r["name"], r["winner"]) for r in rows] == [
        ("gemmgen", "fast", "1"), ("gemmgen", "wrong", "0"), ("gemmgen", "slow", "0"), ("sdpa", "flash", "0"),
        ("sdpa", "cudnn", "0")]
    assert rows[0]["causal"] == "0" and rows[0]["head_dim"] == "64"
    db = tuning_db.cached(H100.fingerprint())
    assert db.count() == 3  # every candidate's record, the failure's too


def test_profile_serves_the_gemm_through_the_one_measure(fake_gpu, monkeypatch, tmp_path, capsys):
    from gemmgen.cli import app, gemm as cli_gemm
    from gemmgen.select import selection

    decided = cands("pick", "other", "broken")
    monkeypatch.setattr(selection, "decide", lambda problem: SimpleNamespace(
        candidates=decided, winner=decided[0], source="heuristic"))

    def call(name):
        if name == "broken":
            raise RuntimeError("instance cannot run this shape")

    def workload(shape, problem):
        assert shape.spec() == "2x4x64x128x32" and problem.b_transposed
        return measure.CallWorkload(shape.spec(), shape.flops, call, problem,
                                    peers={"torch": measure.Peer(lambda i: None)})

    monkeypatch.setattr(cli_gemm, "workload", workload)
    monkeypatch.setattr(timing, "sustained_ms", lambda runs, **kw: {
        name: {"pick": 1.0, "other": 0.9, "peer:torch": 1.1}[name] for name in runs})
    monkeypatch.setattr(timing, "rounds_ms", lambda runs, **kw: {name: 0.8 for name in runs})
    monkeypatch.setattr(timing, "steady_ms", lambda runs, **kw: {name: 0.95 for name in runs})
    out = tmp_path / "g.csv"
    argv = ["profile", "--op", "gemm", "--batch", "2", "--heads", "4", "--m", "64", "--n", "128", "--k", "32",
            "--b-transposed", "--record", "--csv", str(out)]
    assert app.main(argv) == 0
    text = capsys.readouterr().out
    assert fake_gpu == [("CallWorkload", "sustained")]
    assert "* pick" in text and "failed: failed to run: instance cannot run this shape" in text
    assert "torch.matmul (cuBLAS)" in text and "(* = the pick before profiling: heuristic)" in text
    assert "short ms" in text and "alone ms" in text and "stored in" in text
    rows = {r["name"]: r for r in csv.DictReader(out.open())}
    assert rows["other"]["ms_short"] == "0.8" and rows["other"]["ms_alone"] == "0.95"
    assert rows["pick"]["winner"] == "1" and rows["torch"]["kind"] == "torch" and rows["broken"]["ms"] == ""
    db = tuning_db.cached(H100.fingerprint())
    assert db.count() == 3
