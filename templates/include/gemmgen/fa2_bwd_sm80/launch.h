// Host side of the fa2_bwd_sm80 family: checks the params an instance cannot run, cuts the caller's
// workspace (the same plan for <symbol>_workspace and the run) and launches prep, backward and
// convert on the caller's stream. Errors come back as a status and a message, never as a crash.
#pragma once
#include <cmath>
#include <cstdint>

#include <cuda_runtime.h>

#include "gemmgen/abi.h"
#include "gemmgen/fa2_bwd_sm80/kernel.h"
#include "gemmgen/fa2_sm80/checks.h"
#include "gemmgen/report.h"
#include "gemmgen/smem.h"

namespace gemmgen::fa2_bwd_sm80 {

constexpr int64_t kMaxGridYZ = 65535;     // CUDA's limit on grid.y and grid.z
constexpr int64_t kWorkspaceAlign = 256;  // the C ABI's workspace alignment; every part starts on it
constexpr int kRowsPerAuxBlock = 8;       // prep and convert: one warp per row, 8 warps per block

inline int64_t align_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

struct Plan {
  int64_t rows_padded, off_dq, off_lse, off_d, off_turns, bytes;
};

template <class Traits, bool Softcap>
int check(const GemmgenAttnBwdParams* p, char* err, int err_len) {
  constexpr int kD = Traits::kHeadDim;
  if (p->head_dim != kD) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "head_dim %d, this instance runs %d", p->head_dim, kD);
  }
  if (p->batch < 1 || p->heads < 1 || p->heads_kv < 1 || p->seqlen_q < 1 || p->seqlen_k < 1 ||
      p->heads % p->heads_kv != 0) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  "bad sizes: batch %d heads %d heads_kv %d seqlen_q %d seqlen_k %d", p->batch, p->heads, p->heads_kv,
                  p->seqlen_q, p->seqlen_k);
  }
  if (p->bias != nullptr || p->dbias != nullptr || p->dropout_p != 0.f) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "this family runs no bias or dropout");
  }
  if (p->local != 0 && (p->window_left < -1 || p->window_right < -1)) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "window (%d, %d): each side is -1 (unbounded) or >= 0",
                  p->window_left, p->window_right);
  }
  if (int status = fa2_sm80::check_varlen(p, err, err_len)) return status;
  if (Softcap ? !(p->softcap > 0.f && p->softcap < INFINITY) : p->softcap != 0.f) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  Softcap ? "softcap %g: this instance runs a finite logit softcap > 0"
                          : "softcap %g: this instance runs no logit softcap (one built for it does)",
                  p->softcap);
  }
  const void* required[] = {p->q, p->k, p->v, p->o, p->d_o, p->lse, p->dq, p->dk, p->dv};
  for (const void* ptr : required) {
    if (ptr == nullptr) {
      return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "q, k, v, o, d_o, lse, dq, dk and dv must be set");
    }
  }
  const void* data[] = {p->q, p->k, p->v, p->o, p->d_o, p->dq, p->dk, p->dv};
  for (const void* ptr : data) {
    if (reinterpret_cast<uintptr_t>(ptr) % 16) {
      return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "a data pointer is not 16-byte aligned");
    }
  }
  if (reinterpret_cast<uintptr_t>(p->lse) % sizeof(float)) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "lse is not 4-byte aligned");
  }
  // 16-byte row vectors: every stride a multiple of 16 bytes, except that of a dim of extent 1,
  // which the kernels never step along.
  constexpr int kAlign = 16 / int(sizeof(typename Traits::Element));
  struct Stride {
    const char* name;
    int64_t stride, extent;
  };
  const int64_t b = p->batch, h = p->heads, hkv = p->heads_kv, nq = p->seqlen_q, nk = p->seqlen_k;
  const Stride strides[] = {
      {"q", p->q_batch_stride, b},   {"q", p->q_head_stride, h},     {"q", p->q_row_stride, nq},
      {"k", p->k_batch_stride, b},   {"k", p->k_head_stride, hkv},   {"k", p->k_row_stride, nk},
      {"v", p->v_batch_stride, b},   {"v", p->v_head_stride, hkv},   {"v", p->v_row_stride, nk},
      {"o", p->o_batch_stride, b},   {"o", p->o_head_stride, h},     {"o", p->o_row_stride, nq},
      {"d_o", p->do_batch_stride, b}, {"d_o", p->do_head_stride, h}, {"d_o", p->do_row_stride, nq},
      {"dq", p->dq_batch_stride, b}, {"dq", p->dq_head_stride, h},   {"dq", p->dq_row_stride, nq},
      {"dk", p->dk_batch_stride, b}, {"dk", p->dk_head_stride, h},   {"dk", p->dk_row_stride, nk},
      {"dv", p->dv_batch_stride, b}, {"dv", p->dv_head_stride, h},   {"dv", p->dv_row_stride, nk}};
  for (const Stride& s : strides) {
    if (s.extent > 1 && s.stride % kAlign) {
      return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                    "%s: stride %lld is not a multiple of %d elements (16-byte rows)", s.name,
                    static_cast<long long>(s.stride), kAlign);
    }
  }
  return GEMMGEN_OK;
}

