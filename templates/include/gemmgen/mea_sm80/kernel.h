// Device side of the mea_sm80 family: one block of CUTLASS example 41's AttentionKernel (included
// from the CUTLASS package) per (query tile, head, batch), set up from GemmgenAttnParams by our own
// code instead of the example's advance_to_block: any strides for Q, K, V and O, GQA, the causal
// offset of the C ABI, variable lengths through cu_seqlens. After the kernel, the block writes LSE
// ([batch, heads, seqlen_q] float32, natural log) and clears the rows that saw no key.
#pragma once
#include <cfloat>
#include <cmath>
#include <cstdint>

#include "gemmgen/abi.h"

// Example 41 compiles its dropout only with HAS_PYTORCH; the two ATen headers it then includes are
// our stand-ins (include/ATen/cuda), which carry the (seed, offset) pair and nothing of PyTorch.
#ifndef HAS_PYTORCH
#define HAS_PYTORCH 1
#endif
#include "41_fused_multi_head_attention/kernel_forward.h"

namespace gemmgen::mea_sm80 {

template <class Element, int BlockM, int BlockN, int MaxHeadDim, bool Aligned>
struct KernelTraits {
  using Kernel = AttentionKernel<Element, cutlass::arch::Sm80, Aligned, BlockM, BlockN, MaxHeadDim,
                                 /*kSupportsDropout=*/true, /*kSupportsBias=*/true>;
  static constexpr int kBlockM = BlockM;
  static constexpr int kBlockN = BlockN;
  static constexpr int kMaxHeadDim = MaxHeadDim;
  static constexpr int kThreads = Kernel::kNumThreads;
  static constexpr int kWarps = Kernel::kNumWarpsPerBlock;
  static constexpr int kSmemSize = int(sizeof(typename Kernel::SharedStorage));
  // Elements per vector load of Q and K (16 bytes aligned, else 4 elements): head dim, strides and
  // pointers must be multiples of it.
  static constexpr int kAlignment = int(Kernel::kAlignmentQ);
  // A head dim above the key tile keeps the output in a float32 workspace between key tiles.
  static constexpr bool kNeedsWorkspace = Kernel::kNeedsOutputAccumulatorBuffer;
  static_assert(Kernel::kAlignmentQ == Kernel::kAlignmentK, "Q and K load alike");
};

struct LaunchArgs {
  GemmgenAttnParams p;
  float* workspace;      // [batch * seqlen_q rows, heads, head_dim] float32 when kNeedsWorkspace
  int32_t batch_offset;  // first batch of this launch: grid.z holds at most 65535 batches
};

constexpr float kLog2e = 1.4426950408889634f;  // the kernel keeps row maxima in log2 units

// Zero O rows [begin, end) of one (batch, head) and set their LSE to -inf: rows that see no key.
template <class Element>
__device__ void clear_rows(Element* o, int64_t row_stride, int head_dim, float* lse, int begin, int end) {
  const int tid = threadIdx.x + threadIdx.y * blockDim.x;
  const int threads = blockDim.x * blockDim.y;
  const int64_t count = int64_t(end - begin) * head_dim;
  for (int64_t i = tid; i < count; i += threads) {
    o[(begin + i / head_dim) * row_stride + i % head_dim] = Element(0);
  }
  if (lse != nullptr) {
    for (int r = begin + tid; r < end; r += threads) lse[r] = -INFINITY;
  }
}

template <class Traits>
__global__ void __launch_bounds__(Traits::Kernel::kNumThreads, Traits::Kernel::kMinBlocksPerSm)
    fwd_kernel(const LaunchArgs args) {
  using AK = typename Traits::Kernel;
  using Element = typename AK::scalar_t;
  constexpr int kBlockM = Traits::kBlockM;
  const GemmgenAttnParams& a = args.p;
  const int64_t b = int64_t(blockIdx.z) + args.batch_offset;
  const int h = blockIdx.y;
  const int h_kv = h / (a.heads / a.heads_kv);  // GQA: query head h reads key/value head h / group

  // This (batch, head)'s sequence: packed rows from cu_seqlens, else the batch stride.
  const bool varlen = a.cu_seqlens_q != nullptr;
  int len_q = a.seqlen_q, len_k = a.seqlen_k;
  int64_t q_base = b * a.q_batch_stride, k_base = b * a.k_batch_stride, v_base = b * a.v_batch_stride,
          o_base = b * a.o_batch_stride, first_row = b * a.seqlen_q;
  if (varlen) {
    const int64_t q0 = a.cu_seqlens_q[b], k0 = a.cu_seqlens_k[b];
    len_q = int(a.cu_seqlens_q[b + 1] - q0);
    len_k = int(a.cu_seqlens_k[b + 1] - k0);
    q_base = q0 * a.q_row_stride;
    o_base = q0 * a.o_row_stride;
    k_base = k0 * a.k_row_stride;
    v_base = k0 * a.v_row_stride;
    first_row = q0;
  }
  Element* q = const_cast<Element*>(static_cast<const Element*>(a.q)) + q_base + h * a.q_head_stride;
  Element* k = const_cast<Element*>(static_cast<const Element*>(a.k)) + k_base + h_kv * a.k_head_stride;
  Element* v = const_cast<Element*>(static_cast<const Element*>(a.v)) + v_base + h_kv * a.v_head_stride;
  Element* o = static_cast<Element*>(a.o) + o_base + h * a.o_head_stride;
  float* lse = a.lse != nullptr ? a.lse + (b * a.heads + h) * int64_t(a.seqlen_q) : nullptr;

  // Key j is visible to query i iff j <= i + causal_offset (INT32_MAX: no mask). Rows with
  // i + offset < 0 see no key: they are cleared, and the kernel runs on the rows after them with a
  // non-negative diagonal offset (it keeps that offset unsigned).
  const int64_t offset = a.causal_offset;
  const bool masked = offset < int64_t(len_k) - 1;
  const int skip = masked && offset < 0 ? int(offset < -int64_t(len_q) ? len_q : -offset) : 0;
  const int64_t diagonal = masked ? offset + skip : 0;
  const int rows = len_q - skip;  // rows the kernel computes
  const int row0 = blockIdx.x * kBlockM;  // this block's first row, counted from `skip`

  if (row0 < skip) clear_rows(o, a.o_row_stride, a.head_dim, lse, row0, min(skip, row0 + kBlockM));
  if (varlen && lse != nullptr) {  // LSE rows past this sequence's end: -inf, like rows without keys
    for (int r = max(row0, len_q) + threadIdx.x + threadIdx.y * blockDim.x; r < min(row0 + kBlockM, a.seqlen_q);
         r += blockDim.x * blockDim.y) {
      lse[r] = -INFINITY;
    }
  }
  if (row0 >= rows) return;  // uniform across the block

  typename AK::Params p;
  p.query_ptr = q + (skip + row0) * a.q_row_stride;
  p.key_ptr = k;
  p.value_ptr = v;
  p.output_ptr = o + (skip + row0) * a.o_row_stride;
  p.output_accum_ptr = Traits::kNeedsWorkspace
      ? args.workspace + ((first_row + skip + row0) * a.heads + h) * int64_t(a.head_dim)
      : nullptr;
  p.logsumexp_ptr = nullptr;  // written below, in the C ABI's layout
  // The kernel adds its own query_start (blockIdx.x * kBlockM) rows to the bias pointer.
  p.attn_bias_ptr = a.bias != nullptr
      ? const_cast<Element*>(static_cast<const Element*>(a.bias)) + b * a.bias_batch_stride +
            h * a.bias_head_stride + skip * a.bias_row_stride
      : nullptr;
  p.bias_strideM = int32_t(a.bias_row_stride);
  // A scale of exactly 0 turns masked scores (-inf) into NaN (0 * -inf); the smallest normal
  // float gives the same uniform weights.
  p.scale = a.scale == 0.f ? FLT_MIN : a.scale;
  p.head_dim = a.head_dim;
  p.head_dim_value = a.head_dim;
  p.num_heads = a.heads;  // row stride of the workspace is heads * head_dim
  p.num_queries = rows - row0;
  p.num_keys_absolute = len_k;
  // Like the kernel's own set-up: a causal tile stops at the last key its last row sees.
  p.num_keys = masked ? int32_t(min(int64_t(len_k), row0 + diagonal + kBlockM)) : len_k;
  p.custom_mask_type = masked ? AK::CausalFromTopLeft : AK::NoCustomMask;
  p.causal_diagonal_offset = uint32_t(diagonal);
  p.q_strideM = int32_t(a.q_row_stride);
  p.k_strideM = int32_t(a.k_row_stride);
  p.v_strideM = int32_t(a.v_row_stride);
  p.o_strideM = int32_t(a.o_row_stride);
  p.use_dropout = a.dropout_p > 0.f;
  p.dropout_prob = a.dropout_p;
  p.rng_engine_inputs = at::PhiloxCudaState(a.dropout_seed, a.dropout_offset);
  // Weight (b, h, i, j) draws Philox output offset + (b*H + h)*Nq*Nk + i*len_k + j (the kernel adds
  // i*len_k + j from the rows it computes, which start at row `skip`).
  p.dropout_batch_head_rng_offset = (uint64_t(b) * a.heads + h) * uint64_t(a.seqlen_q) * uint64_t(a.seqlen_k) +
                                    uint64_t(skip) * uint64_t(len_k);

  AK::attention_kernel(p);

  // The kernel leaves each row's maximum (log2 units) and sum of exponentials in shared memory.
  // A zero sum means the row saw no key (a sequence without keys, a bias row of -inf): its
  // epilogue divided 0 by 0 there, so the row is cleared.
  __syncthreads();
  extern __shared__ __align__(16) char smem[];
  auto& state = *reinterpret_cast<typename AK::SharedStorage*>(smem);
  const int tile_rows = min(kBlockM, rows - row0);
  for (int t = threadIdx.x + threadIdx.y * blockDim.x; t < tile_rows; t += blockDim.x * blockDim.y) {
    const float sum = state.s_prime[t];
    const bool empty = !(sum > 0.f);
    const int r = skip + row0 + t;
    if (lse != nullptr) lse[r] = empty ? -INFINITY : state.mi[t] / kLog2e + logf(sum);
    if (empty) {
      for (int c = 0; c < a.head_dim; ++c) o[r * a.o_row_stride + c] = Element(0);
    }
  }
}

}  // namespace gemmgen::mea_sm80
