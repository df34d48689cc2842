// The gemm_sm90 family: CUTLASS 3.x GEMMs built by the collective builders (TMA + wgmma, warp
// specialized), batch mode L = the batch index (strided strategy, one L stride: (batch, head) is
// mapped onto it by gemmgen::gemm::for_each_launch) and pointer-array mode (KernelPtrArray*,
// as CUTLASS's example 56 configures it).
#pragma once
#include <atomic>
#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/kernel_hardware_info.h"

#include "gemmgen/gemm/batched_host.h"
#include "gemmgen/gemm_sm90/in_order_scheduler.h"
#include "gemmgen/gemm_sm90/scaled_output.h"
#include "gemmgen/gemm_sm90/workspace.h"
#include "gemmgen/smem.h"

namespace gemmgen::gemm_sm90 {

using gemmgen::report;

struct Cooperative {  // two consumer warpgroups share one tile (tile_m >= 128)
  using Kernel = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::TmaWarpSpecializedCooperative;
  using PtrKernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using PtrEpilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
struct Pingpong {  // two consumer warpgroups alternate tiles: one's epilogue hides under the other's MMAs
  using Kernel = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
  using Epilogue = cutlass::epilogue::TmaWarpSpecialized;
  using PtrKernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using PtrEpilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};

// CUTLASS's TMA warp-specialized mainloop with the A and B loads marked EVICT_LAST in L2: the
// output tiles stream through L2 once, and with the default policy they can push out operand lines
// that other tiles of the same batch still read, which then come from memory a second time
// (bench/NOTES.md, experiment 24). Only the producer's load() differs from CUTLASS's.
template <class Base>
struct EvictLastMainloop : Base {
  template <class TensorA, class TensorB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(typename Base::Params const& params, typename Base::MainloopPipeline pipeline,
                           typename Base::PipelineState smem_pipe_write,
                           cute::tuple<TensorA, TensorB> const& load_inputs, BlockCoord const& blk_coord,
                           KTileIterator k_tile_iter, int k_tile_count, int /*thread_idx*/,
                           uint32_t block_rank_in_cluster, typename Base::TensorStorage& shared_tensors) {
    using namespace cute;
    using Cluster = typename Base::DispatchPolicy::ClusterShape;
    if (!cute::elect_one_sync()) return;
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), typename Base::SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), typename Base::SmemLayoutB{});
    constexpr uint32_t cx = get<0>(Cluster{});
    const uint32_t bx = block_rank_in_cluster % cx, by = block_rank_in_cluster / cx;
    auto tma_a = params.tma_load_a.get_slice(by);
    auto tma_b = params.tma_load_b.get_slice(bx);
    auto [m, n, k, l] = blk_coord;
    Tensor tAgA = tma_a.partition_S(get<0>(load_inputs)(_, _, m, _, l));
    Tensor tAsA = tma_a.partition_D(sA);
    Tensor tBgB = tma_b.partition_S(get<1>(load_inputs)(_, _, n, _, l));
    Tensor tBsB = tma_b.partition_D(sB);
    // A tile goes to the cluster's CTAs in its row, a B tile to those in its column.
    uint16_t mask_a = 0, mask_b = 0;
    auto blocks = Layout<Cluster>{};
    if constexpr (cute::is_same_v<typename Base::GmemTiledCopyA, SM90_TMA_LOAD_MULTICAST>) {
      for (int j = 0; j < size<1>(blocks); ++j) mask_a |= uint16_t(1) << blocks(bx, j, Int<0>{});
    }
    if constexpr (cute::is_same_v<typename Base::GmemTiledCopyB, SM90_TMA_LOAD_MULTICAST>) {
      for (int i = 0; i < size<0>(blocks); ++i) mask_b |= uint16_t(1) << blocks(i, by, Int<0>{});
    }
    constexpr auto hint = TMA::CacheHintSm90::EVICT_LAST;
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count, ++k_tile_iter, ++smem_pipe_write) {
      pipeline.producer_acquire(smem_pipe_write);
      auto* barrier = pipeline.producer_get_barrier(smem_pipe_write);
      const int stage = smem_pipe_write.index();
      copy(params.tma_load_a.with(*barrier, mask_a, hint), tAgA(_, _, _, *k_tile_iter), tAsA(_, _, _, stage));
      copy(params.tma_load_b.with(*barrier, mask_b, hint), tBgB(_, _, _, *k_tile_iter), tBsB(_, _, _, stage));
    }
  }
};

// Derives the CUTLASS 3.x kernel from the instance's integers. TMA needs 16-byte aligned
// pointers and strides: alignment is one 16-byte vector for every operand.
template <class Element_, class ElementOut_, bool BTransposed, int TileM, int TileN, int TileK,
          int ClusterM, int ClusterN, int EpiTileN, class Schedule, bool PtrArray,
          class TileScheduler = cutlass::gemm::PersistentScheduler, bool EvictLast = false>
