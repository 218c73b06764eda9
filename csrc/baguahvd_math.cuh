// Per-element math shared by the CUDA kernels, the host test harness and (by
// construction, not by code) the torch fallback in baguahvd/kernels/torch_impl.py.
//
// Everything here compiles three ways: with nvcc (host and device passes), with NVRTC
// (BAGUAHVD_NVRTC, no standard headers) and with a plain C++17 host compiler. Results are
// bit-exact across the three because every float operation is a single, explicitly rounded
// IEEE operation: on the device the _rn intrinsics stop nvcc from contracting a*b+c into an
// FMA, which the torch fallback cannot reproduce.
//
// MinMaxUInt8 in one paragraph: a flat tensor of N elements is cut into n chunks of
// C = ceil(N / n) elements (the last ones may be short or empty). Chunk j is stored in a slot
// of S = roundup(C, 32) + 32 bytes at byte j*S: min and max in the source dtype in the first
// 2*sizeof(T) bytes, zero up to byte 32, then one uint8 code per element, then zero padding.
// With scale = 255 / (max - min + 1e-7), upper = rint(max * scale), lower = upper - 255
// (all fp32, rint = round half to even), an element x gets the code
// q = saturate_u8(min(rint(x * scale), upper) - lower) and decodes to (q + lower) / scale.
//
// Non-finite policy (the format leaves it open, we fix it): a chunk holding any NaN or
// +-Inf stores NaN as both min and max, so all its codes are 0 and all its elements decode
// to NaN. An empty chunk stores min = max = 0. Signed zeros are stored as +0.
#pragma once

#if defined(__CUDACC__)
#define BHVD_HD __host__ __device__ __forceinline__
#else
#define BHVD_HD inline
#endif

#if !defined(__CUDACC_RTC__)
#include <cmath>
#include <cstring>
#endif

