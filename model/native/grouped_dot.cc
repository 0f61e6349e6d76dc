// The quantized dot as CPU kernels behind XLA's FFI: y [M, N] = x [M, K] . W [K, N], where
// W = codes * scale (+ min) per group of G rows of K, the layout of meshserve's grouped int8
// kernels (codes int8 [K, N], scales and mins float32 [K / G, N]); and the tied LM head over a
// table kept in its blocks (`TableDot`, below).
//
// One row of x: for each group, the rows' codes are converted and accumulated into a float
// buffer of the group's partial sums per output (in cache), which then takes the group's scale
// (and the group's sum of x times its minimum): the codes are read once, never written out as
// floats; the loops run over N, contiguous, which the compiler vectorizes. Several rows (with
// AVX-512): 8 rows x 32 outputs of partial sums held in registers while the group's codes are
// read, each converted once.
//
// Both kernels split their outputs into column (or vocabulary) ranges that run on XLA's
// intra-op threads and the calling one (`ParallelFor`): each range is claimed from a shared
// counter, so a task the pool starts late (or never) costs nothing but the caller's time.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// Runs body(begin, end) over [0, count) in ranges of `grain` (the last one shorter), on the pool
// and this thread, and returns when every range is done.
template <typename Body>
static void ParallelFor(ffi::ThreadPool& pool, int64_t count, int64_t grain, const Body& body) {
  const int64_t ranges = (count + grain - 1) / grain;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), ranges - 1);
  if (helpers <= 0) {
    body(0, count);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto state = std::make_shared<State>();
  // Claims ranges until none is left; `body` is only reached through a claimed range, so a task
  // that starts after the call returned touches nothing of it.
  auto work = [state, ranges, count, grain, &body] {
    for (int64_t i; (i = state->next.fetch_add(1)) < ranges;) {
      body(i * grain, std::min(count, (i + 1) * grain));
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t t = 0; t < helpers; ++t)
    pool.Schedule([state, ranges, work] {
      if (state->next.load() < ranges) work();
    });
  work();
  while (state->done.load(std::memory_order_acquire) < ranges) std::this_thread::yield();
}

// Columns a range of outputs takes: long enough that the loops over them, which run once per
// row of codes, outweigh their own overhead (at least 256), and about two ranges a thread, in
// whole blocks of 32.
static int64_t ColumnGrain(int64_t n, ffi::ThreadPool& pool) {
  const int64_t ranges = 2 * std::max<int64_t>(1, pool.num_threads());
  return std::max<int64_t>(256, (n / ranges + 31) / 32 * 32);
}

// The operands both kernels take: x [M, K], codes, scales and mins (mins empty when none).
struct Operands {
  int64_t m, k, groups;
  const float* xs;
  const int8_t* c;
  const float* s;
  const float* mn;  // nullptr: no minimums
  float* out;
};

// Checks the shapes: codes [K, N] with scales [K / G, N] (`table` false), or codes [V, D] with
// scales [V, D / G] (`table` true); `width` is N or V.
static ffi::Error Decode(ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::S8>& codes,
                         ffi::Buffer<ffi::F32>& scales, ffi::Buffer<ffi::F32>& mins,
                         ffi::ResultBuffer<ffi::F32>& y, bool table, Operands* ops,
                         int64_t* width) {
  const auto xd = x.dimensions(), cd = codes.dimensions(), sd = scales.dimensions();
  if (xd.size() != 2 || cd.size() != 2 || sd.size() != 2)
    return ffi::Error::InvalidArgument("x, codes and scales must be 2-D");
  const int64_t k = xd[1];
  const int64_t contracted = table ? cd[1] : cd[0], outputs = table ? cd[0] : cd[1];
  const int64_t groups = table ? sd[1] : sd[0], scale_outputs = table ? sd[0] : sd[1];
  if (contracted != k || scale_outputs != outputs || groups == 0 || k % groups)
    return ffi::Error::InvalidArgument("shapes do not agree");
  const auto md = mins.dimensions();
  const bool has_mins = md.size() == 2 && md[0] == sd[0] && md[1] == sd[1];
  *ops = Operands{xd[0], k, groups, x.typed_data(), codes.typed_data(), scales.typed_data(),
                  has_mins ? mins.typed_data() : nullptr, y->typed_data()};
  *width = outputs;
  return ffi::Error::Success();
}

#if defined(__AVX512F__)
// Rows [m0, m0 + MC) of x against group `gi`'s rows of codes, 32 outputs from j0: the partial
// sums of MC rows x 32 outputs stay in 2 * MC vector registers while the group's rows of codes
// are read, each converted once; then scaled (and the minimum times the sum of x) into y.
template <int MC>
static void Micro(const Operands& o, int64_t n, int64_t g, int64_t gi, int64_t m0, int64_t j0) {
  __m512 acc[MC][2];
  float xsum[MC];
  for (int mi = 0; mi < MC; ++mi) {
    acc[mi][0] = _mm512_setzero_ps();
    acc[mi][1] = _mm512_setzero_ps();
    xsum[mi] = 0.0f;
  }
  for (int64_t r = gi * g; r < (gi + 1) * g; ++r) {
    const int8_t* row = o.c + r * n + j0;
    const __m512 v0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(row))));
    const __m512 v1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16))));
    for (int mi = 0; mi < MC; ++mi) {
      const float xv = o.xs[(m0 + mi) * o.k + r];
      xsum[mi] += xv;
      const __m512 xb = _mm512_set1_ps(xv);
      acc[mi][0] = _mm512_fmadd_ps(xb, v0, acc[mi][0]);
      acc[mi][1] = _mm512_fmadd_ps(xb, v1, acc[mi][1]);
    }
  }
  const float* sg = o.s + gi * n + j0;
  const __m512 s0 = _mm512_loadu_ps(sg), s1 = _mm512_loadu_ps(sg + 16);
  for (int mi = 0; mi < MC; ++mi) {
    float* y = o.out + (m0 + mi) * n + j0;
    __m512 y0 = _mm512_fmadd_ps(acc[mi][0], s0, _mm512_loadu_ps(y));
    __m512 y1 = _mm512_fmadd_ps(acc[mi][1], s1, _mm512_loadu_ps(y + 16));
    if (o.mn) {
      const float* mg = o.mn + gi * n + j0;
      const __m512 xs0 = _mm512_set1_ps(xsum[mi]);
      y0 = _mm512_fmadd_ps(xs0, _mm512_loadu_ps(mg), y0);
      y1 = _mm512_fmadd_ps(xs0, _mm512_loadu_ps(mg + 16), y1);
    }
    _mm512_storeu_ps(y, y0);
    _mm512_storeu_ps(y + 16, y1);
  }
}
#endif

