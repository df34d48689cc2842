// Host side of the mea_bwd_sm80 family: checks the params an instance cannot run, plans where O and
// the gradients go and how the caller's workspace is cut (the same plan for <symbol>_workspace and
// the run), and launches prep, backward and copy-out on the caller's stream. Errors come back as a
// status and a message, never as a crash.
//
// causal_offset is read for every call (this family's instances serve both masks): key j is visible
// to query i iff j <= i + causal_offset, so INT32_MAX means no mask; with cu_seqlens, i and j count
// from the start of each sequence. Offsets the kernel's masks cannot express are rejected (map_mask).
#pragma once
#include <atomic>
#include <cstdint>

#include <cuda_runtime.h>

#include "gemmgen/abi.h"
#include "gemmgen/mea_bwd_sm80/kernel.h"
#include "gemmgen/mea_sm80/checks.h"
#include "gemmgen/report.h"
#include "gemmgen/smem.h"

namespace gemmgen::mea_bwd_sm80 {

using mea_sm80::kInt32Max;
using mea_sm80::rows_fit_int32;

constexpr int64_t kMaxGridYZ = 65535;  // CUDA's limit on grid.y (heads) and grid.z (batches)
constexpr int64_t kWorkspaceAlign = 256;  // the C ABI's workspace alignment; every part starts on it
constexpr int kLseRows = 32;              // the kernel reads LSE in groups of 32 rows
constexpr int kMaxGradMultiplier = 127;   // Params::gQKV_strideM_multiplier is an int8

inline int64_t align_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

// Multiprocessors of the current device (cached per device), 0 where it cannot be read.
inline int sm_count() {
  static std::atomic<int> cache[64];
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  if (device < 64 && cache[device].load(std::memory_order_relaxed) > 0) return cache[device].load();
  int count = 0;
  if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    cudaGetLastError();  // leave no sticky error for the caller's next call
    return 0;
  }
  if (device < 64) cache[device].store(count);
  return count;
}

