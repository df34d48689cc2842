// The decode family's second entry point: new tokens' keys and values written into a key-value
// cache in place, at each sequence's current length, before attending.
//   int <symbol>_append(const GemmgenKvAppendArgs*, void* stream, char* err, int err_len);
// gemmgen/kernels/abi.py mirrors the struct (KvAppendArgs).
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

#include "gemmgen/abi.h"
#include "gemmgen/report.h"

typedef struct GemmgenKvAppendArgs {
  const void* k;  // [batch, new_tokens, heads_kv, head_dim] by its strides (last dim contiguous)
  const void* v;
  void* k_cache;  // [batch, capacity, ...] or [num_pages, page_size, ...] by its strides
  void* v_cache;
  const int32_t* seqlens;  // [batch]: rows already held; token t goes to row seqlens[b] + t
  const int32_t* block_table;  // as GemmgenAttnParams's; NULL: contiguous
  int64_t block_table_batch_stride;
  int32_t batch, new_tokens, heads_kv, head_dim;
  int32_t capacity;   // rows a sequence may hold (max_pages * page_size when paged)
  int32_t page_size;  // 0: contiguous
  int32_t num_pages;
  int32_t elem_bytes;  // 2
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  int64_t kc_batch_stride, kc_row_stride, kc_head_stride;  // batch or page stride first
  int64_t vc_batch_stride, vc_row_stride, vc_head_stride;
} GemmgenKvAppendArgs;

namespace gemmgen::decode_sm80 {

// One thread per 16-byte chunk of one new token's key and value row of one head. A sequence whose
// rows would fall outside [0, capacity) or on a page the cache does not have writes nothing (its
// attention then reports NaN rows: see the kernel's bad-length rule).
__global__ void append_kernel(const GemmgenKvAppendArgs a) {
  const int chunks = a.head_dim * a.elem_bytes / 16;
  const int64_t total = int64_t(a.batch) * a.new_tokens * a.heads_kv * chunks;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int c = int(i % chunks);
    const int h = int(i / chunks % a.heads_kv);
    const int t = int(i / (int64_t(chunks) * a.heads_kv) % a.new_tokens);
    const int b = int(i / (int64_t(chunks) * a.heads_kv * a.new_tokens));
    const int len = a.seqlens[b];
    if (len < 0 || int64_t(len) + a.new_tokens > a.capacity) continue;
    const int pos = len + t;
    int64_t page = b, row = pos;
    if (a.block_table != nullptr) {
      page = a.block_table[b * a.block_table_batch_stride + pos / a.page_size];
      row = pos % a.page_size;
      if (page < 0 || page >= a.num_pages) continue;
    }
    const int64_t col = int64_t(c) * 16;
    const char* k = static_cast<const char*>(a.k) + (b * a.k_batch_stride + t * a.k_row_stride + h * a.k_head_stride) * a.elem_bytes + col;
    const char* v = static_cast<const char*>(a.v) + (b * a.v_batch_stride + t * a.v_row_stride + h * a.v_head_stride) * a.elem_bytes + col;
    char* kc = static_cast<char*>(a.k_cache) + (page * a.kc_batch_stride + row * a.kc_row_stride + h * a.kc_head_stride) * a.elem_bytes + col;
    char* vc = static_cast<char*>(a.v_cache) + (page * a.vc_batch_stride + row * a.vc_row_stride + h * a.vc_head_stride) * a.elem_bytes + col;
    *reinterpret_cast<uint4*>(kc) = *reinterpret_cast<const uint4*>(k);
    *reinterpret_cast<uint4*>(vc) = *reinterpret_cast<const uint4*>(v);
  }
}

inline int append(const GemmgenKvAppendArgs* a, cudaStream_t stream, char* err, int err_len) {
  if (a == nullptr) return report(err, err_len, GEMMGEN_INVALID_ARGUMENT, "args is NULL");
  if (a->batch < 0 || a->new_tokens < 0 || a->heads_kv < 1 || a->elem_bytes != 2 || a->head_dim % 8 != 0 ||
      (a->block_table != nullptr && (a->page_size < 1 || a->num_pages < 1))) {
    return report(err, err_len, GEMMGEN_INVALID_ARGUMENT,
                  "bad append sizes: batch %d new_tokens %d heads_kv %d head_dim %d page_size %d", a->batch,
                  a->new_tokens, a->heads_kv, a->head_dim, a->page_size);
  }
  const int64_t total = int64_t(a->batch) * a->new_tokens * a->heads_kv * (a->head_dim / 8);
  if (total == 0) return GEMMGEN_OK;
  const int64_t blocks = (total + 255) / 256;
  append_kernel<<<static_cast<unsigned>(blocks < 65536 ? blocks : 65536), 256, 0, stream>>>(*a);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    return report(err, err_len, GEMMGEN_CUDA_ERROR, "append launch: %s (%s)", cudaGetErrorString(e),
                  cudaGetErrorName(e));
  }
  return GEMMGEN_OK;
}

}  // namespace gemmgen::decode_sm80
