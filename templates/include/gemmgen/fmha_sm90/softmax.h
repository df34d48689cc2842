// The fmha_sm90 family's online softmax with a lazy rescale of O.
//
// Why: after each key tile the online softmax multiplies the output accumulators (and row sums) by
// 2^(old max - new max); at d64 that is one FP32 multiply per two scores, at d128 one per score, on
// the pipes that bound the softmax (bench/NOTES.md, experiments 40-41). Taking the probabilities
// against a maximum that may lag the true one by up to kRescaleAbove keeps them bounded by
// 2^kRescaleAbove and the result exact in real arithmetic (O and the sums share the same factor),
// so the rescale is needed only when a maximum grows by more than that.
//
// Speculation (kSpeculate): a later key tile's probabilities are first taken against the maximum
// held so far, with no row maximum computed; this thread's sum of them over the tile bounds each
// one, so a sum of at most 2^kRescaleAbove shows that no maximum grew past the bound, and the tile
// is done. Only when a sum exceeds it (at the first key tiles of a row at most, in practice) does
// the warp take the exact maxima, rescale, and take the probabilities again from the scores, kept
// for that. The maximum costs a comparison per score, shuffles and a vote on every tile; skipping
// them was +5-14% (bench/NOTES.md, experiment 44), at one more fp32 tile of registers.
//
// How it plugs in: CUTLASS's Hopper FMHA mainloops name their softmax as
// CollectiveSoftmax<Accumulator, Fusion, Params>. LazyRescale<Mask> is a Fusion (the Mask's masking
// and key-tile counts, inherited), and the specialization below is the softmax the mainloops then
// instantiate: the same interface and online-softmax arithmetic, our code.
#pragma once
#include <cmath>
#include <cstdint>
#include <type_traits>


#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"

#include "88_hopper_fmha/collective/fmha_collective_softmax.hpp"
#include "88_hopper_fmha/collective/fmha_common.hpp"

#include "gemmgen/fmha_sm90/bias.h"

namespace gemmgen::fmha_sm90 {

// A Fusion: Mask's masking and trip counts; its softmax leaves O and the row sums unscaled while no
// row maximum of a warp has grown by more than kRescaleAbove (in log2 units of the scaled scores).
// kSoftcap: a logit softcap c (Gemma 2's): the scaled scores s become c * tanh(s / c) before the
// mask (the launcher passes c in the params' scale_softmax_log2, which this softmax then derives
// from scale_softmax). BiasElement: an additive mask (attn_mask) in the inputs' type, added to the
// scaled (and capped) scores before the mask (void: none); kBlockN the key tile's width.
template <class Mask, bool kSpeculate = false, bool kDescaled = false, bool kSoftcap = false,
          class BiasElement = void, int kBlockN = 0>
struct LazyRescale : Mask {};

// Descaled (fp8) instances: the factors of the row tile a consumer warp is about to compute, q's
// times k's (of the scores) and v's (of O), in a shared-memory slot per warp. The kernel's consumer
// warps set theirs before each compute() (one lane writes, __syncwarp), and the softmax reads them
// where it uses its scale; the next write comes after the epilogue's barrier, which every thread of
// the group reaches after its last read. (The mainloop hands the softmax its params only; a
// per-tile copy of those took a stack frame and spilled.) 32 slots: 256 bytes of static shared
// memory in the fp8 kernels (FmhaSm90Instance.smem_bytes counts them).
struct TileFactors {
  float qk;
  float v;
};
CUTLASS_DEVICE TileFactors& tile_factors() {
  __shared__ TileFactors slots[32];  // by the CTA's warp (a CTA has at most 20)
  return slots[threadIdx.x / 32];
}

// Probabilities are taken against a row maximum up to this far below the true one: at most 2^8,
// which fp32 sums and fp16/bf16 probabilities hold with their full relative precision.
constexpr float kRescaleAbove = 8.f;

}  // namespace gemmgen::fmha_sm90

