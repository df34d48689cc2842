// Host side of the fmha_bwd_sm90 family: CUTLASS's Hopper FMHA backward mainloop (example 88 of the
// CUTLASS source tree, included from the installed package), driven through gemmgen's C ABI
// (GemmgenAttnBwdParams, templates/include/gemmgen/abi.h).
//
// One call runs three steps on the caller's stream:
//   1. prep (ours): D_i = sum_d O[i, d] * dO[i, d] in fp32, and the forward's LSE copied into the
//      workspace with a row stride padded to kRowPad floats (the mainloop reads both with TMA, whose
//      strides must be multiples of 16 bytes; the caller's LSE is [B, H, Nq] contiguous, so its head
//      stride Nq * 4 bytes need not be). dQ's fp32 accumulator is zeroed (cudaMemsetAsync).
//   2. CUTLASS's warp-specialized backward kernel (FmhaKernelTmaWarpSpecialized over
//      FmhaBwdMainloopTmaWarpSpecialized): one CTA per block_n keys of one (batch, head), looping
//      over the queries block_m at a time; it writes dK and dV (TMA stores in the element type) and
//      adds dQ into the fp32 accumulator with TMA reductions (atomic adds across CTAs: the order of
//      the additions depends on scheduling; deterministic calls to split-dQ instances take turns
//      per query tile in key-tile order (split_dq.h's reduce), other instances refuse them).
//   3. convert (ours): the fp32 dQ accumulator into dQ by its strides.
//
// The LSE convention: the mainloop computes P = exp2(scale_log2 * S - log2(e) * LSE), that is
// exp(scale * S - LSE) with LSE the natural-log logsumexp of scale * Q K^T, which is the ABI's LSE;
// it is copied unchanged. The scale: CUTLASS derives 1/sqrt(d) itself; the params are patched after
// they are built with the caller's scale (scale_softmax multiplies dS, so dQ and dK carry it and dV
// does not). A scale of 0 runs as the smallest normal float (see run()).
//
// The mask: keys past seqlen_k are masked in every key tile (TMA fills them with zeros, and
// exp(0 - LSE) can overflow the element type that dS is kept in), and the partial last query tile's
// rows past seqlen_q load Q, dO, LSE and D as zeros, so they add nothing. The split-dQ mainloop
// (`_sq`) takes band.h's band as a launch parameter: causal with any causal_offset (both
// alignments) and, in local instances, a sliding window. Example 88's mainloop (head dim 32) takes
// BwdMask below, ours rather than example 88's FusionBwdAdapter: no mask, or causal top-left (key j
// visible to query i iff j <= i, causal_offset 0). A query row that sees no key (its forward LSE
// -inf) has P = 0 everywhere: prep stores its LSE as +inf. Softcap instances (split-dQ only) take
// the forward's logit softcap c: P = exp(c tanh(scale S / c) - LSE) and dS gains the factor
// 1 - tanh^2 (split_dq.h).
//
// Additive masks: `_bias` instances (split-dQ, no softcap or window, fixed lengths) take the
// forward's bias (no dbias) and add it to the recomputed scores; a bias that several heads or batch
// entries share is first sorted into visible, hidden and mixed tiles (fmha_sm90/bias.h's sort, into
// the workspace after its other parts), split_dq.h reads the mixed tiles' bias only, and each key
// tile's CTA runs the query tiles from the first to the last it does not see hidden only.
//
// GQA: split-dQ instances (GEMMGEN_INFO_READS_GQA) take K and V at their own heads, heads_kv dividing
// heads: the load warp reads query head h's K and V at head h / group, and dK and dV are written per
// query head (dk and dv have `heads` heads), which the caller sums over each group. Example 88's
// loop takes K and V expanded to the query heads.
#pragma once
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>

#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/bfloat16.h"
#include "cutlass/cutlass.h"
#include "cutlass/device_kernel.h"
#include "cutlass/kernel_hardware_info.h"

// bf16: example 88's backward mainloop writes its dS fragment, made by
// make_fragment_like<Element>(acc_DP) from the fp32 dP accumulator, with `acc_DS(i) = <float>`.
// cutlass::half_t takes that (the float converts implicitly through __half); cutlass::bfloat16_t does
// not (its constructors from float are explicit). For Element = bfloat16_t this overload, declared
// before the mainloop so that its lookup finds it, makes that one fragment of Bf16FromFloat: the
// same 16 bits, with an assignment from float that rounds to nearest even like bfloat16_t(float).
// No other fragment of a backward translation unit is made this way from an fp32 register tensor.
namespace gemmgen::fmha_bwd_sm90 {
struct Bf16FromFloat : cutlass::bfloat16_t {
  Bf16FromFloat() = default;
  CUTLASS_HOST_DEVICE Bf16FromFloat& operator=(float x) {
    cutlass::bfloat16_t::operator=(cutlass::bfloat16_t(x));
    return *this;
  }
};
static_assert(sizeof(Bf16FromFloat) == 2 && alignof(Bf16FromFloat) == 2, "a bf16 in 16 bits");
}  // namespace gemmgen::fmha_bwd_sm90

namespace cute {
template <class NewT, size_t N, class Layout, __CUTE_REQUIRES(cute::is_same_v<NewT, cutlass::bfloat16_t>)>
CUTE_HOST_DEVICE constexpr auto make_fragment_like(Tensor<ArrayEngine<float, N>, Layout> const& tensor) {
  return make_fragment_like<gemmgen::fmha_bwd_sm90::Bf16FromFloat>(tensor.layout());
}
}  // namespace cute

#include "88_hopper_fmha/collective/fmha_collective_bwd_tma_warpspecialized.hpp"
#include "88_hopper_fmha/collective/fmha_epilogue_bwd.hpp"
#include "88_hopper_fmha/kernel/fmha_kernel_tma_warpspecialized.hpp"
#include "88_hopper_fmha/kernel/fmha_tile_scheduler.hpp"

