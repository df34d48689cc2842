// Where one sequence of an attention call lies, for kernels that run fixed and variable lengths
// alike (GemmgenAttnParams and GemmgenAttnBwdParams have the fields read here).
//
// Fixed lengths (cu_seqlens_q NULL): sequence b is batch b, seqlen_q x seqlen_k, placed by the
// batch strides. Variable lengths: rows cu_seqlens_q[b] to cu_seqlens_q[b + 1] of the packed query
// tensors (cu_seqlens_k for the key tensors), the batch strides unused; seqlen_q and seqlen_k are
// then the maxima, which size the grid and the LSE rows. The causal diagonal (and a window's) sits
// at causal_offset, shifted by the sequence's len_k - len_q when align_per_sequence is set (the
// bottom-right alignment within each sequence).
#pragma once
#include <cstdint>

namespace gemmgen {

struct Sequence {
  int b;
  bool varlen;
  int64_t q_row0, k_row0;  // the first query and key rows (variable lengths; 0 for fixed ones)
  int seqlen_q, seqlen_k;
  int64_t causal_offset;  // key j visible to query i iff j <= i + causal_offset (a window around it)

  // Element offset of this sequence's first row in a query-side (q, o, dO, dQ) or key-side (k, v,
  // dK, dV) tensor with these strides.
  __device__ __forceinline__ int64_t q_start(int64_t batch_stride, int64_t row_stride) const {
    return varlen ? q_row0 * row_stride : int64_t(b) * batch_stride;
  }
  __device__ __forceinline__ int64_t k_start(int64_t batch_stride, int64_t row_stride) const {
    return varlen ? k_row0 * row_stride : int64_t(b) * batch_stride;
  }
};

__device__ __forceinline__ int clamp_length(int64_t len, int max_len) {
  return int(len < 0 ? 0 : len > max_len ? max_len : len);
}

template <class Params>
__device__ __forceinline__ Sequence sequence_of(Params const& p, int b) {
  Sequence s;
  s.b = b;
  s.varlen = p.cu_seqlens_q != nullptr;
  s.causal_offset = p.causal_offset;
  if (!s.varlen) {
    s.q_row0 = s.k_row0 = 0;
    s.seqlen_q = p.seqlen_q;
    s.seqlen_k = p.seqlen_k;
    return s;
  }
  s.q_row0 = p.cu_seqlens_q[b];
  s.k_row0 = p.cu_seqlens_k[b];
  // Within [0, the maxima]: the grids cover no more (the caller checks the offsets; this keeps a bad
  // array, where nothing checked it, inside the rows the launch was sized for).
  s.seqlen_q = clamp_length(p.cu_seqlens_q[b + 1] - s.q_row0, p.seqlen_q);
  s.seqlen_k = clamp_length(p.cu_seqlens_k[b + 1] - s.k_row0, p.seqlen_k);
  if (p.align_per_sequence) s.causal_offset += s.seqlen_k - s.seqlen_q;
  return s;
}

}  // namespace gemmgen
