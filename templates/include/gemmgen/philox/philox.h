// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011) in
// cuRAND's stream layout, and the dropout mask every gemmgen family draws from it.
//
// The mask (the one CUTLASS's memory-efficient attention kernel draws through cuRAND, which the
// mea_sm80 and mea_bwd_sm80 families run): weight (b, h, i, j) of a [B, H, Nq, Nk] call is kept
// iff the 32-bit output at stream position
//   offset + u32(b * H * Nq * Nk + h * Nq * Nk) + u32(i * Nk + j)
// (u32: taken modulo 2^32, as that kernel's 32-bit arithmetic does) scales into (0, 1] above
// dropout_p. Output n of the stream is word n % 4 of Philox4x32-10 with key = seed and counter =
// n / 4 (128 bits, the high 64 zero). Families that draw it alike give the same mask for the same
// (seed, offset), so a forward and its backward may run on different families.
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

namespace gemmgen::philox {

// The round multipliers and Weyl key increments of Philox4x32.
constexpr uint32_t kMul0 = 0xD2511F53u;
constexpr uint32_t kMul1 = 0xCD9E8D57u;
constexpr uint32_t kWeyl0 = 0x9E3779B9u;
constexpr uint32_t kWeyl1 = 0xBB67AE85u;
constexpr int kRounds = 10;
constexpr float kTwoPow32Inv = 2.3283064e-10f;  // 2^-32 (exactly): a 32-bit output scaled into (0, 1]

__host__ __device__ __forceinline__ uint4 philox_round(uint4 ctr, uint2 key) {
#ifdef __CUDA_ARCH__
  const uint32_t hi0 = __umulhi(kMul0, ctr.x), hi1 = __umulhi(kMul1, ctr.z);
#else
  const uint32_t hi0 = uint32_t((uint64_t(kMul0) * ctr.x) >> 32), hi1 = uint32_t((uint64_t(kMul1) * ctr.z) >> 32);
#endif
  return make_uint4(hi1 ^ ctr.y ^ key.x, kMul1 * ctr.z, hi0 ^ ctr.w ^ key.y, kMul0 * ctr.x);
}

// The four outputs of counter `ctr` under `key`.
__host__ __device__ __forceinline__ uint4 block(uint4 ctr, uint2 key) {
#pragma unroll
  for (int r = 0; r < kRounds; ++r) {
    if (r > 0) key = make_uint2(key.x + kWeyl0, key.y + kWeyl1);
    ctr = philox_round(ctr, key);
  }
  return ctr;
}

// The four outputs at stream positions 4 * counter .. 4 * counter + 3 of `seed`'s stream.
__host__ __device__ __forceinline__ uint4 outputs(uint64_t counter, uint64_t seed) {
  return block(make_uint4(uint32_t(counter), uint32_t(counter >> 32), 0u, 0u),
               make_uint2(uint32_t(seed), uint32_t(seed >> 32)));
}

// An output scaled into (0, 1], as cuRAND's curand_uniform scales it (the product is exact).
__host__ __device__ __forceinline__ float uniform(uint32_t x) {
  return float(x) * kTwoPow32Inv + kTwoPow32Inv / 2.0f;
}

// The smallest output whose uniform() exceeds p (p in [0, 1)): a weight is kept iff its output is
// at least this. uniform() never decreases with its argument, so a binary search finds it.
inline uint32_t keep_threshold(float p) {
  uint64_t lo = 0, hi = 0xffffffffull;  // uniform(2^32 - 1) = 1 > p
  while (lo < hi) {
    const uint64_t mid = (lo + hi) / 2;
    if (uniform(uint32_t(mid)) > p) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return uint32_t(lo);
}

// A launch's dropout, as its kernels draw the mask: the seed and offset, the stream position of the
// launch's first (batch, head) modulo 2^32 before the offset, the steps of one batch entry and one
// head (H * Nq * Nk and Nq * Nk modulo 2^32), the stream's row length (the call's keys), the keep
// threshold, 1 / (1 - p), and whether every row (every key run of Nk) starts on a counter (Nk and
// the offset multiples of 4).
struct Mask {
  uint64_t seed = 0, offset = 0;
  uint32_t origin = 0, batch_step = 0, head_step = 0;
  uint32_t seqlen_k = 0, threshold = 0;
  float scale = 1.f;
  bool aligned = false;

  // The stream position of weight (0, 0) of (batch b, head h), both counted from the launch's first.
  __host__ __device__ __forceinline__ uint64_t head_base(uint32_t b, uint32_t h) const {
    return offset + uint32_t(origin + b * batch_step + h * head_step);
  }
};

// The mask of a launch over heads h0.. of batch entries b0.. of a call's [B, H, Nq, Nk] weights.
inline Mask launch_mask(float p, uint64_t seed, uint64_t offset, int64_t heads, int64_t seqlen_q, int64_t seqlen_k,
                        int64_t b0, int64_t h0) {
  Mask m;
  m.seed = seed;
  m.offset = offset;
  m.head_step = uint32_t(seqlen_q) * uint32_t(seqlen_k);
  m.batch_step = uint32_t(heads) * m.head_step;
  m.origin = uint32_t(b0) * m.batch_step + uint32_t(h0) * m.head_step;
  m.seqlen_k = uint32_t(seqlen_k);
  m.threshold = keep_threshold(p);
  m.scale = 1.f / (1.f - p);
  m.aligned = seqlen_k % 4 == 0 && offset % 4 == 0;
  return m;
}

}  // namespace gemmgen::philox