#include "gemmgen/abi.h"
#include "gemmgen/fmha_bwd_sm90/band.h"
#include "gemmgen/fmha_bwd_sm90/split_dq.h"
#include "gemmgen/fmha_bwd_sm90/tile_order.h"
#include "gemmgen/fmha_sm90/bias.h"
#include "gemmgen/fmha_sm90/cutlass_launch.h"
#include "gemmgen/report.h"
#include "gemmgen/smem.h"

namespace gemmgen::fmha_bwd_sm90 {

using namespace cute;

// Example 88's mainloop's Fusion (the instances without `_sq`): which query tiles a CTA visits and
// which scores it masks. The mainloop calls it with blk_coord = (query tile, key tile of the CTA,
// ...), the tile shape (block_m queries, block_n keys, head_dim) and problem (B, H, Nq, Nk, D); in
// before_softmax each index is (key, query), the scores being K Q^T.
template <bool Causal>
struct BwdMask {
  template <class BlkCoord, class TileShape, class ProblemSize>
  CUTLASS_DEVICE int get_trip_count(BlkCoord const&, TileShape const& tile, ProblemSize const& problem) {
    return ceil_div(int(get<2>(problem)), int(get<0>(tile)));
  }

  template <class AccQK, class IndexQK, class ProblemSize>
  CUTLASS_DEVICE void before_softmax(AccQK& acc, IndexQK const& index, ProblemSize const& problem) {
    const int seqlen_k = get<3>(problem);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(acc); ++i) {
      auto pos = index(i);
      const int key = get<0>(pos);
      const int query = get<1>(pos);
      if (key >= seqlen_k || (Causal && key > query)) acc(i) = -INFINITY;
    }
  }

  // Whether the CTA runs query tile get<0>(c) against its key tile get<1>(c). Causal: when the
  // tile's last query row reaches the key tile's first key; the tiles that do not come first in
  // the loop, and the load warp, the math warp groups and the dQ reducer all skip them by this same
  // test. The last query tile always runs: a CTA that skipped every tile would hang in the
  // mainloop (its dQ reducer releases a pipeline stage it never received, after which the math warp
  // groups' producer_tail waits on a barrier phase that never completes). Where it sees none of the
  // keys (key tiles past the last query, seqlen_q < seqlen_k) the mask zeroes its P and dS, so it
  // adds nothing, and the CTA writes zero dK and dV.
  template <class BlkCoord, class TileShape, class ProblemSize>
  CUTLASS_DEVICE bool is_contributing(BlkCoord const& c, TileShape const& tile, ProblemSize const& problem) {
    if constexpr (!Causal) {
      return true;
    } else {
      const int q_tile = get<0>(c);
      return q_tile + 1 >= get_trip_count(c, tile, problem) ||
             (q_tile + 1) * int(get<0>(tile)) - 1 >= int(get<1>(c)) * int(get<1>(tile));
    }
  }
};

// SplitDq: split_dq.h's mainloop (dQ computed half by each math warp group, the mask a band given
// at launch), else example 88's (no mask or causal top-left, kLocal not available).
template <class Element_, int BlockM, int BlockN, int HeadDim, BandKind Kind, bool SplitDq = false,
          bool Softcap = false, bool Bias = false, bool Dropout = false>
struct Config {
  static_assert(SplitDq || Kind != BandKind::kLocal, "the local mask runs on the split-dQ mainloop");
  static_assert(SplitDq || !Softcap, "a softcap runs on the split-dQ mainloop");
  static_assert(!Bias || (SplitDq && !Softcap && Kind != BandKind::kLocal),
                "a bias runs on the split-dQ mainloop, without a softcap or a window");
  static_assert(!Dropout || (SplitDq && !Softcap && !Bias && Kind != BandKind::kLocal),
                "dropout runs on the split-dQ mainloop, without a softcap, bias or window");
  static constexpr bool Causal = Kind == BandKind::kCausal;
  using Element = Element_;
  // (queries per step, keys per CTA, head dim): example 88's TileShape order. Two math warp groups
  // take block_n / 2 keys each.
  using TileShape = Shape<Int<BlockM>, Int<BlockN>, Int<HeadDim>>;
  using Mainloop = std::conditional_t<
      SplitDq, SplitDqMainloop<Element, TileShape, Kind, Softcap, false, Bias, Dropout>,
      cutlass::fmha::collective::FmhaBwdMainloopTmaWarpSpecialized<Element, float, TileShape, BwdMask<Causal>>>;
  using Epilogue = cutlass::fmha::collective::FmhaBwdEpilogueKV<Element, float, typename Mainloop::TileShapePV>;
  using Scheduler = cutlass::fmha::kernel::TileSchedulerBwdAdapter<std::conditional_t<
      Causal, gemmgen::fmha_bwd_sm90::CausalKeyTileOrder, cutlass::fmha::kernel::IndividualTileScheduler>>;
  using Kernel = cutlass::fmha::kernel::FmhaKernelTmaWarpSpecialized<Mainloop, Epilogue, Scheduler>;
  // Packed sequences (split-dQ instances without a bias or dropout): the same kernel with
  // split_dq.h's kPacked mainloop.
  using PackedKernel = std::conditional_t<
      SplitDq && !Bias && !Dropout,
      cutlass::fmha::kernel::FmhaKernelTmaWarpSpecialized<SplitDqMainloop<Element, TileShape, Kind, Softcap, true>,
                                                          Epilogue, Scheduler>,
      void>;
  static constexpr int kHeadDim = HeadDim;
  static constexpr int kBlockM = BlockM;
  static constexpr int kBlockN = BlockN;
  static constexpr bool kCausal = Causal;
  static constexpr bool kLocal = Kind == BandKind::kLocal;
  static constexpr bool kBand = SplitDq;  // the mask's band is a launch parameter
  static constexpr BandKind kKind = Kind;
  static constexpr bool kSoftcap = Softcap;
  static constexpr bool kBias = Bias;  // the forward's additive mask (no dbias)
  static constexpr bool kDropout = Dropout;  // the forward's dropout (its mask drawn again)
};

