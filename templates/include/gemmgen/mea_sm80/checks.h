// Host-side checks that the launches of CUTLASS example 41's kernels share (mea_sm80's forward and
// mea_bwd_sm80's backward): the head dims an instance runs and the kernels' 32-bit row indexing.
// Errors come back as a status and a message.
#pragma once
#include <cstdint>

#include "gemmgen/abi.h"
#include "gemmgen/report.h"

namespace gemmgen::mea_sm80 {

constexpr int64_t kInt32Max = 2147483647;

// The kernels multiply row indices by row strides in 32 bits: rows * |stride| must fit.
inline bool rows_fit_int32(int64_t rows, int64_t row_stride) {
  const int64_t s = row_stride < 0 ? -row_stride : row_stride;
  return s <= kInt32Max && (rows <= 1 || s <= kInt32Max / rows);
}

// An instance runs every multiple of its alignment (Traits::kAlignment elements) up to its bound
// (Traits::kMaxHeadDim, the kernels' kMaxK).
template <class Traits>
int check_head_dim(int head_dim, char* err, int err_len) {
  constexpr int kAlign = Traits::kAlignment;
  if (head_dim < 1 || head_dim > Traits::kMaxHeadDim || head_dim % kAlign) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  "head_dim %d, this instance runs multiples of %d up to %d", head_dim, kAlign,
                  Traits::kMaxHeadDim);
  }
  return GEMMGEN_OK;
}

}  // namespace gemmgen::mea_sm80
