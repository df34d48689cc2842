// Host side of the fmha_sm90 family: CUTLASS's Hopper FMHA forward kernels (example 88 of the
// CUTLASS source tree, included from the installed package), driven through gemmgen's C ABI.
//
// What this layer adds to CUTLASS's kernel: our strides for any [B, H, N, d] view (int32, as the
// kernel's stride type), GQA (one launch in the persistent schedule, one per query head of a group
// in CUTLASS's own kernels), the causal offset (causal.h), any scale >= 0
// (the kernel derives 1/sqrt(d) itself: the params are patched after they are built), batch and
// head counts above the grid's y/z limits (chunked launches), and errors as a status + message.
// The persistent schedule runs CUTLASS's mainloop in a kernel of our own (persistent.h).
#pragma once
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdio>

#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/device_kernel.h"
#include "cutlass/kernel_hardware_info.h"

#include "88_hopper_fmha/collective/fmha_fusion.hpp"
#include "88_hopper_fmha/kernel/fmha_kernel_builder.hpp"

#include "gemmgen/abi.h"
#include "gemmgen/fmha_sm90/bias.h"
#include "gemmgen/fmha_sm90/causal.h"
#include "gemmgen/fmha_sm90/cutlass_launch.h"
#include "gemmgen/fmha_sm90/persistent.h"
#include "gemmgen/fmha_sm90/softmax.h"
#include "gemmgen/fmha_sm90/transpose.h"
#include "gemmgen/fmha_sm90/varlen.h"
#include "gemmgen/philox/philox.h"
#include "gemmgen/report.h"

