"""gemmgen's dropout mask computed on the host, independently of the kernels: Philox4x32-10 in
cuRAND's stream layout and the position rule of templates/include/gemmgen/philox/philox.h (weight
(b, h, i, j) of a [B, H, Nq, Nk] call reads stream position offset + u32(b*H*Nq*Nk + h*Nq*Nk) +
u32(i*Nk + j), kept iff its output scaled into (0, 1] as curand_uniform scales it exceeds p)."""
from __future__ import annotations

import numpy as np
import torch

MASK32 = np.uint64(0xFFFFFFFF)
MUL = (np.uint64(0xD2511F53), np.uint64(0xCD9E8D57))
WEYL = (np.uint64(0x9E3779B9), np.uint64(0xBB67AE85))


def philox4x32_10(counter: tuple, key: tuple) -> tuple:
    """The four 32-bit outputs (uint64 arrays) of 128-bit counters (c0, c1, c2, c3) under the 64-bit
    key (k0, k1), each part a uint64 array or scalar below 2^32."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) for c in counter)
    k0, k1 = (np.uint64(k) for k in key)
    for r in range(10):
        if r:
            k0, k1 = (k0 + WEYL[0]) & MASK32, (k1 + WEYL[1]) & MASK32
        p0, p1 = MUL[0] * c0, MUL[1] * c2  # exact: both factors below 2^32
        c0, c1, c2, c3 = (p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & MASK32, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & MASK32
    return c0, c1, c2, c3


def stream_outputs(positions: np.ndarray, seed: int) -> np.ndarray:
    """The 32-bit outputs at stream positions `positions` (uint64) of `seed`'s stream."""
    counter = positions >> np.uint64(2)
    words = philox4x32_10((counter & MASK32, counter >> np.uint64(32), 0, 0), (seed & 0xFFFFFFFF, seed >> 32))
    word = (positions & np.uint64(3)).astype(np.int64)
    return np.choose(word, words)


def uniform(outputs: np.ndarray) -> np.ndarray:
    """curand_uniform's scaling in float32: x * 2^-32 + 2^-33."""
    return outputs.astype(np.float32) * np.float32(2.0**-32) + np.float32(2.0**-33)


def keep_mask(batch: int, heads: int, seqlen_q: int, seqlen_k: int, p: float, seed: int, offset: int) -> torch.Tensor:
    """The kept weights [B, H, Nq, Nk] (bool) of a dropout call with (seed, offset)."""
    b = np.arange(batch, dtype=np.uint64)[:, None, None, None]
    h = np.arange(heads, dtype=np.uint64)[None, :, None, None]
    i = np.arange(seqlen_q, dtype=np.uint64)[None, None, :, None]
    j = np.arange(seqlen_k, dtype=np.uint64)[None, None, None, :]
    per_head = np.uint64(seqlen_q * seqlen_k)
    head = (b * np.uint64(heads) * per_head + h * per_head) & MASK32
    within = (i * np.uint64(seqlen_k) + j) & MASK32
    positions = np.uint64(offset) + head + within
    return torch.from_numpy(uniform(stream_outputs(positions, seed)) > np.float32(p))
