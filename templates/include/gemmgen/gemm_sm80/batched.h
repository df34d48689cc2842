// The gemm_sm80 family: CUTLASS 2.x GemmUniversal in batched mode (strided strategy) and array
// mode (pointer-array strategy), tensor cores mma.sync 16x8x16, fp32 accumulation.
#pragma once
#include <type_traits>

#include "cutlass/cutlass.h"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/device/gemm_universal.h"
#include "cutlass/gemm/threadblock/threadblock_swizzle.h"

#include "gemmgen/gemm/batched_host.h"

namespace gemmgen::gemm_sm80 {

using gemmgen::report;

// Derives the CUTLASS device GEMM from the instance's few integers. Alignment 8 (16-byte
// vectors) uses the cp.async multistage mainloop; alignment 1 runs any row stride and extent,
// through the 2-stage mainloop of plain loads (cp.async moves 4, 8 or 16 bytes, never 2).
template <class Element_, class ElementOut_, bool BTransposed, int TileM, int TileN, int TileK,
          int WarpsM, int WarpsN, int Stages, int Align>
struct Traits {
  using Element = Element_;
  using ElementOut = ElementOut_;
  static constexpr bool kBTransposed = BTransposed;
  static constexpr int kAlign = Align;
  // C in 16-byte vectors where the inputs allow vectors at all.
  static constexpr int kAlignC = Align == 1 ? 1 : 128 / cutlass::sizeof_bits<ElementOut>::value;
  static constexpr int kStages = Stages;
  static_assert(Align == 1 ? Stages == 2 : Stages >= 3, "alignment 1 is the 2-stage mainloop");
  static_assert(TileM % (16 * WarpsM) == 0 && TileN % (8 * WarpsN) == 0, "warps tile the block");

  using LayoutB = std::conditional_t<BTransposed, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  using Epilogue = cutlass::epilogue::thread::LinearCombination<
      ElementOut, kAlignC, float, float, cutlass::epilogue::thread::ScaleType::OnlyAlphaScaling>;
  using Gemm = cutlass::gemm::device::GemmUniversal<
      Element, cutlass::layout::RowMajor, Element, LayoutB, ElementOut, cutlass::layout::RowMajor, float,
      cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80,
      cutlass::gemm::GemmShape<TileM, TileN, TileK>,
      cutlass::gemm::GemmShape<TileM / WarpsM, TileN / WarpsN, TileK>,
      cutlass::gemm::GemmShape<16, 8, 16>, Epilogue,
      cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<>, Stages, Align, Align>;
  static constexpr int kThreads = 32 * WarpsM * WarpsN;
  static constexpr int kTileM = TileM, kTileN = TileN, kTileK = TileK;
};

template <class Traits>
int launch(cutlass::gemm::GemmUniversalMode mode, const GemmgenBatchedGemmStridedArgs& p,
           const void* a, const void* b, void* c, const gemm::Launch& l, cudaStream_t stream,
           char* err, int err_len) {
  using Gemm = typename Traits::Gemm;
  typename Gemm::Arguments args(
      mode, cutlass::gemm::GemmCoord(int(p.M), int(p.N), int(p.K)), l.count, {p.alpha, 0.0f},
      a, b, c, c, l.step_a, l.step_b, l.step_c, l.step_c,
      p.stride_a_row, p.stride_b_row, p.stride_c_row, p.stride_c_row);
  Gemm gemm;
  cutlass::Status status = gemm.can_implement(args);
  if (status != cutlass::Status::kSuccess) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "CUTLASS cannot run these arguments: %s",
                  cutlassGetStatusString(status));
  }
  // Batched and array modes without split-K need no workspace.
  status = gemm.initialize(args, nullptr, stream);
  if (status == cutlass::Status::kSuccess) status = gemm.run(stream);
  if (status != cutlass::Status::kSuccess) {
    cudaError_t e = cudaGetLastError();
    return report(err, err_len, GEMMGEN_CUDA_ERROR, "CUTLASS launch failed: %s (%s)",
                  cutlassGetStatusString(status), cudaGetErrorString(e));
  }
  return gemm::check_launch(cudaSuccess, "batched GEMM launch", err, err_len);
}

