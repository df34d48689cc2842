// The causal mask of the fmha_sm90 family, aligned bottom-right: query row i sees keys
// j <= i + seqlen_k - seqlen_q, the offset read from the kernel's problem size. The launcher
// (launch.h) hands the kernel seqlen_k = seqlen_q + the call's causal offset, so one instance
// serves any offset in [0, seqlen_k - seqlen_q]: top-left calls (offset 0; the keys past seqlen_q,
// which no row sees, are not read) and bottom-right ones (chunked prefill against a longer context).
//
// The contract with CUTLASS's example-88 mainloops (a Fusion): the key tiles of a row tile are
// walked in order; the first and the last get_masked_trip_count() of them have the mask applied
// (before_softmax), the ones between do not. A key tile may go unmasked only when every row of the
// row tile sees all of its keys.
#pragma once
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"

#include "88_hopper_fmha/collective/fmha_fusion.hpp"

namespace gemmgen::fmha_sm90 {

struct BottomRightCausal : cutlass::fmha::collective::DefaultFusion {
  // Problem size: (batch, heads, seqlen_q, seqlen_k, head_dim); block coordinate: (row tile, ...).
  template <class ProblemSize>
  CUTLASS_DEVICE static int offset(ProblemSize const& ps) {
    return int(cute::get<3>(ps)) - int(cute::get<2>(ps));  // >= 0: the launcher guarantees it
  }

  // Key tiles up to the one holding the last key the row tile's last row sees.
  template <class BlkCoord, class TileShape, class ProblemSize>
  CUTLASS_DEVICE int get_trip_count(BlkCoord const& blk, TileShape const& tile, ProblemSize const& ps) {
    const int last_key = (int(cute::get<0>(blk)) + 1) * int(cute::get<0>(tile)) - 1 + offset(ps);
    const int all = cute::ceil_div(int(cute::get<3>(ps)), int(cute::get<1>(tile)));
    const int seen = last_key / int(cute::get<1>(tile)) + 1;
    return seen < all ? seen : all;
  }

  // Key tiles every row sees whole: those ending at or before the first row's last key, the last
  // tile excluded (it may hold keys past seqlen_k, which only the mask hides).
  template <class BlkCoord, class TileShape, class ProblemSize>
  CUTLASS_DEVICE int get_unmasked_trip_count(BlkCoord const& blk, TileShape const& tile, ProblemSize const& ps) {
    const int first_row_keys = int(cute::get<0>(blk)) * int(cute::get<0>(tile)) + offset(ps) + 1;
    const int whole = first_row_keys / int(cute::get<1>(tile));
    const int trips = get_trip_count(blk, tile, ps);
    return whole < trips - 1 ? whole : trips - 1;
  }

  template <class BlkCoord, class TileShape, class ProblemSize>
  CUTLASS_DEVICE int get_masked_trip_count(BlkCoord const& blk, TileShape const& tile, ProblemSize const& ps) {
    return get_trip_count(blk, tile, ps) - get_unmasked_trip_count(blk, tile, ps);
  }

  template <class AccQK, class IndexQK, class ProblemSize>
  CUTLASS_DEVICE void before_softmax(AccQK& acc_qk, IndexQK const& index_qk, ProblemSize const& ps) {
    const int off = offset(ps);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < cute::size(acc_qk); i++) {
      auto pos = index_qk(i);
      if (int(cute::get<0>(pos)) + off < int(cute::get<1>(pos))) acc_qk(i) = -INFINITY;
    }
  }
};

}  // namespace gemmgen::fmha_sm90

