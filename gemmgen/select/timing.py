"""GPU timing for autotune and profile: CUDA events around each call after a warm-up, the median of
the repeats, inputs rotated over copies so that they do not stay in L2 (or L2 flushed before each
call when the copies cannot outgrow it); optionally each call queued behind a spin kernel, so the
events time the kernels alone (device time, the host path hidden), or the calls replayed from a
CUDA graph."""
from __future__ import annotations

import math
import statistics
from typing import Callable

import torch

ROTATE_FACTOR = 2  # the rotated copies together hold at least this many times the L2 size
MAX_COPIES = 64
MEMORY_SHARE = 0.25  # of the free GPU memory, at most, for the copies
GRAPH_CALLS = 20  # calls per captured graph at least, so the graph's own launch is amortized
# GPU cycles of the spin kernel ahead of each call timed with hide_host (about 0.5 ms at H200
# clocks): far longer than any host path, so the call is queued before the GPU reaches it.
HIDE_HOST_CYCLES = 1_000_000
DEFAULT_L2_BYTES = 64 * 1024 * 1024


def plan_copies(set_bytes: int, l2_bytes: int, free_bytes: int) -> tuple[int, bool]:
    """(number of input copies to rotate over, whether to flush L2 before each call instead).

    Enough copies to hold ROTATE_FACTOR x L2, within MAX_COPIES and MEMORY_SHARE of free memory;
    when that cannot outgrow L2 (tiny problems), one copy and an L2 flush."""
    l2 = l2_bytes or DEFAULT_L2_BYTES
    budget = max(int(free_bytes * MEMORY_SHARE), set_bytes)
    want = -(-ROTATE_FACTOR * l2 // max(set_bytes, 1))
    copies = max(1, min(want, MAX_COPIES, budget // max(set_bytes, 1)))
    if copies * set_bytes >= ROTATE_FACTOR * l2:
        return copies, False
    return 1, True


def flush_buffer(index: int, l2_bytes: int) -> torch.Tensor:
    """A buffer whose zeroing evicts L2 (twice its size)."""
    return torch.empty(ROTATE_FACTOR * (l2_bytes or DEFAULT_L2_BYTES), dtype=torch.uint8,
                       device=f"cuda:{index}")


def median_ms(run: Callable[[int], None], copies: int, *, warmup: int = 5, reps: int = 30,
              graph: bool = False, flush: torch.Tensor | None = None, hide_host: bool = False) -> float:
    """Median milliseconds of one call `run(i)` (i: the copy to use), on the current stream.

    Without `graph`: CUDA events around each of `reps` calls (after `warmup` calls), L2 flushed
    before each when `flush` is given. The events then time what a caller waits for, host path
    included when the kernels are shorter than it; with `hide_host` a spin kernel runs ahead of
    each call, so the events time the call's kernels alone, each on its own as a profiler would.
    With `graph`: one CUDA graph holds at least GRAPH_CALLS calls cycling over the copies; each
    replay is timed and divided by its calls (back-to-back kernels, no launch overhead)."""
    if graph:
        return _graph_median_ms(run, copies, warmup=warmup, reps=reps)
    for i in range(warmup):
        run(i % copies)
    start = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        if flush is not None:
            flush.zero_()
        if hide_host:
            torch.cuda._sleep(HIDE_HOST_CYCLES)
        start[i].record()
        run(i % copies)
        end[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(start, end))


def alternating_rounds(timers: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Each timer's results over `rounds` rounds, the timers in alternating order (forward, then
    backward), so that none is always timed right after the same one or always first while the
    GPU warms."""
    names = list(timers)
    got: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            got[name].append(timers[name]())
    return got


def rounds_ms(runs: dict[str, Callable[[], None]], *, rounds: int, reps: int, warmup: int = 5,
              hide_host: bool = False) -> dict[str, float]:
    """Each run's median over `rounds` alternating rounds (alternating_rounds) of its per-call
    median (median_ms: `reps` calls, each timed on its own)."""
    timers = {name: (lambda f=f: median_ms(lambda _i: f(), 1, warmup=warmup, reps=reps, hide_host=hide_host))
              for name, f in runs.items()}
    return {name: statistics.median(t) for name, t in alternating_rounds(timers, rounds).items()}


def _graph_median_ms(run: Callable[[int], None], copies: int, *, warmup: int, reps: int) -> float:
    calls = max(copies, GRAPH_CALLS)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the capture, as torch.cuda.graph asks
        for i in range(copies):
            run(i)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            run(i % copies)
    for _ in range(max(1, warmup)):
        g.replay()
    start = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        start[i].record()
        g.replay()
        end[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) / calls for s, e in zip(start, end))


def burst_ms(run: Callable[[], None], calls: int) -> float:
    """Milliseconds per call of `calls` back-to-back calls, queued behind a spin kernel so that the
    events time the kernels alone (the host enqueues them while the spin runs)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(HIDE_HOST_CYCLES)
    start.record()
    for _ in range(calls):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


# A call shorter than this may be host-bound in a long burst (the host path costs 10-20 us per
# call), so its bursts keep their fixed count; longer calls get bursts of at least min_burst_ms.
HOST_BOUND_MS = 0.05


def burst_calls(est_ms: float, burst: int, min_burst_ms: float) -> int:
    """Calls per timed burst: `burst`, or enough to last `min_burst_ms` when one call (`est_ms`)
    is long enough for the host to stay ahead of the GPU."""
    if min_burst_ms <= 0 or not est_ms < math.inf or est_ms < HOST_BOUND_MS:
        return burst
    return max(burst, math.ceil(min_burst_ms / est_ms))


def sustained_ms(runs: dict[str, Callable[[], None]], *, rounds: int = 3, burst: int = 10,
                 settle_s: float = 1.0, min_burst_ms: float = 0.0, prune: float = 0.0,
                 fixed: tuple[str, ...] = ()) -> dict[str, float]:
    """Median milliseconds per call of each run, in the state a sustained workload runs in.

    Heavy kernels bring the H200 to its power cap within about a second, and the cap lowers the SM
    clock (bench/NOTES.md, experiment 10); kernels that spend more energy per result then slow more
    than others, so a ranking taken on a cool GPU can invert under load. Here the runs first cycle in
    bursts of `burst` calls for `settle_s` seconds (at least one pass, which also estimates each
    call's time), then `rounds` rounds time one burst of each run, in alternating order (forward,
    then backward), so that no run always follows the same one. With `min_burst_ms`, a run's timed
    bursts last at least that long (burst_calls): a burst of a few milliseconds is about as long as
    the power controller takes to react, so it would partly run at the clock its predecessor left
    (bench/NOTES.md, experiment 19). With `prune`, runs slower than `prune` times the fastest in
    the last settling pass skip the rounds and keep that pass's time: they cannot win, and their
    lighter bursts would raise the clock the next run is timed at; the runs named in `fixed` (a
    reference such as cuBLAS) are always timed."""
    import time

    names = list(runs)
    est: dict[str, float] = {}
    end = time.monotonic() + settle_s
    while True:
        for name in names:
            est[name] = burst_ms(runs[name], burst)
        if time.monotonic() >= end:
            break
    if prune > 0:
        fastest = min((t for name, t in est.items() if name not in fixed), default=0.0)
        timed = [name for name in names if name in fixed or est[name] <= prune * fastest]
    else:
        timed = names
    calls = {name: burst_calls(est[name], burst, min_burst_ms) for name in timed}
    got = alternating_rounds({name: (lambda name=name: burst_ms(runs[name], calls[name])) for name in timed}, rounds)
    return {name: statistics.median(got[name]) if name in got else est[name] for name in names}


def steady_ms(runs: dict[str, Callable[[], None]], *, seconds: float = 1.5, window_s: float = 0.75,
              rounds: int = 2, burst: int = 10, min_burst_ms: float = 0.0,
              clock: Callable[[], float] | None = None) -> dict[str, float]:
    """Median milliseconds per call of each run alone, in the steady state it holds under sustained load.

    Each run in turn has the GPU to itself for `seconds` of back-to-back bursts (burst_ms, sized
    by burst_calls), long enough for the power controller to settle at the clock that run draws at
    the cap (within a second: bench/NOTES.md, experiment 10); its time is the median burst that
    started in the last `window_s`. The turns go in alternating order (forward, then backward: with
    two runs A B B A), so the GPU's slow warming over a long run (times 5% longer after half a
    minute, experiment 27) weighs on each run alike; the result is the median over `rounds` turns.
    Unlike sustained_ms, whose every burst starts at the clock the run before it left, a run's time
    here does not depend on which runs are timed with it (experiment 48)."""
    import time

    now = clock or time.monotonic

    def turn(run: Callable[[], None]) -> float:
        calls = burst_calls(burst_ms(run, burst), burst, min_burst_ms)
        end = now() + seconds
        got: list[tuple[float, float]] = []
        while True:
            started = now()
            got.append((started, burst_ms(run, calls)))
            if now() >= end:
                break
        last = [ms for started, ms in got if started >= end - window_s] or [got[-1][1]]
        return statistics.median(last)

    timers = {name: (lambda f=f: turn(f)) for name, f in runs.items()}
    return {name: statistics.median(t) for name, t in alternating_rounds(timers, rounds).items()}
