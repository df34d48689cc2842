// The split-dQ backward's mask as a band around a diagonal: key j is visible to query i iff
// lo <= j - i <= hi (and j < seqlen_k). Without a mask the band is unbounded; causal is hi =
// causal_offset (0 top-left, seqlen_k - seqlen_q bottom-right); a sliding window (left, right) around
// the diagonal of causal_offset is lo = offset - left, hi = offset + right, a side of -1 unbounded.
//
// The band is a launch parameter (the mainloop's Params), so that one causal instance runs both
// alignments and one local instance every window. Because the band is convex, the query tiles a key
// tile sees are one contiguous range: the load warp, the math warp groups and the dQ reducer of a
// CTA all walk that same range (query_tiles below), which is the contract that keeps their
// pipelines in step.
#pragma once
#include <climits>
#include <cmath>
#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"

namespace gemmgen::fmha_bwd_sm90 {

// Which bounds an instance tests per score: none (only keys past seqlen_k), the upper one (causal), or
// both (local). The range of query tiles follows the band in each case.
enum class BandKind { kNone, kCausal, kLocal };

struct Band {
  int lo = INT_MIN;  // j - i >= lo
  int hi = INT_MAX;  // j - i <= hi

  // The band of a call (host): `offset` is the ABI's causal_offset, `left` and `right` the window's
  // sides (-1: unbounded), read by kLocal only. Bounds past int's range are clamped, which keeps
  // every pair of in-range indices on the same side.
  static Band of(BandKind kind, int64_t offset, int64_t left, int64_t right) {
    auto clamp = [](int64_t x) { return static_cast<int>(x < INT_MIN ? INT_MIN : x > INT_MAX ? INT_MAX : x); };
    Band b;
    if (kind == BandKind::kCausal) b.hi = clamp(offset);
    if (kind == BandKind::kLocal) {
      if (right >= 0) b.hi = clamp(offset + right);
      if (left >= 0) b.lo = clamp(offset - left);
    }
    return b;
  }
};

// The query tiles [first, first + count) that key tile `key_tile` (block_n keys) runs, block_m
// queries each. count is at least 1: where no query sees any of the tile's keys (`empty`) the CTA
// still runs one tile, which the score mask zeroes whole (a CTA without a query tile would hang in
// the mainloop: its dQ reducer releases a pipeline stage it never received), so it writes zero dK and
// dV and its dQ reducer adds nothing.
struct QueryTiles {
  int first;
  int count;
  bool empty = false;
};

template <BandKind Kind>
CUTLASS_HOST_DEVICE QueryTiles query_tiles(Band const& band, int key_tile, int block_n, int block_m, int seqlen_q,
                                           int seqlen_k) {
  const int tiles = (seqlen_q + block_m - 1) / block_m;
  if constexpr (Kind == BandKind::kNone) {
    return {0, tiles};
  } else {
    const int64_t k0 = int64_t(key_tile) * block_n;
    const int64_t k1 = (k0 + block_n < seqlen_k ? k0 + block_n : int64_t(seqlen_k)) - 1;
    // Queries i with k0 - hi <= i <= k1 - lo see a key of the tile.
    const int64_t i0 = k0 - band.hi > 0 ? k0 - band.hi : 0;
    const int64_t i1 = k1 - band.lo < seqlen_q - 1 ? k1 - band.lo : int64_t(seqlen_q) - 1;
    if (i0 > i1) return {k1 - band.lo < 0 ? 0 : tiles - 1, 1, true};
    const int first = static_cast<int>(i0 / block_m);
    return {first, static_cast<int>(i1 / block_m) - first + 1};
  }
}

// The first key tile (block_n keys) whose range of query tiles holds query tile `q_tile`: the key
// tiles that hold it are contiguous (the band is convex), from this one on. A query tile that no key
// tile holds has no use for it.
CUTLASS_HOST_DEVICE int first_key_tile(Band const& band, int q_tile, int block_m, int block_n) {
  const int64_t key = int64_t(q_tile) * block_m + band.lo;  // the smallest key its first row may see
  return key > 0 ? static_cast<int>(key / block_n) : 0;
}

// Scores outside the band, or of keys past seqlen_k, become -inf. acc holds the thread's scores and
// index their (key, query) coordinates (the scores being K Q^T).
template <BandKind Kind, class Acc, class Index>
CUTLASS_DEVICE void mask_scores(Band const& band, Acc& acc, Index const& index, int seqlen_k) {
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < cute::size(acc); ++i) {
    const auto pos = index(i);
    const int key = cute::get<0>(pos);
    const int diff = key - int(cute::get<1>(pos));  // both in [0, 2^31): no overflow
    bool out = key >= seqlen_k;
    if constexpr (Kind != BandKind::kNone) out |= diff > band.hi;
    if constexpr (Kind == BandKind::kLocal) out |= diff < band.lo;
    if (out) acc(i) = -INFINITY;
  }
}

// A query-tile index as the loads' step() walks it (operator* and ++), from the range's first tile.
struct TileIndex {
  int i;
  CUTLASS_DEVICE int operator*() const { return i; }
  CUTLASS_DEVICE TileIndex& operator++() {
    ++i;
    return *this;
  }
};

}  // namespace gemmgen::fmha_bwd_sm90
