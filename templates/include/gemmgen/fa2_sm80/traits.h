// Every layout, copy atom and size of one fa2_sm80 instance, derived from six parameters.
#pragma once
#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

namespace gemmgen::fa2_sm80 {
using namespace cute;

template <class Element> struct MmaOp;
template <> struct MmaOp<cutlass::half_t> { using type = SM80_16x8x16_F32F16F16F32_TN; };
template <> struct MmaOp<cutlass::bfloat16_t> { using type = SM80_16x8x16_F32BF16BF16F32_TN; };

template <class Element_, int HeadDim, int BlockM, int BlockN, int Warps, int Stages>
struct KernelTraits {
  using Element = Element_;
  static constexpr int kHeadDim = HeadDim;
  static constexpr int kBlockM = BlockM;
  static constexpr int kBlockN = BlockN;
  static constexpr int kNWarps = Warps;
  static constexpr int kNThreads = 32 * Warps;
  // 1: one K and one V buffer, each loading while the other is used (FlashAttention-2);
  // 2: K and V double-buffered, a whole tile loading ahead.
  static constexpr int kStages = Stages;

  // Warps split the query rows: each owns 16-row slices of S = Q K^T and of O.
  // The N and K tiles of 16 let one ldmatrix.x4 feed two m16n8k16 atoms.
  using TiledMma = TiledMMA<MMA_Atom<typename MmaOp<Element>::type>,
                            Layout<Shape<Int<kNWarps>, _1, _1>>,
                            Tile<Int<16 * kNWarps>, _16, _16>>;

  // Shared-memory rows are handled in chunks of 64 elements (128 bytes, a full bank sweep)
  // or 32 for head dims that 64 does not divide; the XOR swizzle over 8 rows makes both
  // the 16-byte cp.async stores and the ldmatrix reads conflict-free.
  static constexpr int kBlockKSmem = kHeadDim % 64 == 0 ? 64 : 32;
  static constexpr int kSwizzleBits = kBlockKSmem == 64 ? 3 : 2;
  using SmemLayoutAtom = decltype(composition(
      Swizzle<kSwizzleBits, 3, 3>{}, Layout<Shape<_8, Int<kBlockKSmem>>, Stride<Int<kBlockKSmem>, _1>>{}));
  using SmemLayoutQ = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  // V viewed as V^T (head_dim, BlockN): the B operand of P V, read with ldmatrix.trans.
  using SmemLayoutVt = decltype(composition(
      SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, GenRowMajor{})));
  using SmemLayoutVtNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutVt{}));

  using SmemCopyAtom = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomTransposed = Copy_Atom<SM75_U16x8_LDSM_T, Element>;
  using SmemCopyAtomO = Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<32>, Element>;

  // Global <-> shared: 16 bytes per thread per access, a row chunk per group of threads.
  static constexpr int kGmemElemsPerAccess = 16 / int(sizeof(Element));
  static constexpr int kGmemThreadsPerRow = kBlockKSmem / kGmemElemsPerAccess;
  static constexpr int kGmemRowsPerPass = kNThreads / kGmemThreadsPerRow;
  using GmemLayoutAtom = Layout<Shape<Int<kGmemRowsPerPass>, Int<kGmemThreadsPerRow>>,
                                Stride<Int<kGmemThreadsPerRow>, _1>>;
  using GmemTiledCopyQKV = decltype(make_tiled_copy(
      Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL<cute::uint128_t>, Element>{}, GmemLayoutAtom{},
      Layout<Shape<_1, Int<kGmemElemsPerAccess>>>{}));
  using GmemTiledCopyO = decltype(make_tiled_copy(
      Copy_Atom<UniversalCopy<cute::uint128_t>, Element>{}, GmemLayoutAtom{},
      Layout<Shape<_1, Int<kGmemElemsPerAccess>>>{}));

  // Q tile, then a K and a V tile per stage; O is staged through the Q tile's space.
  static constexpr int kSmemSize = (kBlockM + 2 * kStages * kBlockN) * kHeadDim * int(sizeof(Element));

  static_assert(kBlockM % (16 * kNWarps) == 0, "each warp owns whole 16-row MMA slices");
  static_assert(kStages == 1 || kStages == 2, "one or two pipeline stages");
  static_assert(kBlockN % 16 == 0 && kHeadDim % 16 == 0, "MMA tiles are 16 wide");
  static_assert(kBlockM % kGmemRowsPerPass == 0 && kBlockN % kGmemRowsPerPass == 0,
                "tiles cover whole copy passes");
};

}  // namespace gemmgen::fa2_sm80
