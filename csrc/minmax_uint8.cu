// MinMaxUInt8 compression kernels: compress, decompress, decompress-and-add,
// decompress-and-reduce, and the fp32-accumulating chunk reduction of ByteGrad.
// The format and the per-element math live in baguahvd_math.cuh.
//
// Compressing takes three launches on one stream:
//   1. minmax_uint8_partial_<dt>  grid (B, k), kThreads: block b of chunk j reduces part of it
//                                 into workspace[2 * (j * B + b) + {0, 1}]
//   2. minmax_uint8_header_<dt>   grid (k), kHeaderThreads: finishes min/max, writes the header
//   3. compress_minmax_uint8_<dt> grid (X, k), kThreads: writes codes and zero padding
// where k is the number of chunks being compressed (all n, or the one target chunk), chunk j
// being first_chunk + blockIdx.y, B = minmax_blocks_per_chunk(C), X = grid_blocks(S - 32).
#include "baguahvd_math.cuh"

namespace bhvd {

// A thread's first index and the stride of a grid-stride loop along one row (blockIdx.y) of
// a two-dimensional grid.
__device__ __forceinline__ long long first_in_row() {
  return static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ long long row_stride() {
  return static_cast<long long>(blockDim.x) * gridDim.x;
}

// Chunks whose quantization parameters decompress_reduce keeps in shared memory (12 bytes
// each): one per rank of any group up to this size.
constexpr int kCachedChunks = 1024;

template <class T>
__device__ void minmax_partial_body(const typename T::storage* x, long long numel,
                                    long long chunk, int first_chunk, float* partial) {
  __shared__ float s_lo[kThreads];
  __shared__ float s_hi[kThreads];
  __shared__ int s_bad[kThreads];

  const long long j = first_chunk + static_cast<long long>(blockIdx.y);
  const long long begin = j * chunk;
  const long long end = begin + chunk_valid(numel, chunk, j);
  // 16-byte loads from the chunk's first 16-byte boundary on (see minmax_share).
  const MinMax m = minmax_share<T>(
      x, begin, end, static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x,
      static_cast<long long>(blockDim.x) * gridDim.x);

  const int t = threadIdx.x;
  s_lo[t] = m.lo;
  s_hi[t] = m.hi;
  s_bad[t] = m.bad ? 1 : 0;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half >>= 1) {
    if (t < half) {
      s_lo[t] = s_lo[t + half] < s_lo[t] ? s_lo[t + half] : s_lo[t];
      s_hi[t] = s_hi[t + half] > s_hi[t] ? s_hi[t + half] : s_hi[t];
      s_bad[t] |= s_bad[t + half];
    }
    __syncthreads();
  }
  if (t == 0) {
    MinMax r;
    r.lo = s_lo[0];
    r.hi = s_hi[0];
    r.bad = s_bad[0] != 0;
    float* out = partial + 2LL * (static_cast<long long>(blockIdx.y) * gridDim.x + blockIdx.x);
    out[0] = minmax_partial_lo(r);
    out[1] = r.hi;
  }
}

template <class T>
__device__ void minmax_header_body(const float* partial, int blocks_per_chunk, long long numel,
                                   long long chunk, int first_chunk, unsigned char* out,
                                   long long slot) {
  const int lane = threadIdx.x;
  const long long j = first_chunk + static_cast<long long>(blockIdx.x);
  const float* p = partial + 2LL * blockIdx.x * blocks_per_chunk;
  MinMax m = minmax_empty();
  for (int b = lane; b < blocks_per_chunk; b += kHeaderThreads) {
    minmax_merge(m, minmax_from_partial(p[2 * b], p[2 * b + 1]));
  }
  for (int offset = kHeaderThreads / 2; offset > 0; offset >>= 1) {
    MinMax o;
    o.lo = __shfl_down_sync(0xffffffffu, m.lo, offset);
    o.hi = __shfl_down_sync(0xffffffffu, m.hi, offset);
    o.bad = __shfl_down_sync(0xffffffffu, m.bad ? 1 : 0, offset) != 0;
    minmax_merge(m, o);
  }
  m.lo = __shfl_sync(0xffffffffu, m.lo, 0);
  m.hi = __shfl_sync(0xffffffffu, m.hi, 0);
  m.bad = __shfl_sync(0xffffffffu, m.bad ? 1 : 0, 0) != 0;
  const HeaderWords h = header_words<T>(m, chunk_valid(numel, chunk, j));
  out[j * slot + lane] = header_byte<T>(h, lane);
}

template <class T>
__device__ void compress_body(const typename T::storage* x, long long numel, long long chunk,
                              int first_chunk, unsigned char* out, long long slot) {
  const long long j = first_chunk + static_cast<long long>(blockIdx.y);
  unsigned char* s = out + j * slot;
  const QuantParams p = slot_params<T>(s);
  const long long begin = j * chunk;
  const long long valid = chunk_valid(numel, chunk, j);
  const long long code_bytes = slot - kHeaderBytes;
  unrolled_loop(
      first_in_row(), row_stride(), code_bytes,
      [=](long long i) -> unsigned char {
        return i < valid ? quantize(T::load(x[begin + i]), p) : 0;
      },
      [s](long long i, unsigned char code) { s[kHeaderBytes + i] = code; });
}

// The quantization parameters of one chunk's slot, read from its header and derived by one
// thread of the block, shared with the others. Decoding keeps the division by the scale: a
// multiplication by its reciprocal rounds differently (about a quarter of the codes decode
// one ulp apart), and the torch implementation is the oracle bit for bit.
template <class T>
__device__ QuantParams block_slot_params(const unsigned char* slot) {
  __shared__ QuantParams s_params;
  if (threadIdx.x == 0) {
    s_params = slot_params<T>(slot);
  }
  __syncthreads();
  return s_params;
}

template <class T>
__device__ void decompress_body(const unsigned char* buf, long long numel, long long chunk,
                                long long slot, typename T::storage* out) {
  const long long j = blockIdx.y;
  const unsigned char* s = buf + j * slot;
  const QuantParams p = block_slot_params<T>(s);
  const long long begin = j * chunk;
  const long long valid = chunk_valid(numel, chunk, j);
  unrolled_loop(
      first_in_row(), row_stride(), valid,
      [=](long long i) { return dequantize(s[kHeaderBytes + i], p); },
      [=](long long i, float value) { out[begin + i] = T::store(value); });
}

// inout += decompress(buf), the decoded value rounded to T first so that this equals
// decompress followed by add_inplace.
template <class T>
__device__ void decompress_add_body(const unsigned char* buf, long long numel, long long chunk,
                                    long long slot, typename T::storage* inout) {
  const long long j = blockIdx.y;
  const unsigned char* s = buf + j * slot;
  const QuantParams p = block_slot_params<T>(s);
  const long long begin = j * chunk;
  const long long valid = chunk_valid(numel, chunk, j);
  unrolled_loop(
      first_in_row(), row_stride(), valid,
      [=](long long i) {
        const float d = round_to<T>(dequantize(s[kHeaderBytes + i], p));
        return add_op(T::load(inout[begin + i]), d);
      },
      [=](long long i, float value) { inout[begin + i] = T::store(value); });
}

// out[i] = pairwise sum over the n full chunks of round_to<T>(decoded element i), divided by
// n when averaging. Equals decompress followed by reduce_chunks.
// The block first derives the parameters of the first kCachedChunks chunks from their
// headers into shared memory, each chunk by one thread; every element then reads them from
// there (chunks past kCachedChunks, only in groups that large, derive theirs per element).
template <class T>
__device__ void decompress_reduce_body(const unsigned char* buf, int n_chunks, long long chunk,
                                       long long slot, int average, typename T::storage* out) {
  __shared__ QuantParams s_params[kCachedChunks];
  const int cached = n_chunks < kCachedChunks ? n_chunks : kCachedChunks;
  for (int j = threadIdx.x; j < cached; j += blockDim.x) {
    s_params[j] = slot_params<T>(buf + j * slot);
  }
  __syncthreads();
  const long long stride = static_cast<long long>(blockDim.x) * gridDim.x;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < chunk;
       i += stride) {
    const float sum = pairwise_sum(n_chunks, [&](int j) {
      const unsigned char* s = buf + j * slot;
      const QuantParams p = j < cached ? s_params[j] : slot_params<T>(s);
      return round_to<T>(dequantize(s[kHeaderBytes + i], p));
    });
    out[i] = T::store(finish_reduce(sum, n_chunks, average != 0));
  }
}

