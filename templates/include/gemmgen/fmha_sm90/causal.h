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