namespace gemmgen::fmha_sm90 {

using namespace cute;

enum class Schedule { kTma, kCooperative, kPingpong };

template <Schedule S> struct DispatchOf;
template <> struct DispatchOf<Schedule::kTma> { using type = cutlass::gemm::KernelTma; };
template <> struct DispatchOf<Schedule::kCooperative> {
  using type = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
};

// Non-causal instances use CUTLASS's residual fusion: it masks the keys past seqlen_k in the last
// key tile (TMA fills them with zeros, which would otherwise score 0), so any seqlen_k works.
// Causal ones our bottom-right mask (causal.h), which serves every causal offset in [0, Nk - Nq];
// local ones (a sliding window) our LocalWindow (causal.h, the persistent schedule only).
// Lazy: our softmax, which rescales O only when a row maximum grows by more than 2^8 (softmax.h).
template <bool Causal, bool Local = false, int BlockM = 0, int BlockN = 0>
using MaskOf = std::conditional_t<Local, LocalWindow<BlockM, BlockN>,
                                  std::conditional_t<Causal, BottomRightCausal, cutlass::fmha::collective::ResidualFusion>>;
// Descaled (fp8): the softmax takes each row tile's factors (TileFactors, softmax.h). Softcap: it
// caps the scores first (softmax.h; the launch passes the cap in scale_softmax_log2).
// BiasElement: an additive mask in that type (void: none; the persistent schedule only). Dropout:
// the softmax drops probabilities by gemmgen's Philox mask (the persistent schedule only).
template <bool Causal, bool Lazy, bool Speculate = false, bool Local = false, int BlockM = 0, int BlockN = 0,
          bool Descaled = false, bool Softcap = false, class BiasElement = void, bool Dropout = false>
using FusionOf =
    std::conditional_t<Lazy, LazyRescale<MaskOf<Causal, Local, BlockM, BlockN>, Speculate, Descaled, Softcap,
                                         BiasElement, BlockN, Dropout>,
                       MaskOf<Causal, Local, BlockM, BlockN>>;

// Speculate: whether our softmax takes its speculative step (softmax.h), decided per instance by
// FmhaSm90Instance.speculates (gemmgen/families/fmha_sm90.py) from the registers it needs.
template <class Element, class TileShape, class Stride, class StrideV, Schedule S, bool Causal, int StagesKV,
          bool Lazy, int QBuffers, bool Speculate, bool Local, bool Softcap, bool Bias, bool DirectO, bool Dropout>
struct KernelOf {  // CUTLASS's own composition of the kernel (the TMA and cooperative schedules)
  static_assert(!Local && !Bias && !Dropout,
                "sliding windows, additive masks and dropout run on the persistent schedule");
  static_assert(!DirectO, "O stored from registers is our persistent epilogue's option");
  // CUTLASS's epilogue stores O in the input type: 8-bit inputs (O in bf16) need ours.
  static_assert(sizeof(Element) == 2, "fp8 inputs run on the persistent schedule");
  using type = typename cutlass::fmha::kernel::FmhaBuilder<
      Element, float, float, TileShape, Stride, Stride, Stride,
      FusionOf<Causal, Lazy, Speculate, false, 0, 0, false, Softcap>,
      typename DispatchOf<S>::type,
      cutlass::fmha::kernel::Option<cutlass::fmha::kernel::Tag::kStagesKV, Int<StagesKV>>>::Kernel;
  using packed_type = void;  // no packed sequences on these schedules
};

template <class Element, class TileShape, class Stride, class StrideV, bool Causal, int StagesKV, bool Lazy,
          int QBuffers, bool Speculate, bool Local, bool Softcap, bool Bias, bool DirectO, bool Dropout>
struct KernelOf<Element, TileShape, Stride, StrideV, Schedule::kPingpong, Causal, StagesKV, Lazy, QBuffers, Speculate,
                Local, Softcap, Bias, DirectO, Dropout> {
  // CUTLASS's persistent mainloop in our kernel (persistent.h); 64 rows per consumer warp group;
  // causal row tiles go in pairs.
  using Tag = cutlass::fmha::kernel::Tag;
  template <Tag T, class V> using Opt = cutlass::fmha::kernel::Option<T, V>;
  using Groups = Int<size<0>(TileShape{}) / 64>;
  using StagesQ = Int<Groups::value * QBuffers>;  // Q buffers per consumer group
  static_assert(sizeof(Element) == 2 || Lazy, "fp8 inputs take their factors in our softmax (lazy_rescale)");
  using Fusion = FusionOf<Causal, Lazy, Speculate, Local, size<0>(TileShape{}), size<1>(TileShape{}),
                          sizeof(Element) == 1, Softcap, std::conditional_t<Bias, Element, void>, Dropout>;
  using Mainloop = cutlass::fmha::collective::FmhaMainloopTmaWarpSpecialized<
      Element, float, float, TileShape, Stride, Stride, StrideV, Fusion, Opt<Tag::kStagesKV, Int<StagesKV>>,
      Opt<Tag::kStagesQ, StagesQ>, Opt<Tag::kIsPersistent, cute::true_type>, Opt<Tag::kLoadsQSeparately, cute::true_type>,
      Opt<Tag::kNumMmaWarpGroups, Groups>>;
  using Fixed = std::conditional_t<Causal, PairedScheduler, cutlass::fmha::kernel::PersistentTileScheduler>;
  template <class Scheduler>
  using With = PersistentKernel<Mainloop, Fusion, DirectO, Scheduler, Opt<Tag::kStagesKV, Int<StagesKV>>,
                                Opt<Tag::kStagesQ, StagesQ>, Opt<Tag::kIsPersistent, cute::true_type>,
                                Opt<Tag::kLoadsQSeparately, cute::true_type>, Opt<Tag::kNumMmaWarpGroups, Groups>>;
  using type = With<Fixed>;
  // Packed sequences (varlen.h), on every persistent instance but fp8, four-group windows and
  // additive masks (FmhaSm90Instance.runs_varlen says why): a second kernel, so that the
  // fixed-length one keeps its registers (the packed scheduler and problem cost the 4-group d64 tile
  // 36 -> 100 bytes of spill in one kernel).
  static constexpr bool kPacked = sizeof(Element) == 2 && !(Local && Groups::value == 4) && !Bias && !Dropout;
  using packed_type = std::conditional_t<kPacked, With<VarlenScheduler<Causal, size<0>(TileShape{}), Local>>, void>;
};

template <class Element_, int BlockM, int BlockN, int HeadDim, Schedule S, bool Causal, int StagesKV,
          bool Lazy = false, int QBuffers = 1, bool Speculate = false, bool Local = false, bool Softcap = false,
          bool Bias = false, bool DirectO = false, bool Dropout = false>
struct Config {
  using Element = Element_;  // of q, k, v
  // 8-bit inputs (fp8 e4m3) give O in bf16, and their V is read transposed: wgmma reads 8-bit
  // operands from shared memory K-major only, and V's K mode (of P V) is the keys.
  static constexpr bool kFp8 = sizeof(Element) == 1;
  using ElementO = std::conditional_t<kFp8, cutlass::bfloat16_t, Element>;
  using Stride = cute::tuple<int, _1, cute::tuple<int, int>>;  // (row, 1, (batch, head)) in elements
  // V as (keys, d, (batch, head)): d contiguous, or (fp8) the keys.
  using StrideV = std::conditional_t<kFp8, cute::tuple<_1, int, cute::tuple<int, int>>, Stride>;
  using StrideLSE = cute::tuple<_1, cute::tuple<int, int>>;
  using TileShape = Shape<Int<BlockM>, Int<BlockN>, Int<HeadDim>>;
  static_assert(!Speculate || (Lazy && S != Schedule::kTma), "the TMA mainloop and CUTLASS's softmax never speculate");
  // A window's first key tile may hide every key of a row: the speculative step assumes it does not.
  static_assert(!Local || (!Causal && !Speculate && Lazy), "a local instance is lazy, not causal, not speculating");
  static_assert(!Softcap || (Lazy && !Local && !kFp8), "a softcap runs in our softmax, without a window or fp8");
  // An additive mask (attn_mask, in the inputs' type) runs in our softmax on the persistent schedule,
  // fixed lengths, no window.
  static_assert(!Bias || (Lazy && !Speculate && !Local && !kFp8 && S == Schedule::kPingpong),
                "an additive mask runs in our plain step on the persistent schedule, 16-bit, without a window");
  // Dropout (gemmgen's Philox mask, philox.h) in our softmax on the persistent schedule, 16-bit,
  // fixed lengths, no window, bias or softcap.
  static_assert(!Dropout || (Lazy && !Local && !kFp8 && !Bias && !Softcap && S == Schedule::kPingpong),
                "dropout runs in our softmax on the persistent schedule, 16-bit, without a window, bias or softcap");
  using Kernels = KernelOf<Element, TileShape, Stride, StrideV, S, Causal, StagesKV, Lazy, QBuffers, Speculate,
                           Local, Softcap, Bias, DirectO, Dropout>;
  using Kernel = typename Kernels::type;
  using PackedKernel = typename Kernels::packed_type;  // void: no packed sequences
  static constexpr int kHeadDim = HeadDim;
  static constexpr int kBlockM = BlockM;
  static constexpr int kBlockN = BlockN;
  static constexpr bool kCausal = Causal;
  static constexpr bool kLocal = Local;
  static constexpr bool kSoftcap = Softcap;
  static constexpr bool kBias = Bias;
  static constexpr bool kDropout = Dropout;
  static constexpr bool kPersistent = S == Schedule::kPingpong;
  static constexpr bool kVarlen = !std::is_void_v<PackedKernel>;  // runs packed sequences (varlen.h)
};

constexpr int64_t kMaxGridYZ = 65535;
constexpr int64_t kInt32Max = 2147483647;

// Largest element offset a [b, h, n, d] view with these strides reaches (+1).
inline int64_t extent(int64_t b, int64_t h, int64_t n, int64_t d, int64_t sb, int64_t sh, int64_t sn) {
  return (b - 1) * sb + (h - 1) * sh + (n - 1) * sn + d;
}

// Per-device facts cached on first use: the SM count (the persistent schedule's grid) and whether
// the shared-memory opt-in was set.
struct DeviceState {
  std::atomic<int> sm_count{0};
  std::atomic<bool> smem_set{false};
};

// The device, its SM count (the persistent schedule's grid) and the kernel's shared-memory opt-in,
// cached per device after the first call.
template <class Kernel>
cudaError_t device_setup(int* device, int* sm_count) {
  cudaError_t e = cudaGetDevice(device);
  static DeviceState states[64];
  DeviceState* state = *device >= 0 && *device < 64 ? &states[*device] : nullptr;
  *sm_count = state ? state->sm_count.load(std::memory_order_relaxed) : 0;
  if (e == cudaSuccess && *sm_count == 0) {
    e = cudaDeviceGetAttribute(sm_count, cudaDevAttrMultiProcessorCount, *device);
    if (e == cudaSuccess && state) state->sm_count.store(*sm_count, std::memory_order_relaxed);
  }
  constexpr int kSmem = Kernel::SharedStorageSize;
  if (e == cudaSuccess && kSmem >= 48 * 1024 && !(state && state->smem_set.load(std::memory_order_relaxed))) {
    e = cudaFuncSetAttribute(cutlass::device_kernel<Kernel>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (e == cudaSuccess && state) state->smem_set.store(true, std::memory_order_relaxed);
  }
  return e;
}

// Before a launch: every element offset the call reaches (`reach`) fits the kernel's int32 indices,
// and the device is set up (device_setup). GEMMGEN_OK, or the error reported.
template <class Kernel, size_t N>
int prepare(const int64_t (&reach)[N], int* device, int* sm_count, char* err, int err_len) {
  for (int64_t r : reach) {
    if (r > kInt32Max) {
      return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                    "element offsets reach %lld: this family indexes with int32", static_cast<long long>(r));
    }
  }
  cudaError_t e = device_setup<Kernel>(device, sm_count);
  if (e != cudaSuccess) {
    return report(err, err_len, GEMMGEN_CUDA_ERROR, "device setup: %s (%s)", cudaGetErrorString(e),
                  cudaGetErrorName(e));
  }
  return GEMMGEN_OK;
}

// A scale of exactly 0 would turn the masked scores (-inf) into NaN in exp2(score * scale - max);
// the smallest normal float gives the same uniform weights.
inline float kernel_scale(float scale) { return scale == 0.f ? FLT_MIN : scale; }

// Key counts of packed sequences on the GPU move TMA descriptors on the device (tensormap.replace):
// nvcc 12.3 or later.
#if defined(__CUDACC_VER_MAJOR__) && (__CUDACC_VER_MAJOR__ > 12 || (__CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ >= 3))
constexpr bool kMovesTmaDescriptors = true;
#else
constexpr bool kMovesTmaDescriptors = false;
#endif

// Key counts of packed sequences on the GPU (seqlens_k with cu_seqlens): the TMA slots of a launch
// on `sm_count` CTAs (persistent.h's load_kv_packed), and the workspace of such a call: the slots,
// then varlen.h's work rows ([4][batch] ints, place_counted's).
template <class Cfg>
int64_t kv_slot_bytes(int sm_count) {
  if constexpr (Cfg::kVarlen) {
    using Kernel = typename Cfg::PackedKernel;
    return int64_t(sm_count) * Kernel::kSlots * int64_t(sizeof(typename Kernel::KvSlot));
  } else {
    return 0;
  }
}
template <class Cfg>
int64_t kv_workspace_bytes(int sm_count, int batch) {
  return kv_slot_bytes<Cfg>(sm_count) + 4 * int64_t(batch) * int64_t(sizeof(int));
}

// Packed sequences (cu_seqlens; varlen.h): one launch over the packed [total rows, H, d] tensors,
// its problem size (1, H, total_q, total_k, d), the sequences handed to the tile scheduler.
template <class Cfg>
int run_packed(const GemmgenAttnParams* p, cudaStream_t stream, char* err, int err_len) {
  if constexpr (!Cfg::kVarlen) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  "variable lengths: this instance runs none (the persistent 16-bit ones do, but windows on "
                  "256-row tiles)");
  } else {
    using Kernel = typename Cfg::PackedKernel;
    if (p->cu_seqlens_q == nullptr || p->cu_seqlens_k == nullptr) {
      return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "variable lengths need both cu_seqlens_q and cu_seqlens_k");
    }
    if (p->total_q < 1 || p->total_k < 1) {
      return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                    "variable lengths: total_q %lld, total_k %lld (the packed tensors' rows, each >= 1)",
                    static_cast<long long>(p->total_q), static_cast<long long>(p->total_k));
    }
    constexpr bool kMasked = Cfg::kCausal || Cfg::kLocal;
    // Key counts on the GPU (varlen.h's used_k): rows that see no key are found per sequence for
    // no mask and bottom-right causal; a window's are not.
    if (p->seqlens_k != nullptr && (Cfg::kLocal || (Cfg::kCausal && p->align_per_sequence != 1))) {
      return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                    "seqlens_k: key counts run without a mask or with a bottom-right causal one (no window)");
    }
    if (kMasked ? p->causal_offset != 0 : p->align_per_sequence != 0) {
      return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                    kMasked ? "variable lengths: the diagonal is top-left (causal_offset 0) or "
                              "bottom-right per sequence (align_per_sequence), got causal_offset %d"
                            : "variable lengths without a mask: align_per_sequence aligns none (%d)",
                    kMasked ? p->causal_offset : p->align_per_sequence);
    }
    const int64_t h = p->heads, hkv = p->heads_kv, d = p->head_dim, tq = p->total_q, tk = p->total_k;
    const int64_t reach[] = {extent(1, h, tq, d, 0, p->q_head_stride, p->q_row_stride),
                             extent(1, hkv, tk, d, 0, p->k_head_stride, p->k_row_stride),
                             extent(1, hkv, tk, d, 0, p->v_head_stride, p->v_row_stride),
                             extent(1, h, tq, d, 0, p->o_head_stride, p->o_row_stride),
                             int64_t(p->batch) * h * p->seqlen_q};
    int device = 0, sm_count = 0;
    if (int status = prepare<Kernel>(reach, &device, &sm_count, err, err_len)) return status;
    using E = typename Cfg::Element;
    // The batch mode has one entry: its stride is never stepped, and the row stride stands in for
    // it (TMA-legal); likewise the K/V head stride with one K/V head.
    auto rows = [](int64_t row, int64_t head) { return make_stride(int(row), _1{}, make_stride(int(row), int(head))); };
    const int64_t k_head_stride = hkv > 1 ? p->k_head_stride : p->k_row_stride;
    const int64_t v_head_stride = hkv > 1 ? p->v_head_stride : p->v_row_stride;
    typename Kernel::Arguments args{
        {1, int(h), int(tq), int(tk), int(d)},
        {static_cast<const E*>(p->q), rows(p->q_row_stride, p->q_head_stride), static_cast<const E*>(p->k),
         rows(p->k_row_stride, k_head_stride), static_cast<const E*>(p->v), rows(p->v_row_stride, v_head_stride)},
        {static_cast<E*>(p->o), rows(p->o_row_stride, p->o_head_stride), p->lse,
         make_stride(_1{}, make_stride(int(h * p->seqlen_q), int(p->seqlen_q)))},
        cutlass::KernelHardwareInfo{device, sm_count}};
    Varlen varlen;
    varlen.cu_q = varlen.slot_q = p->cu_seqlens_q;
    varlen.cu_k = varlen.slot_k = p->cu_seqlens_k;
    varlen.end_q = p->cu_seqlens_q + 1;
    varlen.end_k = p->cu_seqlens_k + 1;
    varlen.batch = p->batch;
    varlen.max_q = p->seqlen_q;
    varlen.max_k = p->seqlen_k;
    varlen.align = p->align_per_sequence;
    if (p->seqlens_k != nullptr) {  // the CTAs' TMA slots (persistent.h's load_kv_packed), the work rows
      if (!kMovesTmaDescriptors) {
        return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                      "seqlens_k: this instance was compiled by an nvcc older than 12.3 (no device-side TMA "
                      "descriptor updates); rebuild it with a newer one");
      }
      const int64_t need = kv_workspace_bytes<Cfg>(sm_count, p->batch);
      if (p->workspace == nullptr || p->workspace_bytes < need || reinterpret_cast<uintptr_t>(p->workspace) % 128) {
        return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                      "seqlens_k: a 128-byte aligned workspace of %lld bytes is needed, got %lld",
                      static_cast<long long>(need), static_cast<long long>(p->workspace_bytes));
      }
      varlen.used_k = p->seqlens_k;
      int* rows = reinterpret_cast<int*>(static_cast<char*>(p->workspace) + kv_slot_bytes<Cfg>(sm_count));
      place_counted<Cfg::kCausal><<<(p->batch + 127) / 128, 128, 0, stream>>>(varlen, rows);
      cudaError_t e = cudaGetLastError();
      if (e != cudaSuccess) {
        return report(err, err_len, GEMMGEN_CUDA_ERROR, "key counts' placement launch: %s (%s)", cudaGetErrorString(e),
                      cudaGetErrorName(e));
      }
      varlen.cu_q = rows;
      varlen.end_q = rows + p->batch;
      varlen.cu_k = rows + 2 * p->batch;
      varlen.end_k = rows + 3 * p->batch;
    }
    cudaError_t e = launch_with_scale<Kernel>(args, kernel_scale(p->scale), Kernel::SharedStorageSize, stream,
                                              [group = int(h / hkv), varlen, p](auto& params) {
                                                params.kv_group = group;
                                                params.tile_scheduler.varlen = varlen;
                                                if (p->seqlens_k != nullptr) {
                                                  params.kv_slots =
                                                      static_cast<typename Kernel::KvSlot*>(p->workspace);
                                                  params.k_base = static_cast<const char*>(p->k);
                                                  params.v_base = static_cast<const char*>(p->v);
                                                  params.k_row_bytes = p->k_row_stride * int64_t(sizeof(E));
                                                  params.v_row_bytes = p->v_row_stride * int64_t(sizeof(E));
                                                }
                                                if constexpr (Cfg::kSoftcap) {  // (softmax.h's cap)
                                                  params.mainloop.scale_softmax_log2 = p->softcap;
                                                }
                                                if constexpr (Cfg::kLocal) {  // around offset 0 (persistent.h)
                                                  constexpr int kUnbounded = 1 << 30;
                                                  params.window_lo = p->window_left < 0 ? -kUnbounded
                                                                                        : -p->window_left;
                                                  params.window_hi = p->window_right < 0 ? kUnbounded
                                                                                         : p->window_right;
                                                }
                                              });
    if (e != cudaSuccess) {
      return report(err, err_len, GEMMGEN_CUDA_ERROR, "kernel launch: %s (%s)", cudaGetErrorString(e),
                    cudaGetErrorName(e));
    }
    return GEMMGEN_OK;
  }
}

