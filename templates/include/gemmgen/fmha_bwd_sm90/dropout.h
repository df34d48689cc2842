// The forward's dropout mask (gemmgen/philox/philox.h) in the split-dQ backward, where the scores
// are held transposed: a math group's tile is keys x queries, wgmma's accumulator layout (element
// i of a thread at key row + 8 * ((i >> 1) & 1) and query column + 8 * (i >> 2) + (i & 1); a
// warp's rows are 16 consecutive keys, lane / 4 and lane / 4 + 8).
//
// Along a query column the mask's stream positions run over the keys: the eight lanes that share
// a column (lane % 4 alike) hold its 16 keys of the warp, which span five Philox counters at most.
// Lane lane / 4 = u draws counter u of the column (lanes 5-7 draw one too many), the comparisons
// with the keep threshold become a nibble, and three shuffles merge the nibbles into the column's
// bits; each lane then takes its two keys' bits. Where every column starts on a counter (Nk and the
// offset multiples of 4: the mask's `aligned`), a column spans four counters, and the eight lanes
// draw those of a thread's two adjacent columns at once: half the draws and shuffles.
#pragma once
#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"

#include "gemmgen/philox/philox.h"

namespace gemmgen::fmha_bwd_sm90 {

// Bit i: whether this thread's element i of a transposed score tile (coordinates `count`, (key,
// query) each; at most 64 elements) is kept, for the head whose weight (0, 0) is at stream position
// `base`.
template <class CountS>
CUTLASS_DEVICE uint64_t kept_transposed(CountS const& count, philox::Mask const& d, uint64_t base) {
  constexpr int kElems = decltype(cute::size(count))::value;
  static_assert(kElems <= 64 && kElems % 4 == 0, "a thread's scores of one tile fit a 64-bit mask");
  const uint32_t u = (threadIdx.x % 32) / 4;                       // this lane's key row in its warp
  const uint32_t key0 = uint32_t(cute::get<0>(count(0))) - u;       // the warp's first key
  uint64_t bits = 0;
  auto nibble = [&](uint4 r) {
    return uint32_t(r.x >= d.threshold) | uint32_t(r.y >= d.threshold) << 1 | uint32_t(r.z >= d.threshold) << 2 |
           uint32_t(r.w >= d.threshold) << 3;
  };
  if (d.aligned) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kElems; i += 4) {  // elements i, i + 2: column q; i + 1, i + 3: column q + 1
      const uint32_t query = uint32_t(cute::get<1>(count(i)));
      const uint64_t at = base + uint32_t(query * d.seqlen_k + key0);  // a multiple of 4
      // Lanes u < 4: counter u of column q; u >= 4: counter u - 4 of column q + 1 (Nk / 4 further).
      const uint64_t counter = (at >> 2) + (u < 4 ? u : d.seqlen_k / 4 + u - 4);
      uint32_t columns = nibble(philox::outputs(counter, d.seed)) << (4 * u);  // q: bits 0-15, q + 1: 16-31
      columns |= __shfl_xor_sync(0xffffffffu, columns, 4);
      columns |= __shfl_xor_sync(0xffffffffu, columns, 8);
      columns |= __shfl_xor_sync(0xffffffffu, columns, 16);
      bits |= uint64_t((columns >> u) & 1u) << i;
      bits |= uint64_t((columns >> (u + 8)) & 1u) << (i + 2);
      bits |= uint64_t((columns >> (u + 16)) & 1u) << (i + 1);
      bits |= uint64_t((columns >> (u + 24)) & 1u) << (i + 3);
    }
    return bits;
  }
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kElems; ++i) {
    if ((i >> 1) & 1) continue;  // element i + 2: the same column, key + 8
    const uint32_t query = uint32_t(cute::get<1>(count(i)));
    const uint64_t at = base + uint32_t(query * d.seqlen_k + key0);  // 32-bit within the head
    const uint32_t nib = nibble(philox::outputs((at >> 2) + u, d.seed));
    uint32_t column = u < 5 ? nib << (4 * u) : 0u;  // bit y: stream position (at & ~3) + y
    column |= __shfl_xor_sync(0xffffffffu, column, 4);
    column |= __shfl_xor_sync(0xffffffffu, column, 8);
    column |= __shfl_xor_sync(0xffffffffu, column, 16);
    const uint32_t y = u + uint32_t(at & 3);
    bits |= uint64_t((column >> y) & 1u) << i;
    bits |= uint64_t((column >> (y + 8)) & 1u) << (i + 2);
  }
  return bits;
}

}  // namespace gemmgen::fmha_bwd_sm90
