// The (seed, offset) pair CUTLASS example 41's dropout reads through PyTorch's names
// (at::PhiloxCudaState, at::cuda::philox::unpack): gemmgen passes them in GemmgenAttnParams.
#pragma once
#include <stdint.h>
#include <tuple>

#include <cuda_runtime.h>

namespace at {

struct PhiloxCudaState {
  __host__ __device__ PhiloxCudaState() {}
  __host__ __device__ PhiloxCudaState(uint64_t seed, uint64_t offset) : seed_(seed), offset_(offset) {}
  uint64_t seed_ = 0;
  uint64_t offset_ = 0;
};

namespace cuda::philox {
__host__ __device__ inline std::tuple<uint64_t, uint64_t> unpack(const PhiloxCudaState& state) {
  return std::tuple<uint64_t, uint64_t>(state.seed_, state.offset_);
}
}  // namespace cuda::philox

}  // namespace at
