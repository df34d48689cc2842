"""Autotune: measure every candidate of a problem, check each one's output, remember the times.

For each shape, gemmgen.select.measure.measure runs an AttentionWorkload: every candidate is first
checked against the float64 reference on a small proxy problem of the same functional key (same
dtype, head dim, mask, layout kind, GQA ratio), then run once at the real size and checked on
sampled rows, then timed per call (gemmgen.select.timing) on inputs of the real size. Candidates
within CONTEND_MARGIN of the fastest are then timed again in CONTEND_ROUNDS rounds of alternating
order, each keeping the median of its times: one pass in a fixed order lets the GPU's clock, which
the power cap moves within a second, favour one of two near-equal tiles. A candidate that fails to
load or launch, or gives a wrong result, gets infinite time and keeps its reason; it can never win.
All times go into the GPU's tuning database under the shape's bucket, so later calls in that bucket
run the winner (gemmgen.select.selection, source "tuned"). A kernel that corrupts the CUDA context
(an illegal address) fails every later launch of the process as well; the reasons of the
candidates after it then say so.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
import zlib
from pathlib import Path
from typing import Any, Iterable

import torch

from gemmgen.select import device as device_mod
from gemmgen.kernels import launch
from gemmgen.select import calls, measure as measuring, registry, selection, timing, tuning_db
from gemmgen.select.measure import Measurement, WrongResult, record
from gemmgen.errors import CacheError, GemmgenWarning
from gemmgen.select.problem import ALIGN_BYTES, BwdProblem, Problem
from gemmgen.select.reference import attention_reference
from gemmgen.select.registry import Candidate
from gemmgen.select.selection import WRONG_RESULT
from gemmgen.select.shapes import Shape, parse_shape

TOLERANCE = {"fp16": 2e-3, "bf16": 1e-2}  # relative Frobenius error ||O - ref|| / ||ref||
# The backward's gradients: its kernels round P and dS to the input dtype before their GEMMs.
BWD_TOLERANCE = {"fp16": 1e-2, "bf16": 3e-2}
LSE_TOLERANCE = 1e-3
PROXY_LEN, PROXY_LEN_K = 257, 263  # odd: partial tiles and the causal diagonal are exercised
SAMPLED_ROWS = 8
# A tuning on the H200 picked a tile 0.7% ahead in its one pass that ran 10% behind in rounds of
# alternating order (bench/NOTES.md, experiment 23).
CONTEND_MARGIN = 1.05
CONTEND_ROUNDS = 3

Progress = measuring.Progress


@dataclasses.dataclass
class TuneResult:
    """What autotune measured for one shape."""

    shape: Shape
    problem: Problem
    measurements: list[Measurement]
    database: Path | None = None  # where the times were stored (None: not stored)

    @property
    def winner(self) -> Measurement | None:
        """The fastest measurement that passed its checks."""
        return measuring.fastest(self.measurements)


def make_qkv(shape: Shape, index: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh standard-normal q, k, v on device `index` in the shape's layout kind."""
    dtype = launch.TORCH_DTYPES[shape.dtype]
    gen = torch.Generator(device=f"cuda:{index}").manual_seed(seed)

    def randn(heads: int, n: int, seq_outer: bool) -> torch.Tensor:
        dims = (shape.batch, n, heads, shape.head_dim) if seq_outer else (shape.batch, heads, n, shape.head_dim)
        t = torch.randn(dims, dtype=dtype, device=f"cuda:{index}", generator=gen)
        return t.transpose(1, 2) if seq_outer else t

    q_outer = shape.layout == "bnhd"
    kv_outer = shape.layout in ("bnhd", "mixed")
    return (randn(shape.heads, shape.seqlen_q, q_outer), randn(shape.kv_heads, shape.seqlen_k, kv_outer),
            randn(shape.kv_heads, shape.seqlen_k, kv_outer))


def proxy_shape(shape: Shape) -> Shape:
    """A small problem of the same functional key, cheap to check against float64."""
    gqa = shape.heads // shape.kv_heads
    hkv = min(shape.kv_heads, 2)
    nk = min(shape.seqlen_k, PROXY_LEN if shape.seqlen_q == shape.seqlen_k else PROXY_LEN_K)
    return dataclasses.replace(shape, batch=1, heads=hkv * gqa, heads_kv=hkv,
                               seqlen_q=min(shape.seqlen_q, PROXY_LEN), seqlen_k=nk)