// Keys a fixed-length call reads: causal rows see none past seqlen_q + causal_offset.
template <class Cfg>
int64_t keys_read(const GemmgenAttnParams* p) {
  return Cfg::kCausal ? int64_t(p->seqlen_q) + p->causal_offset : int64_t(p->seqlen_k);
}

// A bias's tiles are sorted and listed (bias.h) where several heads or batch entries read it; the
// sort's batch entries and heads (1 where the bias broadcasts), and its workspace layout.
template <class Cfg>
bool sorts_bias(const GemmgenAttnParams* p) {
  return Cfg::kBias && p->bias != nullptr &&
         classifies(p->batch, p->heads, p->bias_batch_stride, p->bias_head_stride);
}
inline int bias_batch(const GemmgenAttnParams* p) { return p->bias_batch_stride == 0 ? 1 : p->batch; }
inline int bias_heads(const GemmgenAttnParams* p) { return p->bias_head_stride == 0 ? 1 : p->heads; }
template <class Cfg>
BiasSortLayout sort_layout(const GemmgenAttnParams* p) {
  return bias_sort_layout(int64_t(bias_batch(p)) * bias_heads(p), p->seqlen_q,
                          std::max<int64_t>(keys_read<Cfg>(p), 1), Cfg::kBlockM, Cfg::kBlockN);
}

