// Additive masks (attn_mask) in the fmha_sm90 family's `_bias` instances.
//
// The bias is [batch, head, row, key] in the inputs' 16-bit type (a bool mask arrives as 0 / -inf),
// any of batch, head and row broadcast (stride 0). Read whole, it costs 2 bytes per score: at the
// dense kernel's rate that is about 3 TB/s at d128, more than the L2 gives, and the first masked
// version (every tile's bias read) ran at 0.40x the unmasked call (bench/NOTES.md, experiment 93).
// Masks are mostly constant over whole tiles, though (a causal and padding mask is 0 below the
// diagonal and -inf above it). So where several heads or batch entries share the bias (the
// attention kernel then reads it that many times), two small kernels first sort each (64-row
// group, key tile) into visible (all 0), hidden (all -inf) or mixed, and list for each row tile the
// key tiles some group of it sees, with every group's class. The attention kernel then loads and
// computes the listed key tiles only (a hidden tile costs nothing), reads the bias of mixed tiles
// only, and skips a group's softmax on a tile hidden to it. A bias per (batch, head) is read whole:
// every key tile is mixed.
#pragma once
#include <cstdint>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/numeric_types.h"

namespace gemmgen::fmha_sm90 {

enum TileClass : uint8_t { kVisible = 0, kHidden = 1, kMixed = 2 };

// What a warp needs of its row tile's bias, in a shared-memory slot per warp set by the kernel
// before each row tile (as TileFactors, softmax.h): the bias rows (batch and head applied; [row,
// key] at row * row_stride + key, row_stride 0 for one row that every query shares); the row tile's
// list (NULL: every key tile, all mixed): [listed key tiles, how many of them go unmasked by the
// instance's causal or residual mask, the entries]; and the warp group's place in the row tile.
struct TileBias {
  const void* ptr;
  int64_t row_stride;
  const uint32_t* list;
  int group;
};
__device__ __forceinline__ TileBias& tile_bias() {
  __shared__ TileBias slots[32];  // by the CTA's warp: 1 KB of static shared memory
  return slots[threadIdx.x / 32];
}

// A list entry: the key tile (low 16 bits) and each 64-row group's class of it (2 bits per group
// from bit 16). Unlisted, every key tile is mixed for every group.
__host__ __device__ constexpr uint32_t kAllMixed = 0xaa0000u;  // kMixed (2) for groups 0-3
__device__ __forceinline__ int tile_of(uint32_t entry) { return int(entry & 0xffffu); }
__device__ __forceinline__ int class_of(uint32_t entry, int group) { return int(entry >> (16 + 2 * group)) & 3; }

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

// One thread per (bias batch entry and head, row tile of kGroups 64-row groups): the row tile's list
// (TileBias) from the classes, ascending. `Mask` is the instance's (causal.h or CUTLASS's residual
// fusion): the listed tiles before its first masked one go unmasked, and the tiles it masks are
// listed whatever their classes (their count stays the mask's). A row tile that sees no key and
// has no masked tile lists its first key tile, hidden to every group (the mainloop runs at least
// one; its rows give O = 0 and LSE = -inf). lists: [bias batch][bias head][row tile][key tiles + 2].
template <class Mask, int kGroups, class TileShape, class ProblemShape>
__global__ void list_bias_tiles(const uint8_t* __restrict__ classes, int bias_bh, int row_groups, int key_tiles,
                                ProblemShape ps, uint32_t* __restrict__ lists) {
  const int row_tiles = (row_groups + kGroups - 1) / kGroups;
  const int64_t at = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (at >= int64_t(bias_bh) * row_tiles) return;
  const int bh = int(at / row_tiles), r = int(at - int64_t(bh) * row_tiles);
  const auto blk = cute::make_coord(r, cute::_0{}, cute::make_coord(0, 0));
  const int first_masked = Mask{}.get_unmasked_trip_count(blk, TileShape{}, ps);
  const int trips = Mask{}.get_trip_count(blk, TileShape{}, ps);
  const uint8_t* c = classes + int64_t(bh) * row_groups * key_tiles;
  uint32_t* list = lists + at * (key_tiles + 2);
  int listed = 0, unmasked = 0;
  for (int t = 0; t < key_tiles; ++t) {
    uint32_t entry = uint32_t(t);
    bool seen = false;
    for (int g = 0; g < kGroups; ++g) {
      const int group = r * kGroups + g;
      const int cls = group < row_groups ? c[int64_t(group) * key_tiles + t] : kHidden;
      entry |= uint32_t(cls) << (16 + 2 * g);
      seen = seen || cls != kHidden;
    }
    if (seen || (t >= first_masked && t < trips)) {
      list[2 + listed++] = entry;
      unmasked += t < first_masked;
    }
  }
  if (listed == 0) {
    uint32_t entry = 0;
    for (int g = 0; g < kGroups; ++g) entry |= uint32_t(kHidden) << (16 + 2 * g);
    list[2] = entry;
    listed = 1;
    unmasked = 0 < first_masked;
  }
  list[0] = uint32_t(listed);
  list[1] = uint32_t(unmasked);
}

// The workspace of a sorted bias: the classes ([bias batch][bias head][row groups][key tiles]
// bytes, rounded up to 16), then the lists (uint32).
struct BiasSortLayout {
  int64_t bias_bh, row_groups, row_tiles, key_tiles;
  int64_t classes_bytes() const { return (bias_bh * row_groups * key_tiles + 15) / 16 * 16; }
  int64_t list_stride() const { return key_tiles + 2; }
  int64_t bytes() const { return classes_bytes() + 4 * bias_bh * row_tiles * list_stride(); }
};
inline BiasSortLayout bias_sort_layout(int64_t bias_bh, int64_t seqlen_q, int64_t seqlen_k, int block_m, int block_n) {
  const int64_t groups = (seqlen_q + kClassRows - 1) / kClassRows, per_tile = block_m / kClassRows;
  return BiasSortLayout{bias_bh, groups, (groups + per_tile - 1) / per_tile, (seqlen_k + block_n - 1) / block_n};
}

// Launches the sort and the lists on `stream` (bias in elements: strides sb, sh, sr) into
// `workspace` (bias_sort_layout's bytes); `ps` the kernel's problem (batch, heads, seqlen_q, keys
// read, d).
template <class Element, class Mask, int kGroups, class TileShape, class ProblemShape>
cudaError_t launch_sort(const void* bias, int64_t sb, int64_t sh, int64_t sr, int bias_batch, int bias_heads,
                        ProblemShape const& ps, bool causal, uint8_t* workspace, cudaStream_t stream) {
  constexpr int kBlockN = cute::size<1>(TileShape{});
  const int seqlen_q = cute::get<2>(ps), seqlen_k = cute::get<3>(ps);
  const BiasSortLayout layout = bias_sort_layout(int64_t(bias_batch) * bias_heads, seqlen_q, seqlen_k,
                                                 kGroups * kClassRows, kBlockN);
  const dim3 grid(static_cast<unsigned>(layout.key_tiles), static_cast<unsigned>(layout.row_groups),
                  static_cast<unsigned>(layout.bias_bh < 65535 ? layout.bias_bh : 65535));
  classify_bias_tiles<Element><<<grid, kClassThreads, 0, stream>>>(
      static_cast<const uint16_t*>(bias), sb, sh, sr, bias_batch, bias_heads, seqlen_q, seqlen_k, kBlockN, causal,
      seqlen_k - seqlen_q, workspace);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  const int64_t threads = layout.bias_bh * layout.row_tiles;
  list_bias_tiles<Mask, kGroups, TileShape><<<static_cast<unsigned>((threads + 127) / 128), 128, 0, stream>>>(
      workspace, static_cast<int>(layout.bias_bh), static_cast<int>(layout.row_groups),
      static_cast<int>(layout.key_tiles), ps, reinterpret_cast<uint32_t*>(workspace + layout.classes_bytes()));
  return cudaGetLastError();
}

}  // namespace gemmgen::fmha_sm90
