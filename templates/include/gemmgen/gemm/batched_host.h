// Host side shared by the batched GEMM families: argument checks and the plan that maps
// (batch, head) onto CUTLASS's single batch index L with a single L stride.
#pragma once
#include <cstdint>
#include <cstdio>

#include <cuda_runtime.h>

#include "gemmgen/abi.h"
#include "gemmgen/report.h"

namespace gemmgen::gemm {

// The batch index of CUTLASS 2.x batched GEMMs is grid.z, capped at 65535 by CUDA.
constexpr int64_t kMaxBatchPerLaunch = 65535;

// One launch of the underlying kernel: `count` matrices, the first at the element offsets
// a/b/c from the base pointers, the next ones `step_*` elements further each.
struct Launch {
  int64_t a, b, c;
  int64_t step_a, step_b, step_c;
  int count;
};

inline bool multiple(int64_t x, int64_t align) { return x % align == 0; }
inline bool aligned(const void* p, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(bytes) == 0;
}

// Calls launch(Launch) for each launch that covers all batch * num_heads matrices; stops at
// the first non-zero status and returns it. A single L stride expresses (batch, head) only
// when one of the two nests inside the other in all three operands (the usual contiguous
// [B, H, M, K] does); otherwise the outer loop runs on the host over the smaller of the two.
template <class F>
int for_each_launch(const GemmgenBatchedGemmStridedArgs& p, F&& launch) {
  const int64_t B = p.batch, H = p.num_heads;
  auto nests = [&](int64_t inner_a, int64_t inner_b, int64_t inner_c, int64_t outer_a,
                   int64_t outer_b, int64_t outer_c, int64_t n_inner) {
    return outer_a == n_inner * inner_a && outer_b == n_inner * inner_b && outer_c == n_inner * inner_c;
  };
  auto chunked = [&](Launch l, int64_t total) {
    for (int64_t first = 0; first < total; first += kMaxBatchPerLaunch) {
      Launch part = l;
      part.a += first * l.step_a;
      part.b += first * l.step_b;
      part.c += first * l.step_c;
      part.count = static_cast<int>(total - first < kMaxBatchPerLaunch ? total - first : kMaxBatchPerLaunch);
      if (int status = launch(part)) return status;
    }
    return 0;
  };
  if (H == 1 || B == 1) {  // one index: step by the strides of the dimension that is not 1
    bool heads = H > 1;
    return chunked({0, 0, 0, heads ? p.stride_a_head : p.stride_a_batch,
                    heads ? p.stride_b_head : p.stride_b_batch, heads ? p.stride_c_head : p.stride_c_batch, 0},
                   B * H);
  }
  if (nests(p.stride_a_head, p.stride_b_head, p.stride_c_head, p.stride_a_batch, p.stride_b_batch,
            p.stride_c_batch, H)) {
    return chunked({0, 0, 0, p.stride_a_head, p.stride_b_head, p.stride_c_head, 0}, B * H);
  }
  if (nests(p.stride_a_batch, p.stride_b_batch, p.stride_c_batch, p.stride_a_head, p.stride_b_head,
            p.stride_c_head, B)) {
    return chunked({0, 0, 0, p.stride_a_batch, p.stride_b_batch, p.stride_c_batch, 0}, B * H);
  }
  const bool loop_batch = B <= H;  // fewer host launches
  const int64_t outer = loop_batch ? B : H, inner = loop_batch ? H : B;
  for (int64_t o = 0; o < outer; ++o) {
    Launch l = loop_batch
        ? Launch{o * p.stride_a_batch, o * p.stride_b_batch, o * p.stride_c_batch,
                 p.stride_a_head, p.stride_b_head, p.stride_c_head, 0}
        : Launch{o * p.stride_a_head, o * p.stride_b_head, o * p.stride_c_head,
                 p.stride_a_batch, p.stride_b_batch, p.stride_c_batch, 0};
    if (int status = chunked(l, inner)) return status;
  }
  return 0;
}

// Checks shared by every strategy: sizes, layout, and that every row stride is a multiple of
// the instance's alignment (A and B in input elements, C in output elements).
template <class Sizes>
int check_sizes(const Sizes& p, bool b_transposed, int align_ab, int align_c, char* err, int err_len) {
  if (p.M < 1 || p.N < 1 || p.K < 1 || p.batch < 1 || p.num_heads < 1 || p.M > INT32_MAX ||
      p.N > INT32_MAX || p.K > INT32_MAX) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "bad sizes: M %u N %u K %u batch %u num_heads %u",
                  p.M, p.N, p.K, p.batch, p.num_heads);
  }
  if ((p.b_transposed != 0) != b_transposed) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "b_transposed %d, this instance runs %d",
                  p.b_transposed, int(b_transposed));
  }
  if (!multiple(p.stride_a_row, align_ab) || !multiple(p.stride_b_row, align_ab) ||
      !multiple(p.stride_c_row, align_c)) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  "row strides %lld/%lld/%lld must be multiples of %d/%d/%d elements",
                  (long long)p.stride_a_row, (long long)p.stride_b_row, (long long)p.stride_c_row,
                  align_ab, align_ab, align_c);
  }
  // K (A's row and B^T's row) and N (B's and C's row) must also be whole vectors.
  if (!multiple(p.K, align_ab) || !multiple(b_transposed ? p.K : p.N, align_ab) || !multiple(p.N, align_c)) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  "M %u N %u K %u: the contiguous extents must be multiples of the %d-element alignment",
                  p.M, p.N, p.K, align_ab);
  }
  return GEMMGEN_OK;
}

// The strided strategy's check beside check_sizes: the batch and head strides must be multiples of
// the alignment too (A and B in input elements, C in output elements), or a matrix after the first
// would start off it.
inline int check_batch_strides(const GemmgenBatchedGemmStridedArgs& p, int64_t align_ab, int64_t align_c,
                               char* err, int err_len) {
  if (!multiple(p.stride_a_batch, align_ab) || !multiple(p.stride_a_head, align_ab) ||
      !multiple(p.stride_b_batch, align_ab) || !multiple(p.stride_b_head, align_ab) ||
      !multiple(p.stride_c_batch, align_c) || !multiple(p.stride_c_head, align_c)) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  "batch and head strides must be multiples of %lld (A, B) and %lld (C) elements",
                  (long long)align_ab, (long long)align_c);
  }
  return GEMMGEN_OK;
}

inline int check_launch(cudaError_t e, const char* what, char* err, int err_len) {
  if (e == cudaSuccess) e = cudaGetLastError();
  if (e != cudaSuccess) {
    return report(err, err_len, GEMMGEN_CUDA_ERROR, "%s: %s", what, cudaGetErrorString(e));
  }
  return GEMMGEN_OK;
}

}  // namespace gemmgen::gemm
