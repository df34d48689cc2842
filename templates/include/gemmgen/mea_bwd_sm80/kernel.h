// Device side of the mea_bwd_sm80 family: CUTLASS example 41's AttentionBackwardKernel (included
// from the CUTLASS package) run per (key split, head, batch) from GemmgenAttnBwdParams by our own
// set-up instead of the example's advance_to_block, with two small kernels around it:
//
//   prep     - the LSE the kernel reads (the forward's, -inf made +inf, rows padded with +inf),
//              zeros where the kernel writes nothing (dQ of rows that see no key, dK and dV of keys
//              no row sees, dBias outside the visited tiles), O's packed copy where O is staged;
//   backward - the example's kernel on one (batch, head) and its share of the key blocks;
//   copy-out - staged dQ, dK and dV into the caller's tensors.
//
// Conventions the kernel relies on (and the forwards keep): LSE is the natural-log logsumexp of
// scale * Q K^T (+ bias) over the visible keys; the kernel forms P = exp(scale * Q K^T + bias - LSE)
// itself, so a row that saw no key (LSE -inf, O zero) gets LSE +inf here: its P is 0 and all its
// gradients are 0, never NaN. The kernel computes delta = rowsum(dO * O) itself, from O and dO.
#pragma once
#include <cmath>
#include <cstdint>

#include <curand_kernel.h>

#include "gemmgen/abi.h"

namespace gemmgen::mea_bwd_sm80 {
constexpr int kDropoutStreamBytes = 16;  // two 64-bit words after the kernel's shared storage

// The Philox stream of the (batch, head) a CTA runs: seed, then the position of its first weight,
// dropout_offset + (b * heads + h) * seqlen_q * seqlen_k + skipped rows * the sequence's keys (the
// forward mea_sm80's numbering). It lives in the last kDropoutStreamBytes of the CTA's dynamic shared memory
// (a dropout launch asks for that much more than the kernel's SharedStorage), so the storage keeps
// the alignment the kernel lays it out for. Written by the CTA before the kernel runs.
__device__ __forceinline__ unsigned long long* dropout_stream() {
  extern __shared__ __align__(16) char gemmgen_mea_bwd_sm80_smem[];
  unsigned bytes;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
  return reinterpret_cast<unsigned long long*>(gemmgen_mea_bwd_sm80_smem + bytes - kDropoutStreamBytes);
}
}  // namespace gemmgen::mea_bwd_sm80

// Example 41's backward seeds its dropout generator only when built with HAS_PYTORCH, which needs
// PyTorch headers gemmgen has no stand-ins for (ATen/cuda/CUDAContext.h, c10/cuda/CUDAGuard.h).
// Built without it, the kernel still places each weight's draw with
//   skipahead(int position, curandStatePhilox4_32_10_t*)   position = row * num_keys + key
// on a state it never initialized. This overload, an exact match where cuRAND's takes an unsigned
// long long, initializes the state at that position of the CTA's stream instead: curand_init(seed,
// 0, base + position) draws what curand_init(seed, 0, base) followed by skipahead(position) draws,
// which is how the forward places the same weight. The position is taken as unsigned 32-bit, as
// the forward computes it.
#ifdef HAS_PYTORCH
#error "mea_bwd_sm80 seeds example 41's dropout through skipahead below; build it without HAS_PYTORCH"
#endif
__device__ __forceinline__ void skipahead(int position, curandStatePhilox4_32_10_t* state) {
  const unsigned long long* stream = gemmgen::mea_bwd_sm80::dropout_stream();
  curand_init(stream[0], 0, stream[1] + static_cast<unsigned long long>(static_cast<unsigned int>(position)), state);
}

#include "41_fused_multi_head_attention/kernel_backward.h"

