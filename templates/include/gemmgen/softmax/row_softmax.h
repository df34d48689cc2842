// Row softmax of the unfused attention path: fp32 scores in (already scaled by the GEMM's
// alpha), probabilities in the input dtype out, causal masking by a key offset. One block per
// row: one pass keeps a running (max, sum) per thread, a block reduction merges them, a second
// pass writes exp(s - max) / sum. A row that sees no key is written as zeros.
#pragma once
#include <cfloat>
#include <cstdint>

#include <cuda_runtime.h>

#include "cutlass/numeric_conversion.h"
#include "cutlass/numeric_types.h"

#include "gemmgen/abi.h"
#include "gemmgen/gemm/batched_host.h"

namespace gemmgen::softmax {

constexpr float kLog2e = 1.4426950408889634f;  // exp(x) = exp2(x * log2(e))
constexpr int64_t kMaxBlocks = int64_t(1) << 30;  // grid.x limit is 2^31 - 1; rows loop beyond

// Merges two partial softmax states (max in the log2 domain, sum of exp2(x - max)).
struct State {
  float max, sum;
  __device__ static State merge(State a, State b) {
    float m = fmaxf(a.max, b.max);
    if (m == -INFINITY) return {m, 0.0f};  // neither has seen a key
    return {m, a.sum * exp2f(a.max - m) + b.sum * exp2f(b.max - m)};
  }
};

template <class Element, int Threads>
__global__ void __launch_bounds__(Threads) row_softmax_kernel(GemmgenSoftmaxArgs p) {
  constexpr int kWarps = Threads / 32;
  __shared__ State warp_states[kWarps];
  cutlass::NumericConverter<Element, float> to_element;
  const int64_t total = int64_t(p.matrices) * p.rows;
  for (int64_t row = blockIdx.x; row < total; row += gridDim.x) {
    const int64_t m = row / p.rows, r = row % p.rows;
    const float* s = p.s + m * p.s_matrix_stride + r * p.s_row_stride;
    Element* out = static_cast<Element*>(p.p) + m * p.p_matrix_stride + r * p.p_row_stride;
    int64_t visible = p.cols;
    if (p.causal) {
      const int64_t last = r + p.causal_offset + 1;  // keys [0, last) are visible
      visible = last < 0 ? 0 : last < visible ? last : visible;
    }

    State st{-INFINITY, 0.0f};
    for (int64_t j = threadIdx.x; j < visible; j += Threads) {
      st = State::merge(st, State{s[j] * kLog2e, 1.0f});
    }
    for (int offset = 16; offset > 0; offset /= 2) {
      State other{__shfl_xor_sync(0xffffffffu, st.max, offset), __shfl_xor_sync(0xffffffffu, st.sum, offset)};
      st = State::merge(st, other);
    }
    if (threadIdx.x % 32 == 0) warp_states[threadIdx.x / 32] = st;
    __syncthreads();
    State all = warp_states[0];
    for (int w = 1; w < kWarps; ++w) all = State::merge(all, warp_states[w]);
    __syncthreads();  // warp_states is rewritten by the next row

    const float inv = all.sum > 0.0f ? 1.0f / all.sum : 0.0f;
    for (int64_t j = threadIdx.x; j < p.cols; j += Threads) {
      out[j] = to_element(j < visible ? exp2f(s[j] * kLog2e - all.max) * inv : 0.0f);
    }
  }
}

template <class Element, int Threads>
int run(const GemmgenSoftmaxArgs* p, cudaStream_t stream, char* err, int err_len) {
  using gemmgen::report;
  if (p == nullptr) return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "args is NULL");
  if (p->s == nullptr || p->p == nullptr || p->rows < 1 || p->cols < 1 || p->matrices < 1) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "bad softmax args: rows %u cols %u matrices %u",
                  p->rows, p->cols, p->matrices);
  }
  const int64_t total = int64_t(p->matrices) * p->rows;
  row_softmax_kernel<Element, Threads>
      <<<dim3(unsigned(total < kMaxBlocks ? total : kMaxBlocks)), dim3(Threads), 0, stream>>>(*p);
  return gemm::check_launch(cudaSuccess, "row softmax launch", err, err_len);
}

}  // namespace gemmgen::softmax
