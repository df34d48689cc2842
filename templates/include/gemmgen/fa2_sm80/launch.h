// Host side of the fa2_sm80 family: checks the params an instance cannot run, sizes the
// grid and launches on the caller's stream. Errors come back as a status and a message.
#pragma once
#include <cfloat>
#include <cstdio>

#include <cuda_runtime.h>

#include "gemmgen/abi.h"
#include "gemmgen/report.h"
#include "gemmgen/smem.h"
#include "gemmgen/fa2_sm80/checks.h"
#include "gemmgen/fa2_sm80/kernel.h"

namespace gemmgen::fa2_sm80 {

// CUDA caps grid.y and grid.z at 65535: batch*heads is spread over both.
constexpr int64_t kMaxGridYZ = 65535;

template <class Traits, bool Causal, bool Local = false, bool Softcap = false>
int run(const GemmgenAttnParams* p, cudaStream_t stream, char* err, int err_len) {
  if (int status = check_sizes<Traits::kHeadDim>(p, 1, err, err_len)) return status;
  if (p->bias != nullptr || p->dropout_p != 0.f || p->seqlens_k != nullptr || p->block_table != nullptr) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "this family runs no bias, dropout or key-value cache");
  }
  if (int status = check_varlen(p, err, err_len)) return status;
  if (Local != (p->local != 0)) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  Local ? "this instance runs sliding windows only (params.local is 0)"
                        : "a sliding window (params.local): this instance runs none (a local one does)");
  }
  if (Softcap ? !(p->softcap > 0.f && p->softcap < INFINITY) : p->softcap != 0.f) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  Softcap ? "softcap %g: this instance runs a finite logit softcap > 0"
                          : "softcap %g: this instance runs no logit softcap (one built for it does)",
                  p->softcap);
  }
  if (Local && (p->window_left < -1 || p->window_right < -1)) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "window (%d, %d): each side is -1 (unbounded) or >= 0",
                  p->window_left, p->window_right);
  }
  const int64_t bh = int64_t(p->batch) * p->heads;
  if (bh > kMaxGridYZ * kMaxGridYZ) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "batch*heads %lld exceeds %lld",
                  static_cast<long long>(bh), static_cast<long long>(kMaxGridYZ * kMaxGridYZ));
  }
  auto kernel = &fwd_kernel<Traits, Causal, Local, Softcap>;
  constexpr int kSmem = Traits::kSmemSize;
  if (int status = opt_in_smem<&fwd_kernel<Traits, Causal, Local, Softcap>>(kSmem, err, err_len)) return status;
  const unsigned grid_y = static_cast<unsigned>(bh < kMaxGridYZ ? bh : kMaxGridYZ);
  const unsigned grid_z = static_cast<unsigned>((bh + grid_y - 1) / grid_y);
  const dim3 grid((p->seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM, grid_y, grid_z);
  GemmgenAttnParams params = *p;
  // A scale of exactly 0 would turn masked scores (-inf) into NaN in the folded
  // exp2(score * scale - max); the smallest normal float gives the same uniform weights.
  if (params.scale == 0.f) params.scale = FLT_MIN;
  kernel<<<grid, Traits::kNThreads, kSmem, stream>>>(params);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    return report(err, err_len, GEMMGEN_CUDA_ERROR, "kernel launch: %s (%s)", cudaGetErrorString(e),
                  cudaGetErrorName(e));
  }
  return GEMMGEN_OK;
}

template <class Traits, bool Causal>
int info(GemmgenInstanceInfo* out) {
  return instance_info(out, Traits::kHeadDim, Traits::kBlockM, Traits::kBlockN, Traits::kNThreads,
                       Traits::kSmemSize, Causal, /*flags=*/0);
}

}  // namespace gemmgen::fa2_sm80
