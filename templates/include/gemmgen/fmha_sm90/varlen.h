// Packed sequences of different lengths (cu_seqlens) in the persistent schedule of the fmha_sm90
// family: where each sequence lies, the row tiles of all of them as one list of work items, and the
// LSE rows no tile writes.
//
// The kernel's Q, K, V and O descriptors span the packed tensors ([total rows, H, d]); a work item
// (row tile m of sequence b, head h) reads and writes at the sequence's first rows, and its
// mainloop and mask see a problem of the sequence's own lengths, so the key tiles past its end are
// masked as the last key tile of any call is, and the causal diagonal sits where that problem's
// lengths put it (bottom-right: len_k - len_q; top-left: the keys past len_q are not read).
//
// Contract (the caller checks it on the offsets; gemmgen's selection sends other calls to a family
// that runs them): every sequence with queries has keys, and with a causal mask or a sliding window
// at least as many keys as queries. A sequence outside it gets no work item: its O rows are left as
// they were. A window's offsets move to each sequence's diagonal (persistent.h).
//
// Key counts on the GPU (`used_k`, a contiguous key-value cache: sequence b's keys are the first
// used_k[b] rows of its cu_seqlens_k slot, its queries its cu_seqlens_q slot) have no contract:
// lengths live on the device and are never read back. A small kernel (place_counted) writes each
// sequence's work rows and keys as begin / end arrays, which the kernel then places as any packed
// sequence: the rows of sequence b that see no key (all of them without keys; with a bottom-right
// causal mask the first len_q - used_k[b] when it holds fewer keys than queries) are left out of its
// work rows, and a count outside [0, its key slot] leaves none. Those rows get O = 0 and LSE = -inf,
// or NaN for a bad count, as the decode family's kernels give them, from the producer's spare warp
// (persistent.h).
#pragma once
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"

namespace gemmgen::fmha_sm90 {

// What a variable-length call hands the persistent kernel (cu_q NULL: fixed lengths).
struct Varlen {
  const int* cu_q = nullptr;   // [batch] first rows of the sequences in the packed Q and O
  const int* cu_k = nullptr;   // [batch] in the packed K and V (packed sequences: cu_seqlens)
  const int* end_q = nullptr;  // [batch] their ends (packed sequences: cu_seqlens + 1)
  const int* end_k = nullptr;
  int batch = 0;               // sequences
  int max_q = 0, max_k = 0;    // the maxima: LSE rows per (sequence, head); lengths are clamped to them
  int align = 0;               // causal: 1 bottom-right within each sequence, 0 top-left
  // Key counts on the GPU: [batch] keys of each sequence (NULL: none), and the caller's [batch + 1]
  // offsets, its slots (cu_q .. end_k are then place_counted's work rows and keys).
  const int* used_k = nullptr;
  const int* slot_q = nullptr;
  const int* slot_k = nullptr;
};

// Sequence b as one work item's mainloop sees it.
struct Placed {
  int q_row0 = 0, k_row0 = 0;  // first rows in the packed tensors
  int len_q = 0;               // query rows (0: no work item)
  int keys = 0;                // the problem's seqlen_k: keys the mask may show (causal: len_q + offset)
};

CUTLASS_DEVICE int clamp_len(int len, int most) { return len < 0 ? 0 : len > most ? most : len; }

template <bool Causal, bool Local = false>
CUTLASS_DEVICE Placed place(Varlen const& v, int b) {
  Placed s;
  s.q_row0 = v.cu_q[b];
  s.k_row0 = v.cu_k[b];
  const int len_q = clamp_len(v.end_q[b] - s.q_row0, v.max_q);
  const int len_k = clamp_len(v.end_k[b] - s.k_row0, v.max_k);
  s.keys = Causal && !v.align ? len_q : len_k;
  // Outside the contract: no work item (a causal or window problem needs keys >= rows, so that each
  // row sees its diagonal key; any problem a key).
  s.len_q = (len_k == 0 || ((Causal || Local) && len_k < len_q)) ? 0 : len_q;
  return s;
}

// Key counts on the GPU: the caller's slots (slot_q, slot_k: [batch + 1] offsets) and counts
// (used_k) as Varlen's work rows and keys (`rows`: [4][batch] ints, cu_q, end_q, cu_k, end_k); one
// thread per sequence.
CUTLASS_DEVICE int slot_keys(Varlen const& v, int b) { return clamp_len(v.slot_k[b + 1] - v.slot_k[b], v.max_k); }
CUTLASS_DEVICE bool bad_count(Varlen const& v, int b) { return v.used_k[b] < 0 || v.used_k[b] > slot_keys(v, b); }

template <bool Causal>
__global__ void place_counted(Varlen v, int* rows) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= v.batch) return;
  const int q0 = v.slot_q[b], k0 = v.slot_k[b], len_q = clamp_len(v.slot_q[b + 1] - q0, v.max_q);
  const int used = v.used_k[b];
  const bool bad = bad_count(v, b);
  // Bottom-right, row i sees keys j <= i + used - len_q: the first len_q - used rows see none.
  const int blind = bad || used == 0 ? len_q : Causal && used < len_q ? len_q - used : 0;
  rows[b] = q0 + blind;
  rows[v.batch + b] = q0 + len_q;
  rows[2 * v.batch + b] = k0;
  rows[3 * v.batch + b] = k0 + (bad ? 0 : used);
}

