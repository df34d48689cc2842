// decode_sm80: attention for few query rows against many keys (decode, speculative decoding,
// chunked prefill against a cache), where the kernel is bound by reading K and V once.
//
// - GQA packing: the query heads of one KV group and their query rows share a CTA's row tile
//   (row R of a group's tile space is query R / group of head h_kv * group + R % group), so K and
//   V are read once per KV head, not once per query head.
// - Split-KV: num_splits CTAs share one row tile's keys, each writing its rows' normalized O and
//   LSE in fp32 to the workspace; combine_kernel merges them weighted by exp(LSE_s - LSE).
// - K and V are read through per-row addresses: contiguous [batch, ...] by their strides, or
//   pages through a block table; sequence b sees its own seqlens_k[b] keys.
// S = Q K^T and O += P V run on the fa2_sm80 family's m16n8k16 MMA tiles and online softmax.
#pragma once
#include <cmath>
#include <cute/tensor.hpp>

#include "gemmgen/abi.h"
#include "gemmgen/fa2_sm80/softmax.h"
#include "gemmgen/fa2_sm80/traits.h"
#include "gemmgen/fa2_sm80/utils.h"

namespace gemmgen::decode_sm80 {
using namespace cute;
using fa2_sm80::gemm_rs;
using fa2_sm80::gemm_ss;
using fa2_sm80::rowcol;
using fa2_sm80::acc_to_a;
using fa2_sm80::convert_to;

constexpr float kLog2e = 1.4426950408889634f;

// The fa2_sm80 shared-memory layouts for one row tile and one K/V tile; the CTA's warps form a
// WarpsM x WarpsN grid: warp (wm, wn) computes the 16 rows 16 * wm.. of the row tile against the
// BlockN / WarpsN keys wn * BlockN / WarpsN.. of every key tile, with its own online softmax, and the
// WarpsN partial results of each row merge once, after the key loop. Splitting keys over warps keeps
// the MMA work per key at 16 rows where a KV group has few query rows; splitting rows serves groups
// of more. Stages K/V tile pairs are in flight.
template <class Element_, int HeadDim, int BlockN, int WarpsM, int WarpsN, int Stages>
struct KernelTraits : fa2_sm80::KernelTraits<Element_, HeadDim, 16 * WarpsM, BlockN, WarpsM, 1> {
  static constexpr int kWarpsM = WarpsM;
  static constexpr int kWarpsN = WarpsN;
  static constexpr int kNWarps = WarpsM * WarpsN;
  static constexpr int kNThreads = 32 * kNWarps;
  static constexpr int kKeysPerWarp = BlockN / WarpsN;
  static constexpr int kStages = Stages;
  static constexpr int kStageElems = 2 * BlockN * HeadDim;  // a K and a V tile
  static constexpr int kSmemSize = (16 * WarpsM + Stages * 2 * BlockN) * HeadDim * int(sizeof(Element_));
  static constexpr int kChunksPerRow = HeadDim / 8;  // 16-byte chunks of one row
  // One warp's m16n8k16 MMAs: a 16-row slice, 16 columns per step.
  using WarpMma = TiledMMA<MMA_Atom<typename fa2_sm80::MmaOp<Element_>::type>, Layout<Shape<_1, _1, _1>>,
                           Tile<_16, _16, _16>>;
  // The merge's fp32 scratch in the K/V stages' space: every warp's unnormalized O rows, then its
  // row maxima and row sums.
  static constexpr int kScratchFloats = kNWarps * 16 * (HeadDim + 2);
  static_assert(Stages >= 2, "the key loop loads tile n+1 while tile n computes");
  static_assert(HeadDim % 8 == 0 && 8 * sizeof(Element_) == 16, "16-byte chunks of 8 elements");
  static_assert(kKeysPerWarp % 16 == 0, "each warp's keys pair up into k16 A fragments of P");
  static_assert(kScratchFloats * 4 <= Stages * kStageElems * int(sizeof(Element_)), "merge scratch fits the stages");
};

// 16 bytes global -> shared without passing through registers (L2 only: K and V are streamed once).
CUTE_DEVICE void cp_async_16(void* smem, const void* gmem) {
  const uint32_t dst = cast_smem_ptr_to_uint(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem));
}
CUTE_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
CUTE_DEVICE void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// The workspace of a split call: LSE_s of every output row of every split, [num_splits, rows],
// then O_s in fp32, [num_splits, rows, head_dim], from a 256-byte boundary (float2 stores).
CUTE_HOST_DEVICE int64_t workspace_lse_floats(GemmgenAttnParams const& p) {
  const int64_t rows = int64_t(p.batch) * p.heads * p.seqlen_q;
  return (int64_t(p.num_splits) * rows + 63) / 64 * 64;
}
CUTE_HOST_DEVICE int64_t workspace_bytes(GemmgenAttnParams const& p) {
  if (p.num_splits <= 1) return 0;
  const int64_t rows = int64_t(p.batch) * p.heads * p.seqlen_q;
  return (workspace_lse_floats(p) + int64_t(p.num_splits) * rows * p.head_dim) * int64_t(sizeof(float));
}

