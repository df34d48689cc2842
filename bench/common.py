"""What the attention benchmark scripts share: the header line naming the GPU, the versions and
the date, and the FlashAttention sweep's shapes (16384 tokens, hidden 2048; bench scripts import
this module from their own folder)."""
from __future__ import annotations

import datetime
from typing import Iterator

import torch

import gemmgen
from gemmgen.select.shapes import HIDDEN, TOKENS

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def header(method: str) -> str:
    """"<GPU>, <SMs> SMs, torch <v>, gemmgen <v>, <date>; <method>"."""
    dev = torch.cuda.get_device_properties(0)
    return (f"{dev.name}, {dev.multi_processor_count} SMs, torch {torch.__version__}, gemmgen {gemmgen.__version__}, "
            f"{datetime.date.today()}; {method}")


def fa_shapes(dtypes: list[str], head_dims: list[int], seq_lens: list[int]) -> Iterator[tuple]:
    """(dtype name, torch dtype, d, causal, N, B, H, forward FLOPs) for each sweep shape, in table
    order: B * N = TOKENS, H * d = HIDDEN, forward FLOPs 4*B*H*N^2*d, halved for causal."""
    for dname in dtypes:
        for d in head_dims:
            for causal in (False, True):
                for n in seq_lens:
                    b, h = TOKENS // n, HIDDEN // d
                    yield dname, DTYPES[dname], d, causal, n, b, h, 4 * b * h * n * n * d / (2 if causal else 1)
