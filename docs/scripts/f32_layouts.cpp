// How the layout of float32 weights sets the speed of a few-row matrix product on this CPU: a
// standalone measurement (docs/performance.md, twenty-first session), not part of the engine.
//
//   g++ -O3 -march=native -fopenmp docs/scripts/f32_layouts.cpp -o /tmp/f32_layouts
//   /tmp/f32_layouts THREADS ROWS [TURNS] [l2]
//
// Over SmolLM2-135M's 120 layer matrices and its output layer (538 MB, in huge pages; or with
// `l2`, 100 passes over one 256 x 576 matrix that stays in the cores' L2 caches), y = x W^T for
// ROWS rows of activations, the variants taking turns in one process (medians in ms):
//   c1      each thread reads its rows of weights one after the other (one stream);
//   c4      4 rows of weights side by side (engine/kernels/csrc/f32_rows.cpp's loop);
//   c4 pf   the same with each row prefetched 8 KB ahead, as f32_rows.cpp does at 2-8 rows;
//   p4      weights packed at load, 4 channels interleaved per 16 inputs, so that 4 channels
//           side by side are one stream again;
//   p4 pin  the same with the loaded vectors kept in registers (GCC otherwise folds the
//           activations' loads into the multiply-adds, one load per product);
//   p4 1pass  p4 pin at 5-8 rows in one pass over each group: chunks of 8 x 16 inputs, rows 0-3
//           then rows 4-7 on the chunk, the sums kept between chunks, the weights prefetched
//           16 KB ahead into L2 (f32_rows.cpp's group_in_one_pass; below 5 rows, p4 pin);
//   sum     a plain sum of the same bytes (what the memory gives).
// Each output is summed in f32_rows.cpp's order in every variant; the bytes are not a real
// model's (the timing does not depend on their values), so p4 reads the same buffer as packed.
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

constexpr long LANES = 16, PREFETCH_BYTES = 8192;

template <bool PIN>
inline __m512 load(const float* p) {
  __m512 v = _mm512_loadu_ps(p);
  if (PIN) __asm__("" : "+v"(v));
  return v;
}

