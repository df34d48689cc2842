// Host side of the decode_sm80 family: checks what an instance cannot run, launches the split
// kernel and (num_splits > 1) the combine on the caller's stream.
#pragma once
#include <cfloat>
#include <cstdint>

#include <cuda_runtime.h>

#include "gemmgen/abi.h"
#include "gemmgen/report.h"
#include "gemmgen/smem.h"
#include "gemmgen/decode_sm80/kernel.h"
#include "gemmgen/fa2_sm80/checks.h"

namespace gemmgen::decode_sm80 {

constexpr int kMaxSplits = 256;
constexpr int64_t kMaxGridYZ = 65535;

template <class Traits>
int run(const GemmgenAttnParams* p, cudaStream_t stream, char* err, int err_len) {
  // Sequences may have no keys yet (seqlens_k says how many each has).
  if (int status = fa2_sm80::check_sizes<Traits::kHeadDim>(p, 0, err, err_len)) return status;
  if (p->bias != nullptr || p->dropout_p != 0.f || p->cu_seqlens_q != nullptr || p->cu_seqlens_k != nullptr) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  "this family runs no bias, dropout or packed variable lengths (seqlens_k instead)");
  }
  if (p->local != 0 && (p->window_left < -1 || p->window_right < -1)) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "window (%d, %d): each side is -1 (unbounded) or >= 0",
                  p->window_left, p->window_right);
  }
  if (p->block_table != nullptr && p->page_size < 1) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "page_size %d with a block table", p->page_size);
  }
  if (p->num_splits > kMaxSplits) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "num_splits %d exceeds %d", p->num_splits, kMaxSplits);
  }
  const int64_t rows = int64_t(p->seqlen_q) * (p->heads / p->heads_kv);
  const int64_t m_blocks = (rows + Traits::kBlockM - 1) / Traits::kBlockM;
  const int64_t bkv = int64_t(p->batch) * p->heads_kv;
  if (m_blocks > kMaxGridYZ || bkv > kMaxGridYZ) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  "%lld row tiles per KV head or %lld batch*heads_kv exceed %lld", static_cast<long long>(m_blocks),
                  static_cast<long long>(bkv), static_cast<long long>(kMaxGridYZ));
  }
  if (p->num_splits > 1 && (p->workspace == nullptr || p->workspace_bytes < workspace_bytes(*p) ||
                            reinterpret_cast<uintptr_t>(p->workspace) % 256 != 0)) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  "num_splits %d needs a 256-byte aligned workspace of %lld bytes (got %lld)", p->num_splits,
                  static_cast<long long>(workspace_bytes(*p)), static_cast<long long>(p->workspace_bytes));
  }
  constexpr int kSmem = Traits::kSmemSize;
  if (int status = opt_in_smem<&decode_kernel<Traits>>(kSmem, err, err_len)) return status;
  GemmgenAttnParams params = *p;
  if (params.scale == 0.f) params.scale = FLT_MIN;  // as fa2_sm80: no NaN from exp2(-inf * 0)
  const int splits = params.num_splits > 1 ? params.num_splits : 1;
  const dim3 grid(splits, static_cast<unsigned>(m_blocks), static_cast<unsigned>(bkv));
  decode_kernel<Traits><<<grid, Traits::kNThreads, kSmem, stream>>>(params);
  if (splits > 1) {
    // A row's splits over up to four warps: one row per CTA from four splits on, two rows of two
    // warps each below (many rows, few splits: the large batches).
    const int warps_per_row = splits >= 4 ? 4 : 2;
    const int rows_per_cta = kCombineWarps / warps_per_row;
    const int64_t all_rows = int64_t(p->batch) * p->heads * p->seqlen_q;
    combine_kernel<typename Traits::Element, Traits::kHeadDim>
        <<<static_cast<unsigned>((all_rows + rows_per_cta - 1) / rows_per_cta), 32 * kCombineWarps, 0, stream>>>(
            params, warps_per_row);
  }
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    return report(err, err_len, GEMMGEN_CUDA_ERROR, "kernel launch: %s (%s)", cudaGetErrorString(e),
                  cudaGetErrorName(e));
  }
  return GEMMGEN_OK;
}

template <class Traits>
int64_t workspace(const GemmgenAttnParams* p) {
  return p == nullptr ? -1 : workspace_bytes(*p);
}

template <class Traits>
int info(GemmgenInstanceInfo* out) {
  // Serves both masks (causal_offset decides per call); writes LSE only when asked.
  return instance_info(out, Traits::kHeadDim, Traits::kBlockM, Traits::kBlockN, Traits::kNThreads,
                       Traits::kSmemSize, /*causal=*/false, GEMMGEN_INFO_KV_CACHE);
}

}  // namespace gemmgen::decode_sm80