struct Traits {
  using Element = Element_;
  using ElementOut = ElementOut_;
  static constexpr bool kBTransposed = BTransposed;
  static constexpr int kAlign = 128 / cutlass::sizeof_bits<Element>::value;
  static constexpr int kAlignC = 128 / cutlass::sizeof_bits<ElementOut>::value;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = std::conditional_t<BTransposed, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  using LayoutC = cutlass::layout::RowMajor;
  using TileShape = cute::Shape<cute::Int<TileM>, cute::Int<TileN>, cute::Int<TileK>>;
  using ClusterShape = cute::Shape<cute::Int<ClusterM>, cute::Int<ClusterN>, cute::_1>;
  // 0: CUTLASS's sub-tile (32 columns); else the consumer rows (128 cooperative, 64 ping-pong) by EpiTileN.
  using EpilogueTile = std::conditional_t<
      EpiTileN == 0, cutlass::epilogue::collective::EpilogueTileAuto,
      cute::Shape<cute::Int<(std::is_same_v<Schedule, Cooperative> ? 128 : 64)>, cute::Int<(EpiTileN ? EpiTileN : 32)>>>;
  using KernelSchedule = std::conditional_t<PtrArray, typename Schedule::PtrKernel, typename Schedule::Kernel>;
  using EpilogueSchedule = std::conditional_t<PtrArray, typename Schedule::PtrEpilogue, typename Schedule::Epilogue>;
  // C is never read (beta = 0): void source; D = alpha * acc (ScaledOutput).
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      EpilogueTile, float, float,
      void, LayoutC, kAlignC, ElementOut, LayoutC, kAlignC, EpilogueSchedule, ScaledOutput<ElementOut>>::CollectiveOp;
  using BuiltMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA, kAlign, Element, LayoutB, kAlign,
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage) +
          (std::is_same_v<TileScheduler, InOrderScheduler> ? sizeof(InOrderTileScheduler<true>::SharedStorage) : 0))>,
      KernelSchedule>::CollectiveOp;
  static_assert(!(PtrArray && EvictLast), "evict-last loads are a variant of the strided mainloop");
  using CollectiveMainloop = std::conditional_t<EvictLast, EvictLastMainloop<BuiltMainloop>, BuiltMainloop>;
  using ProblemShape = std::conditional_t<PtrArray, cutlass::gemm::ArrayProblemShape<cute::Shape<int, int, int, int>>,
                                          cute::Shape<int, int, int, int>>;
  // The pointer-array kernels bring their own (grouped) scheduler.
  using GemmKernel = std::conditional_t<
      PtrArray, cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>,
      cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue, TileScheduler>>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
  static constexpr int kTileM = TileM, kTileN = TileN, kTileK = TileK;
  static constexpr int kStages = CollectiveMainloop::DispatchPolicy::Stages;
  static constexpr int kThreads = GemmKernel::MaxThreadsPerBlock;
};

// A CUTLASS 3.x stride (row mode and unit mode in either order, then L) from a row stride and
// an L stride; static modes (the unit stride, a ptr-array kernel's L) are left as they are.
template <class Stride>
Stride make_stride(int64_t row, int64_t batch) {
  Stride s{};
  if constexpr (!cute::is_static<std::decay_t<decltype(cute::get<0>(s))>>::value) {
    cute::get<0>(s) = row;
  } else {
    cute::get<1>(s) = row;
  }
  if constexpr (!cute::is_static<std::decay_t<decltype(cute::get<2>(s))>>::value) cute::get<2>(s) = batch;
  return s;
}

// can_implement, workspace (stream-ordered; stream-K's partial sums), params, launch: what
// GemmUniversalAdapter::initialize + run do, with the shared-memory opt-in done once per device
// (the adapter repeats it, a driver call, on every initialize()).
template <class Traits>
int launch(typename Traits::Gemm::Arguments& args, cudaStream_t stream, char* err, int err_len) {
  using Gemm = typename Traits::Gemm;
  using GemmKernel = typename Traits::GemmKernel;
  cutlass::Status status = Gemm::can_implement(args);
  if (status != cutlass::Status::kSuccess) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "CUTLASS cannot run these arguments: %s",
                  cutlassGetStatusString(status));
  }
  if (int s = gemmgen::opt_in_smem<&cutlass::device_kernel<GemmKernel>>(int(GemmKernel::SharedStorageSize),
                                                                         err, err_len)) {
    return s;
  }
  size_t bytes = GemmKernel::get_workspace_size(args);
  void* workspace = nullptr;
  if (bytes > 0) {
    if (cudaError_t e = workspace_alloc(&workspace, bytes, stream)) {
      return report(err, err_len, GEMMGEN_CUDA_ERROR, "workspace: %s", cudaGetErrorString(e));
    }
  }
  status = GemmKernel::initialize_workspace(args, workspace, stream);
  if (status == cutlass::Status::kSuccess) {
    typename GemmKernel::Params params = GemmKernel::to_underlying_arguments(args, workspace);
    status = Gemm::run(params, stream);
  }
  cudaError_t e = cudaGetLastError();
  if (workspace != nullptr) cudaFreeAsync(workspace, stream);
  if (status != cutlass::Status::kSuccess || e != cudaSuccess) {
    return report(err, err_len, GEMMGEN_CUDA_ERROR, "CUTLASS launch failed: %s (%s)",
                  cutlassGetStatusString(status), cudaGetErrorString(e));
  }
  return GEMMGEN_OK;
}