// Outputs [jb, je) of y = x . W, every row of x (y's columns there zeroed first).
static void GroupedColumns(const Operands& o, int64_t n, int64_t jb, int64_t je) {
  const int64_t m = o.m, g = o.k / o.groups, w = je - jb;
  for (int64_t mi = 0; mi < m; ++mi)
    std::fill(o.out + mi * n + jb, o.out + mi * n + je, 0.0f);
#if defined(__AVX512F__)
  if (m > 1 && w % 32 == 0) {
    for (int64_t gi = 0; gi < o.groups; ++gi)
      for (int64_t j0 = jb; j0 < je; j0 += 32) {
        int64_t m0 = 0;
        for (; m0 + 8 <= m; m0 += 8) Micro<8>(o, n, g, gi, m0, j0);
        for (; m0 + 4 <= m; m0 += 4) Micro<4>(o, n, g, gi, m0, j0);
        for (; m0 < m; ++m0) Micro<1>(o, n, g, gi, m0, j0);
      }
    return;
  }
#endif
  std::vector<float> acc(m * w), values(w);
  for (int64_t gi = 0; gi < o.groups; ++gi) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t r = gi * g; r < (gi + 1) * g; ++r) {
      const int8_t* row = o.c + r * n + jb;
      if (m == 1) {  // convert while multiplying: the codes are read once
        const float xv = o.xs[r];
        float* a = acc.data();
        for (int64_t j = 0; j < w; ++j) a[j] += xv * static_cast<float>(row[j]);
        continue;
      }
      float* v = values.data();  // the row converted once, then used by every row of x
      for (int64_t j = 0; j < w; ++j) v[j] = static_cast<float>(row[j]);
      for (int64_t mi = 0; mi < m; ++mi) {
        const float xv = o.xs[mi * o.k + r];
        float* a = acc.data() + mi * w;
        for (int64_t j = 0; j < w; ++j) a[j] += xv * v[j];
      }
    }
    const float* sg = o.s + gi * n + jb;
    for (int64_t mi = 0; mi < m; ++mi) {
      float* y = o.out + mi * n + jb;
      const float* a = acc.data() + mi * w;
      for (int64_t j = 0; j < w; ++j) y[j] += a[j] * sg[j];
      if (o.mn) {
        float xsum = 0.0f;
        for (int64_t r = gi * g; r < (gi + 1) * g; ++r) xsum += o.xs[mi * o.k + r];
        const float* mg = o.mn + gi * n + jb;
        for (int64_t j = 0; j < w; ++j) y[j] += xsum * mg[j];
      }
    }
  }
}

