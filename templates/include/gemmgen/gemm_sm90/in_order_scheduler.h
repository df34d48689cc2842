// A dynamic persistent tile scheduler for CUTLASS's sm90 cooperative GEMM kernel: each cluster
// takes its next output tile from a global counter, so tiles are started in index order, as the
// hardware's block scheduler would start them, while the CTAs stay resident and overlap a tile's
// epilogue with the next tile's loads.
//
// Why: with CUTLASS's static persistent schedule CTA c runs tiles c, c + G, c + 2G, ... The CTAs
// drift apart over hundreds of tiles, so the tiles of one batch, which read the same A and B, run
// further apart in time than the operands live in L2 while a large C streams through it: on the
// output-bound Q Kᵀ shapes a quarter of the operand bytes came from memory twice. A grid of one
// CTA per tile read them once (bench/NOTES.md, experiments 24 and 25).
//
// How: CUTLASS's sm90 kernels carry hooks for a dynamic scheduler (a scheduler warp, a pipeline
// of responses in shared memory, a throttle that keeps the scheduler one tile ahead of the loads);
// on sm90 no scheduler of CUTLASS's uses them. This one fills them: the scheduler warp of the
// cluster's first CTA takes a ticket with one atomicAdd and writes it into every CTA of the
// cluster with st.async, which completes the transaction on that CTA's barrier; every role of
// every CTA reads the ticket and releases the slot on the first CTA's barrier. The counter lives
// in the kernel's workspace and is zeroed before each launch. The first tile of each cluster is
// its place in the grid, as in the static schedule; ticket t then maps to the cluster tile
// (number of clusters + t), so the mapping from linear index to (m, n, l) is CUTLASS's own.
#pragma once
#include <cuda_runtime.h>

#include "cute/arch/cluster_sm90.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/gemm/kernel/sm90_tile_scheduler.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"
#include "cutlass/pipeline/sm90_pipeline.hpp"

namespace gemmgen::gemm_sm90 {

// The tag a GemmUniversal takes in place of cutlass::gemm::PersistentScheduler.
struct InOrderScheduler {};

namespace in_order {

constexpr int kStages = 4;  // tickets in flight per cluster; the throttle keeps it near one

CUTLASS_DEVICE uint32_t smem_addr(const void* p) { return cute::cast_smem_ptr_to_uint(p); }

// The same shared-memory offset in CTA `cta` of the cluster.
CUTLASS_DEVICE uint32_t in_cta(uint32_t addr, uint32_t cta) {
  uint32_t out;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(out) : "r"(addr), "r"(cta));
  return out;
}

// Writes 4 bytes into another CTA's shared memory and completes 4 bytes of that CTA's barrier.
CUTLASS_DEVICE void store_async(uint32_t addr, uint32_t value, uint32_t barrier) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];"
               :: "r"(addr), "r"(value), "r"(barrier) : "memory");
}

CUTLASS_DEVICE uint32_t cluster_size() {
  const dim3 cs = cute::cluster_shape();
  return cs.x * cs.y * cs.z;
}

// The response pipeline: full barriers in every CTA (one arrival with the ticket's 4 bytes, armed
// by the first CTA), empty barriers used in the first CTA only (every consumer thread of the
// cluster arrives there). The interface is the one CUTLASS's kernels call. Kernels of one CTA per
// cluster are launched without a cluster, where shared::cluster operations are illegal: they keep
// everything in the CTA (a plain store, then an arrival that releases it).
template <int Stages_, bool Clustered>
class TicketPipeline {
 public:
  static constexpr uint32_t Stages = Stages_;
  using PipelineState = cutlass::PipelineState<Stages>;
  struct SharedStorage {
    cutlass::arch::ClusterTransactionBarrier full[Stages];
    cutlass::arch::ClusterBarrier empty[Stages];
  };
  enum class ThreadCategory { NonParticipant, Producer, Consumer, ProducerConsumer };
  struct Params {
    uint32_t transaction_bytes = 0;
    ThreadCategory role = ThreadCategory::NonParticipant;
    uint32_t is_leader = 0;
    uint32_t num_consumers = 0;
    uint32_t producer_blockid = 0;
    uint32_t producer_arv_count = 0;
    uint32_t consumer_arv_count = 0;  // per CTA
    int initializing_warp = 0;
  };

