"""Measuring candidates for the tuning database, for every kind of operation.

A kind describes one problem as a Workload: the label its records carry, its flops, a call of each
candidate on real-size inputs, the correctness gate, and its peers (the libraries it is compared
with, e.g. torch SDPA or torch.matmul). `measure` gates every candidate, times those that pass and
the peers under one Policy, and returns their Measurements and tuning-database records; `record`
stores records under the problem's functional key and bucket. A candidate that fails to load, to
run or to give the right result gets infinite time and keeps its reason: it can never win, and it
never stops the others from being measured.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import statistics
import time
import warnings
from typing import Any, Callable, ContextManager, Protocol

from gemmgen.errors import GemmgenError, GemmgenWarning
from gemmgen.select import gemm_select, registry, timing, tuning_db

Progress = Callable[[str], None]
Run = Callable[[int], None]  # one call on copy i of the workload's inputs


class WrongResult(GemmgenError):
    """A candidate's output does not match the reference."""


@dataclasses.dataclass
class Measurement:
    """One candidate (or peer) on one problem: ms (inf when it failed) and why it failed; ms_short
    and ms_alone where the policy takes those states."""

    name: str
    content_hash: str
    ms: float
    reason: str | None = None
    error: float | None = None  # the correctness gate's relative error, where it gives one
    ms_short: float | None = None
    ms_alone: float | None = None

    @property
    def ok(self) -> bool:
        """True for a finite time."""
        return math.isfinite(self.ms)


@dataclasses.dataclass(frozen=True)
class Peer:
    """A library the candidates are compared with: `run(i)` calls it on copy i of the workload's
    inputs, inside `scope()` (e.g. the choice of one SDPA backend). The scope is entered around each
    timing of per-call load, so its cost is not timed, and around each call of sustained load,
    where the bursts hide the host path."""

    run: Run
    scope: Callable[[], ContextManager] = contextlib.nullcontext


class Workload(Protocol):
    """One problem of one kind of operation, as `measure` needs it, on the current CUDA device."""

    label: str  # the shape as the records store it
    flops: float  # per call
    problem: Any  # the selection problem whose bucket the records belong to (`record`)
    copies: int  # input copies a run rotates over (so that they do not stay in L2)
    flush: Any  # a tensor whose zeroing evicts L2 before each per-call timing, or None
    peers: dict[str, Peer]

    def prepare(self, cand: Any) -> tuple[Run, float | None]:
        """The correctness gate, then `cand`'s call on the real-size inputs with everything it needs
        made outside the timed call. The gate compares the candidate's output with a reference where
        the kind has one and makes at least one real-size call, so that a candidate that cannot run
        is never timed. Raises WrongResult for a wrong result, anything else for a candidate that
        cannot load or run; returns (the call, the relative error or None)."""


@dataclasses.dataclass
class CallWorkload:
    """A Workload whose candidates are called by name on inputs made elsewhere (one copy, no L2
    flush): `call(name)` runs the candidate named. Its gate is one call, then `sync` (e.g.
    torch.cuda.synchronize, so that an asynchronous failure is the candidate's own); it checks no
    output."""

    label: str
    flops: float
    call: Callable[[str], None]
    problem: Any = None
    peers: dict[str, Peer] = dataclasses.field(default_factory=dict)
    sync: Callable[[], None] | None = None
    copies: int = 1
    flush: Any = None

    def prepare(self, cand: Any) -> tuple[Run, None]:
        """`call` with the candidate's name, after one call, synchronized."""
        name = cand.name

        def run(_i: int) -> None:
            self.call(name)
        run(0)
        if self.sync is not None:
            self.sync()
        return run, None