static ffi::Error GroupedDot(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                             ffi::Buffer<ffi::S8> codes, ffi::Buffer<ffi::F32> scales,
                             ffi::Buffer<ffi::F32> mins, ffi::ResultBuffer<ffi::F32> y) {
  Operands o;
  int64_t n;
  if (ffi::Error error = Decode(x, codes, scales, mins, y, false, &o, &n); error.failure())
    return error;
  const int64_t grain = ColumnGrain(n, pool);
  ParallelFor(pool, n, grain, [&](int64_t jb, int64_t je) { GroupedColumns(o, n, jb, je); });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshserveGroupedDot, GroupedDot,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// Packed codes (4, 5 or 6 bits; `meshserve.model.quant_formats`): per unit of codes along K,
// rows of nibbles (code j in the low nibble, j + unit / 2 in the high one), then for 5 and 6
// bits the codes' top bits (8 or 4 codes a byte). An int4 kernel's unit is its group; a 5- or
// 6-bit kernel's is 32 codes, in 20 or 24 rows. A code is its stored value minus `offset`.
struct Packing {
  int64_t bits, offset, unit, unit_rows;
};

// Codes [unit, w] of unit `u`, columns [jb, jb + w), as floats into `buf`: each code read once.
static void DecodeUnit(const uint8_t* c, int64_t n, const Packing& p, int64_t u, int64_t jb,
                       int64_t w, float* buf) {
  const int64_t half = p.unit / 2, width = p.bits - 4;
  const uint8_t* base = c + u * p.unit_rows * n + jb;
  const float offset = static_cast<float>(p.offset);
  for (int64_t kk = 0; kk < p.unit; ++kk) {
    const uint8_t* nib = base + (kk % half) * n;
    const int shift = kk < half ? 0 : 4;
    float* out = buf + kk * w;
    if (width == 0) {
      for (int64_t j = 0; j < w; ++j) out[j] = static_cast<float>((nib[j] >> shift) & 15);
      continue;
    }
    const int64_t per_byte = 8 / width;
    const uint8_t* top = base + (half + kk / per_byte) * n;
    const int top_shift = static_cast<int>((kk % per_byte) * width), mask = (1 << width) - 1;
    for (int64_t j = 0; j < w; ++j)
      out[j] = static_cast<float>(((nib[j] >> shift) & 15) | (((top[j] >> top_shift) & mask) << 4))
               - offset;
  }
}

#if defined(__AVX512F__)
// As `Micro`, over codes already decoded to floats: `buf` [g, w] holds the group's codes for
// columns from the range's start; `jr` is j0's place in it.
template <int MC>
static void MicroDecoded(const Operands& o, int64_t n, const float* buf, int64_t w, int64_t g,
                         int64_t k0, int64_t gi, int64_t m0, int64_t j0, int64_t jr) {
  __m512 acc[MC][2];
  float xsum[MC];
  for (int mi = 0; mi < MC; ++mi) {
    acc[mi][0] = _mm512_setzero_ps();
    acc[mi][1] = _mm512_setzero_ps();
    xsum[mi] = 0.0f;
  }
  for (int64_t r = 0; r < g; ++r) {
    const __m512 v0 = _mm512_loadu_ps(buf + r * w + jr), v1 = _mm512_loadu_ps(buf + r * w + jr + 16);
    for (int mi = 0; mi < MC; ++mi) {
      const float xv = o.xs[(m0 + mi) * o.k + k0 + r];
      xsum[mi] += xv;
      const __m512 xb = _mm512_set1_ps(xv);
      acc[mi][0] = _mm512_fmadd_ps(xb, v0, acc[mi][0]);
      acc[mi][1] = _mm512_fmadd_ps(xb, v1, acc[mi][1]);
    }
  }
  const float* sg = o.s + gi * n + j0;
  const __m512 s0 = _mm512_loadu_ps(sg), s1 = _mm512_loadu_ps(sg + 16);
  for (int mi = 0; mi < MC; ++mi) {
    float* y = o.out + (m0 + mi) * n + j0;
    __m512 y0 = _mm512_fmadd_ps(acc[mi][0], s0, _mm512_loadu_ps(y));
    __m512 y1 = _mm512_fmadd_ps(acc[mi][1], s1, _mm512_loadu_ps(y + 16));
    if (o.mn) {
      const float* mg = o.mn + gi * n + j0;
      const __m512 xs0 = _mm512_set1_ps(xsum[mi]);
      y0 = _mm512_fmadd_ps(xs0, _mm512_loadu_ps(mg), y0);
      y1 = _mm512_fmadd_ps(xs0, _mm512_loadu_ps(mg + 16), y1);
    }
    _mm512_storeu_ps(y, y0);
    _mm512_storeu_ps(y + 16, y1);
  }
}
#endif

// One row of x, outputs [jb, je) of y (zeroed first), packed codes: each byte of nibbles is
// read once for its two codes (k and k + unit / 2), each multiplied by its own x into the sum
// of its group; a code's offset comes off once per group, as offset times the group's sum of x.
static void PackedOneRow(const Operands& o, const Packing& p, const uint8_t* c, int64_t n,
                         int64_t jb, int64_t je) {
  const int64_t g = o.k / o.groups, w = je - jb, half = p.unit / 2, width = p.bits - 4;
  const int64_t per_byte = width ? 8 / width : 1;
  const int mask = (1 << width) - 1;
  float* y = o.out + jb;
  std::fill(y, y + w, 0.0f);
  std::vector<float> acc(2 * w);
  for (int64_t u = 0; u < o.k / p.unit; ++u) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    const uint8_t* base = c + u * p.unit_rows * n + jb;
    const float* xu = o.xs + u * p.unit;
    for (int64_t r = 0; r < half; ++r) {
      const uint8_t* nib = base + r * n;
      const float xl = xu[r], xh = xu[r + half];
      float* al = acc.data() + (r / g) * w;  // the groups of codes r and r + half
      float* ah = acc.data() + ((r + half) / g) * w;
      if (width == 0) {
        if (al == ah) {
          for (int64_t j = 0; j < w; ++j) al[j] += xl * (nib[j] & 15) + xh * (nib[j] >> 4);
        } else {
          for (int64_t j = 0; j < w; ++j) al[j] += xl * (nib[j] & 15);
          for (int64_t j = 0; j < w; ++j) ah[j] += xh * (nib[j] >> 4);
        }
        continue;
      }
      const uint8_t* tl = base + (half + r / per_byte) * n;
      const uint8_t* th = base + (half + (r + half) / per_byte) * n;
      const int sl = static_cast<int>((r % per_byte) * width);
      const int sh = static_cast<int>(((r + half) % per_byte) * width);
      if (al == ah) {
        for (int64_t j = 0; j < w; ++j)
          al[j] += xl * ((nib[j] & 15) | (((tl[j] >> sl) & mask) << 4)) +
                   xh * ((nib[j] >> 4) | (((th[j] >> sh) & mask) << 4));
      } else {
        for (int64_t j = 0; j < w; ++j) al[j] += xl * ((nib[j] & 15) | (((tl[j] >> sl) & mask) << 4));
        for (int64_t j = 0; j < w; ++j) ah[j] += xh * ((nib[j] >> 4) | (((th[j] >> sh) & mask) << 4));
      }
    }
    for (int64_t k0 = u * p.unit; k0 < (u + 1) * p.unit; k0 += g) {
      const int64_t gi = k0 / g;
      float xsum = 0.0f;
      for (int64_t r = 0; r < g; ++r) xsum += o.xs[k0 + r];
      const float* a = acc.data() + (k0 - u * p.unit) / g * w;
      const float* sg = o.s + gi * n + jb;
      const float shift = static_cast<float>(p.offset) * xsum;
      for (int64_t j = 0; j < w; ++j) y[j] += (a[j] - shift) * sg[j];
      if (o.mn) {
        const float* mg = o.mn + gi * n + jb;
        for (int64_t j = 0; j < w; ++j) y[j] += xsum * mg[j];
      }
    }
  }
}