template <class Traits>
int check_pointer(const void* ptr, const char* name, char* err, int err_len) {
  constexpr int kBytes = Traits::kAlign * int(sizeof(typename Traits::Element));
  if (ptr == nullptr || !gemm::aligned(ptr, kBytes)) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "%s is NULL or not %d-byte aligned", name, kBytes);
  }
  return GEMMGEN_OK;
}

template <class Traits>
int run_strided(const GemmgenBatchedGemmStridedArgs* p, cudaStream_t stream, char* err, int err_len) {
  if (p == nullptr) return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "args is NULL");
  if (int s = gemm::check_sizes(*p, Traits::kBTransposed, Traits::kAlign, Traits::kAlignC, err, err_len)) return s;
  for (auto [ptr, name] : {std::pair<const void*, const char*>{p->A, "A"}, {p->B, "B"}, {p->C, "C"}}) {
    if (int s = check_pointer<Traits>(ptr, name, err, err_len)) return s;
  }
  if (int s = gemm::check_batch_strides(*p, Traits::kAlign, Traits::kAlignC, err, err_len)) return s;
  using Element = typename Traits::Element;
  using ElementOut = typename Traits::ElementOut;
  return gemm::for_each_launch(*p, [&](const gemm::Launch& l) {
    return launch<Traits>(cutlass::gemm::GemmUniversalMode::kBatched, *p,
                          static_cast<const Element*>(p->A) + l.a, static_cast<const Element*>(p->B) + l.b,
                          static_cast<ElementOut*>(p->C) + l.c, l, stream, err, err_len);
  });
}

template <class Traits>
int run_ptrs(const GemmgenBatchedGemmPtrArgs* p, cudaStream_t stream, char* err, int err_len) {
  if (p == nullptr) return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "args is NULL");
  if (int s = gemm::check_sizes(*p, Traits::kBTransposed, Traits::kAlign, Traits::kAlignC, err, err_len)) return s;
  if (p->A_ptrs == nullptr || p->B_ptrs == nullptr || p->C_ptrs == nullptr) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "a pointer array is NULL");
  }
  // The arrays live on the device: the caller checked each pointer's alignment.
  GemmgenBatchedGemmStridedArgs s{};
  s.M = p->M, s.N = p->N, s.K = p->K, s.alpha = p->alpha;
  s.stride_a_row = p->stride_a_row, s.stride_b_row = p->stride_b_row, s.stride_c_row = p->stride_c_row;
  const int64_t total = int64_t(p->batch) * p->num_heads;
  for (int64_t first = 0; first < total; first += gemm::kMaxBatchPerLaunch) {
    gemm::Launch l{0, 0, 0, 0, 0, 0,
                   int(total - first < gemm::kMaxBatchPerLaunch ? total - first : gemm::kMaxBatchPerLaunch)};
    if (int status = launch<Traits>(cutlass::gemm::GemmUniversalMode::kArray, s, p->A_ptrs + first,
                                    p->B_ptrs + first, const_cast<void**>(p->C_ptrs + first), l, stream,
                                    err, err_len)) {
      return status;
    }
  }
  return GEMMGEN_OK;
}

template <class Traits, int Strategy>
int info(GemmgenGemmInfo* info) {
  if (info == nullptr) return GEMMGEN_INVALID_ARGUMENT;
  *info = GemmgenGemmInfo{GEMMGEN_ABI_VERSION, Traits::kTileM, Traits::kTileN, Traits::kTileK,
                          Traits::kStages, Traits::kThreads,
                          int(sizeof(typename Traits::Gemm::GemmKernel::SharedStorage)), Traits::kAlign,
                          int(Traits::kBTransposed), Strategy, int(sizeof(typename Traits::ElementOut))};
  return GEMMGEN_OK;
}

}  // namespace gemmgen::gemm_sm80