namespace gemmgen::mea_bwd_sm80 {

template <class Element, int BlockI, int BlockJ, int MaxHeadDim, bool Preload, bool Dropout>
struct KernelTraits {
  using Kernel = AttentionBackwardKernel<cutlass::arch::Sm80, Element, /*kIsAligned=*/true, Dropout, Preload,
                                         BlockI, BlockJ, MaxHeadDim, /*kKeysQueriesAlignedToBlockSize=*/false,
                                         /*kEnableSplitKeys=*/true>;
  static constexpr int kBlockI = BlockI;
  static constexpr int kBlockJ = BlockJ;
  static constexpr int kMaxHeadDim = MaxHeadDim;
  static constexpr bool kDropout = Dropout;
  static constexpr int kThreads = int(Kernel::kNumThreads);
  static constexpr int kMinBlocksPerSm = int(Kernel::kMinBlocksPerSm);
  // Dynamic shared memory of a launch: the kernel's storage, and the dropout stream after it.
  static constexpr int kSmemSize = int(sizeof(typename Kernel::SharedStorage)) + (Dropout ? kDropoutStreamBytes : 0);
  // Elements per 16-byte vector: head dim, strides and pointers are multiples of it (kIsAligned).
  static constexpr int kAlignment = 16 / int(sizeof(Element));
  static_assert(Kernel::DefaultConfig::kAlignmentA == kAlignment, "the aligned kernel loads 16-byte vectors");
  // Every float32 accumulator tile (dQ, dK, dV) is one size: the plan sizes the workspace by it.
  static_assert(Kernel::MatmulGradK::AccumTileGmem::kElementsStored ==
                        Kernel::MatmulGradQ::AccumTileGmem::kElementsStored &&
                    Kernel::MatmulGradV::AccumTileGmem::kElementsStored ==
                        Kernel::MatmulGradQ::AccumTileGmem::kElementsStored,
                "accumulator tiles of one size");
  static_assert(int(Kernel::NoCustomMask) == 0 && int(Kernel::CausalFromTopLeft) == 1 &&
                    int(Kernel::CausalFromBottomRight) == 2,
                "map_mask below numbers the kernel's masks");
};

// The kernel's masks, as AttentionBackwardKernel::CustomMaskType numbers them.
constexpr int kNoMask = 0;
constexpr int kTopLeft = 1;      // key j visible to query i iff j <= i
constexpr int kBottomRight = 2;  // iff j <= i + num_keys - num_queries

// One (batch, head)'s sequence as the kernel runs it.
struct Sequence {
  int len_q = 0, len_k = 0;  // this sequence's rows and keys
  int skip = 0;              // leading query rows that see no key: not run, their dQ is zero
  int rows = 0;              // query rows the kernel runs, from row `skip`
  int keys = 0;              // keys the kernel runs, from key 0 (the rest are hidden from every row)
  int mask = kNoMask;
  __host__ __device__ bool runs() const { return rows > 0 && keys > 0; }
};

// The C ABI's offset c (key j visible to query i iff j <= i + c) on the kernel's masks: rows with
// i + c < 0 see no key and are skipped (c' = c + skip counts from the first row run); c' = 0 is
// top-left; c' > 0 is bottom-right over keys = rows + c' (the keys after those are hidden from
// every row). Returns false for the one case the kernel cannot express: 0 < c' < len_k - 1 with
// rows + c' > len_k (bottom-right would need keys the sequence does not have).
__host__ __device__ inline bool map_mask(int64_t c, int len_q, int len_k, Sequence& s) {
  s.len_q = len_q;
  s.len_k = len_k;
  s.skip = 0;
  s.rows = len_q;
  s.keys = len_k;
  s.mask = kNoMask;
  if (len_q <= 0 || len_k <= 0 || c >= int64_t(len_k) - 1) return true;
  if (c < 0) {
    s.skip = c < -int64_t(len_q) ? len_q : int(-c);
    s.rows = len_q - s.skip;
    c += s.skip;
    if (s.rows == 0) return true;
  }
  if (c == 0) {
    s.mask = kTopLeft;
    return true;
  }
  if (int64_t(s.rows) + c > len_k) return false;
  s.keys = int(s.rows + c);
  s.mask = kBottomRight;
  return true;
}

// Where the kernel reads O and writes dQ, dK and dV, and how the workspace is cut. Example 41
// derives those row strides from two numbers: O's is head_dim * heads_factor (Params::num_heads),
// the gradients' head_dim * heads_factor * grad_multiplier (all three alike). A tensor whose strides
// are not of that form goes through a packed copy in the workspace ("staged"): row r of (batch,
// head) u at ((u / n) * rows * n + r * n + u % n) * head_dim for the interleave n of its stride.
struct Plan {
  int32_t heads_factor = 1;
  int32_t grad_multiplier = 1;
  int32_t stage_o = 0;
  int32_t stage_grads = 0;
  int32_t splits = 1;      // CTAs per (batch, head), each a share of the key blocks (gridDim.x)
  int32_t lse_stride = 0;  // floats per (batch, head) in the LSE copy: seqlen_q rounded up to 32
  // The kernel's float32 workspace per (batch, head): each key split's dK and dV accumulators (where
  // they do not stay in registers), then the dQ accumulators of every query block.
  int64_t ws_stride_bh = 0, ws_gk_split = 0, ws_gv_split = 0;
  // Byte offsets of the workspace's parts, and its size.
  int64_t off_kernel = 0, off_delta = 0, off_lse = 0, off_o = 0, off_dq = 0, off_dk = 0, off_dv = 0;
  int64_t bytes = 0;
};

struct LaunchArgs {
  GemmgenAttnBwdParams p;
  Plan plan;
  char* workspace;
  int32_t batch_offset;  // first batch of this launch: grid.z holds at most 65535 batches
};

__device__ inline int clamp_len(int64_t len, int max) { return int(len < 0 ? 0 : len > max ? max : len); }

// Sequence b: its lengths (cu_seqlens, within the maxima, else the fixed sizes) on the mask.
__device__ inline Sequence sequence_of(const GemmgenAttnBwdParams& a, int64_t b) {
  int len_q = a.seqlen_q, len_k = a.seqlen_k;
  if (a.cu_seqlens_q != nullptr) {
    len_q = clamp_len(int64_t(a.cu_seqlens_q[b + 1]) - a.cu_seqlens_q[b], a.seqlen_q);
    len_k = clamp_len(int64_t(a.cu_seqlens_k[b + 1]) - a.cu_seqlens_k[b], a.seqlen_k);
  }
  Sequence s;
  map_mask(a.causal_offset, len_q, len_k, s);  // the host rejected offsets it cannot map
  return s;
}

// The (batch, head) a CTA of the prep, backward and copy-out kernels works on: batch b (grid.z, after
// this launch's first batch), head h (grid.y), u = b * heads + h (its index among all of them), and
// the lengths of sequence b on the mask.
struct BlockHead {
  int64_t b;
  int h;
  int64_t u;
  Sequence s;
};

__device__ inline BlockHead block_head(const LaunchArgs& args) {
  const int64_t b = int64_t(blockIdx.z) + args.batch_offset;
  const int h = blockIdx.y;
  return {b, h, b * args.p.heads + h, sequence_of(args.p, b)};
}

// Element offset of (batch b, head h)'s first row: packed rows from `first_row` with variable
// lengths, else the batch stride.
__device__ inline int64_t head_offset(const GemmgenAttnBwdParams& a, int64_t b, int h, int64_t first_row,
                                      int64_t batch_stride, int64_t head_stride, int64_t row_stride) {
  return (a.cu_seqlens_q != nullptr ? first_row * row_stride : b * batch_stride) + h * head_stride;
}

template <class Element>
struct RowsRef {  // the rows of one (batch, head) of a tensor
  Element* ptr;
  int64_t row_stride;
};

template <class Element>
__device__ inline RowsRef<Element> staged(char* base, int64_t u, int64_t interleave, int64_t rows, int head_dim) {
  Element* p = reinterpret_cast<Element*>(base) + ((u / interleave) * rows * interleave + u % interleave) * head_dim;
  return {p, interleave * head_dim};
}

// The tensors of (batch b, head h) where the caller keeps them and where the kernel reads/writes them.
template <class Element>
struct HeadTensors {
  RowsRef<Element> o, dq, dk, dv;             // the caller's
  RowsRef<Element> o_run, dq_run, dk_run, dv_run;  // the kernel's (the caller's or staged)
};

template <class Element>
__device__ inline HeadTensors<Element> head_tensors(const LaunchArgs& args, int64_t b, int h) {
  const GemmgenAttnBwdParams& a = args.p;
  const Plan& plan = args.plan;
  const int64_t u = b * a.heads + h;
  const int64_t q0 = a.cu_seqlens_q != nullptr ? a.cu_seqlens_q[b] : 0;
  const int64_t k0 = a.cu_seqlens_k != nullptr ? a.cu_seqlens_k[b] : 0;
  HeadTensors<Element> t;
  t.o = {const_cast<Element*>(static_cast<const Element*>(a.o)) +
             head_offset(a, b, h, q0, a.o_batch_stride, a.o_head_stride, a.o_row_stride),
         a.o_row_stride};
  t.dq = {static_cast<Element*>(a.dq) + head_offset(a, b, h, q0, a.dq_batch_stride, a.dq_head_stride, a.dq_row_stride),
          a.dq_row_stride};
  t.dk = {static_cast<Element*>(a.dk) + head_offset(a, b, h, k0, a.dk_batch_stride, a.dk_head_stride, a.dk_row_stride),
          a.dk_row_stride};
  t.dv = {static_cast<Element*>(a.dv) + head_offset(a, b, h, k0, a.dv_batch_stride, a.dv_head_stride, a.dv_row_stride),
          a.dv_row_stride};
  const int64_t n_o = plan.heads_factor, n_g = int64_t(plan.heads_factor) * plan.grad_multiplier;
  t.o_run = plan.stage_o ? staged<Element>(args.workspace + plan.off_o, u, n_o, a.seqlen_q, a.head_dim) : t.o;
  if (plan.stage_grads) {
    t.dq_run = staged<Element>(args.workspace + plan.off_dq, u, n_g, a.seqlen_q, a.head_dim);
    t.dk_run = staged<Element>(args.workspace + plan.off_dk, u, n_g, a.seqlen_k, a.head_dim);
    t.dv_run = staged<Element>(args.workspace + plan.off_dv, u, n_g, a.seqlen_k, a.head_dim);
  } else {
    t.dq_run = t.dq;
    t.dk_run = t.dk;
    t.dv_run = t.dv;
  }
  return t;
}

// Rows [begin, end) of `cols` elements (a multiple of 8 and of 16 bytes): dst = src, or 0 where
// src is null. 16-byte vectors spread over the CTA's threads.
template <class Element>
__device__ void copy_rows(RowsRef<Element> dst, const Element* src, int64_t src_stride, int begin, int end,
                          int cols) {
  if (end <= begin) return;
  constexpr int kVec = 16 / int(sizeof(Element));
  const int vecs = cols / kVec;
  const int64_t count = int64_t(end - begin) * vecs;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) {
    const int64_t r = begin + i / vecs;
    const int64_t c = (i % vecs) * kVec;
    *reinterpret_cast<uint4*>(dst.ptr + r * dst.row_stride + c) =
        src != nullptr ? *reinterpret_cast<const uint4*>(src + r * src_stride + c) : zero;
  }
}