template <class Traits>
int check(const GemmgenAttnBwdParams* p, char* err, int err_len) {
  if (int status = mea_sm80::check_head_dim<Traits>(p->head_dim, err, err_len)) return status;
  constexpr int kAlign = Traits::kAlignment;
  if (p->batch < 1 || p->heads < 1 || p->seqlen_q < 1 || p->seqlen_k < 1 || p->heads > kMaxGridYZ) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  "bad sizes: batch %d heads %d (at most %lld) seqlen_q %d seqlen_k %d", p->batch, p->heads,
                  static_cast<long long>(kMaxGridYZ), p->seqlen_q, p->seqlen_k);
  }
  if (p->heads_kv != p->heads) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  "heads_kv %d differs from heads %d: this backward runs K and V with Q's heads (expand them "
                  "for GQA/MQA and sum dK, dV over each group)", p->heads_kv, p->heads);
  }
  if (!(p->dropout_p >= 0.f && p->dropout_p < 1.f)) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "dropout_p %g outside [0, 1)", p->dropout_p);
  }
  if (p->dropout_p > 0.f && !Traits::kDropout) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  "dropout_p %g: this instance is built without dropout (use a dropout instance)", p->dropout_p);
  }
  const bool varlen = p->cu_seqlens_q != nullptr;
  if (varlen != (p->cu_seqlens_k != nullptr)) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "cu_seqlens_q and cu_seqlens_k go together");
  }
  if (p->align_per_sequence != 0) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  "align_per_sequence: this family aligns every sequence's mask at causal_offset (top-left)");
  }
  const void* required[] = {p->q, p->k, p->v, p->o, p->d_o, p->lse, p->dq, p->dk, p->dv};
  for (const void* ptr : required) {
    if (ptr == nullptr) {
      return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "q, k, v, o, d_o, lse, dq, dk and dv must be set");
    }
  }
  const int64_t element_bytes = sizeof(typename Traits::Kernel::scalar_t);
  const void* data[] = {p->q, p->k, p->v, p->o, p->d_o, p->dq, p->dk, p->dv, p->bias, p->dbias};
  for (const void* ptr : data) {
    if (reinterpret_cast<uintptr_t>(ptr) % (kAlign * element_bytes)) {
      return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "a data pointer is not %lld-byte aligned",
                    static_cast<long long>(kAlign * element_bytes));
    }
  }
  if (reinterpret_cast<uintptr_t>(p->lse) % sizeof(float)) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "lse is not 4-byte aligned");
  }
  const int64_t strides[] = {
      p->q_batch_stride,     p->q_head_stride,     p->q_row_stride,     p->k_batch_stride,    p->k_head_stride,
      p->k_row_stride,       p->v_batch_stride,    p->v_head_stride,    p->v_row_stride,      p->o_batch_stride,
      p->o_head_stride,      p->o_row_stride,      p->do_batch_stride,  p->do_head_stride,    p->do_row_stride,
      p->dq_batch_stride,    p->dq_head_stride,    p->dq_row_stride,    p->dk_batch_stride,   p->dk_head_stride,
      p->dk_row_stride,      p->dv_batch_stride,   p->dv_head_stride,   p->dv_row_stride,     p->bias_batch_stride,
      p->bias_head_stride,   p->bias_row_stride,   p->dbias_batch_stride, p->dbias_head_stride, p->dbias_row_stride};
  for (int64_t s : strides) {
    if (s % kAlign) {
      return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "stride %lld is not a multiple of %d elements",
                    static_cast<long long>(s), kAlign);
    }
  }
  // The gradients must not overlap themselves: every (batch, head, row) its own elements.
  struct Out { const char* name; int64_t batch, head, row, rows; };
  const Out outs[] = {{"dq", p->dq_batch_stride, p->dq_head_stride, p->dq_row_stride, p->seqlen_q},
                      {"dk", p->dk_batch_stride, p->dk_head_stride, p->dk_row_stride, p->seqlen_k},
                      {"dv", p->dv_batch_stride, p->dv_head_stride, p->dv_row_stride, p->seqlen_k}};
  for (const Out& o : outs) {
    if ((o.rows > 1 && o.row < p->head_dim) || (p->heads > 1 && o.head == 0) ||
        (!varlen && p->batch > 1 && o.batch == 0)) {
      return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                    "%s strides (%lld, %lld, %lld) overlap its rows or heads: a row stride of at least head_dim "
                    "and non-zero batch and head strides are needed", o.name, static_cast<long long>(o.batch),
                    static_cast<long long>(o.head), static_cast<long long>(o.row));
    }
  }
  if (p->dbias != nullptr) {
    if ((p->batch > 1 && p->dbias_batch_stride == 0) || (p->heads > 1 && p->dbias_head_stride == 0) ||
        (p->seqlen_q > 1 && p->dbias_row_stride < p->seqlen_k)) {
      return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                    "dbias strides (%lld, %lld, %lld): the kernel writes dBias per (batch, head, query) and cannot "
                    "sum over broadcast (0) strides; pass a full [batch, heads, seqlen_q, seqlen_k] buffer and reduce",
                    static_cast<long long>(p->dbias_batch_stride), static_cast<long long>(p->dbias_head_stride),
                    static_cast<long long>(p->dbias_row_stride));
    }
    if (p->seqlen_k % kAlign) {
      return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                    "dbias with seqlen_k %d: the kernel stores dBias in vectors of %d keys, so seqlen_k must be a "
                    "multiple of %d", p->seqlen_k, kAlign, kAlign);
    }
  }
  // The causal offset on the kernel's masks (with variable lengths, for every length the
  // sequences may have).
  const int64_t c = p->causal_offset;
  Sequence s;
  if (varlen) {
    if (c > 0 && c < int64_t(p->seqlen_k) - 1) {
      return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                    "causal_offset %d with variable lengths: this backward runs offsets <= 0 (top-left) or no mask "
                    "there", p->causal_offset);
    }
  } else {
    if (!map_mask(c, p->seqlen_q, p->seqlen_k, s)) {
      return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                    "causal_offset %d on %d x %d: the kernel masks top-left (0) or bottom-right (seqlen_k - seqlen_q) "
                    "and offsets up to seqlen_k - seqlen_q, not between that and seqlen_k - 1",
                    p->causal_offset, p->seqlen_q, p->seqlen_k);
    }
    if (p->dropout_p > 0.f && s.keys < s.len_k) {
      return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                    "dropout with causal_offset %d on %d x %d: the mask's positions need all seqlen_k keys run "
                    "(offsets 0, seqlen_k - seqlen_q, negative ones or no mask)", p->causal_offset, p->seqlen_q,
                    p->seqlen_k);
    }
  }
  if (p->dropout_p > 0.f && int64_t(p->seqlen_q) * p->seqlen_k > kInt32Max) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  "dropout over %d x %d scores: the kernel computes the mask's positions in 32 bits", p->seqlen_q,
                  p->seqlen_k);
  }
  if (!rows_fit_int32(p->seqlen_q, p->q_row_stride) || !rows_fit_int32(p->seqlen_k, p->k_row_stride) ||
      !rows_fit_int32(p->seqlen_k, p->v_row_stride) || !rows_fit_int32(p->seqlen_q, p->do_row_stride) ||
      (p->bias != nullptr && !rows_fit_int32(p->seqlen_q, p->bias_row_stride)) ||
      (p->dbias != nullptr && !rows_fit_int32(p->seqlen_q, p->dbias_row_stride))) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  "sequence length x row stride exceeds int32 (the kernel's row indexing)");
  }
  return GEMMGEN_OK;
}

