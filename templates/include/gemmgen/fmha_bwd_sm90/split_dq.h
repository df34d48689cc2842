// The fmha_bwd_sm90 mainloop with dQ split between the two math warp groups (instance suffix `_sq`).
//
// Example 88's mainloop (FmhaBwdMainloopTmaWarpSpecialized, included by launch.h) gives each math
// warp group block_n / 2 keys and, per query tile of block_m rows, runs five GEMMs: S = K Q^T and
// dP = V dO^T (block_n/2 x block_m x d each), dV += P^T dO and dK += dS^T Q (block_n/2 x d x
// block_m each), and dQ = dS K (block_m x d x block_n). The last is as large as two of the others and
// runs on the second warp group only, in turns with the first kept by an ordered barrier: per query
// tile one group does six units of MMA work and the other four.
//
// This mainloop reuses example 88's loads, pipelines, dQ reducer and epilogue and replaces the math
// warp groups' loop (`compute`): both groups write their dS into shared memory, meet at a named
// barrier, and each computes half of dQ (five units per group) with one tiled MMA over the 256 math
// threads, the two warp groups side by side (TiledMmaDQ: along d at d128, along the queries at
// d64). dS is double-buffered by the parity of the query tile, so the one barrier per tile also
// orders a group's write of dS for tile t + 2 after the other group's reads of tile t's (each passes
// tile t + 1's barrier only after its tile-t GEMMs completed). No ordered barrier turns remain in
// the loop; the kernel's epilogue keeps its own (it waits for group 0, then group 1).
//
// Within a tile each group issues its dQ half before its dK, stores dQ into the reducer's stage
// while dK still runs, and lets dK complete under the next tile's wait for S (wgmma batches
// complete in order); the tile's Q and dO stages go back to the producer only then. The tensor
// cores stay busy through dQ's store and the next tile's first issue (NOTES 67: +2-13%).
//
// The mask is band.h's (a launch parameter in this mainloop's Params; packed sequences add each
// key's rows of its own sequence, band.h's Packed): the load warp
// (load_kv_maybe_q), the math warp groups (compute) and the dQ reducer (reduce) are this
// mainloop's own, and all three walk the CTA's range of query tiles (band.h's query_tiles, on the
// CTA's key tile), where example 88's versions visit every query tile and skip those its
// default-constructed Fusion refuses.
//
// Contract with the kernel (FmhaKernelTmaWarpSpecialized): the same pipelines and the same sequence
// of query tiles in the load warp, both math groups and the reducer, the dQ reducer's stage receives
// all 256 producer arrivals per tile, and the returned dK and dV fragments are laid out as the base
// mainloop's (TiledMmaND), which the epilogue reads. Head dims 64 and 128, block_m 64 or 128 where the
// second dS buffer fits shared memory.
#pragma once

#include <cuda_fp16.h>

#include "cutlass/arch/barrier.h"

#include "gemmgen/fmha_bwd_sm90/band.h"
#include "gemmgen/fmha_sm90/bias.h"
#include "gemmgen/fmha_bwd_sm90/dropout.h"
#include "gemmgen/softcap.h"