namespace bhvd {

// Launch geometry. baguahvd/kernels/cuda.py mirrors these numbers.
constexpr int kThreads = 256;           // threads per block of every kernel
constexpr int kHeaderThreads = 32;      // one warp writes one 32-byte chunk header
constexpr long long kMaxBlocks = 4096;  // grid-stride loops cover the rest
constexpr long long kMinMaxItemsPerThread = 16;
constexpr long long kMaxMinMaxBlocks = 128;  // per chunk, first pass of the min/max
constexpr long long kMinMaxBlocksPerSM = 8;   // 8 x 256 threads fill one SM

constexpr int kHeaderBytes = 32;
constexpr float kEps = 1e-7f;
constexpr float kLevels = 255.0f;

BHVD_HD long long ceil_div(long long a, long long b) { return (a + b - 1) / b; }

BHVD_HD long long clamp_ll(long long v, long long lo, long long hi) {
  return v < lo ? lo : (v > hi ? hi : v);
}

BHVD_HD long long grid_blocks(long long work) {
  return clamp_ll(ceil_div(work, kThreads), 1, kMaxBlocks);
}

// Elements a thread of a grid-stride loop has in flight per round (unrolled_loop).
constexpr int kUnroll = 4;

// "#pragma unroll" for the device pass only (a host compiler warns of an unknown pragma).
#if defined(__CUDA_ARCH__)
#define BHVD_UNROLL _Pragma("unroll")
#else
#define BHVD_UNROLL
#endif

// The grid-stride loop over [first, n) with stride `stride`, kUnroll elements per round:
// compute(i) runs for all of a round's elements before store(i, value) runs for any, so that
// a thread's loads are issued together instead of each waiting for the store before it
// (the compiler may not reorder a load past a store to memory it may alias). One element at
// a time leaves most of the memory bandwidth unused. A warp's accesses stay coalesced.
template <class Compute, class Store>
BHVD_HD void unrolled_loop(long long first, long long stride, long long n, Compute compute,
                           Store store) {
  using Value = decltype(compute(first));
  for (long long base = first; base < n; base += stride * kUnroll) {
    Value v[kUnroll] = {};
    BHVD_UNROLL
    for (int k = 0; k < kUnroll; ++k) {
      const long long i = base + k * stride;
      if (i < n) {
        v[k] = compute(i);
      }
    }
    BHVD_UNROLL
    for (int k = 0; k < kUnroll; ++k) {
      const long long i = base + k * stride;
      if (i < n) {
        store(i, v[k]);
      }
    }
  }
}

// Blocks per chunk of the min/max first pass: enough to cover the chunk, capped at
// kMaxMinMaxBlocks or, when the device's SM count is known, at what fills the device
// across the rows (chunks) of the launch.
BHVD_HD long long minmax_blocks_per_chunk(long long chunk, long long rows = 1,
                                          long long sm_count = 0) {
  const long long fill = ceil_div(sm_count * kMinMaxBlocksPerSM, rows < 1 ? 1 : rows);
  const long long cap = fill > kMaxMinMaxBlocks ? fill : kMaxMinMaxBlocks;
  return clamp_ll(ceil_div(chunk, kThreads * kMinMaxItemsPerThread), 1, cap);
}

// ---- layout -------------------------------------------------------------------------------

BHVD_HD long long chunk_elements(long long numel, long long n_chunks) {
  return ceil_div(numel, n_chunks);
}

BHVD_HD long long slot_bytes(long long chunk) {
  return ceil_div(chunk, kHeaderBytes) * kHeaderBytes + kHeaderBytes;
}

// Elements of chunk j that exist in a tensor of numel elements (0 for a trailing empty chunk).
BHVD_HD long long chunk_valid(long long numel, long long chunk, long long j) {
  return clamp_ll(numel - j * chunk, 0, chunk);
}

// ---- explicitly rounded fp32 arithmetic -------------------------------------------------

BHVD_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

BHVD_HD float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

BHVD_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

BHVD_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// Round to nearest integer, ties to even (the default rounding mode on host and device).
BHVD_HD float rint_even(float x) {
#if defined(__CUDA_ARCH__)
  return rintf(x);
#else
  return std::rint(x);
#endif
}

BHVD_HD unsigned int float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  unsigned int u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

BHVD_HD float bits_to_float(unsigned int u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

BHVD_HD bool is_finite(float x) { return (float_to_bits(x) & 0x7f800000u) != 0x7f800000u; }

BHVD_HD float quiet_nan() { return bits_to_float(0x7fc00000u); }
BHVD_HD float pos_inf() { return bits_to_float(0x7f800000u); }

// ---- fp16 / bf16 conversions (round to nearest even) -------------------------------------
// The host versions are the reference; the device uses the hardware conversion, which rounds
// the same way (NaN payloads may differ, which no caller depends on).

BHVD_HD unsigned short float_to_half_bits_soft(float f) {
  const unsigned int x = float_to_bits(f);
  const unsigned short sign = static_cast<unsigned short>((x >> 16) & 0x8000u);
  const unsigned int ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) {  // Inf stays Inf, NaN becomes the canonical quiet NaN
    return static_cast<unsigned short>(sign | (ax > 0x7f800000u ? 0x7e00u : 0x7c00u));
  }
  if (ax >= 0x477ff000u) {  // >= 65520 rounds to Inf
    return static_cast<unsigned short>(sign | 0x7c00u);
  }
  if (ax < 0x38800000u) {  // below 2^-14: a subnormal half is rint(|f| * 2^24) units of 2^-24
    const float units = rint_even(mul_rn(bits_to_float(ax), 16777216.0f));
    return static_cast<unsigned short>(sign | static_cast<unsigned short>(units));
  }
  // Normal: rebias the exponent by 127 - 15 and round the 13 dropped bits to even; a carry
  // out of the mantissa correctly bumps the exponent.
  const unsigned int odd = (ax >> 13) & 1u;
  const unsigned int r = ax - 0x38000000u + 0x0fffu + odd;
  return static_cast<unsigned short>(sign | (r >> 13));
}

BHVD_HD float half_bits_to_float_soft(unsigned short h) {
  const unsigned int sign = (static_cast<unsigned int>(h) & 0x8000u) << 16;
  const unsigned int exp = (h >> 10) & 0x1fu;
  const unsigned int mant = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: mant units of 2^-24, exact in fp32
    const float v = mul_rn(static_cast<float>(mant), 5.9604644775390625e-08f);
    return bits_to_float(float_to_bits(v) | sign);
  }
  if (exp == 31) {
    return bits_to_float(sign | 0x7f800000u | (mant << 13));
  }
  return bits_to_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

BHVD_HD unsigned short float_to_bf16_bits_soft(float f) {
  const unsigned int x = float_to_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) {
    return static_cast<unsigned short>((x >> 16) | 0x0040u);  // keep it a quiet NaN
  }
  const unsigned int r = x + 0x7fffu + ((x >> 16) & 1u);
  return static_cast<unsigned short>(r >> 16);
}