// Splits of the key blocks over CTAs per (batch, head): enough CTAs to fill the GPU, at most one per
// key block; one when the call must be deterministic (the CTAs of a (batch, head) add their dQ in
// the order they arrive).
template <class Traits>
int32_t key_splits(const GemmgenAttnBwdParams* p) {
  if (p->deterministic) return 1;
  const int64_t key_blocks = (int64_t(p->seqlen_k) + Traits::kBlockJ - 1) / Traits::kBlockJ;
  const int64_t slots = int64_t(sm_count()) * (Traits::kMinBlocksPerSm > 1 ? Traits::kMinBlocksPerSm : 1);
  const int64_t heads = int64_t(p->batch) * p->heads;
  int64_t splits = (slots + heads - 1) / heads;
  if (splits > key_blocks) splits = key_blocks;
  if (splits > 32767) splits = 32767;  // Params::num_splits_key is an int16
  return int32_t(splits < 1 ? 1 : splits);
}

template <class Traits>
int make_plan(const GemmgenAttnBwdParams* p, Plan* plan, char* err, int err_len) {
  if (int status = check<Traits>(p, err, err_len)) return status;
  using AK = typename Traits::Kernel;
  const int64_t d = p->head_dim;
  // O's and the gradients' row strides as the kernel derives them (see Plan).
  const int64_t n_o = p->o_row_stride > 0 && p->o_row_stride % d == 0 ? p->o_row_stride / d : 0;
  const bool grads_alike = p->dq_row_stride == p->dk_row_stride && p->dk_row_stride == p->dv_row_stride &&
                           p->dq_row_stride > 0 && p->dq_row_stride % d == 0;
  const int64_t n_g = grads_alike ? p->dq_row_stride / d : 0;
  int64_t n = 1, m = 1;
  Plan out;
  if (n_o && n_g && n_g % n_o == 0 && n_g / n_o <= kMaxGradMultiplier) {
    n = n_o;
    m = n_g / n_o;
  } else if (n_g) {  // O alone goes through a copy (the cheapest to move)
    n = n_g;
    out.stage_o = 1;
  } else if (n_o) {
    n = n_o;
    out.stage_grads = 1;
  } else {
    out.stage_o = out.stage_grads = 1;
  }
  const int64_t rows_max = p->seqlen_q > p->seqlen_k ? p->seqlen_q : p->seqlen_k;
  if (!rows_fit_int32(p->seqlen_q, d * n) || !rows_fit_int32(rows_max, d * n * m)) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  "sequence length x row stride of O or the gradients exceeds int32 (the kernel's row indexing)");
  }
  out.heads_factor = int32_t(n);
  out.grad_multiplier = int32_t(m);
  out.splits = key_splits<Traits>(p);
  out.lse_stride = int32_t(align_up(p->seqlen_q, kLseRows));

  // The kernel's workspace. A CTA keeps its dK (dV) accumulators in one tile per column block of
  // the head dim, reused from key block to key block (MatmulGradK / MatmulGradV, AccumTileGmem),
  // so a key split needs that much, not the whole-sequence bound of Params::workspace_elements_gk.
  // The dQ accumulators are the kernel's own count, on the longest sequence.
  constexpr int64_t kTile = AK::MatmulGradQ::AccumTileGmem::kElementsStored;
  constexpr int64_t kColsK = AK::MatmulGradK::ThreadblockShape::kN;
  constexpr int64_t kColsV = AK::MatmulGradV::ThreadblockShape::kN;
  out.ws_gk_split = AK::kNeedsAccumGradK ? (d + kColsK - 1) / kColsK * kTile : 0;
  out.ws_gv_split = AK::kNeedsAccumGradV ? (d + kColsV - 1) / kColsV * kTile : 0;
  typename AK::Params sizes;
  sizes.head_dim = p->head_dim;
  sizes.head_dim_value = p->head_dim;
  sizes.num_queries = p->seqlen_q;
  sizes.num_keys = p->seqlen_k;
  // 16-byte aligned: the dQ temp storage after the dK and dV tiles is read in 16-byte vectors.
  out.ws_stride_bh = align_up((out.ws_gk_split + out.ws_gv_split) * out.splits + sizes.workspace_elements_gq(), 4);

  const int64_t heads = int64_t(p->batch) * p->heads;
  const int64_t element_bytes = sizeof(typename AK::scalar_t);
  // A staged tensor's packed copy: ceil(heads / interleave) groups of rows x interleave x head_dim.
  auto staged_bytes = [&](int64_t interleave, int64_t rows) {
    return (heads + interleave - 1) / interleave * interleave * rows * d * element_bytes;
  };
  int64_t at = 0;
  auto part = [&](int64_t bytes) {
    const int64_t offset = at;
    at = align_up(at + bytes, kWorkspaceAlign);
    return offset;
  };
  out.off_kernel = part(heads * out.ws_stride_bh * int64_t(sizeof(float)));
  out.off_delta = part(heads * p->seqlen_q * int64_t(sizeof(float)));
  out.off_lse = part(heads * out.lse_stride * int64_t(sizeof(float)));
  out.off_o = part(out.stage_o ? staged_bytes(n, p->seqlen_q) : 0);
  out.off_dq = part(out.stage_grads ? staged_bytes(n * m, p->seqlen_q) : 0);
  out.off_dk = part(out.stage_grads ? staged_bytes(n * m, p->seqlen_k) : 0);
  out.off_dv = part(out.stage_grads ? staged_bytes(n * m, p->seqlen_k) : 0);
  out.bytes = at;
  *plan = out;
  return GEMMGEN_OK;
}