  CUTLASS_DEVICE TicketPipeline(SharedStorage& storage, Params const& params)
      : full_(storage.full), empty_(storage.empty), bytes_(params.transaction_bytes),
        first_(cute::block_rank_in_cluster() == 0), cluster_size_(cluster_size()) {
    if (cutlass::canonical_warp_idx_sync() == params.initializing_warp && cute::elect_one_sync()) {
      for (uint32_t i = 0; i < Stages; ++i) {
        full_[i].init(1);
        empty_[i].init(params.consumer_arv_count * cluster_size_);
      }
    }
    cutlass::arch::fence_barrier_init();
  }

  // First CTA, whole scheduler warp: wait until the slot is free, then arm every CTA's full barrier.
  CUTLASS_DEVICE void producer_acquire(PipelineState state) {
    if (!first_) return;
    empty_[state.index()].wait(state.phase());
    if constexpr (Clustered) {
      const uint32_t lane = cutlass::canonical_lane_idx();
      full_[state.index()].arrive_and_expect_tx(bytes_, lane, lane < cluster_size_);
      __syncwarp();
    }
  }

  // First CTA, one thread: the ticket into `slot` of every CTA, completing the slot's full barrier.
  CUTLASS_DEVICE void publish(PipelineState state, uint32_t* slot, uint32_t ticket) {
    if constexpr (Clustered) {
      const uint32_t data = smem_addr(slot), barrier = smem_addr(&full_[state.index()]);
      for (uint32_t cta = 0; cta < cluster_size_; ++cta) store_async(in_cta(data, cta), ticket, in_cta(barrier, cta));
    } else {
      *reinterpret_cast<volatile uint32_t*>(slot) = ticket;
      full_[state.index()].arrive();  // release: the store is visible to the threads that wait
    }
  }

  CUTLASS_DEVICE void consumer_wait(PipelineState state) { full_[state.index()].wait(state.phase()); }
  CUTLASS_DEVICE void consumer_release(PipelineState state) {
    if constexpr (Clustered) {
      empty_[state.index()].arrive(0u, 1u);
    } else {
      empty_[state.index()].arrive();
    }
  }

  // The first CTA may not exit while other CTAs can still arrive on its barriers.
  CUTLASS_DEVICE void producer_tail(PipelineState state) {
    if (!first_) return;
    for (uint32_t i = 0; i < Stages; ++i, ++state) empty_[state.index()].wait(state.phase());
  }

  CUTLASS_DEVICE bool first_cta() const { return first_; }

 private:
  cutlass::arch::ClusterTransactionBarrier* full_;
  cutlass::arch::ClusterBarrier* empty_;
  uint32_t bytes_;
  bool first_;
  uint32_t cluster_size_;
};

// CUTLASS's throttle (the mainloop warp signals each new tile, the scheduler warp waits for it
// before the next ticket), kept inside each CTA: PipelineAsync as the kernel configures it would
// send every CTA's arrivals to the first CTA.
template <int Stages_>
struct LocalThrottle : cutlass::PipelineAsync<Stages_> {
  using Base = cutlass::PipelineAsync<Stages_>;
  CUTLASS_DEVICE LocalThrottle(typename Base::SharedStorage& storage, typename Base::Params params)
      : Base(storage, local(params)) {}
  CUTLASS_DEVICE static typename Base::Params local(typename Base::Params params) {
    params.dst_blockid = cute::block_rank_in_cluster();
    return params;
  }
};

}  // namespace in_order

template <bool Clustered>
class InOrderTileScheduler : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90 {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;

 public:
  static constexpr bool IsDynamicPersistent = true;
  using Pipeline = in_order::TicketPipeline<in_order::kStages, Clustered>;
  using ThrottlePipeline = in_order::LocalThrottle<in_order::kStages>;
  struct CLCResponse {
    uint32_t ticket;
  };
  class SharedStorage {
   public:
    CUTLASS_DEVICE typename Pipeline::SharedStorage& pipeline() { return pipeline_; }
    CUTLASS_DEVICE typename ThrottlePipeline::SharedStorage& throttle_pipeline() { return throttle_; }
    CUTLASS_DEVICE CLCResponse* data() { return data_; }

   private:
    alignas(16) typename Pipeline::SharedStorage pipeline_;
    alignas(16) typename ThrottlePipeline::SharedStorage throttle_;
    alignas(16) CLCResponse data_[in_order::kStages];
  };

  using RasterOrder = Base::RasterOrder;
  using WorkTileInfo = Base::WorkTileInfo;
  struct Params : Base::Params {
    uint32_t* counter = nullptr;
  };
  using Arguments = Base::Arguments;

