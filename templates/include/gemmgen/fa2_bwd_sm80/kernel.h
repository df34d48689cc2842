// fa2_bwd_sm80: the backward of fused attention on mma.sync (FlashAttention-2's algorithm, our code).
//
// Three kernels per call, all on the caller's stream:
//   prep:    per query row, D = rowsum(dO * O) and the forward's LSE in log2 units (+inf for a row
//            that saw no key, so that its P is 0); the fp32 dQ accumulator cleared.
//   main:    one CTA per (key tile, batch * head). K and V stay in shared memory; the loop walks the
//            query tiles that see this key tile: S = Q K^T, dP = dO V^T, P = exp(scale S - LSE),
//            dS = P (dP - D), then dV += P^T dO, dK += dS^T Q (registers, fp32) and dQ += dS K
//            (fp32 atomics into the workspace; with params.deterministic, plain adds that the key
//            tiles of a query tile make one after another, lowest first, each waiting for its turn
//            on a counter in the workspace). dK (times the scale) and dV are stored at the end.
//   convert: dQ = scale * the accumulator, in dQ's dtype and strides.
// Nothing of size seqlen_q x seqlen_k touches global memory.
//
// Masks come at launch: causal_offset (key j visible to query i iff j <= i + causal_offset;
// INT32_MAX for none), or a sliding window around it (abi.h's local, window_left, window_right).
// Query head h reads key/value head h / (heads / heads_kv) and writes dK and dV of head h
// (GEMMGEN_INFO_READS_GQA: the caller sums each group's). Variable lengths: every grid covers the
// longest sequence, each block finds its sequence's rows (gemmgen/sequence.h) and the workspace
// keeps seqlen_q (the longest) rows per (batch, head).
#pragma once
#include <cmath>
#include <cute/tensor.hpp>

#include "gemmgen/abi.h"
#include "gemmgen/fa2_bwd_sm80/traits.h"
#include "gemmgen/fa2_sm80/utils.h"
#include "gemmgen/sequence.h"
#include "gemmgen/softcap.h"

namespace gemmgen::fa2_bwd_sm80 {
using namespace cute;
using fa2_sm80::convert_to;
using fa2_sm80::copy_rows;
using fa2_sm80::gemm_ss;
using fa2_sm80::rowcol;

constexpr float kLog2e = 1.4426950408889634f;

// Where the call's workspace parts are (launch.h cuts them): rows of every (batch, head) padded to a
// whole number of query tiles, so the main kernel reads LSE and D and adds dQ without predicates.
struct Workspace {
  float* dq_accum;  // [batch * heads, rows_padded, head_dim]
  float* lse_log2;  // [batch * heads, rows_padded]
  float* d;         // [batch * heads, rows_padded]
  int* turns;       // [batch * heads, rows_padded / block_m]: deterministic dQ, the next key tile's turn
  int64_t rows_padded;
};

struct Args {
  GemmgenAttnBwdParams p;
  Workspace ws;
};

CUTE_DEVICE void bh_of(int64_t bh, int heads, int& b, int& h) {
  b = int(bh / heads);
  h = int(bh % heads);
}

// A turn counter read with acquire and written with release semantics at GPU scope: the dQ adds a
// key tile makes before passing the turn are visible to the one that takes it.
__device__ __forceinline__ int load_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void store_release(int* p, int v) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// prep: one warp per query row (padded rows included), 16-byte vectors along the head dim.
template <class Traits>
__global__ void __launch_bounds__(256) prep_kernel(const Args a) {
  using Element = typename Traits::Element;
  constexpr int kVec = 8;
  constexpr int kChunks = Traits::kHeadDim / kVec;
  const GemmgenAttnBwdParams& p = a.p;
  const int64_t bh = blockIdx.y + int64_t(blockIdx.z) * gridDim.y;
  if (bh >= int64_t(p.batch) * p.heads) return;
  const int64_t row = int64_t(blockIdx.x) * 8 + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= a.ws.rows_padded) return;
  int b, h;
  bh_of(bh, p.heads, b, h);
  float* acc = a.ws.dq_accum + (bh * a.ws.rows_padded + row) * Traits::kHeadDim;
  for (int c = lane; c < Traits::kHeadDim / 4; c += 32) reinterpret_cast<float4*>(acc)[c] = make_float4(0, 0, 0, 0);
  if (a.p.deterministic && lane == 0 && row % Traits::kBlockM == 0) {
    a.ws.turns[bh * (a.ws.rows_padded / Traits::kBlockM) + row / Traits::kBlockM] = 0;
  }
  float dot = 0.f;
  float lse2 = INFINITY;
  const Sequence seq = sequence_of(p, b);
  if (row < seq.seqlen_q) {
    const Element* o = static_cast<const Element*>(p.o) + seq.q_start(p.o_batch_stride, p.o_row_stride) +
                       h * p.o_head_stride + row * p.o_row_stride;
    const Element* d_o = static_cast<const Element*>(p.d_o) + seq.q_start(p.do_batch_stride, p.do_row_stride) +
                         h * p.do_head_stride + row * p.do_row_stride;
    for (int c = lane; c < kChunks; c += 32) {
      const uint4 ov = reinterpret_cast<const uint4*>(o)[c];
      const uint4 gv = reinterpret_cast<const uint4*>(d_o)[c];
      const Element* oe = reinterpret_cast<const Element*>(&ov);
      const Element* ge = reinterpret_cast<const Element*>(&gv);
      CUTE_UNROLL
      for (int i = 0; i < kVec; ++i) dot += float(oe[i]) * float(ge[i]);
    }
    const float lse = p.lse[bh * p.seqlen_q + row];
    lse2 = lse == -INFINITY ? INFINITY : lse * kLog2e;
  }
  CUTE_UNROLL
  for (int off = 16; off > 0; off /= 2) dot += __shfl_xor_sync(0xffffffff, dot, off);
  if (lane == 0) {
    a.ws.d[bh * a.ws.rows_padded + row] = dot;
    a.ws.lse_log2[bh * a.ws.rows_padded + row] = lse2;
  }
}

