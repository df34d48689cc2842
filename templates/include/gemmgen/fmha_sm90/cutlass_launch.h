// The launch of one of CUTLASS example 88's kernels (forward or backward) with the caller's softmax
// scale: the example derives 1/sqrt(d) in to_underlying_arguments, so the params are patched after
// they are built (scale_softmax multiplies the scores, or dS in the backward; the log2 form feeds
// exp2). Shared by fmha_sm90 and fmha_bwd_sm90.
#pragma once
#include <cmath>

#include <cuda_runtime.h>

#include "cutlass/device_kernel.h"

namespace gemmgen {

struct NoPatch {
  template <class Params> void operator()(Params&) const {}
};

// patch(params): what the caller sets in the kernel's params besides the scale.
template <class Kernel, class Patch = NoPatch>
cudaError_t launch_with_scale(typename Kernel::Arguments const& args, float scale, int smem_bytes,
                              cudaStream_t stream, Patch patch = {}) {
  typename Kernel::Params params = Kernel::to_underlying_arguments(args, nullptr);
  params.mainloop.scale_softmax = scale;
  params.mainloop.scale_softmax_log2 = scale * static_cast<float>(M_LOG2E);
  patch(params);
  cutlass::device_kernel<Kernel><<<Kernel::get_grid_shape(params), Kernel::get_block_shape(), smem_bytes, stream>>>(
      params);
  return cudaGetLastError();
}

}  // namespace gemmgen