  template <class ProblemShapeMNKL, class TileShape, class ClusterShape>
  static Params to_underlying_arguments(ProblemShapeMNKL problem, TileShape tile, ClusterShape cluster,
                                        cutlass::KernelHardwareInfo const& hw_info, Arguments const& args,
                                        void* workspace = nullptr, uint32_t epilogue_subtile = 1,
                                        uint32_t ktile_start_alignment_count = 1u) {
    Params params;
    static_cast<Base::Params&>(params) = Base::to_underlying_arguments(
        problem, tile, cluster, hw_info, args, workspace, epilogue_subtile, ktile_start_alignment_count);
    params.counter = static_cast<uint32_t*>(workspace);
    return params;
  }

  template <class ProblemShape, class ElementAccumulator, class... Rest>
  static size_t get_workspace_size(Arguments const&, ProblemShape, cutlass::KernelHardwareInfo const&, Rest...) {
    return 16;  // the counter, in a 16-byte slot so that later workspace stays aligned
  }

  template <class ProblemShape, class ElementAccumulator, class... Rest>
  static cutlass::Status initialize_workspace(Arguments const&, void* workspace, cudaStream_t stream, ProblemShape,
                                              cutlass::KernelHardwareInfo const&, Rest...) {
    if (workspace == nullptr) return cutlass::Status::kErrorWorkspaceNull;
    return cudaMemsetAsync(workspace, 0, sizeof(uint32_t), stream) == cudaSuccess ? cutlass::Status::kSuccess
                                                                                : cutlass::Status::kErrorInternal;
  }

  CUTLASS_DEVICE explicit InOrderTileScheduler(Params const& params) : Base(params), counter_(params.counter) {
#if defined(__CUDA_ARCH__)
    // The static schedule's first linear index: cluster index * cluster size + place in the cluster.
    const uint64_t linear = params.raster_order_ == RasterOrder::AlongN
                                ? uint64_t(blockIdx.x) + uint64_t(blockIdx.y) * gridDim.x
                                : uint64_t(blockIdx.x) * gridDim.y + uint64_t(blockIdx.y);
    const uint32_t cs = in_order::cluster_size();
    offset_ = uint32_t(linear % cs);
    clusters_ = uint32_t(uint64_t(gridDim.x) * gridDim.y * gridDim.z / cs);
#endif
  }

  // The kernel's other calls (a warpgroup without work in a tile: never, for whole tiles).
  using Base::advance_to_next_work;
  using Base::fetch_next_work;

  CUTLASS_DEVICE void set_data_ptr(CLCResponse* data) { data_ = data; }

  // Scheduler warp: the next ticket, one tile ahead of the loads (the kernel's throttle).
  template <class State>
  CUTLASS_DEVICE State advance_to_next_work(Pipeline& pipeline, State state) const {
    pipeline.producer_acquire(state);
    if (pipeline.first_cta() && cute::elect_one_sync()) {
      pipeline.publish(state, &data_[state.index()].ticket, clusters_ + atomicAdd(counter_, 1u));
    }
    ++state;
    return state;
  }

  // Every role: the tile of the next ticket, for this CTA's place in the cluster.
  template <class TileSchedulerPipeline, class TileSchedulerPipelineState>
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo, TileSchedulerPipeline& pipeline, TileSchedulerPipelineState state) {
    pipeline.consumer_wait(state);
    uint32_t ticket;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(ticket) : "r"(in_order::smem_addr(&data_[state.index()])) : "memory");
    pipeline.consumer_release(state);
    const uint64_t linear = uint64_t(ticket) * in_order::cluster_size() + offset_;
    return cute::make_tuple(get_current_work_for_linear_idx(linear), true);
  }

 private:
  uint32_t* counter_ = nullptr;
  CLCResponse* data_ = nullptr;
  uint32_t offset_ = 0;
  uint32_t clusters_ = 0;
};

}  // namespace gemmgen::gemm_sm90

namespace cutlass::gemm::kernel::detail {

template <class ArchTag, class TileShape, class ClusterShape, uint32_t SchedulerPipelineStageCount,
          class ProblemShapeType>
struct TileSchedulerSelector<gemmgen::gemm_sm90::InOrderScheduler, ArchTag, TileShape, ClusterShape,
                             SchedulerPipelineStageCount, ProblemShapeType> {
  using Scheduler = gemmgen::gemm_sm90::InOrderTileScheduler<(cute::size(ClusterShape{}) > 1)>;
};

}  // namespace cutlass::gemm::kernel::detail