// out[i] = pairwise sum over chunks j of x[j * chunk + i] (divided by n when averaging).
// out may be one of the chunks of x: every thread reads its whole column before writing.
template <class T>
__device__ void reduce_chunks_body(const typename T::storage* x, int n_chunks, long long chunk,
                                   int average, typename T::storage* out) {
  const long long stride = static_cast<long long>(blockDim.x) * gridDim.x;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < chunk;
       i += stride) {
    const float sum = pairwise_sum(n_chunks, [&](int j) { return T::load(x[j * chunk + i]); });
    out[i] = T::store(finish_reduce(sum, n_chunks, average != 0));
  }
}

}  // namespace bhvd

#define BHVD_MINMAX_KERNELS(SUFFIX, TRAITS)                                                   \
  extern "C" __global__ void __launch_bounds__(bhvd::kThreads)                                \
      minmax_uint8_partial_##SUFFIX(const bhvd::TRAITS::storage* x, long long numel,          \
                                    long long chunk, int first_chunk, float* partial) {       \
    bhvd::minmax_partial_body<bhvd::TRAITS>(x, numel, chunk, first_chunk, partial);           \
  }                                                                                           \
  extern "C" __global__ void __launch_bounds__(bhvd::kHeaderThreads)                          \
      minmax_uint8_header_##SUFFIX(const float* partial, int blocks_per_chunk,                \
                                   long long numel, long long chunk, int first_chunk,         \
                                   unsigned char* out, long long slot) {                      \
    bhvd::minmax_header_body<bhvd::TRAITS>(partial, blocks_per_chunk, numel, chunk,           \
                                           first_chunk, out, slot);                           \
  }                                                                                           \
  extern "C" __global__ void __launch_bounds__(bhvd::kThreads)                                \
      compress_minmax_uint8_##SUFFIX(const bhvd::TRAITS::storage* x, long long numel,         \
                                     long long chunk, int first_chunk, unsigned char* out,    \
                                     long long slot) {                                        \
    bhvd::compress_body<bhvd::TRAITS>(x, numel, chunk, first_chunk, out, slot);               \
  }                                                                                           \
  extern "C" __global__ void __launch_bounds__(bhvd::kThreads)                                \
      decompress_minmax_uint8_##SUFFIX(const unsigned char* buf, long long numel,             \
                                       long long chunk, long long slot,                       \
                                       bhvd::TRAITS::storage* out) {                          \
    bhvd::decompress_body<bhvd::TRAITS>(buf, numel, chunk, slot, out);                        \
  }                                                                                           \
  extern "C" __global__ void __launch_bounds__(bhvd::kThreads)                                \
      decompress_add_minmax_uint8_##SUFFIX(const unsigned char* buf, long long numel,         \
                                           long long chunk, long long slot,                   \
                                           bhvd::TRAITS::storage* inout) {                    \
    bhvd::decompress_add_body<bhvd::TRAITS>(buf, numel, chunk, slot, inout);                  \
  }                                                                                           \
  extern "C" __global__ void __launch_bounds__(bhvd::kThreads)                                \
      decompress_reduce_minmax_uint8_##SUFFIX(const unsigned char* buf, int n_chunks,         \
                                              long long chunk, long long slot, int average,   \
                                              bhvd::TRAITS::storage* out) {                   \
    bhvd::decompress_reduce_body<bhvd::TRAITS>(buf, n_chunks, chunk, slot, average, out);     \
  }                                                                                           \
  extern "C" __global__ void __launch_bounds__(bhvd::kThreads)                                \
      reduce_chunks_##SUFFIX(const bhvd::TRAITS::storage* x, int n_chunks, long long chunk,   \
                             int average, bhvd::TRAITS::storage* out) {                       \
    bhvd::reduce_chunks_body<bhvd::TRAITS>(x, n_chunks, chunk, average, out);                 \
  }