BHVD_HD float bf16_bits_to_float(unsigned short b) {
  return bits_to_float(static_cast<unsigned int>(b) << 16);
}

BHVD_HD unsigned short float_to_half_bits(float f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 530
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
#else
  return float_to_half_bits_soft(f);
#endif
}

BHVD_HD float half_bits_to_float(unsigned short h) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 530
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#else
  return half_bits_to_float_soft(h);
#endif
}

BHVD_HD unsigned short float_to_bf16_bits(float f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  unsigned short b;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(f));
  return b;
#else
  return float_to_bf16_bits_soft(f);
#endif
}

// ---- dtype traits: storage type, fp32 load/store, header encoding -------------------------

struct F32 {
  typedef float storage;
  static constexpr int kBytes = 4;
  static constexpr unsigned int kNanBits = 0x7fc00000u;
  static BHVD_HD float load(float v) { return v; }
  static BHVD_HD float store(float v) { return v; }
  static BHVD_HD unsigned int encode(float v) { return float_to_bits(v); }
  static BHVD_HD float decode(unsigned int bits) { return bits_to_float(bits); }
};

struct F16 {
  typedef unsigned short storage;
  static constexpr int kBytes = 2;
  static constexpr unsigned int kNanBits = 0x7e00u;
  static BHVD_HD float load(unsigned short v) { return half_bits_to_float(v); }
  static BHVD_HD unsigned short store(float v) { return float_to_half_bits(v); }
  static BHVD_HD unsigned int encode(float v) { return float_to_half_bits(v); }
  static BHVD_HD float decode(unsigned int bits) {
    return half_bits_to_float(static_cast<unsigned short>(bits));
  }
};

struct BF16 {
  typedef unsigned short storage;
  static constexpr int kBytes = 2;
  static constexpr unsigned int kNanBits = 0x7fc0u;
  static BHVD_HD float load(unsigned short v) { return bf16_bits_to_float(v); }
  static BHVD_HD unsigned short store(float v) { return float_to_bf16_bits(v); }
  static BHVD_HD unsigned int encode(float v) { return float_to_bf16_bits(v); }
  static BHVD_HD float decode(unsigned int bits) {
    return bf16_bits_to_float(static_cast<unsigned short>(bits));
  }
};

// Value as the storage dtype sees it: fp32 -> T -> fp32.
template <class T>
BHVD_HD float round_to(float v) {
  return T::load(T::store(v));
}

// ---- chunk min / max ----------------------------------------------------------------------

struct MinMax {
  float lo;
  float hi;
  bool bad;  // saw a NaN or an Inf
};

BHVD_HD MinMax minmax_empty() {
  MinMax m;
  m.lo = pos_inf();
  m.hi = -pos_inf();
  m.bad = false;
  return m;
}

BHVD_HD void minmax_push(MinMax& m, float x) {
  m.bad = m.bad || !is_finite(x);
  m.lo = x < m.lo ? x : m.lo;
  m.hi = x > m.hi ? x : m.hi;
}

BHVD_HD void minmax_merge(MinMax& m, const MinMax& o) {
  m.bad = m.bad || o.bad;
  m.lo = o.lo < m.lo ? o.lo : m.lo;
  m.hi = o.hi > m.hi ? o.hi : m.hi;
}

// A partial result travels through global memory as two floats; lo = NaN marks "bad".
BHVD_HD MinMax minmax_from_partial(float lo, float hi) {
  MinMax m;
  m.bad = lo != lo;
  m.lo = m.bad ? pos_inf() : lo;
  m.hi = hi;
  return m;
}

BHVD_HD float minmax_partial_lo(const MinMax& m) { return m.bad ? quiet_nan() : m.lo; }