// Outputs [jb, je) of y = x . W for packed codes, every row of x: each unit's codes decoded once
// into a buffer in cache, then each of its groups multiplied by every row.
static void PackedColumns(const Operands& o, const Packing& p, const uint8_t* c, int64_t n,
                          int64_t jb, int64_t je) {
  const int64_t m = o.m, g = o.k / o.groups, w = je - jb, units = o.k / p.unit;
  if (m == 1) return PackedOneRow(o, p, c, n, jb, je);
  for (int64_t mi = 0; mi < m; ++mi)
    std::fill(o.out + mi * n + jb, o.out + mi * n + je, 0.0f);
  std::vector<float> buf(p.unit * w), acc(m * w);
  for (int64_t u = 0; u < units; ++u) {
    DecodeUnit(c, n, p, u, jb, w, buf.data());
    for (int64_t k0 = u * p.unit; k0 < (u + 1) * p.unit; k0 += g) {
      const int64_t gi = k0 / g;
      const float* group = buf.data() + (k0 - u * p.unit) * w;
#if defined(__AVX512F__)
      if (m > 1 && w % 32 == 0) {
        for (int64_t jr = 0; jr < w; jr += 32) {
          int64_t m0 = 0;
          for (; m0 + 8 <= m; m0 += 8) MicroDecoded<8>(o, n, group, w, g, k0, gi, m0, jb + jr, jr);
          for (; m0 + 4 <= m; m0 += 4) MicroDecoded<4>(o, n, group, w, g, k0, gi, m0, jb + jr, jr);
          for (; m0 < m; ++m0) MicroDecoded<1>(o, n, group, w, g, k0, gi, m0, jb + jr, jr);
        }
        continue;
      }
#endif
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t r = 0; r < g; ++r) {
        const float* v = group + r * w;
        for (int64_t mi = 0; mi < m; ++mi) {
          const float xv = o.xs[mi * o.k + k0 + r];
          float* a = acc.data() + mi * w;
          for (int64_t j = 0; j < w; ++j) a[j] += xv * v[j];
        }
      }
      const float* sg = o.s + gi * n + jb;
      for (int64_t mi = 0; mi < m; ++mi) {
        float* y = o.out + mi * n + jb;
        const float* a = acc.data() + mi * w;
        for (int64_t j = 0; j < w; ++j) y[j] += a[j] * sg[j];
        if (o.mn) {
          float xsum = 0.0f;
          for (int64_t r = 0; r < g; ++r) xsum += o.xs[mi * o.k + k0 + r];
          const float* mg = o.mn + gi * n + jb;
          for (int64_t j = 0; j < w; ++j) y[j] += xsum * mg[j];
        }
      }
    }
  }
}

