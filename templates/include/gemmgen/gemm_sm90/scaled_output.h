// The gemm_sm90 epilogue's per-element work: D = convert(alpha * acc), C never read.
//
// CUTLASS's LinearCombination multiplies every accumulator by alpha, one FMUL per output element,
// which on the output-bound Q Kᵀ shapes is a fifth of the kernel's instructions, issued in the
// epilogue while the tensor cores wait (bench/NOTES.md, experiment 27). alpha = 1 is the common
// case (torch.matmul's contract, Q Kᵀ with the scale applied later), so the multiply is left out
// then: the branch is taken once per fragment, and x * 1 == x exactly, so the result is the same.
#pragma once
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"
#include "cutlass/numeric_conversion.h"

namespace gemmgen::gemm_sm90 {

// A CUTLASS 3.x epilogue visitor (a one-node tree) that the collective builder takes in place of
// a fusion operation.
template <class ElementOut, cutlass::FloatRoundStyle Round = cutlass::FloatRoundStyle::round_to_nearest>
struct ScaledOutput {
  struct SharedStorage {};
  struct Arguments {
    float alpha = 1.0f;
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const&) {
    return true;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_HOST_DEVICE ScaledOutput() {}
  CUTLASS_HOST_DEVICE ScaledOutput(Params const& params, SharedStorage const&) : params(params) {}
  Params params;

  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }

  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(cutlass::epilogue::fusion::ProducerLoadArgs<Args...> const&) {
    return cutlass::epilogue::fusion::EmptyProducerLoadCallbacks{};
  }

  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE explicit ConsumerStoreCallbacks(float alpha) : alpha(alpha), scale(alpha != 1.0f) {}
    float alpha;
    bool scale;

    template <class ElementAcc, int N>
    CUTLASS_DEVICE cutlass::Array<ElementOut, N> visit(cutlass::Array<ElementAcc, N> const& acc, int, int, int) {
      cutlass::NumericArrayConverter<ElementOut, ElementAcc, N, Round> convert;
      if (!scale) return convert(acc);
      cutlass::multiplies<cutlass::Array<ElementAcc, N>> mul;
      return convert(mul(ElementAcc(alpha), acc));
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cutlass::epilogue::fusion::ConsumerStoreArgs<Args...> const&) {
    return ConsumerStoreCallbacks(params.alpha);
  }
};

}  // namespace gemmgen::gemm_sm90
