// fa2_sm80 forward kernel: one CTA per (query tile, batch*head); with variable lengths the grid
// covers the longest sequence and each CTA finds its sequence's rows (gemmgen/sequence.h). Q stays
// in shared memory; K and V tiles stream through shared memory with cp.async in one or two pipeline
// stages; S = Q K^T and O += P V run on m16n8k16 mma.sync with fp32 accumulation; nothing of size
// seqlen_q x seqlen_k touches global memory.
#pragma once
#include <cmath>
#include <cute/tensor.hpp>

#include "gemmgen/abi.h"
#include "gemmgen/fa2_sm80/softmax.h"
#include "gemmgen/fa2_sm80/traits.h"
#include "gemmgen/fa2_sm80/utils.h"
#include "gemmgen/sequence.h"
#include "gemmgen/softcap.h"

namespace gemmgen::fa2_sm80 {
using namespace cute;

constexpr float kLog2e = 1.4426950408889634f;

// A query tile that sees no key at all (causal, bottom-right alignment with more queries
// than keys, or a sequence without keys): O = 0 and LSE = -inf, as the softmax of an empty row
// is defined here. `seqlen_q`: the sequence's query rows.
template <class Traits>
CUTE_DEVICE void write_empty_tile(GemmgenAttnParams const& p, typename Traits::Element* o_ptr, float* lse_ptr,
                                  int m_block, int seqlen_q) {
  constexpr int kChunks = Traits::kHeadDim / Traits::kGmemElemsPerAccess;
  const int rows = min(Traits::kBlockM, seqlen_q - m_block * Traits::kBlockM);
  for (int i = threadIdx.x; i < rows * kChunks; i += Traits::kNThreads) {
    const int r = i / kChunks, c = i % kChunks;
    *reinterpret_cast<uint4*>(o_ptr + int64_t(r) * p.o_row_stride + c * Traits::kGmemElemsPerAccess) =
        make_uint4(0, 0, 0, 0);
  }
  if (lse_ptr != nullptr) {
    for (int r = threadIdx.x; r < rows; r += Traits::kNThreads) lse_ptr[r] = -INFINITY;
  }
}

// Local: the sliding window of Mask.LOCAL (abi.h's window_left / window_right around the diagonal
// at causal_offset); Causal and Local are never both set. Softcap: the scaled scores s become
// softcap * tanh(s / softcap) (abi.h's softcap, > 0) before the mask.
template <class Traits, bool Causal, bool Local = false, bool Softcap = false>
__global__ void __launch_bounds__(Traits::kNThreads, 1) fwd_kernel(const GemmgenAttnParams p) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;

  extern __shared__ __align__(128) char smem[];

  // Causal tiles further down have more keys to visit: hand those out first so the short
  // ones fill the tail of the grid.
  const int m_block = Causal ? int(gridDim.x - 1 - blockIdx.x) : int(blockIdx.x);
  const int64_t bh = blockIdx.y + int64_t(blockIdx.z) * gridDim.y;
  if (bh >= int64_t(p.batch) * p.heads) return;
  const int b = int(bh / p.heads);
  const int h = int(bh % p.heads);
  const int h_kv = h / (p.heads / p.heads_kv);
  const int tidx = threadIdx.x;

  // This sequence's rows and diagonal (gemmgen/sequence.h); p.seqlen_q stays the LSE's row count.
  const Sequence seq = sequence_of(p, b);
  const int seqlen_q = seq.seqlen_q;
  const int seqlen_k = seq.seqlen_k;
  const int64_t causal_offset = seq.causal_offset;
  float* lse_ptr = p.lse == nullptr ? nullptr : p.lse + bh * p.seqlen_q + int64_t(m_block) * kBlockM;
  if (seq.varlen) {  // LSE rows past a shorter sequence's end are -inf; a tile wholly past it is done
    if (lse_ptr != nullptr) {
      const int end = min((m_block + 1) * kBlockM, p.seqlen_q) - m_block * kBlockM;
      for (int r = max(seqlen_q - m_block * kBlockM, 0) + tidx; r < end; r += Traits::kNThreads) lse_ptr[r] = -INFINITY;
    }
    if (m_block * kBlockM >= seqlen_q) return;
  }

  const Element* q_ptr = static_cast<const Element*>(p.q) + seq.q_start(p.q_batch_stride, p.q_row_stride) +
                         h * p.q_head_stride;
  const Element* k_ptr = static_cast<const Element*>(p.k) + seq.k_start(p.k_batch_stride, p.k_row_stride) +
                         h_kv * p.k_head_stride;
  const Element* v_ptr = static_cast<const Element*>(p.v) + seq.k_start(p.v_batch_stride, p.v_row_stride) +
                         h_kv * p.v_head_stride;
  Element* o_ptr = static_cast<Element*>(p.o) + seq.q_start(p.o_batch_stride, p.o_row_stride) + h * p.o_head_stride;

