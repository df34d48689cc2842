// Stream-ordered workspace allocation that stays cheap for callers who synchronize after every call.
// cudaMallocAsync draws from the device's default memory pool, whose release threshold is 0: each
// synchronize hands its unused memory back, and the next allocation maps it again (tens of
// microseconds per call). The first allocation on a device lets the pool keep up to
// kKeepPoolBytes across synchronizes; only stream-ordered allocations use this pool.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace gemmgen {

inline constexpr uint64_t kKeepPoolBytes = uint64_t(64) << 20;

inline cudaError_t workspace_alloc(void** ptr, size_t bytes, cudaStream_t stream) {
  static std::atomic<uint64_t> configured{0};  // one bit per device index below 64
  int device = 0;
  if (cudaGetDevice(&device) == cudaSuccess && device < 64) {
    const uint64_t bit = uint64_t(1) << device;
    if (!(configured.load(std::memory_order_relaxed) & bit)) {
      cudaMemPool_t pool;
      uint64_t keep = kKeepPoolBytes, current = 0;
      if (cudaDeviceGetDefaultMemPool(&pool, device) == cudaSuccess &&
          cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &current) == cudaSuccess &&
          current < keep) {
        cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);  // best effort
      }
      cudaGetLastError();  // a pool that refuses the attribute leaves no sticky error
      configured.fetch_or(bit, std::memory_order_relaxed);
    }
  }
  return cudaMallocAsync(ptr, bytes, stream);
}

}  // namespace gemmgen
