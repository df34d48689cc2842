"""Size buckets: rounding, keys and distances."""
from __future__ import annotations

import pytest

from gemmgen.select import buckets
from gemmgen.errors import InputError


@pytest.mark.parametrize("n, b", [(0, 0), (1, 1), (2, 2), (3, 4), (17, 32), (512, 512), (513, 1024),
                                  (1000, 1024), (1024, 1024), (1025, 2048), (16384, 16384)])
def test_pow2_ceil(n, b):
    assert buckets.pow2_ceil(n) == b


def test_bucket_of_and_key_roundtrip():
    b = buckets.bucket_of(layout="bnhd", gqa=4, batch_heads=96, seqlen_q=1000, seqlen_k=4097)
    assert b == buckets.Bucket("bnhd", 4, 128, 1024, 8192)
    assert b.key == "bnhd_g4_bh128_q1024_k8192" and str(b) == b.key
    assert buckets.parse_key(b.key) == b


@pytest.mark.parametrize("key", ["", "bhnd_g1_bh1_q1", "xyz_g1_bh1_q1_k1", "bhnd_g1_bh1_q1_k1_extra"])
def test_parse_key_rejects(key):
    with pytest.raises(InputError, match="not a bucket key"):
        buckets.parse_key(key)


def test_distance_counts_doublings():
    a = buckets.Bucket("bhnd", 1, 512, 1024, 1024)
    assert buckets.distance(a, a) == 0
    assert buckets.distance(a, buckets.Bucket("bhnd", 1, 512, 2048, 2048)) == 2
    assert buckets.distance(a, buckets.Bucket("bhnd", 1, 128, 1024, 1024)) == 2
    assert buckets.distance(a, buckets.Bucket("bnhd", 1, 512, 1024, 1024)) == 1
    assert buckets.distance(a, buckets.Bucket("bhnd", 4, 512, 1024, 1024)) == 2
