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
#include "gemmgen/philox/philox.h"
#include "gemmgen/softcap.h"

namespace gemmgen::fmha_sm90 {

// A Fusion: Mask's masking and trip counts; its softmax leaves O and the row sums unscaled while no
// row maximum of a warp has grown by more than kRescaleAbove (in log2 units of the scaled scores).
// kSoftcap: a logit softcap c (Gemma 2's): the scaled scores s become c * tanh(s / c) before the
// mask (the launcher passes c in the params' scale_softmax_log2, which this softmax then derives
// from scale_softmax). BiasElement: an additive mask (attn_mask) in the inputs' type, added to the
// scaled (and capped) scores before the mask (void: none); kBlockN the key tile's width.
// With a sorted bias a row tile runs its listed key tiles only (bias.h): the trip counts of the
// tiles before the mask's masked ones are the list's, which the warp's TileBias slot holds.
// kDropout: the probabilities are dropped by gemmgen's Philox mask (philox.h) after the row sums
// take them (the sums, LSE and normalization are of the weights before dropout; O's final factor
// holds 1 / (1 - p)), the row tile's stream position read from the warp's TileDropout slot.
template <class Mask, bool kSpeculate = false, bool kDescaled = false, bool kSoftcap = false,
          class BiasElement = void, int kBlockN = 0, bool kDropout = false>
struct LazyRescale : Mask {
  static constexpr bool kDrops = kDropout;
  CUTLASS_DEVICE static uint32_t const* list() {
    if constexpr (std::is_void_v<BiasElement>) {
      return nullptr;
    } else {
      return tile_bias().list;
    }
  }
  template <class BlkCoord, class TileShape, class ProblemShape>
  CUTLASS_DEVICE int get_trip_count(BlkCoord const& blk, TileShape const& tile, ProblemShape const& ps) {
    if (uint32_t const* l = list()) return int(l[0]);
    return Mask::get_trip_count(blk, tile, ps);
  }
  template <class BlkCoord, class TileShape, class ProblemShape>
  CUTLASS_DEVICE int get_unmasked_trip_count(BlkCoord const& blk, TileShape const& tile, ProblemShape const& ps) {
    if (uint32_t const* l = list()) return int(l[1]);
    return Mask::get_unmasked_trip_count(blk, tile, ps);
  }
  // (The tiles the mask masks are always listed, so their count stays the mask's own.)
};

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

// Dropout instances: the row tile's place in the Philox stream (philox.h), in a shared-memory slot
// per warp that the consumer warps set before each compute(), as the fp8 factors' slots.
struct TileDropout {
  uint64_t seed;
  uint64_t base;       // the stream position of the row tile's (batch, head) weight (0, 0)
  uint32_t seqlen_k;   // the stream's row length: the call's keys
  uint32_t threshold;  // a weight is kept iff its output is at least this (philox::keep_threshold)
};
CUTLASS_DEVICE TileDropout& tile_dropout() {
  __shared__ TileDropout slots[32];  // by the CTA's warp (768 bytes; FmhaSm90Instance.smem_bytes counts them)
  return slots[threadIdx.x / 32];
}

// Probabilities are taken against a row maximum up to this far below the true one: at most 2^8,
// which fp32 sums and fp16/bf16 probabilities hold with their full relative precision.
constexpr float kRescaleAbove = 8.f;

}  // namespace gemmgen::fmha_sm90