// Channels c .. c + R - 1 (rows of W [n, k]) for M rows of x; PF: prefetch every row.
template <int R, int M, bool PF>
void side_by_side(const float* w, long k, const float* x, float* y, long n, long c) {
  const float* row = w + c * k;
  __m512 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < M; ++j) acc[r][j] = _mm512_setzero_ps();
  for (long i = 0; i < k; i += LANES) {
    if (PF)
      for (int r = 0; r < R; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(row + r * k + i) + PREFETCH_BYTES, _MM_HINT_T0);
    __m512 xv[M];
    for (int j = 0; j < M; ++j) xv[j] = _mm512_loadu_ps(x + j * k + i);
    for (int r = 0; r < R; ++r) {
      const __m512 wv = _mm512_loadu_ps(row + r * k + i);
      for (int j = 0; j < M; ++j) acc[r][j] = _mm512_fmadd_ps(wv, xv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < M; ++j) y[j * n + c + r] = _mm512_reduce_add_ps(acc[r][j]);
}

// Channels c .. c + 3 packed: for each 16 inputs, the 4 channels' 16 weights one after another.
template <int M, bool PIN>
void packed(const float* w, long k, const float* x, float* y, long n, long c) {
  const float* group = w + c * k;
  __m512 acc[4][M];
  for (int r = 0; r < 4; ++r)
    for (int j = 0; j < M; ++j) acc[r][j] = _mm512_setzero_ps();
  for (long i = 0; i < k; i += LANES, group += 4 * LANES) {
    __m512 xv[M];
    for (int j = 0; j < M; ++j) xv[j] = load<PIN>(x + j * k + i);
    for (int r = 0; r < 4; ++r) {
      const __m512 wv = load<PIN>(group + r * LANES);
      for (int j = 0; j < M; ++j) acc[r][j] = _mm512_fmadd_ps(wv, xv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int j = 0; j < M; ++j) y[j * n + c + r] = _mm512_reduce_add_ps(acc[r][j]);
}

// Channels c .. c + 3 packed, for 5-8 rows (m) in one pass: p4 pin's sums in two sets of 4 rows,
// a chunk of CHUNK pieces at a time, the first set prefetching the weights into L2.
constexpr long CHUNK = 8, L2_PREFETCH_BYTES = 16384;

template <int M>
void chunk_rows(const float* g, long p0, long p1, long k, const float* x, __m512 (&sums)[4][4],
                bool prefetch) {
  __m512 acc[4][M];
  for (int r = 0; r < 4; ++r)
    for (int j = 0; j < M; ++j) acc[r][j] = sums[r][j];
  for (long p = p0; p < p1; ++p) {
    const float* w = g + p * 4 * LANES;
    if (prefetch)
      for (int r = 0; r < 4; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(w + r * LANES) + L2_PREFETCH_BYTES,
                     _MM_HINT_T1);
    __m512 xv[M];
    for (int j = 0; j < M; ++j) xv[j] = load<true>(x + j * k + p * LANES);
    for (int r = 0; r < 4; ++r) {
      const __m512 wv = load<true>(w + r * LANES);
      for (int j = 0; j < M; ++j) acc[r][j] = _mm512_fmadd_ps(wv, xv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int j = 0; j < M; ++j) sums[r][j] = acc[r][j];
}

void one_pass(const float* w, long k, const float* x, float* y, long n, long c, int m) {
  const float* g = w + c * k;
  __m512 sums[2][4][4];
  for (auto& set : sums)
    for (auto& channel : set)
      for (auto& v : channel) v = _mm512_setzero_ps();
  const long pieces = k / LANES;
  for (long p0 = 0; p0 < pieces; p0 += CHUNK) {
    const long p1 = std::min(pieces, p0 + CHUNK);
    chunk_rows<4>(g, p0, p1, k, x, sums[0], true);
    switch (m - 4) {
      case 4: chunk_rows<4>(g, p0, p1, k, x + 4 * k, sums[1], false); break;
      case 3: chunk_rows<3>(g, p0, p1, k, x + 4 * k, sums[1], false); break;
      case 2: chunk_rows<2>(g, p0, p1, k, x + 4 * k, sums[1], false); break;
      case 1: chunk_rows<1>(g, p0, p1, k, x + 4 * k, sums[1], false); break;
      default: break;
    }
  }
  for (int j = 0; j < m; ++j)
    for (int r = 0; r < 4; ++r) y[j * n + c + r] = _mm512_reduce_add_ps(sums[j / 4][r][j % 4]);
}

struct Matrix {
  float* w;
  long n, k;
};

// y = x W^T for `rows` rows (more than 4: passes of 4), each thread a range of channels.
template <typename Channels>
void linear(const Matrix& m, const float* x, float* y, int threads, int rows, int at_once,
            const Channels& channels) {
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num();
    const long per = (m.n / at_once + threads - 1) / threads * at_once;
    const long c0 = t * per, c1 = std::min(m.n, c0 + per);
    for (long c = c0; c < c1; c += at_once)
      for (int r0 = 0; r0 < rows; r0 += 4)
        channels(m.w, m.k, x + r0 * m.k, y + r0 * m.n, m.n, c, std::min(4, rows - r0));
  }
}

void sum_all(const std::vector<Matrix>& ms, int threads) {
  [[maybe_unused]] static volatile float sink;
  for (const auto& m : ms) {
    const long size = m.n * m.k;
#pragma omp parallel num_threads(threads)
    {
      const int t = omp_get_thread_num();
      const long per = (size / 64 + threads - 1) / threads * 64;
      const long a = t * per, b = std::min(size, a + per);
      __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
      for (long i = a; i + 64 <= b; i += 64) {
        s0 = _mm512_add_ps(s0, _mm512_loadu_ps(m.w + i));
        s1 = _mm512_add_ps(s1, _mm512_loadu_ps(m.w + i + 16));
        s2 = _mm512_add_ps(s2, _mm512_loadu_ps(m.w + i + 32));
        s3 = _mm512_add_ps(s3, _mm512_loadu_ps(m.w + i + 48));
      }
      sink = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
    }
  }
}

// A variant's channel function at m (1-4) rows of activations.
template <template <int> class Kernel>
auto by_rows() {
  return [](const float* w, long k, const float* x, float* y, long n, long c, int m) {
    switch (m) {
      case 4: Kernel<4>::run(w, k, x, y, n, c); break;
      case 3: Kernel<3>::run(w, k, x, y, n, c); break;
      case 2: Kernel<2>::run(w, k, x, y, n, c); break;
      default: Kernel<1>::run(w, k, x, y, n, c); break;
    }
  };
}
template <int M> struct C1 { static void run(const float* w, long k, const float* x, float* y, long n, long c) { side_by_side<1, M, false>(w, k, x, y, n, c); } };
template <int M> struct C4 { static void run(const float* w, long k, const float* x, float* y, long n, long c) { side_by_side<4, M, false>(w, k, x, y, n, c); } };
template <int M> struct C4Pf { static void run(const float* w, long k, const float* x, float* y, long n, long c) { side_by_side<4, M, true>(w, k, x, y, n, c); } };
template <int M> struct P4 { static void run(const float* w, long k, const float* x, float* y, long n, long c) { packed<M, false>(w, k, x, y, n, c); } };
template <int M> struct P4Pin { static void run(const float* w, long k, const float* x, float* y, long n, long c) { packed<M, true>(w, k, x, y, n, c); } };

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s THREADS ROWS [TURNS] [l2]\n", argv[0]);
    return 2;
  }
  const int threads = std::atoi(argv[1]), rows = std::atoi(argv[2]);
  const int turns = argc > 3 ? std::atoi(argv[3]) : 15;
  const bool in_l2 = argc > 4 && std::string(argv[4]) == "l2";
  std::vector<Matrix> ms;
  if (in_l2) {
    for (int i = 0; i < 100; ++i) ms.push_back({nullptr, 256, 576});
  } else {
    const long shapes[4][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};
    for (int layer = 0; layer < 30; ++layer)
      for (const auto& s : shapes) ms.push_back({nullptr, s[0], s[1]});
    ms.push_back({nullptr, 49152, 576});
  }
  size_t total = 0;
  for (const auto& m : ms) total += m.n * m.k * 4;
  const size_t bytes = in_l2 ? (4 << 20) : (total + (4 << 20)) & ~((size_t(2) << 20) - 1);
  char* base = static_cast<char*>(
      mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  madvise(base, bytes, MADV_HUGEPAGE);
  size_t offset = 0;
  for (auto& m : ms) {
    m.w = reinterpret_cast<float*>(base + (in_l2 ? 0 : offset));
    offset = (offset + m.n * m.k * 4 + 63) & ~size_t(63);
  }
  for (size_t i = 0; i < bytes / 4; ++i) reinterpret_cast<float*>(base)[i] = (i % 7) * 0.01f;
  std::vector<float> x(8 * 1536, 0.5f), y(8 * 49152);
  using Run = std::function<void()>;
  auto over = [&](auto channels, int at_once) {
    return Run([&, channels, at_once] {
      for (const auto& m : ms) linear(m, x.data(), y.data(), threads, rows, at_once, channels);
    });
  };
  const std::vector<std::pair<std::string, Run>> variants = {
      {"c1", over(by_rows<C1>(), 1)},        {"c4", over(by_rows<C4>(), 4)},
      {"c4 pf", over(by_rows<C4Pf>(), 4)},   {"p4", over(by_rows<P4>(), 4)},
      {"p4 pin", over(by_rows<P4Pin>(), 4)}, {"p4 1pass", Run([&] {
         for (const auto& m : ms)  // one call per group with all the rows
           linear(m, x.data(), y.data(), threads, 1, 4,
                  [&](const float* w, long k, const float* xx, float* yy, long n, long c, int) {
                    if (rows > 4) one_pass(w, k, xx, yy, n, c, rows);
                    else by_rows<P4Pin>()(w, k, xx, yy, n, c, rows);
                  });
       })},
      {"sum", Run([&] { sum_all(ms, threads); })}};
  std::vector<std::vector<double>> ms_taken(variants.size());
  for (int turn = 0; turn < turns + 2; ++turn)
    for (size_t v = 0; v < variants.size(); ++v) {
      const auto start = std::chrono::steady_clock::now();
      variants[v].second();
      const std::chrono::duration<double, std::milli> took = std::chrono::steady_clock::now() - start;
      if (turn >= 2) ms_taken[v].push_back(took.count());  // the first two turns warm up
    }
  std::printf("%s, %d threads, %d rows (%.0f MB):", in_l2 ? "L2" : "memory", threads, rows,
              total / 1e6);
  for (size_t v = 0; v < variants.size(); ++v) {
    std::sort(ms_taken[v].begin(), ms_taken[v].end());
    std::printf("  %s %.2f", variants[v].first.c_str(), ms_taken[v][ms_taken[v].size() / 2]);
  }
  std::printf("\n");
}
