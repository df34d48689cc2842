// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011) with
// cuRAND's interface and stream layout: key = seed, counter = (offset / 4, subsequence), four
// 32-bit outputs per counter. Only used where the toolkit has no curand_kernel.h.
#pragma once
#include <cuda_runtime.h>

struct curandStatePhilox4_32_10 {
  uint4 ctr;
  uint4 output;
  uint2 key;
  unsigned int STATE;  // next output of `output` to hand out, 0..3
};
typedef struct curandStatePhilox4_32_10 curandStatePhilox4_32_10_t;

namespace gemmgen::philox {

// The round multipliers and Weyl key increments of Philox4x32.
constexpr unsigned int kMul0 = 0xD2511F53u;
constexpr unsigned int kMul1 = 0xCD9E8D57u;
constexpr unsigned int kWeyl0 = 0x9E3779B9u;
constexpr unsigned int kWeyl1 = 0xBB67AE85u;
constexpr int kRounds = 10;
constexpr float kTwoPow32Inv = 2.3283064e-10f;  // 2^-32: a 32-bit output scaled into (0, 1]

__device__ __forceinline__ uint4 philox_round(uint4 ctr, uint2 key) {
  const unsigned int hi0 = __umulhi(kMul0, ctr.x), lo0 = kMul0 * ctr.x;
  const unsigned int hi1 = __umulhi(kMul1, ctr.z), lo1 = kMul1 * ctr.z;
  return make_uint4(hi1 ^ ctr.y ^ key.x, lo1, hi0 ^ ctr.w ^ key.y, lo0);
}

__device__ __forceinline__ uint4 block(uint4 ctr, uint2 key) {
#pragma unroll
  for (int r = 0; r < kRounds; ++r) {
    if (r > 0) key = make_uint2(key.x + kWeyl0, key.y + kWeyl1);
    ctr = philox_round(ctr, key);
  }
  return ctr;
}

// Advance the 128-bit counter's low 64 bits by n (carrying into the high 64).
__device__ __forceinline__ void advance(curandStatePhilox4_32_10_t* s, unsigned long long n) {
  unsigned int lo = static_cast<unsigned int>(n), hi = static_cast<unsigned int>(n >> 32);
  s->ctr.x += lo;
  if (s->ctr.x < lo) ++hi;
  s->ctr.y += hi;
  if (hi <= s->ctr.y) return;
  if (++s->ctr.z) return;
  ++s->ctr.w;
}

// Advance the high 64 bits (the subsequence) by n.
__device__ __forceinline__ void advance_high(curandStatePhilox4_32_10_t* s, unsigned long long n) {
  unsigned int lo = static_cast<unsigned int>(n), hi = static_cast<unsigned int>(n >> 32);
  s->ctr.z += lo;
  if (s->ctr.z < lo) ++hi;
  s->ctr.w += hi;
}

}  // namespace gemmgen::philox

// Skip n 32-bit outputs.
__device__ __forceinline__ void skipahead(unsigned long long n, curandStatePhilox4_32_10_t* s) {
  s->STATE += static_cast<unsigned int>(n & 3);
  n /= 4;
  if (s->STATE > 3) {
    n += 1;
    s->STATE -= 4;
  }
  gemmgen::philox::advance(s, n);
  s->output = gemmgen::philox::block(s->ctr, s->key);
}

__device__ __forceinline__ void curand_init(unsigned long long seed, unsigned long long subsequence,
                                            unsigned long long offset, curandStatePhilox4_32_10_t* s) {
  s->ctr = make_uint4(0, 0, 0, 0);
  s->key = make_uint2(static_cast<unsigned int>(seed), static_cast<unsigned int>(seed >> 32));
  s->STATE = 0;
  gemmgen::philox::advance_high(s, subsequence);
  skipahead(offset, s);
}

// The next four 32-bit outputs.
__device__ __forceinline__ uint4 curand4(curandStatePhilox4_32_10_t* s) {
  const uint4 now = s->output;
  gemmgen::philox::advance(s, 1);
  const uint4 next = s->output = gemmgen::philox::block(s->ctr, s->key);
  switch (s->STATE) {
    case 0: return now;
    case 1: return make_uint4(now.y, now.z, now.w, next.x);
    case 2: return make_uint4(now.z, now.w, next.x, next.y);
    default: return make_uint4(now.w, next.x, next.y, next.z);
  }
}

// Four uniform floats in (0, 1].
__device__ __forceinline__ float4 curand_uniform4(curandStatePhilox4_32_10_t* s) {
  using gemmgen::philox::kTwoPow32Inv;
  const uint4 r = curand4(s);
  return make_float4(r.x * kTwoPow32Inv + kTwoPow32Inv / 2.0f, r.y * kTwoPow32Inv + kTwoPow32Inv / 2.0f,
                     r.z * kTwoPow32Inv + kTwoPow32Inv / 2.0f, r.w * kTwoPow32Inv + kTwoPow32Inv / 2.0f);
}