// The packed kernel's tile scheduler: the row tiles of every (sequence, head) in one list, sequence
// by sequence and head by head within it (the CTAs running at one time share a few heads' K and V in
// L2), handed to the CTAs in a static round robin over an SM-sized grid. Causal row tiles go in
// pairs within a sequence (tile i with tile m - 1 - i, the longer first), as PairedScheduler's.
template <bool Causal, int BlockM, bool Local = false>
struct VarlenScheduler {
  struct Params {
    Varlen varlen;  // set at launch
    int heads = 0;
    int sm_count = 0;
  };

  Params const* p;
  int item;          // work item (a row tile, or a pair of them) in the list
  int b = 0;         // its sequence
  int base = 0;      // the sequence's first item
  int per_head = 0;  // items per head of the sequence
  int tiles = 0;     // row tiles per head of the sequence
  bool second = false;

  CUTLASS_DEVICE VarlenScheduler(Params const& params) : p(&params), item(blockIdx.x) { seek(); }

  template <class ProblemSize, class ClusterShape, class TileShape>
  static Params to_underlying_arguments(ProblemSize const& problem_size, cutlass::KernelHardwareInfo hw_info,
                                        ClusterShape const&, TileShape const&) {
    return Params{Varlen{}, int(cute::get<1>(problem_size)), hw_info.sm_count};
  }

  static dim3 get_grid_shape(Params const& params) { return dim3(params.sm_count, 1, 1); }

  CUTLASS_DEVICE static Placed place_of(Varlen const& v, int b) { return place<Causal, Local>(v, b); }

  // Moves b and base forward to the sequence holding `item` (items only grow).
  CUTLASS_DEVICE void seek() {
    for (; b < p->varlen.batch; ++b) {
      tiles = cute::ceil_div(place<Causal, Local>(p->varlen, b).len_q, BlockM);
      per_head = Causal ? (tiles + 1) / 2 : tiles;
      if (item < base + per_head * p->heads) return;
      base += per_head * p->heads;
    }
  }

  CUTLASS_DEVICE bool is_valid() { return b < p->varlen.batch; }

  CUTLASS_DEVICE auto get_block_coord() {
    const int rel = item - base;
    const int h = rel / per_head, t = rel - h * per_head;
    const int m = Causal && !second ? tiles - 1 - t : t;
    return cute::make_coord(m, cute::_0{}, cute::make_coord(b, h));
  }

  CUTLASS_DEVICE VarlenScheduler& operator++() {
    const int t = (item - base) % per_head;
    if (Causal && !second && t != tiles - 1 - t) {
      second = true;
    } else {
      second = false;
      item += gridDim.x;
      seek();
    }
    return *this;
  }
};

}  // namespace gemmgen::fmha_sm90