// Bytes of workspace `p` needs; 0 for params the instance rejects (the run call says why).
template <class Traits>
int64_t workspace(const GemmgenAttnBwdParams* p) {
  Plan plan;
  if (p == nullptr || make_plan<Traits>(p, &plan, nullptr, 0) != GEMMGEN_OK) return 0;
  return plan.bytes;
}

inline int launch_error(char* err, int err_len, const char* what) {
  cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return GEMMGEN_OK;
  return report(err, err_len, GEMMGEN_CUDA_ERROR, "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
}

template <class Traits>
int run(const GemmgenAttnBwdParams* p, cudaStream_t stream, char* err, int err_len) {
  if (p == nullptr) return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "params is NULL");
  Plan plan;
  if (int status = make_plan<Traits>(p, &plan, err, err_len)) return status;
  if (p->workspace == nullptr || p->workspace_bytes < plan.bytes ||
      reinterpret_cast<uintptr_t>(p->workspace) % kWorkspaceAlign) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  "workspace %p of %lld bytes: this call needs %lld bytes, %lld-byte aligned (<symbol>_workspace)",
                  p->workspace, static_cast<long long>(p->workspace_bytes), static_cast<long long>(plan.bytes),
                  static_cast<long long>(kWorkspaceAlign));
  }
  constexpr int kSmem = Traits::kSmemSize;
  if (int status = opt_in_smem<&bwd_kernel<Traits>>(kSmem, err, err_len)) return status;
  LaunchArgs args{*p, plan, static_cast<char*>(p->workspace), 0};
  // Several CTAs per (batch, head) meet in the dQ accumulators through locks and counters there.
  if (plan.splits > 1 && plan.ws_stride_bh > 0) {
    const size_t bytes = size_t(p->batch) * p->heads * plan.ws_stride_bh * sizeof(float);
    cudaError_t e = cudaMemsetAsync(args.workspace + plan.off_kernel, 0, bytes, stream);
    if (e != cudaSuccess) {
      return report(err, err_len, GEMMGEN_CUDA_ERROR, "clearing the workspace: %s (%s)", cudaGetErrorString(e),
                    cudaGetErrorName(e));
    }
  }
  const int64_t aux_rows = plan.lse_stride > p->seqlen_k ? plan.lse_stride : p->seqlen_k;
  const unsigned aux_blocks = unsigned((aux_rows + kAuxRows - 1) / kAuxRows);
  for (int64_t first = 0; first < p->batch; first += kMaxGridYZ) {
    const int64_t batches = p->batch - first < kMaxGridYZ ? p->batch - first : kMaxGridYZ;
    args.batch_offset = int32_t(first);
    prep_kernel<Traits><<<dim3(aux_blocks, p->heads, unsigned(batches)), kAuxThreads, 0, stream>>>(args);
    if (int status = launch_error(err, err_len, "prep kernel launch")) return status;
    bwd_kernel<Traits><<<dim3(plan.splits, p->heads, unsigned(batches)), Traits::kThreads, kSmem, stream>>>(args);
    if (int status = launch_error(err, err_len, "backward kernel launch")) return status;
    if (plan.stage_grads) {
      copy_out_kernel<Traits><<<dim3(aux_blocks, p->heads, unsigned(batches)), kAuxThreads, 0, stream>>>(args);
      if (int status = launch_error(err, err_len, "copy-out kernel launch")) return status;
    }
  }
  return GEMMGEN_OK;
}

template <class Traits>
int info(GemmgenInstanceInfo* out) {
  // The head dim is the bound (every multiple of kAlignment up to it runs); causal is false as
  // the instance serves both masks (causal_offset decides per call).
  return instance_info(out, Traits::kMaxHeadDim, Traits::kBlockI, Traits::kBlockJ, Traits::kThreads,
                       Traits::kSmemSize, /*causal=*/false, GEMMGEN_INFO_BACKWARD);
}

}  // namespace gemmgen::mea_bwd_sm80