namespace cutlass::fmha::collective {

template <class Mask, bool kSpeculate, bool kDescaled, bool kSoftcap, class BiasElement, int kBlockN, class Params>
struct CollectiveSoftmax<float,
                         gemmgen::fmha_sm90::LazyRescale<Mask, kSpeculate, kDescaled, kSoftcap, BiasElement, kBlockN>,
                         Params> {
  using Fusion = gemmgen::fmha_sm90::LazyRescale<Mask, kSpeculate, kDescaled, kSoftcap, BiasElement, kBlockN>;
  static constexpr float kBound = float(1 << int(gemmgen::fmha_sm90::kRescaleAbove));  // 2^kRescaleAbove
  // Bias instances hold the scores in scaled units (scale * s + bias: the bias is in those units)
  // and take the softmax with scale 1. The speculative step assumes every row sees key 0, which a
  // bias may hide (a left-padded row's first keys); with the bias registers held ahead it also
  // spilled (d128 128x128: 100 bytes, 14% slower on the H100: bench/NOTES.md, experiment 93).
  static constexpr bool kBias = !std::is_void_v<BiasElement>;
  static_assert(!kBias || (!kSpeculate && !kDescaled && kBlockN % 8 == 0), "a bias runs the plain 16-bit step");
  // The next key tile's bias pairs of this thread (a 64-row group's tile of kBlockN keys holds
  // kBlockN / 2 scores per thread, in pairs of adjacent keys), loaded one key tile ahead: a load
  // where it is added waited for memory after every Q K^T.
  static constexpr int kPairs = kBias ? kBlockN / 4 : 1;
  uint32_t bias_ahead[kPairs];
  int next_class = gemmgen::fmha_sm90::kMixed;   // of the key tile after the current one
  int after_class = gemmgen::fmha_sm90::kMixed;  // of the one after that
  // The scores' scale (natural and log2) and O's final factor: the params', times the row tile's
  // factors where descaled, read where used (held in registers through the tile, they made the fp8
  // d128 tile spill 400 bytes; the params' own values are operands from the constant bank).
  Params const& params;
  CUTLASS_DEVICE CollectiveSoftmax(Params const& p) : params(p) {}
  CUTLASS_DEVICE float scale_log2() const {
    if constexpr (kBias) return float(M_LOG2E);  // (scores already scaled: add_bias)
    if constexpr (kSoftcap) return params.scale_softmax * float(M_LOG2E);  // (scale_softmax_log2 holds c)
    if constexpr (kDescaled) return params.scale_softmax_log2 * gemmgen::fmha_sm90::tile_factors().qk;
    return params.scale_softmax_log2;
  }
  CUTLASS_DEVICE float scale() const {
    if constexpr (kBias) return 1.f;
    if constexpr (kDescaled) return params.scale_softmax * gemmgen::fmha_sm90::tile_factors().qk;
    return params.scale_softmax;
  }
  CUTLASS_DEVICE float o_factor() const {
    if constexpr (kDescaled) return params.rp_dropout * gemmgen::fmha_sm90::tile_factors().v;
    return params.rp_dropout;
  }

  // Softcap: the raw scores s become out * tanh(in * s), in = scale / c and out = c / scale, so that
  // the scaled ones are c * tanh(scale * s / c); before the mask, whose -inf it would undo. tanh as
  // 1 - 2 / (e^2x + 1), as the backward (fmha_bwd_sm90) and fa2_sm80 take it: the backward's P,
  // recomputed from the forward's LSE, then matches. A scale of 0 (run as the smallest normal
  // float) would overflow `out`: the capped scores are then all 0, which out = 0 gives.
  template <class AccQK>
  CUTLASS_DEVICE void cap(AccQK& acc_qk) const {
    if constexpr (kSoftcap) {
      const float c = params.scale_softmax_log2, in = params.scale_softmax / c;
      const float out = ::isfinite(c / params.scale_softmax) ? c / params.scale_softmax : 0.f;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(acc_qk); ++i) {
        acc_qk(i) = out * (1.f - __fdividef(2.f, __expf(2.f * in * acc_qk(i)) + 1.f));
      }
    }
  }

