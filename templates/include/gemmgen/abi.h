// The C ABI every gemmgen instance library exports. Python loads it with ctypes
// (gemmgen/abi.py mirrors these structs field by field; keep the two in step and
// bump GEMMGEN_ABI_VERSION on any change).
#pragma once
#include <stdint.h>

#define GEMMGEN_ABI_VERSION 2
#define GEMMGEN_EXPORT extern "C" __attribute__((visibility("default")))

// Fused attention forward: O = softmax(scale * Q K^T + mask) V.
// Shapes follow torch: Q [batch, heads, seqlen_q, head_dim], K and V
// [batch, heads_kv, seqlen_k, head_dim], O like Q. Strides are in elements; the last
// dimension is contiguous. Query head h reads key/value head h / (heads / heads_kv).
typedef struct GemmgenAttnParams {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* lse;  // [batch, heads, seqlen_q] contiguous float32, natural log; may be NULL

  int32_t batch;
  int32_t heads;
  int32_t heads_kv;
  int32_t seqlen_q;
  int32_t seqlen_k;
  int32_t head_dim;

  int64_t q_batch_stride, q_head_stride, q_row_stride;
  int64_t k_batch_stride, k_head_stride, k_row_stride;
  int64_t v_batch_stride, v_head_stride, v_row_stride;
  int64_t o_batch_stride, o_head_stride, o_row_stride;

  float scale;            // multiplies Q K^T before the softmax
  int32_t causal_offset;  // causal instances: key j is visible to query i iff j <= i + causal_offset
                          // (0: top-left alignment as torch; seqlen_k - seqlen_q: bottom-right)

  // Features only some families have. An instance of a family without one rejects params that
  // ask for it (the registry never sends it such a call).
  const void* bias;  // additive mask in the input dtype, [batch, heads, seqlen_q, seqlen_k] by the
                     // strides below (0 broadcasts; the last dim is contiguous); NULL: none
  int64_t bias_batch_stride, bias_head_stride, bias_row_stride;
  float dropout_p;  // probability of zeroing an attention weight (kept ones scale by 1/(1-p)); 0: none
  uint64_t dropout_seed;    // Philox seed and offset: the same pair gives the same mask
  uint64_t dropout_offset;
  const int32_t* cu_seqlens_q;  // variable lengths: [batch + 1] cumulative row offsets of the
  const int32_t* cu_seqlens_k;  // packed sequences (seqlen_q/k are then the maxima); NULL: fixed
} GemmgenAttnParams;

// Static facts of one compiled instance, for the manifest and the registry.
typedef struct GemmgenInstanceInfo {
  int32_t abi_version;
  int32_t head_dim;
  int32_t block_m;
  int32_t block_n;
  int32_t threads;
  int32_t smem_bytes;
  int32_t causal;
  int32_t flags;  // GEMMGEN_INFO_* bits
} GemmgenInstanceInfo;

// The kernel writes LSE whatever the caller wants: the caller passes a buffer even without return_lse.
#define GEMMGEN_INFO_NEEDS_LSE 1

// Status codes returned by the entry points; a message is written to err as well.
enum GemmgenStatus {
  GEMMGEN_OK = 0,
  GEMMGEN_INVALID_ARGUMENT = 1,  // params the instance cannot run (message says which)
  GEMMGEN_CUDA_ERROR = 2,        // a CUDA runtime call or the launch failed
};