template <class Traits, bool Softcap>
int make_plan(const GemmgenAttnBwdParams* p, Plan* plan, char* err, int err_len) {
  if (int status = check<Traits, Softcap>(p, err, err_len)) return status;
  const int64_t heads = int64_t(p->batch) * p->heads;
  if (heads > kMaxGridYZ * kMaxGridYZ) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "batch*heads %lld exceeds %lld",
                  static_cast<long long>(heads), static_cast<long long>(kMaxGridYZ * kMaxGridYZ));
  }
  const int64_t blocks = (p->seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN * heads;
  if (p->deterministic && blocks > INT32_MAX) {  // the deterministic grid is one-dimensional
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "deterministic: %lld blocks exceed CUDA's %d",
                  static_cast<long long>(blocks), INT32_MAX);
  }
  Plan out;
  out.rows_padded = align_up(p->seqlen_q, Traits::kBlockM);
  int64_t at = 0;
  auto part = [&](int64_t bytes) {
    const int64_t offset = at;
    at = align_up(at + bytes, kWorkspaceAlign);
    return offset;
  };
  out.off_dq = part(heads * out.rows_padded * Traits::kHeadDim * int64_t(sizeof(float)));
  out.off_lse = part(heads * out.rows_padded * int64_t(sizeof(float)));
  out.off_d = part(heads * out.rows_padded * int64_t(sizeof(float)));
  // Deterministic calls: a turn counter per query tile.
  out.off_turns = p->deterministic ? part(heads * (out.rows_padded / Traits::kBlockM) * int64_t(sizeof(int))) : 0;
  out.bytes = at;
  *plan = out;
  return GEMMGEN_OK;
}

// Bytes of workspace `p` needs; 0 for params the instance rejects (the run call says why).
template <class Traits, bool Softcap>
int64_t workspace(const GemmgenAttnBwdParams* p) {
  Plan plan;
  if (p == nullptr || make_plan<Traits, Softcap>(p, &plan, nullptr, 0) != GEMMGEN_OK) return 0;
  return plan.bytes;
}

inline int launch_error(char* err, int err_len, const char* what) {
  cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return GEMMGEN_OK;
  return report(err, err_len, GEMMGEN_CUDA_ERROR, "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
}

template <class Traits, bool Softcap>
int run(const GemmgenAttnBwdParams* p, cudaStream_t stream, char* err, int err_len) {
  if (p == nullptr) return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "params is NULL");
  Plan plan;
  if (int status = make_plan<Traits, Softcap>(p, &plan, err, err_len)) return status;
  if (p->workspace == nullptr || p->workspace_bytes < plan.bytes ||
      reinterpret_cast<uintptr_t>(p->workspace) % kWorkspaceAlign) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  "workspace %p of %lld bytes: this call needs %lld bytes, %lld-byte aligned (<symbol>_workspace)",
                  p->workspace, static_cast<long long>(p->workspace_bytes), static_cast<long long>(plan.bytes),
                  static_cast<long long>(kWorkspaceAlign));
  }
  constexpr int kSmem = Traits::kSmemSize;
  if (int status = opt_in_smem<&bwd_kernel<Traits, Softcap>>(kSmem, err, err_len)) return status;
  char* ws = static_cast<char*>(p->workspace);
  Args args{*p, Workspace{reinterpret_cast<float*>(ws + plan.off_dq), reinterpret_cast<float*>(ws + plan.off_lse),
                          reinterpret_cast<float*>(ws + plan.off_d), reinterpret_cast<int*>(ws + plan.off_turns),
                          plan.rows_padded}};
  const int64_t heads = int64_t(p->batch) * p->heads;
  const unsigned grid_y = unsigned(heads < kMaxGridYZ ? heads : kMaxGridYZ);
  const unsigned grid_z = unsigned((heads + grid_y - 1) / grid_y);
  const unsigned prep_blocks = unsigned((plan.rows_padded + kRowsPerAuxBlock - 1) / kRowsPerAuxBlock);
  prep_kernel<Traits><<<dim3(prep_blocks, grid_y, grid_z), 32 * kRowsPerAuxBlock, 0, stream>>>(args);
  if (int status = launch_error(err, err_len, "prep kernel launch")) return status;
  const int64_t key_tiles = (p->seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN;
  if (p->deterministic) {  // one block per (key tile, batch * head), batch * head fastest (kernel.h)
    bwd_kernel<Traits, Softcap><<<unsigned(key_tiles * heads), Traits::kNThreads, kSmem, stream>>>(args);
  } else {
    bwd_kernel<Traits, Softcap><<<dim3(unsigned(key_tiles), grid_y, grid_z), Traits::kNThreads, kSmem, stream>>>(args);
  }
  if (int status = launch_error(err, err_len, "backward kernel launch")) return status;
  const unsigned convert_blocks = unsigned((p->seqlen_q + kRowsPerAuxBlock - 1) / kRowsPerAuxBlock);
  convert_kernel<Traits><<<dim3(convert_blocks, grid_y, grid_z), 32 * kRowsPerAuxBlock, 0, stream>>>(args);
  return launch_error(err, err_len, "convert kernel launch");
}

template <class Traits>
int info(GemmgenInstanceInfo* out) {
  // Both masks (causal_offset decides per call): causal is reported false.
  return instance_info(out, Traits::kHeadDim, Traits::kBlockM, Traits::kBlockN, Traits::kNThreads, Traits::kSmemSize,
                       /*causal=*/false, GEMMGEN_INFO_BACKWARD | GEMMGEN_INFO_READS_GQA);
}

}  // namespace gemmgen::fa2_bwd_sm80
