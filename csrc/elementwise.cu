// Elementwise in-place kernels: average, add, subtract, addmul, scale, divide, the async
// model average update and the low-precision decentralized diff. Each loads its operands as
// fp32, applies one function of baguahvd_math.cuh and rounds once to the storage dtype.
// Grid: grid_blocks(n) blocks of kThreads threads, grid-stride loop (unrolled_loop).
#include "baguahvd_math.cuh"

namespace bhvd {

__device__ __forceinline__ long long first_index() {
  return static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ long long grid_stride() {
  return static_cast<long long>(blockDim.x) * gridDim.x;
}

// out[i] = compute(i) for every i < n, rounded once to T. out may be an operand of compute:
// every element is read before it is written, by the same thread (unrolled_loop).
template <class T, class Compute>
__device__ __forceinline__ void elementwise(typename T::storage* out, long long n,
                                            Compute compute) {
  unrolled_loop(first_index(), grid_stride(), n, compute,
                [out](long long i, float value) { out[i] = T::store(value); });
}

template <class T>
__device__ void average_body(typename T::storage* x, const typename T::storage* y, long long n) {
  elementwise<T>(x, n, [=](long long i) { return average_op(T::load(x[i]), T::load(y[i])); });
}

template <class T>
__device__ void add_body(typename T::storage* x, const typename T::storage* y, long long n) {
  elementwise<T>(x, n, [=](long long i) { return add_op(T::load(x[i]), T::load(y[i])); });
}

template <class T>
__device__ void subtract_body(typename T::storage* x, const typename T::storage* y,
                              long long n) {
  elementwise<T>(x, n, [=](long long i) { return subtract_op(T::load(x[i]), T::load(y[i])); });
}

template <class T>
__device__ void addmul_body(typename T::storage* x, const typename T::storage* y, float factor,
                            long long n) {
  elementwise<T>(x, n, [=](long long i) {
    return addmul_op(T::load(x[i]), T::load(y[i]), factor);
  });
}

template <class T>
__device__ void scale_body(typename T::storage* x, float factor, long long n) {
  elementwise<T>(x, n, [=](long long i) { return scale_op(T::load(x[i]), factor); });
}

template <class T>
__device__ void divide_body(typename T::storage* x, float divisor, long long n) {
  elementwise<T>(x, n, [=](long long i) { return divide_op(T::load(x[i]), divisor); });
}

template <class T>
__device__ void async_model_average_body(typename T::storage* w,
                                         const typename T::storage* reduced,
                                         const typename T::storage* snapshot, float nranks,
                                         long long n) {
  elementwise<T>(w, n, [=](long long i) {
    return async_model_average_op(T::load(w[i]), T::load(reduced[i]), T::load(snapshot[i]),
                                  nranks);
  });
}

template <class T>
__device__ void lowprec_diff_body(typename T::storage* x, const typename T::storage* w,
                                  const typename T::storage* left,
                                  const typename T::storage* right, long long n) {
  elementwise<T>(x, n, [=](long long i) {
    return lowprec_diff_op(T::load(x[i]), T::load(w[i]), T::load(left[i]), T::load(right[i]));
  });
}

}  // namespace bhvd

#define BHVD_ELEMENTWISE_KERNELS(SUFFIX, TRAITS)                                              \
  extern "C" __global__ void __launch_bounds__(bhvd::kThreads) average_inplace_##SUFFIX(      \
      bhvd::TRAITS::storage* x, const bhvd::TRAITS::storage* y, long long n) {                \
    bhvd::average_body<bhvd::TRAITS>(x, y, n);                                                \
  }                                                                                           \
  extern "C" __global__ void __launch_bounds__(bhvd::kThreads) add_inplace_##SUFFIX(          \
      bhvd::TRAITS::storage* x, const bhvd::TRAITS::storage* y, long long n) {                \
    bhvd::add_body<bhvd::TRAITS>(x, y, n);                                                    \
  }                                                                                           \
  extern "C" __global__ void __launch_bounds__(bhvd::kThreads) subtract_inplace_##SUFFIX(     \
      bhvd::TRAITS::storage* x, const bhvd::TRAITS::storage* y, long long n) {                \
    bhvd::subtract_body<bhvd::TRAITS>(x, y, n);                                               \
  }                                                                                           \
  extern "C" __global__ void __launch_bounds__(bhvd::kThreads) addmul_inplace_##SUFFIX(       \
      bhvd::TRAITS::storage* x, const bhvd::TRAITS::storage* y, float factor, long long n) {  \
    bhvd::addmul_body<bhvd::TRAITS>(x, y, factor, n);                                         \
  }                                                                                           \
  extern "C" __global__ void __launch_bounds__(bhvd::kThreads) scale_inplace_##SUFFIX(        \
      bhvd::TRAITS::storage* x, float factor, long long n) {                                  \
    bhvd::scale_body<bhvd::TRAITS>(x, factor, n);                                             \
  }                                                                                           \
  extern "C" __global__ void __launch_bounds__(bhvd::kThreads) divide_inplace_##SUFFIX(       \
      bhvd::TRAITS::storage* x, float divisor, long long n) {                                 \
    bhvd::divide_body<bhvd::TRAITS>(x, divisor, n);                                           \
  }                                                                                           \
  extern "C" __global__ void __launch_bounds__(bhvd::kThreads) async_model_average_##SUFFIX(  \
      bhvd::TRAITS::storage* w, const bhvd::TRAITS::storage* reduced,                         \
      const bhvd::TRAITS::storage* snapshot, float nranks, long long n) {                     \
    bhvd::async_model_average_body<bhvd::TRAITS>(w, reduced, snapshot, nranks, n);            \
  }                                                                                           \
  extern "C" __global__ void __launch_bounds__(bhvd::kThreads)                                \
      lowprec_decentralized_diff_##SUFFIX(                                                    \
          bhvd::TRAITS::storage* x, const bhvd::TRAITS::storage* w,                           \
          const bhvd::TRAITS::storage* left, const bhvd::TRAITS::storage* right,              \
          long long n) {                                                                      \
    bhvd::lowprec_diff_body<bhvd::TRAITS>(x, w, left, right, n);                              \
  }

