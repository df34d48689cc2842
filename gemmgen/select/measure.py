"""Measuring for the tuning database, for every kind of operation: `record` stores a problem's
records under its functional key and bucket; `measure_states` times GEMM candidates in the states a
batched GEMM runs in (the attention tuner, gemmgen.select.tuner, times with its own checks and
stores through `record` too)."""
from __future__ import annotations

import math
import time

from gemmgen.select import gemm_select, registry, timing, tuning_db


def record(problem, records: dict[str, tuning_db.Record]) -> tuning_db.TuningDB:
    """Store `records` (content hash -> record) under the problem's functional key and bucket in its
    GPU's tuning database, and forget cached selections so the next call reads them. Raises
    CacheError when the cache folder is not writable."""
    entries = {problem.functional_key: {problem.bucket_key: {h: r.to_json() for h, r in records.items()}}}
    db = tuning_db.update(problem.device.fingerprint(), entries)
    registry.refresh()
    return db


TUNE_BURST = 10  # back-to-back calls per timed burst when tuning, at least
TUNE_MIN_BURST_MS = 40.0  # and bursts of calls >= 50 us last this long (timing.burst_calls)
TUNE_PRUNE = 1.3  # candidates this much slower than the fastest after settling skip the rounds
TUNE_SHORT_REPS = 10  # calls per pass when timing calls one by one (two passes, alternating order)
TUNE_FINALISTS = 3  # the candidates of lowest cost in both states, each then timed alone under load
TUNE_ALONE_S = 1.0  # seconds of each finalist's turns alone (timing.steady_ms: two turns each)


def measure_states(cands: list, call, *, reps: int, shape: str, peers: dict | None = None,
            settle_s: float = 1.0) -> tuple[list[tuple[str, float, float | None, float | None, str | None]], dict, dict]:
    """Time `call(name)` for every candidate in the two states a GEMM runs in.

    Sustained load (the record's ms; timing.sustained_ms): `settle_s` seconds of load, then rounds
    of back-to-back bursts in alternating order, each queued behind a spin kernel so that the events
    time the kernels alone and lasting TUNE_MIN_BURST_MS where the calls are long enough; one round
    per TUNE_BURST of `reps`, at least two; candidates more than TUNE_PRUNE times slower than the
    fastest after settling keep their settling time. Short runs (ms_short): the candidates within
    TUNE_PRUNE of the fastest sustained time, each call timed on its own (timing.median_ms, host
    path hidden), TUNE_SHORT_REPS calls per candidate and pass, two passes in alternating order,
    the mean of the two passes' medians (timing.rounds_ms): the clock a cooler GPU gives a few
    calls. Alone under load (ms_alone): where calls are long enough for bursts of them to hold the
    GPU at its power cap (timing.HOST_BOUND_MS and longer), the TUNE_FINALISTS candidates of lowest
    cost in both states, each with the GPU to itself for turns of TUNE_ALONE_S seconds
    (timing.steady_ms), since in the rotation a burst starts at the clock the candidate before it
    left (bench/NOTES.md, experiment 48). gemm_select picks the candidate closest to the best in
    both states (tuned_costs), its load ratio taken alone where the finalists were.

    Returns (name, ms, ms_short, ms_alone, reason) rows, tuning-database records by build hash, and
    the sustained ms of each of `peers` (name -> callable, e.g. torch.matmul), timed in the same rounds.

    A kernel of a few microseconds timed with its host path would measure that path, the same for
    every candidate; a ranking taken in one state can invert in the other on output-bound shapes
    (bench/NOTES.md, experiments 17, 19, 21 and 22). A failing candidate is infinitely slow."""
    rows, records, runs = [], {}, {}
    for cand in cands:  # one call each first: a candidate that fails is not timed
        try:
            call(cand.name)
            runs[cand.name] = lambda name=cand.name: call(name)
        except Exception as exc:  # a failing candidate is infinitely slow, not a crash
            rows.append((cand.name, math.inf, None, None, str(exc).splitlines()[0]))
    peer_ms = {}
    if runs:
        rounds = max(2, -(-reps // TUNE_BURST))
        peer_runs = {f"peer:{k}": v for k, v in (peers or {}).items()}
        timed = timing.sustained_ms({**runs, **peer_runs}, rounds=rounds, burst=TUNE_BURST, settle_s=settle_s,
                                    min_burst_ms=TUNE_MIN_BURST_MS, prune=TUNE_PRUNE, fixed=tuple(peer_runs))
        peer_ms = {name.removeprefix("peer:"): ms for name, ms in timed.items() if name.startswith("peer:")}
        fastest = min(timed[name] for name in runs)
        contenders = [name for name in runs if timed[name] <= TUNE_PRUNE * fastest]
        short = timing.rounds_ms({name: runs[name] for name in contenders}, rounds=2, reps=TUNE_SHORT_REPS,
                                 warmup=2, hide_host=True)
        alone = {}
        if fastest >= timing.HOST_BOUND_MS and len(contenders) > 1:
            costs = gemm_select.tuned_costs({name: tuning_db.Record(name=name, ms=timed[name], ms_short=short.get(name))
                                             for name in contenders})
            finalists = sorted(contenders, key=lambda name: costs[name])[:TUNE_FINALISTS]
            alone = timing.steady_ms({name: runs[name] for name in finalists}, seconds=TUNE_ALONE_S,
                                     window_s=TUNE_ALONE_S / 2, burst=TUNE_BURST, min_burst_ms=TUNE_MIN_BURST_MS)
        rows += [(name, timed[name], short.get(name), alone.get(name), None) for name in runs]
    by_name = {cand.name: cand for cand in cands}
    for name, ms, ms_short, ms_alone, reason in rows:
        records[by_name[name].content_hash] = tuning_db.Record(name=name, ms=ms, reason=reason, shape=shape,
                                                               at=time.time(), ms_short=ms_short, ms_alone=ms_alone)
    return rows, records, peer_ms
