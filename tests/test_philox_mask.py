"""The host dropout mask (tests/philox_mask.py), which the GPU tests hold every family's kernels
to: Philox4x32-10's published known-answer vectors, the stream layout, and the kept fraction."""
from __future__ import annotations

import numpy as np

from philox_mask import keep_mask, philox4x32_10, stream_outputs


def test_known_answers():
    # Random123's kat_vectors for philox4x32_10 (counter, key -> outputs).
    zero = philox4x32_10((0, 0, 0, 0), (0, 0))
    assert [int(x) for x in zero] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    ones = philox4x32_10((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF))
    assert [int(x) for x in ones] == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    pi = philox4x32_10((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0))
    assert [int(x) for x in pi] == [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


def test_stream_positions_are_consecutive_words():
    seed = 2**40 + 12345
    words = philox4x32_10((7, 0, 0, 0), (seed & 0xFFFFFFFF, seed >> 32))
    got = stream_outputs(np.arange(28, 32, dtype=np.uint64), seed)
    assert [int(x) for x in got] == [int(w) for w in words]


def test_mask_layout_and_fraction():
    mask = keep_mask(2, 3, 129, 127, 0.25, seed=42, offset=1001)
    assert mask.shape == (2, 3, 129, 127)
    assert abs(mask.float().mean().item() - 0.75) < 0.01
    # The offset moves every weight along the stream: weight (0, 0, 0, 1) at offset o is weight
    # (0, 0, 0, 0) at offset o + 1.
    moved = keep_mask(1, 1, 1, 127, 0.25, seed=42, offset=1002)
    assert bool((mask[0, 0, 0, 1:] == moved[0, 0, 0, :-1]).all())
    # Head h starts Nq * Nk positions after head h - 1.
    head1 = keep_mask(1, 1, 129, 127, 0.25, seed=42, offset=1001 + 129 * 127)
    assert bool((mask[0, 1] == head1[0, 0]).all())