static ffi::Error PackedDot(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                            ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::F32> scales,
                            ffi::Buffer<ffi::F32> mins, ffi::ResultBuffer<ffi::F32> y,
                            int64_t bits, int64_t offset) {
  const auto xd = x.dimensions(), cd = codes.dimensions(), sd = scales.dimensions();
  if (xd.size() != 2 || cd.size() != 2 || sd.size() != 2)
    return ffi::Error::InvalidArgument("x, codes and scales must be 2-D");
  const int64_t k = xd[1], n = cd[1], groups = sd[0];
  if (sd[1] != n || groups == 0 || k % groups || (bits != 4 && bits != 5 && bits != 6))
    return ffi::Error::InvalidArgument("shapes or bits do not agree");
  const int64_t g = k / groups, unit = bits == 4 ? g : 32;
  const Packing p{bits, offset, unit, unit / 2 + unit * (bits - 4) / 8};
  if (k % unit || cd[0] != k / unit * p.unit_rows)
    return ffi::Error::InvalidArgument("codes do not pack x's contracted axis");
  const auto md = mins.dimensions();
  const bool has_mins = md.size() == 2 && md[0] == groups && md[1] == n;
  const Operands o{xd[0], k, groups, x.typed_data(), nullptr, scales.typed_data(),
                   has_mins ? mins.typed_data() : nullptr, y->typed_data()};
  const uint8_t* c = codes.typed_data();
  const int64_t grain = ColumnGrain(n, pool);
  ParallelFor(pool, n, grain, [&](int64_t jb, int64_t je) { PackedColumns(o, p, c, n, jb, je); });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshservePackedDot, PackedDot,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("offset"));