namespace cutlass::fmha::collective {

template <class Mask, bool kSpeculate, bool kDescaled, bool kSoftcap, class BiasElement, int kBlockN, bool kDropout,
          class Params>
struct CollectiveSoftmax<float,
                         gemmgen::fmha_sm90::LazyRescale<Mask, kSpeculate, kDescaled, kSoftcap, BiasElement, kBlockN,
                                                         kDropout>,
                         Params> {
  using Fusion =
      gemmgen::fmha_sm90::LazyRescale<Mask, kSpeculate, kDescaled, kSoftcap, BiasElement, kBlockN, kDropout>;
  static constexpr float kBound = float(1 << int(gemmgen::fmha_sm90::kRescaleAbove));  // 2^kRescaleAbove
  // Bias instances add the bias where the scores are made ready (prepare), without the speculative
  // step: it assumes every row sees key 0, which a bias may hide (a left-padded row's first keys),
  // and with the bias registers held ahead it spilled (d128 128x128: 100 bytes, 14% slower on the
  // H100: bench/NOTES.md, experiment 93).
  static constexpr bool kBias = !std::is_void_v<BiasElement>;
  static_assert(!kBias || (!kSpeculate && !kDescaled && kBlockN % 8 == 0), "a bias runs the plain 16-bit step");
  // The next key tile's bias pairs of this thread (a 64-row group's tile of kBlockN keys holds
  // kBlockN / 2 scores per thread, in pairs of adjacent keys), loaded one key tile ahead: a load
  // where it is added waited for memory after every Q K^T.
  static constexpr int kPairs = kBias ? kBlockN / 4 : 1;
  uint32_t bias_ahead[kPairs];
  uint32_t next_entry = 0;  // the list entry (bias.h) of the key tile after the current one
  // The scores' scale (natural and log2) and O's final factor: the params', times the row tile's
  // factors where descaled, read where used (held in registers through the tile, they made the fp8
  // d128 tile spill 400 bytes; the params' own values are operands from the constant bank).
  Params const& params;
  CUTLASS_DEVICE CollectiveSoftmax(Params const& p) : params(p) {}
  // Bias instances hold the scores raw (s + bias / scale) where the scale is at least kRawScale,
  // so that a visible tile's scores need no operation; below it (a scale of 0 runs as FLT_MIN),
  // bias / scale could overflow, and they hold them scaled (scale * s + bias).
  static constexpr float kRawScale = 1.f / 65536.f;
  CUTLASS_DEVICE bool raw() const { return !kBias || params.scale_softmax >= kRawScale; }
  CUTLASS_DEVICE float scale_log2() const {
    if constexpr (kBias) {
      if (!raw()) return float(M_LOG2E);
    }
    if constexpr (kSoftcap) return params.scale_softmax * float(M_LOG2E);  // (scale_softmax_log2 holds c)
    if constexpr (kDescaled) return params.scale_softmax_log2 * gemmgen::fmha_sm90::tile_factors().qk;
    return params.scale_softmax_log2;
  }
  CUTLASS_DEVICE float scale() const {
    if constexpr (kBias) {
      if (!raw()) return 1.f;
    }
    if constexpr (kDescaled) return params.scale_softmax * gemmgen::fmha_sm90::tile_factors().qk;
    return params.scale_softmax;
  }
  CUTLASS_DEVICE float o_factor() const {
    if constexpr (kDescaled) return params.rp_dropout * gemmgen::fmha_sm90::tile_factors().v;
    return params.rp_dropout;
  }

  // Softcap: the raw scores s become out * tanh(in * s), in = scale / c and out = c / scale, so that
  // the scaled ones are c * tanh(scale * s / c); before the mask, whose -inf it would undo. tanh is
  // softcap.h's, as every backward takes it: the backward's P, recomputed from the forward's LSE,
  // then matches. A scale of 0 (run as the smallest normal float) would overflow `out`: the capped
  // scores are then all 0, which out = 0 gives. Bias instances holding scaled scores (raw() false)
  // take them capped in scaled units: out = c.
  template <class AccQK>
  CUTLASS_DEVICE void cap(AccQK& acc_qk) const {
    if constexpr (kSoftcap) {
      const float c = params.scale_softmax_log2, in = params.scale_softmax / c;
      const float out = !raw() ? c : ::isfinite(c / params.scale_softmax) ? c / params.scale_softmax : 0.f;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(acc_qk); ++i) {
        acc_qk(i) = out * gemmgen::softcap_tanh(in * acc_qk(i));
      }
    }
  }