// What a CTA derives from its block index and the params.
struct Work {
  int b, h_kv, group, rows;  // rows: seqlen_q * group, the packed rows of this KV head
  int len;                   // keys of this sequence
  bool bad;                  // its length lies outside [0, seqlen_k]: its rows come out NaN
  int64_t offset;            // causal: key j visible to query i iff j <= i + offset (no mask: huge)
  int64_t lo;                // a sliding window: key j hidden from query i when j < i + lo (else very negative)
  int n_begin, n_end;        // this split's key tiles [n_begin, n_end)
};

template <class Traits>
CUTE_DEVICE Work plan(GemmgenAttnParams const& p, int split, int m_block, int bkv) {
  Work w;
  w.b = bkv / p.heads_kv;
  w.h_kv = bkv % p.heads_kv;
  w.group = p.heads / p.heads_kv;
  w.rows = p.seqlen_q * w.group;
  const int len = p.seqlens_k != nullptr ? p.seqlens_k[w.b] : p.seqlen_k;
  w.bad = len < 0 || len > p.seqlen_k;
  w.len = w.bad ? 0 : len;
  // The diagonal: at causal_offset, moved per sequence to its own last key (key-value caches).
  const int64_t diagonal = int64_t(p.causal_offset) + (p.seqlens_k != nullptr ? w.len - p.seqlen_k : 0);
  constexpr int64_t kUnbounded = int64_t(1) << 40;
  w.offset = diagonal;
  w.lo = -kUnbounded;
  if (p.local) {  // a sliding window (abi.h): the diagonal's causal_offset, its sides -1 unbounded
    w.offset = p.window_right < 0 ? kUnbounded : diagonal + p.window_right;
    w.lo = p.window_left < 0 ? -kUnbounded : diagonal - p.window_left;
  }
  // Keys the tile's last query can see bound the tiles it visits; with a window, its first query's
  // first visible key is where they start.
  const int last_query = min(w.rows - 1, (m_block + 1) * Traits::kBlockM - 1) / w.group;
  const int64_t keys = max<int64_t>(0, min<int64_t>(w.len, int64_t(last_query) + w.offset + 1));
  const int n_tiles = int((keys + Traits::kBlockN - 1) / Traits::kBlockN);
  const int64_t first_key = int64_t(min(w.rows - 1, m_block * Traits::kBlockM) / w.group) + w.lo;
  const int n_first = first_key <= 0 ? 0 : int(min<int64_t>(n_tiles, first_key / Traits::kBlockN));
  const int splits = max(p.num_splits, 1);
  const int per_split = (n_tiles - n_first + splits - 1) / splits;
  w.n_begin = min(n_tiles, n_first + split * per_split);
  w.n_end = min(n_tiles, w.n_begin + per_split);
  return w;
}

// Where output row r of the row tile goes: the flat LSE row ((b * heads + h) * seqlen_q + i), and
// the query (i) and head (h) it stands for. False for a padding row.
struct RowId {
  int64_t flat;
  int i, h;
};
CUTE_DEVICE bool row_id(GemmgenAttnParams const& p, Work const& w, int packed, RowId& id) {
  if (packed >= w.rows) return false;
  id.i = packed / w.group;
  id.h = w.h_kv * w.group + packed % w.group;
  id.flat = (int64_t(w.b) * p.heads + id.h) * p.seqlen_q + id.i;
  return true;
}

// 8 NaNs of a 2-byte float type (0x7FFF is a NaN in fp16 and in bf16).
constexpr uint32_t kNaN2 = 0x7FFF7FFFu;

