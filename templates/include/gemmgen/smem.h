// Opting a kernel into more than 48 KB of dynamic shared memory: a per-device function attribute,
// set once per device and kernel (later calls only read an atomic).
#pragma once
#include <atomic>
#include <cstdint>

#include <cuda_runtime.h>

#include "gemmgen/abi.h"
#include "gemmgen/report.h"

namespace gemmgen {

template <auto Kernel>
int opt_in_smem(int bytes, char* err, int err_len) {
  if (bytes <= 48 * 1024) return GEMMGEN_OK;
  static std::atomic<uint64_t> configured{0};  // one bit per device index below 64
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  const uint64_t bit = device < 64 ? uint64_t(1) << device : 0;
  if (e == cudaSuccess && (bit == 0 || !(configured.load(std::memory_order_relaxed) & bit))) {
    e = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (e == cudaSuccess) configured.fetch_or(bit, std::memory_order_relaxed);
  }
  if (e != cudaSuccess) {
    return report(err, err_len, GEMMGEN_CUDA_ERROR, "setting the shared memory limit: %s (%s)",
                  cudaGetErrorString(e), cudaGetErrorName(e));
  }
  return GEMMGEN_OK;
}

}  // namespace gemmgen
