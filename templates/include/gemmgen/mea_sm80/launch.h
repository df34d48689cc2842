// Host side of the mea_sm80 family: checks the params an instance cannot run, sizes the grid and
// launches on the caller's stream (a float32 workspace, when the instance needs one, is allocated
// and freed in stream order). Errors come back as a status and a message, never as a crash.
//
// causal_offset is read for every call (this family's instances serve both masks): key j is
// visible to query i iff j <= i + causal_offset, so INT32_MAX means no mask. With cu_seqlens,
// i and j count from the start of each sequence.
#pragma once
#include <cstdint>
#include <cstdio>

#include <cuda_runtime.h>

#include "gemmgen/abi.h"
#include "gemmgen/report.h"
#include "gemmgen/smem.h"
#include "gemmgen/mea_sm80/checks.h"
#include "gemmgen/mea_sm80/kernel.h"

namespace gemmgen::mea_sm80 {

constexpr int64_t kMaxGridYZ = 65535;  // CUDA's limit on grid.y (heads) and grid.z (batches)

template <class Traits>
int check(const GemmgenAttnParams* p, char* err, int err_len) {
  if (int status = check_head_dim<Traits>(p->head_dim, err, err_len)) return status;
  constexpr int kAlign = Traits::kAlignment;
  if (p->batch < 1 || p->heads < 1 || p->heads_kv < 1 || p->seqlen_q < 1 || p->seqlen_k < 1 ||
      p->heads % p->heads_kv != 0 || p->heads > kMaxGridYZ) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  "bad sizes: batch %d heads %d (at most %lld) heads_kv %d seqlen_q %d seqlen_k %d", p->batch,
                  p->heads, static_cast<long long>(kMaxGridYZ), p->heads_kv, p->seqlen_q, p->seqlen_k);
  }
  if (!(p->dropout_p >= 0.f && p->dropout_p < 1.f)) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "dropout_p %g outside [0, 1)", p->dropout_p);
  }
  if ((p->cu_seqlens_q == nullptr) != (p->cu_seqlens_k == nullptr)) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "cu_seqlens_q and cu_seqlens_k go together");
  }
  if (p->align_per_sequence != 0) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  "align_per_sequence: this family aligns every sequence's mask at causal_offset (top-left)");
  }
  if (p->seqlens_k != nullptr || p->block_table != nullptr) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "this family runs no key-value cache (seqlens_k, block_table)");
  }
  const void* data[] = {p->q, p->k, p->v, p->o, p->bias};
  const int64_t strides[] = {p->q_batch_stride, p->q_head_stride, p->q_row_stride, p->k_batch_stride,
                             p->k_head_stride,  p->k_row_stride,  p->v_batch_stride, p->v_head_stride,
                             p->v_row_stride,   p->o_batch_stride, p->o_head_stride, p->o_row_stride,
                             p->bias_batch_stride, p->bias_head_stride, p->bias_row_stride};
  const int64_t element_bytes = sizeof(typename Traits::Kernel::scalar_t);
  for (const void* ptr : data) {
    if (reinterpret_cast<uintptr_t>(ptr) % (kAlign * element_bytes)) {
      return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "a data pointer is not %lld-byte aligned",
                    static_cast<long long>(kAlign * element_bytes));
    }
  }
  for (int64_t s : strides) {
    if (s % kAlign) {
      return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "stride %lld is not a multiple of %d elements",
                    static_cast<long long>(s), kAlign);
    }
  }
  if (!rows_fit_int32(p->seqlen_k, p->k_row_stride) || !rows_fit_int32(p->seqlen_k, p->v_row_stride) ||
      !rows_fit_int32(p->seqlen_q, p->q_row_stride) || !rows_fit_int32(p->seqlen_q, p->o_row_stride) ||
      (p->bias != nullptr && !rows_fit_int32(p->seqlen_q, p->bias_row_stride))) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  "sequence length x row stride exceeds int32 (the kernel's row indexing)");
  }
  return GEMMGEN_OK;
}

template <class Traits>
int run(const GemmgenAttnParams* p, cudaStream_t stream, char* err, int err_len) {
  if (p == nullptr) return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "params is NULL");
  if (int status = check<Traits>(p, err, err_len)) return status;
  auto kernel = &fwd_kernel<Traits>;
  constexpr int kSmem = Traits::kSmemSize;
  if (int status = opt_in_smem<&fwd_kernel<Traits>>(kSmem, err, err_len)) return status;
  LaunchArgs args{*p, nullptr, 0};
  if constexpr (Traits::kNeedsWorkspace) {
    // Rows of every sequence: batch * seqlen_q bounds the packed rows too (seqlen_q is their maximum).
    const size_t bytes = size_t(p->batch) * p->seqlen_q * p->heads * p->head_dim * sizeof(float);
    cudaError_t e = cudaMallocAsync(reinterpret_cast<void**>(&args.workspace), bytes, stream);
    if (e != cudaSuccess) {
      return report(err, err_len, GEMMGEN_CUDA_ERROR, "allocating a %zu-byte workspace: %s (%s)", bytes,
                    cudaGetErrorString(e), cudaGetErrorName(e));
    }
  }
  const dim3 block(32, Traits::kWarps);
  int status = GEMMGEN_OK;
  for (int64_t first = 0; first < p->batch && status == GEMMGEN_OK; first += kMaxGridYZ) {
    const int64_t batches = p->batch - first < kMaxGridYZ ? p->batch - first : kMaxGridYZ;
    const dim3 grid((p->seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM, p->heads, unsigned(batches));
    args.batch_offset = int32_t(first);
    kernel<<<grid, block, kSmem, stream>>>(args);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) {
      status = report(err, err_len, GEMMGEN_CUDA_ERROR, "kernel launch: %s (%s)", cudaGetErrorString(e),
                      cudaGetErrorName(e));
    }
  }
  if (args.workspace != nullptr) {
    cudaError_t e = cudaFreeAsync(args.workspace, stream);
    if (e != cudaSuccess && status == GEMMGEN_OK) {
      status = report(err, err_len, GEMMGEN_CUDA_ERROR, "freeing the workspace: %s (%s)", cudaGetErrorString(e),
                      cudaGetErrorName(e));
    }
  }
  return status;
}

template <class Traits>
int info(GemmgenInstanceInfo* out) {
  // The head dim is the bound (every multiple of kAlignment up to it runs); causal is false as
  // the instance serves both masks (causal_offset decides per call); no flags: LSE is written only
  // where the caller passes a buffer.
  return instance_info(out, Traits::kMaxHeadDim, Traits::kBlockM, Traits::kBlockN, Traits::kThreads,
                       Traits::kSmemSize, /*causal=*/false, /*flags=*/0);
}

}  // namespace gemmgen::mea_sm80
