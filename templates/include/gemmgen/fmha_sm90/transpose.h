// V transposed for the fp8 instances: wgmma reads 8-bit operands from shared memory K-major only,
// and the K mode of P V is the keys, so these instances read V as [B, Hkv, d, Nk] with the keys
// contiguous. The caller's V ([B, Hkv, Nk, d] by its strides) is copied into that layout in the
// call's workspace before the attention kernel, one 64-key x 64-column tile per CTA through shared
// memory: 16-byte loads along d, 16-byte stores along the keys.
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

namespace gemmgen::fmha_sm90 {

constexpr int kTransposeTile = 64;  // keys and head-dim columns per CTA
constexpr int kTransposeThreads = 256;

// The transposed V's row pitch: keys rounded up to 16 (a TMA descriptor's strides are multiples of
// 16 bytes). Keys past seqlen_k in a row are never read (the descriptor's extent is seqlen_k).
inline int64_t transposed_pitch(int64_t seqlen_k) { return (seqlen_k + 15) / 16 * 16; }

// grid: (batch * heads_kv * key tiles, d / 64). v: row stride sn, head stride sh, batch stride sb
// (elements = bytes), 16-byte aligned rows; vt: [batch * heads_kv, d, pitch].
__global__ void __launch_bounds__(kTransposeThreads) transpose_v(const uint8_t* __restrict__ v, int64_t sb,
                                                                 int64_t sh, int64_t sn, int heads_kv, int seqlen_k,
                                                                 int d, int64_t pitch, int key_tiles,
                                                                 uint8_t* __restrict__ vt) {
  __shared__ uint8_t tile[kTransposeTile][kTransposeTile + 4];  // [key][column]
  const int bh = blockIdx.x / key_tiles, b = bh / heads_kv, h = bh - b * heads_kv;
  const int key0 = (blockIdx.x - bh * key_tiles) * kTransposeTile, col0 = blockIdx.y * kTransposeTile;
  const int t = threadIdx.x;
  {  // load: thread t reads 16 columns of key t / 4
    const int key = key0 + t / 4, col = col0 + (t % 4) * 16;
    uint4 chunk = make_uint4(0, 0, 0, 0);
    if (key < seqlen_k) chunk = *reinterpret_cast<const uint4*>(v + b * sb + h * sh + int64_t(key) * sn + col);
    const uint8_t* bytes = reinterpret_cast<const uint8_t*>(&chunk);
#pragma unroll
    for (int i = 0; i < 16; ++i) tile[t / 4][(t % 4) * 16 + i] = bytes[i];
  }
  __syncthreads();
  {  // store: thread t writes 16 keys of column t / 4
    const int col = t / 4, k16 = (t % 4) * 16, key = key0 + k16;
    if (key >= pitch) return;
    uint4 chunk;
    uint8_t* bytes = reinterpret_cast<uint8_t*>(&chunk);
#pragma unroll
    for (int i = 0; i < 16; ++i) bytes[i] = tile[k16 + i][col];
    *reinterpret_cast<uint4*>(vt + (int64_t(bh) * d + col0 + col) * pitch + key) = chunk;
  }
}

// Launches transpose_v for all of V (d a multiple of 64).
inline cudaError_t launch_transpose_v(const void* v, int64_t sb, int64_t sh, int64_t sn, int batch, int heads_kv,
                                      int seqlen_k, int d, void* vt, cudaStream_t stream) {
  const int64_t pitch = transposed_pitch(seqlen_k);
  const int key_tiles = static_cast<int>((pitch + kTransposeTile - 1) / kTransposeTile);
  dim3 grid(static_cast<unsigned>(int64_t(batch) * heads_kv * key_tiles), static_cast<unsigned>(d / kTransposeTile));
  transpose_v<<<grid, kTransposeThreads, 0, stream>>>(static_cast<const uint8_t*>(v), sb, sh, sn, heads_kv, seqlen_k, d,
                                                      pitch, key_tiles, static_cast<uint8_t*>(vt));
  return cudaGetLastError();
}

}  // namespace gemmgen::fmha_sm90
