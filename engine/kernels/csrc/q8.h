// Activations rounded to int8 in blocks of 32, as llama.cpp's Q8_1 rounds them (the torch
// reference: engine/kernels/quant.py `round_activations_q8`). Shared by the row-layout kernel
// (cpu_kernels.cpp int4_q8_linear) and the tiled one (q8_tiles.cpp): both must round alike.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace q8 {

constexpr int64_t BLOCK = 32;  // activation values per int8 block

// x (k floats, k a multiple of 32) -> xq, d[k / 32], dsum[k / 32] = d * sum(xq) of each block,
// and, where qsum is given, qsum[k / 32] = sum(xq) itself: per block d = max |x| / 127 and
// xq = round(x / d) to nearest, ties to even (0 where d is 0). The AVX-512 loop computes the
// same IEEE quotients and rounds them the same way, so both branches give identical bytes.
inline void quantize_row(const float* x, int64_t k, int8_t* xq, float* d, float* dsum,
                         int32_t* qsum = nullptr) {
  for (int64_t b = 0; b < k / BLOCK; ++b) {
    const float* v = x + b * BLOCK;
    int8_t* out = xq + b * BLOCK;
#if defined(__AVX512F__)
    const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float scale = amax / 127.f;
    int32_t total = 0;
    if (scale > 0.f) {
      const __m512 s = _mm512_set1_ps(scale), lim = _mm512_set1_ps(127.f);
      auto to_int = [&](__m512 a) {
        const __m512 r = _mm512_roundscale_ps(_mm512_div_ps(a, s), _MM_FROUND_TO_NEAREST_INT |
                                                                       _MM_FROUND_NO_EXC);
        return _mm512_cvtps_epi32(_mm512_min_ps(lim, _mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), lim), r)));
      };
      const __m512i q0 = to_int(v0), q1 = to_int(v1);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm512_cvtepi32_epi8(q1));
      total = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    } else {
      std::fill(out, out + BLOCK, int8_t{0});
    }
#else
    float amax = 0.f;
    for (int64_t i = 0; i < BLOCK; ++i) amax = std::max(amax, std::fabs(v[i]));
    const float scale = amax / 127.f;
    int32_t total = 0;
    for (int64_t i = 0; i < BLOCK; ++i) {
      const float r = scale > 0.f ? std::nearbyint(v[i] / scale) : 0.f;  // to nearest, ties even
      const int32_t q = static_cast<int32_t>(std::min(127.f, std::max(-127.f, r)));
      out[i] = static_cast<int8_t>(q);
      total += q;
    }
#endif
    d[b] = scale;
    dsum[b] = scale * static_cast<float>(total);
    if (qsum) qsum[b] = total;
  }
}

}  // namespace q8
