"""One call of every built instance, for `compute-sanitizer --tool memcheck`:

    compute-sanitizer --tool memcheck --error-exitcode 1 python tests/gpu/sanitize_calls.py

Attention instances run forced by name on odd lengths (Nq = 129 and Nk = 127, or Nk = 129 for
causal and sliding-window calls; one causal and one plain call where the instance serves both); GEMM instances on a 65 x 63 x 72 product (or the
smallest sizes their alignment allows); the row-softmax instances through unfused_attention. Each
output is compared with the float64 reference, so a call that reads or writes out of bounds
without a sanitizer report still fails. Prints one line per instance and a summary.
"""
from __future__ import annotations

import sys

import torch

import gemmgen
from gemmgen.errors import NoInstanceError
from gemmgen.ops.reference import attention_reference
from gemmgen.select import gemm_select, registry

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
TOLERANCE = {"fp16": 2e-3, "bf16": 1e-2}


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def attention_fp8(cand) -> str:
    """An fp8 instance (O in bf16) against the reference of its inputs' values, per-head factors."""
    d, causal = cand.instance.head_dim, cand.instance.causal
    q, k, v = (torch.randn(2, 4, n, d, device="cuda").to(torch.float8_e4m3fn) for n in (129, 131, 131))
    scales = [torch.rand(2, 4, device="cuda") + 0.5 for _ in range(3)]
    o = gemmgen.fused_attention(q, k, v, causal=causal, instance=cand.name, q_descale=scales[0],
                                k_descale=scales[1], v_descale=scales[2])
    ref = attention_reference(*(t.double() * s[:, :, None, None] for t, s in zip((q, k, v), scales)), causal)[0]
    err = rel(o, ref)
    if not err <= 0.05:  # tests/gpu/test_fp8_gpu.py's bound
        raise AssertionError(f"relative error {err:.2e}")
    return f"rel err {err:.1e}"


def attention(cand) -> str:
    inst, p = cand.instance, cand.entry.params
    if p["dtype"] == "fp8":
        return attention_fp8(cand)
    d = inst.head_dim or p["max_head_dim"]
    dtype = DTYPES[p["dtype"]]
    if inst.mask is None:
        masks = [(False, None), (True, None)]
    else:  # a sliding-window instance runs a window of 40 keys left, 7 right
        masks = [(inst.mask.value == "causal", (40, 7) if inst.mask.value == "local" else None)]
    softcap = 5.0 if p.get("softcap") else 0.0  # `_sc` instances run capped calls only
    worst = 0.0
    for causal, window in masks:
        nk = 129 if causal or window else 127  # some causal (and window) tiles run Nq <= Nk only
        q = torch.randn(2, 2, 129, d, device="cuda", dtype=dtype)
        k, v = (torch.randn(2, 2, nk, d, device="cuda", dtype=dtype) for _ in range(2))
        out = torch.full_like(q, float("nan"))
        gemmgen.fused_attention(q, k, v, causal=causal, instance=cand.name, out=out, window=window, softcap=softcap)
        err = rel(out, attention_reference(q, k, v, causal, window=window, softcap=softcap)[0])
        if not err <= TOLERANCE[p["dtype"]]:
            raise AssertionError(f"relative error {err:.2e}")
        worst = max(worst, err)
    return f"rel err {worst:.1e}"


def gemm(cand) -> str:
    inst = cand.instance
    dtype = DTYPES[inst.dtype.value]
    m, n, k = (64, 64, 72) if inst.align > 1 else (65, 63, 71)
    a = torch.randn(2, 3, m, k, device="cuda", dtype=dtype)
    b = torch.randn(2, 3, n, k, device="cuda", dtype=dtype) if inst.b_transposed else \
        torch.randn(2, 3, k, n, device="cuda", dtype=dtype)
    out_dtype = torch.float32 if inst.out_fp32 else dtype
    c = torch.full((2, 3, m, n), float("nan"), device="cuda", dtype=out_dtype)
    bt = b.transpose(-2, -1) if inst.b_transposed else b
    if inst.strategy.value == "ptr":  # separate allocations: each matrix 16-byte aligned
        outs = [m.clone() for m in c.flatten(0, 1)]
        gemmgen.batched_gemm_ptrs([m.clone() for m in a.flatten(0, 1)], [m.clone() for m in b.flatten(0, 1)],
                                  out_list=outs, b_transposed=inst.b_transposed, instance=cand.name)
        c = torch.stack(outs).view(c.shape)
    else:
        gemmgen.batched_gemm(a, b, b_transposed=inst.b_transposed, out=c, instance=cand.name)
    err = rel(c, a.double() @ bt.double())
    if not err <= 1e-2:
        raise AssertionError(f"relative error {err:.2e}")
    return f"rel err {err:.1e}"


def main() -> int:
    torch.manual_seed(0)
    done, skipped, failed = 0, 0, 0
    for cand in registry.load()[0]:
        if cand.entry.state != "built":
            continue
        family = cand.entry.family
        try:
            if family in ("fa2_sm80", "fmha_sm90", "mea_sm80"):
                note = attention(cand)
            elif gemm_select.is_gemm(cand):
                note = gemm(cand)
            else:
                continue
            torch.cuda.synchronize()
            done += 1
            print(f"ok      {cand.name}: {note}", flush=True)
        except NoInstanceError as exc:
            skipped += 1
            print(f"skipped {cand.name}: {str(exc).splitlines()[-1]}", flush=True)
        except Exception as exc:  # report every instance, then fail
            failed += 1
            print(f"FAILED  {cand.name}: {type(exc).__name__}: {str(exc).splitlines()[0]}", flush=True)
    for dtype in DTYPES.values():  # the softmax instances, through the unfused path
        q = torch.randn(1, 2, 129, 64, device="cuda", dtype=dtype)
        k = torch.randn(1, 2, 127, 64, device="cuda", dtype=dtype)
        try:
            o = gemmgen.unfused_attention(q, k, k, causal=True)
            torch.cuda.synchronize()
            err = rel(o, attention_reference(q, k, k, True)[0])
            ok = err <= TOLERANCE["bf16"]
            done += ok
            failed += not ok
            print(f"{'ok     ' if ok else 'FAILED '} softmax {dtype}: rel err {err:.1e}", flush=True)
        except NoInstanceError:
            skipped += 1
    print(f"sanitize_calls: {done} calls checked, {skipped} skipped, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