// Workspace bytes of a call: fp8 instances copy V transposed into it (transpose.h), bias instances
// sort and list a shared bias's tiles in it (bias.h), packed sequences with key counts on the GPU
// hold their CTAs' TMA slots and their work rows in it (kv_workspace_bytes); 0 for others.
template <class Cfg>
int64_t workspace(const GemmgenAttnParams* p) {
  if (p != nullptr && p->seqlens_k != nullptr && p->cu_seqlens_q != nullptr) {
    int device = 0, sm_count = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
      return -1;
    }
    return kv_workspace_bytes<Cfg>(sm_count, p->batch);
  }
  if (!Cfg::kFp8 && !Cfg::kBias) return 0;
  if (p == nullptr || p->batch < 0 || p->heads < 0 || p->heads_kv < 0 || p->head_dim < 0 || p->seqlen_q < 0 ||
      p->seqlen_k < 0) {
    return -1;
  }
  if (Cfg::kBias) return sorts_bias<Cfg>(p) ? sort_layout<Cfg>(p).bytes() : 0;
  return int64_t(p->batch) * p->heads_kv * p->head_dim * transposed_pitch(std::max<int64_t>(keys_read<Cfg>(p), 1));
}

// fp8: V ([B, Hkv, Nk, d] by the call's strides) copied transposed into the workspace, its first
// `keys` keys. GEMMGEN_OK, or the error reported.
template <class Cfg>
int transpose_v_into_workspace(const GemmgenAttnParams* p, int64_t keys, cudaStream_t stream, char* err,
                               int err_len) {
  const int64_t need = workspace<Cfg>(p);
  if (p->workspace == nullptr || p->workspace_bytes < need) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  "fp8 instances copy V transposed into the workspace: it needs %lld bytes, got %lld",
                  static_cast<long long>(need), static_cast<long long>(p->workspace_bytes));
  }
  const bool stepped[] = {p->batch > 1, p->heads_kv > 1, keys > 1};
  const int64_t strides[] = {p->v_batch_stride, p->v_head_stride, p->v_row_stride};
  bool aligned = reinterpret_cast<uintptr_t>(p->v) % 16 == 0 && p->head_dim % kTransposeTile == 0;
  for (int i = 0; i < 3; ++i) aligned = aligned && (!stepped[i] || strides[i] % 16 == 0);
  if (!aligned) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  "fp8: v needs 16-byte aligned data, strides in multiples of 16 elements and a head dim in "
                  "multiples of %d (got head_dim %d, strides %lld, %lld, %lld)", kTransposeTile, p->head_dim,
                  static_cast<long long>(strides[0]), static_cast<long long>(strides[1]),
                  static_cast<long long>(strides[2]));
  }
  cudaError_t e = launch_transpose_v(p->v, p->v_batch_stride, p->v_head_stride, p->v_row_stride, p->batch,
                                     p->heads_kv, static_cast<int>(keys), p->head_dim, p->workspace, stream);
  if (e != cudaSuccess) {
    return report(err, err_len, GEMMGEN_CUDA_ERROR, "V transpose launch: %s (%s)", cudaGetErrorString(e),
                  cudaGetErrorName(e));
  }
  return GEMMGEN_OK;
}

