"""Selection's order of decision with synthetic manifests and tuning data: tuned bucket, nearest tuned
bucket, heuristic, error; failed measurements; caching."""
from __future__ import annotations

import time

import pytest

from conftest import make_entry, write_build_dir
from gemmgen.select import device, registry, selection, tuning_db
from gemmgen.errors import InputError, NoInstanceError
from gemmgen.generator.families.fa2_sm80 import DType, Fa2Sm80Instance, Mask
from gemmgen.select.problem import Problem

H200 = device.synthetic((9, 0), 132, "NVIDIA H200")
DEFAULT = Fa2Sm80Instance(DType.BF16, 128, Mask.CAUSAL, 128, 64, 4)
SMALL = Fa2Sm80Instance(DType.BF16, 128, Mask.CAUSAL, 64, 64, 4)
WIDE = Fa2Sm80Instance(DType.BF16, 128, Mask.CAUSAL, 128, 128, 8)
OTHER = Fa2Sm80Instance(DType.FP16, 128, Mask.CAUSAL, 128, 64, 4)


@pytest.fixture
def build(tmp_path):
    write_build_dir(tmp_path, [make_entry(i) for i in (DEFAULT, SMALL, WIDE, OTHER)])
    registry.set_build_dirs([tmp_path])
    yield tmp_path
    registry.set_build_dirs(None)


def problem(n: int = 4096, bh: int = 64, **kw) -> Problem:
    return Problem(**{"dtype": "bf16", "head_dim": 128, "causal": True, "device": H200, "batch_heads": bh,
                      "seqlen_q": n, "seqlen_k": n, **kw})


def tune(p: Problem, times: dict, bucket: str | None = None, at: float | None = None) -> None:
    """Store measurements {instance: ms or (inf, reason)} for `p`'s bucket (or `bucket`)."""
    recs = {}
    for inst, t in times.items():
        ms, reason = t if isinstance(t, tuple) else (t, None)
        recs[inst.content_hash()] = tuning_db.Record(inst.name, ms, reason, None, "x", at or time.time()).to_json()
    tuning_db.update(H200.fingerprint(), {p.functional_key: {bucket or p.bucket.key: recs}})
    registry.refresh()


def test_heuristic_when_nothing_is_tuned(build):
    d = selection.decide(problem())
    assert d.source == "heuristic" and d.winner.name == DEFAULT.name and d.from_bucket is None
    assert set(d.estimates) == {DEFAULT.name, SMALL.name, WIDE.name}
    assert any(OTHER.name in label and "dtype fp16, the problem is bf16" in r for label, r in d.rejected)
    assert "decided by: heuristic" in d.report()


def test_tuned_bucket_wins_over_heuristic(build):
    tune(problem(), {DEFAULT: 1.0, SMALL: 1.2, WIDE: 0.9})
    d = selection.decide(problem())
    assert (d.source, d.winner.name, d.from_bucket) == ("tuned", WIDE.name, problem().bucket.key)
    assert d.measured[SMALL.name] == (1.2, None)
    assert "decided by: tuned bucket bhnd_g1_bh64_q4096_k4096 (3 of 3 candidates measured)" in d.report()
    assert selection.decide(problem(n=4000)).source == "tuned"  # same bucket


def test_nearest_tuned_bucket(build):
    tune(problem(), {DEFAULT: 1.0, SMALL: 0.5})
    near = selection.decide(problem(n=2048))  # 2 doublings away
    assert (near.source, near.winner.name, near.from_bucket) == ("nearest-tuned", SMALL.name, problem().bucket.key)
    assert "nearest tuned bucket bhnd_g1_bh64_q4096_k4096, 2 doublings away" in near.report()
    assert selection.decide(problem(n=1024)).source == "heuristic"  # 4 doublings: too far
    assert selection.decide(problem(layout="bnhd")).source == "nearest-tuned"  # 1 for the layout


def test_nearest_prefers_the_closest_bucket(build):
    tune(problem(n=8192), {DEFAULT: 1.0, SMALL: 0.5})
    tune(problem(n=1024), {DEFAULT: 0.5, SMALL: 1.0})
    assert selection.decide(problem(n=4096)).winner.name == SMALL.name  # 2 doublings from 8192, 4 from 1024
    assert selection.decide(problem(n=2048)).winner.name == DEFAULT.name


def test_failed_measurements_are_rejected_with_their_reason(build):
    tune(problem(), {DEFAULT: (float("inf"), "failed to run: too many resources requested"), SMALL: 2.0})
    d = selection.decide(problem())
    assert d.winner.name == SMALL.name
    assert any(DEFAULT.name in label and "failed when tuned for bucket bhnd_g1_bh64_q4096_k4096: failed to run"
               in reason for label, reason in d.rejected)
    assert selection.decide(problem(n=512)).winner.name == DEFAULT.name  # a launch failure stays in its bucket


def test_wrong_result_is_rejected_everywhere(build):
    tune(problem(), {WIDE: (float("inf"), f"{selection.WRONG_RESULT}: relative error 3e-01"), DEFAULT: 1.0})
    far = selection.decide(problem(n=128, bh=1))
    assert far.source == "heuristic" and WIDE.name not in {c.name for c in far.candidates}
    assert any("gave a wrong result when tuned for another bucket" in r for _, r in far.rejected)


