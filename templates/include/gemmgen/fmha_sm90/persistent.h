// The persistent ("ping-pong") schedule of the fmha_sm90 family: CUTLASS's warp-specialized
// mainloop (example 88: a producer warp group loading Q, K and V with TMA, two to four consumer warp
// groups sharing a row tile, 64 rows each), driven by a tile loop and an output epilogue of our own.
// Three groups (192-row tiles) suit d <= 64, where a group's softmax takes longer than its MMAs:
// two other groups keep the tensor cores busy meanwhile (bench/NOTES.md, experiment 32).
//
// Why not CUTLASS's own kernel: its consumer groups store O through CUTLASS's collective epilogue,
// one 64 x 32 sub-tile at a time, wait for each tile's stores to drain, and hold a lock shared with
// the other group meanwhile (the epilogue's named barrier is common to both groups). The next row
// tile's first Q K^T waits for both groups' epilogues. Here each group stores its 64 x d tile with
// one TMA store behind a named barrier of its own, takes no lock, and waits for the store only when
// it next needs the buffer (the kernel waits once before it exits): +2-9% at d128 up to N = 2048,
// a tie with causal at 8192 (bench/NOTES.md, experiment 29).
#pragma once
#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/arch/reg_reconfig.h"
#include "cutlass/cutlass.h"
#include "cutlass/fast_math.h"
#include "cutlass/kernel_hardware_info.h"
#include "cutlass/pipeline/pipeline.hpp"

#include "88_hopper_fmha/collective/fmha_common.hpp"
#include "88_hopper_fmha/kernel/fmha_kernel_tma_warpspecialized.hpp"

#include "gemmgen/fmha_sm90/bias.h"
#include "gemmgen/fmha_sm90/causal.h"
#include "gemmgen/fmha_sm90/softmax.h"
#include "gemmgen/fmha_sm90/varlen.h"

namespace gemmgen::fmha_sm90 {

using namespace cute;

// Causal row tiles in pairs. CUTLASS's persistent scheduler hands each SM a fixed stride of row
// tiles, which mixes short (top) and long (bottom) causal rows unevenly. Here row tile i of a head
// goes with row tile m - 1 - i (m row tiles per head) and one CTA runs both, the longer first: every
// pair holds the same number of key tiles, so a static round robin over the SMs is an even share.
// Pairs are handed out head by head, so the CTAs running at one time share a few heads' K and V in
// L2 (an order over all heads at once, longest tiles first, streamed every head's K and V from
// memory and was about a fifth slower at N = 1024-2048: bench/NOTES.md, experiment 23).
// When every row tile fits on the GPU at once (row tiles * batch * heads <= SMs), each tile is a work
// item of its own instead: the call then takes as long as its longest tile, not its longest pair,
// and twice the SMs work (a chunk of a few row tiles against a long context, causal bottom-right).
struct PairedScheduler {
  struct Params {
    int num_pairs;  // work items: pairs, or row tiles when not paired
    int num_m_blocks;
    cutlass::FastDivmod divmod_pairs;  // item index -> (batch * heads index, item within the head)
    cutlass::FastDivmod divmod_h;      // batch * heads index -> (batch, head)
    cutlass::KernelHardwareInfo hw_info;
    bool paired;
  };

  int pair_idx = 0;
  bool second = false;  // running the shorter tile of the pair
  Params params;

  CUTLASS_DEVICE PairedScheduler(Params const& p) : pair_idx(blockIdx.x), params(p) {}

  template <class ProblemSize, class ClusterShape, class TileShape>
  static Params to_underlying_arguments(ProblemSize const& problem_size, cutlass::KernelHardwareInfo hw_info,
                                        ClusterShape const&, TileShape const& tile_shape) {
    const int m_blocks = ceil_div(size<2>(problem_size), size<0>(tile_shape));
    const int bh = size<0>(problem_size) * size<1>(problem_size);
    const bool paired = int64_t(m_blocks) * bh > hw_info.sm_count;
    const int per_head = paired ? (m_blocks + 1) / 2 : m_blocks;
    return Params{per_head * bh, m_blocks, cutlass::FastDivmod(per_head), cutlass::FastDivmod(size<1>(problem_size)),
                  hw_info, paired};
  }

  static dim3 get_grid_shape(Params const& params) {
    return dim3(std::min(params.num_pairs, params.hw_info.sm_count), 1, 1);
  }

  CUTLASS_DEVICE bool is_valid() { return pair_idx < params.num_pairs; }

  CUTLASS_DEVICE auto get_block_coord() {
    int bh, pair, b, h;
    params.divmod_pairs(bh, pair, pair_idx);
    params.divmod_h(b, h, bh);
    return make_coord(second ? pair : params.num_m_blocks - 1 - pair, _0{}, make_coord(b, h));
  }

  CUTLASS_DEVICE PairedScheduler& operator++() {
    int bh, pair;
    params.divmod_pairs(bh, pair, pair_idx);
    if (params.paired && !second && pair != params.num_m_blocks - 1 - pair) {
      second = true;
    } else {
      second = false;
      pair_idx += gridDim.x;
    }
    return *this;
  }
};

// One consumer group's output: O (rows x d, converted to Element) and the LSE of its rows. O goes
// registers -> shared memory (stmatrix) -> global memory in one TMA store, issued by the group's
// first thread; the group synchronizes on its own named barrier, so the two groups run their
// epilogues at the same time. The store is left in flight: the next call waits for it to have read
// the buffer before rewriting it, and the kernel calls drain() before it exits.
// Direct: no buffer; the threads store O to global memory themselves, 16 bytes per thread and row
// (store_direct). A group's buffer is rows x d of shared memory (24 KB at d = 192), which for the
// large head dims' wide tiles costs the K/V pipeline a stage or more (FmhaSm90Instance.direct_store).
template <class Element, class TileShapePV, bool Direct = false>  // (rows, d, keys) of one consumer group
struct GroupEpilogue {
  static constexpr int kRows = size<0>(TileShapePV{});
  static constexpr int kCols = size<1>(TileShapePV{});
  static constexpr int kThreads = cutlass::NumThreadsPerWarpGroup;
  using StrideO = cute::tuple<int, _1, cute::tuple<int, int>>;  // (row, 1, (batch, head)) in elements
  using StrideLSE = cute::tuple<_1, cute::tuple<int, int>>;
  using TileMN = Shape<Int<kRows>, Int<kCols>>;
  // The widest swizzle whose row fits the tile's row (d = 32 has 64-byte rows).
  using SmemAtom = std::conditional_t<kCols * sizeof(Element) % 128 == 0, GMMA::Layout_K_SW128_Atom<Element>,
                                      GMMA::Layout_K_SW64_Atom<Element>>;
  using SmemLayout = decltype(tile_to_shape(SmemAtom{}, TileMN{}));
  using TmaStore = decltype(make_tma_copy(
      SM90_TMA_STORE{},
      make_tensor(make_gmem_ptr(static_cast<Element*>(nullptr)), make_shape(0, 0, make_shape(0, 0)), StrideO{}),
      SmemLayout{}, TileMN{}, _1{}));