  // The bias of the key tile whose scores `count` indexes moved `shift` keys on, into bias_ahead:
  // a pair of adjacent keys per load. Rows past the problem's read its last row and keys past a
  // row's end (rounded up to 8: the ABI's rows are readable that far) its last pair: their scores
  // are dropped or masked, and the loads need no predicates.
  template <class CountQK, class ProblemShape>
  CUTLASS_DEVICE void load_bias(CountQK const& count, ProblemShape const& ps, int shift) {
    if constexpr (kBias) {
      gemmgen::fmha_sm90::TileBias const& slot = gemmgen::fmha_sm90::tile_bias();
      auto const* rows = static_cast<uint16_t const*>(slot.ptr);
      const int64_t row_stride = slot.row_stride;
      const int last_row = int(get<2>(ps)) - 1, last_pair = (int(get<3>(ps)) + 7) / 8 * 8 - 2;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kPairs; ++i) {
        auto pos = count(2 * i);  // (row, key); element 2i + 1 is key + 1 of the same row
        const int row = min(int(get<0>(pos)), last_row), key = min(int(get<1>(pos)) + shift, last_pair);
        bias_ahead[i] = __ldg(reinterpret_cast<uint32_t const*>(rows + row * row_stride + key));
      }
    }
  }

  // The list entry (bias.h) of the row tile's i-th key tile: the list's, or key tile i, mixed,
  // where the tiles were not sorted; past the list's end a visible tile (nothing is loaded for it).
  CUTLASS_DEVICE static uint32_t entry(int i) {
    gemmgen::fmha_sm90::TileBias const& slot = gemmgen::fmha_sm90::tile_bias();
    if (slot.list == nullptr) return uint32_t(i) | gemmgen::fmha_sm90::kAllMixed;
    return i < int(slot.list[0]) ? __ldg(slot.list + 2 + i) : 0u;
  }

  // The scores of the mainloop's i-th key tile made ready for the softmax: capped where a softcap
  // applies; in bias instances, plus the bias of the key tile the list names (mixed tiles; raw or
  // scaled units: raw()), that tile's offset from tile i in keys into `shift` (the mask's
  // coordinates move by it); then the next listed tile's entry, and its bias when it is mixed: in
  // flight through this tile's softmax and P V and the next Q K^T. Returns whether the tile is
  // hidden to this warp group (the caller skips its softmax: P = 0). `first`: a row tile's first
  // key tile, whose entry and bias are loaded here. A mixed bias entry past FLT_MAX * scale
  // overflows the raw score to +inf: its row comes out NaN, not wrong.
  template <class AccQK, class CountQK, class ProblemShape>
  CUTLASS_DEVICE bool prepare(AccQK& acc_qk, CountQK const& count, ProblemShape const& ps, bool first, int& shift) {
    if constexpr (kBias) {
      static_assert(decltype(size(acc_qk))::value == 2 * kPairs, "a 64-row group's tile of kBlockN keys");
      using namespace gemmgen::fmha_sm90;
      const int i = int(get<1>(count(0))) / kBlockN;  // the mainloop's key tile
      const int group = tile_bias().group;
      const uint32_t now = first ? entry(i) : next_entry;
      next_entry = entry(i + 1);  // (used below, after this tile's scores are ready)
      shift = (tile_of(now) - i) * kBlockN;
      const int cls = class_of(now, group);
      if (first && cls == kMixed) load_bias(count, ps, shift);
      const bool hidden = cls == kHidden;
      if (!hidden) {
        cap(acc_qk);
        const bool raw_units = raw();
        if (cls == kMixed) {  // raw: s + b / scale; scaled: scale * s + b (a cap's output is scaled already)
          const float f = raw_units ? __frcp_rn(params.scale_softmax) : 1.f;
          const float k = raw_units || kSoftcap ? 1.f : params.scale_softmax;
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < kPairs; ++j) {
            const float2 b = bias_pair(bias_ahead[j], static_cast<BiasElement const*>(nullptr));
            acc_qk(2 * j) = fmaf(acc_qk(2 * j), k, b.x * f);
            acc_qk(2 * j + 1) = fmaf(acc_qk(2 * j + 1), k, b.y * f);
          }
        } else if (!raw_units && !kSoftcap) {
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < size(acc_qk); ++j) acc_qk(j) *= params.scale_softmax;
        }
      }
      if (class_of(next_entry, group) == kMixed) load_bias(count, ps, (tile_of(next_entry) - i) * kBlockN);
      return hidden;
    } else {
      shift = 0;
      cap(acc_qk);
      return false;
    }
  }

  // The problem the mask takes for scores whose coordinates lie `shift` keys before the keys they
  // hold: the causal and residual masks compare a score's key with seqlen_k (and seqlen_q) only, so
  // seqlen_k less `shift` masks the moved keys as the keys themselves.
  template <class ProblemShape>
  CUTLASS_DEVICE static ProblemShape moved(ProblemShape ps, int shift) {
    if constexpr (kBias) get<3>(ps) -= shift;
    return ps;
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

  // Dropout: the probabilities of one key tile (a 64-row group's, 2 rows of kBlockN / 8 pairs of
  // adjacent keys per thread: wgmma's accumulator layout, element i at row + 8 * ((i >> 1) & 1),
  // key + 8 * (i >> 2) + (i & 1)) zeroed where the mask drops them. The four threads of a quad hold
  // one row's keys between them, a stream of kBlockN consecutive outputs: each draws every fourth
  // Philox counter of it (kBlockN / 16 + 1 each, against kBlockN / 8 for the pairs it holds alone),
  // keeps the comparisons as bits, and the quad merges the bits with two shuffles per word.
  template <class AccQK, class CountQK>
  CUTLASS_DEVICE void drop(AccQK& acc_qk, CountQK const& count) const {
    if constexpr (kDropout) {
      static_assert(kBlockN % 16 == 0, "dropout tiles hold whole 16-key groups");
      static_assert(decltype(size(acc_qk))::value == kBlockN / 2, "a 64-row group's tile of kBlockN keys");
      constexpr int kCounters = kBlockN / 16 + 1;   // per thread: 4 * kCounters >= kBlockN / 4 + 1
      constexpr int kWords = (kCounters + 1) / 2;    // 32-bit words of the row's bits (16 per counter pair)
      constexpr int kKeptWords = kBlockN / 32 > 0 ? kBlockN / 32 : 1;
      gemmgen::fmha_sm90::TileDropout const& slot = gemmgen::fmha_sm90::tile_dropout();
      const uint64_t seed = slot.seed, base = slot.base;
      const uint32_t nk = slot.seqlen_k, threshold = slot.threshold;
      const int first_key = int(get<1>(count(0)));  // this thread's: the tile's first + 2 * its quad lane
      const int lane2 = first_key % 8;
      const uint32_t quad_lane = uint32_t(lane2) / 2;
      CUTLASS_PRAGMA_UNROLL
      for (int half = 0; half < 2; ++half) {
        const uint32_t row = uint32_t(get<0>(count(2 * half)));
        // The stream position of (row, the tile's first key), 32-bit within the head as the mask's.
        const uint64_t at = base + uint32_t(row * nk + uint32_t(first_key - lane2));
        const uint64_t counter0 = at >> 2;
        uint32_t words[kWords];
        CUTLASS_PRAGMA_UNROLL
        for (int w = 0; w < kWords; ++w) words[w] = 0u;
        CUTLASS_PRAGMA_UNROLL
        for (int m = 0; m < kCounters; ++m) {
          const uint4 r = gemmgen::philox::outputs(counter0 + quad_lane + 4u * m, seed);
          const uint32_t nib = uint32_t(r.x >= threshold) | uint32_t(r.y >= threshold) << 1 |
                               uint32_t(r.z >= threshold) << 2 | uint32_t(r.w >= threshold) << 3;
          words[m / 2] |= nib << (4u * quad_lane + 16u * (m % 2));  // counter 4m + lane: bits 16m + 4 lane
        }
        CUTLASS_PRAGMA_UNROLL
        for (int w = 0; w < kWords; ++w) {
          words[w] |= __shfl_xor_sync(0xffffffffu, words[w], 1);
          words[w] |= __shfl_xor_sync(0xffffffffu, words[w], 2);
        }
        // Bit x of kept[]: this thread's key first_key + x (its stream position at + lane2 + x).
        const uint32_t shift = uint32_t(at & 3) + uint32_t(lane2);  // 0..9
        uint32_t kept[kKeptWords];
        CUTLASS_PRAGMA_UNROLL
        for (int w = 0; w < kKeptWords; ++w) {
          kept[w] = __funnelshift_r(words[w], w + 1 < kWords ? words[w + 1] : 0u, shift);
        }
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(acc_qk); ++i) {
          if (((i >> 1) & 1) != half) continue;
          const int x = 8 * (i >> 2) + (i & 1);
          if (!((kept[x / 32] >> (x % 32)) & 1u)) acc_qk(i) = 0.f;
        }
      }
    }
  }

  // One key tile's probabilities, dropped where dropout applies (drop): the first of a row tile,
  // or a later one (the warp-specialized mainloops).
  template <class AccQK, class TiledMmaQK, class CountQK, class State, class ProblemShape>
  CUTLASS_DEVICE void step(AccQK& acc_qk, TiledMmaQK const& mma_qk, CountQK const& count_qk, State& state,
                           ProblemShape const& problem_shape) {
    first_probabilities(acc_qk, mma_qk, count_qk, state, problem_shape);
    drop(acc_qk, count_qk);
  }
  template <bool kUseFusion = true, class AccQK, class TiledMmaQK, class CountQK, class State, class AccPV,
            class TiledMmaPV, class ProblemShape>
  CUTLASS_DEVICE void step(AccQK& acc_qk, TiledMmaQK const& mma_qk, CountQK const& count_qk, State& state,
                           AccPV& acc_pv, TiledMmaPV const& mma_pv, ProblemShape const& problem_shape) {
    probabilities<kUseFusion>(acc_qk, mma_qk, count_qk, state, acc_pv, mma_pv, problem_shape);
    drop(acc_qk, count_qk);
  }

  // The first key tile of a row tile.
  template <class AccQK, class TiledMmaQK, class CountQK, class State, class ProblemShape>
  CUTLASS_DEVICE void first_probabilities(AccQK& acc_qk, TiledMmaQK const& mma_qk, CountQK const& count_qk,
                                          State& state, ProblemShape const& problem_shape) {
    auto& row_max = get<0>(state);
    auto& row_sum = get<1>(state);
    fill(row_max, -INFINITY);
    int shift;
    if (prepare(acc_qk, count_qk, problem_shape, /*first=*/true, shift)) {  // a hidden tile: P = 0
      fill(row_sum, 0.f);
      fill(acc_qk, 0.f);
      return;
    }
    Fusion{}.before_softmax(acc_qk, count_qk, moved(problem_shape, shift));
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
  CUTLASS_DEVICE void probabilities(AccQK& acc_qk, TiledMmaQK const& mma_qk, CountQK const& count_qk, State& state,
                                    AccPV& acc_pv, TiledMmaPV const& mma_pv, ProblemShape const& problem_shape) {
    int shift;
    if (prepare(acc_qk, count_qk, problem_shape, /*first=*/false, shift)) {  // a hidden tile: P = 0
      fill(acc_qk, 0.f);
      return;
    }
    if constexpr (kUseFusion) Fusion{}.before_softmax(acc_qk, count_qk, moved(problem_shape, shift));
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
    static_assert(!kDropout, "dropout runs on the warp-specialized mainloops");
    int shift;
    prepare(acc_qk, count_qk, problem_shape, /*first=*/false, shift);  // (no bias on the TMA mainloop)
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