BHVD_MINMAX_KERNELS(f32, F32)
BHVD_MINMAX_KERNELS(f16, F16)
BHVD_MINMAX_KERNELS(bf16, BF16)

#undef BHVD_MINMAX_KERNELS

#ifndef BAGUAHVD_NVRTC
// Host launchers for a library build. Every launcher takes its stream explicitly, returns the
// launch status and never synchronizes. Half and bfloat16 tensors are passed as their raw
// 16-bit words. n_chunks must be in [1, 65535]. target_chunk = -1 compresses every chunk;
// otherwise only that chunk's slot in out is written and the other slots are left untouched.
// The compress workspace holds baguahvd_minmax_uint8_workspace_bytes(...) bytes of device
// memory, aligned to 4 bytes, and must not be reused before the launch has completed.
#include <cuda_runtime.h>

namespace bhvd {

struct CompressGeometry {
  long long chunk;
  long long slot;
  int first;
  unsigned int chunks;          // grid y: chunks being compressed
  unsigned int partial_blocks;  // grid x of the min/max first pass
  unsigned int code_blocks;     // grid x of the code pass
};

inline bool compress_geometry(long long numel, int n_chunks, int target_chunk,
                              CompressGeometry* g) {
  if (numel < 0 || n_chunks < 1 || n_chunks > 65535 || target_chunk >= n_chunks) {
    return false;
  }
  g->chunk = chunk_elements(numel, n_chunks);
  g->slot = slot_bytes(g->chunk);
  g->first = target_chunk < 0 ? 0 : target_chunk;
  g->chunks = static_cast<unsigned int>(target_chunk < 0 ? n_chunks : 1);
  g->partial_blocks = static_cast<unsigned int>(minmax_blocks_per_chunk(g->chunk));
  g->code_blocks = static_cast<unsigned int>(grid_blocks(g->slot - kHeaderBytes));
  return true;
}

inline bool chunk_geometry(long long numel, int n_chunks, long long* chunk, long long* slot) {
  if (numel < 0 || n_chunks < 1 || n_chunks > 65535) {
    return false;
  }
  *chunk = chunk_elements(numel, n_chunks);
  *slot = slot_bytes(*chunk);
  return true;
}

}  // namespace bhvd