// Writes, for a CTA with no key to visit, O = 0 and LSE = -inf (one split), or LSE = -inf into its
// split's workspace rows (the combine skips them); for a sequence with a bad length, NaN.
template <class Traits>
CUTE_DEVICE void write_empty(GemmgenAttnParams const& p, Work const& w, int split, int m_block) {
  using Element = typename Traits::Element;
  const int64_t all_rows = int64_t(p.batch) * p.heads * p.seqlen_q;
  float* ws_lse = static_cast<float*>(p.workspace);
  const float lse = w.bad ? NAN : -INFINITY;
  const uint32_t fill = w.bad ? kNaN2 : 0u;
  for (int r = threadIdx.x; r < Traits::kBlockM; r += Traits::kNThreads) {
    RowId id;
    if (!row_id(p, w, m_block * Traits::kBlockM + r, id)) continue;
    if (p.num_splits > 1) {  // the combine reads every split's O_s: zeros (NaN for a bad length)
      ws_lse[split * all_rows + id.flat] = lse;
      float* ws_o = static_cast<float*>(p.workspace) + workspace_lse_floats(p) +
                    (split * all_rows + id.flat) * int64_t(Traits::kHeadDim);
      const float o_fill = w.bad ? NAN : 0.f;
      for (int c = 0; c < Traits::kHeadDim; c += 2) *reinterpret_cast<float2*>(ws_o + c) = make_float2(o_fill, o_fill);
      continue;
    }
    Element* o = static_cast<Element*>(p.o) + w.b * p.o_batch_stride + id.h * p.o_head_stride + id.i * p.o_row_stride;
    for (int c = 0; c < Traits::kChunksPerRow; ++c) reinterpret_cast<uint4*>(o)[c] = make_uint4(fill, fill, fill, fill);
    if (p.lse != nullptr) p.lse[id.flat] = lse;
  }
}