#if defined(__AVX512F__)
// One row of x against VR rows of the table from `vi`: each group's codes are converted and
// multiplied by x in registers (never stored as floats), the group's partial sum takes its scale
// in the running sum (and x's group sum, `xsum`, the group's minimum), one reduction a row.
// The VR rows' sums are independent chains, so their latencies overlap. G a multiple of 16.
template <int VR>
static void TableOneRowMicro(const Operands& o, int64_t v, int64_t vi, const float* xsum) {
  const int64_t d = o.k, groups = o.groups, g = d / groups;
  __m512 total[VR];
  float low[VR];
  for (int a = 0; a < VR; ++a) {
    total[a] = _mm512_setzero_ps();
    low[a] = 0.0f;
  }
  for (int64_t gi = 0; gi < groups; ++gi) {
    __m512 part[VR];
    for (int a = 0; a < VR; ++a) part[a] = _mm512_setzero_ps();
    for (int64_t j = gi * g; j < (gi + 1) * g; j += 16) {
      const __m512 xv = _mm512_loadu_ps(o.xs + j);
      for (int a = 0; a < VR; ++a) {
        const int8_t* code = o.c + (vi + a) * d + j;
        const __m512 w = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(code))));
        part[a] = _mm512_fmadd_ps(w, xv, part[a]);
      }
    }
    for (int a = 0; a < VR; ++a) {
      total[a] = _mm512_fmadd_ps(part[a], _mm512_set1_ps(o.s[(vi + a) * groups + gi]), total[a]);
      if (o.mn) low[a] += o.mn[(vi + a) * groups + gi] * xsum[gi];
    }
  }
  for (int a = 0; a < VR; ++a) o.out[vi + a] = _mm512_reduce_add_ps(total[a]) + low[a];
}

// VR vocabulary rows (dequantized, `rows` [VR, D]) against MR rows of x from `m0`: the sums of
// VR x MR pairs stay in registers while each value of x is loaded once per VR rows; one
// reduction a pair at the end.
template <int VR, int MR>
static void TableMicro(const Operands& o, int64_t v, const float* rows, int64_t vi, int64_t m0) {
  const int64_t d = o.k;
  __m512 total[VR][MR];
  for (int a = 0; a < VR; ++a)
    for (int b = 0; b < MR; ++b) total[a][b] = _mm512_setzero_ps();
  for (int64_t j = 0; j < d; j += 16) {
    __m512 weight[VR];
    for (int a = 0; a < VR; ++a) weight[a] = _mm512_loadu_ps(rows + a * d + j);
    for (int b = 0; b < MR; ++b) {
      const __m512 xv = _mm512_loadu_ps(o.xs + (m0 + b) * d + j);
      for (int a = 0; a < VR; ++a) total[a][b] = _mm512_fmadd_ps(xv, weight[a], total[a][b]);
    }
  }
  for (int a = 0; a < VR; ++a)
    for (int b = 0; b < MR; ++b) o.out[(m0 + b) * v + vi + a] = _mm512_reduce_add_ps(total[a][b]);
}

