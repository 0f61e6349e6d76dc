// A prototype of the quantized dot as a CPU kernel behind XLA's FFI: y [M, N] = x [M, K] .
// W [K, N], where W = codes * scale (+ min) per group of G rows of K, the layout of meshserve's
// grouped int8 kernels (codes int8 [K, N], scales and mins float32 [K / G, N]).
//
// One row of x: for each group, the rows' codes are converted and accumulated into a float
// buffer of the group's partial sums per output (in cache), which then takes the group's scale
// (and the group's sum of x times its minimum): the codes are read once, never written out as
// floats; the loops run over N, contiguous, which the compiler vectorizes. Several rows (with
// AVX-512): 8 rows x 32 outputs of partial sums held in registers while the group's codes are
// read, each converted once. One thread.
#include <cstdint>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#if defined(__AVX512F__)
// Rows [m0, m0 + MC) of x against group `gi`'s rows of codes, 32 outputs from j0: the partial
// sums of MC rows x 32 outputs stay in 2 * MC vector registers while the group's 32 rows of
// codes are read, each converted once; then scaled (and the minimum times the sum of x) into y.
template <int MC>
static void Micro(const float* xs, int64_t k, const int8_t* c, int64_t n, const float* s,
                  const float* mn, int64_t g, int64_t gi, int64_t m0, int64_t j0, float* out) {
  __m512 acc[MC][2];
  float xsum[MC];
  for (int mi = 0; mi < MC; ++mi) {
    acc[mi][0] = _mm512_setzero_ps();
    acc[mi][1] = _mm512_setzero_ps();
    xsum[mi] = 0.0f;
  }
  for (int64_t r = gi * g; r < (gi + 1) * g; ++r) {
    const int8_t* row = c + r * n + j0;
    const __m512 v0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(row))));
    const __m512 v1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16))));
    for (int mi = 0; mi < MC; ++mi) {
      const float xv = xs[(m0 + mi) * k + r];
      xsum[mi] += xv;
      const __m512 xb = _mm512_set1_ps(xv);
      acc[mi][0] = _mm512_fmadd_ps(xb, v0, acc[mi][0]);
      acc[mi][1] = _mm512_fmadd_ps(xb, v1, acc[mi][1]);
    }
  }
  const float* sg = s + gi * n + j0;
  const __m512 s0 = _mm512_loadu_ps(sg), s1 = _mm512_loadu_ps(sg + 16);
  for (int mi = 0; mi < MC; ++mi) {
    float* o = out + (m0 + mi) * n + j0;
    __m512 y0 = _mm512_fmadd_ps(acc[mi][0], s0, _mm512_loadu_ps(o));
    __m512 y1 = _mm512_fmadd_ps(acc[mi][1], s1, _mm512_loadu_ps(o + 16));
    if (mn) {
      const float* mg = mn + gi * n + j0;
      const __m512 xs0 = _mm512_set1_ps(xsum[mi]);
      y0 = _mm512_fmadd_ps(xs0, _mm512_loadu_ps(mg), y0);
      y1 = _mm512_fmadd_ps(xs0, _mm512_loadu_ps(mg + 16), y1);
    }
    _mm512_storeu_ps(o, y0);
    _mm512_storeu_ps(o + 16, y1);
  }
}

// y += x . W for several rows of x (y zeroed first), 8 rows and 32 outputs at a time.
static bool SeveralRows(const float* xs, int64_t m, int64_t k, const int8_t* c, int64_t n,
                        const float* s, const float* mn, int64_t groups, float* out) {
  if (n % 32) return false;
  const int64_t g = k / groups;
  for (int64_t i = 0; i < m * n; ++i) out[i] = 0.0f;
  for (int64_t gi = 0; gi < groups; ++gi) {
    for (int64_t j0 = 0; j0 < n; j0 += 32) {
      int64_t m0 = 0;
      for (; m0 + 8 <= m; m0 += 8) Micro<8>(xs, k, c, n, s, mn, g, gi, m0, j0, out);
      for (; m0 + 4 <= m; m0 += 4) Micro<4>(xs, k, c, n, s, mn, g, gi, m0, j0, out);
      for (; m0 < m; ++m0) Micro<1>(xs, k, c, n, s, mn, g, gi, m0, j0, out);
    }
  }
  return true;
}
#endif

static ffi::Error GroupedDot(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> codes,
                             ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::F32> mins,
                             ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), cd = codes.dimensions(), sd = scales.dimensions();
  if (xd.size() != 2 || cd.size() != 2 || sd.size() != 2)
    return ffi::Error::InvalidArgument("x, codes and scales must be 2-D");
  const int64_t m = xd[0], k = xd[1], n = cd[1], groups = sd[0];
  if (cd[0] != k || sd[1] != n || groups == 0 || k % groups)
    return ffi::Error::InvalidArgument("shapes do not agree");
  const bool has_mins = mins.dimensions().size() == 2 && mins.dimensions()[0] == groups;
  const int64_t g = k / groups;
  const float* xs = x.typed_data();
  const int8_t* c = codes.typed_data();
  const float* s = scales.typed_data();
  const float* mn = has_mins ? mins.typed_data() : nullptr;
  float* out = y->typed_data();
#if defined(__AVX512F__)
  if (m > 1 && SeveralRows(xs, m, k, c, n, s, mn, groups, out)) return ffi::Error::Success();
