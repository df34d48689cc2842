"""What selection needs to know about a GPU: its arch and limits, and the fingerprint that names its
tuning database (GPU model, driver, CUDA, gemmgen version)."""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import re
from pathlib import Path
from typing import Any

from gemmgen import __version__

# Opt-in shared memory per block, and per SM, by compute capability, for torch builds that do not
# report them (CUDA programming guide, "Technical Specifications per Compute Capability").
SMEM_PER_BLOCK = {(8, 0): 163 * 1024, (8, 6): 99 * 1024, (8, 7): 163 * 1024, (8, 9): 99 * 1024,
                  (9, 0): 227 * 1024}
SMEM_PER_SM = {(8, 0): 164 * 1024, (8, 6): 100 * 1024, (8, 7): 164 * 1024, (8, 9): 100 * 1024,
               (9, 0): 228 * 1024}
THREADS_PER_SM = {(8, 6): 1536, (8, 9): 1536}  # 2048 elsewhere from sm80 on
NVIDIA_PROC_VERSION = Path("/proc/driver/nvidia/version")


@dataclasses.dataclass(frozen=True)
class DeviceFacts:
    """One GPU model as selection sees it. Frozen and hashable: part of every Problem."""

    name: str
    cc: tuple[int, int]
    sm_count: int
    smem_per_block: int  # bytes one block may opt into
    smem_per_sm: int = 0  # bytes per SM (0: from the table by cc)
    l2_bytes: int = 0
    max_threads_per_sm: int = 2048
    driver: str = "unknown"
    cuda: str = "unknown"

    def fingerprint(self) -> dict[str, Any]:
        """What a tuning database must match to be used on this GPU."""
        return {"gpu": self.name, "cc": f"{self.cc[0]}.{self.cc[1]}", "sm_count": self.sm_count,
                "driver": self.driver, "cuda": self.cuda, "gemmgen_version": __version__}

    def describe(self) -> str:
        """e.g. "NVIDIA H200 (sm_90, 132 SMs)"."""
        return f"{self.name} (sm_{self.cc[0]}{self.cc[1]}, {self.sm_count} SMs)"


def synthetic(cc: tuple[int, int], sm_count: int, name: str = "") -> DeviceFacts:
    """Facts of a GPU that is not here (`gemmgen explain --cc 9.0 --sms 132`), limits from the tables."""
    return DeviceFacts(name=name or f"sm_{cc[0]}{cc[1]} GPU", cc=cc, sm_count=sm_count,
                       smem_per_block=SMEM_PER_BLOCK.get(cc, 48 * 1024),
                       smem_per_sm=SMEM_PER_SM.get(cc, 64 * 1024),
                       max_threads_per_sm=THREADS_PER_SM.get(cc, 2048))


@functools.lru_cache(maxsize=1)
def driver_version() -> str:
    """The NVIDIA driver version (e.g. "580.65.06"), else the CUDA version the driver supports
    (e.g. "cuda-13.0"), else "unknown"."""
    try:
        match = re.search(r"Kernel Module\D*?(\d+\.\d+(?:\.\d+)?)", NVIDIA_PROC_VERSION.read_text())
        if match:
            return match.group(1)
    except OSError:
        pass
    try:
        version = ctypes.c_int()
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version)) == 0:
            return f"cuda-{version.value // 1000}.{version.value % 1000 // 10}"
    except (OSError, AttributeError):
        pass
    return "unknown"


@functools.lru_cache(maxsize=None)
def facts(index: int) -> DeviceFacts:
    """The facts of CUDA device `index` (cached; needs torch with CUDA)."""
    import torch

    props = torch.cuda.get_device_properties(index)
    cc = (props.major, props.minor)
    return DeviceFacts(
        name=props.name, cc=cc, sm_count=props.multi_processor_count,
        smem_per_block=int(getattr(props, "shared_memory_per_block_optin", 0)
                           or SMEM_PER_BLOCK.get(cc, 48 * 1024)),
        smem_per_sm=int(getattr(props, "shared_memory_per_multiprocessor", 0)
                        or SMEM_PER_SM.get(cc, 64 * 1024)),
        l2_bytes=int(getattr(props, "L2_cache_size", 0)),
        max_threads_per_sm=int(getattr(props, "max_threads_per_multi_processor", 0)
                               or THREADS_PER_SM.get(cc, 2048)),
        driver=driver_version(), cuda=str(torch.version.cuda))
