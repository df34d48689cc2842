// Host-side checks that every launch of a kernel on fa2_sm80's tiles starts with (fa2_sm80's own
// and decode_sm80's, and fa2_bwd_sm80's variable lengths): the params are there, hold the
// instance's head dim, and describe sizes the kernels index. Errors come back as a status and a message.
#pragma once

#include "gemmgen/abi.h"
#include "gemmgen/report.h"

namespace gemmgen::fa2_sm80 {

// `min_seqlen_k`: the fewest keys a call may have (decode_sm80 runs caches that hold none yet).
// The query heads must be a whole number of groups per key/value head.
template <int HeadDim>
int check_sizes(const GemmgenAttnParams* p, int min_seqlen_k, char* err, int err_len) {
  if (p == nullptr) return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "params is NULL");
  if (p->head_dim != HeadDim) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "head_dim %d, this instance runs %d", p->head_dim,
                  HeadDim);
  }
  if (p->batch < 1 || p->heads < 1 || p->heads_kv < 1 || p->seqlen_q < 1 || p->seqlen_k < min_seqlen_k ||
      p->heads % p->heads_kv != 0) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  "bad sizes: batch %d heads %d heads_kv %d seqlen_q %d seqlen_k %d",
                  p->batch, p->heads, p->heads_kv, p->seqlen_q, p->seqlen_k);
  }
  return GEMMGEN_OK;
}

// Variable lengths: both offset arrays or neither; the per-sequence alignment only with them.
template <class Params>
int check_varlen(const Params* p, char* err, int err_len) {
  if ((p->cu_seqlens_q == nullptr) != (p->cu_seqlens_k == nullptr)) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "variable lengths need both cu_seqlens_q and cu_seqlens_k");
  }
  if (p->align_per_sequence != 0 && p->cu_seqlens_q == nullptr) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  "align_per_sequence aligns the sequences of variable lengths: cu_seqlens are NULL");
  }
  return GEMMGEN_OK;
}

}  // namespace gemmgen::fa2_sm80