  struct BufferStorage {
    cute::array_aligned<Element, cute::cosize_v<SmemLayout>, 128> smem_o;
  };
  struct NoStorage {};
  using TensorStorage = std::conditional_t<Direct, NoStorage, BufferStorage>;
  // CUTLASS's kernel storage names an epilogue load pipeline; this epilogue loads nothing.
  using LoadPipeline = cutlass::PipelineTransactionAsync<1>;
  using PipelineStorage = typename LoadPipeline::SharedStorage;
  static constexpr int TmaTransactionBytes = 0;

  struct Arguments {
    Element* ptr_O;
    StrideO dO;
    float* ptr_LSE;
    StrideLSE dLSE;
  };
  struct Params {
    TmaStore tma_store;
    float* ptr_LSE;
    StrideLSE dLSE;
    Element* ptr_O;  // the direct stores of a packed sequence's last rows
    StrideO dO;
  };

  template <class ProblemShape>  // (batch, heads, seqlen_q, seqlen_k, d)
  CUTLASS_HOST_DEVICE static auto shape_o(ProblemShape const& ps) {
    return make_shape(get<2>(ps), get<4>(ps), make_shape(get<0>(ps), get<1>(ps)));
  }

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& ps, Arguments const& a, void* = nullptr) {
    Tensor mO = make_tensor(make_gmem_ptr(a.ptr_O), shape_o(ps), a.dO);
    return Params{make_tma_copy(SM90_TMA_STORE{}, mO, SmemLayout{}, TileMN{}, _1{}), a.ptr_LSE, a.dLSE, a.ptr_O, a.dO};
  }

  CUTLASS_DEVICE static void prefetch_tma_descriptor(Params const& params) {
    cute::prefetch_tma_descriptor(params.tma_store.get_tma_descriptor());
  }

  // Before the CTA exits: its last stores have read shared memory.
  CUTLASS_DEVICE static void drain() {
    if constexpr (!Direct) cute::tma_store_wait<0>();
  }

  // blk: (row block of kRows rows, 0, (batch, head)); result: (O accumulators, LSE per held row).
  // ps: the tile's problem (a packed sequence's own lengths). q_row0 >= 0: a packed sequence whose
  // first row is row q_row0 of the [total rows, H, d] O (blk's batch then names the sequence): the
  // TMA store clips only at the packed tensor's end, so a tile reaching past the sequence's last row
  // is stored row by row instead, up to that row. lse_row0: the LSE row of the problem's first row
  // (key counts on the GPU: the rows of the sequence's slot before its work rows, varlen.h).
  template <class BlkCoord, class Result, class TiledMma, class ProblemShape>
  CUTLASS_DEVICE void operator()(BlkCoord const& blk, Result const& result, TiledMma const& mma,
                                 ProblemShape const& ps, Params const& params, TensorStorage& smem,
                                 int q_row0 = -1, int lse_row0 = 0) const {
    const int tid = threadIdx.x % kThreads;
    auto const& acc = get<0>(result);
    auto const& lse = get<1>(result);

    Tensor out = make_fragment_like<Element>(acc);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(acc); ++i) out(i) = static_cast<Element>(acc(i));
    // (row, column) of each accumulator in the group's tile.
    Tensor coord = mma.get_thread_slice(tid).partition_C(make_identity_tensor(TileMN{}));
    const int rows_left = get<2>(ps) - get<0>(blk) * kRows;  // this tile's rows within the problem

    if constexpr (Direct) {
      store_direct(blk, out, coord, rows_left, params, q_row0);
    } else {
      store_buffered(blk, out, mma, ps, params, smem, q_row0, rows_left);
    }

