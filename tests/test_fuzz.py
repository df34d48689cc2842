"""Property-based checks of every public function on CPU tensors (hypothesis): random shapes (0
included), strides, views, storage offsets, dtypes and keyword values. Validation runs before the
device check, so each call must raise a GemmgenError subclass: InputError where an oracle written
from the documented rules says the input is bad, DeviceError where it says it is well formed.
The oracles below restate the docstrings' rules independently of gemmgen's own checks."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gemmgen
from gemmgen.ops.padding import tile_head_dims

pytestmark = pytest.mark.filterwarnings("ignore")
SETTINGS = settings(max_examples=3000, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
ALIGN = 8  # elements of 2 bytes: 16-byte aligned strides and data
BAD_NUMBERS = [float("nan"), float("inf"), -float("inf"), 10**400, True, "1", [1.0]]


def build(shape, dtype, view: str, pad: int, offset: int) -> torch.Tensor:
    """A tensor of `shape` as a view: "contig", "bnhd" (stored [B, N, H, d], seen as [B, H, N, d]),
    "padded" (each row of the last dim padded by `pad` elements), with `offset` leading elements."""
    if view == "bnhd" and len(shape) == 4:
        b, h, n, d = shape
        stored = (b, n, h, d)
    else:
        stored = tuple(shape)
    last = stored[-1] + (pad if view == "padded" else 0)
    base = torch.randn(offset + math.prod(stored[:-1]) * last + 1, dtype=torch.float32).to(dtype)
    t = base[offset:offset + math.prod(stored[:-1]) * last].view(*stored[:-1], last)[..., :stored[-1]]
    return t.transpose(1, 2) if view == "bnhd" and len(shape) == 4 else t


def stride_bad(t: torch.Tensor) -> bool:
    """The documented stride rule: contiguous last dim, other strides multiples of 8 elements
    (dims of size 1 never stepped over), data 16-byte aligned."""
    *outer, last = list(zip(t.shape, t.stride()))
    if last[0] > 1 and last[1] != 1:
        return True
    if any(n > 1 and s % ALIGN for n, s in outer):
        return True
    return t.numel() > 0 and (t.storage_offset() * t.element_size()) % 16 != 0


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0 or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    def span(t):
        lo = t.storage_offset() * t.element_size()
        return lo, lo + (sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 1) + 1) * t.element_size()
    (alo, ahi), (blo, bhi) = span(a), span(b)
    return alo < bhi and blo < ahi


def number_bad(x, *, low=None, high=None, none_ok=True) -> bool:
    if x is None:
        return not none_ok
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return True
    try:
        f = float(x)
    except OverflowError:
        return True
    return not math.isfinite(f) or (low is not None and f < low) or (high is not None and f >= high)


# Mostly valid values, so that both outcomes are exercised: each draw is well formed more often
# than not, and a case is bad when any one of its draws is.
views = st.sampled_from(["contig", "contig", "bnhd", "bnhd", "padded"])
pads = st.sampled_from([8, 16, 8, 1, 3])
offsets = st.sampled_from([0] * 8 + [1, 8])
small = st.sampled_from([1, 2, 3, 1, 2, 0])
lengths = st.sampled_from([1, 17, 129, 1, 17, 0])
head_dims = st.sampled_from([32, 64, 128, 80, 96, 256, 32, 64, 8, 0, 81, 264])
valid_keywords = st.fixed_dictionaries({}, optional={
    "causal": st.booleans(), "causal_alignment": st.sampled_from(["top_left", "bottom_right"]),
    "scale": st.sampled_from([None, 0.125, -1.0, 0, 3]), "return_lse": st.booleans(),
    "dropout_p": st.sampled_from([0.0, 0.1, 0.99]), "seed": st.sampled_from([None, 0, 7]),
    "offset": st.sampled_from([0, 4])})
any_keywords = st.fixed_dictionaries({}, optional={
    "causal": st.sampled_from([False, True, "no", 1, None]),
    "causal_alignment": st.sampled_from(["top_left", "bottom_right", "bottom", 5]),
    "scale": st.sampled_from([None, 0.125, -1.0, 0, 3, *BAD_NUMBERS]),
    "return_lse": st.sampled_from([False, True, "no"]),
    "instance": st.sampled_from([None, ["x"], 5]),
    "dropout_p": st.sampled_from([0.0, 0.1, 0.99, 1.0, -0.1, True, "0.1", float("nan")]),
    "seed": st.sampled_from([None, 0, 7, -1, 2**63, 1.5, True]),
    "offset": st.sampled_from([0, 4, -1, 2**63, None]),
})
keywords = st.one_of(valid_keywords, valid_keywords, valid_keywords, any_keywords)


@st.composite
def attention_case(draw):
    b, h, groups = draw(small), draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2, 3]))
    hk = draw(st.sampled_from([h, max(1, h // groups), h, max(1, h // groups), 0, 3]))
    nq, nk = draw(lengths), draw(lengths)
    d = draw(head_dims)
    dtype = draw(st.sampled_from(DTYPES[:2] * 4 + DTYPES))
    kd = draw(st.sampled_from([dtype] * 6 + [torch.float16]))
    shapes = [(b, h * 1, nq, d), (b, hk, nk, d), (draw(st.sampled_from([b] * 6 + [b + 1])), hk,
                                                     draw(st.sampled_from([nk] * 6 + [nk + 1])), d)]
    q = build(shapes[0], dtype, draw(views), draw(pads), draw(offsets))
    k = build(shapes[1], kd, draw(views), draw(pads), draw(offsets))
    v = build(shapes[2], kd, draw(views), draw(pads), draw(offsets))
    out_kind = draw(st.sampled_from([None, None, "fresh", "fresh", "q", "view", "wrong_shape"]))
    out = {None: None, "fresh": torch.empty_like(q), "q": q, "view": build(shapes[0], dtype, draw(views), 1, 0),
           "wrong_shape": torch.empty(b, h, nq + 1, d, dtype=dtype)}[out_kind]
    mask_kind = draw(st.sampled_from([None] * 4 + ["row", "full", "bool", "bad_shape", "bad_dtype", "5d"]))
    mask = {None: None, "row": torch.zeros(1, 1, 1, nk, dtype=dtype), "full": torch.zeros(b, h, nq, nk, dtype=dtype),
            "bool": torch.ones(nq, nk, dtype=torch.bool), "bad_shape": torch.zeros(nq + 2, nk + 3, dtype=dtype),
            "bad_dtype": torch.zeros(nq, nk, dtype=torch.int32), "5d": torch.zeros(1, 1, 1, 1, nk, dtype=dtype)}[mask_kind]
    kwargs = draw(keywords)
    return q, k, v, out, mask, kwargs


def attention_oracle(q, k, v, out, mask, kw) -> type:
    bad = False
    bad |= not isinstance(kw.get("causal", False), bool) or not isinstance(kw.get("return_lse", False), bool)
    bad |= kw.get("instance") is not None and not isinstance(kw.get("instance"), str)
    bad |= kw.get("causal_alignment", "top_left") not in ("top_left", "bottom_right")
    bad |= number_bad(kw.get("scale"))
    bad |= number_bad(kw.get("dropout_p", 0.0), low=0.0, high=1.0, none_ok=False)
    seed, offset = kw.get("seed"), kw.get("offset", 0)
    bad |= seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63)
    bad |= isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < 2**63
    (b, h, nq, d), (bk, hk, nk, dk), (bv, hv, nv, dv) = q.shape, k.shape, v.shape
    bad |= not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16)
    bad |= not (d == dk == dv) or not 1 <= d <= 256
    bad |= not (b == bk == bv) or nk != nv or hk != hv or hk == 0 or (hk and h % hk)
    padded = d == dk == dv and d not in tile_head_dims()  # runs on padded copies: their strides are new
    bad |= not padded and any(stride_bad(t) for t in (q, k, v))
    if out is not None:
        bad |= out.shape != q.shape or out.dtype != q.dtype or (not padded and stride_bad(out))
        bad |= any(overlaps(out, t) for t in (q, k, v) + ((mask,) if mask is not None else ()))
    if mask is not None:
        bad |= mask.dtype not in (torch.bool, q.dtype) or mask.dim() > 4
        try:
            mask.expand(b, h, nq, nk)
        except RuntimeError:
            bad = True
    return gemmgen.InputError if bad else gemmgen.DeviceError


@SETTINGS
@given(attention_case())
def test_fused_attention(case):
    q, k, v, out, mask, kw = case
    want = attention_oracle(q, k, v, out, mask, kw)
    with pytest.raises(gemmgen.GemmgenError) as info:
        gemmgen.fused_attention(q, k, v, out=out, attn_mask=mask, **kw)
    assert isinstance(info.value, want), (type(info.value).__name__, str(info.value), want.__name__)


@st.composite
def varlen_case(draw):
    lens_q = draw(st.lists(st.sampled_from([0, 1, 5, 17]), min_size=1, max_size=4))
    lens_k = draw(st.sampled_from([lens_q, [n + 1 for n in lens_q], lens_q[::-1]]))
    h, hk, d = draw(st.sampled_from([2, 4])), draw(st.sampled_from([1, 2, 1, 2, 3])), draw(head_dims)
    dtype = draw(st.sampled_from(DTYPES[:2] * 4 + DTYPES))
    q = torch.randn(sum(lens_q), h, d).to(dtype)
    k = torch.randn(sum(lens_k), hk, d).to(dtype)
    v = torch.randn(sum(lens_k) + draw(st.sampled_from([0] * 6 + [1])), hk, d).to(dtype)
    cum = lambda lens: [0] + [sum(lens[:i + 1]) for i in range(len(lens))]  # noqa: E731
    cq = torch.tensor(cum(lens_q), dtype=draw(st.sampled_from([torch.int32] * 6 + [torch.int64])))
    ck = torch.tensor(draw(st.sampled_from([cum(lens_k)] * 6 + [cum(lens_k)[::-1], [1] + cum(lens_k)[1:]])),
                      dtype=torch.int32)
    if draw(st.booleans()):  # a strided view of the same values
        cq = torch.stack([cq, cq]).t().reshape(-1)[::2]
    max_q = draw(st.sampled_from([max(lens_q)] * 3 + [max(lens_q) + 3, max(lens_q) - 1, -1, True]))
    max_k = max(lens_k)
    kw = draw(st.fixed_dictionaries({}, optional={"causal": st.sampled_from([True, False, "no"]),
                                                  "scale": st.sampled_from([None, 0.5, *BAD_NUMBERS]),
                                                  "dropout_p": st.sampled_from([0.0, 0.5, 1.0])}))
    return q, k, v, cq, ck, max_q, max_k, lens_q, lens_k, kw


@SETTINGS
@given(varlen_case())
def test_fused_attention_varlen(case):
    q, k, v, cq, ck, max_q, max_k, lens_q, lens_k, kw = case
    bad = not isinstance(kw.get("causal", False), bool) or number_bad(kw.get("scale"))
    bad |= number_bad(kw.get("dropout_p", 0.0), low=0.0, high=1.0, none_ok=False)
    bad |= not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16)
    bad |= not 1 <= q.shape[2] <= 256 or q.shape[1] % k.shape[1] or k.shape[0] != v.shape[0]
    bad |= cq.dtype != torch.int32 or ck.tolist()[0] != 0 or ck.tolist() != sorted(ck.tolist())
    bad |= isinstance(max_q, bool) or max_q < max(lens_q)
    bad |= ck.tolist()[-1] != k.shape[0]
    want = gemmgen.InputError if bad else gemmgen.DeviceError
    with pytest.raises(gemmgen.GemmgenError) as info:
        gemmgen.fused_attention_varlen(q, k, v, cq, ck, max_q, max_k, **kw)
    assert isinstance(info.value, want), (type(info.value).__name__, str(info.value), want.__name__)


@st.composite
def gemm_case(draw):
    b, h, m, n, kk = draw(small), draw(small), draw(lengths), draw(lengths), draw(st.sampled_from([0, 8, 17, 64]))
    bt = draw(st.sampled_from([False, True, "yes"]))
    dtype = draw(st.sampled_from(DTYPES))
    a = build((b, h, m, kk), dtype, draw(views), draw(pads), draw(offsets))
    bshape = (b, h, n, kk) if bt is True else (b, h, kk, n)
    bm = build(bshape, draw(st.sampled_from([dtype, dtype, torch.float16])), draw(views), draw(pads), draw(offsets))
    out_kind = draw(st.sampled_from([None, None, "fresh", "fp32", "a", "expanded"]))
    out = {None: None, "fresh": torch.empty(b, h, m, n, dtype=dtype), "fp32": torch.empty(b, h, m, n),
           "a": a, "expanded": torch.empty(b, h, 1, n, dtype=dtype).expand(b, h, m, n)}[out_kind]
    kw = draw(st.fixed_dictionaries({}, optional={"alpha": st.sampled_from([1.0, 2, -0.5, *BAD_NUMBERS]),
                                                  "instance": st.sampled_from([None, ["x"]])}))
    return a, bm, bt, out, kw


@SETTINGS
@given(gemm_case())
def test_batched_gemm(case):
    a, bm, bt, out, kw = case
    b, h, m, kk = a.shape
    bad = not isinstance(bt, bool) or number_bad(kw.get("alpha", 1.0), none_ok=False)
    bad |= kw.get("instance") is not None and not isinstance(kw.get("instance"), str)
    bad |= a.dtype not in (torch.float16, torch.bfloat16) or bm.dtype != a.dtype
    if isinstance(bt, bool):
        n, kb = (bm.shape[2], bm.shape[3]) if bt else (bm.shape[3], bm.shape[2])
        bad |= bm.shape[:2] != a.shape[:2] or kb != kk
    else:
        n = bm.shape[3]
    launches = b * h * m * n * kk > 0  # an empty C, or K = 0 (C zeroed), reads no operand
    for t in (a, bm):
        bad |= t.shape[-1] > 1 and t.stride(-1) != 1
        bad |= launches and (t.storage_offset() * t.element_size()) % 16 != 0
    if out is not None:
        bad |= tuple(out.shape) != (b, h, m, n) or out.dtype not in (a.dtype, torch.float32)
        bad |= any(overlaps(out, t) for t in (a, bm))
        dims = sorted((s, size) for s, size in zip(out.stride(), out.shape) if size > 1)
        bad |= bool(dims) and (dims[0][0] == 0 or any(s2 < s1 * n1 for (s1, n1), (s2, _) in zip(dims, dims[1:])))
    want = gemmgen.InputError if bad else gemmgen.DeviceError
    with pytest.raises(gemmgen.GemmgenError) as info:
        gemmgen.batched_gemm(a, bm, b_transposed=bt, out=out, **kw)
    assert isinstance(info.value, want), (type(info.value).__name__, str(info.value), want.__name__)


@st.composite
def ptrs_case(draw):
    count, m, n, kk = draw(st.sampled_from([1, 2, 3])), draw(lengths), draw(lengths), draw(st.sampled_from([8, 17]))
    dtype = draw(st.sampled_from(DTYPES))
    a_list = [torch.randn(m, kk).to(dtype) for _ in range(count)]
    b_list = [torch.randn(kk, n).to(dtype) for _ in range(count)]
    kind = draw(st.sampled_from(["list", "tuple", "none", "int", "mismatch", "short"]))
    out_kind = draw(st.sampled_from([None, "fresh", "alias", "input", "none_item", "int"]))
    outs = {None: None, "fresh": [torch.empty(m, n, dtype=dtype) for _ in range(count)],
            "alias": [torch.empty(m, n, dtype=dtype)] * count, "input": None, "none_item": [None] * count,
            "int": 5}[out_kind]
    if out_kind == "input" and m == kk == n:
        outs = [a_list[0]] + [torch.empty(m, n, dtype=dtype) for _ in range(count - 1)]
    a_arg = {"list": a_list, "tuple": tuple(a_list), "none": None, "int": 3,
             "mismatch": a_list[:-1] + [torch.randn(m + 1, kk).to(dtype)], "short": a_list[:-1]}[kind]
    return a_arg, b_list, outs, count, m, n


@SETTINGS
@given(ptrs_case())
def test_batched_gemm_ptrs(case):
    a_arg, b_list, outs, count, m, n = case
    bad = not isinstance(a_arg, (list, tuple)) or len(a_arg) != count
    bad |= isinstance(a_arg, (list, tuple)) and any(t.shape != a_arg[0].shape for t in a_arg)
    bad |= b_list[0].dtype not in (torch.float16, torch.bfloat16)
    if outs is not None:
        bad |= not isinstance(outs, list) or any(not isinstance(c, torch.Tensor) for c in outs)
        if not bad and isinstance(a_arg, (list, tuple)) and a_arg:
            bad |= any(tuple(c.shape) != (a_arg[0].shape[0], n) for c in outs)
        if not bad and m * n:
            bad |= len({c.data_ptr() for c in outs}) < len(outs) or any(
                overlaps(c, t) for c in outs for t in list(a_arg or []) + b_list)
    want = gemmgen.InputError if bad else gemmgen.DeviceError
    with pytest.raises(gemmgen.GemmgenError) as info:
        gemmgen.batched_gemm_ptrs(a_arg, b_list, out_list=outs)
    assert isinstance(info.value, want), (type(info.value).__name__, str(info.value), want.__name__)


# Random corruptions of the files gemmgen reads: a tuning database and a manifest, each either cut
# short or with one value anywhere in it replaced by another JSON value. Loading never raises
# anything but the documented errors, and what loads is usable.
json_values = st.recursive(st.none() | st.booleans() | st.integers(-3, 3) | st.floats(allow_nan=True) |
                           st.text(max_size=4), lambda inner: st.lists(inner, max_size=2) |
                           st.dictionaries(st.text(max_size=3), inner, max_size=2), max_leaves=4)


def _paths(data, prefix=()):
    yield prefix
    if isinstance(data, dict):
        for key, value in data.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            yield from _paths(value, (*prefix, i))


def _corrupt(draw, data) -> str:
    import json

    text = json.dumps(data)
    if draw(st.booleans()):
        return text[:draw(st.integers(0, len(text)))]
    paths = [p for p in _paths(data) if p]
    where = draw(st.sampled_from(paths))
    node = data
    for key in where[:-1]:
        node = node[key]
    if draw(st.booleans()) and isinstance(node, dict):
        del node[where[-1]]
    else:
        node[where[-1]] = draw(json_values)
    return json.dumps(data)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(data=st.data())
def test_corrupt_tuning_databases(data, tmp_path_factory):
    import warnings

    from gemmgen.select import tuning_db

    fp = {"gpu": "NVIDIA H100", "cc": "9.0", "sm_count": 132}
    good = tuning_db.TuningDB(device=dict(fp))
    for i in range(2):
        good.add("k", f"b{i}", f"h{i}", tuning_db.Record(name=f"n{i}", ms=1.0 + i, reason=None, shape="s", at=1.0))
    path = tmp_path_factory.mktemp("db") / "db.json"
    path.write_text(_corrupt(data.draw, good.to_json()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        db = tuning_db.load(path, fp)
        for bucket in db.buckets("k").values():  # every record that loads is a valid Record
            assert all(isinstance(r.name, str) and r.ms >= 0 for r in bucket.values())
        assert tuning_db.read_any(path) is None or path.exists()


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(data=st.data())
def test_corrupt_manifests(data, tmp_path_factory):
    from conftest import make_entry, write_build_dir
    from gemmgen.errors import ManifestError
    from gemmgen.generator import manifest
    from gemmgen.generator.families import fa2_sm80
    from gemmgen.select import registry

    root = write_build_dir(tmp_path_factory.mktemp("build"), [make_entry(i) for i in fa2_sm80.DEFAULT[:2]])
    path = root / "sm80" / "manifest.json"
    import json
    path.write_text(_corrupt(data.draw, json.loads(path.read_text())))
    try:
        loaded = manifest.load(path)
        assert all(isinstance(e.smem_bytes, int) and e.library == f"lib/{e.name}.so" for e in loaded.instances)
    except ManifestError:
        pass
    registry.set_build_dirs([root])
    try:
        cands, errors = registry.load()
        assert len(cands) <= 2 and all(isinstance(e, str) for e in errors)
        for cand in cands:  # what loads can be judged for a problem without crashing
            registry.reject_reason(cand, registry.Problem("fp16", 64, False, __import__(
                "gemmgen.select.device", fromlist=["synthetic"]).synthetic((9, 0), 132)))
    finally:
        registry.set_build_dirs(None)