// Sixteen bytes read at once: one 128-bit load on the device (read-only path), a copy on the
// host. p must be 16-byte aligned.
constexpr long long kVectorBytes = 16;

struct Words4 {
  unsigned int w[4];
};

BHVD_HD Words4 load_words4(const void* p) {
  Words4 r;
#if defined(__CUDA_ARCH__)
  const uint4 u = __ldg(static_cast<const uint4*>(p));
  r.w[0] = u.x;
  r.w[1] = u.y;
  r.w[2] = u.z;
  r.w[3] = u.w;
#else
  std::memcpy(r.w, p, sizeof r.w);
#endif
  return r;
}

// Pushes the elements held in 16 little-endian bytes (4 fp32 or 8 fp16/bf16 values).
template <class T>
BHVD_HD void minmax_push_words(MinMax& m, const Words4& v) {
  for (int k = 0; k < 4; ++k) {
    if constexpr (T::kBytes == 4) {
      minmax_push(m, T::decode(v.w[k]));
    } else {
      minmax_push(m, T::decode(v.w[k] & 0xffffu));
      minmax_push(m, T::decode(v.w[k] >> 16));
    }
  }
}

// Min/max of the share of x[begin, end) that worker `worker` of `workers` reads: the elements
// from the first 16-byte boundary on are read 16 bytes at a time (worker w takes vectors w,
// w + workers, ...), the scalar head before that boundary and the tail after the last whole
// vector element by element. The workers' shares cover every element once, whatever the
// alignment of x + begin; min and max do not depend on the order, so merging the shares
// gives the result of a scalar scan.
template <class T>
BHVD_HD MinMax minmax_share(const typename T::storage* x, long long begin, long long end,
                            long long worker, long long workers) {
  typedef typename T::storage S;
  constexpr long long kWidth = kVectorBytes / static_cast<long long>(sizeof(S));
  MinMax m = minmax_empty();
  const long long count = end > begin ? end - begin : 0;
  const S* p = x + begin;
  const unsigned long long address = reinterpret_cast<unsigned long long>(p);
  long long head = static_cast<long long>((kVectorBytes - address % kVectorBytes) %
                                          kVectorBytes) / static_cast<long long>(sizeof(S));
  if (address % sizeof(S) != 0 || head > count) {
    head = count;  // no element starts on a 16-byte boundary: scalar only
  }
  const long long vectors = (count - head) / kWidth;
  const long long tail = head + vectors * kWidth;
  for (long long i = worker; i < head; i += workers) {
    minmax_push(m, T::load(p[i]));
  }
  for (long long k = worker; k < vectors; k += workers) {
    minmax_push_words<T>(m, load_words4(p + head + k * kWidth));
  }
  for (long long i = tail + worker; i < count; i += workers) {
    minmax_push(m, T::load(p[i]));
  }
  return m;
}

// The two header words (storage-dtype bits of min and max) of a chunk with `valid` elements.
struct HeaderWords {
  unsigned int lo;
  unsigned int hi;
};

BHVD_HD float canonical_zero(float v) { return v == 0.0f ? 0.0f : v; }

template <class T>
BHVD_HD HeaderWords header_words(const MinMax& m, long long valid) {
  HeaderWords h;
  if (valid <= 0) {
    h.lo = T::encode(0.0f);
    h.hi = T::encode(0.0f);
  } else if (m.bad) {
    h.lo = T::kNanBits;
    h.hi = T::kNanBits;
  } else {
    h.lo = T::encode(canonical_zero(m.lo));
    h.hi = T::encode(canonical_zero(m.hi));
  }
  return h;
}

// Byte k (0 <= k < 32) of the little-endian chunk header.
template <class T>
BHVD_HD unsigned char header_byte(const HeaderWords& h, int k) {
  if (k < T::kBytes) {
    return static_cast<unsigned char>((h.lo >> (8 * k)) & 0xffu);
  }
  if (k < 2 * T::kBytes) {
    return static_cast<unsigned char>((h.hi >> (8 * (k - T::kBytes))) & 0xffu);
  }
  return 0;
}