// convert: dQ = scale * accumulator, one warp per query row.
template <class Traits>
__global__ void __launch_bounds__(256) convert_kernel(const Args a) {
  using Element = typename Traits::Element;
  constexpr int kVec = 8;
  constexpr int kChunks = Traits::kHeadDim / kVec;
  const GemmgenAttnBwdParams& p = a.p;
  const int64_t bh = blockIdx.y + int64_t(blockIdx.z) * gridDim.y;
  if (bh >= int64_t(p.batch) * p.heads) return;
  const int64_t row = int64_t(blockIdx.x) * 8 + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= p.seqlen_q) return;
  int b, h;
  bh_of(bh, p.heads, b, h);
  const Sequence seq = sequence_of(p, b);
  if (row >= seq.seqlen_q) return;
  const float* acc = a.ws.dq_accum + (bh * a.ws.rows_padded + row) * Traits::kHeadDim;
  Element* dq = static_cast<Element*>(p.dq) + seq.q_start(p.dq_batch_stride, p.dq_row_stride) + h * p.dq_head_stride +
                row * p.dq_row_stride;
  for (int c = lane; c < kChunks; c += 32) {
    const float4 lo = reinterpret_cast<const float4*>(acc)[2 * c];
    const float4 hi = reinterpret_cast<const float4*>(acc)[2 * c + 1];
    const float v[kVec] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    uint4 out;
    Element* oe = reinterpret_cast<Element*>(&out);
    CUTE_UNROLL
    for (int i = 0; i < kVec; ++i) oe[i] = Element(v[i] * p.scale);
    reinterpret_cast<uint4*>(dq)[c] = out;
  }
}

