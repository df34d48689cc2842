"""GPU architectures gemmgen builds for: their nvcc targets and hardware limits."""
from __future__ import annotations

import enum


class Arch(enum.Enum):
    """A build target named as on the command line (`--arch sm80`)."""

    SM80 = "sm80"
    SM90 = "sm90"

    @property
    def gencode(self) -> tuple[str, ...]:
        return ARCH_GENCODE[self]

    @property
    def max_smem_bytes(self) -> int:
        return ARCH_MAX_SMEM[self]


# sm_80 machine code does not run on sm_90 (a new major version), so the Ampere-class
# family carries both; sm_86/sm_89 run the sm_80 code.
ARCH_GENCODE: dict[Arch, tuple[str, ...]] = {
    Arch.SM80: ("-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90"),
    # wgmma, TMA multicast and setmaxnreg exist only in the arch-specific sm_90a target, whose
    # code runs on compute capability 9.0 alone.
    Arch.SM90: ("-gencode=arch=compute_90a,code=sm_90a",),
}

# Largest dynamic shared memory one block may opt into. An instance built for several
# targets must fit the smallest of them: sm80 has 163 KB (sm90 has 227 KB).
ARCH_MAX_SMEM: dict[Arch, int] = {
    Arch.SM80: 163 * 1024,
    Arch.SM90: 227 * 1024,
}


def parse_arch(text: str) -> Arch:
    """Return the Arch for `text` (e.g. "sm80"); raise ValueError listing the supported ones."""
    try:
        return Arch(text.strip().lower())
    except ValueError:
        supported = ", ".join(a.value for a in Arch)
        raise ValueError(f"unknown arch {text!r}; supported: {supported}") from None