// Reads the min (field 0) or max (field 1) of a chunk header as fp32.
template <class T>
BHVD_HD float header_value(const unsigned char* slot, int field) {
  unsigned int bits = 0;
  for (int k = 0; k < T::kBytes; ++k) {
    bits |= static_cast<unsigned int>(slot[field * T::kBytes + k]) << (8 * k);
  }
  return T::decode(bits);
}

// ---- quantization -------------------------------------------------------------------------

struct QuantParams {
  float scale;
  float upper;
  float lower;
};

BHVD_HD QuantParams quant_params(float lo, float hi) {
  QuantParams p;
  p.scale = div_rn(kLevels, add_rn(sub_rn(hi, lo), kEps));
  p.upper = rint_even(mul_rn(hi, p.scale));
  p.lower = sub_rn(p.upper, kLevels);
  return p;
}

template <class T>
BHVD_HD QuantParams slot_params(const unsigned char* slot) {
  return quant_params(header_value<T>(slot, 0), header_value<T>(slot, 1));
}

// Saturating fp32 -> uint8 of an integral value: NaN and negatives give 0, > 255 gives 255.
BHVD_HD unsigned char saturate_u8(float v) {
  if (v > 0.0f) {
    return v < kLevels ? static_cast<unsigned char>(v) : static_cast<unsigned char>(255);
  }
  return 0;
}

BHVD_HD unsigned char quantize(float x, const QuantParams& p) {
  const float r = rint_even(mul_rn(x, p.scale));
  const float clipped = r < p.upper ? r : p.upper;  // clip the top only
  return saturate_u8(sub_rn(clipped, p.lower));
}

BHVD_HD float dequantize(unsigned char q, const QuantParams& p) {
  return div_rn(add_rn(static_cast<float>(q), p.lower), p.scale);
}

// ---- deterministic pairwise sum ------------------------------------------------------------
// Sums get(0) .. get(n-1) as a pairwise tree: level by level, neighbours (2i, 2i+1) are added
// and an odd last element moves up unchanged. A binary-counter stack computes the same tree
// in one streaming pass; the torch fallback computes it level by level, vectorized.
template <class Get>
BHVD_HD float pairwise_sum(int n, const Get& get) {
  float vals[33];
  int heights[33];
  int top = 0;
  for (int j = 0; j < n; ++j) {
    float v = get(j);
    int h = 0;
    while (top > 0 && heights[top - 1] == h) {
      v = add_rn(vals[top - 1], v);
      --top;
      ++h;
    }
    vals[top] = v;
    heights[top] = h;
    ++top;
  }
  if (top == 0) {
    return 0.0f;
  }
  float acc = vals[top - 1];
  for (int k = top - 2; k >= 0; --k) {
    acc = add_rn(vals[k], acc);
  }
  return acc;
}

BHVD_HD float finish_reduce(float sum, int n, bool average) {
  return average ? div_rn(sum, static_cast<float>(n)) : sum;
}

// ---- elementwise updates (all in fp32, rounded once to the storage dtype by the caller) ---

BHVD_HD float average_op(float x, float y) { return div_rn(add_rn(x, y), 2.0f); }
BHVD_HD float add_op(float x, float y) { return add_rn(x, y); }
BHVD_HD float subtract_op(float x, float y) { return sub_rn(x, y); }
BHVD_HD float addmul_op(float x, float y, float factor) { return add_rn(x, mul_rn(y, factor)); }
BHVD_HD float scale_op(float x, float factor) { return mul_rn(x, factor); }
BHVD_HD float divide_op(float x, float divisor) { return div_rn(x, divisor); }

// Async model average: w + (reduced / n - snapshot). Grouping the correction first keeps the
// local progress (w - snapshot) exact when the ranks already agree.
BHVD_HD float async_model_average_op(float w, float reduced, float snapshot, float nranks) {
  return add_rn(w, sub_rn(div_rn(reduced, nranks), snapshot));
}

// Low-precision decentralized diff: d = x + l/3 + r/3 - 5w/3, computed as
// (x - w) + ((l - w) + (r - w)) / 3 so that nearly equal replicas do not cancel.
BHVD_HD float lowprec_diff_op(float x, float w, float l, float r) {
  return add_rn(sub_rn(x, w), div_rn(add_rn(sub_rn(l, w), sub_rn(r, w)), 3.0f));
}

}  // namespace bhvd