namespace gemmgen::fmha_bwd_sm90 {

using namespace cute;

// The math groups' dS barrier, as an id after CUTLASS's reserved ones (NamedBarrier adds
// ReservedNamedBarrierCount: hardware id 8 of 16).
constexpr int kDsBarrier = 0;

// Deterministic dQ (SplitDqMainloop::reduce): wait until a query tile's counter reaches `turn`, then
// order the TMA reduction that follows after the additions the counter stands for.
CUTLASS_DEVICE void wait_turn(int const* counter, int turn) {
  int seen;
  while (true) {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
    if (seen == turn) break;
    __nanosleep(64);
  }
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// After this thread's TMA reduction: wait until it has completed in global memory (not only read its
// shared memory), then advance the counter, releasing the addition to the next key tile's CTA.
CUTLASS_DEVICE void pass_turn(int* counter) {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  asm volatile("fence.proxy.async.global;" ::: "memory");
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(counter) : "memory");
}

// The base mainloop's Fusion parameter: every member of the base that calls it (its loads, reducer
// and math loop) is replaced below, so it is never called.
struct NoFusion {};

// kPacked: the kernel of packed sequences (params.packed set), a second kernel of the instance, so
// that the fixed-length kernel keeps its registers (the packed mask's lookups cost spills there).
// kBias: the forward's additive mask (attn_mask) is added to the recomputed scores (`_bias`
// instances; fixed lengths, no softcap): the scores are held scaled, scale * S + bias, and
// P = exp(that - LSE). Where several heads or batch entries share the bias, launch.h first sorts
// its (64-query, 64-key) tiles into visible (all 0), hidden (all -inf) and mixed
// (fmha_sm90/bias.h's classify_bias_tiles): a group reads the bias of its mixed tiles only, scales a
// visible tile's scores and gives a hidden tile P = 0. Without the sort every tile is mixed. The
// 64-query tile (d128) reads its threads' values while its S and dP GEMMs run; the 128-query tile
// (d64), with twice the scores per thread, where it adds them (held ahead, they spilled 952 bytes).
// With the sort, a CTA's range of query tiles is cut to the tiles from its first to its last one
// that some group of its keys does not see hidden (launch.h's bias_query_ranges), outside
// deterministic calls, whose dQ turns need the band's ranges.
// kDropout: the forward's dropout (fixed lengths, no softcap or bias): its mask (dropout.h), drawn
// again, gives dV += (P * Z)^T dO and dS = P * (Z * dP - D), Z the kept weights times 1 / (1 - p).
template <class Element_, class TileShape_, BandKind Kind, bool Softcap = false, bool kPacked = false,
          bool kBias = false, bool kDropout = false>
struct SplitDqMainloop
    : cutlass::fmha::collective::FmhaBwdMainloopTmaWarpSpecialized<Element_, float, TileShape_, NoFusion> {
  using Base = cutlass::fmha::collective::FmhaBwdMainloopTmaWarpSpecialized<Element_, float, TileShape_, NoFusion>;
  using Element = typename Base::Element;
  using ElementAccumulator = typename Base::ElementAccumulator;
  using TileShape = typename Base::TileShape;
  using TileShapeNM = typename Base::TileShapeNM;
  using TileShapeND = typename Base::TileShapeND;
  using TileShapeMD = typename Base::TileShapeMD;
  using TiledMmaNM = typename Base::TiledMmaNM;
  using TiledMmaND = typename Base::TiledMmaND;
  using TiledMmaND_SS = typename Base::TiledMmaND_SS;
  using SmemLayoutK = typename Base::SmemLayoutK;
  using SmemLayoutQ = typename Base::SmemLayoutQ;
  using SmemLayoutV = typename Base::SmemLayoutV;
  using SmemLayoutDO = typename Base::SmemLayoutDO;
  using SmemLayoutDS = typename Base::SmemLayoutDS;
  using SmemLayoutKp = typename Base::SmemLayoutKp;
  using SmemLayoutQp = typename Base::SmemLayoutQp;
  using SmemLayoutDOp = typename Base::SmemLayoutDOp;
  using SmemLayoutDQ = typename Base::SmemLayoutDQ;
  using MainloopPipeline = typename Base::MainloopPipeline;
  using MainloopPipelineQ = typename Base::MainloopPipelineQ;
  using PipelineState = typename Base::PipelineState;
  using PipelineStateQ = typename Base::PipelineStateQ;
  static constexpr int NumMmaWarpGroups = Base::NumMmaWarpGroups;
  static constexpr int StageCount = Base::StageCount;

  static constexpr int kBlockM = get<0>(TileShape{});
  static constexpr int kBlockN = get<1>(TileShape{});
  static constexpr int kHeadDim = get<2>(TileShape{});
  static_assert(NumMmaWarpGroups == 2, "dQ is split in two halves, one per math warp group");
  // How dQ's GEMM is split, over the 256 math threads, the two warp groups side by side:
  // - d = 128: dQ = dS K (block_m x d), the groups along d: A = dS (block_m x keys) and B = K viewed
  //   as (d x keys), both M/N-major in shared memory as in example 88's dQ GEMM; a half of d is one
  //   64-column swizzle atom of K's layout, so each half is a canonical wgmma operand.
  // - d = 64 (a half of d would cut K's swizzle atom): dQ^T = K^T dS^T (d x block_m), the groups
  //   along the queries: A = K^T (d x keys), B = dS^T (queries x keys), whose unswizzled layout
  //   splits into whole 8-row atoms. wgmma's 64-row minimum rules out d = 32.
  static constexpr bool kTransposedDq = kHeadDim == 64;
  static constexpr bool kBiasAhead = kBlockM == 64;  // bias values read while S and dP run (kBias)
  static_assert(kHeadDim == 128 || kHeadDim == 64, "dQ splits at head dims 64 and 128");
  using DqTileMNK = std::conditional_t<kTransposedDq, Shape<Int<kHeadDim>, Int<kBlockM / 2>, _64>,
                                       Shape<Int<kBlockM>, Int<kHeadDim / 2>, _64>>;
  using MmaAtomDQ = decltype(cute::GMMA::ss_op_selector<Element, Element, ElementAccumulator, DqTileMNK,
                                                        cute::GMMA::Major::MN, cute::GMMA::Major::MN>());
  using TiledMmaDQ = decltype(make_tiled_mma(MmaAtomDQ{}, Layout<Shape<_1, _2, _1>>{}));
  // The dQ accumulator tile: (block_m, d), or (d, block_m) transposed.
  using DqShape = std::conditional_t<kTransposedDq, Shape<Int<kHeadDim>, Int<kBlockM>>,
                                     Shape<Int<kBlockM>, Int<kHeadDim>>>;

  // Example 88's storage with a second dS buffer (tile parity 1 uses it; parity 0 the base's smem_ds).
  struct SharedStorage : Base::SharedStorage {
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutDS>> smem_ds_odd;
  };

  // Example 88's params, the call's band, its GQA group (query heads per key/value head) and, for a
  // deterministic call, the dQ turn counters (launch.h sets them after the params are built).
  struct Params : Base::Params {
    Band band;
    int group = 1;
    // Deterministic calls: one counter per (batch, head, query tile), zero at the launch (packed:
    // the tile's first key tile, launch.h's packed_turns_kernel); nullptr otherwise. A query tile's dQ
    // additions go in key-tile order (see reduce).
    int* turns = nullptr;
    int64_t turns_batch_stride = 0;  // counters per batch entry (heads * query tiles)
    int turns_head_stride = 0;       // counters per head (query tiles)
    float softcap = 0.f;             // the forward's logit softcap (Softcap instances)
    Packed packed;                   // packed sequences (band.h): the kPacked kernel's
    // kBias: the bias of the launch's first (batch, head), [query, key] at query * bias_sr + key,
    // and its batch and head strides, in elements.
    const Element* bias = nullptr;
    int64_t bias_sb = 0, bias_sh = 0, bias_sr = 0;
    // The sorted bias (NULL: not sorted, every tile mixed): the class of (64-query group g, 64-key
    // tile t) of this launch's first (batch, head) at g * class_tiles + t, strides per batch and head
    // (0 where the bias broadcasts); class_groups query groups.
    const uint8_t* classes = nullptr;
    int64_t classes_sb = 0, classes_sh = 0;
    int class_tiles = 0, class_groups = 0;
    // With the sort: per CTA key tile, the first and last query tiles some group of its keys does not
    // see hidden (first > last: none), strides per batch and head (0 where the bias broadcasts).
    const int2* query_ranges = nullptr;
    int64_t ranges_sb = 0, ranges_sh = 0;
    philox::Mask dropout{};  // kDropout: the forward's mask (philox.h)
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_size, typename Base::Arguments const& args,
                                        void* workspace) {
    return Params{Base::to_underlying_arguments(problem_size, args, workspace), Band{}, 1, nullptr, 0, 0, 0.f,
                  Packed{}};
  }

  // The CTA's query tiles; blk_coord's key tile is the CTA's (block_n keys), not a math group's.
  template <class BlkCoord, class ProblemShape>
  CUTLASS_DEVICE static QueryTiles cta_query_tiles(BlkCoord const& blk_coord, Params const& params,
                                                   ProblemShape const& problem_size) {
    if constexpr (kPacked) {
      return packed_query_tiles(params.packed, params.band, int(get<1>(blk_coord)), kBlockN, kBlockM,
                                int(get<2>(problem_size)), int(get<3>(problem_size)));
    }
    const QueryTiles band = query_tiles<Kind>(params.band, int(get<1>(blk_coord)), kBlockN, kBlockM,
                                              int(get<2>(problem_size)), int(get<3>(problem_size)));
    if constexpr (kBias) {
      if (params.query_ranges != nullptr && params.turns == nullptr && !band.empty) {
        const int2 r = params.query_ranges[int64_t(get<2, 0>(blk_coord)) * params.ranges_sb +
                                           int64_t(get<2, 1>(blk_coord)) * params.ranges_sh + int(get<1>(blk_coord))];
        const int first = max(band.first, r.x), last = min(band.first + band.count - 1, r.y);
        // No tile seen: one tile that every group sees hidden (zero dK and dV; no dQ addition).
        if (first > last) return {band.first, 1, true};
        return {first, last - first + 1};
      }
    }
    return band;
  }

  // The direction of the CTA's walk over its query tiles, which the load warp, the math groups and
  // the reducer take alike (+1 a tile: from the range's first; -1: from its last). Deterministic
  // calls walk down. Their additions to a query tile go in key-tile order, and a lower key tile's
  // range ends no later than a higher one's (both ends of the band's and the packed ranges never
  // decrease with the key tile): walking down, a lower key tile reaches each tile of a higher one's
  // range no later than the higher one does, so a chain's CTAs add in step. Walking up, a higher key
  // tile's first tile comes late in the lower ones' walks: causal CTAs would wait at their first
  // tile for the diagonal's lower key tiles, and in a packed call the key tile that holds the last
  // keys of sequence A and the first of B would add B's first tiles only after all of A's, holding
  // every later key tile of B behind it (NOTES 108).
  CUTLASS_DEVICE static int walk_step(Params const& params) { return params.turns != nullptr ? -1 : 1; }

  CUTLASS_DEVICE static int walk_start(QueryTiles const& tiles, Params const& params) {
    return walk_step(params) > 0 ? tiles.first : tiles.first + tiles.count - 1;
  }

  // The load warp: the CTA's K and V halves (one pair per math group; K and V of the query head's
  // key/value head, head / group) and, per query tile of its range, Q with its LSE in one pipeline
  // stage and dO with its D in the next. The first loads go K0, Q, V0, K1, dO, V1, so that group 0's
  // S GEMM can start after two of them.
  template <bool kLoadOuter, class BlkCoord, class ProblemShape, class PipelineInner, class StateInner,
            class PipelineOuter, class StateOuter, class LoadWarpBarrier>
  CUTLASS_DEVICE void load_kv_maybe_q(int block_rank_in_cluster, BlkCoord const& blk_coord, Params const& params,
                                      ProblemShape const& problem_size, PipelineInner& pipeline_inner,
                                      StateInner& smem_pipe_write_inner, PipelineOuter& pipeline_outer,
                                      StateOuter& smem_pipe_write_outer, SharedStorage& storage,
                                      LoadWarpBarrier& /*unused: K and V load here*/, bool /*do_barrier*/) {
    static_assert(kLoadOuter, "the kernel's load warp loads K and V too (no separate Q warp)");
    const QueryTiles tiles = cta_query_tiles(blk_coord, params, problem_size);
    const int lane_predicate = cute::elect_one_sync();

    int kv_count = NumMmaWarpGroups;
    int q_count = tiles.count;
    auto kv_tile = cute::make_coord_iterator(kv_count);
    TileIndex q_tile{walk_start(tiles, params), walk_step(params)};

    typename Base::LoadQ load_q{params.tma_load_q, pipeline_inner, storage.smem_q};
    auto state_q = load_q.init_state(block_rank_in_cluster, problem_size, TileShapeNM{}, blk_coord, q_count);
    typename Base::LoadDO load_do{params.tma_load_do, pipeline_inner, storage.smem_do};
    auto state_do = load_do.init_state(block_rank_in_cluster, problem_size, TileShapeNM{}, blk_coord, q_count);
    // (K/V half, key tile, (batch, key/value head)): the coordinate K's and V's loads read at.
    const auto kv_coord = make_coord(get<0>(blk_coord), get<1>(blk_coord),
                                     make_coord(get<2, 0>(blk_coord), int(get<2, 1>(blk_coord)) / params.group));
    typename Base::LoadK load_k{params.tma_load_k, pipeline_outer, storage.smem_k};
    auto state_k = load_k.init_state(_0{}, problem_size, TileShapeNM{}, kv_coord, kv_count);
    typename Base::LoadV load_v{params.tma_load_v, pipeline_outer, storage.smem_v};
    auto state_v = load_v.init_state(_0{}, problem_size, TileShapeNM{}, kv_coord, kv_count);
    typename Base::LoadLSE load_lse{params.tma_load_lse, pipeline_inner, storage.smem_lse};
    auto state_lse = load_lse.init_state(_0{}, problem_size, TileShapeNM{}, blk_coord, kv_count);
    typename Base::LoadODO load_odo{params.tma_load_odo, pipeline_inner, storage.smem_sumOdO};
    auto state_odo = load_odo.init_state(_0{}, problem_size, TileShapeNM{}, blk_coord, kv_count);

    // step() counts one per load: K and V per group, Q, LSE, dO and D per query tile. Q's step
    // acquires the stage that LSE's then advances past; dO and D likewise, D's step moving to the
    // next query tile.
    kv_count *= 2;
    q_count *= 4;
    auto load_q_lse = [&] {
      load_q.template step<false, false, true>(q_tile, state_q, smem_pipe_write_inner, lane_predicate, q_count);
      load_lse.template step<false, true, false>(q_tile, state_lse, smem_pipe_write_inner, lane_predicate, q_count);
    };
    auto load_do_odo = [&] {
      load_do.template step<false, false, true>(q_tile, state_do, smem_pipe_write_inner, lane_predicate, q_count);
      load_odo.template step<true, true, false>(q_tile, state_odo, smem_pipe_write_inner, lane_predicate, q_count);
    };
    load_k.template step<false>(kv_tile, state_k, smem_pipe_write_outer, lane_predicate, kv_count);
    load_q_lse();
    load_v.template step<true>(kv_tile, state_v, smem_pipe_write_outer, lane_predicate, kv_count);
    load_k.template step<false>(kv_tile, state_k, smem_pipe_write_outer, lane_predicate, kv_count);
    load_do_odo();
    load_v.template step<true>(kv_tile, state_v, smem_pipe_write_outer, lane_predicate, kv_count);
    while (kv_count > 0) {
      load_k.template step<false>(kv_tile, state_k, smem_pipe_write_outer, lane_predicate, kv_count);
      load_v.template step<true>(kv_tile, state_v, smem_pipe_write_outer, lane_predicate, kv_count);
    }
    CUTLASS_PRAGMA_NO_UNROLL
    while (q_count > 0) {
      load_q_lse();
      load_do_odo();
    }
  }

  // The dQ reducer warp: each query tile's dQ, as the math groups leave it in a reducer stage, added
  // into the fp32 accumulator in global memory with a TMA reduction; a stage goes back to the math
  // groups once the reduction that read it has completed (one reduction kept in flight). A key tile
  // that no query sees adds nothing.
  //
  // Deterministic calls (params.turns): the key tiles that hold a query tile add into its dQ one
  // after another in key-tile order, so the fp32 sums never depend on scheduling. The reducer waits
  // for the tile's counter to reach its turn (its key tile less the first that holds the query tile;
  // packed: its key tile, the counter starting at the first), adds, waits for the addition to
  // complete in global memory, and advances the counter. A key tile's CTA waits only on CTAs of lower
  // key tiles of its (batch, head), which the grid starts before it (key tiles are the faster grid
  // coordinate in both schedules), so the waits end. A packed key tile without rows inside a query
  // tile's range of key tiles takes its turn there without adding (band.h).
  template <class BlkCoord, class ProblemShape, class PipelineReducer, class StateReducer>
  CUTLASS_DEVICE void reduce(BlkCoord const& blk_coord, Params const& params, ProblemShape const& problem_size,
                             PipelineReducer& pipeline_reducer, StateReducer& smem_pipe_read_reducer,
                             SharedStorage& storage) {
    const int lane_predicate = cute::elect_one_sync();
    Tensor mDQ = params.tma_red_dq.get_tma_tensor(select<2, 4, 0, 1>(problem_size));
    Tensor gDQ_all = local_tile(mDQ, typename Base::TileShapeMD{}, make_coord(_, _, _), Step<_1, _1, Underscore>{});
    Tensor gDQ = gDQ_all(_, _, _, _0{}, get<2, 0>(blk_coord), get<2, 1>(blk_coord));
    Tensor sDQ = make_tensor(make_smem_ptr(storage.smem_dq.data()), SmemLayoutDQ{});
    auto block_tma = params.tma_red_dq.get_slice(_0{});
    Tensor tDQsDQ = block_tma.partition_S(sDQ);
    Tensor tDQgDQ = block_tma.partition_D(gDQ);

    const QueryTiles tiles = cta_query_tiles(blk_coord, params, problem_size);
    const int key_tile = int(get<1>(blk_coord));
    int* turns = params.turns == nullptr ? nullptr
                                         : params.turns + int64_t(get<2, 0>(blk_coord)) * params.turns_batch_stride +
                                               int64_t(get<2, 1>(blk_coord)) * params.turns_head_stride;
    bool takes_turns = turns != nullptr && !tiles.empty;
    if constexpr (kPacked) {
      if (turns != nullptr && tiles.empty && lane_predicate) {
        takes_turns = packed_tile_takes_turn(params.packed, params.band, key_tile, tiles.first, kBlockN, kBlockM,
                                             int(get<3>(problem_size)));
      }
    }
    StateReducer smem_pipe_release_reducer = smem_pipe_read_reducer;
    int q_tile = walk_start(tiles, params);
    for (int t = 0; t < tiles.count; ++t) {
      pipeline_reducer.consumer_wait(smem_pipe_read_reducer);
      if (lane_predicate) tma_store_wait<1>();  // the previous tile's reduction has read its stage
      if (t > 0) {
        pipeline_reducer.consumer_release(smem_pipe_release_reducer);
        ++smem_pipe_release_reducer;
      }
      if (lane_predicate) {
        if (takes_turns) {
          wait_turn(turns + q_tile,
                    kPacked ? key_tile : key_tile - first_key_tile(params.band, q_tile, kBlockM, kBlockN));
        }
        if (!tiles.empty) {
          copy(params.tma_red_dq, tDQsDQ(_, _, _, smem_pipe_read_reducer.index()), tDQgDQ(_, _, _, q_tile));
          tma_store_arrive();
        }
        if (takes_turns) pass_turn(turns + q_tile);
      }
      q_tile += walk_step(params);
      ++smem_pipe_read_reducer;
    }
    if (lane_predicate) tma_store_wait<0>();
    pipeline_reducer.consumer_release(smem_pipe_release_reducer);
    ++smem_pipe_release_reducer;
  }

  template <class BlkCoord, class ProblemShape, class MainloopPipelineReducer, class PipelineStateReducer,
            class MathWgOrderBarrier>
  CUTLASS_DEVICE auto compute(BlkCoord const& blk_coord, BlkCoord const& wg_coord, Params const& params,
                              ProblemShape const& problem_size, MainloopPipeline& pipeline_inner,
                              PipelineState& smem_pipe_read_inner, MainloopPipelineQ& pipeline_outer,
                              PipelineStateQ& smem_pipe_read_outer, MainloopPipelineReducer& pipeline_reducer,
                              PipelineStateReducer& smem_pipe_write_reducer, SharedStorage& storage,
                              MathWgOrderBarrier& /*unused: no turns in this loop*/) {
    const int thread_idx = int(threadIdx.x) % cutlass::NumThreadsPerWarpGroup;
    const int wg_idx = __shfl_sync(0xffffffff, get<1>(wg_coord) % NumMmaWarpGroups, 0);

    TiledMmaND tiled_mma_nd;
    Tensor acc_DV = partition_fragment_C(tiled_mma_nd, take<0, 2>(TileShapeND{}));
    Tensor acc_DK = partition_fragment_C(tiled_mma_nd, take<0, 2>(TileShapeND{}));
    clear(acc_DV);
    clear(acc_DK);

    // This group's K and V stages (the kernel advanced smem_pipe_read_outer to them), and the other
    // group's K stage (two stages on: K and V per group).
    pipeline_outer.consumer_wait(smem_pipe_read_outer);
    PipelineStateQ smem_pipe_read_k = smem_pipe_read_outer;
    ++smem_pipe_read_outer;
    pipeline_outer.consumer_wait(smem_pipe_read_outer);
    PipelineStateQ smem_pipe_read_v = smem_pipe_read_outer;
    PipelineStateQ smem_pipe_read_k_other = smem_pipe_read_k;
    smem_pipe_read_k_other.advance(2);
    // K stage of key half w of the CTA's block_n keys.
    const int k_stage[2] = {wg_idx == 0 ? smem_pipe_read_k.index() : smem_pipe_read_k_other.index(),
                            wg_idx == 1 ? smem_pipe_read_k.index() : smem_pipe_read_k_other.index()};

    PipelineState smem_pipe_release_inner = smem_pipe_read_inner;

    // S and dP: this group's keys x the query tile (both operands from shared memory).
    TiledMmaNM tiled_mma_nm;
    auto thr_mma_nm = tiled_mma_nm.get_thread_slice(thread_idx);
    Tensor sK = make_tensor(make_smem_ptr(storage.smem_k.data()), SmemLayoutK{});
    Tensor sQ = make_tensor(make_smem_ptr(storage.smem_q.data()), SmemLayoutQ{});
    Tensor tSrK = thr_mma_nm.make_fragment_A(thr_mma_nm.partition_A(sK));
    Tensor tSrQ = thr_mma_nm.make_fragment_B(thr_mma_nm.partition_B(sQ));
    Tensor sV = make_tensor(make_smem_ptr(storage.smem_v.data()), SmemLayoutV{});
    Tensor sDO = make_tensor(make_smem_ptr(storage.smem_do.data()), SmemLayoutDO{});
    Tensor tDPrV = thr_mma_nm.make_fragment_A(thr_mma_nm.partition_A(sV));
    Tensor tDPrDO = thr_mma_nm.make_fragment_B(thr_mma_nm.partition_B(sDO));

    // dV += P^T dO (P from registers) and dK += dS^T Q (dS from shared memory).
    auto thr_mma_nd = tiled_mma_nd.get_thread_slice(thread_idx);
    Tensor sDOp = make_tensor(make_smem_ptr(storage.smem_dop.data()), SmemLayoutDOp{});
    Tensor tDVrDO = thr_mma_nd.make_fragment_B(thr_mma_nd.partition_B(sDOp));
    Tensor sQp = make_tensor(make_smem_ptr(storage.smem_qp.data()), SmemLayoutQp{});
    Tensor tDKrQ = thr_mma_nd.make_fragment_B(thr_mma_nd.partition_B(sQp));
    auto thr_mma_nd_ss = TiledMmaND_SS{}.get_thread_slice(thread_idx);

    // dQ's half: thread index over both math groups.
    TiledMmaDQ tiled_mma_dq;
    auto thr_mma_dq = tiled_mma_dq.get_thread_slice(wg_idx * cutlass::NumThreadsPerWarpGroup + thread_idx);
    Tensor sKp = make_tensor(make_smem_ptr(storage.smem_kp.data()), SmemLayoutKp{});
    Tensor sDQ = make_tensor(make_smem_ptr(storage.smem_dq.data()), SmemLayoutDQ{});
    auto tDQrK = [&] {
      if constexpr (kTransposedDq) {
        return thr_mma_dq.make_fragment_A(thr_mma_dq.partition_A(sKp));
      } else {
        return thr_mma_dq.make_fragment_B(thr_mma_dq.partition_B(sKp));
      }
    }();
    // The reducer's stages, (block_m, d, stage), or viewed (d, block_m, stage).
    auto tDQsDQ_full = [&] {
      if constexpr (kTransposedDq) {
        Tensor sDQt = sDQ.compose(make_layout(make_shape(size<1>(sDQ), size<0>(sDQ), size<2>(sDQ)),
                                              make_stride(size<0>(sDQ), _1{}, size<0>(sDQ) * size<1>(sDQ))));
        return thr_mma_dq.partition_C(sDQt);
      } else {
        return thr_mma_dq.partition_C(sDQ);
      }
    }();

    // LSE and D (sum of O * dO) of the query tile, broadcast over this group's keys.
    Tensor sLSE = make_tensor(make_smem_ptr(storage.smem_lse.data()),
                              make_shape(get<0>(TileShapeNM{}), get<1>(TileShapeNM{}), Int<StageCount>{}),
                              make_stride(_0{}, _1{}, get<1>(TileShapeNM{})));
    Tensor tSsLSE = thr_mma_nm.partition_C(sLSE);
    Tensor sODO = make_tensor(make_smem_ptr(storage.smem_sumOdO.data()),
                              make_shape(get<0>(TileShapeNM{}), get<1>(TileShapeNM{}), Int<StageCount>{}),
                              make_stride(_0{}, _1{}, get<1>(TileShapeNM{})));
    Tensor tDPsODO = thr_mma_nm.partition_C(sODO);

    // Coordinates (key, query) of this thread's scores, for the mask.
    Tensor cS = make_identity_tensor(take<0, 2>(TileShapeNM{}));
    Tensor tScS = thr_mma_nm.partition_C(cS);
    const int n_block = get<1>(wg_coord);
    tScS.data() = tScS.data() + E<0>{} * n_block * get<0>(TileShapeNM{});

    // Packed calls: the query rows of this thread's keys (band.h), fixed through the loop.
    [[maybe_unused]] const auto rows_of_keys = [&] {
      if constexpr (kPacked) {
        return key_rows(params.packed, params.band, tScS, tiled_mma_nm, int(get<3>(problem_size)));
      } else {
        return 0;
      }
    }();

    // Bias instances: this (batch, head)'s bias rows.
    [[maybe_unused]] const Element* bias_bh = nullptr;
    [[maybe_unused]] const uint8_t* classes_bh = nullptr;
    if constexpr (kBias) {
      static_assert(get<0>(TileShapeNM{}) == fmha_sm90::kClassRows && kBlockM % fmha_sm90::kClassRows == 0,
                    "a group's keys are one class tile wide, a query tile whole class groups");
      bias_bh = params.bias + int64_t(get<2, 0>(blk_coord)) * params.bias_sb +
                int64_t(get<2, 1>(blk_coord)) * params.bias_sh;
      if (params.classes != nullptr) {
        classes_bh = params.classes + int64_t(get<2, 0>(blk_coord)) * params.classes_sb +
                     int64_t(get<2, 1>(blk_coord)) * params.classes_sh + n_block;
      }
    }

    // Dropout instances: this (batch, head)'s place in the mask's stream.
    [[maybe_unused]] const uint64_t dropout_base =
        kDropout ? params.dropout.head_base(uint32_t(get<2, 0>(blk_coord)), uint32_t(get<2, 1>(blk_coord))) : 0;

    // The CTA's range of query tiles, walked as the load warp and the reducer walk it.
    const QueryTiles tiles = cta_query_tiles(blk_coord, params, problem_size);
    int q_tile = walk_start(tiles, params);
    const int q_step = walk_step(params);
    tScS.data() = tScS.data() + E<1>{} * q_tile * get<1>(TileShapeNM{});
    int inner_tile_count = tiles.count;
    int parity = 0;
    // A tile's Q and dO stages are released once its dK GEMM has completed.
    bool release_pending = false;
    auto release_inner_tile = [&] {
      pipeline_inner.consumer_release(smem_pipe_release_inner);
      ++smem_pipe_release_inner;
      pipeline_inner.consumer_release(smem_pipe_release_inner);
      ++smem_pipe_release_inner;
      release_pending = false;
    };
    while (inner_tile_count > 0) {
      // dS of this tile's parity: (block_m, keys, group) for the dQ GEMM, (keys, block_m, group)
      // viewed from the S accumulator's side.
      Element* ds_ptr = parity ? storage.smem_ds_odd.data() : storage.smem_ds.data();
      Tensor sDS = make_tensor(make_smem_ptr(ds_ptr), SmemLayoutDS{});
      Tensor sDSp = sDS.compose(make_layout(make_shape(size<1>(sDS), size<0>(sDS), size<2>(sDS)),
                                            make_stride(size<0>(sDS), _1{}, size<1>(sDS) * size<0>(sDS))));
      Tensor tDPsDS = thr_mma_nm.partition_C(sDSp);
      Tensor tDKrDSp = thr_mma_nd_ss.make_fragment_A(thr_mma_nd_ss.partition_A(sDSp));
      auto tDQrDS = [&] {
        if constexpr (kTransposedDq) {
          return thr_mma_dq.make_fragment_B(thr_mma_dq.partition_B(sDS));
        } else {
          return thr_mma_dq.make_fragment_A(thr_mma_dq.partition_A(sDS));
        }
      }();

      pipeline_inner.consumer_wait(smem_pipe_read_inner);
      PipelineState smem_pipe_read_q = smem_pipe_read_inner;
      ++smem_pipe_read_inner;
      PipelineState smem_pipe_read_do = smem_pipe_read_inner;
      ++smem_pipe_read_inner;

      Tensor acc_S = partition_fragment_C(tiled_mma_nm, take<0, 2>(TileShapeNM{}));
      warpgroup_fence_operand(acc_S);
      warpgroup_arrive();
      cutlass::fmha::collective::gemm_zero_acc(tiled_mma_nm, tSrK(_, _, _, smem_pipe_read_k.index()),
                                               tSrQ(_, _, _, smem_pipe_read_q.index()), acc_S);
      warpgroup_commit_batch();

      pipeline_inner.consumer_wait(smem_pipe_read_do);
      Tensor acc_DP = partition_fragment_C(tiled_mma_nm, take<0, 2>(TileShapeNM{}));
      warpgroup_fence_operand(acc_DP);
      warpgroup_arrive();
      cutlass::fmha::collective::gemm_zero_acc(tiled_mma_nm, tDPrV(_, _, _, smem_pipe_read_v.index()),
                                               tDPrDO(_, _, _, smem_pipe_read_do.index()), acc_DP);
      warpgroup_commit_batch();

      // Dropout: this tile's kept weights, drawn while the S and dP GEMMs run.
      [[maybe_unused]] uint64_t kept = 0;
      if constexpr (kDropout) kept = kept_transposed(tScS, params.dropout, dropout_base);

      // Bias instances: the class of this group's tile, and (kBiasAhead) its bias values.
      [[maybe_unused]] auto bias_r = make_fragment_like<Element>(acc_S);
      [[maybe_unused]] int tile_class = fmha_sm90::kMixed;  // of this group's keys and the query tile
      if constexpr (kBias) {
        if (classes_bh != nullptr && n_block >= params.class_tiles) {
          tile_class = fmha_sm90::kHidden;  // keys past seqlen_k only (the mask hides them too)
        } else if (classes_bh != nullptr) {
          constexpr int kGroups = kBlockM / fmha_sm90::kClassRows;
          const int g0 = q_tile * kGroups;
          tile_class = classes_bh[int64_t(g0) * params.class_tiles];
          CUTLASS_PRAGMA_UNROLL
          for (int g = 1; g < kGroups; ++g) {
            if (g0 + g < params.class_groups && classes_bh[int64_t(g0 + g) * params.class_tiles] != tile_class) {
              tile_class = fmha_sm90::kMixed;
            }
          }
        }
      }
      // The bias of this thread's score i; scores past the problem (masked, or rows whose dO is zero)
      // read the last row's or key's.
      [[maybe_unused]] auto bias_at = [&](int i) {
        const auto pos = tScS(i);
        const int key = min(int(get<0>(pos)), int(get<3>(problem_size)) - 1);
        const int query = min(int(get<1>(pos)), int(get<2>(problem_size)) - 1);
        return bias_bh[int64_t(query) * params.bias_sr + key];
      };
      if (kBias && kBiasAhead && tile_class == fmha_sm90::kMixed) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(bias_r); ++i) bias_r(i) = bias_at(i);
      }

      // P = exp(scale * S - LSE) while dP runs.
      Tensor acc_P = make_fragment_like<ElementAccumulator>(acc_S);
      warpgroup_wait<1>();
      warpgroup_fence_operand(acc_S);
      // The previous tile's dK is complete too: its Q and dO stages go back to the producer.
      if (release_pending) {
        warpgroup_fence_operand(acc_DK);
        release_inner_tile();
      }
      // Softcap: the forward's scores were c * tanh(scale * S / c); acc_S takes them in S's units (the
      // exponential below scales by `scale`), and acc_cap keeps d(capped)/d(scale * S) = 1 - tanh^2
      // for dS, taken before the mask turns masked scores to -inf: in fp16, two to a register (dS is
      // rounded to 16 bits after), since an fp32 fragment takes 32 more registers, which the tile
      // has to spill (bench/NOTES.md 102).
      constexpr int kCapPairs = Softcap ? decltype(size(acc_S))::value / 2 : 1;
      __half2 acc_cap[kCapPairs];
      if constexpr (Softcap) {
        // A scale of 0 (run as the smallest normal float) would overflow `out`: the capped scores
        // are then all 0, which out = 0 gives.
        const float in = params.scale_softmax / params.softcap;
        const float out = isfinite(params.softcap / params.scale_softmax) ? params.softcap / params.scale_softmax : 0.f;
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < kCapPairs; ++i) {
          const float t0 = gemmgen::softcap_tanh(in * acc_S(2 * i)), t1 = gemmgen::softcap_tanh(in * acc_S(2 * i + 1));
          acc_cap[i] = __floats2half2_rn(1.f - t0 * t0, 1.f - t1 * t1);
          acc_S(2 * i) = out * t0;
          acc_S(2 * i + 1) = out * t1;
        }
      }
      if constexpr (kBias) {  // scaled units from here: scale * S + bias
        if (tile_class == fmha_sm90::kMixed) {
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < size(acc_S); ++i) {
            acc_S(i) = fmaf(params.scale_softmax, acc_S(i), float(kBiasAhead ? bias_r(i) : bias_at(i)));
          }
        } else if (tile_class == fmha_sm90::kVisible) {
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < size(acc_S); ++i) acc_S(i) *= params.scale_softmax;
        } else {
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < size(acc_S); ++i) acc_S(i) = -INFINITY;
        }
      }
      if constexpr (kPacked) {
        mask_packed_scores(acc_S, tScS, tiled_mma_nm, rows_of_keys);
      } else {
        mask_scores<Kind>(params.band, acc_S, tScS, int(get<3>(problem_size)));
      }
      constexpr ElementAccumulator kLog2e = 1.4426950408889634f;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(acc_P); ++i) {
        if constexpr (kBias) {
          acc_P(i) = ::exp2f(kLog2e * (acc_S(i) - tSsLSE(_, _, _, smem_pipe_read_q.index())(i)));
        } else {
          acc_P(i) = ::exp2f(params.scale_softmax_log2 * acc_S(i) -
                             kLog2e * tSsLSE(_, _, _, smem_pipe_read_q.index())(i));
        }
      }

      // dS = P * (dP - D) * scale, in the element type (dropout: dP of the kept weights, times
      // 1 / (1 - p); the dropped ones' is 0).
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_DP);
      auto acc_DS = make_fragment_like<Element>(acc_DP);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(acc_DS); ++i) {
        float dp = acc_DP(i);
        if constexpr (kDropout) dp = (kept >> i) & 1 ? dp * params.dropout.scale : 0.f;
        float ds = acc_P(i) * params.scale_softmax * (dp - tDPsODO(_, _, _, smem_pipe_read_do.index())(i));
        if constexpr (Softcap) ds *= i % 2 ? __high2float(acc_cap[i / 2]) : __low2float(acc_cap[i / 2]);
        acc_DS(i) = ds;
      }

      // dV += P^T dO, issued before dS goes to shared memory (dropout: the kept weights times 1 / (1 - p)).
      if constexpr (kDropout) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(acc_P); ++i) acc_P(i) = (kept >> i) & 1 ? acc_P(i) * params.dropout.scale : 0.f;
      }
      auto op_P = cutlass::fmha::collective::make_acc_into_op<Element>(acc_P, typename TiledMmaND::LayoutA_TV{});
      warpgroup_fence_operand(acc_DV);
      warpgroup_fence_operand(op_P);
      warpgroup_arrive();
      cute::gemm(tiled_mma_nd, op_P, tDVrDO(_, _, _, smem_pipe_read_do.index()), acc_DV);
      warpgroup_commit_batch();

      auto tDPsDS_v = recast<uint_bit_t<sizeof_bits_v<Element> * 2>>(tDPsDS);
      auto acc_DS_v = recast<uint_bit_t<sizeof_bits_v<Element> * 2>>(acc_DS);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(acc_DS_v); ++i) tDPsDS_v(_, _, _, wg_idx)(i) = acc_DS_v(i);
      cutlass::arch::fence_view_async_shared();
      // Both groups' dS of this tile are in shared memory past this point.
      cutlass::arch::NamedBarrier::sync(NumMmaWarpGroups * cutlass::NumThreadsPerWarpGroup, kDsBarrier);

      // This group's half of dQ = dS K over all block_n keys (key half w: dS slot w, K stage of group w),
      // issued before dK so that dQ's store below overlaps dK's MMA.
      Tensor acc_DQ = partition_fragment_C(tiled_mma_dq, DqShape{});
      warpgroup_fence_operand(acc_DQ);
      warpgroup_arrive();
      if constexpr (kTransposedDq) {
        cutlass::fmha::collective::gemm_zero_acc(tiled_mma_dq, tDQrK(_, _, _, k_stage[0]), tDQrDS(_, _, _, 0), acc_DQ);
        cute::gemm(tiled_mma_dq, tDQrK(_, _, _, k_stage[1]), tDQrDS(_, _, _, 1), acc_DQ);
      } else {
        cutlass::fmha::collective::gemm_zero_acc(tiled_mma_dq, tDQrDS(_, _, _, 0), tDQrK(_, _, _, k_stage[0]), acc_DQ);
        cute::gemm(tiled_mma_dq, tDQrDS(_, _, _, 1), tDQrK(_, _, _, k_stage[1]), acc_DQ);
      }
      warpgroup_commit_batch();

      // dK += dS^T Q over this group's keys. It stays in flight through dQ's store and into the next
      // tile (wgmma batches complete in order: the next tile's wait for S also waits for it), so this
      // tile's Q stage is released only then.
      warpgroup_fence_operand(acc_DK);
      warpgroup_arrive();
      cute::gemm(TiledMmaND_SS{}, tDKrDSp(_, _, _, wg_idx), tDKrQ(_, _, _, smem_pipe_read_q.index()), acc_DK);
      warpgroup_commit_batch();

      // dV and dQ are complete past this point; dK may not be.
      warpgroup_wait<1>();
      warpgroup_fence_operand(acc_DV);
      warpgroup_fence_operand(acc_DQ);

      // The dQ half into the reducer's stage; the reducer warp adds the whole tile to global memory.
      pipeline_reducer.producer_acquire(smem_pipe_write_reducer);
      auto tDQsDQ = tDQsDQ_full(_, _, _, smem_pipe_write_reducer.index());
      if constexpr (kTransposedDq) {
        // Neighbouring accumulators are neighbouring queries here, d floats apart in the stage.
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(acc_DQ); ++i) tDQsDQ(i) = acc_DQ(i);
      } else {
        using Vec = uint_bit_t<sizeof_bits_v<ElementAccumulator> * 2>;
        auto tDQsDQ_v = recast<Vec>(tDQsDQ);
        auto acc_DQ_v = recast<Vec>(acc_DQ);
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(acc_DQ_v); ++i) tDQsDQ_v(i) = acc_DQ_v(i);
      }
      cutlass::arch::fence_view_async_shared();
      pipeline_reducer.producer_commit(smem_pipe_write_reducer);
      ++smem_pipe_write_reducer;

      --inner_tile_count;
      release_pending = true;

      tScS.data() = tScS.data() + E<1>{} * (q_step * get<1>(TileShapeNM{}));
      q_tile += q_step;
      parity ^= 1;
    }

    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_DK);
    warpgroup_fence_operand(acc_DV);
    if (release_pending) release_inner_tile();

    pipeline_outer.consumer_release(smem_pipe_read_k);
    pipeline_outer.consumer_release(smem_pipe_read_outer);
    pipeline_reducer.producer_tail(smem_pipe_write_reducer);
    ++smem_pipe_read_outer;
    return make_tuple(acc_DK, acc_DV);
  }
};

}  // namespace gemmgen::fmha_bwd_sm90