constexpr int kAuxRows = 64;      // rows of one (batch, head) per CTA of the prep and copy-out kernels
constexpr int kAuxThreads = 256;

template <class Traits>
__global__ void __launch_bounds__(kAuxThreads) prep_kernel(const LaunchArgs args) {
  using Element = typename Traits::Kernel::scalar_t;
  const GemmgenAttnBwdParams& a = args.p;
  const Plan& plan = args.plan;
  const auto [b, h, u, s] = block_head(args);
  const int r0 = blockIdx.x * kAuxRows, r1 = r0 + kAuxRows;
  const bool runs = s.runs();

  // The LSE the kernel reads: row t of the rows it runs, -inf (a row without keys) as +inf, and
  // +inf up to the next multiple of 32 (the kernel reads LSE in 32-row groups).
  float* lse_run = reinterpret_cast<float*>(args.workspace + plan.off_lse) + u * plan.lse_stride;
  const float* lse = a.lse + u * a.seqlen_q + s.skip;
  for (int t = r0 + threadIdx.x; t < min(r1, plan.lse_stride); t += blockDim.x) {
    float x = INFINITY;
    if (runs && t < s.rows) {
      x = lse[t];
      if (x == -INFINITY) x = INFINITY;
    }
    lse_run[t] = x;
  }

  const HeadTensors<Element> t = head_tensors<Element>(args, b, h);
  // dQ of the rows that see no key, dK and dV of the keys no row sees.
  const int dq_zero_end = runs ? s.skip : s.len_q;
  copy_rows<Element>(t.dq_run, nullptr, 0, r0, min(r1, dq_zero_end), a.head_dim);
  const int kv_zero_begin = max(r0, runs ? s.keys : 0);
  copy_rows<Element>(t.dk_run, nullptr, 0, kv_zero_begin, min(r1, s.len_k), a.head_dim);
  copy_rows<Element>(t.dv_run, nullptr, 0, kv_zero_begin, min(r1, s.len_k), a.head_dim);
  // O's packed copy: the rows the kernel runs.
  if (plan.stage_o && runs) {
    copy_rows<Element>(t.o_run, t.o.ptr, t.o.row_stride, max(r0, s.skip), min(r1, s.len_q), a.head_dim);
  }
  // dBias: the kernel writes the tiles it visits; every other element of [seqlen_q, seqlen_k] is
  // zero (masked weights, rows without keys, positions past a sequence's end).
  if (a.dbias != nullptr &&
      (a.cu_seqlens_q != nullptr || !runs || s.mask != kNoMask || s.skip > 0 || s.keys < s.len_k)) {
    RowsRef<Element> db{static_cast<Element*>(a.dbias) + b * a.dbias_batch_stride + h * a.dbias_head_stride,
                        a.dbias_row_stride};
    copy_rows<Element>(db, nullptr, 0, r0, min(r1, a.seqlen_q), a.seqlen_k);
  }
}

