// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011) with
// cuRAND's interface and stream layout: key = seed, counter = (offset / 4, subsequence), four
// 32-bit outputs per counter. Only used where the toolkit has no curand_kernel.h.
#pragma once
#include <cuda_runtime.h>

#include "gemmgen/philox/philox.h"

struct curandStatePhilox4_32_10 {
  uint4 ctr;
  uint4 output;
  uint2 key;
  unsigned int STATE;  // next output of `output` to hand out, 0..3
};
typedef struct curandStatePhilox4_32_10 curandStatePhilox4_32_10_t;

namespace gemmgen::philox {

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
  using gemmgen::philox::uniform;
  const uint4 r = curand4(s);
  return make_float4(uniform(r.x), uniform(r.y), uniform(r.z), uniform(r.w));
}
