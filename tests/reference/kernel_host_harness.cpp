// Host harness: runs the per-element math of csrc/baguahvd_math.cuh on the CPU, looping over
// chunks and elements the way the CUDA kernels do, so tests can compare it with the torch
// fallback bit for bit. Built by tests/unit/test_kernels_host.py with a plain C++17 compiler.
//
// Usage: harness OP DTYPE ARGS... ; tensors are raw little-endian files (fp16/bf16 as their
// 16-bit words), every OP writes its result to the last path.
//   compress        DT numel n target x out      (target -1: every chunk)
//   decompress      DT numel n buf out
//   decompress_add  DT numel n buf x out
//   decompress_reduce DT numel n average buf out
//   reduce          DT numel n average x out
//   minmax          DT numel offset workers x out   (lo, hi, bad of x[offset:] as fp32)
//   average|add|subtract DT numel x y out
//   addmul          DT numel factor x y out
//   scale|divide    DT numel scalar x out
//   async           DT numel nranks w reduced snapshot out
//   lowprec         DT numel x w left right out
//   narrow          DT numel f32_in out           (fp32 -> storage dtype)
//   widen           DT numel storage_in f32_out   (storage dtype -> fp32)
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "baguahvd_math.cuh"

namespace {

using Bytes = std::vector<unsigned char>;

Bytes read_file(const char* path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    std::fprintf(stderr, "cannot read %s\n", path);
    std::exit(2);
  }
  return Bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

void write_file(const char* path, const void* data, size_t bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
  if (!f) {
    std::fprintf(stderr, "cannot write %s\n", path);
    std::exit(2);
  }
}

template <class S>
std::vector<S> read_array(const char* path, long long count) {
  const Bytes raw = read_file(path);
  if (raw.size() != static_cast<size_t>(count) * sizeof(S)) {
    std::fprintf(stderr, "%s: %zu bytes, expected %lld\n", path, raw.size(),
                 count * static_cast<long long>(sizeof(S)));
    std::exit(2);
  }
  std::vector<S> out(static_cast<size_t>(count));
  if (count > 0) {
    std::memcpy(out.data(), raw.data(), raw.size());
  }
  return out;
}

template <class S>
void write_array(const char* path, const std::vector<S>& v) {
  write_file(path, v.data(), v.size() * sizeof(S));
}

// Splits a chunk over several workers whose shares (minmax_share, as the threads of the first
// min/max pass read them) travel as (lo, hi) pairs, then merges them like the header kernel.
constexpr int kPartials = 7;

template <class T>
bhvd::MinMax chunk_minmax(const typename T::storage* x, long long begin, long long valid,
                          int workers = kPartials) {
  bhvd::MinMax m = bhvd::minmax_empty();
  for (int w = 0; w < workers; ++w) {
    const bhvd::MinMax part = bhvd::minmax_share<T>(x, begin, begin + valid, w, workers);
    bhvd::minmax_merge(m, bhvd::minmax_from_partial(bhvd::minmax_partial_lo(part), part.hi));
  }
  return m;
}

// lo, hi and bad (1 or 0) of x[offset, numel) as fp32, x starting on a 16-byte boundary.
template <class T>
void minmax(long long numel, long long offset, int workers, const char* in,
            const char* out_path) {
  typedef typename T::storage S;
  const std::vector<S> x = read_array<S>(in, numel);
  std::vector<S> aligned(x.size() + 16 / sizeof(S));
  const unsigned long long address = reinterpret_cast<unsigned long long>(aligned.data());
  S* base = aligned.data() + (16 - address % 16) % 16 / sizeof(S);
  std::copy(x.begin(), x.end(), base);
  const bhvd::MinMax m = chunk_minmax<T>(base, offset, numel - offset, workers);
  const std::vector<float> out = {m.lo, m.hi, m.bad ? 1.0f : 0.0f};
  write_array(out_path, out);
}

template <class T>
void compress(long long numel, int n, int target, const char* in, const char* out_path) {
  typedef typename T::storage S;
  const std::vector<S> x = read_array<S>(in, numel);
  const long long chunk = bhvd::chunk_elements(numel, n);
  const long long slot = bhvd::slot_bytes(chunk);
  Bytes out(static_cast<size_t>(slot * n), 0);
  for (int j = 0; j < n; ++j) {
    if (target >= 0 && j != target) {
      continue;
    }
    unsigned char* s = out.data() + j * slot;
    const long long valid = bhvd::chunk_valid(numel, chunk, j);
    const bhvd::HeaderWords h = bhvd::header_words<T>(chunk_minmax<T>(x.data(), j * chunk, valid), valid);
    for (int k = 0; k < bhvd::kHeaderBytes; ++k) {
      s[k] = bhvd::header_byte<T>(h, k);
    }
    const bhvd::QuantParams p = bhvd::slot_params<T>(s);
    for (long long i = 0; i < slot - bhvd::kHeaderBytes; ++i) {
      s[bhvd::kHeaderBytes + i] = i < valid ? bhvd::quantize(T::load(x[j * chunk + i]), p) : 0;
    }
  }
  write_array(out_path, out);
}

template <class T>
void decompress(long long numel, int n, const char* buf_path, const char* x_path, bool add,
                const char* out_path) {
  typedef typename T::storage S;
  const long long chunk = bhvd::chunk_elements(numel, n);
  const long long slot = bhvd::slot_bytes(chunk);
  const Bytes buf = read_array<unsigned char>(buf_path, slot * n);
  std::vector<S> out = add ? read_array<S>(x_path, numel) : std::vector<S>(numel);
  for (int j = 0; j < n; ++j) {
    const unsigned char* s = buf.data() + j * slot;
    const bhvd::QuantParams p = bhvd::slot_params<T>(s);
    for (long long i = 0; i < bhvd::chunk_valid(numel, chunk, j); ++i) {
      const float d = bhvd::dequantize(s[bhvd::kHeaderBytes + i], p);
      S& o = out[j * chunk + i];
      o = add ? T::store(bhvd::add_op(T::load(o), bhvd::round_to<T>(d))) : T::store(d);
    }
  }
  write_array(out_path, out);
}

template <class T>
void decompress_reduce(long long numel, int n, bool average, const char* buf_path,
                       const char* out_path) {
  typedef typename T::storage S;
  const long long chunk = bhvd::chunk_elements(numel, n);
  const long long slot = bhvd::slot_bytes(chunk);
  const Bytes buf = read_array<unsigned char>(buf_path, slot * n);
  std::vector<S> out(chunk);
  // Every chunk's parameters derived once, as the kernel's blocks do into shared memory.
  std::vector<bhvd::QuantParams> params;
  for (int j = 0; j < n; ++j) {
    params.push_back(bhvd::slot_params<T>(buf.data() + j * slot));
  }
  for (long long i = 0; i < chunk; ++i) {
    const float sum = bhvd::pairwise_sum(n, [&](int j) {
      const unsigned char* s = buf.data() + j * slot;
      return bhvd::round_to<T>(bhvd::dequantize(s[bhvd::kHeaderBytes + i], params[j]));
    });
    out[i] = T::store(bhvd::finish_reduce(sum, n, average));
  }
  write_array(out_path, out);
}

template <class T>
void reduce(long long numel, int n, bool average, const char* in, const char* out_path) {
  typedef typename T::storage S;
  const std::vector<S> x = read_array<S>(in, numel);
  const long long chunk = numel / n;
  std::vector<S> out(chunk);
  for (long long i = 0; i < chunk; ++i) {
    const float sum = bhvd::pairwise_sum(n, [&](int j) { return T::load(x[j * chunk + i]); });
    out[i] = T::store(bhvd::finish_reduce(sum, n, average));
  }
  write_array(out_path, out);
}

template <class T, class F>
void elementwise(long long numel, int n_inputs, char** paths, const F& op) {
  typedef typename T::storage S;
  std::vector<std::vector<S>> in;
  for (int k = 0; k < n_inputs; ++k) {
    in.push_back(read_array<S>(paths[k], numel));
  }
  std::vector<S> out(numel);
  float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (long long i = 0; i < numel; ++i) {
    for (int k = 0; k < n_inputs; ++k) {
      v[k] = T::load(in[k][i]);
    }
    out[i] = T::store(op(v));
  }
  write_array(paths[n_inputs], out);
}

template <class T>
int run(const std::string& op, int argc, char** argv) {
  typedef typename T::storage S;
  const long long numel = std::atoll(argv[3]);
  auto need = [&](int count) {
    if (argc != count) {
      std::fprintf(stderr, "%s: expected %d arguments, got %d\n", op.c_str(), count - 1, argc - 1);
      std::exit(2);
    }
  };
  if (op == "compress") {
    need(8);
    compress<T>(numel, std::atoi(argv[4]), std::atoi(argv[5]), argv[6], argv[7]);
  } else if (op == "decompress") {
    need(7);
    decompress<T>(numel, std::atoi(argv[4]), argv[5], nullptr, false, argv[6]);
  } else if (op == "decompress_add") {
    need(8);
    decompress<T>(numel, std::atoi(argv[4]), argv[5], argv[6], true, argv[7]);
  } else if (op == "decompress_reduce") {
    need(8);
    decompress_reduce<T>(numel, std::atoi(argv[4]), std::atoi(argv[5]) != 0, argv[6], argv[7]);
  } else if (op == "minmax") {
    need(8);
    minmax<T>(numel, std::atoll(argv[4]), std::atoi(argv[5]), argv[6], argv[7]);
  } else if (op == "reduce") {
    need(8);
    reduce<T>(numel, std::atoi(argv[4]), std::atoi(argv[5]) != 0, argv[6], argv[7]);
  } else if (op == "average") {
    need(7);
    elementwise<T>(numel, 2, argv + 4, [](const float* v) { return bhvd::average_op(v[0], v[1]); });
  } else if (op == "add") {
    need(7);
    elementwise<T>(numel, 2, argv + 4, [](const float* v) { return bhvd::add_op(v[0], v[1]); });
  } else if (op == "subtract") {
    need(7);
    elementwise<T>(numel, 2, argv + 4, [](const float* v) { return bhvd::subtract_op(v[0], v[1]); });
  } else if (op == "addmul") {
    need(8);
    const float f = std::strtof(argv[4], nullptr);
    elementwise<T>(numel, 2, argv + 5, [f](const float* v) { return bhvd::addmul_op(v[0], v[1], f); });
  } else if (op == "scale") {
    need(7);
    const float f = std::strtof(argv[4], nullptr);
    elementwise<T>(numel, 1, argv + 5, [f](const float* v) { return bhvd::scale_op(v[0], f); });
  } else if (op == "divide") {
    need(7);
    const float d = std::strtof(argv[4], nullptr);
    elementwise<T>(numel, 1, argv + 5, [d](const float* v) { return bhvd::divide_op(v[0], d); });
  } else if (op == "async") {
    need(9);
    const float n = std::strtof(argv[4], nullptr);
    elementwise<T>(numel, 3, argv + 5,
                   [n](const float* v) { return bhvd::async_model_average_op(v[0], v[1], v[2], n); });
  } else if (op == "lowprec") {
    need(9);
    elementwise<T>(numel, 4, argv + 4,
                   [](const float* v) { return bhvd::lowprec_diff_op(v[0], v[1], v[2], v[3]); });
  } else if (op == "narrow") {
    need(6);
    const std::vector<float> x = read_array<float>(argv[4], numel);
    std::vector<S> out(numel);
    for (long long i = 0; i < numel; ++i) {
      out[i] = T::store(x[i]);
    }
    write_array(argv[5], out);
  } else if (op == "widen") {
    need(6);
    const std::vector<S> x = read_array<S>(argv[4], numel);
    std::vector<float> out(numel);
    for (long long i = 0; i < numel; ++i) {
      out[i] = T::load(x[i]);
    }
    write_array(argv[5], out);
  } else {
    std::fprintf(stderr, "unknown op %s\n", op.c_str());
    return 2;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s OP DTYPE NUMEL ...\n", argv[0]);
    return 2;
  }
  const std::string op = argv[1];
  const std::string dtype = argv[2];
  if (dtype == "f32") {
    return run<bhvd::F32>(op, argc, argv);
  }
  if (dtype == "f16") {
    return run<bhvd::F16>(op, argc, argv);
  }
  if (dtype == "bf16") {
    return run<bhvd::BF16>(op, argc, argv);
  }
  std::fprintf(stderr, "unknown dtype %s\n", dtype.c_str());
  return 2;
}
