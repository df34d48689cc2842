"""The logit softcap without a GPU: the argument's checks, the Problem's key, the registry's rule
(softcap calls to instances built for one, nothing else to them), the reference's formula, and the
C ABI fields."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import gemmgen
from gemmgen.generator.families import fa2_sm80, fmha_bwd_sm90, fmha_sm90
from gemmgen.generator.families.base import DType, Mask
from gemmgen.kernels import abi, launch
from gemmgen.ops.checks import check_softcap
from gemmgen.ops.reference import attention_reference
from gemmgen.select import device, registry
from gemmgen.select.problem import BwdProblem, Problem

H100 = device.synthetic((9, 0), 132)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), "30", True, None, 1e39])
def test_bad_softcaps_raise(bad):
    with pytest.raises(gemmgen.InputError, match="softcap"):
        check_softcap(bad)


def test_good_softcaps():
    assert check_softcap(0) == 0.0 and check_softcap(50) == 50.0 and check_softcap(0.5) == 0.5


def test_problem_key_and_description():
    p = Problem("bf16", 128, True, H100, softcap=True)
    assert p.functional_key.endswith("_softcap") and "softcap" in p.describe()
    assert not Problem("bf16", 128, True, H100).functional_key.endswith("_softcap")


def test_registry_rule():
    capped = Problem("bf16", 128, True, H100, seqlen_q=300, seqlen_k=300, softcap=True)
    plain = dataclasses.replace(capped, softcap=False)
    sc = fa2_sm80.Fa2Sm80Instance(DType.BF16, 128, Mask.CAUSAL, 128, 64, 4, softcap=True)
    no = dataclasses.replace(sc, softcap=False)
    assert registry.functional_reason(fa2_sm80, sc, capped) is None
    assert registry.functional_reason(fa2_sm80, no, plain) is None
    assert "no logit softcap" in registry.functional_reason(fa2_sm80, no, capped)
    assert "built for a logit softcap" in registry.functional_reason(fa2_sm80, sc, plain)
    sm90 = next(i for i in fmha_sm90.DEFAULT if i.dtype is DType.BF16 and i.head_dim == 128 and i.causal)
    assert "no logit softcap" in registry.functional_reason(fmha_sm90, sm90, capped)
    bwd = BwdProblem(**{f.name: getattr(capped, f.name) for f in dataclasses.fields(Problem)})
    bsc = next(i for i in fmha_bwd_sm90.DEFAULT if i.softcap and i.causal and i.dtype is DType.BF16)
    assert registry.functional_reason(fmha_bwd_sm90, bsc, bwd) is None
    assert "built for a logit softcap" in registry.functional_reason(
        fmha_bwd_sm90, bsc, dataclasses.replace(bwd, softcap=False))


def test_reference_formula():
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=gen, dtype=torch.float64) * 4 for _ in range(3))
    o, lse = attention_reference(q, k, v, True, softcap=3.0)
    s = 3.0 * torch.tanh((q @ k.transpose(-1, -2)) / math.sqrt(8) / 3.0)
    s = s.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    assert torch.allclose(o, torch.softmax(s, -1) @ v) and torch.allclose(lse, torch.logsumexp(s, -1))


def test_params_carry_the_softcap():
    """Appended after the window (libraries built before it never read it), before the per-sequence
    alignment and the packed tensors' row counts; 0 without a cap."""
    assert [n for n, _ in abi.AttnParams._fields_][-7:] == ["softcap", "align_per_sequence", "total_q", "total_k",
                                                            "descale_q", "descale_k", "descale_v"]
    assert [n for n, _ in abi.AttnBwdParams._fields_][-4:] == ["softcap", "align_per_sequence", "total_q", "total_k"]
    q = torch.zeros(1, 2, 16, 128, dtype=torch.float16)
    p = launch.params(q, q, q, q, None, causal=True, causal_alignment="top_left", scale=None, softcap=30.0)
    assert p.softcap == 30.0
    assert launch.params(q, q, q, q, None, causal=True, causal_alignment="top_left", scale=None).softcap == 0.0
    pb = launch.params_bwd(q, q, q, q, q, torch.zeros(1, 2, 16), q, q, q, causal=True, causal_alignment="top_left",
                           scale=None, softcap=30.0)
    assert pb.softcap == 30.0


def test_cli_explain_takes_a_softcap(tmp_path, capsys):
    """`gemmgen explain --softcap C` explains a capped call's decision (the `_sc` instance wins, the
    others say why not); a negative cap is an InputError."""
    from conftest import make_entry, write_build_dir
    from gemmgen.cli import app

    fa2 = [i for i in fa2_sm80.DEFAULT if i.dtype is DType.BF16 and i.head_dim == 128 and i.causal]
    build = write_build_dir(tmp_path, [make_entry(i) for i in fa2])
    try:
        args = ["explain", "--shape", "2,16,2048,128,causal", "--cc", "8.0", "--sms", "108", "--build-dir", str(build)]
        assert app.main(args + ["--softcap", "50"]) == 0
        out = capsys.readouterr().out
        assert "softcap" in out and "fa2_sm80_bf16_d128_causal_m128n64w4s1_sc" in out and "no logit softcap" in out
        assert app.main(args) == 0
        assert "built for a logit softcap" in capsys.readouterr().out
        assert app.main(args + ["--softcap", "-1"]) != 0
        assert "softcap" in capsys.readouterr().err
    finally:
        registry.set_build_dirs(None)


def test_every_family_caps_with_the_one_tanh():
    """A backward recomputes P = exp(capped - LSE) from a forward that may have run in another
    family: every kernel that caps scores takes templates/include/gemmgen/softcap.h's tanh, and no
    header computes a tanh of its own."""
    import pathlib
    import re

    include = pathlib.Path(__file__).resolve().parents[1] / "templates" / "include" / "gemmgen"
    capping = {p.relative_to(include).as_posix() for p in include.rglob("*.h")
               if re.search(r"\bsoftcap\b|kSoftcap|Softcap\b", p.read_text())}
    users = {p.relative_to(include).as_posix() for p in include.rglob("*.h")
             if "softcap_tanh(" in p.read_text() and p.name != "softcap.h"}
    assert {"fmha_sm90/softmax.h", "fmha_bwd_sm90/split_dq.h", "fa2_sm80/kernel.h", "fa2_bwd_sm80/kernel.h"} <= users
    for rel in users:
        assert '#include "gemmgen/softcap.h"' in (include / rel).read_text(), rel
    for p in include.rglob("*.h"):
        code = re.sub(r"//.*", "", p.read_text())  # (comments write the formula out)
        assert not re.search(r"\btanhf?\s*\(|__expf\(2\.f \*|tanh\.approx", code) or p.name == "softcap.h", \
            f"{p.relative_to(include)} computes a tanh of its own"
    assert capping, "no kernel header mentions a softcap"
