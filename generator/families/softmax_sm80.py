"""The row softmax of the unfused attention path (S fp32 -> P in the input dtype, causal mask
by offset), a baseline beside the fused kernels: gemmgen.unfused_attention runs
gemm_sm80/gemm_sm90 (S = scale Q K^T) -> this -> gemm (O = P V).

Built for the sm80 arch (sm_80 + sm_90 code): a memory-bound kernel gains nothing from sm_90a.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools

from gemmgen.arch import Arch
from gemmgen.generator.families.gemm_sm80 import DTYPE_CPP, DTYPES, DType

FAMILY = "softmax_sm80"
KIND = "softmax"
HEADER_DIRS = ("softmax",)  # under templates/include/gemmgen/: its build key covers them
BUILT_BY_DEFAULT = False  # built when named: gemmgen generate --family softmax_sm80
TEMPLATE = "softmax_sm80.cu.jinja"
ARCHS = (Arch.SM80,)

THREADS = (128, 256)


@dataclasses.dataclass(frozen=True)
class SoftmaxSm80Instance:
    dtype: DType
    threads: int

    family = FAMILY

    @property
    def name(self) -> str:
        """Readable, stable, unique: used for the file, the symbol, the manifest and logs."""
        return f"{FAMILY}_{self.dtype.value}_t{self.threads}"

    @property
    def symbol(self) -> str:
        return f"gemmgen_{self.name}"

    @property
    def smem_bytes(self) -> int:
        """One (max, sum) pair per warp."""
        return self.threads // 32 * 8

    def params(self) -> dict:
        """Plain values for the manifest and the template."""
        return {"dtype": self.dtype.value, "threads": self.threads}

    def template_values(self) -> dict:
        return {**self.params(), "name": self.name, "symbol": self.symbol, "element": DTYPE_CPP[self.dtype]}

    def content_hash(self) -> str:
        """Hash of the family and parameters (template text and toolchain join it in the build key)."""
        return hashlib.sha256((FAMILY + repr(sorted(self.params().items()))).encode()).hexdigest()[:16]


def invalid_reason(inst: SoftmaxSm80Instance, arch: Arch = Arch.SM80) -> str | None:
    """The one validity rule of this family: None when valid, else why not."""
    if inst.dtype not in DTYPES:
        return f"dtype {inst.dtype.value} not in {[d.value for d in DTYPES]}"
    if inst.threads not in THREADS:
        return f"threads {inst.threads} not in {THREADS}"
    return None


def problem_reason(params: dict, problem) -> str | None:
    """Never an attention kernel by itself (the registry skips non-attention kinds anyway)."""
    return f"{FAMILY} is the unfused path's softmax, not a fused attention kernel"


SPACE: tuple[SoftmaxSm80Instance, ...] = tuple(
    inst for inst in itertools.starmap(SoftmaxSm80Instance, itertools.product(DTYPES, THREADS))
    if invalid_reason(inst) is None
)

# 128 threads: rows of 64 to 4096 keys leave 1 to 32 elements per thread and many blocks per SM.
DEFAULT: tuple[SoftmaxSm80Instance, ...] = tuple(inst for inst in SPACE if inst.threads == 128)