// The device and its SM count (the persistent grid's size), the count queried once per device.
inline cutlass::KernelHardwareInfo hardware() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> sm_counts[kMaxDevices];
  cutlass::KernelHardwareInfo hw;
  cudaGetDevice(&hw.device_id);
  int count = hw.device_id < kMaxDevices ? sm_counts[hw.device_id].load() : 0;
  if (count == 0) {
    count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(hw.device_id);
    if (hw.device_id < kMaxDevices) sm_counts[hw.device_id].store(count);
  }
  hw.sm_count = count;
  return hw;
}

template <class Traits>
int check_pointers(std::initializer_list<const void*> ptrs, char* err, int err_len) {
  for (const void* p : ptrs) {
    if (p == nullptr || !gemm::aligned(p, 16)) {
      return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "a pointer is NULL or not 16-byte aligned");
    }
  }
  return GEMMGEN_OK;
}

template <class Traits>
int run_strided(const GemmgenBatchedGemmStridedArgs* p, cudaStream_t stream, char* err, int err_len) {
  using Kernel = typename Traits::GemmKernel;
  if (p == nullptr) return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "args is NULL");
  if (int s = gemm::check_sizes(*p, Traits::kBTransposed, Traits::kAlign, Traits::kAlignC, err, err_len)) return s;
  if (int s = check_pointers<Traits>({p->A, p->B, p->C}, err, err_len)) return s;
  if (int s = gemm::check_batch_strides(*p, Traits::kAlign, Traits::kAlignC, err, err_len)) return s;
  const auto hw = hardware();
  using Element = typename Traits::Element;
  using ElementOut = typename Traits::ElementOut;
  return gemm::for_each_launch(*p, [&](const gemm::Launch& l) {
    typename Traits::Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {int(p->M), int(p->N), int(p->K), l.count},
        {static_cast<const Element*>(p->A) + l.a, make_stride<typename Kernel::StrideA>(p->stride_a_row, l.step_a),
         static_cast<const Element*>(p->B) + l.b, make_stride<typename Kernel::StrideB>(p->stride_b_row, l.step_b)},
        {{p->alpha}, nullptr, make_stride<typename Kernel::StrideC>(p->stride_c_row, l.step_c),
         static_cast<ElementOut*>(p->C) + l.c, make_stride<typename Kernel::StrideD>(p->stride_c_row, l.step_c)},
        hw};
    return launch<Traits>(args, stream, err, err_len);
  });
}

template <class Traits>
int run_ptrs(const GemmgenBatchedGemmPtrArgs* p, cudaStream_t stream, char* err, int err_len) {
  using Kernel = typename Traits::GemmKernel;
  using Element = typename Traits::Element;
  using ElementOut = typename Traits::ElementOut;
  if (p == nullptr) return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "args is NULL");
  if (int s = gemm::check_sizes(*p, Traits::kBTransposed, Traits::kAlign, Traits::kAlignC, err, err_len)) return s;
  if (p->A_ptrs == nullptr || p->B_ptrs == nullptr || p->C_ptrs == nullptr) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "a pointer array is NULL");
  }
  const int64_t total = int64_t(p->batch) * p->num_heads;
  if (total > INT32_MAX) return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "too many matrices");
  typename Traits::Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kArray,
      {{int(p->M), int(p->N), int(p->K), int(total)}},
      {reinterpret_cast<const Element**>(const_cast<const void**>(p->A_ptrs)),
       make_stride<typename Kernel::StrideA>(p->stride_a_row, 0),
       reinterpret_cast<const Element**>(const_cast<const void**>(p->B_ptrs)),
       make_stride<typename Kernel::StrideB>(p->stride_b_row, 0)},
      {{p->alpha}, nullptr, make_stride<typename Kernel::StrideC>(p->stride_c_row, 0),
       reinterpret_cast<ElementOut**>(const_cast<void**>(p->C_ptrs)),
       make_stride<typename Kernel::StrideD>(p->stride_c_row, 0)},
      hardware()};
  return launch<Traits>(args, stream, err, err_len);
}

template <class Traits, int Strategy>
int info(GemmgenGemmInfo* info) {
  if (info == nullptr) return GEMMGEN_INVALID_ARGUMENT;
  *info = GemmgenGemmInfo{GEMMGEN_ABI_VERSION, Traits::kTileM, Traits::kTileN, Traits::kTileK,
                          Traits::kStages, Traits::kThreads, int(Traits::GemmKernel::SharedStorageSize),
                          Traits::kAlign, int(Traits::kBTransposed), Strategy, int(sizeof(typename Traits::ElementOut))};
  return GEMMGEN_OK;
}

}  // namespace gemmgen::gemm_sm90