  // The bias of the key tile whose scores `count` indexes (key `shift` tiles on), into bias_ahead:
  // a pair of adjacent keys per load, 0 for rows and keys past the problem's (a row's last key
  // alone where the key count is odd, so no load reaches past a row's last element).
  template <class CountQK, class ProblemShape>
  CUTLASS_DEVICE void load_bias(CountQK const& count, ProblemShape const& ps, int shift) {
    if constexpr (kBias) {
      gemmgen::fmha_sm90::TileBias const& slot = gemmgen::fmha_sm90::tile_bias();
      auto const* rows = static_cast<uint16_t const*>(slot.ptr);
      const int64_t row_stride = slot.row_stride;
      const int nq = int(get<2>(ps)), nk = int(get<3>(ps));
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kPairs; ++i) {
        auto pos = count(2 * i);  // (row, key); element 2i + 1 is key + 1 of the same row
        const int row = int(get<0>(pos)), key = int(get<1>(pos)) + shift;
        uint16_t const* at = rows + row * row_stride + key;
        uint32_t v = 0;
        if (row < nq && key + 1 < nk) {
          v = __ldg(reinterpret_cast<uint32_t const*>(at));
        } else if (row < nq && key < nk) {
          v = __ldg(reinterpret_cast<unsigned short const*>(at));
        }
        bias_ahead[i] = v;
      }
    }
  }

  // The class (bias.h) of this warp group's key tile `tile` (mixed where none were sorted; visible
  // past the row's last tile, where nothing is loaded).
  CUTLASS_DEVICE static int class_of(int tile) {
    gemmgen::fmha_sm90::TileBias const& slot = gemmgen::fmha_sm90::tile_bias();
    if (slot.classes == nullptr) return gemmgen::fmha_sm90::kMixed;
    return tile < slot.key_tiles ? int(__ldg(slot.classes + tile)) : int(gemmgen::fmha_sm90::kVisible);
  }

  // The scores of a key tile made ready for the softmax: capped where a softcap applies; in bias
  // instances, in scaled units plus the tile's bias (mixed tiles; visible ones are scaled only), the
  // next key tile's bias requested when it is mixed and the class of the one after that. The
  // classes run ahead so that no load waits: the next tile's bias is in flight through this tile's
  // P V and the next Q K^T, its class was requested a tile before. Returns whether the tile is
  // hidden (every score -inf: the caller skips its softmax). `first`: a row tile's first key tile,
  // whose class and bias are loaded here.
  template <class AccQK, class CountQK, class ProblemShape>
  CUTLASS_DEVICE bool prepare(AccQK& acc_qk, CountQK const& count, ProblemShape const& ps, bool first) {
    if constexpr (kBias) {
      static_assert(decltype(size(acc_qk))::value == 2 * kPairs, "a 64-row group's tile of kBlockN keys");
      const int tile = int(get<1>(count(0))) / kBlockN;
      int now;
      if (first) {
        now = class_of(tile);
        next_class = class_of(tile + 1);
        after_class = class_of(tile + 2);
        if (now == gemmgen::fmha_sm90::kMixed) load_bias(count, ps, 0);
      } else {
        now = next_class;
        next_class = after_class;
        after_class = class_of(tile + 2);
      }
      if (now == gemmgen::fmha_sm90::kHidden) {
        if (next_class == gemmgen::fmha_sm90::kMixed) load_bias(count, ps, kBlockN);
        return true;
      }
      cap(acc_qk);
      if (now == gemmgen::fmha_sm90::kMixed) {
        const float k = kSoftcap ? 1.f : params.scale_softmax;  // (the cap's output is scaled already)
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < kPairs; ++i) {
          const float2 b = gemmgen::fmha_sm90::bias_pair(bias_ahead[i], static_cast<BiasElement const*>(nullptr));
          acc_qk(2 * i) = fmaf(acc_qk(2 * i), k, b.x);
          acc_qk(2 * i + 1) = fmaf(acc_qk(2 * i + 1), k, b.y);
        }
      } else if constexpr (!kSoftcap) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(acc_qk); ++i) acc_qk(i) *= params.scale_softmax;
      }
      if (next_class == gemmgen::fmha_sm90::kMixed) load_bias(count, ps, kBlockN);
      return false;
    } else {
      cap(acc_qk);
      return false;
    }
  }

  // State, per held row: the maximum its probabilities are taken against (a raw score, at most
  // kRescaleAbove below the row's true maximum so far) and the sum of its probabilities.
  template <class AccPV, class TiledMmaPV>
  CUTLASS_DEVICE auto init(AccPV const& acc_pv, TiledMmaPV const& mma_pv) {
    Tensor row_max = make_tensor<float>(size<0>(layout_acc_mn(mma_pv, acc_pv.layout())));
    Tensor row_sum = make_tensor<float>(size<0>(layout_acc_mn(mma_pv, acc_pv.layout())));
    return make_tuple(row_max, row_sum);
  }

  // Each row's value combined over the threads that hold parts of the row (a butterfly over their
  // lanes), so that all of them end with the whole row's.
  template <class RowVals, class TiledMma, class Op>
  CUTLASS_DEVICE static void across_row(RowVals& v, TiledMma const& mma, Op op) {
    auto lanes = reduction_target_n(mma);  // the lane strides of a row's threads
    for_each(make_seq<decltype(rank(lanes))::value>{}, [&](auto r) {
      CUTLASS_PRAGMA_UNROLL
      for (int j = 1; j < shape<r>(lanes); j *= 2) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(v); ++i) v(i) = op(v(i), __shfl_xor_sync(0xffffffffu, v(i), stride<r>(lanes) * j));
      }
    });
  }

  // The row maxima over s (rows, columns), which the threads of a row hold in parts.
  template <class AccMN, class TiledMma, class RowMax>
  CUTLASS_DEVICE static void take_max(AccMN const& s, TiledMma const& mma, RowMax& row_max) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size<0>(s); ++i) {
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < size<1>(s); ++j) row_max(i) = fmaxf(row_max(i), s(i, j));
    }
    across_row(row_max, mma, [](float a, float b) { return fmaxf(a, b); });
  }

  // p (rows, columns) = 2^(scale_log2 * (s - row max)); a row that has seen only masked scores is
  // taken relative to 0. p may be s itself.
  template <class AccMN, class RowMax, class P>
  CUTLASS_DEVICE void exponentiate(AccMN const& s, RowMax const& row_max, P& p) const {
    const float k = scale_log2();
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size<0>(s); ++i) {
      const float shift = k * (row_max(i) == -INFINITY ? 0.f : row_max(i));
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < size<1>(s); ++j) p(i, j) = ::exp2f(k * s(i, j) - shift);
    }
  }
  template <class AccMN, class RowMax>
  CUTLASS_DEVICE void exponentiate(AccMN& s, RowMax const& row_max) const {
    exponentiate(s, row_max, s);
  }

  // The row maxima after key tile s. While no row of the warp has grown by more than kRescaleAbove,
  // the old maxima stay (the probabilities of this tile then reach at most 2^kRescaleAbove) and O
  // and the row sums are left as they are: the rescale of O costs one multiply per O element, as
  // many FP32 instructions as an eighth to a quarter of the softmax, and after the first few key
  // tiles a row's maximum seldom grows that much. Otherwise every row moves to its new maximum.
  // The choice is the warp's (a vote), so its threads do not diverge; each row is held by threads of
  // one warp, which agree on its maximum.
  template <class AccMN, class TiledMma, class RowMax, class RowSum, class AccPV, class TiledMmaPV>
  CUTLASS_DEVICE void update_max(AccMN const& s, TiledMma const& mma, RowMax& row_max, RowSum& row_sum,
                                 AccPV& acc_pv, TiledMmaPV const& mma_pv) const {
    Tensor now = make_fragment_like(row_max);
    copy(row_max, now);
    take_max(s, mma, now);
    bool grown = false;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(now); ++i) {
      // (-inf) - (-inf) is NaN and compares false: a row still without a key stays at -inf.
      grown |= (now(i) - row_max(i)) * scale_log2() > gemmgen::fmha_sm90::kRescaleAbove;
    }
    if (!__any_sync(0xffffffffu, grown)) return;
    Tensor o = make_tensor(acc_pv.data(), layout_acc_mn(mma_pv, acc_pv.layout()));
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size<0>(o); ++i) {
      const float to = now(i) == -INFINITY ? 0.f : now(i);
      const float factor = ::exp2f((row_max(i) - to) * scale_log2());
      row_sum(i) *= factor;
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < size<1>(o); ++j) o(i, j) *= factor;
      row_max(i) = now(i);
    }
  }

  // The first key tile of a row tile.
  template <class AccQK, class TiledMmaQK, class CountQK, class State, class ProblemShape>
  CUTLASS_DEVICE void step(AccQK& acc_qk, TiledMmaQK const& mma_qk, CountQK const& count_qk, State& state,
                           ProblemShape const& problem_shape) {
    auto& row_max = get<0>(state);
    auto& row_sum = get<1>(state);
    fill(row_max, -INFINITY);
    if (prepare(acc_qk, count_qk, problem_shape, /*first=*/true)) {  // a hidden tile: P = 0
      fill(row_sum, 0.f);
      fill(acc_qk, 0.f);
      return;
    }
    Fusion{}.before_softmax(acc_qk, count_qk, problem_shape);
    Tensor s = make_tensor(acc_qk.data(), layout_acc_mn(mma_qk, acc_qk.layout()));
    take_max(s, mma_qk, row_max);
    exponentiate(s, row_max);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size<0>(s); ++i) row_sum(i) = reduce(s(i, _), cute::plus{});
  }

  // A later key tile (the warp-specialized mainloops): maxima (O rescaled if one grew past the
  // bound), probabilities, sums.
  template <bool kUseFusion = true, class AccQK, class TiledMmaQK, class CountQK, class State, class AccPV,
            class TiledMmaPV, class ProblemShape>
  CUTLASS_DEVICE void step(AccQK& acc_qk, TiledMmaQK const& mma_qk, CountQK const& count_qk, State& state,
                           AccPV& acc_pv, TiledMmaPV const& mma_pv, ProblemShape const& problem_shape) {
    if (prepare(acc_qk, count_qk, problem_shape, /*first=*/false)) {  // a hidden tile: P = 0
      fill(acc_qk, 0.f);
      return;
    }
    if constexpr (kUseFusion) Fusion{}.before_softmax(acc_qk, count_qk, problem_shape);
    Tensor s = make_tensor(acc_qk.data(), layout_acc_mn(mma_qk, acc_qk.layout()));
    auto& row_max = get<0>(state);
    auto& row_sum = get<1>(state);
    if constexpr (kSpeculate) {
      // The held maxima are finite here: the first key tile holds key 0, which every row sees (no
      // mask hides it), so no row is taken relative to 0 by speculation.
      Tensor p = make_fragment_like(s);
      Tensor part = make_fragment_like(row_sum);  // this thread's sums over the tile
      exponentiate(s, row_max, p);
      bool bounded = true;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size<0>(p); ++i) {
        part(i) = reduce(p(i, _), cute::plus{});
        bounded &= part(i) <= kBound;  // NaN: false
      }
      if (__all_sync(0xffffffffu, bounded)) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(s); ++i) s(i) = p(i);
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size<0>(s); ++i) row_sum(i) += part(i);
        return;
      }
      // Otherwise the plain step below, on the scores s still holds.
    }
    update_max(s, mma_qk, row_max, row_sum, acc_pv, mma_pv);
    exponentiate(s, row_max);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size<0>(s); ++i) row_sum(i) += reduce(s(i, _), cute::plus{});
  }

  // A later key tile (the TMA mainloop), first half: maxima (O rescaled if one grew past the bound);
  // the probabilities follow chunk by chunk (step_interleave_step) between the P V MMAs.
  template <bool kUseFusion = true, class AccQK, class TiledMmaQK, class CountQK, class State, class AccPV,
            class TiledMmaPV, class ProblemShape>
  CUTLASS_DEVICE void step_interleave_begin(AccQK& acc_qk, TiledMmaQK const& mma_qk, CountQK const& count_qk,
                                            State& state, AccPV& acc_pv, TiledMmaPV const& mma_pv,
                                            ProblemShape const& problem_shape) {
    prepare(acc_qk, count_qk, problem_shape, /*first=*/false);
    if constexpr (kUseFusion) Fusion{}.before_softmax(acc_qk, count_qk, problem_shape);
    Tensor s = make_tensor(acc_qk.data(), layout_acc_mn(mma_qk, acc_qk.layout()));
    update_max(s, mma_qk, get<0>(state), get<1>(state), acc_pv, mma_pv);
  }

  template <class AccMN, class State>
  CUTLASS_DEVICE void step_interleave_step(AccMN& s, State& state) {
    exponentiate(s, get<0>(state));
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size<0>(s); ++i) {
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < size<1>(s); ++j) get<1>(state)(i) += s(i, j);
    }
  }

  // After the last key tile: whole-row sums, O normalized, LSE (+inf for a row with no weight, as
  // CUTLASS's softmax gives it; -inf, gemmgen's convention, where a bias may hide a row's keys).
  template <class State, class AccPV, class TiledMmaPV>
  CUTLASS_DEVICE auto tail(State& state, AccPV& acc_pv, TiledMmaPV const& mma_pv) {
    auto& row_max = get<0>(state);
    auto& row_sum = get<1>(state);
    Tensor o = make_tensor(acc_pv.data(), layout_acc_mn(mma_pv, acc_pv.layout()));
    across_row(row_sum, mma_pv, [](float a, float b) { return a + b; });
    Tensor lse = make_fragment_like(row_sum);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size<0>(o); ++i) {
      const float sum = row_sum(i);
      const bool empty = sum == 0.f || sum != sum;
      lse(i) = empty ? (kBias ? -INFINITY : INFINITY) : row_max(i) * scale() + __logf(sum);
      const float factor = o_factor() * (empty ? 1.f : __frcp_rn(sum));
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < size<1>(o); ++j) o(i, j) *= factor;
    }
    return lse;
  }
};

}  // namespace cutlass::fmha::collective