namespace gemmgen::fmha_sm90 {

// The problem size the persistent kernel hands its mainloop's Fusion and softmax when it runs a
// sliding window: CUTLASS's (batch, heads, seqlen_q, seqlen_k, head_dim), which the mainloop passes
// on to them only, and the window as offsets from a row's index: key j is visible to row i iff
// i + lo <= j <= i + hi.
struct WindowShape {
  cute::tuple<int, int, int, int, int> size;
  int lo;
  int hi;
};

// The sliding-window mask (Mask.LOCAL) of the persistent schedule. Row tile m (BlockM rows) reads
// the key tiles [first_tile, first_tile + get_trip_count): from the one holding its first row's
// first visible key to the one holding its last row's last. The kernel's own K/V loader starts at
// first_tile; CUTLASS's consumer loop counts key positions from 0, so before_softmax adds the start
// back (it finds the row tile from the row index). Every key tile goes through before_softmax
// (get_unmasked_trip_count 1: the first, which the mainloop always masks), which masks only where a
// thread holds scores outside the window; the launcher guarantees that every row sees a key (its
// diagonal, the offset in [0, seqlen_k - seqlen_q]), so every row tile has a key tile.
template <int BlockM, int BlockN>
struct LocalWindow : cutlass::fmha::collective::DefaultFusion {
  static constexpr bool kWindow = true;

  template <class BlkCoord>
  CUTLASS_DEVICE static int first_tile(BlkCoord const& blk, WindowShape const& ps) {
    const int first_key = int(cute::get<0>(blk)) * BlockM + ps.lo;
    return first_key <= 0 ? 0 : first_key / BlockN;
  }

  template <class BlkCoord, class TileShape>
  CUTLASS_DEVICE int get_trip_count(BlkCoord const& blk, TileShape const&, WindowShape const& ps) {
    const int seqlen_q = cute::get<2>(ps.size), seqlen_k = cute::get<3>(ps.size);
    const int row0 = int(cute::get<0>(blk)) * BlockM;
    const int last_row = (row0 + BlockM < seqlen_q ? row0 + BlockM : seqlen_q) - 1;
    const long long last_key = (long long)last_row + ps.hi;  // hi may be "unbounded" (large)
    const int all = cute::ceil_div(seqlen_k, BlockN);
    const int end = last_key / BlockN + 1 < all ? int(last_key / BlockN) + 1 : all;
    return end - first_tile(blk, ps);
  }

  template <class BlkCoord, class TileShape>
  CUTLASS_DEVICE int get_unmasked_trip_count(BlkCoord const&, TileShape const&, WindowShape const&) {
    return 1;
  }

  template <class BlkCoord, class TileShape>
  CUTLASS_DEVICE int get_masked_trip_count(BlkCoord const& blk, TileShape const& tile, WindowShape const& ps) {
    return get_trip_count(blk, tile, ps) - 1;
  }

  // Masks the scores outside the window. A thread whose scores all lie inside it (its rows' and key
  // positions' bounds: the index layout is static, so they are the tile's origin plus constants)
  // leaves them: only the tiles at the window's edges and the last key tile pay for the mask.
  template <class AccQK, class IndexQK>
  CUTLASS_DEVICE void before_softmax(AccQK& acc_qk, IndexQK const& index_qk, WindowShape const& ps) {
    const int seqlen_k = cute::get<3>(ps.size);
    int row_lo = int(cute::get<0>(index_qk(0))), row_hi = row_lo;
    int col_lo = int(cute::get<1>(index_qk(0))), col_hi = col_lo;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 1; i < cute::size(acc_qk); i++) {
      auto pos = index_qk(i);
      row_lo = cute::min(row_lo, int(cute::get<0>(pos)));
      row_hi = cute::max(row_hi, int(cute::get<0>(pos)));
      col_lo = cute::min(col_lo, int(cute::get<1>(pos)));
      col_hi = cute::max(col_hi, int(cute::get<1>(pos)));
    }
    // The key tiles count from the row tile's first one (all of a thread's rows lie in one row tile).
    const int first_key = (row_lo / BlockM) * BlockM + ps.lo;
    const int shift = (first_key <= 0 ? 0 : first_key / BlockN) * BlockN;
    if (col_lo + shift >= row_hi + ps.lo && col_hi + shift <= row_lo + ps.hi && col_hi + shift < seqlen_k) return;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < cute::size(acc_qk); i++) {
      auto pos = index_qk(i);
      const int row = int(cute::get<0>(pos));
      const int key = int(cute::get<1>(pos)) + shift;
      if (key < row + ps.lo || key > row + ps.hi || key >= seqlen_k) acc_qk(i) = -INFINITY;
    }
  }
};

}  // namespace gemmgen::fmha_sm90