constexpr int64_t kInt32Max = 2147483647;
constexpr int64_t kMaxGridYZ = 65535;

template <class K>
struct KernelTag {  // a kernel type passed as a value (run()'s choice of kernel)
  using type = K;
};
constexpr int64_t kRowPad = 8;          // LSE and D rows in the workspace: Nq rounded up to this
constexpr int64_t kWorkspaceAlign = 256;
constexpr int kVec = 8;                 // elements per 16-byte access (fp16/bf16)

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Heads per launch of a causal instance (tile_order.h: within a launch and batch entry, every head's
// key tile 0 starts first, then key tile 1, and so on). All of them where their Q, dO and dQ
// accumulator (8 * seqlen_q * d bytes per head) take at most twice L2 (NOTES 67: 64 MB of them
// over a 50 MB L2 ran faster, 256 MB slower than the heads one after another); else as many as
// that holds, at least enough that a launch's work spread over the SMs covers its longest CTA
// (2 * SMs / key tiles heads), in launches of equal size.
inline int64_t causal_heads_per_launch(int64_t heads, int64_t nq, int64_t d, int64_t key_tiles, int device) {
  int l2 = 0, sms = 0;
  if (cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return heads;
  }
  const int64_t per_head = 8 * nq * d;
  if (heads * per_head <= 2 * int64_t(l2)) return heads;
  const int64_t fit = std::max<int64_t>(1, 2 * int64_t(l2) / per_head);
  const int64_t want = (2 * int64_t(sms) + key_tiles - 1) / key_tiles;
  const int64_t most = std::min(heads, std::max(fit, want));
  const int64_t launches = (heads + most - 1) / most;
  return (heads + launches - 1) / launches;
}

// The workspace, in order: the LSE copy and D ([B, H, round_up(Nq, kRowPad)] fp32 each), dQ's
// accumulator ([B, H, Nq, d] fp32, dense), then for split-dQ instances the deterministic turn
// counters ([B, H, query tiles] int32); each part starts kWorkspaceAlign-aligned. The accumulator
// and the counters are cleared together.
struct WorkspaceLayout {
  int64_t rows_padded = 0;
  int64_t lse_offset = 0, sum_offset = 0, dq_offset = 0, dq_bytes = 0, turns_offset = 0, total = 0;
};

inline WorkspaceLayout workspace_layout(int64_t b, int64_t h, int64_t nq, int64_t d, int64_t query_tiles) {
  WorkspaceLayout w;
  w.rows_padded = round_up(nq, kRowPad);
  const int64_t vec_bytes = round_up(b * h * w.rows_padded * 4, kWorkspaceAlign);
  w.lse_offset = 0;
  w.sum_offset = vec_bytes;
  w.dq_offset = 2 * vec_bytes;
  w.dq_bytes = b * h * nq * d * 4;
  w.turns_offset = w.dq_offset + round_up(w.dq_bytes, kWorkspaceAlign);
  w.total = w.turns_offset + round_up(b * h * query_tiles * 4, kWorkspaceAlign);
  return w;
}

// Bias instances: the classes of a bias that several heads or batch entries share (split_dq.h; the
// forward's sort, fmha_sm90/bias.h), one byte per (bias batch entry and head, 64-query group,
// 64-key tile), after the other parts of the workspace. None (0 bytes) for a bias per (batch, head).
// Then the range of query tiles of each CTA key tile (bias_query_ranges): an int2 per (bias batch
// entry and head, key tile of block_n keys).
struct BiasClasses {
  int64_t batch = 0, heads = 0, groups = 0, tiles = 0, key_tiles = 0;
  int64_t class_bytes() const { return round_up(batch * heads * groups * tiles, kWorkspaceAlign); }
  int64_t bytes() const { return class_bytes() + round_up(batch * heads * key_tiles * 8, kWorkspaceAlign); }
};

template <class Cfg>
BiasClasses bias_classes(const GemmgenAttnBwdParams* p) {
  BiasClasses c;
  if (!Cfg::kBias || p->bias == nullptr || p->cu_seqlens_q != nullptr ||
      !fmha_sm90::classifies(p->batch, p->heads, p->bias_batch_stride, p->bias_head_stride)) {
    return c;
  }
  c.batch = p->bias_batch_stride == 0 ? 1 : p->batch;
  c.heads = p->bias_head_stride == 0 ? 1 : p->heads;
  c.groups = (int64_t(p->seqlen_q) + fmha_sm90::kClassRows - 1) / fmha_sm90::kClassRows;
  c.tiles = (int64_t(p->seqlen_k) + fmha_sm90::kClassRows - 1) / fmha_sm90::kClassRows;
  c.key_tiles = (int64_t(p->seqlen_k) + Cfg::kBlockN - 1) / Cfg::kBlockN;
  return c;
}

// One thread per (bias batch entry and head, key tile of block_n keys): the first and last query
// tile (block_m queries, whole 64-query class groups) with a class other than hidden for some
// 64-key class tile of the key tile; first > last where there is none. classes as the sort writes
// them ([bias entry][group][class tile]).
template <int kBlockM, int kBlockN>
__global__ void bias_query_ranges(const uint8_t* __restrict__ classes, int64_t entries, int groups, int tiles,
                                  int key_tiles, int2* __restrict__ ranges) {
  constexpr int kGroupsPerTile = kBlockM / fmha_sm90::kClassRows, kTilesPerKeyTile = kBlockN / fmha_sm90::kClassRows;
  const int64_t at = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (at >= entries * key_tiles) return;
  const int64_t entry = at / key_tiles;
  const int key_tile = int(at - entry * key_tiles);
  const uint8_t* c = classes + entry * groups * tiles;
  int first = 1 << 30, last = -1;
  for (int g = 0; g < groups; ++g) {
    bool seen = false;
    for (int t = key_tile * kTilesPerKeyTile; t < (key_tile + 1) * kTilesPerKeyTile && t < tiles; ++t) {
      seen = seen || c[int64_t(g) * tiles + t] != fmha_sm90::kHidden;
    }
    if (seen) {
      first = min(first, g / kGroupsPerTile);
      last = g / kGroupsPerTile;
    }
  }
  ranges[at] = make_int2(first, last);
}

// Query tiles a split-dQ instance counts turns for (none for example 88's loop).
template <class Cfg>
int64_t turn_tiles(int64_t nq) {
  return Cfg::kBand ? (nq + Cfg::kBlockM - 1) / Cfg::kBlockM : 0;
}

// Deterministic packed calls: each (head, query tile) turn counter starts at the first key tile that
// runs the query tile (band.h's packed_first_key_tile), whose CTA adds first. One thread per query
// tile; every head has the same sequences and band.
template <int kBlockM, int kBlockN>
__global__ void packed_turns_kernel(int* turns, int64_t heads, int query_tiles, int key_tiles, Packed packed,
                                    Band band, int total_k) {
  const int t = int(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= query_tiles) return;
  const int first = packed_first_key_tile(packed, band, t, kBlockM, kBlockN, key_tiles, total_k);
  for (int64_t hh = 0; hh < heads; ++hh) turns[hh * query_tiles + t] = first;
}

// Step 1: D and the LSE copy. kLanes threads share a row (kVec elements each); rows in a grid-stride
// loop. Row r is (batch r / (H Nq), head r / Nq % H, query r % Nq).
// Packed sequences (packed.cu_q set; one batch entry of nq = total_q rows): the forward's LSE is
// [sequences, H, lse_rows] (lse_rows = max_seqlen_q), gathered here into the packed rows.
template <class Element, int HeadDim>
__global__ void __launch_bounds__(128) prep_kernel(const Element* o, int64_t o_sb, int64_t o_sh, int64_t o_sr,
                                                   const Element* d_o, int64_t do_sb, int64_t do_sh, int64_t do_sr,
                                                   const float* lse, float* lse_ws, float* sum_ws, int64_t heads,
                                                   int64_t nq, int64_t rows_padded, int64_t rows, Packed packed,
                                                   int64_t lse_rows) {
  constexpr int kLanes = HeadDim / kVec;
  static_assert(kLanes >= 1 && kLanes <= 32 && (kLanes & (kLanes - 1)) == 0, "head_dim / 8 must be a power of 2");
  constexpr int kRowsPerBlock = 128 / kLanes;
  const int lane = threadIdx.x % kLanes;
  // The loop's bounds are the block's, so every thread of a warp runs each shuffle below.
  for (int64_t r0 = int64_t(blockIdx.x) * kRowsPerBlock; r0 < rows; r0 += int64_t(gridDim.x) * kRowsPerBlock) {
    const int64_t r = r0 + threadIdx.x / kLanes;
    const bool active = r < rows;
    const int64_t i = r % nq;
    const int64_t bh = r / nq;
    const int64_t hh = bh % heads;
    const int64_t bb = bh / heads;
    float acc = 0.f;
    if (active) {
      Element vo[kVec], vd[kVec];
      *reinterpret_cast<uint4*>(vo) =
          *reinterpret_cast<const uint4*>(o + bb * o_sb + hh * o_sh + i * o_sr + lane * kVec);
      *reinterpret_cast<uint4*>(vd) =
          *reinterpret_cast<const uint4*>(d_o + bb * do_sb + hh * do_sh + i * do_sr + lane * kVec);
      CUTLASS_PRAGMA_UNROLL
      for (int e = 0; e < kVec; ++e) acc += float(vo[e]) * float(vd[e]);
    }
    CUTLASS_PRAGMA_UNROLL
    for (int s = 1; s < kLanes; s *= 2) acc += __shfl_xor_sync(0xffffffffu, acc, s, kLanes);
    if (active && lane == 0) {
      int64_t at = bh * nq + i;
      if (packed.cu_q != nullptr) {  // row i of sequence b (the last starting at or before it), head hh
        int lo = 0, hi = packed.batch - 1;
        while (lo < hi) {
          const int mid = (lo + hi + 1) / 2;
          if (packed.cu_q[mid] <= i) lo = mid; else hi = mid - 1;
        }
        at = (int64_t(lo) * heads + hh) * lse_rows + (i - packed.cu_q[lo]);
      }
      const float l = lse[at];
      sum_ws[bh * rows_padded + i] = acc;
      lse_ws[bh * rows_padded + i] = l == -INFINITY ? INFINITY : l;  // a row without keys: P = 0
    }
  }
}

// Step 3: dQ's fp32 accumulator (dense [B, H, Nq, d]) into dQ by its strides, kVec elements a thread.
template <class Element, int HeadDim>
__global__ void __launch_bounds__(256) convert_kernel(const float* acc, Element* dq, int64_t sb, int64_t sh,
                                                      int64_t sr, int64_t heads, int64_t nq, int64_t vectors) {
  constexpr int kPerRow = HeadDim / kVec;
  for (int64_t v = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; v < vectors; v += int64_t(gridDim.x) * blockDim.x) {
    const int64_t col = (v % kPerRow) * kVec;
    const int64_t r = v / kPerRow;
    const int64_t i = r % nq;
    const int64_t bh = r / nq;
    const float4 lo = reinterpret_cast<const float4*>(acc)[2 * v];
    const float4 hi = reinterpret_cast<const float4*>(acc)[2 * v + 1];
    const float f[kVec] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    Element out[kVec];
    CUTLASS_PRAGMA_UNROLL
    for (int e = 0; e < kVec; ++e) out[e] = Element(f[e]);
    *reinterpret_cast<uint4*>(dq + (bh / heads) * sb + (bh % heads) * sh + i * sr + col) =
        *reinterpret_cast<const uint4*>(out);
  }
}

// Largest element offset a [b, h, n, d] view with these strides reaches (+1), for sizes in
// [1, 2^31) and strides in [0, 2^63): past kInt32Max it is kInt32Max + 1 (no product overflows).
inline int64_t extent(int64_t b, int64_t h, int64_t n, int64_t d, int64_t sb, int64_t sh, int64_t sn) {
  int64_t sum = d;
  const int64_t sizes[] = {b, h, n}, strides[] = {sb, sh, sn};
  for (int i = 0; i < 3; ++i) {
    if (sizes[i] > 1 && strides[i] > kInt32Max / (sizes[i] - 1)) return kInt32Max + 1;
    sum += (sizes[i] - 1) * strides[i];
  }
  return sum > kInt32Max ? kInt32Max + 1 : sum;
}

// A tensor of the call as the kernels see it. The stride of a dim of extent 1 is never used: where
// it would fail the TMA's rules (a multiple of 16 bytes, in int32) it is taken as 0, so that such a
// view (a torch size-1 dim of any stride) runs.
struct View {
  const char* name;
  const void* ptr;
  int64_t sb, sh, sr;
  int64_t n;      // rows
  int64_t heads;  // heads_kv for K and V, else heads
};

inline bool sizes_ok(const GemmgenAttnBwdParams* p) {
  return p->batch >= 1 && p->heads >= 1 && p->heads_kv >= 1 && p->seqlen_q >= 1 && p->seqlen_k >= 1 &&
         p->head_dim >= 1;
}

template <class Cfg>
int64_t workspace(const GemmgenAttnBwdParams* p) {
  if (p == nullptr || !sizes_ok(p) || p->head_dim != Cfg::kHeadDim) return 0;
  const bool packed = p->cu_seqlens_q != nullptr;
  const int64_t b = packed ? 1 : p->batch, h = p->heads, nq = packed ? p->total_q : p->seqlen_q;
  if (nq < 1) return 0;
  // run() refuses calls whose dQ accumulator passes int32 offsets; no workspace is needed for them.
  if (b * h > kInt32Max || b * h * nq > kInt32Max / Cfg::kHeadDim) return 0;
  return workspace_layout(b, h, nq, Cfg::kHeadDim, turn_tiles<Cfg>(nq)).total + bias_classes<Cfg>(p).bytes();
}

template <class Cfg>
int run(const GemmgenAttnBwdParams* p, cudaStream_t stream, char* err, int err_len) {
  using Element = typename Cfg::Element;
  using Kernel = typename Cfg::Kernel;
  constexpr int D = Cfg::kHeadDim;
  if (p == nullptr) return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "params is NULL");
  if (p->head_dim != D) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "head_dim %d, this instance runs %d", p->head_dim, D);
  }
  if (!sizes_ok(p)) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  "bad sizes: batch %d heads %d heads_kv %d seqlen_q %d seqlen_k %d", p->batch, p->heads,
                  p->heads_kv, p->seqlen_q, p->seqlen_k);
  }
  if (p->heads_kv != p->heads && (!Cfg::kBand || p->heads % p->heads_kv != 0 || p->heads_kv > p->heads)) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  Cfg::kBand ? "heads_kv %d must divide heads %d"
                             : "heads_kv %d != heads %d: this instance runs expanded K and V (one K/V head per query "
                               "head)",
                  p->heads_kv, p->heads);
  }
  if (p->heads / p->heads_kv > kMaxGridYZ) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  "heads / heads_kv %d: at most %lld query heads per key/value head", p->heads / p->heads_kv,
                  static_cast<long long>(kMaxGridYZ));
  }
  if (p->dbias != nullptr) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "this family runs no dbias");
  }
  if (Cfg::kDropout ? !(p->dropout_p > 0.f && p->dropout_p < 1.f) : p->dropout_p != 0.f) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  Cfg::kDropout ? "dropout_p %g: this instance runs the backward of dropout in (0, 1)"
                                : "dropout_p %g: this instance runs no dropout (a `_dropout` one does)", p->dropout_p);
  }
  if (Cfg::kDropout && (int64_t(p->seqlen_q) * p->seqlen_k > kInt32Max || p->cu_seqlens_q != nullptr ||
                        p->cu_seqlens_k != nullptr)) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  "dropout: fixed lengths with seqlen_q * seqlen_k below 2^31 (the mask's positions are 32-bit)");
  }
  if ((p->bias != nullptr) != Cfg::kBias) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  Cfg::kBias ? "this instance runs calls with a bias only (bias is NULL)"
                             : "bias is set: this instance runs no additive mask (one built for it does, `_bias`)");
  }
  // Packed sequences (split-dQ instances): one batch entry over the packed tensors, each key masked to
  // its own sequence's rows (band.h's Packed).
  const bool packed = p->cu_seqlens_q != nullptr || p->cu_seqlens_k != nullptr;
  if (Cfg::kBias && (reinterpret_cast<uintptr_t>(p->bias) % 16 != 0 || p->bias_batch_stride < 0 ||
                     p->bias_head_stride < 0 || p->bias_row_stride < 0 || p->bias_batch_stride % kVec != 0 ||
                     p->bias_head_stride % kVec != 0 || p->bias_row_stride % kVec != 0)) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  "bias: a 16-byte aligned pointer and non-negative strides that are multiples of %d elements", kVec);
  }
  if (packed) {
    if (Cfg::kBias) {
      return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "variable lengths: this instance runs a bias at fixed lengths only");
    }
    if (!Cfg::kBand) {
      return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                    "variable lengths: this instance runs none (the split-dQ instances do)");
    }
    if (p->cu_seqlens_q == nullptr || p->cu_seqlens_k == nullptr) {
      return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "variable lengths need both cu_seqlens_q and cu_seqlens_k");
    }
    if (p->total_q < 1 || p->total_k < 1 || p->total_q > kInt32Max || p->total_k > kInt32Max) {
      return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                    "variable lengths: total_q %lld, total_k %lld (the packed tensors' rows, in [1, 2^31))",
                    static_cast<long long>(p->total_q), static_cast<long long>(p->total_k));
    }
    if (Cfg::kKind != BandKind::kNone && p->causal_offset != 0) {
      return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                    "variable lengths: the diagonal is top-left (causal_offset 0) or bottom-right per sequence "
                    "(align_per_sequence), got causal_offset %d", p->causal_offset);
    }
  } else if (p->align_per_sequence != 0) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  "align_per_sequence aligns the sequences of variable lengths: cu_seqlens are NULL");
  }
  if (p->deterministic != 0 && !Cfg::kBand) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  "deterministic: this instance adds dQ up with atomic TMA reductions across key tiles (its "
                  "split-dQ instances run deterministic calls)");
  }
  if (!(p->scale >= 0.f) || std::isinf(p->scale)) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "scale %g: this family runs finite scales >= 0",
                  p->scale);
  }
  if (Cfg::kCausal && !Cfg::kBand && p->causal_offset != 0) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  "causal_offset %d: this instance's causal mask is top-left (offset 0; bottom-right only "
                  "where seqlen_q == seqlen_k)", p->causal_offset);
  }
  if (Cfg::kSoftcap ? !(p->softcap > 0.f && p->softcap < INFINITY) : p->softcap != 0.f) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  Cfg::kSoftcap ? "softcap %g: this instance runs the backward of a finite logit softcap > 0"
                                : "softcap %g: this instance runs no logit softcap (one built for it does)",
                  p->softcap);
  }
  if ((p->local != 0) != Cfg::kLocal) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  Cfg::kLocal ? "this instance runs a sliding window only (local is 0)"
                              : "local is set: this instance runs no sliding window");
  }
  const int64_t b = packed ? 1 : p->batch, h = p->heads, hkv = p->heads_kv;
  const int64_t nq = packed ? p->total_q : p->seqlen_q, nk = packed ? p->total_k : p->seqlen_k;
  const int64_t group = h / hkv;  // query heads per key/value head (split-dQ instances read GQA)
  auto norm = [](int64_t extent, int64_t stride) {
    return extent == 1 && (stride < 0 || stride > kInt32Max || stride % kVec != 0) ? int64_t(0) : stride;
  };
  const View views[] = {
      {"q", p->q, p->q_batch_stride, p->q_head_stride, p->q_row_stride, nq, h},
      {"k", p->k, p->k_batch_stride, p->k_head_stride, p->k_row_stride, nk, hkv},
      {"v", p->v, p->v_batch_stride, p->v_head_stride, p->v_row_stride, nk, hkv},
      {"o", p->o, p->o_batch_stride, p->o_head_stride, p->o_row_stride, nq, h},
      {"d_o", p->d_o, p->do_batch_stride, p->do_head_stride, p->do_row_stride, nq, h},
      {"dq", p->dq, p->dq_batch_stride, p->dq_head_stride, p->dq_row_stride, nq, h},
      {"dk", p->dk, p->dk_batch_stride, p->dk_head_stride, p->dk_row_stride, nk, h},
      {"dv", p->dv, p->dv_batch_stride, p->dv_head_stride, p->dv_row_stride, nk, h}};
  View v[8];
  for (int t = 0; t < 8; ++t) {
    v[t] = views[t];
    v[t].sb = norm(b, v[t].sb);
    v[t].sh = norm(v[t].heads, v[t].sh);
    v[t].sr = norm(v[t].n, v[t].sr);
    // MQA: K's and V's TMA descriptors span `heads` heads (the problem's) and are read at head 0
    // only; a stride of 0 becomes 16 bytes, which TMA takes whatever the extent.
    if (v[t].heads == 1 && h > 1 && v[t].sh == 0) v[t].sh = kVec;
    if (v[t].ptr == nullptr) {
      return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "%s is NULL", v[t].name);
    }
    if (v[t].sb < 0 || v[t].sh < 0 || v[t].sr < 0) {
      return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "%s: negative strides", v[t].name);
    }
    // TMA (and our 16-byte accesses): 16-byte aligned base, strides multiples of 16 bytes.
    if (reinterpret_cast<uintptr_t>(v[t].ptr) % 16 != 0 || v[t].sb % kVec != 0 || v[t].sh % kVec != 0 ||
        v[t].sr % kVec != 0) {
      return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                    "%s: this family needs a 16-byte aligned pointer and strides that are multiples of %d "
                    "elements (got %p, strides %lld %lld %lld)", v[t].name, kVec, v[t].ptr,
                    static_cast<long long>(v[t].sb), static_cast<long long>(v[t].sh),
                    static_cast<long long>(v[t].sr));
    }
    const int64_t reach = extent(b, v[t].heads, v[t].n, D, v[t].sb, v[t].sh, v[t].sr);
    if (reach > kInt32Max) {
      return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                    "%s: element offsets pass int32 (this family indexes with int32)", v[t].name);
    }
  }
  if (b * h > kInt32Max || b * h * nq > kInt32Max / D) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  "batch * heads * seqlen_q * head_dim passes int32 (dQ's fp32 accumulator indexes with int32)");
  }
  if (p->lse == nullptr || reinterpret_cast<uintptr_t>(p->lse) % alignof(float) != 0) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "lse must be a 4-byte aligned float32 buffer");
  }
  const int64_t query_tiles = turn_tiles<Cfg>(nq);
  const WorkspaceLayout ws = workspace_layout(b, h, nq, D, query_tiles);
  const BiasClasses classes = bias_classes<Cfg>(p);
  if (p->workspace == nullptr || reinterpret_cast<uintptr_t>(p->workspace) % kWorkspaceAlign != 0 ||
      p->workspace_bytes < ws.total + classes.bytes()) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  "workspace: %lld bytes, %lld-byte aligned, needed (got %p, %lld bytes)",
                  static_cast<long long>(ws.total + classes.bytes()), static_cast<long long>(kWorkspaceAlign),
                  p->workspace, static_cast<long long>(p->workspace_bytes));
  }

  if (Cfg::kCausal && (nk + Cfg::kBlockN - 1) / Cfg::kBlockN > kMaxGridYZ) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  "seqlen_k %lld: this family's causal grid takes at most %lld key tiles of %d keys",
                  static_cast<long long>(nk), static_cast<long long>(kMaxGridYZ), Cfg::kBlockN);
  }

  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  auto cuda_failed = [&](const char* what) {
    return report(err, err_len, GEMMGEN_CUDA_ERROR, "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
  };
  if (e != cudaSuccess) return cuda_failed("cudaGetDevice");

  char* base = static_cast<char*>(p->workspace);
  float* lse_ws = reinterpret_cast<float*>(base + ws.lse_offset);
  float* sum_ws = reinterpret_cast<float*>(base + ws.sum_offset);
  float* dq_acc = reinterpret_cast<float*>(base + ws.dq_offset);
  const View &vq = v[0], &vk = v[1], &vv = v[2], &vo = v[3], &vdo = v[4], &vdq = v[5], &vdk = v[6], &vdv = v[7];

  int* turns = reinterpret_cast<int*>(base + ws.turns_offset);
  e = cudaMemsetAsync(dq_acc, 0, p->deterministic ? ws.total - ws.dq_offset : ws.dq_bytes, stream);
  if (e != cudaSuccess) return cuda_failed("clearing dQ's accumulator");

  const int64_t rows = b * h * nq;
  const Packed packed_seqs =
      packed ? Packed{p->cu_seqlens_q, p->cu_seqlens_k, p->batch, p->align_per_sequence} : Packed{};
  const Band band = Band::of(Cfg::kKind, p->causal_offset, p->window_left, p->window_right);
  const int64_t key_tiles = (nk + Cfg::kBlockN - 1) / Cfg::kBlockN;
  if (p->deterministic && packed) {
    packed_turns_kernel<Cfg::kBlockM, Cfg::kBlockN><<<static_cast<unsigned>((query_tiles + 127) / 128), 128, 0, stream>>>(
        turns, h, static_cast<int>(query_tiles), static_cast<int>(key_tiles), packed_seqs, band, static_cast<int>(nk));
    e = cudaGetLastError();
    if (e != cudaSuccess) return cuda_failed("turn counters launch");
  }
  {
    constexpr int kRowsPerBlock = 128 / (D / kVec);
    const int64_t blocks = std::min<int64_t>((rows + kRowsPerBlock - 1) / kRowsPerBlock, int64_t(1) << 20);
    prep_kernel<Element, D><<<static_cast<unsigned>(blocks), 128, 0, stream>>>(
        static_cast<const Element*>(vo.ptr), vo.sb, vo.sh, vo.sr, static_cast<const Element*>(vdo.ptr), vdo.sb,
        vdo.sh, vdo.sr, p->lse, lse_ws, sum_ws, h, nq, ws.rows_padded, rows, packed_seqs, p->seqlen_q);
    e = cudaGetLastError();
    if (e != cudaSuccess) return cuda_failed("prep kernel launch");
  }
  // A shared bias: its tiles sorted into visible, hidden and mixed (split_dq.h reads the mixed ones).
  uint8_t* class_ws = classes.bytes() > 0 ? reinterpret_cast<uint8_t*>(base + ws.total) : nullptr;
  if constexpr (Cfg::kBias) {  // (the sort kernel is compiled into bias instances only)
    if (class_ws != nullptr) {
      const dim3 grid(static_cast<unsigned>(classes.tiles), static_cast<unsigned>(classes.groups),
                      static_cast<unsigned>(std::min<int64_t>(classes.batch * classes.heads, kMaxGridYZ)));
      fmha_sm90::classify_bias_tiles<Element><<<grid, fmha_sm90::kClassThreads, 0, stream>>>(
          static_cast<const uint16_t*>(p->bias), p->bias_batch_stride, p->bias_head_stride, p->bias_row_stride,
          static_cast<int>(classes.batch), static_cast<int>(classes.heads), static_cast<int>(nq),
          static_cast<int>(nk), fmha_sm90::kClassRows, /*causal=*/false, /*offset=*/0, class_ws);
      e = cudaGetLastError();
      if (e != cudaSuccess) return cuda_failed("bias sort launch");
      const int64_t entries = classes.batch * classes.heads;
      bias_query_ranges<Cfg::kBlockM, Cfg::kBlockN>
          <<<static_cast<unsigned>((entries * classes.key_tiles + 127) / 128), 128, 0, stream>>>(
              class_ws, entries, static_cast<int>(classes.groups), static_cast<int>(classes.tiles),
              static_cast<int>(classes.key_tiles), reinterpret_cast<int2*>(class_ws + classes.class_bytes()));
      e = cudaGetLastError();
      if (e != cudaSuccess) return cuda_failed("bias range launch");
    }
  }

  // A scale of exactly 0 would turn the masked scores (-inf) into NaN in exp2(score * scale - lse);
  // the smallest normal float gives the same probabilities (exp(-LSE)) and dS of about 1e-38.
  const float scale = p->scale == 0.f ? FLT_MIN : p->scale;
  const auto* q0 = static_cast<const Element*>(vq.ptr);
  const auto* k0 = static_cast<const Element*>(vk.ptr);
  const auto* v0 = static_cast<const Element*>(vv.ptr);
  const auto* do0 = static_cast<const Element*>(vdo.ptr);
  auto* dk0 = static_cast<Element*>(const_cast<void*>(vdk.ptr));
  auto* dv0 = static_cast<Element*>(const_cast<void*>(vdv.ptr));
  const int64_t rp = ws.rows_padded;
  // (batch, head, row, 1) in elements: the int strides CUTLASS's arguments take.
  auto s3 = [](const View& t) { return make_stride(int(t.sb), int(t.sh), int(t.sr), _1{}); };
  // Chunks keep batch and heads within the grid's y and z limits (causal: the batch in z, the key
  // tiles in y, and the heads per launch of causal_heads_per_launch), whole GQA groups each, so that
  // a chunk's first query head reads its key/value head h0 / group. A packed call's CTA reads the
  // rows of its own sequence only: its heads' working set is counted per sequence (max_seqlen_q),
  // as a fixed-length call's is per batch entry.
  const int64_t rows_per_head = packed ? int64_t(p->seqlen_q) : nq;
  const int64_t head_step = std::max(
      group,
      (Cfg::kCausal ? causal_heads_per_launch(h, rows_per_head, D, key_tiles, device) : kMaxGridYZ) / group * group);
  // The main kernel (K: the instance's, or its packed-sequence kernel), over chunks of the grid.
  auto run_main = [&](auto kernel) -> int {
    using K = typename decltype(kernel)::type;
    constexpr int kSmem = K::SharedStorageSize;
    if (int status = opt_in_smem<cutlass::device_kernel<K>>(kSmem, err, err_len); status != GEMMGEN_OK) {
      return status;
    }
    for (int64_t b0 = 0; b0 < b; b0 += kMaxGridYZ) {
      for (int64_t h0 = 0; h0 < h; h0 += head_step) {
        const int nb = static_cast<int>(std::min(kMaxGridYZ, b - b0));
        const int nh = static_cast<int>(std::min(head_step, h - h0));
        auto at = [&](auto* ptr, const View& t) { return ptr + b0 * t.sb + h0 / (h / t.heads) * t.sh; };
        const int64_t vec0 = b0 * h + h0;  // first (batch, head) row of the workspace vectors
        typename K::Arguments args{
            make_tuple(nb, nh, static_cast<int>(nq), static_cast<int>(nk), D),
            {at(q0, vq), s3(vq), at(k0, vk), s3(vk), at(v0, vv), s3(vv), at(do0, vdo), s3(vdo),
             lse_ws + vec0 * rp, make_stride(int(h * rp), int(rp), _1{}),
             sum_ws + vec0 * rp, make_stride(int(h * rp), int(rp), _1{}),
             dq_acc + vec0 * nq * D, make_stride(int(h * nq * D), int(nq * D), D, _1{})},
            {at(dk0, vdk), s3(vdk), at(dv0, vdv), s3(vdv)},
            cutlass::KernelHardwareInfo{device, 0}};
        e = launch_with_scale<K>(args, scale, kSmem, stream, [&](auto& params) {
          if constexpr (Cfg::kBand) {
            params.mainloop.band = band;
            params.mainloop.group = static_cast<int>(group);
            params.mainloop.softcap = p->softcap;
            params.mainloop.packed = packed_seqs;
            if constexpr (Cfg::kBias) {
              params.mainloop.bias = static_cast<const Element*>(p->bias) + b0 * p->bias_batch_stride +
                                     h0 * p->bias_head_stride;
              params.mainloop.bias_sb = p->bias_batch_stride;
              params.mainloop.bias_sh = p->bias_head_stride;
              params.mainloop.bias_sr = p->bias_row_stride;
              if (class_ws != nullptr) {
                const int64_t per_head = classes.groups * classes.tiles;
                params.mainloop.classes_sb = classes.batch == 1 ? 0 : classes.heads * per_head;
                params.mainloop.classes_sh = classes.heads == 1 ? 0 : per_head;
                params.mainloop.classes = class_ws + b0 * params.mainloop.classes_sb + h0 * params.mainloop.classes_sh;
                params.mainloop.class_tiles = static_cast<int>(classes.tiles);
                params.mainloop.class_groups = static_cast<int>(classes.groups);
                params.mainloop.ranges_sb = classes.batch == 1 ? 0 : classes.heads * classes.key_tiles;
                params.mainloop.ranges_sh = classes.heads == 1 ? 0 : classes.key_tiles;
                params.mainloop.query_ranges = reinterpret_cast<const int2*>(class_ws + classes.class_bytes()) +
                                               b0 * params.mainloop.ranges_sb + h0 * params.mainloop.ranges_sh;
              }
            }
            if constexpr (Cfg::kDropout) {  // philox.h's mask over the call's [B, H, Nq, Nk] weights
              params.mainloop.dropout = philox::launch_mask(p->dropout_p, p->dropout_seed, p->dropout_offset, p->heads,
                                                            p->seqlen_q, p->seqlen_k, b0, h0);
            }
            if (p->deterministic) {
              params.mainloop.turns = turns + vec0 * query_tiles;
              params.mainloop.turns_batch_stride = h * query_tiles;
              params.mainloop.turns_head_stride = static_cast<int>(query_tiles);
            }
          }
        });
        if (e != cudaSuccess) return cuda_failed("backward kernel launch");
      }
    }
    return GEMMGEN_OK;
  };
  int status = GEMMGEN_OK;
  if constexpr (Cfg::kBand && !Cfg::kBias && !Cfg::kDropout) {
    status = packed ? run_main(KernelTag<typename Cfg::PackedKernel>{})
                    : run_main(KernelTag<Kernel>{});
  } else {
    status = run_main(KernelTag<Kernel>{});
  }
  if (status != GEMMGEN_OK) return status;

  {
    const int64_t vectors = rows * (D / kVec);
    const int64_t blocks = std::min<int64_t>((vectors + 255) / 256, int64_t(1) << 20);
    convert_kernel<Element, D><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(
        dq_acc, static_cast<Element*>(const_cast<void*>(vdq.ptr)), vdq.sb, vdq.sh, vdq.sr, h, nq, vectors);
    e = cudaGetLastError();
    if (e != cudaSuccess) return cuda_failed("dQ conversion launch");
  }
  return GEMMGEN_OK;
}

template <class Cfg>
int info(GemmgenInstanceInfo* out) {
  return cutlass_kernel_info<Cfg>(out, GEMMGEN_INFO_BACKWARD | (Cfg::kBand ? GEMMGEN_INFO_READS_GQA : 0));
}

}  // namespace gemmgen::fmha_bwd_sm90
