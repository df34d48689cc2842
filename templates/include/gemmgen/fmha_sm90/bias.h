// Additive masks (attn_mask) in the fmha_sm90 family's `_bias` instances.
//
// The bias is [batch, head, row, key] in the inputs' 16-bit type (a bool mask arrives as 0 / -inf),
// any of batch, head and row broadcast (stride 0). Read whole, it costs 2 bytes per score: at the
// dense kernel's rate that is about 3 TB/s at d128, more than the L2 gives, and the first masked
// version (every tile's bias read) ran at 0.40x the unmasked call (bench/NOTES.md, experiment 93).
// Masks are mostly constant over whole tiles, though (a causal and padding mask is 0 below the
// diagonal and -inf above it), so a small kernel first sorts each (64-row group, key tile) into
// visible (all 0), hidden (all -inf) or mixed; the attention kernel then reads the bias of mixed
// tiles only, and skips the softmax of hidden ones (their probabilities are 0). The sort reads the
// bias once more, so it runs only where the bias is shared by several heads or batch entries (the
// attention kernel then reads it that many times); otherwise every tile is taken as mixed.
#pragma once
#include <cstdint>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cutlass/numeric_types.h"

namespace gemmgen::fmha_sm90 {

enum TileClass : uint8_t { kVisible = 0, kHidden = 1, kMixed = 2 };

// What a consumer warp's softmax needs of its row tile's bias, in a shared-memory slot per warp set
// by the kernel before each row tile (as TileFactors, softmax.h): the bias rows (batch and head
// applied; [row, key] at row * row_stride + key, row_stride 0 for one row that every query
// shares), and the classes of this warp group's 64 rows, one per key tile (NULL: all mixed).
struct TileBias {
  const void* ptr;
  int64_t row_stride;
  const uint8_t* classes;
  int key_tiles;
};
__device__ __forceinline__ TileBias& tile_bias() {
  __shared__ TileBias slots[32];  // by the CTA's warp: 1 KB of static shared memory
  return slots[threadIdx.x / 32];
}

// Two adjacent bias elements (the first in the low half) as floats.
__device__ __forceinline__ float2 bias_pair(uint32_t v, cutlass::bfloat16_t const*) {
  return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u));
}
__device__ __forceinline__ float2 bias_pair(uint32_t v, cutlass::half_t const*) {
  return __half22float2(*reinterpret_cast<__half2 const*>(&v));
}
// Two -inf elements in one word.
constexpr uint32_t neg_inf_pair(cutlass::bfloat16_t const*) { return 0xff80ff80u; }
constexpr uint32_t neg_inf_pair(cutlass::half_t const*) { return 0xfc00fc00u; }

constexpr int kClassRows = 64;  // a consumer warp group's rows
constexpr int kClassThreads = 256;

// Whether to sort the tiles: the bias is read by several heads or batch entries.
inline bool classifies(int64_t batch, int64_t heads, int64_t batch_stride, int64_t head_stride) {
  return (head_stride == 0 && heads > 1) || (batch_stride == 0 && batch > 1);
}

// grid: (key tiles, row groups, up to 65535 of the bias's batch entries * heads, each 1 where it
// broadcasts);
// classes: [bias batch][bias head][row group][key tile]. Tiles a causal row group never reads
// (their first key past its last row's diagonal, `offset` = seqlen_k - seqlen_q) are marked hidden
// unread.
template <class Element>
__global__ void __launch_bounds__(kClassThreads) classify_bias_tiles(
    const uint16_t* __restrict__ bias, int64_t sb, int64_t sh, int64_t sr, int bias_batch, int bias_heads,
    int seqlen_q, int seqlen_k, int block_n, bool causal, int offset, uint8_t* __restrict__ classes) {
  const int tile = blockIdx.x, group = blockIdx.y;
  const int row0 = group * kClassRows, key0 = tile * block_n;
  const int rows = min(kClassRows, seqlen_q - row0), keys = min(block_n, seqlen_k - key0);
  const bool unread = causal && key0 > row0 + rows - 1 + offset;
  const int pairs = (keys + 1) / 2;
  constexpr uint32_t kNegInf = neg_inf_pair(static_cast<Element const*>(nullptr));
  for (int bh = blockIdx.z; bh < bias_batch * bias_heads; bh += gridDim.z) {  // (grid z is at most 65535)
    const int b = bh / bias_heads, h = bh - b * bias_heads;
    uint8_t* out = classes + (int64_t(bh) * gridDim.y + group) * gridDim.x + tile;
    if (unread) {
      if (threadIdx.x == 0) *out = kHidden;
      continue;
    }
    const uint16_t* base = bias + b * sb + h * sh;
    bool zero = true, hidden = true;
    for (int i = threadIdx.x; i < rows * pairs; i += kClassThreads) {
      const int r = i / pairs, key = key0 + 2 * (i - r * pairs);
      const uint16_t* at = base + int64_t(row0 + r) * sr + key;
      uint32_t w;
      if (key + 1 < seqlen_k) {
        w = __ldg(reinterpret_cast<const uint32_t*>(at));
      } else {  // a row's last key alone: its value in both halves
        w = __ldg(reinterpret_cast<const unsigned short*>(at));
        w |= w << 16;
      }
      zero = zero && (w & 0x7fff7fffu) == 0;
      hidden = hidden && w == kNegInf;
    }
    zero = __syncthreads_and(zero);
    hidden = __syncthreads_and(hidden);
    if (threadIdx.x == 0) *out = zero ? kVisible : hidden ? kHidden : kMixed;
  }
}

// The classes' bytes: [bias batch][bias head][row groups][key tiles].
inline int64_t bias_classes_bytes(int64_t bias_batch, int64_t bias_heads, int64_t seqlen_q, int64_t seqlen_k,
                                  int block_n) {
  return bias_batch * bias_heads * ((seqlen_q + kClassRows - 1) / kClassRows) * ((seqlen_k + block_n - 1) / block_n);
}

// Launches the sort on `stream` (bias in elements: strides sb, sh, sr).
template <class Element>
cudaError_t launch_classify(const void* bias, int64_t sb, int64_t sh, int64_t sr, int bias_batch, int bias_heads,
                            int seqlen_q, int seqlen_k, int block_n, bool causal, int offset, uint8_t* classes,
                            cudaStream_t stream) {
  const int64_t bh = int64_t(bias_batch) * bias_heads;
  const dim3 grid((seqlen_k + block_n - 1) / block_n, (seqlen_q + kClassRows - 1) / kClassRows,
                  static_cast<unsigned>(bh < 65535 ? bh : 65535));
  classify_bias_tiles<Element><<<grid, kClassThreads, 0, stream>>>(
      static_cast<const uint16_t*>(bias), sb, sh, sr, bias_batch, bias_heads, seqlen_q, seqlen_k, block_n, causal,
      offset, classes);
  return cudaGetLastError();
}

}  // namespace gemmgen::fmha_sm90
