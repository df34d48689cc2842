"""The one selection engine: every kind of operation (attention, batched GEMM, row softmax) goes
through gemmgen.select.engine by its problem's `kind`; a new kind plugs in as a Kind."""
from __future__ import annotations

import pytest

from conftest import make_entry, write_build_dir
from gemmgen.errors import InputError, NoInstanceError
from gemmgen.generator.families import softmax_sm80
from gemmgen.select import device, engine, registry, selection, tuning_db
from gemmgen.select.softmax_select import SoftmaxProblem

H100 = device.synthetic((9, 0), 132)


@pytest.fixture
def softmax_build(tmp_path):
    registry.set_build_dirs([write_build_dir(tmp_path, [make_entry(i) for i in softmax_sm80.SPACE])])
    yield tmp_path
    registry.set_build_dirs(None)


def test_every_kind_is_registered():
    assert set(selection.KINDS) == {"attention", "attention_bwd", "gemm", "softmax"}


def test_softmax_goes_through_the_engine(softmax_build):
    decision = selection.decide(SoftmaxProblem("bf16", H100))
    assert decision.source == "heuristic" and decision.winner.entry.params["dtype"] == "bf16"
    assert all(c.entry.params["dtype"] == "bf16" for c in decision.candidates)
    assert {reason for _, reason in decision.rejected} == {"dtype fp16, the problem's is bf16"}
    assert selection.select(SoftmaxProblem("bf16", H100)) is selection.select(SoftmaxProblem("bf16", H100))
    with pytest.raises(NoInstanceError, match="Build one with: gemmgen generate --arch sm80 --family softmax_sm80"):
        selection.select(SoftmaxProblem("bf16", device.synthetic((7, 5), 40)))
    with pytest.raises(InputError, match="no instance named 'nope' among the softmax instances"):
        selection.select(SoftmaxProblem("bf16", H100), "nope")


def test_a_new_kind_plugs_in(softmax_build, tmp_path):
    """A Kind defined here (ranking by name backwards, costs twice the time) runs through the
    engine's whole order: heuristic, then tuned from a database, with failed records rejected."""
    cands = registry.load()[0]
    kind = engine.Kind(name="toy", candidates=lambda p: (list(cands), []),
                       heuristic=lambda usable, p: (max(usable, key=lambda c: c.name), {}),
                       costs=lambda recs: {n: 2 * r.ms for n, r in recs.items() if r.ok},
                       build_command=lambda p: None, distance=lambda p, key: None)
    problem = SoftmaxProblem("fp16", H100)
    first = engine.decide(kind, problem, db=tuning_db.TuningDB({}))
    assert first.source == "heuristic" and first.winner.name == max(c.name for c in cands)
    db = tuning_db.TuningDB({})
    slow, fast, broken = sorted(cands, key=lambda c: c.name)[:3]
    for cand, ms in ((slow, 2.0), (fast, 1.0), (broken, float("inf"))):
        db.add(problem.functional_key, problem.bucket_key, cand.content_hash,
               tuning_db.Record(name=cand.name, ms=ms, reason=None if ms < 9 else "launch failed"))
    tuned = engine.decide(kind, problem, db=db)
    assert tuned.source == "tuned" and tuned.winner.name == fast.name and tuned.costs[fast.name] == 2.0
    assert "decided by: tuned bucket all" in tuned.report()
    assert (broken.label, "failed when tuned for bucket all: launch failed") in tuned.rejected
