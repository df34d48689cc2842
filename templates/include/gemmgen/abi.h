// The C ABI every gemmgen instance library exports. Python loads it with ctypes
// (gemmgen/kernels/abi.py mirrors these structs field by field; keep the two in step). A field
// appended at the end of a params struct, zero meaning "not asked for", keeps the version: a
// library built before it never reads it, and the registry sends a call that sets it only to
// instances of the families that read it. Bump GEMMGEN_ABI_VERSION on any other change.
#pragma once
#include <stdint.h>

#define GEMMGEN_ABI_VERSION 4
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
                     // strides below (0 broadcasts; the last dim is contiguous; 16-byte aligned rows,
                     // readable up to the next multiple of 8 elements); NULL: none
  int64_t bias_batch_stride, bias_head_stride, bias_row_stride;
  float dropout_p;  // probability of zeroing an attention weight (kept ones scale by 1/(1-p)); 0: none
  uint64_t dropout_seed;    // Philox seed and offset: the same pair gives the same mask
  uint64_t dropout_offset;
  const int32_t* cu_seqlens_q;  // variable lengths: [batch + 1] cumulative row offsets of the
  const int32_t* cu_seqlens_k;  // packed sequences (seqlen_q/k are then the maxima); NULL: fixed

  // Key-value cache reads (families with GEMMGEN_INFO_KV_CACHE; others reject these when set, but
  // for seqlens_k with packed sequences where a family's instance says it reads them).
  const int32_t* seqlens_k;  // [batch]: sequence b attends to its first seqlens_k[b] <= seqlen_k keys,
                             // with the causal mask aligned as if its keys ended there (key j visible
                             // to query i iff j <= i + causal_offset + seqlens_k[b] - seqlen_k); NULL:
                             // seqlen_k keys each. With cu_seqlens: the first seqlens_k[b] keys of
                             // sequence b's cu_seqlens_k slot, the causal mask bottom-right
  const int32_t* block_table;  // paged K and V: key t of sequence b is row t % page_size of page
                               // block_table[b * block_table_batch_stride + t / page_size], pages
                               // k/v_batch_stride apart; NULL: K and V are [batch, ...] by their strides
  int64_t block_table_batch_stride;
  int32_t page_size;
  int32_t num_pages;   // pages K and V hold: a sequence whose length lies outside [0, seqlen_k] or whose
                       // block table names a page outside [0, num_pages) gets NaN rows (never a fault)
  int32_t num_splits;  // split-KV families: CTAs sharing one row tile's keys (<= 1: one, no workspace)
  void* workspace;     // <symbol>_workspace(params) bytes, 256-byte aligned; contents undefined on entry
  int64_t workspace_bytes;

  // Sliding window (read by instances built for the local mask and by decode_sm80's; the registry
  // sends it to no other instance): key j is visible to query i iff
  // i + causal_offset - window_left <= j <= i + causal_offset + window_right, a side of -1 unbounded.
  int32_t local;
  int32_t window_left;
  int32_t window_right;

  // Logit softcap (read by instances built for it, which require it > 0; the registry sends it to
  // no other instance): the scaled scores s become softcap * tanh(s / softcap) before the mask.
  float softcap;

  // Variable lengths with a causal mask or a window (read by families whose instances run variable
  // lengths in both alignments; the registry sends it to no other instance): 1 shifts the diagonal
  // of each sequence b by its own len_k - len_q (causal_offset then 0: the bottom-right alignment
  // within each sequence, FlashAttention's varlen causal); 0: causal_offset alone (top-left: 0).
  int32_t align_per_sequence;

  // Variable lengths: the rows of the packed q and o (total_q) and of k and v (total_k), which
  // bound what a TMA descriptor may span (read by the families that build descriptors over the
  // packed tensors; 0 where not set: those families then refuse the call).
  int64_t total_q;
  int64_t total_k;

  // FP8 inputs (read by instances whose inputs are 8-bit; NULL: 1): the factors that turn the
  // stored q, k, v back into their values, float32 [batch, heads_kv] each (contiguous); the scores
  // are scale * descale_q * descale_k * q k^T and O is multiplied by descale_v.
  const float* descale_q;
  const float* descale_k;
  const float* descale_v;
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
// The instance reads seqlens_k, block_table and num_splits, and exports
//   int64_t <symbol>_workspace(const GemmgenAttnParams*);  // bytes of workspace the call needs
#define GEMMGEN_INFO_KV_CACHE 4
// The instance needs a workspace (workspace, workspace_bytes in its params) and exports
//   int64_t <symbol>_workspace(const GemmgenAttnParams*);  // bytes of workspace the call needs
#define GEMMGEN_INFO_WORKSPACE 16