template <class Cfg>
int run(const GemmgenAttnParams* p, cudaStream_t stream, char* err, int err_len) {
  using Kernel = typename Cfg::Kernel;
  if (p == nullptr) return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "params is NULL");
  if (p->head_dim != Cfg::kHeadDim) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "head_dim %d, this instance runs %d", p->head_dim,
                  Cfg::kHeadDim);
  }
  if (p->batch < 1 || p->heads < 1 || p->heads_kv < 1 || p->seqlen_q < 1 || p->seqlen_k < 1 ||
      p->heads % p->heads_kv != 0) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  "bad sizes: batch %d heads %d heads_kv %d seqlen_q %d seqlen_k %d", p->batch, p->heads,
                  p->heads_kv, p->seqlen_q, p->seqlen_k);
  }
  if (p->block_table != nullptr) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "this family runs no paged key-value cache");
  }
  if (p->seqlens_k != nullptr && p->cu_seqlens_q == nullptr) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  "seqlens_k: this family reads key counts of packed sequences only (cu_seqlens set)");
  }
  if (Cfg::kDropout ? !(p->dropout_p > 0.f && p->dropout_p < 1.f) : p->dropout_p != 0.f) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  Cfg::kDropout ? "dropout_p %g: this instance runs dropout in (0, 1)"
                                : "dropout_p %g: this instance runs none (a `_dropout` one does)", p->dropout_p);
  }
  if (Cfg::kDropout) {  // the mask's position of weight (i, j) within a head is 32-bit (philox.h)
    if (int64_t(p->seqlen_q) * p->seqlen_k > kInt32Max) {
      return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                    "dropout: seqlen_q * seqlen_k must stay below 2^31 (got %d x %d)", p->seqlen_q, p->seqlen_k);
    }
    if (p->cu_seqlens_q != nullptr || p->cu_seqlens_k != nullptr) {
      return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "dropout: fixed lengths only (cu_seqlens set)");
    }
  }
  if (Cfg::kBias != (p->bias != nullptr)) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  Cfg::kBias ? "this instance runs additive masks only (params.bias is NULL)"
                             : "an additive mask (params.bias): this instance runs none (a `_bias` one does)");
  }
  if (Cfg::kBias) {  // pairs of adjacent keys are read as 4-byte words, rows to their padded end
    const int64_t strides[] = {p->bias_batch_stride, p->bias_head_stride, p->bias_row_stride};
    bool aligned = reinterpret_cast<uintptr_t>(p->bias) % 16 == 0;
    for (int64_t s : strides) aligned = aligned && s % 8 == 0 && s >= 0;
    if (!aligned) {
      return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                    "bias: 16-byte aligned rows, strides non-negative multiples of 8 (got %lld, %lld, %lld)",
                    static_cast<long long>(strides[0]), static_cast<long long>(strides[1]),
                    static_cast<long long>(strides[2]));
    }
    if (p->cu_seqlens_q != nullptr || p->cu_seqlens_k != nullptr) {
      return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "additive masks: fixed lengths only (cu_seqlens set)");
    }
  }
  if (Cfg::kLocal != (p->local != 0)) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  Cfg::kLocal ? "this instance runs sliding windows only (params.local is 0)"
                              : "a sliding window (params.local): this instance runs none (a local one does)");
  }
  if (Cfg::kLocal && (p->window_left < -1 || p->window_right < -1)) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "window (%d, %d): each side is -1 (unbounded) or >= 0",
                  p->window_left, p->window_right);
  }
  if (!(p->scale >= 0.f)) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "scale %g: this family runs scales >= 0", p->scale);
  }
  if (p->lse == nullptr) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "this family always writes LSE: pass a buffer");
  }
  if (Cfg::kSoftcap ? !(p->softcap > 0.f && p->softcap < INFINITY) : p->softcap != 0.f) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  Cfg::kSoftcap ? "softcap %g: this instance runs a finite logit softcap > 0"
                                : "softcap %g: this instance runs none (an `_sc` one does)", p->softcap);
  }
  if (!Cfg::kFp8 && (p->descale_q != nullptr || p->descale_k != nullptr || p->descale_v != nullptr)) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "descale factors: this instance's inputs are 16-bit");
  }
  if (p->cu_seqlens_q != nullptr || p->cu_seqlens_k != nullptr) return run_packed<Cfg>(p, stream, err, err_len);
  if (p->align_per_sequence != 0) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  "align_per_sequence aligns the sequences of variable lengths: cu_seqlens are NULL");
  }
  if ((Cfg::kCausal || Cfg::kLocal) && (p->causal_offset < 0 || int64_t(p->seqlen_q) + p->causal_offset > p->seqlen_k)) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  "causal and local masks run offsets in [0, seqlen_k - seqlen_q] (every row sees a key; got "
                  "offset %d, seqlen_q %d, seqlen_k %d)", p->causal_offset, p->seqlen_q, p->seqlen_k);
  }
  // Causal: no row sees a key past nq + offset, so the kernel reads only those, and its mask's
  // offset (its seqlen_k - seqlen_q) is the call's.
  const int64_t nk_read = keys_read<Cfg>(p);
  GemmgenAttnParams transposed;  // fp8: the call's params, V read from its transposed copy
  if constexpr (Cfg::kFp8) {
    if (int status = transpose_v_into_workspace<Cfg>(p, nk_read, stream, err, err_len)) return status;
    const int64_t pitch = transposed_pitch(nk_read);
    transposed = *p;
    transposed.v = p->workspace;
    transposed.v_row_stride = pitch;  // [B, Hkv, d, pitch]: the head dim's rows
    transposed.v_head_stride = p->head_dim * pitch;
    transposed.v_batch_stride = p->heads_kv * p->head_dim * pitch;
    p = &transposed;
  }
  // Bias instances: a shared bias's tiles sorted and listed into the workspace first (bias.h).
  const uint32_t* lists = nullptr;
  if constexpr (Cfg::kBias) {
    if ((nk_read + Cfg::kBlockN - 1) / Cfg::kBlockN > 0xffff) {  // (list entries hold 16-bit key tiles)
      return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                    "additive masks: at most %d keys per call on this instance, got %lld", 0xffff * Cfg::kBlockN,
                    static_cast<long long>(nk_read));
    }
    if (sorts_bias<Cfg>(p)) {
      const int64_t need = workspace<Cfg>(p);
      if (p->workspace == nullptr || p->workspace_bytes < need) {
        return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                      "bias instances sort a shared bias's tiles in the workspace: it needs %lld bytes, got %lld",
                      static_cast<long long>(need), static_cast<long long>(p->workspace_bytes));
      }
      using Mask = MaskOf<Cfg::kCausal, false, Cfg::kBlockM, Cfg::kBlockN>;
      auto* ws = static_cast<uint8_t*>(p->workspace);
      const auto ps = make_shape(int(p->batch), int(p->heads), int(p->seqlen_q), int(nk_read), int(p->head_dim));
      cudaError_t e = launch_sort<typename Cfg::Element, Mask, Cfg::kBlockM / kClassRows,
                                  typename Cfg::TileShape>(p->bias, p->bias_batch_stride, p->bias_head_stride,
                                                           p->bias_row_stride, bias_batch(p), bias_heads(p), ps,
                                                           Cfg::kCausal, ws, stream);
      if (e != cudaSuccess) {
        return report(err, err_len, GEMMGEN_CUDA_ERROR, "bias sort launch: %s (%s)", cudaGetErrorString(e),
                      cudaGetErrorName(e));
      }
      lists = reinterpret_cast<const uint32_t*>(ws + sort_layout<Cfg>(p).classes_bytes());
    }
  }
  const int64_t b = p->batch, h = p->heads, hkv = p->heads_kv, nq = p->seqlen_q, nk = p->seqlen_k;
  const int64_t d = p->head_dim;
  const int64_t reach[] = {
      extent(b, h, nq, d, p->q_batch_stride, p->q_head_stride, p->q_row_stride),
      extent(b, hkv, nk, d, p->k_batch_stride, p->k_head_stride, p->k_row_stride),
      Cfg::kFp8 ? extent(b, hkv, d, nk_read, p->v_batch_stride, p->v_head_stride, p->v_row_stride)  // [B, Hkv, d, Nk]
                : extent(b, hkv, nk, d, p->v_batch_stride, p->v_head_stride, p->v_row_stride),
      extent(b, h, nq, d, p->o_batch_stride, p->o_head_stride, p->o_row_stride), b * h * nq};
  int device = 0, sm_count = 0;
  if (int status = prepare<Kernel>(reach, &device, &sm_count, err, err_len)) return status;
  cudaError_t e = cudaSuccess;

  const float scale = kernel_scale(p->scale);
  constexpr int kSmem = Kernel::SharedStorageSize;
  const int64_t group = h / hkv;
  const auto* q0 = static_cast<const typename Cfg::Element*>(p->q);
  const auto* k0 = static_cast<const typename Cfg::Element*>(p->k);
  const auto* v0 = static_cast<const typename Cfg::Element*>(p->v);
  auto* o0 = static_cast<typename Cfg::ElementO*>(p->o);
  // V's (keys, d, (batch, head)) stride: fp8 reads it transposed (the keys contiguous).
  auto v_stride = [](int64_t row, int64_t batch, int64_t head) {
    if constexpr (Cfg::kFp8) {
      return make_stride(_1{}, int(row), make_stride(int(batch), int(head)));
    } else {
      return make_stride(int(row), _1{}, make_stride(int(batch), int(head)));
    }
  };
  cutlass::KernelHardwareInfo hw{device, sm_count};
  // GQA: the persistent kernel reads K/V head h / group for query head h itself (kv_group), so one
  // launch runs every query head. CUTLASS's own kernels index K/V heads linearly: one launch per
  // query head of a group, launch g running query heads g, g + group, ... against K/V heads 0, 1, ...
  const int64_t launches = Cfg::kPersistent ? 1 : group;
  const int64_t packed = group / launches;  // query heads per K/V head within one launch
  const int64_t heads = h / launches;       // query heads per launch
  // Chunks keep batch and heads within the grid's y and z limits (the persistent schedule folds
  // them into x, but one chunking rule for all schedules keeps this simple); a head chunk holds
  // whole groups.
  const int64_t head_step = kMaxGridYZ / packed * packed;
  // The K/V descriptors span a launch's query heads, though only its K/V heads are read: with one
  // K/V head its head stride is never stepped, and any TMA-legal value stands in for it.
  const int64_t k_head_stride = hkv > 1 ? p->k_head_stride : p->k_row_stride;
  const int64_t v_head_stride = hkv > 1 ? p->v_head_stride : p->v_row_stride;
  for (int64_t g = 0; g < launches; ++g) {
    for (int64_t b0 = 0; b0 < b; b0 += kMaxGridYZ) {
      for (int64_t h0 = 0; h0 < heads; h0 += head_step) {  // in this launch's query heads
        const int nb = static_cast<int>(std::min(kMaxGridYZ, b - b0));
        const int nh = static_cast<int>(std::min(head_step, heads - h0));
        const int64_t qh = h0 * launches + g;  // first query head of this launch
        const int64_t kvh = h0 / packed;       // its K/V head
        typename Kernel::Arguments args{
            {nb, nh, static_cast<int>(nq), static_cast<int>(nk_read), static_cast<int>(d)},
            {q0 + b0 * p->q_batch_stride + qh * p->q_head_stride,
             make_stride(int(p->q_row_stride), _1{},
                         make_stride(int(p->q_batch_stride), int(p->q_head_stride * launches))),
             k0 + b0 * p->k_batch_stride + kvh * p->k_head_stride,
             make_stride(int(p->k_row_stride), _1{}, make_stride(int(p->k_batch_stride), int(k_head_stride))),
             v0 + b0 * p->v_batch_stride + kvh * p->v_head_stride,
             v_stride(p->v_row_stride, p->v_batch_stride, v_head_stride)},
            {o0 + b0 * p->o_batch_stride + qh * p->o_head_stride,
             make_stride(int(p->o_row_stride), _1{},
                         make_stride(int(p->o_batch_stride), int(p->o_head_stride * launches))),
             p->lse + (b0 * h + qh) * nq, make_stride(_1{}, make_stride(int(h * nq), int(launches * nq)))},
            hw};
        e = launch_with_scale<Kernel>(args, scale, kSmem, stream,
                                      [packed, p, b0, qh, kvh, hkv, lists](auto& params) {
          if constexpr (Cfg::kPersistent) params.kv_group = static_cast<int>(packed);
          if constexpr (Cfg::kDropout) {  // philox.h's mask over the call's [B, H, Nq, Nk] weights
            params.dropout = philox::launch_mask(p->dropout_p, p->dropout_seed, p->dropout_offset, p->heads,
                                                 p->seqlen_q, p->seqlen_k, b0, qh);
            params.mainloop.rp_dropout = params.dropout.scale;
          }
          if constexpr (Cfg::kSoftcap) params.mainloop.scale_softmax_log2 = p->softcap;  // (softmax.h's cap)
          if constexpr (Cfg::kBias) {  // this chunk's first batch entry and query head
            params.bias = static_cast<const typename Cfg::Element*>(p->bias) + b0 * p->bias_batch_stride +
                          qh * p->bias_head_stride;
            params.bias_batch_stride = p->bias_batch_stride;
            params.bias_head_stride = p->bias_head_stride;
            params.bias_row_stride = p->bias_row_stride;
            if (lists != nullptr) {  // [bias batch][bias head][row tile][list_stride]
              const BiasSortLayout layout = sort_layout<Cfg>(p);
              const int64_t per_head = layout.row_tiles * layout.list_stride();
              params.lists_head_stride = p->bias_head_stride == 0 ? 0 : per_head;
              params.lists_batch_stride = p->bias_batch_stride == 0 ? 0 : per_head * bias_heads(p);
              params.bias_lists = lists + b0 * params.lists_batch_stride + qh * params.lists_head_stride;
              params.list_stride = static_cast<int>(layout.list_stride());
            }
          }
          if constexpr (Cfg::kFp8) {  // this chunk's [batch, K/V head] factors
            const int64_t at = b0 * hkv + kvh;
            params.descale_q = p->descale_q ? p->descale_q + at : nullptr;
            params.descale_k = p->descale_k ? p->descale_k + at : nullptr;
            params.descale_v = p->descale_v ? p->descale_v + at : nullptr;
            params.descale_batch_stride = static_cast<int>(hkv);
          }
          if constexpr (Cfg::kLocal) {  // WindowShape's offsets; an unbounded side lies past every key
            constexpr int64_t kUnbounded = int64_t(1) << 30;
            const int64_t lo = p->window_left < 0 ? -kUnbounded : int64_t(p->causal_offset) - p->window_left;
            const int64_t hi = p->window_right < 0 ? kUnbounded : int64_t(p->causal_offset) + p->window_right;
            params.window_lo = static_cast<int>(std::max(-kUnbounded, lo));
            params.window_hi = static_cast<int>(std::min(kUnbounded, hi));
          }
        });
        if (e != cudaSuccess) {
          return report(err, err_len, GEMMGEN_CUDA_ERROR, "kernel launch: %s (%s)", cudaGetErrorString(e),
                        cudaGetErrorName(e));
        }
      }
    }
  }
  return GEMMGEN_OK;
}

template <class Cfg>
int info(GemmgenInstanceInfo* out) {
  return cutlass_kernel_info<Cfg>(out,
                                 GEMMGEN_INFO_NEEDS_LSE |
                                     (Cfg::kFp8 || Cfg::kBias || Cfg::kVarlen ? GEMMGEN_INFO_WORKSPACE : 0));
}

}  // namespace gemmgen::fmha_sm90