BHVD_ELEMENTWISE_KERNELS(f32, F32)
BHVD_ELEMENTWISE_KERNELS(f16, F16)
BHVD_ELEMENTWISE_KERNELS(bf16, BF16)

#undef BHVD_ELEMENTWISE_KERNELS

#ifndef BAGUAHVD_NVRTC
// Host launchers for a library build: explicit stream, launch status returned, no
// synchronization. Half and bfloat16 tensors are passed as their raw 16-bit words.
#include <cuda_runtime.h>

namespace bhvd {

inline unsigned int elementwise_blocks(long long n) {
  return static_cast<unsigned int>(grid_blocks(n));
}

}  // namespace bhvd

#define BHVD_ELEMENTWISE_LAUNCHERS(SUFFIX, TRAITS)                                            \
  extern "C" cudaError_t baguahvd_average_inplace_##SUFFIX(                                   \
      bhvd::TRAITS::storage* x, const bhvd::TRAITS::storage* y, long long n,                  \
      cudaStream_t stream) {                                                                  \
    average_inplace_##SUFFIX<<<bhvd::elementwise_blocks(n), bhvd::kThreads, 0, stream>>>(     \
        x, y, n);                                                                             \
    return cudaGetLastError();                                                                \
  }                                                                                           \
  extern "C" cudaError_t baguahvd_add_inplace_##SUFFIX(                                       \
      bhvd::TRAITS::storage* x, const bhvd::TRAITS::storage* y, long long n,                  \
      cudaStream_t stream) {                                                                  \
    add_inplace_##SUFFIX<<<bhvd::elementwise_blocks(n), bhvd::kThreads, 0, stream>>>(x, y,    \
                                                                                     n);      \
    return cudaGetLastError();                                                                \
  }                                                                                           \
  extern "C" cudaError_t baguahvd_subtract_inplace_##SUFFIX(                                  \
      bhvd::TRAITS::storage* x, const bhvd::TRAITS::storage* y, long long n,                  \
      cudaStream_t stream) {                                                                  \
    subtract_inplace_##SUFFIX<<<bhvd::elementwise_blocks(n), bhvd::kThreads, 0, stream>>>(    \
        x, y, n);                                                                             \
    return cudaGetLastError();                                                                \
  }                                                                                           \
  extern "C" cudaError_t baguahvd_addmul_inplace_##SUFFIX(                                    \
      bhvd::TRAITS::storage* x, const bhvd::TRAITS::storage* y, float factor, long long n,    \
      cudaStream_t stream) {                                                                  \
    addmul_inplace_##SUFFIX<<<bhvd::elementwise_blocks(n), bhvd::kThreads, 0, stream>>>(      \
        x, y, factor, n);                                                                     \
    return cudaGetLastError();                                                                \
  }                                                                                           \
  extern "C" cudaError_t baguahvd_scale_inplace_##SUFFIX(                                     \
      bhvd::TRAITS::storage* x, float factor, long long n, cudaStream_t stream) {             \
    scale_inplace_##SUFFIX<<<bhvd::elementwise_blocks(n), bhvd::kThreads, 0, stream>>>(       \
        x, factor, n);                                                                        \
    return cudaGetLastError();                                                                \
  }                                                                                           \
  extern "C" cudaError_t baguahvd_divide_inplace_##SUFFIX(                                    \
      bhvd::TRAITS::storage* x, float divisor, long long n, cudaStream_t stream) {            \
    divide_inplace_##SUFFIX<<<bhvd::elementwise_blocks(n), bhvd::kThreads, 0, stream>>>(      \
        x, divisor, n);                                                                       \
    return cudaGetLastError();                                                                \
  }                                                                                           \
  extern "C" cudaError_t baguahvd_async_model_average_##SUFFIX(                               \
      bhvd::TRAITS::storage* w, const bhvd::TRAITS::storage* reduced,                         \
      const bhvd::TRAITS::storage* snapshot, float nranks, long long n,                       \
      cudaStream_t stream) {                                                                  \
    async_model_average_##SUFFIX<<<bhvd::elementwise_blocks(n), bhvd::kThreads, 0, stream>>>( \
        w, reduced, snapshot, nranks, n);                                                     \
    return cudaGetLastError();                                                                \
  }                                                                                           \
  extern "C" cudaError_t baguahvd_lowprec_decentralized_diff_##SUFFIX(                        \
      bhvd::TRAITS::storage* x, const bhvd::TRAITS::storage* w,                               \
      const bhvd::TRAITS::storage* left, const bhvd::TRAITS::storage* right, long long n,     \
      cudaStream_t stream) {                                                                  \
    lowprec_decentralized_diff_##SUFFIX<<<bhvd::elementwise_blocks(n), bhvd::kThreads, 0,     \
                                          stream>>>(x, w, left, right, n);                    \
    return cudaGetLastError();                                                                \
  }

BHVD_ELEMENTWISE_LAUNCHERS(f32, F32)
BHVD_ELEMENTWISE_LAUNCHERS(f16, F16)
BHVD_ELEMENTWISE_LAUNCHERS(bf16, BF16)

#undef BHVD_ELEMENTWISE_LAUNCHERS

#endif  // BAGUAHVD_NVRTC