// Stage a register fragment of `mma`'s C layout (rows x cols) through shared memory `s` (whose
// layout is `SmemLayout`) into global rows `g` (rows_left of them exist), 16 bytes per thread.
template <class Traits, class TiledMma, class Frag, class SmemTensor, class GmemTensor>
CUTE_DEVICE void store_tile(TiledMma const& mma, Frag const& frag, SmemTensor& s, GmemTensor& g, int rows_left) {
  using Element = typename Traits::Element;
  const int tidx = threadIdx.x;
  Tensor r = convert_to<Element>(frag);
  auto smem_copy = make_tiled_copy_C(typename Traits::SmemCopyAtomStore{}, mma);
  auto smem_thr = smem_copy.get_thread_slice(tidx);
  cute::copy(smem_copy, smem_thr.retile_S(r), smem_thr.partition_D(s));
  __syncthreads();
  typename Traits::GmemTiledCopyOut gmem_copy;
  auto gmem_thr = gmem_copy.get_thread_slice(tidx);
  Tensor ts = gmem_thr.partition_S(s);
  Tensor tg = gmem_thr.partition_D(g);
  Tensor tc = gmem_thr.partition_D(make_identity_tensor(shape(g)));
  Tensor tr = make_tensor<Element>(shape(tg));
  cute::copy(gmem_copy, ts, tr);
  CUTE_UNROLL
  for (int m = 0; m < size<1>(tr); ++m) {
    if (get<0>(tc(0, m, 0)) < rows_left) cute::copy(gmem_copy, tr(_, m, _), tg(_, m, _));
  }
}

