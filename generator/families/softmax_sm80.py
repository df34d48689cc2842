"""The row softmax of the unfused attention path (S fp32 -> P in the input dtype, causal mask
by offset), a baseline beside the fused kernels: gemmgen.unfused_attention runs
gemm_sm80/gemm_sm90 (S = scale Q K^T) -> this -> gemm (O = P V).

Built for the sm80 arch (sm_80 + sm_90 code): a memory-bound kernel gains nothing from sm_90a.
"""
from __future__ import annotations

import dataclasses
import itertools

from gemmgen.arch import Arch
from gemmgen.generator.families.base import DType, Instance, axis_reason

FAMILY = "softmax_sm80"
KIND = "softmax"
HEADER_DIRS = ("softmax",)  # under templates/include/gemmgen/: its build key covers them
BUILT_BY_DEFAULT = False  # built when named: gemmgen generate --family softmax_sm80
TEMPLATE = "softmax_sm80.cu.jinja"
ARCHS = (Arch.SM80,)

DTYPES = (DType.FP16, DType.BF16)  # of P; S is always fp32
THREADS = (128, 256)


@dataclasses.dataclass(frozen=True)
class SoftmaxSm80Instance(Instance):
    """P's dtype and the threads of a block, which walks one row at a time."""

    family = FAMILY

    dtype: DType
    threads: int

    @property
    def name(self) -> str:
        return f"{FAMILY}_{self.dtype.value}_t{self.threads}"

    @property
    def smem_bytes(self) -> int:
        """One (max, sum) pair per warp."""
        return self.threads // 32 * 8


INSTANCE = SoftmaxSm80Instance


def invalid_reason(inst: SoftmaxSm80Instance, arch: Arch = Arch.SM80) -> str | None:
    """The one validity rule of this family: None when valid, else why not."""
    return axis_reason("dtype", inst.dtype, DTYPES) or axis_reason("threads", inst.threads, THREADS)


SPACE: tuple[SoftmaxSm80Instance, ...] = tuple(
    inst for inst in itertools.starmap(SoftmaxSm80Instance, itertools.product(DTYPES, THREADS))
    if invalid_reason(inst) is None
)

# 128 threads: rows of 64 to 4096 keys leave 1 to 32 elements per thread and many blocks per SM.
DEFAULT: tuple[SoftmaxSm80Instance, ...] = tuple(inst for inst in SPACE if inst.threads == 128)
