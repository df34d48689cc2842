// Register-layout conversions, predicated tile copies and the two MMA loops of the kernel.
#pragma once
#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

namespace gemmgen::fa2_sm80 {
using namespace cute;

// Accumulator ((2,2), MMA_M, MMA_N) -> (row, col) view ((2, MMA_M), (2, MMA_N)).
// In an m16n8 accumulator a thread holds a column pair in row r and the same pair in r + 8.
template <class Layout>
CUTE_HOST_DEVICE constexpr auto rowcol(Layout const& acc) {
  static_assert(rank(Layout{}) == 3 && size<0>(Layout{}) == 4);
  auto l = logical_divide(acc, Shape<_2>{});  // ((2, 2), MMA_M, MMA_N)
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)), make_layout(get<0, 0>(l), get<2>(l)));
}

// Accumulator ((2,2), MMA_M, MMA_N) -> A-operand ((2,2,2), MMA_M, MMA_N / 2): two adjacent
// n8 accumulators hold exactly one k16 A fragment, so P feeds P V without leaving registers.
template <class Layout>
CUTE_HOST_DEVICE constexpr auto acc_to_a(Layout const& acc) {
  static_assert(rank(Layout{}) == 3 && size<0>(Layout{}) == 4);
  auto l = logical_divide(acc, Shape<Underscore, Underscore, _2>{});  // ((2,2), MMA_M, (2, MMA_N/2))
  return make_layout(make_layout(get<0>(l), get<2, 0>(l)), get<1>(l), get<2, 1>(l));
}

// Element-wise conversion of a register tensor (fp32 accumulators -> fp16/bf16), vectorized.
template <class To, class Engine, class Layout>
CUTE_DEVICE auto convert_to(Tensor<Engine, Layout> const& t) {
  using From = typename Engine::value_type;
  constexpr int N = decltype(size(t))::value;
  cutlass::NumericArrayConverter<To, From, N> convert;
  Tensor out = make_tensor<To>(t.layout());
  *reinterpret_cast<cutlass::Array<To, N>*>(out.data()) =
      convert(*reinterpret_cast<cutlass::Array<From, N> const*>(t.data()));
  return out;
}

// Copy a (CPY, CPY_ROWS, CPY_K) partition row by row; rows at or past `rows_left` are
// zero-filled instead, so out-of-range keys and values read as 0 and never as NaN.
template <class TiledCopy, class TS, class TD, class TC>
CUTE_DEVICE void copy_rows(TiledCopy const& tiled_copy, TS const& src, TD&& dst, TC const& coord,
                           int rows_left) {
  CUTE_UNROLL
  for (int m = 0; m < size<1>(src); ++m) {
    if (get<0>(coord(0, m, 0)) < rows_left) {
      cute::copy(tiled_copy, src(_, m, _), dst(_, m, _));
    } else {
      cute::clear(dst(_, m, _));
    }
  }
}

// acc += A B with both operands in shared memory; the ldmatrix of k-slice i+1 is issued
// before the MMAs of slice i so the two overlap.
template <class Acc, class RA, class RB, class SA, class SB, class TiledMma, class CopyA, class CopyB,
          class ThrCopyA, class ThrCopyB>
CUTE_DEVICE void gemm_ss(Acc& acc, RA& tCrA, RB& tCrB, SA const& tCsA, SB const& tCsB,
                         TiledMma const& tiled_mma, CopyA const& copy_a, CopyB const& copy_b,
                         ThrCopyA const& thr_copy_a, ThrCopyB const& thr_copy_b) {
  Tensor tCrA_view = thr_copy_a.retile_D(tCrA);
  Tensor tCrB_view = thr_copy_b.retile_D(tCrB);
  cute::copy(copy_a, tCsA(_, _, 0), tCrA_view(_, _, 0));
  cute::copy(copy_b, tCsB(_, _, 0), tCrB_view(_, _, 0));
  CUTE_UNROLL
  for (int i = 0; i < size<2>(tCrA); ++i) {
    if (i < size<2>(tCrA) - 1) {
      cute::copy(copy_a, tCsA(_, _, i + 1), tCrA_view(_, _, i + 1));
      cute::copy(copy_b, tCsB(_, _, i + 1), tCrB_view(_, _, i + 1));
    }
    cute::gemm(tiled_mma, tCrA(_, _, i), tCrB(_, _, i), acc);
  }
}

// acc += A B with A already in registers (P) and B in shared memory (V^T).
template <class Acc, class RA, class RB, class SB, class TiledMma, class CopyB, class ThrCopyB>
CUTE_DEVICE void gemm_rs(Acc& acc, RA const& tCrA, RB& tCrB, SB const& tCsB, TiledMma const& tiled_mma,
                         CopyB const& copy_b, ThrCopyB const& thr_copy_b) {
  Tensor tCrB_view = thr_copy_b.retile_D(tCrB);
  cute::copy(copy_b, tCsB(_, _, 0), tCrB_view(_, _, 0));
  CUTE_UNROLL
  for (int i = 0; i < size<2>(tCrA); ++i) {
    if (i < size<2>(tCrA) - 1) cute::copy(copy_b, tCsB(_, _, i + 1), tCrB_view(_, _, i + 1));
    cute::gemm(tiled_mma, tCrA(_, _, i), tCrB(_, _, i), acc);
  }
}

}  // namespace gemmgen::fa2_sm80