    // LSE: the thread holding column 0 of a row writes it.
    Tensor coord_mn = make_tensor(coord.data(), cutlass::fmha::collective::layout_acc_mn(mma, coord.layout()));
    if (get<1>(coord_mn(0, 0)) == 0) {
      float* lse_bh = params.ptr_LSE + get<0>(get<2>(blk)) * get<0>(get<1>(params.dLSE)) +
                      get<1>(get<2>(blk)) * get<1>(get<1>(params.dLSE)) + lse_row0;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size<0>(coord_mn); ++i) {
        const int row = get<0>(blk) * kRows + get<0>(coord_mn(i, 0));
        if (row < get<2>(ps)) lse_bh[row] = lse(i);
      }
    }
  }

  // Direct stores, 16 bytes per thread and row. A wgmma accumulator holds value c + 2r + 4j of a
  // thread at row r * 8 + (its row) and column 8j + 2t + c (t: the thread's place in its quad of
  // four lanes), so each 8-column chunk of a row lies in one quad, 4 bytes per thread. Four chunks
  // at a time, the quad transposes its 4 x 4 words with three shuffles, after which thread t holds
  // all 16 bytes of chunk t: a warp's store then covers 8 rows x 64 bytes (whole 32-byte sectors),
  // a quarter of the store instructions of 4-byte stores. Rows past the problem's are not written.
  // q_row0 >= 0: the rows of a packed sequence from its first row in the [total rows, H, d] O (no
  // batch stride).
  template <class BlkCoord, class Out, class Coord>
  CUTLASS_DEVICE static void store_direct(BlkCoord const& blk, Out const& out, Coord const& coord, int rows_left,
                                          Params const& params, int q_row0) {
    static_assert(sizeof(Element) == 2);
    constexpr int kChunks = kCols / 8;  // 8-column chunks of a row
    static_assert(kChunks % 4 == 0 && decltype(size(out))::value == 4 * kChunks,
                  "a thread holds 2 columns x 2 rows of each 8-column chunk");
    Tensor words = recast<uint32_t>(out);  // word r + 2j: the pair (c = 0, 1) of row half r, chunk j
    const int lane = threadIdx.x % cutlass::NumThreadsPerWarp;
    const int t = lane % 4, quad = lane & ~3;
    const int64_t b = q_row0 < 0 ? get<0>(get<2>(blk)) : 0;
    Element* o_tile = params.ptr_O + int64_t(b) * get<0>(get<2>(params.dO)) +
                      int64_t(get<1>(get<2>(blk))) * get<1>(get<2>(params.dO)) +
                      int64_t((q_row0 < 0 ? 0 : q_row0) + get<0>(blk) * kRows) * get<0>(params.dO);
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < 2; ++r) {
      const int row = get<0>(coord(2 * r));  // (the same row for every chunk of this half)
      CUTLASS_PRAGMA_UNROLL
      for (int g = 0; g < kChunks / 4; ++g) {
        uint32_t w[4], d[4] = {0, 0, 0, 0};
        CUTLASS_PRAGMA_UNROLL
        for (int c = 0; c < 4; ++c) w[c] = words(r + 2 * (4 * g + c));
        // Round k: this thread sends its word of chunk (t + k) % 4 and receives from thread
        // s = (t - k) % 4 its word of chunk t, columns 2s and 2s + 1 of that chunk.
        CUTLASS_PRAGMA_UNROLL
        for (int k = 0; k < 4; ++k) {
          const int send = (t + k) & 3, from = (t - k) & 3;
          const uint32_t x = send == 0 ? w[0] : send == 1 ? w[1] : send == 2 ? w[2] : w[3];
          const uint32_t y = k == 0 ? x : __shfl_sync(0xffffffff, x, quad | from);
          CUTLASS_PRAGMA_UNROLL
          for (int s = 0; s < 4; ++s) d[s] = s == from ? y : d[s];
        }
        if (row < rows_left) {
          *reinterpret_cast<uint4*>(o_tile + int64_t(row) * get<0>(params.dO) + 8 * (4 * g + t)) =
              make_uint4(d[0], d[1], d[2], d[3]);
        }
      }
    }
  }

  template <class BlkCoord, class Out, class TiledMma, class ProblemShape>
  CUTLASS_DEVICE void store_buffered(BlkCoord const& blk, Out const& out, TiledMma const& mma,
                                     ProblemShape const& ps, Params const& params, TensorStorage& smem,
                                     int q_row0, int rows_left) const {
    const int tid = threadIdx.x % kThreads;
    // One named barrier per consumer warp group (1-4; NamedBarrier adds CUTLASS's reserved count, so
    // hardware ids 9-12 of 16: __syncthreads' 0 and the reserved ones stay free).
    const int barrier = threadIdx.x / kThreads;
    Tensor sO = make_tensor(make_smem_ptr(smem.smem_o.data()), SmemLayout{});
    // stmatrix: each lane's fragment lands in other lanes' rows, so the copy needs the tiled op.
    auto r2s = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma);
    auto thr_r2s = r2s.get_thread_slice(tid);
    if (tid == 0) cute::tma_store_wait<0>();  // the previous tile's store has read the buffer
    cutlass::arch::NamedBarrier::sync(kThreads, barrier);
    copy(r2s, thr_r2s.retile_S(out), thr_r2s.partition_D(sO));
    cute::tma_store_fence();  // the writes are visible to the TMA unit
    cutlass::arch::NamedBarrier::sync(kThreads, barrier);
    if (q_row0 < 0) {
      if (tid == 0) {
        Tensor mO = params.tma_store.get_tma_tensor(shape_o(ps));
        Tensor gO = local_tile(mO(_, _, get<2>(blk)), TileMN{}, make_coord(get<0>(blk), _0{}));
        auto tma = params.tma_store.get_slice(_0{});
        copy(params.tma_store, tma.partition_S(sO), tma.partition_D(gO));  // rows past seqlen_q are clipped
        cute::tma_store_arrive();
      }
    } else if (rows_left >= kRows) {
      if (tid == 0) {  // the descriptor spans the packed rows: batch 0, the sequence's rows from q_row0
        auto rows_to_end = shape_o(ps);
        get<0>(rows_to_end) = q_row0 + get<2>(ps);  // (offset below to the sequence's own rows)
        Tensor mO = params.tma_store.get_tma_tensor(rows_to_end);
        Tensor mO_seq = domain_offset(make_coord(q_row0, _0{}), mO(_, _, make_coord(_0{}, get<1>(get<2>(blk)))));
        Tensor gO = local_tile(mO_seq, TileMN{}, make_coord(get<0>(blk), _0{}));
        auto tma = params.tma_store.get_slice(_0{});
        copy(params.tma_store, tma.partition_S(sO), tma.partition_D(gO));
        cute::tma_store_arrive();
      }
    } else {
      // 16-byte chunks from the swizzled buffer (a chunk of 8 elements stays contiguous in it). The
      // buffer is rewritten only after the next tile's first barrier, which every thread reaches
      // after these reads.
      constexpr int kChunks = kCols * int(sizeof(Element)) / 16;
      Element* o_rows = params.ptr_O + int64_t(q_row0 + get<0>(blk) * kRows) * get<0>(params.dO) +
                        int64_t(get<1>(get<2>(blk))) * get<1>(get<2>(params.dO));
      for (int i = tid; i < rows_left * kChunks; i += kThreads) {
        const int r = i / kChunks, c = (i - r * kChunks) * (16 / int(sizeof(Element)));
        *reinterpret_cast<uint4*>(o_rows + int64_t(r) * get<0>(params.dO) + c) =
            *reinterpret_cast<uint4 const*>(&sO(r, c));
      }
    }
  }
};

// O's type: the inputs', or bf16 for 8-bit (fp8) inputs.
template <class Element>
using OutputOf = std::conditional_t<sizeof(Element) == 1, cutlass::bfloat16_t, Element>;