template <class Traits>
__global__ void __launch_bounds__(Traits::kNThreads) decode_kernel(const GemmgenAttnParams p) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kStages = Traits::kStages;
  constexpr int kChunks = Traits::kChunksPerRow;
  constexpr int kThreads = Traits::kNThreads;
  constexpr int kWarpsN = Traits::kWarpsN;
  constexpr int kKeys = Traits::kKeysPerWarp;
  constexpr int kStageElems = Traits::kStageElems;

  extern __shared__ __align__(128) char smem[];
  const int split = blockIdx.x;
  const int m_block = blockIdx.y;
  const Work w = plan<Traits>(p, split, m_block, blockIdx.z);
  if (w.bad || w.n_begin >= w.n_end) {
    write_empty<Traits>(p, w, split, m_block);
    return;
  }
  const int tidx = threadIdx.x;
  const int lane = tidx % 32;
  const int warp = tidx / 32;
  const int wm = warp / kWarpsN, wn = warp % kWarpsN;
  const int row0 = m_block * kBlockM;

  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(sQ.data() + size(sQ), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(sK.data() + size(sK), typename Traits::SmemLayoutKV{});
  Tensor sVt = make_tensor(sV.data(), typename Traits::SmemLayoutVt{});
  Tensor sVtNoSwizzle = make_tensor(sV.data().get(), typename Traits::SmemLayoutVtNoSwizzle{});
  // Stage s's K and V tiles lie s * kStageElems elements after stage 0's: [Q][K0][V0][K1][V1]...
  auto staged = [](auto const& t, int stage) { return make_tensor(t.data() + stage * kStageElems, t.layout()); };

  // Q: the packed rows, each from its own query head; padding rows are zero.
  for (int c = tidx; c < kBlockM * kChunks; c += kThreads) {
    const int r = c / kChunks, col = (c % kChunks) * 8;
    RowId id;
    Element* dst = &sQ(r, col);
    if (row_id(p, w, row0 + r, id)) {
      cp_async_16(dst, static_cast<const Element*>(p.q) + w.b * p.q_batch_stride + id.h * p.q_head_stride +
                           id.i * p.q_row_stride + col);
    } else {
      *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
    }
  }
  // K and V tile n into `stage`: each row from its page (or its sequence's contiguous rows); rows
  // past the sequence's keys read as zero, so masked scores never meet NaN values.
  const Element* k_base = static_cast<const Element*>(p.k) + w.h_kv * p.k_head_stride;
  const Element* v_base = static_cast<const Element*>(p.v) + w.h_kv * p.v_head_stride;
  const int32_t* table = p.block_table != nullptr ? p.block_table + w.b * p.block_table_batch_stride : nullptr;
  // Pages a whole number of key tiles long hold each tile in one page: one lookup per tile. Shorter
  // pages are looked up per row; a power-of-two page size (the usual one) by a shift and a mask
  // rather than a division.
  const bool tile_in_page = table != nullptr && p.page_size % kBlockN == 0;
  const bool pow2_page = table != nullptr && (p.page_size & (p.page_size - 1)) == 0;
  const int page_shift = pow2_page ? __ffs(p.page_size) - 1 : 0;
  auto load_kv = [&](int n, int stage) {
    Element* k_dst = sK.data().get() + stage * kStageElems;
    Element* v_dst = sV.data().get() + stage * kStageElems;
    int64_t tile_page = 0;
    int tile_row = 0;
    if (tile_in_page) {
      tile_page = table[n * kBlockN / p.page_size];
      tile_row = n * kBlockN % p.page_size;
    }
    for (int c = tidx; c < kBlockN * kChunks; c += kThreads) {
      const int r = c / kChunks, col = (c % kChunks) * 8;
      const int t = n * kBlockN + r;
      const int at = sK.layout()(r, col);  // the swizzle keeps each 8-element chunk contiguous
      if (t < w.len) {
        int64_t page, row;
        if (table != nullptr) {
          if (tile_in_page) {
            page = tile_page;
            row = tile_row + r;
          } else if (pow2_page) {
            page = table[t >> page_shift];
            row = t & (p.page_size - 1);
          } else {
            page = table[t / p.page_size];
            row = t % p.page_size;
          }
          if (p.num_pages > 0 && (page < 0 || page >= p.num_pages)) {  // not a page: NaN, never a fault
            *reinterpret_cast<uint4*>(k_dst + at) = make_uint4(kNaN2, kNaN2, kNaN2, kNaN2);
            *reinterpret_cast<uint4*>(v_dst + at) = make_uint4(kNaN2, kNaN2, kNaN2, kNaN2);
            continue;
          }
        } else {
          page = w.b;
          row = t;
        }
        cp_async_16(k_dst + at, k_base + page * p.k_batch_stride + row * p.k_row_stride + col);
        cp_async_16(v_dst + at, v_base + page * p.v_batch_stride + row * p.v_row_stride + col);
      } else {
        *reinterpret_cast<uint4*>(k_dst + at) = make_uint4(0, 0, 0, 0);
        *reinterpret_cast<uint4*>(v_dst + at) = make_uint4(0, 0, 0, 0);
      }
    }
  };

  // Key tiles run from the split's last to its first (the partial and diagonal tiles, which need
  // the mask, come first); the prologue puts kStages - 1 tiles in flight, one commit group each.
  const int n_count = w.n_end - w.n_begin;
  auto tile_of = [&](int step) { return w.n_end - 1 - step; };
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n_count) load_kv(tile_of(s), s);
    cp_async_commit();  // the Q loads join the first group
  }

  // This warp's slices: Q rows 16 * wm.., and of every K / V tile the keys wn * kKeys...
  Tensor sQw = local_tile(sQ, Shape<_16, Int<kHeadDim>>{}, make_coord(wm, 0));
  Tensor sKw = local_tile(sK, Shape<Int<kKeys>, Int<kHeadDim>>{}, make_coord(wn, 0));
  Tensor sVtw = local_tile(sVt, Shape<Int<kHeadDim>, Int<kKeys>>{}, make_coord(0, wn));
  Tensor sVtNoSwizzlew = local_tile(sVtNoSwizzle, Shape<Int<kHeadDim>, Int<kKeys>>{}, make_coord(0, wn));
  typename Traits::WarpMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(lane);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQw);
  Tensor tSrK = thr_mma.partition_fragment_B(sKw);
  Tensor tOrVt = thr_mma.partition_fragment_B(sVtNoSwizzlew);
  Tensor acc_o = partition_fragment_C(tiled_mma, Shape<_16, Int<kHeadDim>>{});
  auto smem_tiled_copy_Q = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_copy_Q = smem_tiled_copy_Q.get_thread_slice(lane);
  Tensor tSsQ = smem_thr_copy_Q.partition_S(sQw);
  auto smem_tiled_copy_K = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_copy_K = smem_tiled_copy_K.get_thread_slice(lane);
  Tensor tSsK = smem_thr_copy_K.partition_S(sKw);
  auto smem_tiled_copy_V = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, tiled_mma);
  auto smem_thr_copy_V = smem_tiled_copy_V.get_thread_slice(lane);
  Tensor tOsVt = smem_thr_copy_V.partition_S(sVtw);
  Tensor tScS = thr_mma.partition_C(make_identity_tensor(Shape<_16, Int<kKeys>>{}));

  clear(acc_o);
  // A negative scale runs as |scale| on -Q (see fa2_sm80's kernel): the max stays a max.
  cp_async_wait<kStages - 2>();
  __syncthreads();
  if (p.scale < 0.f) {
    for (int i = tidx; i < size(sQ); i += kThreads) sQ(i) = -sQ(i);
    __syncthreads();
  }
  // Q stays in registers for the whole key loop: each warp's 16 rows, read from shared memory once.
  cute::copy(smem_tiled_copy_Q, tSsQ, smem_thr_copy_Q.retile_D(tSrQ));
  fa2_sm80::OnlineSoftmax<2 * size<1>(acc_o)> softmax(fabsf(p.scale) * kLog2e);

  // Visible keys of each accumulator row of this thread: [i + lo, min(len, i + offset + 1)).
  Tensor cS = make_tensor(tScS.data(), rowcol(tScS.layout()));
  constexpr int kRows = decltype(size<0>(cS))::value;
  const int warp_row0 = row0 + 16 * wm;
  int64_t row_limit[kRows], row_first[kRows];
  CUTE_UNROLL
  for (int mi = 0; mi < kRows; ++mi) {
    const int packed = warp_row0 + get<0>(cS(mi, 0));
    const int64_t i = min(packed, w.rows - 1) / w.group;
    row_limit[mi] = max<int64_t>(0, min<int64_t>(w.len, i + w.offset + 1));
    row_first[mi] = i + w.lo;
  }
  const int first_query = min(row0, w.rows - 1) / w.group;
  const int64_t all_visible = min<int64_t>(w.len, int64_t(first_query) + w.offset + 1);
  // Keys from here on are visible to every row of the tile (a window's left edge; without one, all).
  const int64_t all_seen_from = int64_t(min(w.rows - 1, row0 + kBlockM - 1) / w.group) + w.lo;

  for (int step = 0; step < n_count; ++step) {
    const int n = tile_of(step);
    const int stage = step % kStages;
    cp_async_wait<kStages - 2>();
    __syncthreads();  // tile n landed; every warp is done with the stage the next load reuses
    if (step + kStages - 1 < n_count) load_kv(tile_of(step + kStages - 1), (step + kStages - 1) % kStages);
    cp_async_commit();  // possibly empty: one group per step keeps the wait count right

    Tensor acc_s = partition_fragment_C(tiled_mma, Shape<_16, Int<kKeys>>{});
    clear(acc_s);
    gemm_rs(acc_s, tSrQ, tSrK, staged(tSsK, stage), tiled_mma, smem_tiled_copy_K, smem_thr_copy_K);
    const int64_t col0 = int64_t(n) * kBlockN + wn * kKeys;
    // Some key of the tile is hidden from some row: past a row's last key, or left of a window.
    if (int64_t(n) * kBlockN + kBlockN > all_visible || int64_t(n) * kBlockN < all_seen_from) {
      Tensor sc = make_tensor(acc_s.data(), rowcol(acc_s.layout()));
      CUTE_UNROLL
      for (int mi = 0; mi < size<0>(sc); ++mi) {
        const int64_t limit = row_limit[mi] - col0;
        const int64_t first = row_first[mi] - col0;
        CUTE_UNROLL
        for (int ni = 0; ni < size<1>(sc); ++ni) {
          if (get<1>(cS(0, ni)) >= limit || get<1>(cS(0, ni)) < first) sc(mi, ni) = -INFINITY;
        }
      }
    }
    if (step == 0) {
      softmax.template update<true>(make_tensor(acc_s.data(), rowcol(acc_s.layout())),
                                    make_tensor(acc_o.data(), rowcol(acc_o.layout())));
    } else {
      softmax.template update<false>(make_tensor(acc_s.data(), rowcol(acc_s.layout())),
                                     make_tensor(acc_o.data(), rowcol(acc_o.layout())));
    }
    Tensor rP = convert_to<Element>(acc_s);
    Tensor tOrP = make_tensor(rP.data(), acc_to_a(rP.layout()));
    gemm_rs(acc_o, tOrP, tOrVt, staged(tOsVt, stage), tiled_mma, smem_tiled_copy_V, smem_thr_copy_V);
  }
  cp_async_wait<0>();
  __syncthreads();  // every warp is done with the K/V stages: the merge scratch reuses them

  // Merge: every warp's unnormalized O rows and its row max (log2 domain, scaled) and row sum go to
  // shared memory; then the threads sum each row's WarpsN parts, O = sum_w 2^(m_w - M) O_w / L with
  // L = sum_w 2^(m_w - M) l_w, LSE = (M + log2 L) ln 2.
  float* scratch = reinterpret_cast<float*>(sK.data().get());
  float* s_o = scratch;                                      // [warps][16][d]
  float* s_m = scratch + Traits::kNWarps * 16 * kHeadDim;    // [warps][16]
  float* s_l = s_m + Traits::kNWarps * 16;                   // [warps][16]
  {
    Tensor tOcO = thr_mma.partition_C(make_identity_tensor(Shape<_16, Int<kHeadDim>>{}));
    Tensor cO = make_tensor(tOcO.data(), rowcol(tOcO.layout()));
    Tensor o = make_tensor(acc_o.data(), rowcol(acc_o.layout()));
    CUTE_UNROLL
    for (int mi = 0; mi < size<0>(o); ++mi) {
      const int r = get<0>(cO(mi, 0));
      float* dst = s_o + (warp * 16 + r) * kHeadDim;
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(o); ni += 2) {
        *reinterpret_cast<float2*>(dst + get<1>(cO(mi, ni))) = make_float2(o(mi, ni), o(mi, ni + 1));
      }
      const float l = fa2_sm80::quad_sum(softmax.row_sum(mi));
      if (get<1>(cO(0, 0)) == 0) {
        s_m[warp * 16 + r] = softmax.row_max(mi);
        s_l[warp * 16 + r] = l;
      }
    }
  }
  __syncthreads();

  constexpr float kLn2 = 0.6931471805599453f;
  const int64_t all_rows = int64_t(p.batch) * p.heads * p.seqlen_q;
  float* ws_lse = static_cast<float*>(p.workspace) + split * all_rows;
  float* ws_o = static_cast<float*>(p.workspace) + workspace_lse_floats(p) + split * int64_t(kHeadDim) * all_rows;
  // Threads walk (row, column pairs) of the whole row tile; a row's statistics are read per pair.
  for (int e = tidx; e < kBlockM * (kHeadDim / 2); e += kThreads) {
    const int r = e / (kHeadDim / 2), c = (e % (kHeadDim / 2)) * 2;
    RowId id;
    if (!row_id(p, w, row0 + r, id)) continue;
    const int rw = r % 16, first = (r / 16) * kWarpsN;  // warps holding row r: first .. first + WarpsN - 1
    float top = -INFINITY;
    CUTE_UNROLL
    for (int j = 0; j < kWarpsN; ++j) top = fmaxf(top, s_m[(first + j) * 16 + rw]);
    const float base = top == -INFINITY ? 0.f : top;
    float sum = 0.f, o0 = 0.f, o1 = 0.f;
    CUTE_UNROLL
    for (int j = 0; j < kWarpsN; ++j) {
      const float f = exp2f(s_m[(first + j) * 16 + rw] - base);
      sum += f * s_l[(first + j) * 16 + rw];
      const float2 part = *reinterpret_cast<const float2*>(s_o + ((first + j) * 16 + rw) * kHeadDim + c);
      o0 += f * part.x;
      o1 += f * part.y;
    }
    const float inv = sum == 0.f ? 0.f : 1.f / sum;  // a row that saw no key: O = 0, LSE = -inf
    const float lse = sum == 0.f ? -INFINITY : (base + __log2f(sum)) * kLn2;
    if (p.num_splits > 1) {
      *reinterpret_cast<float2*>(ws_o + id.flat * kHeadDim + c) = make_float2(o0 * inv, o1 * inv);
      if (c == 0) ws_lse[id.flat] = lse;
    } else {
      Element* dst = static_cast<Element*>(p.o) + w.b * p.o_batch_stride + id.h * p.o_head_stride +
                     id.i * p.o_row_stride + c;
      dst[0] = Element(o0 * inv);
      dst[1] = Element(o1 * inv);
      if (c == 0 && p.lse != nullptr) p.lse[id.flat] = lse;
    }
  }
}