template <class Traits, bool Softcap>
__global__ void __launch_bounds__(Traits::kNThreads, 1) bwd_kernel(const Args a) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kStages = Traits::kStages;
  // Local copies: the tensors' pointer arithmetic takes its offsets by reference.
  constexpr int kQElems = Traits::kQElems;
  constexpr int kKVElems = Traits::kKVElems;
  constexpr int kPElems = Traits::kPElems;
  const GemmgenAttnBwdParams& p = a.p;

  extern __shared__ __align__(128) char smem[];

  // Deterministic calls launch a 1-D grid, batch * head fastest: key tile 0 of every head starts
  // first, so a CTA that waits for a lower key tile's turn waits on one launched a wave earlier
  // (with key tiles fastest, a head's tiles started together and waited in a chain, holding SMs).
  const int64_t heads = int64_t(p.batch) * p.heads;
  const int n_block = p.deterministic ? int(blockIdx.x / heads) : int(blockIdx.x);
  const int64_t bh = p.deterministic ? int64_t(blockIdx.x % heads) : blockIdx.y + int64_t(blockIdx.z) * gridDim.y;
  if (bh >= heads) return;
  int b, h;
  bh_of(bh, p.heads, b, h);
  const int h_kv = h / (p.heads / p.heads_kv);
  const int tidx = threadIdx.x;
  const Sequence seq = sequence_of(p, b);
  const int seqlen_q = seq.seqlen_q;
  const int seqlen_k = seq.seqlen_k;
  const int64_t causal_offset = seq.causal_offset;
  const int64_t col0 = int64_t(n_block) * kBlockN;
  if (col0 >= seqlen_k) return;  // past a shorter sequence's keys (variable lengths)
  const int keys_left = seqlen_k - int(col0);
  // Key j is visible to query i iff i + lo <= j <= i + hi: hi the causal diagonal (or a window's
  // right edge), lo a window's left edge; a side without a bound lies past every key.
  constexpr int64_t kFar = int64_t(1) << 40;
  const bool local = p.local != 0;
  const int64_t hi = !local ? causal_offset : p.window_right >= 0 ? causal_offset + p.window_right : kFar;
  const int64_t lo = local && p.window_left >= 0 ? causal_offset - p.window_left : -kFar;

  // Query tiles that see a key of this tile: from the first row whose right limit reaches col0 to
  // the last whose left limit reaches the tile's last key.
  int m_end = (seqlen_q + kBlockM - 1) / kBlockM;
  const int64_t last_row = col0 + min(keys_left, kBlockN) - 1 - lo;
  m_end = last_row < 0 ? 0 : int(min<int64_t>(m_end, last_row / kBlockM + 1));
  int m_begin = 0;
  if (hi < col0) m_begin = int(min<int64_t>(m_end, (col0 - hi) / kBlockM));

  const Element* k_ptr = static_cast<const Element*>(p.k) + seq.k_start(p.k_batch_stride, p.k_row_stride) +
                         h_kv * p.k_head_stride;
  const Element* v_ptr = static_cast<const Element*>(p.v) + seq.k_start(p.v_batch_stride, p.v_row_stride) +
                         h_kv * p.v_head_stride;
  const Element* q_ptr = static_cast<const Element*>(p.q) + seq.q_start(p.q_batch_stride, p.q_row_stride) +
                         h * p.q_head_stride;
  const Element* do_ptr = static_cast<const Element*>(p.d_o) + seq.q_start(p.do_batch_stride, p.do_row_stride) +
                          h * p.do_head_stride;
  Element* dk_ptr = static_cast<Element*>(p.dk) + seq.k_start(p.dk_batch_stride, p.dk_row_stride) + h * p.dk_head_stride;
  Element* dv_ptr = static_cast<Element*>(p.dv) + seq.k_start(p.dv_batch_stride, p.dv_row_stride) + h * p.dv_head_stride;
  float* dq_accum = a.ws.dq_accum + bh * a.ws.rows_padded * kHeadDim;
  const float* lse_log2 = a.ws.lse_log2 + bh * a.ws.rows_padded;
  const float* d_rows = a.ws.d + bh * a.ws.rows_padded;

  Tensor mQ = make_tensor(make_gmem_ptr(q_ptr), make_shape(seqlen_q, Int<kHeadDim>{}), make_stride(p.q_row_stride, _1{}));
  Tensor mdO = make_tensor(make_gmem_ptr(do_ptr), make_shape(seqlen_q, Int<kHeadDim>{}), make_stride(p.do_row_stride, _1{}));
  Tensor mK = make_tensor(make_gmem_ptr(k_ptr), make_shape(seqlen_k, Int<kHeadDim>{}), make_stride(p.k_row_stride, _1{}));
  Tensor mV = make_tensor(make_gmem_ptr(v_ptr), make_shape(seqlen_k, Int<kHeadDim>{}), make_stride(p.v_row_stride, _1{}));
  Tensor mdK = make_tensor(make_gmem_ptr(dk_ptr), make_shape(seqlen_k, Int<kHeadDim>{}), make_stride(p.dk_row_stride, _1{}));
  Tensor mdV = make_tensor(make_gmem_ptr(dv_ptr), make_shape(seqlen_k, Int<kHeadDim>{}), make_stride(p.dv_row_stride, _1{}));
  Tensor gQ = local_tile(mQ, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(_, 0));    // (M, D, m)
  Tensor gdO = local_tile(mdO, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(_, 0));  // (M, D, m)
  Tensor gK = local_tile(mK, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, 0));
  Tensor gV = local_tile(mV, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, 0));
  Tensor gdK = local_tile(mdK, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, 0));
  Tensor gdV = local_tile(mdV, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, 0));

  Element* base = reinterpret_cast<Element*>(smem);
  Tensor sQ = make_tensor(make_smem_ptr(base), typename Traits::SmemLayoutQ{});
  Tensor sdO = make_tensor(sQ.data() + kStages * kQElems, typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(sdO.data() + kStages * kQElems, typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(sK.data() + kKVElems, typename Traits::SmemLayoutKV{});
  Tensor sP = make_tensor(sV.data() + kKVElems, typename Traits::SmemLayoutPdS{});
  Tensor sdS = make_tensor(sP.data() + kPElems, typename Traits::SmemLayoutPdS{});
  Tensor sQt = make_tensor(sQ.data(), typename Traits::SmemLayoutQt{});
  Tensor sQtNoSwizzle = make_tensor(sQ.data().get(), typename Traits::SmemLayoutQtNoSwizzle{});
  Tensor sdOt = make_tensor(sdO.data(), typename Traits::SmemLayoutQt{});
  Tensor sdOtNoSwizzle = make_tensor(sdO.data().get(), typename Traits::SmemLayoutQtNoSwizzle{});
  Tensor sKt = make_tensor(sK.data(), typename Traits::SmemLayoutKt{});
  Tensor sKtNoSwizzle = make_tensor(sK.data().get(), typename Traits::SmemLayoutKtNoSwizzle{});
  Tensor sPt = make_tensor(sP.data(), typename Traits::SmemLayoutPdSt{});
  Tensor sPtNoSwizzle = make_tensor(sP.data().get(), typename Traits::SmemLayoutPdStNoSwizzle{});
  Tensor sdSt = make_tensor(sdS.data(), typename Traits::SmemLayoutPdSt{});
  Tensor sdStNoSwizzle = make_tensor(sdS.data().get(), typename Traits::SmemLayoutPdStNoSwizzle{});

  // Global -> shared (cp.async, rows past the end zero-filled).
  typename Traits::GmemTiledCopy gmem_copy;
  auto gmem_thr = gmem_copy.get_thread_slice(tidx);
  Tensor tQgQ = gmem_thr.partition_S(gQ);  // (CPY, CPY_M, CPY_D, m)
  Tensor tQsQ = gmem_thr.partition_D(sQ);
  Tensor tdOgdO = gmem_thr.partition_S(gdO);
  Tensor tdOsdO = gmem_thr.partition_D(sdO);
  Tensor tQcQ = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tKVcKV = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  // Q and dO buffer `stage` lies stage * kQElems after buffer 0.
  auto staged = [](auto const& t, int stage) { return make_tensor(t.data() + stage * kQElems, t.layout()); };
  auto load_q_do = [&](int m, int stage) {
    const int rows_left = seqlen_q - m * kBlockM;
    copy_rows(gmem_copy, tQgQ(_, _, _, m), staged(tQsQ, stage), tQcQ, rows_left);
    copy_rows(gmem_copy, tdOgdO(_, _, _, m), staged(tdOsdO, stage), tQcQ, rows_left);
  };

  // The three MMAs and their shared -> register copies.
  typename Traits::TiledMmaSdP mma_sdp;
  auto thr_sdp = mma_sdp.get_thread_slice(tidx);
  Tensor tSrQ = thr_sdp.partition_fragment_A(sQ);
  Tensor tSrK = thr_sdp.partition_fragment_B(sK);
  Tensor tdPrdO = thr_sdp.partition_fragment_A(sdO);
  Tensor tdPrV = thr_sdp.partition_fragment_B(sV);
  auto copy_sdp_a = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, mma_sdp);
  auto thr_copy_sdp_a = copy_sdp_a.get_thread_slice(tidx);
  Tensor tSsQ = thr_copy_sdp_a.partition_S(sQ);
  Tensor tdPsdO = thr_copy_sdp_a.partition_S(sdO);
  auto copy_sdp_b = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, mma_sdp);
  auto thr_copy_sdp_b = copy_sdp_b.get_thread_slice(tidx);
  Tensor tSsK = thr_copy_sdp_b.partition_S(sK);
  Tensor tdPsV = thr_copy_sdp_b.partition_S(sV);

  typename Traits::TiledMmaKV mma_kv;
  auto thr_kv = mma_kv.get_thread_slice(tidx);
  Tensor tdVrPt = thr_kv.partition_fragment_A(sPtNoSwizzle);
  Tensor tdVrdOt = thr_kv.partition_fragment_B(sdOtNoSwizzle);
  Tensor tdKrdSt = thr_kv.partition_fragment_A(sdStNoSwizzle);
  Tensor tdKrQt = thr_kv.partition_fragment_B(sQtNoSwizzle);
  auto copy_kv_a = make_tiled_copy_A(typename Traits::SmemCopyAtomTransposed{}, mma_kv);
  auto thr_copy_kv_a = copy_kv_a.get_thread_slice(tidx);
  Tensor tdVsPt = thr_copy_kv_a.partition_S(sPt);
  Tensor tdKsdSt = thr_copy_kv_a.partition_S(sdSt);
  auto copy_kv_b = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, mma_kv);
  auto thr_copy_kv_b = copy_kv_b.get_thread_slice(tidx);
  Tensor tdVsdOt = thr_copy_kv_b.partition_S(sdOt);
  Tensor tdKsQt = thr_copy_kv_b.partition_S(sQt);

  typename Traits::TiledMmaQ mma_q;
  auto thr_q = mma_q.get_thread_slice(tidx);
  Tensor tdQrdS = thr_q.partition_fragment_A(sdS);
  Tensor tdQrKt = thr_q.partition_fragment_B(sKtNoSwizzle);
  auto copy_q_a = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, mma_q);
  auto thr_copy_q_a = copy_q_a.get_thread_slice(tidx);
  Tensor tdQsdS = thr_copy_q_a.partition_S(sdS);
  auto copy_q_b = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, mma_q);
  auto thr_copy_q_b = copy_q_b.get_thread_slice(tidx);
  Tensor tdQsKt = thr_copy_q_b.partition_S(sKt);
  Tensor tdQcdQ = thr_q.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));

  // P and dS: registers -> shared.
  auto copy_pds = make_tiled_copy_C(typename Traits::SmemCopyAtomStore{}, mma_sdp);
  auto thr_copy_pds = copy_pds.get_thread_slice(tidx);
  Tensor tPsP = thr_copy_pds.partition_D(sP);
  Tensor tdSsdS = thr_copy_pds.partition_D(sdS);

  Tensor acc_dk = partition_fragment_C(mma_kv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  Tensor acc_dv = partition_fragment_C(mma_kv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  clear(acc_dk);
  clear(acc_dv);

  if (m_begin < m_end) {
    // Prologue: K, V and the first Q, dO tile in one cp.async group.
    copy_rows(gmem_copy, gmem_thr.partition_S(gK), gmem_thr.partition_D(sK), tKVcKV, keys_left);
    copy_rows(gmem_copy, gmem_thr.partition_S(gV), gmem_thr.partition_D(sV), tKVcKV, keys_left);
    load_q_do(m_begin, 0);
    cp_async_fence();

    // (row, col) of every score this thread holds.
    Tensor tScS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
    Tensor cS = make_tensor(tScS.data(), rowcol(tScS.layout()));
    constexpr int kRows = decltype(size<0>(cS))::value;
    const float scale_log2 = p.scale * kLog2e;
    // Softcap: the forward's scores are softcap * tanh(scale * s / softcap), their derivative by s
    // scale * (1 - tanh^2); the scale joins dK and dQ at their stores.
    const float cap_in = Softcap ? p.scale / p.softcap : 0.f;
    const float cap_log2 = Softcap ? p.softcap * kLog2e : 0.f;

    for (int m = m_begin; m < m_end; ++m) {
      const int stage = kStages == 2 ? (m - m_begin) & 1 : 0;
      if constexpr (kStages == 2) {
        // The other buffer was last read in the previous step, which ended on a barrier.
        if (m + 1 < m_end) load_q_do(m + 1, stage ^ 1);
        cp_async_fence();
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();

      // This thread's rows' LSE and D, loaded before the GEMMs so that their latency hides under them.
      const int row0 = m * kBlockM;
      float lse_r[kRows], d_r[kRows];
      CUTE_UNROLL
      for (int mi = 0; mi < kRows; ++mi) {
        lse_r[mi] = lse_log2[row0 + get<0>(cS(mi, 0))];
        d_r[mi] = d_rows[row0 + get<0>(cS(mi, 0))];
      }
      Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
      Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
      clear(acc_s);
      clear(acc_dp);
      gemm_ss(acc_s, tSrQ, tSrK, staged(tSsQ, stage), tSsK, mma_sdp, copy_sdp_a, copy_sdp_b, thr_copy_sdp_a,
              thr_copy_sdp_b);
      gemm_ss(acc_dp, tdPrdO, tdPrV, staged(tdPsdO, stage), tdPsV, mma_sdp, copy_sdp_a, copy_sdp_b, thr_copy_sdp_a,
              thr_copy_sdp_b);

      // P = exp(scale S - LSE) (0 where masked), dS = P (dP - D), in place.
      const bool masked = keys_left < kBlockN || col0 + kBlockN - 1 > int64_t(row0) + hi ||
                          col0 < int64_t(row0) + kBlockM - 1 + lo;
      Tensor s = make_tensor(acc_s.data(), rowcol(acc_s.layout()));
      Tensor dp = make_tensor(acc_dp.data(), rowcol(acc_dp.layout()));
      CUTE_UNROLL
      for (int mi = 0; mi < size<0>(s); ++mi) {
        const int row = get<0>(cS(mi, 0));
        const float lse = lse_r[mi];
        const float dd = d_r[mi];
        // This row sees tile columns [first, first + width): one unsigned compare per score.
        int first = 0, width = kBlockN;
        if (masked) {
          const int64_t r = int64_t(row0) + row - col0;
          first = int(max<int64_t>(0, min<int64_t>(kBlockN, r + lo)));
          const int limit = int(max<int64_t>(0, min<int64_t>(min(keys_left, kBlockN), r + hi + 1)));
          width = max(limit - first, 0);
        }
        CUTE_UNROLL
        for (int ni = 0; ni < size<1>(s); ++ni) {
          float pv, grad;
          if constexpr (Softcap) {
            const float t = softcap_tanh(cap_in * s(mi, ni));
            pv = exp2f(cap_log2 * t - lse);
            grad = pv * (dp(mi, ni) - dd) * (1.f - t * t);
          } else {
            pv = exp2f(fmaf(s(mi, ni), scale_log2, -lse));
            grad = pv * (dp(mi, ni) - dd);
          }
          const bool hidden = unsigned(get<1>(cS(0, ni)) - first) >= unsigned(width);
          s(mi, ni) = hidden ? 0.f : pv;
          dp(mi, ni) = hidden ? 0.f : grad;
        }
      }
      Tensor rP = convert_to<Element>(acc_s);
      Tensor rdS = convert_to<Element>(acc_dp);
      cute::copy(copy_pds, thr_copy_pds.retile_S(rP), tPsP);
      cute::copy(copy_pds, thr_copy_pds.retile_S(rdS), tdSsdS);
      __syncthreads();

      gemm_ss(acc_dv, tdVrPt, tdVrdOt, tdVsPt, staged(tdVsdOt, stage), mma_kv, copy_kv_a, copy_kv_b, thr_copy_kv_a,
              thr_copy_kv_b);
      gemm_ss(acc_dk, tdKrdSt, tdKrQt, tdKsdSt, staged(tdKsQt, stage), mma_kv, copy_kv_a, copy_kv_b, thr_copy_kv_a,
              thr_copy_kv_b);
      if constexpr (kStages == 1) {
        __syncthreads();  // every warp is done with Q and dO: the next tile loads under dQ's GEMM
        if (m + 1 < m_end) load_q_do(m + 1, 0);
        cp_async_fence();
      }

      Tensor acc_dq = partition_fragment_C(mma_q, Shape<Int<kBlockM>, Int<kHeadDim>>{});
      clear(acc_dq);
      gemm_ss(acc_dq, tdQrdS, tdQrKt, tdQsdS, tdQsKt, mma_q, copy_q_a, copy_q_b, thr_copy_q_a, thr_copy_q_b);
      float* dq_rows = dq_accum + int64_t(row0) * kHeadDim;
      // Deterministic calls: this key tile's turn at query tile m. The key tiles that see m are a
      // contiguous range (m_begin and m_end never decrease with the key tile) from the first whose
      // last key reaches m's first row through the window's left edge; one at a time, in order, adds
      // its part (atomics, each element once per tile, so the sums' order is fixed) and passes on.
      int* turn = a.ws.turns + bh * (a.ws.rows_padded / kBlockM) + m;
      int place = 0;
      if (p.deterministic) {
        const int64_t x = int64_t(row0) + lo - kBlockN + 1;
        place = n_block - (x <= 0 ? 0 : int((x + kBlockN - 1) / kBlockN));
        if (tidx == 0) {
          while (load_acquire(turn) != place) {
          }
        }
        __syncthreads();
      }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      // Elements 2i and 2i + 1 of an m16n8 accumulator are one row's adjacent columns (the first
      // mode is (column pair, row + 8)): one 8-byte atomic each.
      CUTE_UNROLL
      for (int i = 0; i < size(acc_dq); i += 2) {
        atomicAdd(reinterpret_cast<float2*>(dq_rows + get<0>(tdQcdQ(i)) * kHeadDim + get<1>(tdQcdQ(i))),
                  make_float2(acc_dq(i), acc_dq(i + 1)));
      }
#else
      CUTE_UNROLL
      for (int i = 0; i < size(acc_dq); ++i) {
        atomicAdd(dq_rows + get<0>(tdQcdQ(i)) * kHeadDim + get<1>(tdQcdQ(i)), acc_dq(i));
      }
#endif
      if (p.deterministic) {
        __threadfence();  // this CTA's additions land before the next key tile takes the turn
        __syncthreads();
        if (tidx == 0) store_release(turn, place + 1);
      }
      __syncthreads();  // every warp is done with P, dS and this step's Q, dO buffer
    }
  }

  // dK = scale dS^T Q, dV: through the K and V tiles' space (the last barrier ordered their reads).
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dk); ++i) acc_dk(i) *= p.scale;
  store_tile<Traits>(mma_kv, acc_dk, sK, gdK, keys_left);
  store_tile<Traits>(mma_kv, acc_dv, sV, gdV, keys_left);
}

}  // namespace gemmgen::fa2_bwd_sm80