def _run(kernel: Any, q, k, v, o, lse, causal: bool) -> None:
    p = launch.params(q, k, v, o, lse, causal=causal, causal_alignment="top_left", scale=None)
    p.num_splits = 2 if kernel.kv_cache else 0  # a split-KV kernel's gate covers its combine too
    launch.launch(kernel, p, q.get_device())


def check_proxy(kernel: Any, shape: Shape, index: int) -> float:
    """Run `kernel` on the proxy problem and compare O and LSE with float64; returns the relative
    error; raises WrongResult."""
    small = proxy_shape(shape)
    q, k, v = make_qkv(small, index, seed=zlib.crc32(small.spec().encode()))
    o = launch.empty_like_layout(q).fill_(float("nan"))
    lse = torch.full(q.shape[:3], float("nan"), dtype=torch.float32, device=q.device)
    _run(kernel, q, k, v, o, lse, shape.causal)
    ref, ref_lse = attention_reference(q, k, v, shape.causal)
    err = ((o.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()
    seen = torch.isfinite(ref_lse)
    lse_gap = (lse.double() - ref_lse).abs() / ref_lse.abs().clamp_min(1.0)
    lse_err = lse_gap[seen].max().item() if seen.any() else 0.0
    if not torch.equal(torch.isneginf(lse), ~seen):
        lse_err = math.inf
    if not err <= TOLERANCE[shape.dtype] or not lse_err <= LSE_TOLERANCE:  # NaN fails
        raise WrongResult(f"{WRONG_RESULT}: relative error {err:.2e} (tolerance {TOLERANCE[shape.dtype]:.0e}), "
                          f"LSE error {lse_err:.2e} on {small.describe()}")
    return err


def check_sampled_rows(q, k, v, o, shape: Shape) -> None:
    """Compare SAMPLED_ROWS rows of the first and last (batch, head) of a real-size output with
    float64; raise WrongResult."""
    group = shape.heads // shape.kv_heads
    rows = torch.linspace(0, shape.seqlen_q - 1, SAMPLED_ROWS, device=q.device).long().unique()
    for b, h in ((0, 0), (shape.batch - 1, shape.heads - 1)):
        qs = q[b, h, rows].double()
        ks, vs = k[b, h // group].double(), v[b, h // group].double()
        scores = (qs @ ks.T) / math.sqrt(shape.head_dim)
        if shape.causal:
            cols = torch.arange(shape.seqlen_k, device=q.device)
            scores = scores.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
        ref = torch.softmax(scores, dim=-1).nan_to_num(0.0) @ vs
        err = ((o[b, h, rows].double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()
        if not err <= TOLERANCE[shape.dtype]:
            raise WrongResult(f"{WRONG_RESULT}: relative error {err:.2e} on sampled rows of {shape.describe()}")


def policy(warmup: int = 5, reps: int = 30, graph: bool = False) -> measuring.Policy:
    """The attention's timing: per call (`reps` calls after `warmup`, median; `graph`: CUDA graph
    replays), then CONTEND_ROUNDS rounds for the candidates within CONTEND_MARGIN of the fastest."""
    return measuring.Policy(load="calls", warmup=warmup, reps=reps, graph=graph, margin=CONTEND_MARGIN,
                            rounds=CONTEND_ROUNDS)


class AttentionWorkload:
    """One attention shape for gemmgen.select.measure.measure, on CUDA device `index` (which must
    be the current device while it is measured): q, k, v in as many copies as keep them out of L2
    (timing.plan_copies; else one copy and an L2 flush before each call), outputs made once, and
    the gate: the proxy check against float64, then one real-size call checked on sampled rows.
    `peers` (none unless set) run on the same input copies."""

    def __init__(self, shape: Shape, index: int, *, graph: bool = False) -> None:
        facts = device_mod.facts(index)
        self.shape, self.index = shape, index
        self.label, self.flops = shape.spec(), shape.flops
        self.problem = problem_of(shape, index)
        with torch.cuda.device(index):
            q0, k0, v0 = make_qkv(shape, index, seed=1)
            set_bytes = sum(t.numel() * t.element_size() for t in (q0, k0, v0, q0))
            self.copies, flush = timing.plan_copies(set_bytes, facts.l2_bytes, torch.cuda.mem_get_info(index)[0])
            self.inputs = [(q0, k0, v0)] + [make_qkv(shape, index, seed=2 + i) for i in range(self.copies - 1)]
            self.outs = [launch.empty_like_layout(q) for q, _, _ in self.inputs]
            self.flush = timing.flush_buffer(index, facts.l2_bytes) if flush and not graph else None
        self.peers: dict[str, measuring.Peer] = {}

    def prepare(self, cand: Candidate) -> tuple[measuring.Run, float]:
        """The gate: the proxy check (check_proxy), then one real-size call checked on sampled rows;
        returns the candidate's call on copy i, its params and LSE buffers (for kernels that always
        write LSE) made here so that nothing is allocated inside the timed calls, and the proxy's
        relative error. Raises WrongResult."""
        kernel, causal, index = cand.kernel, self.shape.causal, self.index
        err = check_proxy(kernel, self.shape, index)
        lses = [torch.empty(q.shape[0] * q.shape[1] * q.shape[2], dtype=torch.float32, device=q.device)
                if kernel.needs_lse else None for q, _, _ in self.inputs]
        prepared = [launch.params(q, k, v, o, lse, causal=causal, causal_alignment="top_left", scale=None)
                    for (q, k, v), o, lse in zip(self.inputs, self.outs, lses)]
        splits = selection.splits(cand, self.problem)
        for p in prepared:
            p.num_splits = splits

        def run(i: int, _lses: list = lses) -> None:  # holds the LSE buffers as long as the run lives
            launch.launch(kernel, prepared[i], index)
        self.outs[0].fill_(float("nan"))
        run(0)
        check_sampled_rows(*self.inputs[0], self.outs[0], self.shape)
        return run, err


def measure(cands: list[Candidate], shape: Shape, *, index: int, warmup: int = 5, reps: int = 30,
            graph: bool = False, progress: Progress | None = None) -> list[Measurement]:
    """Check and time every candidate on `shape` (see the module docstring), in the order given."""
    with torch.cuda.device(index):
        work = AttentionWorkload(shape, index, graph=graph)
        return measuring.measure(cands, work, policy(warmup, reps, graph), progress).measurements


def problem_of(shape: Shape, index: int) -> Problem:
    """The Problem of a shape on device `index`."""
    return Problem(dtype=shape.dtype, head_dim=shape.head_dim, causal=shape.causal,
                   device=device_mod.facts(index), batch_heads=shape.batch * shape.heads,
                   seqlen_q=shape.seqlen_q, seqlen_k=shape.seqlen_k,
                   gqa=shape.heads // shape.kv_heads, layout=shape.layout, align=ALIGN_BYTES)


def records_of(result: TuneResult) -> dict[str, tuning_db.Record]:
    """The tuning-database records of one result, by content hash."""
    return measuring.records_of(result.measurements, result.shape.spec())


def store(result: TuneResult, *, strict: bool = True) -> Path | None:
    """Write a result into the tuning database. With strict=False an unwritable cache is a warning
    and the times are kept in memory for this process."""
    records = records_of(result)
    try:
        return record(result.problem, records).path
    except (CacheError, OSError) as exc:
        if strict:
            raise
        warnings.warn(f"gemmgen: tuning results not stored ({exc}); kept for this process only",
                      GemmgenWarning, stacklevel=2)
        problem = result.problem
        tuning_db.remember(problem.device.fingerprint(),
                           {problem.functional_key: {problem.bucket_key: {h: r.to_json() for h, r in records.items()}}})
        registry.refresh()  # cached decisions predate these times
        return None


def bwd_problem_of(shape: Shape, index: int) -> BwdProblem:
    """The BwdProblem of a shape's backward on device `index`: K and V reach the kernel with Q's
    heads (the op expands them), so its GQA ratio is 1."""
    fields = {f.name: getattr(problem_of(shape, index), f.name) for f in dataclasses.fields(Problem)}
    return BwdProblem(**{**fields, "gqa": 1})


def check_proxy_bwd(kernel: Any, shape: Shape, index: int) -> float:
    """Run the backward `kernel` on the proxy problem, from the float64 forward's O and LSE, into
    NaN-filled gradients, and compare dQ, dK, dV (K and V expanded to Q's heads) with float64
    autograd; returns the largest relative error; raises WrongResult."""
    small = proxy_shape(shape)
    q, k, v = make_qkv(small, index, seed=zlib.crc32(f"bwd {small.spec()}".encode()))
    group = small.heads // small.kv_heads
    k, v = launch.expand_heads(k, group), launch.expand_heads(v, group)
    do = torch.randn(q.shape, dtype=q.dtype, device=q.device,
                     generator=torch.Generator(device=q.device).manual_seed(7))
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    with torch.enable_grad():
        ref, ref_lse = attention_reference(*leaves, shape.causal)
        grads = torch.autograd.grad(ref, leaves, do.double())
    o = launch.empty_like_layout(q).copy_(ref.detach())
    lse = ref_lse.detach().float().contiguous()
    dq, dk, dv = (launch.empty_like_layout(t).fill_(float("nan")) for t in (q, k, v))
    launch.run_bwd(kernel, launch.params_bwd(q, k, v, o, do, lse, dq, dk, dv, causal=shape.causal,
                                             causal_alignment="top_left", scale=None), index)
    errors = [((g.double() - w).norm() / w.norm().clamp_min(1e-300)).item() for g, w in zip((dq, dk, dv), grads)]
    worst = max(errors, key=lambda e: math.inf if math.isnan(e) else e)
    if not worst <= BWD_TOLERANCE[shape.dtype]:  # NaN fails
        raise WrongResult(f"{WRONG_RESULT}: gradient errors dQ {errors[0]:.2e}, dK {errors[1]:.2e}, dV "
                          f"{errors[2]:.2e} (tolerance {BWD_TOLERANCE[shape.dtype]:.0e}) on {small.describe()}")
    return worst


class BackwardWorkload:
    """One attention shape's backward for gemmgen.select.measure.measure, on CUDA device `index` (the
    current device while it is measured): q, K and V expanded to q's heads as the op passes them, O
    and LSE from the forward the registry picks, dO, gradients made once (one input copy: a backward
    reads several times the forward's bytes, and its time is long against an L2's refill). The gate:
    the proxy check against float64 autograd (check_proxy_bwd), then one real-size call whose
    gradients must all be finite. `peers` (none unless set) are torch's backward passes."""

    copies = 1
    flush = None

    def __init__(self, shape: Shape, index: int) -> None:
        self.shape, self.index = shape, index
        self.label, self.flops = f"bwd {shape.spec()}", 2.5 * shape.flops
        self.problem = bwd_problem_of(shape, index)
        q, k, v = make_qkv(shape, index, seed=1)
        group = shape.heads // shape.kv_heads
        self.qkv = (q, k, v)
        self.k, self.v = launch.expand_heads(k, group), launch.expand_heads(v, group)
        self.o, self.lse = launch.empty_like_layout(q), torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        forward = registry_select(problem_of(shape, index))
        launch.launch(forward.kernel, launch.params(q, self.k, self.v, self.o, self.lse, causal=shape.causal,
                                                   causal_alignment="top_left", scale=None), index)
        self.do = torch.randn(q.shape, dtype=q.dtype, device=q.device)
        self.grads = tuple(launch.empty_like_layout(t) for t in (q, self.k, self.v))
        self.peers: dict[str, measuring.Peer] = {}

    def prepare(self, cand: Candidate) -> tuple[measuring.Run, float]:
        """The gate, then the candidate's call with its params and workspace made here."""
        kernel, index = cand.kernel, self.index
        err = check_proxy_bwd(kernel, self.shape, index)
        q = self.qkv[0]
        p = launch.params_bwd(q, self.k, self.v, self.o, self.do, self.lse, *self.grads, causal=self.shape.causal,
                              causal_alignment="top_left", scale=None)
        workspace = launch.bwd_workspace(kernel, p, index)

        def run(_i: int, _workspace: torch.Tensor = workspace) -> None:  # holds the workspace while it lives
            kernel.run(p, launch.raw_stream(index))
        for g in self.grads:
            g.fill_(float("nan"))
        run(0)
        if not all(torch.isfinite(g).all().item() for g in self.grads):
            raise WrongResult(f"{WRONG_RESULT}: non-finite gradients on {self.shape.describe()}")
        return run, err


def registry_select(problem: Problem) -> Candidate:
    """The forward the registry picks for `problem` (the backward workload's O and LSE)."""
    from gemmgen.select import selection

    return selection.select(problem)


def measure_backward(cands: list[Candidate], shape: Shape, *, index: int, warmup: int = 5, reps: int = 30,
                     progress: Progress | None = None, peers: dict | None = None) -> list[Measurement]:
    """Check and time every backward candidate on `shape`, per call (policy), in the order given."""
    with torch.cuda.device(index):
        work = BackwardWorkload(shape, index)
        work.peers = peers(work) if peers else {}
        return measuring.measure(cands, work, policy(warmup, reps, False), progress).measurements


def tune_shape(shape: Shape, *, index: int | None = None, candidates: list[Candidate] | None = None,
               warmup: int = 5, reps: int = 30, graph: bool = False, save: bool = True,
               strict: bool = True, progress: Progress | None = None) -> TuneResult:
    """Measure every candidate of one shape (or `candidates`) and store the times (unless save=False)."""
    index = torch.cuda.current_device() if index is None else index
    problem = problem_of(shape, index)
    cands = registry.candidates(problem)[0] if candidates is None else candidates
    result = TuneResult(shape, problem, measure(cands, shape, index=index, warmup=warmup, reps=reps,
                                                graph=graph, progress=progress))
    if save and result.measurements:
        result.database = store(result, strict=strict)
    return result


def tune_backward(shape: Shape, *, index: int | None = None, warmup: int = 5, reps: int = 30,
                  save: bool = True, strict: bool = True, progress: Progress | None = None) -> TuneResult:
    """Measure every backward candidate of one shape and store the times under its BwdProblem's
    bucket (unless save=False): later backward passes in that bucket run the winner."""
    index = torch.cuda.current_device() if index is None else index
    problem = bwd_problem_of(shape, index)
    cands = registry.candidates(problem)[0]
    result = TuneResult(shape, problem, measure_backward(cands, shape, index=index, warmup=warmup, reps=reps,
                                                         progress=progress))
    if save and result.measurements:
        result.database = store(result, strict=strict)
    return result


def autotune(problems: Iterable[Shape | str], *, device: int | None = None, warmup: int = 5, reps: int = 30,
             graph: bool = False, save: bool = True, backward: bool = False) -> list[TuneResult]:
    """Tune each problem (a Shape, or "B,H,N,d[,causal]" text for bf16) on CUDA device `device`
    (default: the current one): every candidate checked and timed, the times stored in the tuning
    database. Later fused_attention calls in the same size buckets run the winners. With
    backward=True the backward instances are tuned instead (for training; graph is not used)."""
    shapes = [parse_shape(p) if isinstance(p, str) else p for p in problems]
    if backward:
        return [tune_backward(s, index=device, warmup=warmup, reps=reps, save=save) for s in shapes]
    return [tune_shape(s, index=device, warmup=warmup, reps=reps, graph=graph, save=save) for s in shapes]


def tune_call(q: torch.Tensor, k: torch.Tensor, causal: bool) -> TuneResult:
    """Tune the bucket of one fused_attention call (GEMMGEN_AUTOTUNE=1), on fresh inputs of its shape."""
    b, h, nq, d = q.shape
    problem = calls.problem_for(q, k, causal)
    shape = Shape(b, h, nq, k.shape[2], d, causal=causal, dtype=problem.dtype, heads_kv=k.shape[1],
                  layout=problem.layout)
    return tune_shape(shape, index=q.get_device(), strict=False)
