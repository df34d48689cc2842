// Online softmax over key tiles (FlashAttention-2): running row max and row sum, with the
// O accumulator rescaled whenever the max grows. Scores arrive raw (Q K^T); the scale and
// log2(e) fold into one FFMA feeding each exp2, as in FlashAttention-2. The scale is
// positive here: the kernel turns a negative one into a positive one on negated Q.
#pragma once
#include <cmath>
#include <cute/tensor.hpp>

#include "gemmgen/fa2_sm80/utils.h"

namespace gemmgen::fa2_sm80 {
using namespace cute;

// The four threads of a quad share each accumulator row (lanes 4r .. 4r+3).
CUTE_DEVICE float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
}
CUTE_DEVICE float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 2);
  return x + __shfl_xor_sync(0xffffffff, x, 1);
}

template <int kRows>
struct OnlineSoftmax {
  // Per thread-row state: max of the scaled scores seen (log2 domain) and the partial sum of
  // exp2(score - max) over this thread's columns (the quad reduction waits for the end).
  Tensor<ArrayEngine<float, kRows>, Layout<Shape<Int<kRows>>>> row_max, row_sum;
  float scale_log2;  // softmax scale * log2(e), > 0 (see launch.h and the kernel)

  CUTE_DEVICE explicit OnlineSoftmax(float scale_log2_) : scale_log2(scale_log2_) {
    fill(row_max, -INFINITY);
    fill(row_sum, 0.f);
  }

  // scores: (rows, cols) view of S for one key tile, overwritten with P = exp2(S - max).
  // acc_o: (rows, cols) view of O, rescaled to the new max, except on the first key tile
  // (First), where O is still zero: a tile's worth of multiplies saved per row tile, which
  // counts when causal row tiles see only a few key tiles.
  template <bool First, class TS, class TO>
  CUTE_DEVICE void update(TS&& scores, TO&& acc_o) {
    static_assert(decltype(size<0>(scores))::value == kRows);
    CUTE_UNROLL
    for (int mi = 0; mi < kRows; ++mi) {
      float top = scores(mi, 0);
      CUTE_UNROLL
      for (int ni = 1; ni < size<1>(scores); ++ni) top = fmaxf(top, scores(mi, ni));
      const float m = quad_max(fmaxf(row_max(mi), top * scale_log2));
      // A row that has seen only masked keys keeps max -inf: subtract 0 instead so that
      // exp2(-inf - (-inf)) never makes a NaN; its P stays 0 and its sum 0.
      const float m_safe = m == -INFINITY ? 0.f : m;
      const float correction = exp2f(row_max(mi) - m_safe);
      row_max(mi) = m;
      float sum = 0.f;
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(scores); ++ni) {
        scores(mi, ni) = exp2f(fmaf(scores(mi, ni), scale_log2, -m_safe));
        sum += scores(mi, ni);
      }
      row_sum(mi) = row_sum(mi) * correction + sum;
      if constexpr (!First) {
        CUTE_UNROLL
        for (int ni = 0; ni < size<1>(acc_o); ++ni) acc_o(mi, ni) *= correction;
      }
    }
  }

  // Normalizes O by the row sums and returns the natural-log LSE per row (-inf for a row
  // that saw no key, whose O is then exactly 0).
  template <class TO>
  CUTE_DEVICE Tensor<ArrayEngine<float, kRows>, Layout<Shape<Int<kRows>>>> finalize(TO&& acc_o) {
    constexpr float kLn2 = 0.6931471805599453f;
    Tensor<ArrayEngine<float, kRows>, Layout<Shape<Int<kRows>>>> lse;
    CUTE_UNROLL
    for (int mi = 0; mi < kRows; ++mi) {
      const float sum = quad_sum(row_sum(mi));
      const bool empty = sum == 0.f;
      const float inv = empty ? 0.f : 1.f / sum;
      lse(mi) = empty ? -INFINITY : (row_max(mi) + __log2f(sum)) * kLn2;
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(acc_o); ++ni) acc_o(mi, ni) *= inv;
    }
    return lse;
  }
};

}  // namespace gemmgen::fa2_sm80