// Every row of x against VR dequantized rows of the table, four rows of x at a time.
template <int VR>
static void TableBlock(const Operands& o, int64_t v, const float* rows, int64_t vi) {
  int64_t m0 = 0;
  for (; m0 + 4 <= o.m; m0 += 4) TableMicro<VR, 4>(o, v, rows, vi, m0);
  for (; m0 < o.m; ++m0) TableMicro<VR, 1>(o, v, rows, vi, m0);
}
#endif

// Vocabulary rows [vb, ve) of the tied LM head y [M, V] = x [M, D] . T [V, D]^T, where
// T = codes * scale (+ min) per group of G along D (a GGUF's `token_embd` layout). With AVX-512
// and D a multiple of 16: one row of x reads each row's codes straight into its dot
// (`TableOneRowMicro`); several rows dequantize four rows of the table at a time into a buffer
// in cache, then multiply them by every row of x (four of x at a time), so x is read once per
// four rows of the table. Otherwise each row of the table is dequantized and dotted plainly.
static void TableRows(const Operands& o, int64_t v, int64_t vb, int64_t ve) {
  const int64_t m = o.m, d = o.k, groups = o.groups, g = d / groups;
  constexpr int64_t kBlock = 4;
#if defined(__AVX512F__)
  if (m == 1 && g % 16 == 0) {
    std::vector<float> xsum(groups, 0.0f);
    for (int64_t gi = 0; gi < groups; ++gi)
      for (int64_t j = gi * g; j < (gi + 1) * g; ++j) xsum[gi] += o.xs[j];
    int64_t vi = vb;
    for (; vi + kBlock <= ve; vi += kBlock) TableOneRowMicro<kBlock>(o, v, vi, xsum.data());
    for (; vi < ve; ++vi) TableOneRowMicro<1>(o, v, vi, xsum.data());
    return;
  }
#endif
  std::vector<float> rows(kBlock * d);
  for (int64_t vi = vb; vi < ve; vi += kBlock) {
    const int64_t block = std::min<int64_t>(kBlock, ve - vi);
    for (int64_t a = 0; a < block; ++a) {
      const int8_t* code = o.c + (vi + a) * d;
      float* row = rows.data() + a * d;
      for (int64_t gi = 0; gi < groups; ++gi) {
        const float scale = o.s[(vi + a) * groups + gi];
        const float low = o.mn ? o.mn[(vi + a) * groups + gi] : 0.0f;
        for (int64_t j = gi * g; j < (gi + 1) * g; ++j)
          row[j] = static_cast<float>(code[j]) * scale + low;
      }
    }
#if defined(__AVX512F__)
    if (d % 16 == 0) {
      if (block == kBlock) {
        TableBlock<kBlock>(o, v, rows.data(), vi);
      } else {
        for (int64_t a = 0; a < block; ++a) TableBlock<1>(o, v, rows.data() + a * d, vi + a);
      }
      continue;
    }
#endif
    for (int64_t a = 0; a < block; ++a)
      for (int64_t mi = 0; mi < m; ++mi) {
        const float* xm = o.xs + mi * d;
        const float* row = rows.data() + a * d;
        float total = 0.0f;
        for (int64_t j = 0; j < d; ++j) total += xm[j] * row[j];
        o.out[mi * v + vi + a] = total;
      }
  }
}

static ffi::Error TableDot(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                           ffi::Buffer<ffi::S8> codes, ffi::Buffer<ffi::F32> scales,
                           ffi::Buffer<ffi::F32> mins, ffi::ResultBuffer<ffi::F32> y) {
  Operands o;
  int64_t v;
  if (ffi::Error error = Decode(x, codes, scales, mins, y, true, &o, &v); error.failure())
    return error;
  const int64_t grain = std::max<int64_t>(16, 65536 / std::max<int64_t>(o.k, 1)) / 2 * 2;
  ParallelFor(pool, v, grain, [&](int64_t vb, int64_t ve) { TableRows(o, v, vb, ve); });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshserveTableDot, TableDot,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
