"""Every fused_attention error path (reachable on CPU) and the CLI's errors."""
from __future__ import annotations

import pytest
import torch

from conftest import run_cli
from gemmgen import GemmgenError, fused_attention
from gemmgen.errors import DeviceError, InputError
from gemmgen.kernels.launch import empty_like_layout

FP16 = torch.float16


def qkv(b=2, h=4, hkv=4, nq=17, nk=19, d=64, dtype=FP16):
    return (torch.randn(b, h, nq, d, dtype=dtype), torch.randn(b, hkv, nk, d, dtype=dtype),
            torch.randn(b, hkv, nk, d, dtype=dtype))


def misaligned(shape):
    flat = torch.empty(1 + torch.Size(shape).numel(), dtype=FP16)
    return flat[1:].view(shape)  # 2 bytes past a 16-byte boundary


def strided_rows(shape):
    return torch.empty(*shape[:-1], shape[-1] + 4, dtype=FP16)[..., :shape[-1]]  # row stride d+4


def replace(index, value):
    items = list(qkv())
    items[index] = value
    return items


CASES = [
    (lambda: ([1.0], *qkv()[1:]), {}, InputError, "q must be a torch.Tensor"),
    (lambda: replace(1, torch.randn(2, 4, 19, dtype=FP16)), {}, InputError, "k must be 4-D"),
    (lambda: qkv(dtype=torch.float32), {}, InputError, "one dtype among torch.float16, torch.bfloat16"),
    (lambda: replace(2, qkv()[2].bfloat16()), {}, InputError, "one dtype"),
    (lambda: qkv(d=300), {}, InputError, "from 1 to 256 .*; got 300"),
    (lambda: replace(1, torch.randn(2, 4, 19, 32, dtype=FP16)), {}, InputError, "head_dim must be equal"),
    (lambda: replace(0, torch.randn(3, 4, 17, 64, dtype=FP16)), {}, InputError, "batch must be equal"),
    (lambda: replace(2, torch.randn(2, 4, 20, 64, dtype=FP16)), {}, InputError, "same seqlen"),
    (lambda: replace(2, torch.randn(2, 2, 19, 64, dtype=FP16)), {}, InputError, "same number of heads"),
    (lambda: qkv(h=6, hkv=4), {}, InputError, "dividing q's 6"),
    (lambda: replace(0, torch.randn(2, 4, 64, 17, dtype=FP16).transpose(2, 3)), {}, InputError,
     "contiguous in its last dim"),
    (lambda: replace(1, strided_rows((2, 4, 19, 64))), {}, InputError, "multiples of 8 elements"),
    (lambda: replace(2, misaligned((2, 4, 19, 64))), {}, InputError, "not 16-byte aligned"),
    (lambda: replace(0, torch.randn(2, 4, 17, 64, dtype=FP16, device="meta")), {}, InputError,
     "must be on one device; got cpu, meta"),
    (lambda: qkv(), {}, DeviceError, "needs a CUDA GPU: the tensors are on cpu"),
    (lambda: qkv(), {"causal": True, "causal_alignment": "bottom-right"}, InputError,
     "supported: top_left, bottom_right"),
    (lambda: qkv(), {"scale": "0.3"}, InputError, "scale must be a float"),
    (lambda: qkv(), {"scale": float("nan")}, InputError, "scale must be finite"),
    (lambda: qkv(), {"scale": float("inf")}, InputError, "scale must be finite"),
    (lambda: qkv(), {"out": torch.empty(2, 4, 17, 32, dtype=FP16)}, InputError, "out must have q's shape"),
    (lambda: qkv(), {"out": torch.empty(1, 1, 1, 64, dtype=FP16).expand(2, 4, 17, 64)}, InputError,
     "overlap"),
]


@pytest.mark.parametrize("make, kwargs, kind, words", CASES)
def test_fused_attention_errors(make, kwargs, kind, words):
    with pytest.raises(kind, match=words) as info:
        fused_attention(*make(), **kwargs)
    assert isinstance(info.value, GemmgenError)
    assert isinstance(info.value, ValueError if kind is InputError else RuntimeError)


@pytest.mark.parametrize("make", [
    lambda x: x.transpose(1, 2),  # [B, N, H, d] storage
    lambda x: torch.cat([x, x], dim=-1)[..., :64].transpose(1, 2),  # a slice of a wider last dim
])
def test_layouts_pass_validation(make):
    """Views the kernels accept get as far as the device check on CPU (no copies, no layout error)."""
    q, k, v = (make(torch.randn(2, n, 4, 64, dtype=FP16)) for n in (17, 19, 19))
    with pytest.raises(DeviceError):
        fused_attention(q, k, v, causal=True, out=make(torch.empty(2, 17, 4, 64, dtype=FP16)))


def test_output_keeps_q_layout():
    q = torch.empty(2, 17, 4, 64, dtype=FP16).transpose(1, 2)
    o = empty_like_layout(q)
    assert o.shape == q.shape and o.stride() == q.stride()
    q = torch.empty(2, 4, 17, 128, dtype=FP16)[..., :64]
    assert empty_like_layout(q).stride() == (4 * 17 * 64, 17 * 64, 64, 1)


def test_cli_unknown_arch():
    proc = run_cli("generate", "--arch", "sm75", "--no-compile")
    assert proc.returncode == 2 and "unknown arch 'sm75'; supported: sm80" in proc.stderr


def test_cli_filter_matches_nothing(tmp_path):
    proc = run_cli("generate", "--arch", "sm80", "--filter", "d999", "--out", str(tmp_path))
    assert proc.returncode == 2 and "--filter 'd999' matches no instance" in proc.stderr


def test_cli_no_nvcc(tmp_path):
    proc = run_cli("generate", "--arch", "sm80", "--filter", "d32_none", "--out", str(tmp_path),
                   env={"GEMMGEN_NVCC": "/nonexistent"})
    assert proc.returncode == 1
    assert "GEMMGEN_NVCC=/nonexistent is not an executable" in proc.stderr and "--no-compile" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_no_cutlass(tmp_path):
    empty = tmp_path / "cutlass"
    empty.mkdir()
    proc = run_cli("generate", "--arch", "sm80", "--filter", "d32_none", "--out", str(tmp_path / "out"),
                   env={"CUTLASS_PATH": str(empty)})
    assert proc.returncode == 1
    assert f"CUTLASS headers not found under {empty} (from CUTLASS_PATH)" in proc.stderr


def test_cli_list_without_manifest(tmp_path):
    proc = run_cli("list", "--out", str(tmp_path))
    assert proc.returncode == 1 and "no manifest under" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cli_run_without_gpu():
    proc = run_cli("run", "--batch", "1", "--heads", "2", "--seq-len", "17", "--verify")
    assert proc.returncode == 1 and "needs a CUDA GPU" in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