// Merges the splits of every output row: LSE = log sum_s exp(LSE_s), O = sum_s exp(LSE_s - LSE) O_s.
// A row's splits are shared out over `warps_per_row` warps of the CTA (1, 2 or 4; a CTA holds
// 4 / warps_per_row rows): every warp of the row computes its LSE (the lanes share out the splits),
// then sums O_s * weight over its splits (s = its index, + warps_per_row, ...) with no branch
// between the loads, so they are all in flight at once; the row's warps add up through shared
// memory. Every split writes all its rows' O_s (zeros where it saw no key, whose LSE is -inf and
// weight 0); a NaN LSE (a bad page or length) makes the row NaN.
constexpr int kCombineWarps = 4;
template <class Element, int HeadDim>
__global__ void __launch_bounds__(32 * kCombineWarps) combine_kernel(const GemmgenAttnParams p, int warps_per_row) {
  constexpr int kCols = (HeadDim + 63) / 64;  // float2 columns per lane
  __shared__ float2 s_part[kCombineWarps][kCols][32];
  const int64_t all_rows = int64_t(p.batch) * p.heads * p.seqlen_q;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int part = warp % warps_per_row;
  const int64_t row = int64_t(blockIdx.x) * (kCombineWarps / warps_per_row) + warp / warps_per_row;
  const bool live = row < all_rows;
  const float* ws_lse = static_cast<const float*>(p.workspace);
  const float* ws_o = ws_lse + workspace_lse_floats(p);
  const int splits = p.num_splits;
  float top = -INFINITY, lse = -INFINITY;
  bool nan = false;
  float2 acc[kCols];
  CUTE_UNROLL
  for (int j = 0; j < kCols; ++j) acc[j] = make_float2(0.f, 0.f);
  if (live) {
    for (int s = lane; s < splits; s += 32) {
      const float l = ws_lse[s * all_rows + row];
      nan |= isnan(l);
      top = fmaxf(top, l);
    }
    for (int o = 16; o > 0; o /= 2) {
      top = fmaxf(top, __shfl_xor_sync(0xffffffff, top, o));
      nan |= __shfl_xor_sync(0xffffffff, int(nan), o) != 0;
    }
    float sum = 0.f;
    if (top != -INFINITY && !nan) {
      for (int s = lane; s < splits; s += 32) sum += __expf(ws_lse[s * all_rows + row] - top);
    }
    for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffff, sum, o);
    lse = nan ? NAN : top == -INFINITY ? -INFINITY : top + __logf(sum);
    const float* o_row = ws_o + row * HeadDim;
    const int64_t split_stride = all_rows * HeadDim;
    #pragma unroll 4
    for (int s = part; s < splits; s += warps_per_row) {
      const float l = ws_lse[s * all_rows + row];
      const float wgt = (nan || l == -INFINITY) ? 0.f : __expf(l - lse);
      CUTE_UNROLL
      for (int j = 0; j < kCols; ++j) {
        const int c = lane * 2 + 64 * j;
        if (c < HeadDim) {
          const float2 v = *reinterpret_cast<const float2*>(o_row + s * split_stride + c);
          acc[j].x += wgt * v.x;
          acc[j].y += wgt * v.y;
        }
      }
    }
  }
  CUTE_UNROLL
  for (int j = 0; j < kCols; ++j) s_part[warp][j][lane] = acc[j];
  __syncthreads();
  if (!live || part != 0) return;
  const int i = int(row % p.seqlen_q);
  const int64_t bh = row / p.seqlen_q;
  const int b = int(bh / p.heads), h = int(bh % p.heads);
  Element* o = static_cast<Element*>(p.o) + b * p.o_batch_stride + h * p.o_head_stride + i * p.o_row_stride;
  CUTE_UNROLL
  for (int j = 0; j < kCols; ++j) {
    const int c = lane * 2 + 64 * j;
    if (c >= HeadDim) continue;
    float2 a = acc[j];
    for (int w = 1; w < warps_per_row; ++w) {
      a.x += s_part[warp + w][j][lane].x;
      a.y += s_part[warp + w][j][lane].y;
    }
    if (nan) a = make_float2(NAN, NAN);
    o[c] = Element(a.x);
    o[c + 1] = Element(a.y);
  }
  if (lane == 0 && p.lse != nullptr) p.lse[row] = lse;
}

}  // namespace gemmgen::decode_sm80
