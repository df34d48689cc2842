// Every layout, copy atom and size of one fa2_bwd_sm80 instance, derived from six parameters.
#pragma once
#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "gemmgen/fa2_sm80/traits.h"

namespace gemmgen::fa2_bwd_sm80 {
using namespace cute;

// Warps along the rows of a Rows x Cols GEMM output (the rest along the columns): of the splits that
// give every warp whole 16-row slices and whole 16-column steps, the one that reads the fewest
// operand elements from shared memory per k step (each warp reads its rows of A and its columns of
// B: (Warps / rows) * Rows + rows * Cols), the larger split on a tie; 0 where none fits.
template <int Rows, int Cols, int Warps>
constexpr int warp_rows() {
  int best = 0, best_reads = 0;
  for (int rows = 1; rows <= Warps; rows *= 2) {
    if (Warps % rows || Rows % (16 * rows) || Cols % (16 * (Warps / rows))) continue;
    const int reads = (Warps / rows) * Rows + rows * Cols;
    if (best == 0 || reads <= best_reads) {
      best = rows;
      best_reads = reads;
    }
  }
  return best;
}

// A TiledMMA of m16n8k16 atoms over a Rows x Cols output with `Warps` warps split by warp_rows. Each
// warp owns 16 columns per step (two n8 atoms), so one ldmatrix.x4 feeds two MMAs of the B operand.
template <class Element, int Rows, int Cols, int Warps>
struct WarpGrid {
  static constexpr int kRows = warp_rows<Rows, Cols, Warps>();
  static_assert(kRows > 0, "no split of the warps gives each whole 16-row slices and 16-column steps");
  static constexpr int kCols = Warps / kRows;
  using TiledMma = TiledMMA<MMA_Atom<typename fa2_sm80::MmaOp<Element>::type>, Layout<Shape<Int<kRows>, Int<kCols>, _1>>,
                            Tile<Int<16 * kRows>, Int<16 * kCols>, _16>>;
};

// One CTA owns BlockN keys of one (batch, head) and loops over the query tiles, BlockM rows at a
// time, with Stages buffers of Q and dO (2: the next tile loads while this one runs).
template <class Element_, int HeadDim, int BlockM, int BlockN, int Warps, int Stages>
struct BwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = HeadDim;
  static constexpr int kBlockM = BlockM;
  static constexpr int kBlockN = BlockN;
  static constexpr int kNWarps = Warps;
  static constexpr int kNThreads = 32 * Warps;
  static constexpr int kStages = Stages;

  // The three GEMM shapes of a step: S = Q K^T and dP = dO V^T (BlockM x BlockN); dV += P^T dO and
  // dK += dS^T Q (BlockN x HeadDim); dQ = dS K (BlockM x HeadDim).
  using GridSdP = WarpGrid<Element, BlockM, BlockN, Warps>;
  using GridKV = WarpGrid<Element, BlockN, HeadDim, Warps>;
  using GridQ = WarpGrid<Element, BlockM, HeadDim, Warps>;
  using TiledMmaSdP = typename GridSdP::TiledMma;
  using TiledMmaKV = typename GridKV::TiledMma;
  using TiledMmaQ = typename GridQ::TiledMma;

  // Shared-memory rows in swizzled chunks of 64 elements (32 where 64 does not divide the width):
  // the 16-byte cp.async stores and the ldmatrix reads, plain or transposed, are conflict-free.
  template <int Width>
  static constexpr int chunk() { return Width % 64 == 0 ? 64 : 32; }
  template <int Width>
  using SmemAtom = decltype(composition(Swizzle<chunk<Width>() == 64 ? 3 : 2, 3, 3>{},
                                        Layout<Shape<_8, Int<chunk<Width>()>>, Stride<Int<chunk<Width>()>, _1>>{}));
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom<HeadDim>{}, Shape<Int<BlockM>, Int<HeadDim>>{}));   // Q, dO
  using SmemLayoutKV = decltype(tile_to_shape(SmemAtom<HeadDim>{}, Shape<Int<BlockN>, Int<HeadDim>>{}));  // K, V
  using SmemLayoutPdS = decltype(tile_to_shape(SmemAtom<BlockN>{}, Shape<Int<BlockM>, Int<BlockN>>{}));   // P, dS
  // Transposed views, read with ldmatrix.trans: Q^T and dO^T (HeadDim, BlockM), K^T (HeadDim,
  // BlockN), P^T and dS^T (BlockN, BlockM). The NoSwizzle forms size the register fragments.
  using SmemLayoutQt = decltype(composition(SmemLayoutQ{}, make_layout(Shape<Int<HeadDim>, Int<BlockM>>{}, GenRowMajor{})));
  using SmemLayoutKt = decltype(composition(SmemLayoutKV{}, make_layout(Shape<Int<HeadDim>, Int<BlockN>>{}, GenRowMajor{})));
  using SmemLayoutPdSt = decltype(composition(SmemLayoutPdS{}, make_layout(Shape<Int<BlockN>, Int<BlockM>>{}, GenRowMajor{})));
  using SmemLayoutQtNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutQt{}));
  using SmemLayoutKtNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutKt{}));
  using SmemLayoutPdStNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutPdSt{}));

  using SmemCopyAtom = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomTransposed = Copy_Atom<SM75_U16x8_LDSM_T, Element>;
  using SmemCopyAtomStore = Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<32>, Element>;  // P, dS, dK, dV

  // Global <-> shared: 16 bytes per thread per access.
  static constexpr int kGmemElemsPerAccess = 16 / int(sizeof(Element));
  static constexpr int kGmemThreadsPerRow = chunk<HeadDim>() / kGmemElemsPerAccess;
  static constexpr int kGmemRowsPerPass = kNThreads / kGmemThreadsPerRow;
  using GmemLayoutAtom = Layout<Shape<Int<kGmemRowsPerPass>, Int<kGmemThreadsPerRow>>, Stride<Int<kGmemThreadsPerRow>, _1>>;
  using GmemTiledCopy = decltype(make_tiled_copy(Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL<cute::uint128_t>, Element>{},
                                                 GmemLayoutAtom{}, Layout<Shape<_1, Int<kGmemElemsPerAccess>>>{}));
  using GmemTiledCopyOut = decltype(make_tiled_copy(Copy_Atom<UniversalCopy<cute::uint128_t>, Element>{},
                                                    GmemLayoutAtom{}, Layout<Shape<_1, Int<kGmemElemsPerAccess>>>{}));

  // Shared memory, in elements: [Q x Stages][dO x Stages][K][V][P][dS]; dK and dV leave through the
  // K and V tiles' space at the end.
  static constexpr int kQElems = BlockM * HeadDim;
  static constexpr int kKVElems = BlockN * HeadDim;
  static constexpr int kPElems = BlockM * BlockN;
  static constexpr int kSmemSize = (2 * Stages * kQElems + 2 * kKVElems + 2 * kPElems) * int(sizeof(Element));

  static_assert(Stages == 1 || Stages == 2, "one or two Q/dO buffers");
  static_assert(BlockM % 16 == 0 && BlockN % 16 == 0 && HeadDim % 16 == 0, "MMA tiles are 16 wide");
  static_assert(BlockM % kGmemRowsPerPass == 0 && BlockN % kGmemRowsPerPass == 0, "tiles cover whole copy passes");
};

}  // namespace gemmgen::fa2_bwd_sm80
