"""The eager fast path without a GPU (gemmgen.ops.eager): when a call skips torch's dispatcher,
that a signature whose checks passed skips them again while per-call facts (data pointer alignment,
overlap) are still checked, and that the launch params built from a call key's cached prototype
equal params built afresh for every call. tests/gpu runs the kernels through the same path."""
from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import gemmgen
from gemmgen.errors import InputError
from gemmgen.kernels import launch
from gemmgen.ops import attention, eager, kvcache, torch_op

FP16 = torch.float16


def qkv(seed=0, nq=8, nk=24, h=4, hkv=2, d=64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, h, nq, d, generator=g).to(FP16), torch.randn(2, hkv, nk, d, generator=g).to(FP16),
            torch.randn(2, hkv, nk, d, generator=g).to(FP16))


class _Function(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _Dispatch(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _refused_unless_plain_eager(check, q, v):
    """`check` is False under a torch function or dispatch mode, vmap and torch.compile; returns a
    function that records check's answers for tracing, and the list they go to."""
    with _Function():
        assert not check(q, v)
    with _Dispatch():
        assert not check(q, v)
    assert torch.vmap(lambda x: torch.tensor(float(check(x))))(q).eq(0).all()
    seen = []

    def traced(x):
        seen.append(check(x))
        return x + 1

    torch.compile(traced, backend="eager", fullgraph=True)(q)
    assert seen and not any(seen)
    seen.clear()
    return traced, seen


def test_runs_directly_only_where_the_dispatcher_has_nothing_to_do():
    q, k, v = qkv()
    assert eager.runs_directly(q, k, None, v)
    k.requires_grad_()
    assert not eager.runs_directly(q, k, v)  # autograd must record the call
    with torch.no_grad():
        assert eager.runs_directly(q, k, v)
    with torch.inference_mode():
        assert eager.runs_directly(q, k.detach(), v)
    assert not eager.runs_directly(torch.nn.Parameter(q, requires_grad=False), v)  # a subclass
    traced, seen = _refused_unless_plain_eager(eager.runs_directly, q, v)
    torch.jit.trace(traced, (q,), check_trace=False)
    assert seen == [False]


def test_runs_eagerly_allows_autograd_but_nothing_traced_or_transformed():
    q, k, v = qkv()
    k.requires_grad_()
    assert eager.runs_eagerly(q, k, None, v) and not eager.runs_directly(q, k, v)
    assert not eager.runs_eagerly(torch.nn.Parameter(q), v)  # a subclass goes through the op
    assert torch.func.grad(lambda x: x.sum() * float(eager.runs_eagerly(x)) + x.sum())(q).eq(1).all()
    _refused_unless_plain_eager(eager.runs_eagerly, q, v)


def test_signature_reads_metadata_and_refuses_unstrided_tensors():
    q, k, _ = qkv()
    assert eager.signature(q, None) == ((q.shape, q.stride(), q.dtype, q.device, False), None)
    assert eager.signature(q, q.transpose(1, 2).contiguous().transpose(1, 2)) != eager.signature(q, q)
    assert eager.signature(q, k.to_sparse()) is None
    checked = eager.Checked(limit=2)
    for key in ("a", "b", "c"):
        checked.add(key)
    assert "c" in checked and "a" not in checked  # forgotten all at once when full


@pytest.fixture
def fast_path(monkeypatch):
    """fused_attention on CPU tensors past the device check, its implementation recorded, and its
    metadata checks counted."""
    monkeypatch.setattr(attention, "_CHECKED", eager.Checked())
    monkeypatch.setattr(attention, "_check_device", lambda *args: None)
    calls = {"validate": 0, "direct": 0, "op": 0, "training": 0}
    validate = attention._validate

    def counting_validate(*args, **kwargs):
        calls["validate"] += 1
        return validate(*args, **kwargs)

    def direct(q, *args):
        calls["direct"] += 1
        return torch.empty_like(q), torch.empty(0)

    def op(q, *args):
        calls["op"] += 1
        return torch.empty_like(q), torch.empty(0)

    def training(q, *args):
        calls["training"] += 1
        return torch.empty_like(q), torch.empty(0)

    monkeypatch.setattr(attention, "_validate", counting_validate)
    monkeypatch.setattr(torch_op, "run_fused_attention", direct)
    monkeypatch.setattr(torch_op, "fused_attention_op", op)
    monkeypatch.setattr(torch_op, "run_fused_attention_training", training)
    return calls


def test_a_signature_is_checked_once_and_pointers_every_call(fast_path):
    q, k, v = qkv()
    gemmgen.fused_attention(q, k, v, causal=True)
    gemmgen.fused_attention(*qkv(seed=1), causal=False)  # new data, same signature
    assert fast_path == {"validate": 1, "direct": 2, "op": 0, "training": 0}
    gemmgen.fused_attention(q.transpose(1, 2).contiguous().transpose(1, 2), k, v)  # new strides: checked
    assert fast_path["validate"] == 2
    store = torch.empty(q.numel() + 8, dtype=FP16)
    shifted = store[1:q.numel() + 1].view(q.shape)  # q's signature, a pointer 2 bytes off
    with pytest.raises(InputError, match="q's data pointer is not 16-byte aligned"):
        gemmgen.fused_attention(shifted, k, v)
    with pytest.raises(InputError, match="must share one dtype"):  # a new signature is checked in full
        gemmgen.fused_attention(q, k.to(torch.bfloat16), v)


def test_training_calls_and_grad_free_calls_of_grad_tensors(fast_path):
    q, k, v = qkv()
    q.requires_grad_()
    gemmgen.fused_attention(q, k, v)
    # autograd records it: eager, by the op's pieces in a torch.autograd.Function
    assert fast_path["training"] == 1 and fast_path["op"] == 0 and fast_path["direct"] == 0
    with torch.no_grad():
        gemmgen.fused_attention(q, k, v)
    assert fast_path["direct"] == 1 and fast_path["training"] == 1
    with pytest.raises(InputError, match="out= has no backward"):  # never skipped by a checked signature
        gemmgen.fused_attention(q, k, v, out=torch.empty_like(q))


def test_out_overlap_is_checked_on_every_call(fast_path, monkeypatch):
    monkeypatch.setattr(torch_op, "run_fused_attention_out", lambda q, *args: torch.empty(0))
    q, k, v = qkv()
    gemmgen.fused_attention(q, k, v, out=torch.empty_like(q))
    with pytest.raises(InputError, match="out overlaps q"):
        gemmgen.fused_attention(q, k, v, out=q)


class _Recording:
    needs_lse, kv_cache = False, True

    def __init__(self):
        self.asked = 0

    def workspace_bytes(self, p):
        self.asked += 1
        return 0

    def append(self, args, stream):
        pass


def _fields(p) -> dict:
    return {name: getattr(p, name) for name, _ in p._fields_}


@pytest.fixture
def launches(monkeypatch):
    kernel = _Recording()
    monkeypatch.setattr(torch_op, "_kernels", {})
    monkeypatch.setattr(torch_op, "_kernel_for",
                        lambda key, problem_of, *rest: torch_op._kernels.setdefault(key, torch_op._Plan(kernel, 3)))
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    recorded = []
    monkeypatch.setattr(launch, "launch", lambda k, p, index, ws=None, owned=False: recorded.append((p, ws)))
    return kernel, recorded


def test_params_from_the_key_prototype_equal_fresh_params(launches):
    kernel, recorded = launches
    for seed in range(3):
        q, k, v = qkv(seed=seed)
        o, lse = torch.empty_like(q), torch.empty(q.shape[:3])
        torch_op._run(q, k, v, o, lse if seed != 1 else None, True, "bottom_right", 0.5, None)
        fresh = launch.params(q, k, v, o, lse if seed != 1 else None, causal=True, causal_alignment="bottom_right",
                              scale=0.5)
        fresh.num_splits = 3
        assert _fields(recorded[-1][0]) == _fields(fresh)
    assert kernel.asked == 1 and recorded[0][0] is not recorded[1][0]


def test_kvcache_params_from_the_key_prototype_equal_fresh_params(launches):
    kernel, recorded = launches
    g = torch.Generator().manual_seed(0)
    table = torch.randperm(9, generator=g)[:8].view(2, 4).to(torch.int32)
    for seed in range(3):
        q = torch.randn(2, 3, 8, 64, generator=g).to(FP16)
        cache = torch.randn(9, 16, 2, 64, generator=g).to(FP16)
        lens = torch.tensor([5 + seed, 40], dtype=torch.int32)
        o, lse = torch_op._fused_attention_with_kvcache(q, cache, cache.clone(), lens, table, None, None, True, None,
                                                        seed != 1, None)
        fresh = launch.params_kvcache(q, cache, cache, lens, table, o, lse if seed != 1 else None, causal=True,
                                      scale=None, capacity=64)
        fresh.num_splits = 3
        got = _fields(recorded[-1][0])
        assert got.pop("v") != fresh.v  # v_cache is a clone: its own pointer
        assert got == {name: value for name, value in _fields(fresh).items() if name != "v"}
    assert kernel.asked == 1


def test_kvcache_signature_is_checked_once(monkeypatch):
    monkeypatch.setattr(kvcache, "_CHECKED", eager.Checked())
    monkeypatch.setattr(kvcache, "_check_device", lambda *args: None)
    counted = []
    validate = kvcache._validate
    monkeypatch.setattr(kvcache, "_validate", lambda *args: counted.append(1) or validate(*args))
    monkeypatch.setattr(torch_op, "run_fused_attention_with_kvcache", lambda q, *args: (q, torch.empty(0)))
    q = torch.randn(2, 1, 8, 64).to(FP16)
    cache = torch.randn(2, 32, 2, 64).to(FP16)
    lens = torch.tensor([3, 7], dtype=torch.int32)
    for _ in range(3):
        gemmgen.fused_attention_with_kvcache(q, cache, cache, lens)
    assert len(counted) == 1
    store = torch.empty(q.numel() + 8, dtype=FP16)
    with pytest.raises(InputError, match="q's data pointer is not 16-byte aligned"):
        gemmgen.fused_attention_with_kvcache(store[1:q.numel() + 1].view(q.shape), cache, cache, lens)
    with pytest.raises(InputError, match=r"cache_seqlens \+ new tokens must lie in"):  # values: every call
        gemmgen.fused_attention_with_kvcache(q, cache, cache, lens + 30, check_values=True)

