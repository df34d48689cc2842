// How the C ABI entry points report: a failure as a status code returned and a message written
// into the caller's buffer (printf-style, truncated to err_len); an attention instance's static
// facts through its <symbol>_info.
#pragma once
#include <cstdarg>
#include <cstdio>

#include "gemmgen/abi.h"

namespace gemmgen {

inline int report(char* err, int err_len, int status, const char* fmt, ...) {
  if (err != nullptr && err_len > 0) {
    va_list args;
    va_start(args, fmt);
    vsnprintf(err, static_cast<size_t>(err_len), fmt, args);
    va_end(args);
  }
  return status;
}

// Fill `out` (GEMMGEN_INVALID_ARGUMENT when it is NULL) with the facts of an attention instance:
// its head dim (the bound, for an instance serving every head dim up to one), tile, threads,
// shared memory, whether it is built for the causal mask, and GEMMGEN_INFO_* flags.
inline int instance_info(GemmgenInstanceInfo* out, int head_dim, int block_m, int block_n, int threads,
                         int smem_bytes, bool causal, int flags) {
  if (out == nullptr) return GEMMGEN_INVALID_ARGUMENT;
  *out = GemmgenInstanceInfo{GEMMGEN_ABI_VERSION, head_dim, block_m, block_n, threads, smem_bytes,
                             causal ? 1 : 0, flags};
  return GEMMGEN_OK;
}

// instance_info of an instance built on a CUTLASS kernel: Cfg names its head dim, tile and mask
// (kHeadDim, kBlockM, kBlockN, kCausal) and its kernel type (Kernel, whose threads and shared
// memory are reported).
template <class Cfg>
int cutlass_kernel_info(GemmgenInstanceInfo* out, int flags) {
  return instance_info(out, Cfg::kHeadDim, Cfg::kBlockM, Cfg::kBlockN, Cfg::Kernel::MaxThreadsPerBlock,
                       Cfg::Kernel::SharedStorageSize, Cfg::kCausal, flags);
}

}  // namespace gemmgen