@dataclasses.dataclass(frozen=True)
class Policy:
    """How `measure` times the candidates that passed the gate, and the peers.

    A first pass times every one; the candidates within `margin` times the fastest candidate, and
    the peers, are then timed in `rounds` rounds in alternating order (forward, then backward:
    timing.alternating_rounds), each keeping the median of its times, so that none is always timed
    after the same one or while the GPU's clock still moves. What one timing is, by `load`:

    "calls": the median of `reps` calls after `warmup`, each timed on its own with CUDA events
    (timing.median_ms; the workload's copies rotated or L2 flushed; with `graph`, replays of a CUDA
    graph): what one call costs its caller. The first pass counts in the median; rounds run only
    where at least two are timed.

    "sustained": device time per call in bursts of at least `burst` calls lasting `min_burst_ms`,
    each queued behind a spin kernel, after `settle_s` seconds of such bursts brought the GPU to the
    clock a sustained workload runs at (timing.sustained_ms, whose settling pass is the first pass;
    the median is over the rounds).

    With `short`, the candidates within `margin` are also timed over short runs (ms_short:
    timing.rounds_ms, two passes of SHORT_REPS calls each timed alone, host path hidden): the clock
    a cooler GPU gives a few calls. With `alone`, where the fastest call is long enough to hold the
    GPU at its power cap (timing.HOST_BOUND_MS), the `finalists` of lowest cost in both states
    (gemm_select.tuned_costs) each have the GPU to itself for turns of `alone_s` seconds (ms_alone:
    timing.steady_ms), since in the rounds a burst starts at the clock the one before it left."""

    load: str = "calls"  # "calls" or "sustained"
    warmup: int = 5
    reps: int = 30
    graph: bool = False
    margin: float = 1.05
    rounds: int = 3
    settle_s: float = 1.0
    burst: int = 10
    min_burst_ms: float = 0.0
    short: bool = False
    alone: bool = False
    finalists: int = 3
    alone_s: float = 1.0

    def __post_init__(self) -> None:
        if self.load not in LOADS:
            raise ValueError(f"load {self.load!r}; known: {', '.join(LOADS)}")


LOADS = ("calls", "sustained")
SHORT_REPS = 10  # calls per pass of the short runs (two passes, alternating order)

# The states a batched GEMM runs in (bench/NOTES.md, experiments 17, 19, 21, 22 and 48): a ranking
# taken in one state can invert in the other on output-bound shapes, and a kernel of a few
# microseconds timed with its host path would time that path, the same for every candidate.
TUNE_BURST = 10  # back-to-back calls per timed burst, at least
TUNE_MIN_BURST_MS = 40.0  # and bursts of calls >= 50 us last this long (timing.burst_calls)
TUNE_PRUNE = 1.3  # candidates this much slower than the fastest after settling skip the rounds
TUNE_FINALISTS = 3  # the candidates of lowest cost in both states, each then timed alone under load
TUNE_ALONE_S = 1.0  # seconds of each finalist's turns alone (timing.steady_ms: two turns each)