def test_unmeasured_candidate_and_needs_tuning(build):
    tune(problem(), {DEFAULT: 1.0, SMALL: 0.8})
    d = selection.decide(problem())
    assert d.source == "tuned" and d.winner.name == SMALL.name and WIDE.name not in d.measured
    assert selection.needs_tuning(problem())
    tune(problem(), {WIDE: 0.9})  # merged: the earlier two stay
    assert not selection.needs_tuning(problem())
    assert selection.decide(problem()).winner.name == SMALL.name


def test_changed_instance_code_drops_its_measurements(build, tmp_path_factory):
    tune(problem(), {DEFAULT: 9.0, SMALL: 0.1})
    other = tmp_path_factory.mktemp("rebuilt")  # same instances, new content hashes
    write_build_dir(other, [make_entry(i, content_hash=f"{i.content_hash()}x") for i in (DEFAULT, SMALL)])
    registry.set_build_dirs([other])
    assert selection.decide(problem()).source == "heuristic"


def test_no_candidate_lists_reasons_and_command(build):
    with pytest.raises(NoInstanceError) as info:
        selection.decide(problem(head_dim=64))
    text = str(info.value)
    assert "No gemmgen instance can run bf16 head_dim=64 causal on sm_90" in text
    assert f"{DEFAULT.name} ({build / 'sm80'}): head_dim 128, the problem has 64" in text
    assert f"gemmgen generate --arch sm80 --out {build} --filter fa2_sm80_bf16_d64_causal_" in text
    tune(problem(), {i: (float("inf"), "failed to run: boom") for i in (DEFAULT, SMALL, WIDE)})
    with pytest.raises(NoInstanceError, match="failed when tuned for bucket"):
        selection.decide(problem())


def test_forced_and_unknown_instance(build):
    tune(problem(), {DEFAULT: 1.0, SMALL: 0.5})
    d = selection.decide(problem(), WIDE.name)
    assert (d.source, d.winner.name) == ("forced", WIDE.name)
    with pytest.raises(InputError, match="no instance named 'nope'"):
        selection.decide(problem(), "nope")
    with pytest.raises(NoInstanceError, match="dtype fp16, the problem is bf16"):
        selection.decide(problem(), OTHER.name)


def test_select_is_cached_until_refresh(build):
    first = selection.select(problem())
    assert first.name == DEFAULT.name and selection.select(problem()) is first
    tuning_db.update(H200.fingerprint(), {problem().functional_key: {problem().bucket.key: {
        SMALL.content_hash(): tuning_db.Record(SMALL.name, 0.1, at=time.time()).to_json()}}})
    assert selection.select(problem()) is first  # cached
    registry.refresh()
    assert selection.select(problem()).name == SMALL.name


def test_corrupt_database_never_fails_a_selection(build):
    path = tuning_db.path_for(H200.fingerprint())
    path.parent.mkdir(parents=True)
    path.write_text("{ not json")
    with pytest.warns(UserWarning, match="ignoring tuning database"):
        d = selection.decide(problem())
    assert d.source == "heuristic"


def test_declared_layouts_gqa_and_alignment_are_held(tmp_path):
    entry = make_entry(DEFAULT)
    entry.params = {**entry.params, "layouts": ["bhnd"], "gqa_ratios": [1, 2], "align_bytes": 16}
    write_build_dir(tmp_path, [entry])
    registry.set_build_dirs([tmp_path])
    try:
        assert [c.name for c in registry.candidates(problem())[0]] == [DEFAULT.name]
        for p, words in ((problem(layout="bnhd"), "layouts ['bhnd'], the problem's is bnhd"),
                         (problem(gqa=4), "GQA ratios [1, 2], the problem's is 4"),
                         (problem(align=8), "needs 16-byte aligned data and strides, the problem's are 8-byte")):
            good, rejected = registry.candidates(p)
            assert good == [] and words in rejected[0][1]
    finally:
        registry.set_build_dirs(None)


def test_the_cached_path_picks_what_the_full_decision_picks(tmp_path):
    """select() decides from the registry's shortlist (the entries of the problem's kind, dtype, head
    dim and mask): the same winner as the full decision that explain reports, over every default
    instance and a spread of problems; a problem nothing runs still raises with every reason."""
    import itertools

    from gemmgen.generator import space

    insts = [i for f in space.FAMILIES if getattr(f, "KIND", "") in ("attention", "attention_bwd")
             for i in f.DEFAULT]
    write_build_dir(tmp_path, [make_entry(i) for i in insts])
    registry.set_build_dirs([tmp_path])
    try:
        checked = 0
        for dtype, d, causal, alignment, (nq, nk), bh, gqa, feature in itertools.product(
                ("fp16", "bf16"), (64, 96, 128, 256), (False, True), ("top_left", "bottom_right"),
                ((1, 300), (17, 4097), (1000, 1000), (4097, 1000)), (8, 512), (1, 4),
                (None, "dropout", "kv_cache")):
            p = Problem(dtype=dtype, head_dim=d, causal=causal, device=H200, batch_heads=bh, seqlen_q=nq,
                        seqlen_k=nk, gqa=gqa, causal_alignment=alignment, **({feature: True} if feature else {}))
            try:
                full = selection.decide(p)
            except NoInstanceError as exc:
                with pytest.raises(NoInstanceError) as short:
                    selection.decide(p, report=False)
                assert str(short.value) == str(exc)
                continue
            fast = selection.decide(p, report=False)
            assert (fast.winner.name, fast.source) == (full.winner.name, full.source), p
            assert [c.name for c in fast.candidates] == [c.name for c in full.candidates]
            checked += 1
        assert checked > 500
    finally:
        registry.set_build_dirs(None)