  // Key tiles this query tile sees, [n_block_min, n_block_max): all, or (causal) up to the last
  // row's diagonal, or (local) from the first row's left window edge to the last row's right one.
  int n_block_max = (seqlen_k + kBlockN - 1) / kBlockN;
  if constexpr (Causal) {
    const int64_t last_row = min((m_block + 1) * kBlockM, seqlen_q) - 1;
    const int64_t last_col = last_row + causal_offset;
    n_block_max = last_col < 0 ? 0 : int(min<int64_t>(n_block_max, last_col / kBlockN + 1));
  }
  // Local: key j hidden from row i when j < i + lo_off or j > i + hi_off (a side without a bound
  // gets an offset past every key). Without a window these are constants no code reads, and the
  // first key tile is 0, so the kernels of the other masks compile as they would without them.
  const int64_t lo_off = Local && p.window_left >= 0 ? causal_offset - p.window_left : -(int64_t(1) << 40);
  const int64_t hi_off = Local && p.window_right >= 0 ? causal_offset + p.window_right : int64_t(1) << 40;
  const int64_t local_last_row = Local ? min((m_block + 1) * kBlockM, seqlen_q) - 1 : 0;
  if constexpr (Local) {
    const int64_t last_col = local_last_row + hi_off;
    n_block_max = last_col < 0 ? 0 : int(min<int64_t>(n_block_max, last_col / kBlockN + 1));
  }
  const int n_block_min = [&] {
    if constexpr (Local) {
      const int64_t first_col = int64_t(m_block) * kBlockM + lo_off;
      return first_col <= 0 ? 0 : int(min<int64_t>(n_block_max, first_col / kBlockN));
    } else {
      return 0;
    }
  }();
  if (n_block_max <= n_block_min) {
    write_empty_tile<Traits>(p, o_ptr + int64_t(m_block) * kBlockM * p.o_row_stride, lse_ptr, m_block, seqlen_q);
    return;
  }