def sustained_policy(reps: int, *, settle_s: float = 1.0) -> Policy:
    """The policy of a batched GEMM: sustained load, one round per TUNE_BURST of `reps` (at least
    two), short runs, and the finalists of long calls alone; gemm_select then picks the candidate
    closest to the best in every state (tuned_costs)."""
    return Policy(load="sustained", rounds=max(2, -(-reps // TUNE_BURST)), margin=TUNE_PRUNE, settle_s=settle_s,
                  burst=TUNE_BURST, min_burst_ms=TUNE_MIN_BURST_MS, short=True, alone=True,
                  finalists=TUNE_FINALISTS, alone_s=TUNE_ALONE_S)


@dataclasses.dataclass
class Measured:
    """What `measure` found for one workload."""

    label: str
    flops: float
    measurements: list[Measurement]  # one per candidate, in the order given
    peers: dict[str, Measurement]  # name -> time (inf and the reason where it could not run)
    records: dict[str, tuning_db.Record]  # the candidates' records, by content hash

    @property
    def winner(self) -> Measurement | None:
        """The fastest measurement that passed its checks."""
        return fastest(self.measurements)

    def tflops(self, ms: float) -> float:
        """TFLOP/s of one call of `ms` milliseconds (0 for a failed one)."""
        return self.flops / ms / 1e9 if math.isfinite(ms) and ms > 0 else 0.0


def fastest(measurements: list[Measurement]) -> Measurement | None:
    """The fastest of `measurements` that passed its checks (None when none did)."""
    ok = [m for m in measurements if m.ok]
    return min(ok, key=lambda m: m.ms) if ok else None


def failure(exc: BaseException) -> str:
    """The reason a candidate failed: a wrong result as it says, anything else as "failed to run:"
    and the first line of the error."""
    if isinstance(exc, WrongResult):
        return str(exc)
    return f"failed to run: {first_line(exc)}"


def first_line(exc: BaseException) -> str:
    """The first line of an error's message, or its type's name when it has none."""
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def records_of(measurements: list[Measurement], label: str) -> dict[str, tuning_db.Record]:
    """The tuning-database records of `measurements` on the shape `label`, by content hash."""
    now = time.time()
    return {m.content_hash: tuning_db.Record(m.name, m.ms, m.reason, m.error, label, now, m.ms_short, m.ms_alone)
            for m in measurements}


def record(problem, records: dict[str, tuning_db.Record]) -> tuning_db.TuningDB:
    """Store `records` (content hash -> record) under the problem's functional key and bucket in its
    GPU's tuning database, and forget cached selections so the next call reads them. Raises
    CacheError when the cache folder is not writable."""
    entries = {problem.functional_key: {problem.bucket_key: {h: r.to_json() for h, r in records.items()}}}
    db = tuning_db.update(problem.device.fingerprint(), entries)
    registry.refresh()
    return db


PEER = "peer:"  # prefix of the peers' names among the timed runs


def measure(cands: list, work: Workload, policy: Policy = Policy(), progress: Progress | None = None) -> Measured:
    """Gate every candidate by the workload's prepare (a failure is infinite time with its reason),
    time those that pass and the workload's peers under `policy` on the current CUDA device, and
    return their measurements and records. A failure while a candidate is timed is its own; one
    that stops the rounds (a kernel that broke the CUDA context fails every later launch) keeps the
    first pass's times, with a warning."""
    say = progress or (lambda _text: None)
    found: dict[str, Measurement] = {}  # by the candidate's name (a repeated name: with its position)
    runs: dict[str, Run] = {}
    for n, cand in enumerate(cands, 1):
        key = cand.name if cand.name not in found else f"{cand.name}#{n}"
        m = found[key] = Measurement(cand.name, cand.content_hash, math.inf)
        say(f"candidate {n}/{len(cands)} {cand.name}")
        try:
            runs[key], m.error = work.prepare(cand)
        except Exception as exc:  # a failing candidate is infinitely slow, not a crash
            m.reason = failure(exc)
    peers = {name: Measurement(name, "", math.inf) for name in work.peers}
    scoped: dict[str, Peer] = {}
    for name, peer in work.peers.items():
        try:
            with peer.scope():
                peer.run(0)
            scoped[name] = peer
        except Exception as exc:  # e.g. an SDPA backend that does not support the shape
            peers[name].reason = str(exc).splitlines()[0] if str(exc) else "not supported"
    if runs or scoped:
        timed = {**runs, **{PEER + name: peer for name, peer in scoped.items()}}
        times, failed = (_sustained if policy.load == "sustained" else _per_call)(timed, work, policy, say)
        for key, ms in times.items():
            (peers[key.removeprefix(PEER)] if key.startswith(PEER) else found[key]).ms = ms
        for key, reason in failed.items():
            (peers[key.removeprefix(PEER)] if key.startswith(PEER) else found[key]).reason = reason
        if runs and (policy.short or policy.alone):
            _other_states({key: found[key] for key in runs}, runs, work, policy, say)
    measurements = list(found.values())
    return Measured(work.label, work.flops, measurements, peers, records_of(measurements, work.label))


def _call(item: Run | Peer) -> tuple[Run, Callable[[], ContextManager]]:
    return (item.run, item.scope) if isinstance(item, Peer) else (item, contextlib.nullcontext)


def _per_call(timed: dict[str, Run | Peer], work: Workload, policy: Policy,
              say: Progress) -> tuple[dict[str, float], dict[str, str]]:
    """Per-call load: (name -> ms, name -> reason for those that failed while timed)."""
    def timer(item: Run | Peer) -> Callable[[], float]:
        run, scope = _call(item)

        def once() -> float:
            with scope():
                return timing.median_ms(run, work.copies, warmup=policy.warmup, reps=policy.reps,
                                        graph=policy.graph, flush=work.flush)
        return once

    timers = {name: timer(item) for name, item in timed.items()}
    first, failed = {}, {}
    for name, once in timers.items():
        try:
            first[name] = once()
        except Exception as exc:
            failed[name] = failure(exc)
    best = min((ms for name, ms in first.items() if not name.startswith(PEER)), default=math.inf)
    close = [name for name, ms in first.items() if name.startswith(PEER) or ms <= policy.margin * best]
    if not math.isfinite(best) or len(close) < 2 or policy.rounds < 1:
        return first, failed
    say(f"{len(close)} within {policy.margin - 1:.0%} of the fastest, peers included: {policy.rounds} rounds")
    try:
        got = timing.alternating_rounds({name: timers[name] for name in close}, policy.rounds)
    except (GemmgenError, RuntimeError, OSError) as exc:
        warnings.warn(f"re-timing stopped ({first_line(exc)}); first-pass times kept", GemmgenWarning, stacklevel=3)
        return first, failed
    return {name: statistics.median([ms, *got[name]]) if name in got else ms for name, ms in first.items()}, failed


def _cycled(item: Run | Peer, copies: int) -> Callable[[], None]:
    """A call without arguments that rotates over the copies (scoped for a peer)."""
    run, scope = _call(item)
    turn = itertools.cycle(range(max(1, copies)))
    if isinstance(item, Peer):
        def scoped_call() -> None:
            with scope():
                run(next(turn))
        return scoped_call
    return lambda: run(next(turn))


def _sustained(timed: dict[str, Run | Peer], work: Workload, policy: Policy,
               say: Progress) -> tuple[dict[str, float], dict[str, str]]:
    """Sustained load: (name -> ms, name -> reason); the runs are timed together, so a failure
    among them stops them all."""
    say(f"{len(timed)} under sustained load: {policy.settle_s:g} s settling, {policy.rounds} rounds")
    calls = {name: _cycled(item, work.copies) for name, item in timed.items()}
    try:
        return timing.sustained_ms(calls, rounds=policy.rounds, burst=policy.burst, settle_s=policy.settle_s,
                                   min_burst_ms=policy.min_burst_ms, prune=policy.margin,
                                   fixed=tuple(name for name in timed if name.startswith(PEER))), {}
    except Exception as exc:
        return {}, {name: f"failed while timed with the others: {first_line(exc)}" for name in timed}


def _other_states(timed: dict[str, Measurement], runs: dict[str, Run], work: Workload, policy: Policy,
                  say: Progress) -> None:
    """ms_short and ms_alone of the candidates within the policy's margin of the fastest (in place)."""
    ok = {key: m for key, m in timed.items() if m.ok}
    if not ok:
        return
    best = min(m.ms for m in ok.values())
    contenders = {key: m for key, m in ok.items() if m.ms <= policy.margin * best}
    calls = {key: _cycled(runs[key], work.copies) for key in contenders}
    try:
        if policy.short:
            say(f"{len(contenders)} over short runs")
            short = timing.rounds_ms(calls, rounds=2, reps=SHORT_REPS, warmup=2, hide_host=True)
            for key, m in contenders.items():
                m.ms_short = short.get(key)
        if policy.alone and best >= timing.HOST_BOUND_MS and len(contenders) > 1:
            costs = gemm_select.tuned_costs({key: tuning_db.Record(name=m.name, ms=m.ms, ms_short=m.ms_short)
                                             for key, m in contenders.items()})
            finalists = sorted(contenders, key=lambda key: costs[key])[:policy.finalists]
            say(f"{len(finalists)} finalists alone under load")
            alone = timing.steady_ms({key: calls[key] for key in finalists}, seconds=policy.alone_s,
                                     window_s=policy.alone_s / 2, burst=policy.burst,
                                     min_burst_ms=policy.min_burst_ms)
            for key in finalists:
                contenders[key].ms_alone = alone.get(key)
    except (GemmgenError, RuntimeError, OSError) as exc:
        warnings.warn(f"timing in the other states stopped ({first_line(exc)})", GemmgenWarning, stacklevel=3)