// Status codes returned by the entry points; a message is written to err as well.
enum GemmgenStatus {
  GEMMGEN_OK = 0,
  GEMMGEN_INVALID_ARGUMENT = 1,  // params the instance cannot run (message says which)
  GEMMGEN_CUDA_ERROR = 2,        // a CUDA runtime call or the launch failed
};

// ---------------------------------------------------------------------------------------------
// Fused attention backward: given dO = dL/dO and the forward's O and LSE, write dQ, dK and dV
// (and dBias when asked). Sizes, strides and masks mean what they mean in GemmgenAttnParams; the
// last dimension of every tensor is contiguous. dQ is shaped like Q; dK and dV like K and V, or with
// Q's heads for an instance with GEMMGEN_INFO_READS_GQA. Other instances run heads_kv == heads only:
// the caller expands K and V for GQA/MQA and sums dK and dV over each group.
typedef struct GemmgenAttnBwdParams {
  const void* q;
  const void* k;
  const void* v;
  const void* o;
  const void* d_o;
  const float* lse;  // the forward's [batch, heads, seqlen_q] contiguous float32, natural log
  void* dq;
  void* dk;
  void* dv;
  void* workspace;          // at least <symbol>_workspace(params) bytes, 256-byte aligned,
  int64_t workspace_bytes;  // contents undefined on entry (the instance clears what it needs)

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
  int64_t do_batch_stride, do_head_stride, do_row_stride;
  int64_t dq_batch_stride, dq_head_stride, dq_row_stride;
  int64_t dk_batch_stride, dk_head_stride, dk_row_stride;
  int64_t dv_batch_stride, dv_head_stride, dv_row_stride;

  float scale;
  int32_t causal_offset;  // as the forward: key j visible to query i iff j <= i + causal_offset

  const void* bias;  // the forward's additive mask (NULL: none), strides as in GemmgenAttnParams
  int64_t bias_batch_stride, bias_head_stride, bias_row_stride;
  void* dbias;       // dL/dBias, [batch, heads, seqlen_q, seqlen_k] by its strides; NULL: not wanted
  int64_t dbias_batch_stride, dbias_head_stride, dbias_row_stride;
  float dropout_p;   // the forward's dropout: the same (seed, offset) regenerates the same mask
  uint64_t dropout_seed;
  uint64_t dropout_offset;
  const int32_t* cu_seqlens_q;  // variable lengths as in GemmgenAttnParams; NULL: fixed
  const int32_t* cu_seqlens_k;
  int32_t deterministic;  // 1: no accumulation whose order depends on scheduling (slower)

  // The forward's sliding window, as in GemmgenAttnParams (read by instances built for the local
  // mask; the registry sends a window to no other backward instance).
  int32_t local;
  int32_t window_left;
  int32_t window_right;

  // The forward's logit softcap, as in GemmgenAttnParams (read by instances built for it).
  float softcap;

  // The forward's per-sequence alignment, as in GemmgenAttnParams.
  int32_t align_per_sequence;

  // Variable lengths: the rows of the packed query-side (q, o, d_o, dq) and key-side (k, v, dk, dv)
  // tensors, as in GemmgenAttnParams.
  int64_t total_q;
  int64_t total_k;
} GemmgenAttnBwdParams;