  Tensor mQ = make_tensor(make_gmem_ptr(q_ptr), make_shape(seqlen_q, Int<kHeadDim>{}),
                          make_stride(p.q_row_stride, _1{}));
  Tensor mK = make_tensor(make_gmem_ptr(k_ptr), make_shape(seqlen_k, Int<kHeadDim>{}),
                          make_stride(p.k_row_stride, _1{}));
  Tensor mV = make_tensor(make_gmem_ptr(v_ptr), make_shape(seqlen_k, Int<kHeadDim>{}),
                          make_stride(p.v_row_stride, _1{}));
  Tensor mO = make_tensor(make_gmem_ptr(o_ptr), make_shape(seqlen_q, Int<kHeadDim>{}),
                          make_stride(p.o_row_stride, _1{}));
  Tensor gQ = local_tile(mQ, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, 0));  // (BLK_M, D)
  Tensor gK = local_tile(mK, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, 0));        // (BLK_N, D, n)
  Tensor gV = local_tile(mV, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, 0));        // (BLK_N, D, n)
  Tensor gO = local_tile(mO, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, 0));  // (BLK_M, D)

  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)), typename Traits::SmemLayoutQ{});  // (BLK_M, D)
  Tensor sK = make_tensor(sQ.data() + size(sQ), typename Traits::SmemLayoutKV{});                        // (BLK_N, D)
  Tensor sV = make_tensor(sK.data() + size(sK), typename Traits::SmemLayoutKV{});                        // (BLK_N, D)
  Tensor sVt = make_tensor(sV.data(), typename Traits::SmemLayoutVt{});                                  // (D, BLK_N)
  Tensor sVtNoSwizzle = make_tensor(sV.data().get(), typename Traits::SmemLayoutVtNoSwizzle{});          // (D, BLK_N)

  // Global -> shared copies, with row predicates from identity tensors.
  typename Traits::GmemTiledCopyQKV gmem_tiled_copy;
  auto gmem_thr_copy = gmem_tiled_copy.get_thread_slice(tidx);
  Tensor tQgQ = gmem_thr_copy.partition_S(gQ);  // (CPY, CPY_M, CPY_D)
  Tensor tQsQ = gmem_thr_copy.partition_D(sQ);
  Tensor tKgK = gmem_thr_copy.partition_S(gK);  // (CPY, CPY_N, CPY_D, n)
  Tensor tKsK = gmem_thr_copy.partition_D(sK);
  Tensor tVgV = gmem_thr_copy.partition_S(gV);  // (CPY, CPY_N, CPY_D, n)
  Tensor tVsV = gmem_thr_copy.partition_D(sV);
  Tensor tQcQ = gmem_thr_copy.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tKVcKV = gmem_thr_copy.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));

  // Shared -> register operands of the two MMAs.
  typename Traits::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(tidx);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);             // (MMA, MMA_M, MMA_D)
  Tensor tSrK = thr_mma.partition_fragment_B(sK);             // (MMA, MMA_N, MMA_D)
  Tensor tOrVt = thr_mma.partition_fragment_B(sVtNoSwizzle);  // (MMA, MMA_D, MMA_N)
  Tensor acc_o = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kHeadDim>>{});  // (MMA, MMA_M, MMA_D)

  auto smem_tiled_copy_Q = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_copy_Q = smem_tiled_copy_Q.get_thread_slice(tidx);
  Tensor tSsQ = smem_thr_copy_Q.partition_S(sQ);
  auto smem_tiled_copy_K = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_copy_K = smem_tiled_copy_K.get_thread_slice(tidx);
  Tensor tSsK = smem_thr_copy_K.partition_S(sK);
  auto smem_tiled_copy_V = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, tiled_mma);
  auto smem_thr_copy_V = smem_tiled_copy_V.get_thread_slice(tidx);
  Tensor tOsVt = smem_thr_copy_V.partition_S(sVt);

  // (row, col) of every score this thread holds, for masking.
  Tensor tScS = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  const int row0 = m_block * kBlockM;

  // K and V tiles of pipeline stage s live kStageElems elements after those of stage 0:
  // shared memory holds [Q][K0][V0] for one stage, [Q][K0][V0][K1][V1] for two.
  constexpr int kStageElems = 2 * kBlockN * kHeadDim;
  auto staged = [](auto const& t, int stage) { return make_tensor(t.data() + stage * kStageElems, t.layout()); };
  auto load_k = [&](int n, int stage, int rows_left) {
    copy_rows(gmem_tiled_copy, tKgK(_, _, _, n), staged(tKsK, stage), tKVcKV, rows_left);
  };
  auto load_v = [&](int n, int stage, int rows_left) {
    copy_rows(gmem_tiled_copy, tVgV(_, _, _, n), staged(tVsV, stage), tKVcKV, rows_left);
  };

  // Prologue: Q and the last K tile (the one that may be partial) in one cp.async group;
  // with two stages also that tile's V and, as a second group, the next K and V.
  int n_block = n_block_max - 1;
  copy_rows(gmem_tiled_copy, tQgQ, tQsQ, tQcQ, seqlen_q - row0);
  load_k(n_block, 0, seqlen_k - n_block * kBlockN);
  if constexpr (Traits::kStages == 2) {
    load_v(n_block, 0, seqlen_k - n_block * kBlockN);
    cp_async_fence();
    if (n_block > n_block_min) {
      load_k(n_block - 1, 1, kBlockN);
      load_v(n_block - 1, 1, kBlockN);
    }
  }
  cp_async_fence();

  clear(acc_o);
  // softmax(scale * Q K^T) = softmax(|scale| * (-Q) K^T): for a negative scale negate the Q
  // tile once, so the hot loop always reduces with max (a runtime max-or-min choice costs
  // two predicated FMNMX per score, measured in SASS).
  if (p.scale < 0.f) {
    cp_async_wait<0>();
    __syncthreads();
    for (int i = tidx; i < size(sQ); i += Traits::kNThreads) sQ(i) = -sQ(i);
    __syncthreads();
  }
  OnlineSoftmax<2 * size<1>(acc_o)> softmax(fabsf(p.scale) * kLog2e);
  // Softcap in the units of the raw scores the softmax scales by |scale|: s -> out * tanh(in * s). A
  // scale of 0 (run as the smallest normal float) would overflow `out`: the capped scores are then
  // all 0, which out = 0 gives.
  const float softcap_in = Softcap ? fabsf(p.scale) / p.softcap : 0.f;
  const float softcap_out = Softcap && isfinite(p.softcap / fabsf(p.scale)) ? p.softcap / fabsf(p.scale) : 0.f;

  // S = Q K^T for key tile n (K in `stage`), with keys past the end and, for causal
  // instances, right of the diagonal (local: outside the window) masked when kMask.
  auto qk = [&](int n, auto mask_tag, int stage) {
    Tensor acc_s = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});  // (MMA, MMA_M, MMA_N)
    clear(acc_s);
    gemm_ss(acc_s, tSrQ, tSrK, tSsQ, staged(tSsK, stage), tiled_mma, smem_tiled_copy_Q, smem_tiled_copy_K,
            smem_thr_copy_Q, smem_thr_copy_K);
    if constexpr (Softcap) {  // before the mask, whose -inf it would undo
      CUTE_UNROLL
      for (int i = 0; i < size(acc_s); ++i) acc_s(i) = softcap_out * softcap_tanh(softcap_in * acc_s(i));
    }
    if constexpr (decltype(mask_tag)::value) {
      // One column limit per accumulator row (keys at or past it are hidden), then one int32
      // compare per score: the mask runs on the diagonal tiles of every causal row tile, where
      // 64-bit index math per score cost as much as a share of the tile's MMAs.
      Tensor s = make_tensor(acc_s.data(), rowcol(acc_s.layout()));    // (rows, cols)
      Tensor c = make_tensor(tScS.data(), rowcol(tScS.layout()));      // (row, col) of each score
      const int cols_left = seqlen_k - n * kBlockN;
      CUTE_UNROLL
      for (int mi = 0; mi < size<0>(s); ++mi) {
        int limit = cols_left;
        if constexpr (Causal) {  // key j visible to query i iff j <= i + causal_offset
          const int64_t last = int64_t(row0) + get<0>(c(mi, 0)) + causal_offset - int64_t(n) * kBlockN;
          limit = int(max<int64_t>(-1, min<int64_t>(cols_left - 1, last))) + 1;
        }
        if constexpr (Local) {  // keys [first, limit) of the tile are in row i's window
          const int64_t row = int64_t(row0) + get<0>(c(mi, 0)) - int64_t(n) * kBlockN;
          limit = int(max<int64_t>(-1, min<int64_t>(cols_left - 1, row + hi_off))) + 1;
          const int first = int(max<int64_t>(0, min<int64_t>(kBlockN, row + lo_off)));
          CUTE_UNROLL
          for (int ni = 0; ni < size<1>(s); ++ni) {
            const int col = get<1>(c(0, ni));
            if (col >= limit || col < first) s(mi, ni) = -INFINITY;
          }
          continue;
        }
        CUTE_UNROLL
        for (int ni = 0; ni < size<1>(s); ++ni) {
          if (get<1>(c(0, ni)) >= limit) s(mi, ni) = -INFINITY;
        }
      }
    }
    return acc_s;
  };
  // Online softmax on S, then O += P V (V in `stage`) with P straight from registers.
  auto softmax_pv = [&](auto& acc_s, int stage, auto first_tag) {
    softmax.template update<decltype(first_tag)::value>(make_tensor(acc_s.data(), rowcol(acc_s.layout())),
                                                        make_tensor(acc_o.data(), rowcol(acc_o.layout())));
    Tensor rP = convert_to<Element>(acc_s);
    Tensor tOrP = make_tensor(rP.data(), acc_to_a(rP.layout()));  // (MMA, MMA_M, MMA_N / 2)
    gemm_rs(acc_o, tOrP, tOrVt, staged(tOsVt, stage), tiled_mma, smem_tiled_copy_V, smem_thr_copy_V);
  };

  // One key tile. One stage: a K and a V buffer alternate, V[n] loading under Q K^T and
  // K[n-1] under the softmax and P V. Two stages: tile n-2 loads while n-1 waits and n runs.
  // Inlined at each of its call sites: outlined, it passed the accumulators through a 2.6 KB stack frame.
  auto step = [&](int n, auto mask_tag, auto first_tag) __attribute__((always_inline)) {
    if constexpr (Traits::kStages == 1) {
      cp_async_wait<0>();
      __syncthreads();  // K[n] landed; every warp is done reading V[n+1]
      load_v(n, 0, seqlen_k - n * kBlockN);
      cp_async_fence();
      Tensor acc_s = qk(n, mask_tag, 0);
      cp_async_wait<0>();
      __syncthreads();  // V[n] landed; every warp is done reading K[n]
      if (n > n_block_min) {
        load_k(n - 1, 0, kBlockN);
        cp_async_fence();
      }
      softmax_pv(acc_s, 0, first_tag);
    } else {
      const int stage = (n_block_max - 1 - n) & 1;
      cp_async_wait<1>();
      __syncthreads();  // this stage's K[n] and V[n] landed
      Tensor acc_s = qk(n, mask_tag, stage);
      softmax_pv(acc_s, stage, first_tag);
      __syncthreads();  // every warp is done with this stage
      if (n - 2 >= n_block_min) {
        load_k(n - 2, stage, kBlockN);
        load_v(n - 2, stage, kBlockN);
      }
      cp_async_fence();  // possibly empty: keeps one group per tile for wait<1>
    }
  };

  // Key tiles run from last to first, so the ones that need a mask (the partial last tile,
  // the tiles crossing the diagonal) come first and the main loop carries no mask code; a
  // window's left edge masks the last few tiles again.
  auto needs_mask = [&](int n) {
    const int64_t col0 = int64_t(n) * kBlockN;
    return col0 + kBlockN > seqlen_k || (Causal && col0 + kBlockN - 1 > int64_t(row0) + causal_offset) ||
           (Local && (col0 + kBlockN - 1 > int64_t(row0) + hi_off || col0 < local_last_row + lo_off));
  };
  // The first tile, peeled where it measured faster (causal, and head dims from 128; non-causal
  // d64 lost 2-4% to the larger kernel): O is still zero there, so it skips the rescale. A
  // runtime flag in the shared loop body instead cost non-causal d128 3-6% (bench/NOTES.md, 13).
  if constexpr (Causal || Local || kHeadDim >= 128) {
    if (needs_mask(n_block)) {
      step(n_block, cute::true_type{}, cute::true_type{});
    } else {
      step(n_block, cute::false_type{}, cute::true_type{});
    }
    --n_block;
  }
  if constexpr (Local) {  // masked (right edge), unmasked, masked again (left edge)
    for (; n_block >= n_block_min && needs_mask(n_block); --n_block) step(n_block, cute::true_type{}, cute::false_type{});
    for (; n_block >= n_block_min && !needs_mask(n_block); --n_block) step(n_block, cute::false_type{}, cute::false_type{});
    for (; n_block >= n_block_min; --n_block) step(n_block, cute::true_type{}, cute::false_type{});
  } else {
    for (; n_block >= 0 && needs_mask(n_block); --n_block) step(n_block, cute::true_type{}, cute::false_type{});
    for (; n_block >= 0; --n_block) step(n_block, cute::false_type{}, cute::false_type{});
  }

  // Epilogue: normalize, stage O through shared memory (the Q tile's space: the last
  // barrier above ordered every read of Q) and store 16-byte rows; LSE from one lane per row.
  Tensor lse = softmax.finalize(make_tensor(acc_o.data(), rowcol(acc_o.layout())));
  Tensor rO = convert_to<Element>(acc_o);
  Tensor sO = make_tensor(sQ.data(), typename Traits::SmemLayoutQ{});  // (BLK_M, D)
  auto smem_tiled_copy_O = make_tiled_copy_C(typename Traits::SmemCopyAtomO{}, tiled_mma);
  auto smem_thr_copy_O = smem_tiled_copy_O.get_thread_slice(tidx);
  cute::copy(smem_tiled_copy_O, smem_thr_copy_O.retile_S(rO), smem_thr_copy_O.partition_D(sO));

  if (lse_ptr != nullptr) {
    Tensor tOcO = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    Tensor tOcO_rc = make_tensor(tOcO.data(), rowcol(tOcO.layout()));  // (rows, cols) -> (m, d)
    if (get<1>(tOcO_rc(0, 0)) == 0) {
      CUTE_UNROLL
      for (int mi = 0; mi < size<0>(tOcO_rc); ++mi) {
        const int row = get<0>(tOcO_rc(mi, 0));
        if (row0 + row < seqlen_q) lse_ptr[row] = lse(mi);
      }
    }
  }
  __syncthreads();

  typename Traits::GmemTiledCopyO gmem_tiled_copy_O;
  auto gmem_thr_copy_O = gmem_tiled_copy_O.get_thread_slice(tidx);
  Tensor tOsO = gmem_thr_copy_O.partition_S(sO);  // (CPY, CPY_M, CPY_D)
  Tensor tOgO = gmem_thr_copy_O.partition_D(gO);
  Tensor tOcO = gmem_thr_copy_O.partition_D(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tOrO = make_tensor<Element>(shape(tOgO));
  cute::copy(gmem_tiled_copy_O, tOsO, tOrO);
  CUTE_UNROLL
  for (int m = 0; m < size<1>(tOrO); ++m) {
    if (row0 + get<0>(tOcO(0, m, 0)) < seqlen_q) cute::copy(gmem_tiled_copy_O, tOrO(_, m, _), tOgO(_, m, _));
  }
}

}  // namespace gemmgen::fa2_sm80