#endif
  std::vector<float> acc(m * n), values(n);
  for (int64_t i = 0; i < m * n; ++i) out[i] = 0.0f;
  for (int64_t gi = 0; gi < groups; ++gi) {
    for (int64_t i = 0; i < m * n; ++i) acc[i] = 0.0f;
    for (int64_t r = gi * g; r < (gi + 1) * g; ++r) {
      const int8_t* row = c + r * n;
      if (m == 1) {  // convert while multiplying: the codes are read once
        const float xv = xs[r];
        float* a = acc.data();
        for (int64_t j = 0; j < n; ++j) a[j] += xv * static_cast<float>(row[j]);
        continue;
      }
      float* v = values.data();  // the row converted once, then used by every row of x
      for (int64_t j = 0; j < n; ++j) v[j] = static_cast<float>(row[j]);
      for (int64_t mi = 0; mi < m; ++mi) {
        const float xv = xs[mi * k + r];
        float* a = acc.data() + mi * n;
        for (int64_t j = 0; j < n; ++j) a[j] += xv * v[j];
      }
    }
    const float* sg = s + gi * n;
    for (int64_t mi = 0; mi < m; ++mi) {
      float* o = out + mi * n;
      const float* a = acc.data() + mi * n;
      for (int64_t j = 0; j < n; ++j) o[j] += a[j] * sg[j];
      if (mn) {
        float xsum = 0.0f;
        for (int64_t r = gi * g; r < (gi + 1) * g; ++r) xsum += xs[mi * k + r];
        const float* mg = mn + gi * n;
        for (int64_t j = 0; j < n; ++j) o[j] += xsum * mg[j];
      }
    }
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshserveGroupedDot, GroupedDot,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// The tied LM head over a table kept in its blocks: y [M, V] = x [M, D] . T [V, D]^T, where
// T = codes * scale (+ min) per group of G along D (a GGUF's `token_embd` layout: codes int8
// [V, D], scales and mins float32 [V, D / G]). Each row of codes is read once, for every row of
// x: per group, the dot of its codes with x's group, times the group's scale, plus the group's
// minimum times x's group sum. One thread.
static ffi::Error TableDot(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> codes,
                           ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::F32> mins,
                           ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), cd = codes.dimensions(), sd = scales.dimensions();
  if (xd.size() != 2 || cd.size() != 2 || sd.size() != 2)
    return ffi::Error::InvalidArgument("x, codes and scales must be 2-D");
  const int64_t m = xd[0], d = xd[1], v = cd[0], groups = sd[1];
  if (cd[1] != d || sd[0] != v || groups == 0 || d % groups)
    return ffi::Error::InvalidArgument("shapes do not agree");
  const bool has_mins = mins.dimensions().size() == 2 && mins.dimensions()[0] == v;
  const int64_t g = d / groups;
  const float* xs = x.typed_data();
  const int8_t* c = codes.typed_data();
  const float* s = scales.typed_data();
  const float* mn = has_mins ? mins.typed_data() : nullptr;
  float* out = y->typed_data();
  std::vector<float> xsum(m * groups, 0.0f);
  if (mn)
    for (int64_t mi = 0; mi < m; ++mi)
      for (int64_t gi = 0; gi < groups; ++gi)
        for (int64_t j = 0; j < g; ++j) xsum[mi * groups + gi] += xs[mi * d + gi * g + j];
  std::vector<float> row(d);
#if defined(__AVX512F__)
  if (g % 16 == 0) {  // per row: sum over groups of scale * (x . codes), one reduction a row
    for (int64_t vi = 0; vi < v; ++vi) {
      const int8_t* code = c + vi * d;
      for (int64_t j = 0; j < d; j += 16)
        _mm512_storeu_ps(row.data() + j, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(code + j)))));
      const float* sv = s + vi * groups;
      for (int64_t mi = 0; mi < m; ++mi) {
        const float* xm = xs + mi * d;
        __m512 total = _mm512_setzero_ps();
        float extra = 0.0f;
        for (int64_t gi = 0; gi < groups; ++gi) {
          __m512 partial = _mm512_setzero_ps();
          for (int64_t j = gi * g; j < (gi + 1) * g; j += 16)
            partial = _mm512_fmadd_ps(_mm512_loadu_ps(xm + j), _mm512_loadu_ps(row.data() + j),
                                      partial);
          total = _mm512_fmadd_ps(_mm512_set1_ps(sv[gi]), partial, total);
          if (mn) extra += mn[vi * groups + gi] * xsum[mi * groups + gi];
        }
        out[mi * v + vi] = _mm512_reduce_add_ps(total) + extra;
      }
    }
    return ffi::Error::Success();
  }
#endif
  for (int64_t vi = 0; vi < v; ++vi) {
    const int8_t* code = c + vi * d;
    for (int64_t j = 0; j < d; ++j) row[j] = static_cast<float>(code[j]);
    const float* sv = s + vi * groups;
    for (int64_t mi = 0; mi < m; ++mi) {
      const float* xm = xs + mi * d;
      float total = 0.0f;
      for (int64_t gi = 0; gi < groups; ++gi) {
        float partial = 0.0f;
        for (int64_t j = gi * g; j < (gi + 1) * g; ++j) partial += xm[j] * row[j];
        total += partial * sv[gi];
        if (mn) total += mn[vi * groups + gi] * xsum[mi * groups + gi];
      }
      out[mi * v + vi] = total;
    }
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshserveTableDot, TableDot,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