template <class Traits>
__global__ void __launch_bounds__(kAuxThreads) copy_out_kernel(const LaunchArgs args) {
  using Element = typename Traits::Kernel::scalar_t;
  const GemmgenAttnBwdParams& a = args.p;
  const auto [b, h, u, s] = block_head(args);
  const int r0 = blockIdx.x * kAuxRows, r1 = r0 + kAuxRows;
  const HeadTensors<Element> t = head_tensors<Element>(args, b, h);
  copy_rows<Element>(t.dq, t.dq_run.ptr, t.dq_run.row_stride, r0, min(r1, s.len_q), a.head_dim);
  copy_rows<Element>(t.dk, t.dk_run.ptr, t.dk_run.row_stride, r0, min(r1, s.len_k), a.head_dim);
  copy_rows<Element>(t.dv, t.dv_run.ptr, t.dv_run.row_stride, r0, min(r1, s.len_k), a.head_dim);
}

template <class Traits>
__global__ void __launch_bounds__(Traits::Kernel::kNumThreads, Traits::Kernel::kMinBlocksPerSm)
    bwd_kernel(const LaunchArgs args) {
  using AK = typename Traits::Kernel;
  using Element = typename AK::scalar_t;
  const GemmgenAttnBwdParams& a = args.p;
  const Plan& plan = args.plan;
  const auto [b, h, u, s] = block_head(args);
  if (!s.runs()) return;  // uniform across the CTA; prep zeroed this (batch, head)'s gradients

  const int64_t q0 = a.cu_seqlens_q != nullptr ? a.cu_seqlens_q[b] : 0;
  const int64_t k0 = a.cu_seqlens_k != nullptr ? a.cu_seqlens_k[b] : 0;
  const HeadTensors<Element> t = head_tensors<Element>(args, b, h);
  auto in = [](const void* ptr) { return const_cast<Element*>(static_cast<const Element*>(ptr)); };

  typename AK::Params p;
  p.query_ptr = in(a.q) + head_offset(a, b, h, q0, a.q_batch_stride, a.q_head_stride, a.q_row_stride) +
                s.skip * a.q_row_stride;
  p.key_ptr = in(a.k) + head_offset(a, b, h, k0, a.k_batch_stride, a.k_head_stride, a.k_row_stride);
  p.value_ptr = in(a.v) + head_offset(a, b, h, k0, a.v_batch_stride, a.v_head_stride, a.v_row_stride);
  p.grad_output_ptr = in(a.d_o) + head_offset(a, b, h, q0, a.do_batch_stride, a.do_head_stride, a.do_row_stride) +
                      s.skip * a.do_row_stride;
  // The bias and dBias of a (batch, head) are [seqlen_q, seqlen_k] by their strides, rows and keys
  // counted within the sequence (as the forward reads the bias); the kernel adds its tile offsets.
  p.bias_ptr = a.bias != nullptr
      ? in(a.bias) + b * a.bias_batch_stride + h * a.bias_head_stride + s.skip * a.bias_row_stride
      : nullptr;
  p.grad_bias_ptr = a.dbias != nullptr
      ? static_cast<Element*>(a.dbias) + b * a.dbias_batch_stride + h * a.dbias_head_stride +
            s.skip * a.dbias_row_stride
      : nullptr;
  p.output_ptr = t.o_run.ptr + s.skip * t.o_run.row_stride;
  p.grad_query_ptr = t.dq_run.ptr + s.skip * t.dq_run.row_stride;
  p.grad_key_ptr = t.dk_run.ptr;
  p.grad_value_ptr = t.dv_run.ptr;
  p.logsumexp_ptr = reinterpret_cast<float*>(args.workspace + plan.off_lse) + u * plan.lse_stride;
  p.delta_ptr = reinterpret_cast<float*>(args.workspace + plan.off_delta) + u * a.seqlen_q;
  p.cu_seqlens_q_ptr = nullptr;  // the sequence is set up above
  p.cu_seqlens_k_ptr = nullptr;

  // The kernel's float32 accumulators (dQ always; dK and dV where they do not stay in registers):
  // [dK of split 0, 1, ...][dV of split 0, 1, ...][dQ temp storage of every query block].
  if (plan.ws_stride_bh > 0) {
    float* ws = reinterpret_cast<float*>(args.workspace + plan.off_kernel) + u * plan.ws_stride_bh;
    const int64_t splits = gridDim.x;
    p.workspace = ws + plan.ws_gk_split * blockIdx.x;
    p.workspace_gv = ws + plan.ws_gk_split * splits + plan.ws_gv_split * blockIdx.x;
    p.workspace_gq = reinterpret_cast<typename AK::GradQTempStorage*>(
        ws + (plan.ws_gk_split + plan.ws_gv_split) * splits);
  }

  p.scale = a.scale;
  p.head_dim = a.head_dim;
  p.head_dim_value = a.head_dim;
  p.num_queries = s.rows;
  p.num_keys = s.keys;
  p.num_heads = plan.heads_factor;  // O's row stride is head_dim * num_heads
  p.gQKV_strideM_multiplier = int8_t(plan.grad_multiplier);
  p.custom_mask_type = uint8_t(s.mask);
  p.q_strideM = int32_t(a.q_row_stride);
  p.k_strideM = int32_t(a.k_row_stride);
  p.v_strideM = int32_t(a.v_row_stride);
  p.bias_strideM = int32_t(a.bias_row_stride);
  p.gO_strideM = int32_t(a.do_row_stride);
  p.gB_strideM = int32_t(a.dbias_row_stride);
  p.num_batches = a.batch;
  p.num_splits_key = int16_t(gridDim.x);
  p.dropout_prob = a.dropout_p;

  if constexpr (Traits::kDropout) {
    // Weight (b, h, i, j) of the forward draws Philox output dropout_offset + (b * heads + h) *
    // seqlen_q * seqlen_k + i * len_k + j; the kernel counts i from the first row it runs and
    // places row * num_keys + j itself (num_keys == len_k: the host rejects dropout otherwise).
    if (threadIdx.x == 0) {
      unsigned long long* stream = dropout_stream();
      stream[0] = a.dropout_seed;
      stream[1] = a.dropout_offset + uint64_t(u) * uint64_t(a.seqlen_q) * uint64_t(a.seqlen_k) +
                  uint64_t(s.skip) * uint64_t(s.len_k);
    }
    __syncthreads();
  }
  AK::attention_kernel(p);
}

}  // namespace gemmgen::mea_bwd_sm80
