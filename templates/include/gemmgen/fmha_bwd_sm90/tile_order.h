// The order in which the causal backward's CTAs start (one CTA per key tile of block_n keys, head
// and batch entry), the Base of example 88's TileSchedulerBwdAdapter (which swaps the coordinates
// this returns into the mainloop's order). Without a mask every CTA visits every query tile and
// example 88's IndividualTileScheduler stays: grid (key tiles, batch, heads), each head's key tiles
// in a row, so neighbouring CTAs share the head's Q, dO and dQ accumulator in L2.
//
// With a top-left causal mask key tile t visits the query tiles from the diagonal on: key tile 0
// the most, the last the fewest. Head by head, the last heads' key tile 0 would start near the end
// and end long after the rest (up to one whole CTA's time past it where a head's work spread over
// the SMs is shorter than that CTA). Here the grid is (heads, key tiles, batch): within a batch
// entry, key tile 0 of every head starts first, then key tile 1, and so on, the longest CTAs first,
// the last to start short. The coordinates stay special registers (a computed order spills the
// math warp groups' registers). Where the heads of one launch would not share L2, the launch
// takes fewer heads at a time (launch.h: causal_heads_per_launch).
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/kernel_hardware_info.h"

namespace gemmgen::fmha_bwd_sm90 {

struct CausalKeyTileOrder {
  struct Params {
    dim3 grid;
  };

  bool valid_ = true;

  CUTLASS_DEVICE explicit CausalKeyTileOrder(Params const&) {}

  // problem: (batch, heads, seqlen_k, seqlen_q, d) and tile (block_n, block_m, d), as the adapter
  // passes them. The launch keeps the key tiles and the batch within the grid's y and z limits.
  template <class ProblemSize, class ClusterShape, class TileShape>
  static Params to_underlying_arguments(ProblemSize const& problem, cutlass::KernelHardwareInfo,
                                        ClusterShape const&, TileShape const& tile) {
    using namespace cute;
    return Params{dim3(static_cast<unsigned>(get<1>(problem)),
                       static_cast<unsigned>(ceil_div(int(get<2>(problem)), int(get<0>(tile)))),
                       static_cast<unsigned>(get<0>(problem)))};
  }

  static dim3 get_grid_shape(Params const& params) { return params.grid; }

  CUTLASS_DEVICE bool is_valid() { return valid_; }

  // (key tile, 0, (batch, head)) of this CTA.
  CUTLASS_DEVICE auto get_block_coord() {
    using namespace cute;
    return make_coord(blockIdx.y, _0{}, make_coord(blockIdx.z, blockIdx.x));
  }

  CUTLASS_DEVICE CausalKeyTileOrder& operator++() {
    valid_ = false;
    return *this;
  }
};

}  // namespace gemmgen::fmha_bwd_sm90
