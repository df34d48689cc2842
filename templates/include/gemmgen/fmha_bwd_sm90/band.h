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

#include "88_hopper_fmha/collective/fmha_common.hpp"

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

// Packed sequences (variable lengths): the call runs as one batch entry over the packed tensors
// (total_q query rows, total_k keys), and key j of sequence b is visible only to that sequence's
// query rows, within the band around the sequence's own diagonal (shifted by len_k - len_q when
// `align` is set: bottom-right per sequence). The query rows a key sees are one contiguous range;
// with the clamps below its ends never decrease with the key (across sequences too), so a key
// tile's rows lie in [rows of its first key's start, rows of its last key's end] (a range as
// contiguous as the band's; rows of other sequences inside it are masked per score).
struct Packed {
  const int* cu_q = nullptr;  // [batch + 1] first rows; NULL: fixed lengths
  const int* cu_k = nullptr;
  int batch = 0;
  int align = 0;
};

struct Rows {
  int first, last;  // packed query rows [first, last] (first > last: none)
};

CUTLASS_DEVICE Rows packed_rows(Packed const& s, Band const& band, int key, int total_k) {
  if (key >= total_k) return {total_k, -1};
  int lo = 0, hi = s.batch - 1;  // the last sequence starting at or before the key (empty ones skipped)
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (s.cu_k[mid] <= key) lo = mid; else hi = mid - 1;
  }
  const int q0 = s.cu_q[lo], len_q = s.cu_q[lo + 1] - q0;
  const int k0 = s.cu_k[lo], len_k = s.cu_k[lo + 1] - k0;
  const int64_t shift = s.align ? int64_t(len_k) - len_q : 0;
  const int64_t kl = int64_t(key) - k0;
  int64_t first = kl - (int64_t(band.hi) + shift), last = kl - (int64_t(band.lo) + shift);
  first = first < 0 ? 0 : first > len_q ? len_q : first;  // within [0, len_q]: monotone across sequences
  last = last > len_q - 1 ? len_q - 1 : last < -1 ? -1 : last;
  return {q0 + int(first), q0 + int(last)};
}

// The query tiles of key tile `key_tile` of a packed call (as query_tiles for fixed lengths).
CUTLASS_DEVICE QueryTiles packed_query_tiles(Packed const& s, Band const& band, int key_tile, int block_n,
                                             int block_m, int total_q, int total_k) {
  const int k0 = key_tile * block_n;
  const int k1 = (k0 + block_n < total_k ? k0 + block_n : total_k) - 1;
  const int first = packed_rows(s, band, k0, total_k).first, last = packed_rows(s, band, k1, total_k).last;
  if (first > last) {
    const int row = first < total_q ? first : total_q - 1;
    return {(row > 0 ? row : 0) / block_m, 1, true};
  }
  return {first / block_m, last / block_m - first / block_m + 1};
}

// Deterministic packed calls. Key tile k's rows are [F(k), L(k)]: packed_rows' first row of its first
// key and last row of its last key (F > L: none). Both ends never decrease with k, so the key tiles
// that run query tile t (block_m rows from t * block_m) are one contiguous range: those with
// L(k) >= t * block_m and F(k) < (t + 1) * block_m, from packed_first_key_tile(t) on. A tile of that
// range without rows (keys between two sequences' rows that none of them is seen from, such as a
// sequence without queries) runs t as its one tile, adding nothing (packed_tile_takes_turn).
CUTLASS_DEVICE int packed_last_row(Packed const& s, Band const& band, int key_tile, int block_n, int total_k) {
  const int64_t k1 = int64_t(key_tile + 1) * block_n;
  return packed_rows(s, band, int(k1 < total_k ? k1 : total_k) - 1, total_k).last;
}

// The first key tile whose rows reach query tile `q_tile` (key_tiles where none does).
CUTLASS_DEVICE int packed_first_key_tile(Packed const& s, Band const& band, int q_tile, int block_m, int block_n,
                                         int key_tiles, int total_k) {
  const int64_t row = int64_t(q_tile) * block_m;
  int lo = 0, hi = key_tiles;  // the smallest key tile with L(k) >= row: L never decreases with k
  while (lo < hi) {
    const int mid = lo + (hi - lo) / 2;
    if (packed_last_row(s, band, mid, block_n, total_k) >= row) hi = mid; else lo = mid + 1;
  }
  return lo;
}

// Whether key tile `key_tile`, which sees no rows and runs query tile `q_tile` as its one tile
// (packed_query_tiles' empty case), lies in that tile's range of key tiles above: it then takes its
// turn, adding nothing.
CUTLASS_DEVICE bool packed_tile_takes_turn(Packed const& s, Band const& band, int key_tile, int q_tile, int block_n,
                                           int block_m, int total_k) {
  const int first = packed_rows(s, band, key_tile * block_n, total_k).first;
  const int last = packed_last_row(s, band, key_tile, block_n, total_k);
  return int64_t(last) >= int64_t(q_tile) * block_m && int64_t(first) < int64_t(q_tile + 1) * block_m;
}

// Before a packed call's query loop: the query rows of the keys of this thread's scores, one per row
// of its accumulator (index: the scores' (key, query) coordinates, mma the tiled MMA whose
// accumulator they index, its rows being keys), kept in registers through the loop.
template <class Index, class TiledMma>
CUTLASS_DEVICE auto key_rows(Packed const& s, Band const& band, Index const& index, TiledMma const& mma,
                             int total_k) {
  auto index_mn = cute::make_tensor(index.data(), cutlass::fmha::collective::layout_acc_mn(mma, index.layout()));
  cute::array<Rows, decltype(cute::size<0>(index_mn))::value> rows;
  CUTLASS_PRAGMA_UNROLL
  for (int r = 0; r < cute::size<0>(index_mn); ++r) {
    rows[r] = packed_rows(s, band, int(cute::get<0>(index_mn(r, 0))), total_k);
  }
  return rows;
}

// The scores of a packed call outside each key's rows (key_rows) become -inf. acc holds the
// thread's scores, index their (key, query) coordinates.
template <class Acc, class Index, class TiledMma, class KeyRows>
CUTLASS_DEVICE void mask_packed_scores(Acc& acc, Index const& index, TiledMma const& mma, KeyRows const& rows) {
  using cutlass::fmha::collective::layout_acc_mn;
  auto acc_mn = cute::make_tensor(acc.data(), layout_acc_mn(mma, acc.layout()));
  auto index_mn = cute::make_tensor(index.data(), layout_acc_mn(mma, index.layout()));
  CUTLASS_PRAGMA_UNROLL
  for (int r = 0; r < cute::size<0>(acc_mn); ++r) {
    CUTLASS_PRAGMA_UNROLL
    for (int c = 0; c < cute::size<1>(acc_mn); ++c) {
      const int query = int(cute::get<1>(index_mn(r, c)));
      if (query < rows[r].first || query > rows[r].last) acc_mn(r, c) = -INFINITY;
    }
  }
}

// A query-tile index as the loads' step() walks it (operator* and ++): from tile i on, `step` (+1 or
// -1) a tile (split_dq.h's walk).
struct TileIndex {
  int i;
  int step;
  CUTLASS_DEVICE int operator*() const { return i; }
  CUTLASS_DEVICE TileIndex& operator++() {
    i += step;
    return *this;
  }
};

}  // namespace gemmgen::fmha_bwd_sm90