extern "C" long long baguahvd_minmax_uint8_workspace_bytes(long long numel, int n_chunks,
                                                           int target_chunk) {
  bhvd::CompressGeometry g;
  if (!bhvd::compress_geometry(numel, n_chunks, target_chunk, &g)) {
    return -1;
  }
  return 2LL * static_cast<long long>(sizeof(float)) * g.chunks * g.partial_blocks;
}

#define BHVD_MINMAX_LAUNCHERS(SUFFIX, TRAITS)                                                 \
  extern "C" cudaError_t baguahvd_compress_minmax_uint8_##SUFFIX(                             \
      const bhvd::TRAITS::storage* x, long long numel, int n_chunks, int target_chunk,        \
      unsigned char* out, float* workspace, cudaStream_t stream) {                            \
    bhvd::CompressGeometry g;                                                                 \
    if (!bhvd::compress_geometry(numel, n_chunks, target_chunk, &g)) {                        \
      return cudaErrorInvalidValue;                                                           \
    }                                                                                         \
    minmax_uint8_partial_##SUFFIX<<<dim3(g.partial_blocks, g.chunks), bhvd::kThreads, 0,      \
                                    stream>>>(x, numel, g.chunk, g.first, workspace);         \
    minmax_uint8_header_##SUFFIX<<<g.chunks, bhvd::kHeaderThreads, 0, stream>>>(              \
        workspace, static_cast<int>(g.partial_blocks), numel, g.chunk, g.first, out, g.slot); \
    compress_minmax_uint8_##SUFFIX<<<dim3(g.code_blocks, g.chunks), bhvd::kThreads, 0,        \
                                     stream>>>(x, numel, g.chunk, g.first, out, g.slot);      \
    return cudaGetLastError();                                                                \
  }                                                                                           \
  extern "C" cudaError_t baguahvd_decompress_minmax_uint8_##SUFFIX(                           \
      const unsigned char* buf, long long numel, int n_chunks, bhvd::TRAITS::storage* out,    \
      cudaStream_t stream) {                                                                  \
    long long chunk, slot;                                                                    \
    if (!bhvd::chunk_geometry(numel, n_chunks, &chunk, &slot)) {                              \
      return cudaErrorInvalidValue;                                                           \
    }                                                                                         \
    const dim3 grid(static_cast<unsigned int>(bhvd::grid_blocks(chunk)),                      \
                    static_cast<unsigned int>(n_chunks));                                     \
    decompress_minmax_uint8_##SUFFIX<<<grid, bhvd::kThreads, 0, stream>>>(buf, numel, chunk,  \
                                                                          slot, out);         \
    return cudaGetLastError();                                                                \
  }                                                                                           \
  extern "C" cudaError_t baguahvd_decompress_add_minmax_uint8_##SUFFIX(                       \
      const unsigned char* buf, long long numel, int n_chunks, bhvd::TRAITS::storage* inout,  \
      cudaStream_t stream) {                                                                  \
    long long chunk, slot;                                                                    \
    if (!bhvd::chunk_geometry(numel, n_chunks, &chunk, &slot)) {                              \
      return cudaErrorInvalidValue;                                                           \
    }                                                                                         \
    const dim3 grid(static_cast<unsigned int>(bhvd::grid_blocks(chunk)),                      \
                    static_cast<unsigned int>(n_chunks));                                     \
    decompress_add_minmax_uint8_##SUFFIX<<<grid, bhvd::kThreads, 0, stream>>>(                \
        buf, numel, chunk, slot, inout);                                                      \
    return cudaGetLastError();                                                                \
  }                                                                                           \
  extern "C" cudaError_t baguahvd_decompress_reduce_minmax_uint8_##SUFFIX(                    \
      const unsigned char* buf, long long numel, int n_chunks, int average,                   \
      bhvd::TRAITS::storage* out, cudaStream_t stream) {                                      \
    long long chunk, slot;                                                                    \
    if (!bhvd::chunk_geometry(numel, n_chunks, &chunk, &slot) ||                              \
        chunk * n_chunks != numel) {                                                          \
      return cudaErrorInvalidValue;                                                           \
    }                                                                                         \
    decompress_reduce_minmax_uint8_##SUFFIX<<<static_cast<unsigned int>(                      \
                                                  bhvd::grid_blocks(chunk)),                  \
                                              bhvd::kThreads, 0, stream>>>(                   \
        buf, n_chunks, chunk, slot, average, out);                                            \
    return cudaGetLastError();                                                                \
  }                                                                                           \
  extern "C" cudaError_t baguahvd_reduce_chunks_##SUFFIX(                                     \
      const bhvd::TRAITS::storage* x, long long numel, int n_chunks, int average,             \
      bhvd::TRAITS::storage* out, cudaStream_t stream) {                                      \
    long long chunk, slot;                                                                    \
    if (!bhvd::chunk_geometry(numel, n_chunks, &chunk, &slot) ||                              \
        chunk * n_chunks != numel) {                                                          \
      return cudaErrorInvalidValue;                                                           \
    }                                                                                         \
    reduce_chunks_##SUFFIX<<<static_cast<unsigned int>(bhvd::grid_blocks(chunk)),             \
                             bhvd::kThreads, 0, stream>>>(x, n_chunks, chunk, average, out);  \
    return cudaGetLastError();                                                                \
  }

BHVD_MINMAX_LAUNCHERS(f32, F32)
BHVD_MINMAX_LAUNCHERS(f16, F16)
BHVD_MINMAX_LAUNCHERS(bf16, BF16)

#undef BHVD_MINMAX_LAUNCHERS

#endif  // BAGUAHVD_NVRTC