// The kernel: CUTLASS's shared storage, params and launch shape (inherited), with our own loop.
// The producer warp group's warp 1 loads K and V, warp 2 Q; the consumer groups take the tile
// scheduler's row tiles in turn, 64 rows each, and order only their first Q K^T per tile (CUTLASS's
// sequence barrier, which staggers their tensor-core work).
template <class Mainloop, class Fusion, bool DirectO, class Scheduler, class... Options>
struct PersistentKernel
    : cutlass::fmha::kernel::FmhaKernelTmaWarpSpecialized<
          Mainloop, GroupEpilogue<OutputOf<typename Mainloop::Element>, typename Mainloop::TileShapePV, DirectO>,
          Scheduler, Options...> {
  using Epilogue = GroupEpilogue<OutputOf<typename Mainloop::Element>, typename Mainloop::TileShapePV, DirectO>;
  static constexpr bool kFp8 = sizeof(typename Mainloop::Element) == 1;
  using Base = cutlass::fmha::kernel::FmhaKernelTmaWarpSpecialized<Mainloop, Epilogue, Scheduler, Options...>;
  using typename Base::Arguments;
  using typename Base::SharedStorage;
  // Copies of the K and V loads' TMA objects (descriptor first), for packed sequences with key counts
  // on the GPU (load_kv_packed): 128-byte aligned, as descriptors in global memory must be; each CTA
  // has kSlots of them and takes the next for each sequence it moves to. A slot is rewritten only
  // after the loads issued with it have landed: each sequence issues a K and a V load at least, and
  // the producer acquires the stage of a load only once the load a pipeline depth before it has been
  // consumed, so kSlots - 1 sequences later every load of the slot's has.
  using TmaK = std::remove_cv_t<decltype(Mainloop::Params::tma_load_k)>;
  using TmaV = std::remove_cv_t<decltype(Mainloop::Params::tma_load_v)>;
  static constexpr int kSlotK = (int(sizeof(TmaK)) + 127) / 128 * 128;
  static constexpr int kSlotV = (int(sizeof(TmaV)) + 127) / 128 * 128;
  struct alignas(128) KvSlot {
    char k[kSlotK];
    char v[kSlotV];
  };
  static constexpr int kSlots = Base::MainloopPipelineInner::Stages / 2 + 2;
  // CUTLASS's params, and GQA: the K/V loads of query head h read K/V head h / kv_group (the launch
  // then covers every query head at once; the K/V tensors' head extent is the query heads', of
  // which only the first heads / kv_group are read).
  struct Params : Base::Params {
    int kv_group = 1;
    int window_lo = 0, window_hi = 0;  // a sliding window's offsets (WindowShape), window fusions only
    // fp8: the factors of q, k, v per (batch, K/V head), float32 at [batch * descale_batch_stride +
    // K/V head] (NULL: 1).
    const float* descale_q = nullptr;
    const float* descale_k = nullptr;
    const float* descale_v = nullptr;
    int descale_batch_stride = 0;
    // An additive mask (bias instances): [batch, head, row, key] of this launch's first batch entry
    // and head, by the strides in elements (0 where it broadcasts), and its row tiles' lists of key
    // tiles (bias.h; NULL: every key tile, mixed), list_stride apart, by (batch, head) strides in
    // list entries.
    const void* bias = nullptr;
    int64_t bias_batch_stride = 0, bias_head_stride = 0, bias_row_stride = 0;
    const uint32_t* bias_lists = nullptr;
    int64_t lists_batch_stride = 0, lists_head_stride = 0;
    int list_stride = 0;
    philox::Mask dropout{};  // the softmax's kDropout: the call's mask (philox.h)
    // Key counts on the GPU (varlen.h's used_k): kSlots slots per CTA (kv_slots[blockIdx.x * kSlots..])
    // for copies of the K and V loads' TMA objects, and what their descriptors' addresses are moved by
    // (load_kv_packed).
    KvSlot* kv_slots = nullptr;
    const char* k_base = nullptr;
    const char* v_base = nullptr;
    int64_t k_row_bytes = 0, v_row_bytes = 0;
  };

  // Bias instances (the softmax's LazyRescale has a BiasElement): each row tile's bias rows reach the
  // softmax through TileBias (softmax.h).
  template <class F> struct BiasOf { using type = void; };
  template <class M, bool S, bool D, bool C, class B, int N, bool X> struct BiasOf<LazyRescale<M, S, D, C, B, N, X>> {
    using type = B;
  };
  template <class F, class = void> struct DropsOf : cute::false_type {};
  template <class F> struct DropsOf<F, std::void_t<decltype(F::kDrops)>> : cute::bool_constant<F::kDrops> {};
  static constexpr bool kDropout = DropsOf<Fusion>::value;
  using BiasElement = typename BiasOf<Fusion>::type;
  static constexpr bool kBias = !std::is_void_v<BiasElement>;
  // The slot of row tile `blk` for its consumer group `group` (the producer's: group 0).
  template <class BlkCoord>
  CUTLASS_DEVICE static TileBias bias_of(Params const& params, BlkCoord const& blk, int group) {
    const int64_t b = get<0>(get<2>(blk)), h = get<1>(get<2>(blk));
    const uint32_t* list = params.bias_lists == nullptr ? nullptr
        : params.bias_lists + b * params.lists_batch_stride + h * params.lists_head_stride +
              int64_t(get<0>(blk)) * params.list_stride;
    return TileBias{static_cast<BiasElement const*>(params.bias) + b * params.bias_batch_stride +
                        h * params.bias_head_stride,
                    params.bias_row_stride, list, group};
  }
  // Sets this warp's slot (as the factors' slot: after its last reads of the previous tile's).
  template <class BlkCoord>
  CUTLASS_DEVICE static void set_bias_slot(Params const& params, BlkCoord const& blk, int group) {
    if constexpr (kBias) {
      __syncwarp();
      if (cute::elect_one_sync()) tile_bias() = bias_of(params, blk, group);
      __syncwarp();
    }
  }

  // fp8: the factors of row tile `blk` (TileFactors, softmax.h): q's times k's, and v's. A product
  // of q's and k's that is not a positive finite number gives NaN rows rather than a wrong softmax
  // (the mainloop takes the row maximum of the raw scores, which needs a scale >= 0).
  template <class BlkCoord>
  CUTLASS_DEVICE static TileFactors factors_of(Params const& params, BlkCoord const& blk) {
    const int64_t at = int64_t(get<0>(get<2>(blk))) * params.descale_batch_stride +
                       get<1>(get<2>(blk)) / params.kv_group;
    float qk = (params.descale_q ? params.descale_q[at] : 1.f) * (params.descale_k ? params.descale_k[at] : 1.f);
    if (!(qk > 0.f && qk < INFINITY)) qk = NAN;
    return TileFactors{qk, params.descale_v ? params.descale_v[at] : 1.f};
  }
  // A sliding window (causal.h's LocalWindow): the Fusion and softmax get a WindowShape, and the K/V
  // loads start at the row tile's first key tile (load_kv below) instead of key tile 0.
  template <class F, class = void> struct IsWindow : cute::false_type {};
  template <class F> struct IsWindow<F, std::void_t<decltype(F::kWindow)>> : cute::true_type {};
  static constexpr bool kWindow = IsWindow<Fusion>::value;
  // Packed sequences (varlen.h): the kernel with VarlenScheduler, launched with cu_seqlens only. Its
  // problem size spans the packed tensors (batch 1, total rows).
  template <class S, class = void> struct IsVarlen : cute::false_type {};
  template <class S> struct IsVarlen<S, std::void_t<decltype(&S::place_of)>> : cute::true_type {};
  static constexpr bool kVarlen = IsVarlen<Scheduler>::value;
  // The packed sequence of work item `blk` (its batch coordinate names the sequence).
  template <class BlkCoord>
  CUTLASS_DEVICE static Placed place_item(Params const& params, BlkCoord const& blk) {
    if constexpr (kVarlen) {
      return Scheduler::place_of(params.tile_scheduler.varlen, get<0>(get<2>(blk)));
    } else {
      return Placed{};
    }
  }
  // A packed call's key counts on the GPU (varlen.h's used_k; NULL: none, or no packed call).
  CUTLASS_DEVICE static int const* used_k_of(Params const& params) {
    if constexpr (kVarlen) {
      return params.tile_scheduler.varlen.used_k;
    } else {
      return nullptr;
    }
  }
  // Its problem: (1, heads, its query rows, the keys its mask may show, d).
  CUTLASS_DEVICE static auto item_problem(Params const& params, Placed const& at) {
    auto ps = params.problem_size;
    get<0>(ps) = 1;
    get<2>(ps) = at.len_q;
    get<3>(ps) = at.keys;
    return ps;
  }
  // The problem the Fusion and softmax take for a packed sequence's item: its own, and for a window
  // the window's offsets moved to the sequence's diagonal (bottom-right within each sequence: by
  // len_k - len_q; the launch sets them around offset 0; an unbounded side stays unbounded).
  CUTLASS_DEVICE static auto item_fusion_problem(Params const& params, Placed const& at) {
    if constexpr (kWindow) {
      constexpr int64_t kUnbounded = int64_t(1) << 30;  // (as the launch's: past every key)
      const int64_t off = params.tile_scheduler.varlen.align ? at.keys - at.len_q : 0;
      const int64_t lo = params.window_lo <= -kUnbounded ? -kUnbounded : params.window_lo + off;
      const int64_t hi = params.window_hi >= kUnbounded ? kUnbounded : params.window_hi + off;
      return WindowShape{item_problem(params, at), int(lo < -kUnbounded ? -kUnbounded : lo),
                         int(hi > kUnbounded ? kUnbounded : hi)};
    } else {
      return item_problem(params, at);
    }
  }
  CUTLASS_DEVICE static auto fusion_problem(Params const& params) {
    if constexpr (kWindow) {
      return WindowShape{params.problem_size, params.window_lo, params.window_hi};
    } else {
      return params.problem_size;
    }
  }
  static Params to_underlying_arguments(Arguments const& args, void* workspace) {
    Params params;
    static_cast<typename Base::Params&>(params) = Base::to_underlying_arguments(args, workspace);
    return params;
  }
  using PipeQ = typename Base::MainloopPipelineOuter;
  using PipeKV = typename Base::MainloopPipelineInner;
  using PipeUnused = typename Base::MainloopPipelineReducer;  // compute() takes it; the forward pass never uses it
  static constexpr int kGroups = Base::NumMmaWarpGroups;
  static_assert(kGroups >= 2 && kGroups <= 4 && Base::kLoadsQSeparately);
  static_assert(size(typename Base::ClusterShape{}) == 1);
  static constexpr int kGroupRows = size<0>(typename Mainloop::TileShape{}) / kGroups;

  // A consumer group whose rows all lie past seqlen_q (in the last row tile of a head, when the
  // tile has more rows than are left) skips the math but keeps its place: it takes its turn in the
  // group order and waits for and releases the Q stage and every K and V stage that compute() would,
  // so the producer and the other groups run as before. The key-tile count repeats compute()'s.
  template <class BlkCoord, class ProblemShape, class State, class StateQ, class Order>
  CUTLASS_DEVICE static void skip(BlkCoord const& blk, ProblemShape const& ps, PipeKV& pipe_kv, State& read_kv,
                                  PipeQ& pipe_q, StateQ const& read_q, Order& order) {
    using TileShape = typename Mainloop::TileShape;
    int left = Fusion{}.get_unmasked_trip_count(blk, TileShape{}, ps) - 1;  // after the first key tile
    int tiles = 1 + (left > 0 ? left : 0);
    left = (left > 0 ? 0 : left) + Fusion{}.get_masked_trip_count(blk, TileShape{}, ps);
    tiles += left > 0 ? left : 0;
    pipe_q.consumer_wait(read_q);
    order.wait();
    order.arrive();
    for (int i = 0; i < 2 * tiles; ++i) {  // a K and a V stage per key tile
      pipe_kv.consumer_wait(read_kv);
      pipe_kv.consumer_release(read_kv);
      ++read_kv;
    }
    pipe_q.consumer_release(read_q);
  }

  // Issues `count` K and V tiles from tile `start` on, in the order CUTLASS's own loader does (K of
  // tile t, then V of tile t, the first V after the K/V and Q warps meet).
  // tma_k, tma_v: the TMA objects the copies use (NULL: the params').
  template <class StateK, class StateV, class State, class Storage, class Barrier>
  CUTLASS_DEVICE static void load_kv_tiles(StateK const& state_k, StateV const& state_v, int start, int count,
                                           Params const& params, PipeKV& pipe_kv, State& write_kv,
                                           Storage& storage, Barrier& barrier, bool first,
                                           uint32_t const* listed = nullptr, TmaK const* tma_k = nullptr,
                                           TmaV const* tma_v = nullptr) {
    const int lane = cute::elect_one_sync();
    typename Mainloop::LoadK load_k{tma_k ? *tma_k : params.mainloop.tma_load_k, pipe_kv, storage.smem_k};
    typename Mainloop::LoadV load_v{tma_v ? *tma_v : params.mainloop.tma_load_v, pipe_kv, storage.smem_v};
    TileIndex tile{start, listed};
    int steps = 2 * count;  // one K and one V step per key tile
    load_k.template step<false>(tile, state_k, write_kv, lane, steps);
    if (first) {
      barrier.arrive();
      barrier.wait(/*phase=*/0);
    }
    load_v.template step<true>(tile, state_v, write_kv, lane, steps);
    while (steps > 0) {
      load_k.template step<false>(tile, state_k, write_kv, lane, steps);
      load_v.template step<true>(tile, state_v, write_kv, lane, steps);
    }
  }

  struct TileIndex {  // what CollectiveLoadTma::step reads of an iterator: tile i, or a list's i-th
    int i;
    uint32_t const* listed = nullptr;  // a sorted bias's list entries (bias.h)
    CUTLASS_DEVICE int operator*() const { return listed ? tile_of(__ldg(listed + i)) : i; }
    CUTLASS_DEVICE void operator++() { ++i; }
  };

  // A sliding window's row tile `blk` (K/V head in kv_blk): its key tiles from the first it sees; a
  // sorted bias's: its listed key tiles (the warp's bias slot is set).
  template <class BlkCoord, class State, class Storage, class Barrier>
  CUTLASS_DEVICE static void load_kv(BlkCoord const& blk, BlkCoord const& kv_blk, Params const& params,
                                     PipeKV& pipe_kv, State& write_kv, Storage& storage, Barrier& barrier,
                                     bool first) {
    using TileShape = typename Mainloop::TileShape;
    const auto problem = fusion_problem(params);
    const int count = Fusion{}.get_trip_count(blk, TileShape{}, problem);
    typename Mainloop::LoadK load_k{params.mainloop.tma_load_k, pipe_kv, storage.smem_k};
    typename Mainloop::LoadV load_v{params.mainloop.tma_load_v, pipe_kv, storage.smem_v};
    auto state_k = load_k.init_state(_0{}, params.problem_size, typename Mainloop::TileShapeQK{}, kv_blk, count);
    auto state_v = load_v.init_state(_0{}, params.problem_size, typename Mainloop::TileShapePV{}, kv_blk, count);
    if constexpr (kWindow) {
      load_kv_tiles(state_k, state_v, Fusion::first_tile(blk, problem), count, params, pipe_kv, write_kv, storage,
                    barrier, first);
    } else {
      uint32_t const* list = tile_bias().list;
      load_kv_tiles(state_k, state_v, 0, count, params, pipe_kv, write_kv, storage, barrier, first,
                    list == nullptr ? nullptr : list + 2);
    }
  }

  // A packed sequence's tiles of one head: a (rows, cols, tiles) view of the packed tensor `m` from
  // the sequence's first row (mode `RowMode` of m's (rows or cols, cols or rows, (batch, head))),
  // partitioned for the TMA copy into `smem` (CUTLASS's load state).
  template <int RowMode, class Tma, class MTensor, class Tile, class SmemLayout, class Smem>
  CUTLASS_DEVICE static auto packed_state(Tma const& tma, MTensor const& m, int row0, int head, Tile const& tile,
                                          SmemLayout const&, Smem& smem) {
    Tensor m_head = m(_, _, make_coord(_0{}, head));
    Tensor g = [&] {
      if constexpr (RowMode == 0) {
        return local_tile(domain_offset(make_coord(row0, _0{}), m_head), tile, make_coord(_, _0{}));
      } else {
        return local_tile(domain_offset(make_coord(_0{}, row0), m_head), tile, make_coord(_0{}, _));
      }
    }();
    Tensor s = make_tensor(make_smem_ptr(smem.data()), SmemLayout{});
    auto block_tma = tma.get_slice(_0{});
    return make_tuple(block_tma.partition_S(g), block_tma.partition_D(s));
  }

  // The K and V tiles of a packed sequence's row tile `blk` (its problem `ps`, K/V head kv_head).
  //
  // Key counts on the GPU (varlen.h's used_k): the rows of a sequence's slot past its keys are not
  // its data (an uninitialized cache may hold NaN there, and 0 * NaN is NaN in P V), so the loads
  // must read zeros there. The TMA unit zero-fills rows past a tensor's end only: each CTA copies the
  // K and V loads' TMA objects into its slot, with the descriptors' addresses moved so that the
  // packed tensors (total_k rows) end at the sequence's last key, and reads the sequence at rows
  // total_k - keys on. `slot_b`: the sequence the CTA's current slot holds (-1: none yet);
  // `slot_i`: that slot's index.
  template <bool Counted, class BlkCoord, class ProblemShape, class State, class Storage, class Barrier>
  CUTLASS_DEVICE static void load_kv_packed(BlkCoord const& blk, ProblemShape const& ps, Placed const& at,
                                            int kv_head, Params const& params, PipeKV& pipe_kv, State& write_kv,
                                            Storage& storage, Barrier& barrier, bool first, int& slot_b,
                                            int& slot_i) {
    using TileShapeQK = typename Mainloop::TileShapeQK;
    auto const& P = params.problem_size;  // (1, heads, total_q, total_k, d)
    auto const& mp = params.mainloop;
    Tensor mK = mp.tma_load_k.get_tma_tensor(make_shape(get<3>(P), get<4>(P), make_shape(get<0>(P), get<1>(P))));
    Tensor mV = mp.tma_load_v.get_tma_tensor(make_shape(get<4>(P), get<3>(P), make_shape(get<0>(P), get<1>(P))));
    const int row0 = Counted ? int(get<3>(P)) - at.keys : at.k_row0;
    auto state_k = packed_state<0>(mp.tma_load_k, mK, row0, kv_head, select<1, 2>(TileShapeQK{}),
                                   typename Mainloop::SmemLayoutK{}, storage.smem_k);
    auto state_v = packed_state<1>(mp.tma_load_v, mV, row0, kv_head,
                                   make_shape(get<2>(TileShapeQK{}), get<1>(TileShapeQK{})),
                                   typename Mainloop::SmemLayoutV{}, storage.smem_v);
    const int count = Fusion{}.get_trip_count(blk, typename Mainloop::TileShape{}, ps);
    int start = 0;
    if constexpr (kWindow) start = Fusion::first_tile(blk, ps);  // a window's first key tile
    if constexpr (!Counted) {
      load_kv_tiles(state_k, state_v, start, count, params, pipe_kv, write_kv, storage, barrier, first);
      return;
    }
    const int b = get<0>(get<2>(blk));
    const bool moved = b != slot_b;
    if (moved) slot_i = slot_i + 1 == kSlots ? 0 : slot_i + 1;
    KvSlot* slot = params.kv_slots + int64_t(blockIdx.x) * kSlots + slot_i;
    TmaK const* tma_k = reinterpret_cast<TmaK const*>(slot->k);
    TmaV const* tma_v = reinterpret_cast<TmaV const*>(slot->v);
    if (moved) {  // the warp copies the TMA objects, 16 bytes a lane
      static_assert(sizeof(TmaK) % 16 == 0 && sizeof(TmaV) % 16 == 0);
      const int lane = threadIdx.x % cutlass::NumThreadsPerWarp;
      auto const* from_k = reinterpret_cast<uint4 const*>(&mp.tma_load_k);
      auto const* from_v = reinterpret_cast<uint4 const*>(&mp.tma_load_v);
      CUTLASS_PRAGMA_NO_UNROLL
      for (int i = lane; i < int(sizeof(TmaK) / 16); i += cutlass::NumThreadsPerWarp) {
        reinterpret_cast<uint4*>(slot->k)[i] = from_k[i];
      }
      CUTLASS_PRAGMA_NO_UNROLL
      for (int i = lane; i < int(sizeof(TmaV) / 16); i += cutlass::NumThreadsPerWarp) {
        reinterpret_cast<uint4*>(slot->v)[i] = from_v[i];
      }
      __syncwarp();
    }
    if (moved && cute::elect_one_sync()) {
      const int64_t shift = int64_t(at.k_row0) + at.keys - get<3>(P);  // rows: <= 0
      cute::tma_descriptor_replace_addr_in_global_mem(tma_k->get_tma_descriptor(),
                                                      params.k_base + shift * params.k_row_bytes);
      cute::tma_descriptor_replace_addr_in_global_mem(tma_v->get_tma_descriptor(),
                                                      params.v_base + shift * params.v_row_bytes);
      cute::tma_descriptor_fence_release();
    }
    if (moved) {  // every lane, whichever issues the loads
      __syncwarp();
      cute::tma_descriptor_fence_acquire(tma_k->get_tma_descriptor());
      cute::tma_descriptor_fence_acquire(tma_v->get_tma_descriptor());
    }
    slot_b = b;
    load_kv_tiles(state_k, state_v, start, count, params, pipe_kv, write_kv, storage, barrier, first, nullptr,
                  tma_k, tma_v);
  }

  // The K/V producer warp's loop over a packed call's work items (load_kv_packed's Counted: the
  // call reads key counts on the GPU).
  template <bool Counted, class Sched, class State, class Storage>
  CUTLASS_DEVICE static void load_kv_items(Sched& scheduler, Params const& params, PipeKV& pipe_kv, State& write_kv,
                                           Storage& storage) {
    if constexpr (kVarlen) {
      bool first = true;
      int slot_b = -1, slot_i = 0;
      for (; scheduler.is_valid(); ++scheduler, first = false) {
        auto blk = scheduler.get_block_coord();
        const Placed at = place_item(params, blk);
        load_kv_packed<Counted>(blk, item_fusion_problem(params, at), at, get<1>(get<2>(blk)) / params.kv_group,
                                params, pipe_kv, write_kv, storage.tensors.mainloop, storage.load_warp_barrier, first,
                                slot_b, slot_i);
      }
    }
  }

  // The Q tiles (one per consumer group) of a packed sequence's row tile `blk`.
  template <class BlkCoord, class State, class Storage, class Barrier>
  CUTLASS_DEVICE static void load_q_packed(BlkCoord const& blk, Placed const& at, Params const& params,
                                           PipeQ& pipe_q, State& write_q, Storage& storage, Barrier& barrier,
                                           bool first) {
    using TileShapeQK = typename Mainloop::TileShapeQK;
    auto const& P = params.problem_size;
    auto const& mp = params.mainloop;
    Tensor mQ = mp.tma_load_q.get_tma_tensor(make_shape(get<2>(P), get<4>(P), make_shape(get<0>(P), get<1>(P))));
    auto state_q = packed_state<0>(mp.tma_load_q, mQ, at.q_row0, get<1>(get<2>(blk)), select<0, 2>(TileShapeQK{}),
                                   typename Mainloop::SmemLayoutQ{}, storage.smem_q);
    const int lane = cute::elect_one_sync();
    typename Mainloop::LoadQ load_q{mp.tma_load_q, pipe_q, storage.smem_q};
    TileIndex tile{kGroups * int(get<0>(blk))};
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kGroups; ++i) {
      int count = 1;
      load_q.step(tile, state_q, write_q, lane, count);
      if (i == 0 && first) {
        barrier.arrive();
        barrier.wait(/*phase=*/0);
      }
    }
  }

  // Producer warp 3 of a packed call: the rows no work item writes. LSE rows past each sequence's
  // end (up to max_q) are -inf, as the softmax of an empty row; with key counts on the GPU (varlen.h's
  // used_k) also the rows of the sequence's slot before its work rows: O = 0 and LSE = -inf, or NaN
  // for a bad count. The CTAs take the sequences in turn.
  CUTLASS_DEVICE static void write_tails(Params const& params) {
    if constexpr (kVarlen) {
      Varlen const& v = params.tile_scheduler.varlen;
      const int heads = get<1>(params.problem_size);
      const int lane = threadIdx.x % cutlass::NumThreadsPerWarp;
      for (int b = blockIdx.x; b < v.batch; b += gridDim.x) {
        const Placed at = Scheduler::place_of(v, b);
        const int skip = v.used_k != nullptr ? v.cu_q[b] - v.slot_q[b] : 0;  // rows before the work rows
        const int done = skip + at.len_q;  // LSE rows [skip, done) are the work item's
        const int tail = v.max_q - done;
        float* lse_b = params.epilogue.ptr_LSE + int64_t(b) * heads * v.max_q;
        for (int i = lane; i < tail * heads; i += cutlass::NumThreadsPerWarp) {
          const int h = i / tail;
          lse_b[int64_t(h) * v.max_q + done + (i - h * tail)] = -INFINITY;
        }
        if (skip == 0) continue;
        const bool bad = bad_count(v, b);
        const float lse_fill = bad ? NAN : -INFINITY;
        for (int i = lane; i < skip * heads; i += cutlass::NumThreadsPerWarp) {
          const int h = i / skip;
          lse_b[int64_t(h) * v.max_q + (i - h * skip)] = lse_fill;
        }
        // O rows slot_q[b] .. + skip - 1 of every head, 16 bytes at a time (the kernel's O rows are
        // 16-byte aligned, the head dim a multiple of 8).
        using Out = OutputOf<typename Mainloop::Element>;
        constexpr int kChunks = Epilogue::kCols * int(sizeof(Out)) / 16;
        const Out fill = bad ? Out(NAN) : Out(0.f);
        uint4 chunk;
        Out* parts = reinterpret_cast<Out*>(&chunk);
        CUTLASS_PRAGMA_UNROLL
        for (int e = 0; e < int(16 / sizeof(Out)); ++e) parts[e] = fill;
        auto const& dO = params.epilogue.dO;
        Out* o_b = params.epilogue.ptr_O + int64_t(v.slot_q[b]) * get<0>(dO);
        for (int64_t i = lane; i < int64_t(skip) * heads * kChunks; i += cutlass::NumThreadsPerWarp) {
          const int64_t row = i / (heads * kChunks);
          const int rest = int(i - row * heads * kChunks), h = rest / kChunks, c = rest - h * kChunks;
          *reinterpret_cast<uint4*>(o_b + row * get<0>(dO) + int64_t(h) * get<1>(get<2>(dO)) +
                                    c * int(16 / sizeof(Out))) = chunk;
        }
      }
    }
  }

  CUTLASS_DEVICE void operator()(const Params& params, char* smem) {
    constexpr int kThreads = cutlass::NumThreadsPerWarpGroup;
    enum { kLoadKV = 1, kLoadQ = 2, kTails = 3 };  // producer warps; warp 0 idle, 3 too at fixed lengths
    auto& storage = *reinterpret_cast<SharedStorage*>(smem);
    const int warp = cutlass::canonical_warp_idx_sync();
    const int warp_in_group = warp % cutlass::NumWarpsPerWarpGroup;
    const int group = cutlass::canonical_warp_group_idx();  // 0 producer, 1 and 2 consumers
    const int consumer = group - 1;
    const int leader = cute::elect_one_sync();

    if (warp == 0 && leader) {
      Mainloop::prefetch_tma_descriptors(params.mainloop);
      Epilogue::prefetch_tma_descriptor(params.epilogue);
    }

    typename PipeQ::Params q_params;  // one or two Q stages per consumer group (q_buffers)
    q_params.transaction_bytes = Mainloop::kOuterLoadBytes;
    q_params.is_leader = leader && group == 0 && warp_in_group == kLoadQ;
    q_params.num_consumers = kThreads;
    typename PipeKV::Params kv_params;  // K and V stages, read by both consumer groups
    kv_params.transaction_bytes = Mainloop::kInnerLoadBytes;
    kv_params.is_leader = leader && group == 0 && warp_in_group == kLoadKV;
    kv_params.num_consumers = kGroups * kThreads;
    typename PipeUnused::Params unused_params;
    unused_params.producer_arv_count = kGroups * kThreads;
    unused_params.consumer_arv_count = cutlass::NumThreadsPerWarp;
    if (group == 0) {
      if (warp_in_group == kLoadKV) kv_params.role = PipeKV::ThreadCategory::Producer;
      if (warp_in_group == kLoadQ) q_params.role = PipeQ::ThreadCategory::Producer;
      unused_params.role = PipeUnused::ThreadCategory::Consumer;
    } else {
      kv_params.role = PipeKV::ThreadCategory::Consumer;
      q_params.role = PipeQ::ThreadCategory::Consumer;
      unused_params.role = PipeUnused::ThreadCategory::Producer;
    }
    PipeQ pipe_q(storage.pipeline_storage_outer, q_params, Shape<_1, _1, _1>{});
    PipeKV pipe_kv(storage.pipeline_storage_inner, kv_params, Shape<_1, _1, _1>{});
    PipeUnused pipe_unused(storage.pipeline_storage_reducer, unused_params);
    typename Base::MathWarpGroupOrderBarrier::Params order_params;
    order_params.group_id = consumer;
    order_params.group_size = kThreads;
    typename Base::MathWarpGroupOrderBarrier order(storage.math_wg_order, order_params);
    if (warp == 0 && leader) storage.load_warp_barrier.init(2 * cutlass::NumThreadsPerWarp);  // K/V and Q warps
    cutlass::arch::fence_barrier_init();
    __syncthreads();  // pipelines and barriers initialized before any use

    Scheduler scheduler{params.tile_scheduler};
    Mainloop mainloop;
    if (group == 0) {
      cutlass::arch::warpgroup_reg_dealloc<Base::LoadRegisterRequirement>();
      auto write_q = cutlass::make_producer_start_state<PipeQ>();
      auto write_kv = cutlass::make_producer_start_state<PipeKV>();
      bool first = true;  // the K/V and Q warps meet once, after the first Q load is issued
      if (warp_in_group == kLoadKV && kVarlen) {
        // Key counts on the GPU or not: two loops, so that the packed loads without them keep the
        // registers they had (the producer runs on LoadRegisterRequirement of them).
        if (used_k_of(params) != nullptr) {
          load_kv_items<true>(scheduler, params, pipe_kv, write_kv, storage);
        } else {
          load_kv_items<false>(scheduler, params, pipe_kv, write_kv, storage);
        }
      } else if (warp_in_group == kLoadKV) {
        for (; scheduler.is_valid(); ++scheduler, first = false) {
          auto kv_blk = scheduler.get_block_coord();
          get<1>(get<2>(kv_blk)) /= params.kv_group;  // this query head's K/V head
          if constexpr (kWindow || kBias) {
            set_bias_slot(params, scheduler.get_block_coord(), 0);  // a sorted bias's listed key tiles
            load_kv(scheduler.get_block_coord(), kv_blk, params, pipe_kv, write_kv, storage.tensors.mainloop,
                    storage.load_warp_barrier, first);
          } else {
            mainloop.template load_kv_maybe_q<false>(0, kv_blk, params.mainloop, params.problem_size, pipe_kv,
                                                     write_kv, pipe_q, write_q, storage.tensors.mainloop,
                                                     storage.load_warp_barrier, first);
          }
        }
      } else if (warp_in_group == kLoadQ) {
        for (; scheduler.is_valid(); ++scheduler, first = false) {
          if constexpr (kVarlen) {
            auto blk = scheduler.get_block_coord();
            load_q_packed(blk, place_item(params, blk), params, pipe_q, write_q, storage.tensors.mainloop,
                          storage.load_warp_barrier, first);
          } else {
            mainloop.load_maybe_q(scheduler.get_block_coord(), params.mainloop, params.problem_size, pipe_q,
                                  write_q, storage.tensors.mainloop, storage.load_warp_barrier, first);
          }
        }
      } else if (warp_in_group == kTails && kVarlen) {
        write_tails(params);
      }
      return;
    }

    cutlass::arch::warpgroup_reg_alloc<Base::MmaRegisterRequirement>();
    typename Base::PipelineStateOuter read_q;
    typename Base::PipelineStateInner read_kv;
    auto write_unused = cutlass::make_producer_start_state<PipeUnused>();
    Epilogue epilogue;
    for (; scheduler.is_valid(); ++scheduler) {
      auto blk = scheduler.get_block_coord();
      auto group_blk = blk;  // this group's 64 rows of the row tile
      get<0>(group_blk) = kGroups * get<0>(blk) + consumer;
      // The tile's problem: the call's, or a packed sequence's own (its first row at q_row0).
      auto problem = fusion_problem(params);
      auto out_problem = params.problem_size;
      int q_row0 = -1;
      if constexpr (kVarlen) {
        const Placed at = place_item(params, blk);
        problem = item_fusion_problem(params, at);
        out_problem = item_problem(params, at);
        q_row0 = at.q_row0;
      }
      set_bias_slot(params, blk, consumer);  // (the trip counts of a sorted bias read it)
      read_q.advance(consumer);  // Q stages go to the groups in turn, a tile's kGroups at a time
      if (get<0>(group_blk) * kGroupRows >= get<2>(out_problem)) {
        skip(blk, problem, pipe_kv, read_kv, pipe_q, read_q, order);
        read_q.advance(kGroups - consumer);
        continue;
      }
      if constexpr (kFp8) {  // this warp's slot: set after its last tile's reads, read after this write
        __syncwarp();
        if (cute::elect_one_sync()) tile_factors() = factors_of(params, blk);
        __syncwarp();
      }
      if constexpr (kDropout) {  // likewise: the row tile's (batch, query head) in the Philox stream
        __syncwarp();
        if (cute::elect_one_sync()) {
          const philox::Mask& d = params.dropout;
          tile_dropout() = TileDropout{d.seed, d.head_base(get<0>(get<2>(blk)), get<1>(get<2>(blk))), d.seqlen_k,
                                       d.threshold};
        }
        __syncwarp();
      }
      auto result = mainloop.compute(blk, group_blk, params.mainloop, problem, pipe_kv, read_kv, pipe_q, read_q,
                                     pipe_unused, write_unused, storage.tensors.mainloop, order);
      read_q.advance(kGroups - consumer);
      int lse_row0 = 0;  // key counts on the GPU: the rows before the work rows (varlen.h)
      if constexpr (kVarlen) {
        if (used_k_of(params) != nullptr) lse_row0 = q_row0 - params.tile_scheduler.varlen.slot_q[get<0>(get<2>(blk))];
      }
      epilogue(group_blk, result, typename Mainloop::TiledMmaPV{}, out_problem, params.epilogue,
               storage.tensors.epilogue[consumer], q_row0, lse_row0);
    }
    Epilogue::drain();
  }
};

}  // namespace gemmgen::fmha_sm90