// A backward instance exports
//   int <symbol>(const GemmgenAttnBwdParams*, void* stream, char* err, int err_len);
//   int64_t <symbol>_workspace(const GemmgenAttnBwdParams*);  // bytes of workspace the call needs
//   int <symbol>_info(GemmgenInstanceInfo*);                   // flags include GEMMGEN_INFO_BACKWARD
#define GEMMGEN_INFO_BACKWARD 2
// A backward instance that reads K and V at their own heads (heads_kv dividing heads, query head h
// reading key/value head h / (heads / heads_kv)) and writes dK and dV with `heads` heads, one per
// query head, by dk's and dv's strides: the caller sums each group's. Without this flag heads_kv
// must equal heads (the caller expands K and V).
#define GEMMGEN_INFO_READS_GQA 8

// ---------------------------------------------------------------------------------------------
// Batched GEMM: C[b, h] = alpha * A[b, h] * op(B[b, h]) for every batch b and head h, fp32
// accumulation. A is [M, K] row-major; B is [K, N] row-major, or with b_transposed [N, K]
// row-major (A * B^T: the Q x K^T case); C is [M, N] row-major. Sizes and strides are in
// elements; the last dimension of every matrix is contiguous. Which dtypes and which value of
// b_transposed an instance runs is fixed when it is compiled (GemmgenGemmInfo says which).

// Strided strategy: every (batch, head) matrix at base + b * stride_batch + h * stride_head.
typedef struct GemmgenBatchedGemmStridedArgs {
  const void* A;
  const void* B;
  void* C;

  uint32_t M;
  uint32_t N;
  uint32_t K;

  uint32_t batch;
  uint32_t num_heads;

  int64_t stride_a_batch, stride_a_head, stride_a_row;
  int64_t stride_b_batch, stride_b_head, stride_b_row;
  int64_t stride_c_batch, stride_c_head, stride_c_row;

  int32_t b_transposed;  // 0 or 1; must match the instance's layout
  float alpha;           // scales A * op(B); C is overwritten, never read
} GemmgenBatchedGemmStridedArgs;

// Pointer-array strategy: batch * num_heads independently allocated matrices of one shape.
// A_ptrs, B_ptrs and C_ptrs are device arrays of device pointers, index b * num_heads + h.
typedef struct GemmgenBatchedGemmPtrArgs {
  const void* const* A_ptrs;
  const void* const* B_ptrs;
  void* const* C_ptrs;

  uint32_t M;
  uint32_t N;
  uint32_t K;

  uint32_t batch;
  uint32_t num_heads;

  int64_t stride_a_row, stride_b_row, stride_c_row;  // one row stride per operand, all matrices

  int32_t b_transposed;
  float alpha;
} GemmgenBatchedGemmPtrArgs;

// Static facts of one compiled GEMM instance.
typedef struct GemmgenGemmInfo {
  int32_t abi_version;
  int32_t tile_m;
  int32_t tile_n;
  int32_t tile_k;
  int32_t stages;
  int32_t threads;
  int32_t smem_bytes;
  int32_t alignment;     // elements every pointer and row stride must be a multiple of
  int32_t b_transposed;
  int32_t strategy;      // GEMMGEN_GEMM_STRIDED or GEMMGEN_GEMM_PTR_ARRAY
  int32_t out_bytes;     // bytes per element of C (2: the input dtype, 4: fp32)
} GemmgenGemmInfo;

#define GEMMGEN_GEMM_STRIDED 0
#define GEMMGEN_GEMM_PTR_ARRAY 1

// Row softmax of the unfused attention path: P = softmax(S) row by row, S fp32 (already scaled),
// P in the instance's dtype. Matrix m (index b * heads + h) at s + m * s_matrix_stride, rows
// s_row_stride apart; rows x cols each. With causal, key j is visible to query i iff
// j <= i + causal_offset; a row that sees no key is written as zeros.
typedef struct GemmgenSoftmaxArgs {
  const float* s;
  void* p;
  uint32_t rows;
  uint32_t cols;
  uint32_t matrices;
  int64_t s_matrix_stride, s_row_stride;
  int64_t p_matrix_stride, p_row_stride;
  int32_t causal;
  int32_t causal_offset;
} GemmgenSoftmaxArgs;
