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
// With AVX-512 VNNI, both layer kernels (int8 codes, and codes packed in 4, 5 or 6 bits:
// `PackedDot`) take integer dots in groups of 16 to 64. Each row of x is rounded per group to 16
// bits of the group's largest |x| (two int8 halves), `vpdpbusd` gives each column the exact int32
// dot of its codes with them, four values of K a lane (the codes transposed from their rows in
// registers), and the group's sum then takes its scales as a float partial sum does. The only
// rounding it adds is x's: at most 1/65024 of its group's largest |x| (at several rows, 1/256 of
// that for a row with a massive activation: `kWide`). Several rows run in blocks of 64 columns
// and four rows over the whole of K (`ManyRowsVnni`), prefill chunks included (up to 512 rows:
// `MeshserveMaxRows`). The table kernel takes integer dots too at several rows of x
// (`TableRowsVnni`; with AMX, tile multiplies of 16 rows of the table by 16 rows of x,
// `TableRowsAmx`); at one row it stays in floats. Without VNNI (or for other groups), the float
// paths.
//
// The kernels split their outputs into column (or vocabulary) ranges that run on XLA's
// intra-op threads and the calling one (`ParallelFor`): each range is claimed from a shared
// counter, so a task the pool starts late (or never) costs nothing but the caller's time.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

using meshserve_native::ParallelFor;


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
  // Packed codes' scales and minimums as a file stores them (float16), read in place of s and mn
  // by the integer path; nullptr: float32 in s and mn.
  const uint16_t* s_half = nullptr;
  const uint16_t* mn_half = nullptr;
};

// A float16 value as float32 (for kernels that read float16 scales through float32 buffers).
static float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exponent = (h >> 10) & 31;
  uint32_t mantissa = h & 0x3FFu, bits;
  if (exponent == 31) {
    bits = sign | 0x7F800000u | (mantissa << 13);  // infinity, NaN
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: mantissa * 2^-24, normalized
    uint32_t shifts = 0;
    while (!(mantissa & 0x400u)) {
      mantissa <<= 1;
      ++shifts;
    }
    bits = sign | ((113 - shifts) << 23) | ((mantissa & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// One layer's matrix of an operand: the operand is that layer's own [R, C] (whatever the layer
// index), or every layer's stacked [L, R, C] (a scanned model's weights), whose layer `layer` is
// read where it lies (the index is an int32 scalar operand, in host memory on the CPU); `offset`
// counts the elements before it. No layer index (`layer` nullptr, the table kernel): 2-D
// operands only.
struct LayerMatrix {
  int64_t rows, cols, offset;
};

static ffi::Error SelectLayer(ffi::Span<const int64_t> dims, const int32_t* layer,
                              LayerMatrix* matrix) {
  if (dims.size() == 2) {
    *matrix = LayerMatrix{dims[0], dims[1], 0};
    return ffi::Error::Success();
  }
  if (dims.size() != 3 || layer == nullptr)
    return ffi::Error::InvalidArgument(
        "codes, scales and mins must be 2-D, or 3-D stacks with a layer index");
  if (*layer < 0 || *layer >= dims[0])
    return ffi::Error::InvalidArgument("layer index " + std::to_string(*layer) +
                                       " is outside the stack of " + std::to_string(dims[0]));
  *matrix = LayerMatrix{dims[1], dims[2], *layer * dims[1] * dims[2]};
  return ffi::Error::Success();
}

// Checks the int8 layer kernel's shapes: codes [K, N] with scales [K / G, N], each of codes,
// scales and mins 2-D or a stack of them, which `layer` picks (`SelectLayer`); `width` is N.
static ffi::Error Decode(ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::S8>& codes,
                         ffi::Buffer<ffi::F32>& scales, ffi::Buffer<ffi::F32>& mins,
                         ffi::ResultBuffer<ffi::F32>& y, const int32_t* layer, Operands* ops,
                         int64_t* width) {
  const auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("x must be 2-D");
  LayerMatrix cm, sm, mm;
  for (auto [dims, matrix] : {std::pair{codes.dimensions(), &cm}, {scales.dimensions(), &sm},
                              {mins.dimensions(), &mm}})
    if (ffi::Error error = SelectLayer(dims, layer, matrix); error.failure()) return error;
  const int64_t k = xd[1];
  const int64_t outputs = cm.cols, groups = sm.rows;
  if (cm.rows != k || sm.cols != outputs || groups == 0 || k % groups)
    return ffi::Error::InvalidArgument("shapes do not agree");
  const bool has_mins = mm.rows == sm.rows && mm.cols == sm.cols;
  *ops = Operands{xd[0], k, groups, x.typed_data(), codes.typed_data() + cm.offset,
                  scales.typed_data() + sm.offset,
                  has_mins ? mins.typed_data() + mm.offset : nullptr, y->typed_data()};
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

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// y = x . W through integer dots (below), where they serve W's groups; false where not.
static bool IntegerGroupedDot(ffi::ThreadPool& pool, const Operands& o, int64_t n, int64_t grain);
#endif

static ffi::Error GroupedDot(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                             ffi::Buffer<ffi::S8> codes, ffi::Buffer<ffi::F32> scales,
                             ffi::Buffer<ffi::F32> mins, ffi::BufferR0<ffi::S32> layer,
                             ffi::ResultBuffer<ffi::F32> y) {
  Operands o;
  int64_t n;
  if (ffi::Error error = Decode(x, codes, scales, mins, y, layer.typed_data(), &o, &n);
      error.failure())
    return error;
  const int64_t grain = ColumnGrain(n, pool);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if (IntegerGroupedDot(pool, o, n, grain)) return ffi::Error::Success();
#endif
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
                                  .Arg<ffi::BufferR0<ffi::S32>>()
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

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// Integer dots for packed codes (AVX-512 VNNI). Each row of x is rounded per group of G to 16
// bits of its group's largest |x|: x ~ scale * (hi * 256 + lo), hi and lo int8, scale that
// largest value / 32512, so x is off by at most half a scale, the only rounding the method
// adds. `vpdpbusd` multiplies four codes (unsigned bytes) by four bytes of hi (and of lo) into
// one int32 lane, 64 products an instruction: two of them give each column the exact integer dot
// of its codes with a group of x; that int32 sum then takes x's scale and the codes' scale (and
// the minimum times x's rounded group sum) in floats, as the float path's group sums do.
//
// `vpdpbusd` wants the four codes of a lane to be four values of K of one column, while the
// codes are stored as rows of K with N contiguous: four rows of bytes are transposed in registers
// (`NibbleQuads`) into 4 vectors of 16 columns, each column's dword holding codes k .. k + 3.
constexpr int32_t kXRange = 127 * 256;  // the largest |hi * 256 + lo|: hi stays in [-127, 127]

// A row of x is wide when its largest |x| exceeds this many times its mean |x| (about 4 times
// in a row of normal values): a massive activation (SmolLM2's down projection, at the first token
// of a prompt, holds values hundreds of times the rest of their group), which 16 bits of the
// group's largest |x| leave the other values a few bits of. The several-row layer kernels give a
// wide row 8 more bits (`third`).
constexpr float kWide = 128.0f;

// x [M, K] rounded per group of G (G a multiple of 16): x[m, k] ~ scale[m, k / G] *
// (hi * 256 + lo)[m, k], lo in [-128, 127]; a wide row to 24 bits, x[m, k] ~ scale[m, k / G] *
// (hi * 256 + lo + third / 256)[m, k].
struct RoundedX {
  int64_t k, groups;
  std::vector<int8_t> hi, lo;       // [M, K]
  std::vector<float> scale;         // [M, K / G]
  std::vector<int32_t> sum;         // [M, K / G]: the group's sum of hi * 256 + lo
  std::vector<uint8_t> wide;        // [M]
  std::vector<int8_t> third;        // [M, K]: zero in rows that are not wide
  std::vector<int32_t> third_sum;   // [M, K / G]
};

// x rounded, its rows split into ranges of about 16384 values on the pool's threads: a prefill
// chunk's 512 rows of 1536 values took 0.35 ms on one thread, 6% of the dot's time.
static RoundedX RoundX(const Operands& o, ffi::ThreadPool& pool) {
  const int64_t g = o.k / o.groups;
  RoundedX r{o.k,
             o.groups,
             std::vector<int8_t>(o.m * o.k),
             std::vector<int8_t>(o.m * o.k),
             std::vector<float>(o.m * o.groups),
             std::vector<int32_t>(o.m * o.groups),
             std::vector<uint8_t>(o.m),
             std::vector<int8_t>(o.m * o.k),
             std::vector<int32_t>(o.m * o.groups)};
  const __m512i limit = _mm512_set1_epi32(kXRange), half_step = _mm512_set1_epi32(128);
  const __m512i byte = _mm512_set1_epi32(127);
  const auto round = [&](int64_t mb, int64_t me) {
    for (int64_t m = mb; m < me; ++m) {
      __m512 sizes = _mm512_setzero_ps(), largest = _mm512_setzero_ps();
      for (int64_t j = 0; j < o.k; j += 16) {
        const __m512 v = _mm512_abs_ps(_mm512_loadu_ps(o.xs + m * o.k + j));
        sizes = _mm512_add_ps(sizes, v);
        largest = _mm512_max_ps(largest, v);
      }
      const bool wide = _mm512_reduce_max_ps(largest) * o.k > kWide * _mm512_reduce_add_ps(sizes);
      r.wide[m] = wide;
      for (int64_t i = m * o.groups; i < (m + 1) * o.groups; ++i) {  // group i % groups
        const float* x = o.xs + i * g;
        __m512 top_group = _mm512_setzero_ps();
        __mmask16 nan = 0;  // max drops NaNs: a NaN in x makes the group's scale NaN, as in floats
        for (int64_t j = 0; j < g; j += 16) {
          const __m512 v = _mm512_loadu_ps(x + j);
          top_group = _mm512_max_ps(top_group, _mm512_abs_ps(v));
          nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        }
        const float top = _mm512_reduce_max_ps(top_group), scale = top / kXRange;
        const __m512 inverse = _mm512_set1_ps(top > 0.0f ? kXRange / top : 0.0f);
        __m512i total = _mm512_setzero_si512(), third_total = _mm512_setzero_si512();
        for (int64_t j = 0; j < g; j += 16) {
          const __m512 v = _mm512_loadu_ps(x + j);
          __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v, inverse));  // nearest
          q = _mm512_max_epi32(_mm512_min_epi32(q, limit),
                               _mm512_sub_epi32(_mm512_setzero_si512(), limit));
          const __m512i hi = _mm512_srai_epi32(_mm512_add_epi32(q, half_step), 8);  // q / 256
          const __m512i lo = _mm512_sub_epi32(q, _mm512_slli_epi32(hi, 8));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(r.hi.data() + i * g + j),
                           _mm512_cvtepi32_epi8(hi));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(r.lo.data() + i * g + j),
                           _mm512_cvtepi32_epi8(lo));
          total = _mm512_add_epi32(total, q);
          if (wide) {  // what q leaves of x (at most half a step, one rounding), in 1/256 steps
            const __m512 rest = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(scale), v);
            __m512i t = _mm512_cvtps_epi32(
                _mm512_mul_ps(rest, _mm512_mul_ps(inverse, _mm512_set1_ps(256.0f))));
            t = _mm512_max_epi32(_mm512_min_epi32(t, byte),
                                 _mm512_sub_epi32(_mm512_setzero_si512(), byte));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(r.third.data() + i * g + j),
                             _mm512_cvtepi32_epi8(t));
            third_total = _mm512_add_epi32(third_total, t);
          }
        }
        r.scale[i] = nan ? std::numeric_limits<float>::quiet_NaN() : scale;
        r.sum[i] = _mm512_reduce_add_epi32(total);
        r.third_sum[i] = _mm512_reduce_add_epi32(third_total);
      }
    }
  };
  ParallelFor(pool, o.m, std::max<int64_t>(1, 16384 / o.k), round);
  return r;
}

// A row of 64 bytes of codes (those of `mask`), its dwords reordered so that two levels of
// in-lane unpacking leave the columns in order: lane L holds columns 4L .. 4L + 3, 16 + 4L ..,
// 32 + 4L .., 48 + 4L ...
static inline __m512i RowForUnpack(const uint8_t* row, __mmask64 mask) {
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_epi32(order, _mm512_maskz_loadu_epi8(mask, row));
}

// Four rows of nibbles from `row` (stride n), 64 columns -> low[v] and high[v], the columns
// 16 v .. 16 v + 15: a dword a column, whose bytes are the four rows' low nibbles (low) or high
// ones (high), in row order.
static inline void NibbleQuads(const uint8_t* row, int64_t n, __mmask64 mask, __m512i low[4],
                               __m512i high[4]) {
  const __m512i r0 = RowForUnpack(row, mask), r1 = RowForUnpack(row + n, mask);
  const __m512i r2 = RowForUnpack(row + 2 * n, mask), r3 = RowForUnpack(row + 3 * n, mask);
  const __m512i nibble = _mm512_set1_epi8(15);
  // words [row 0, row 1] (a, b) and [row 2, row 3] (c, d) of a column: a and c the columns of
  // bytes 0..7 of each lane, b and d those of bytes 8..15
  const __m512i a = _mm512_unpacklo_epi8(r0, r1), b = _mm512_unpackhi_epi8(r0, r1);
  const __m512i c = _mm512_unpacklo_epi8(r2, r3), d = _mm512_unpackhi_epi8(r2, r3);
  const auto low_of = [&](__m512i w) { return _mm512_and_si512(w, nibble); };
  const auto high_of = [&](__m512i w) { return _mm512_and_si512(_mm512_srli_epi16(w, 4), nibble); };
  const __m512i al = low_of(a), ah = high_of(a), bl = low_of(b), bh = high_of(b);
  const __m512i cl = low_of(c), ch = high_of(c), dl = low_of(d), dh = high_of(d);
  low[0] = _mm512_unpacklo_epi16(al, cl);
  low[1] = _mm512_unpackhi_epi16(al, cl);
  low[2] = _mm512_unpacklo_epi16(bl, dl);
  low[3] = _mm512_unpackhi_epi16(bl, dl);
  high[0] = _mm512_unpacklo_epi16(ah, ch);
  high[1] = _mm512_unpackhi_epi16(ah, ch);
  high[2] = _mm512_unpacklo_epi16(bh, dh);
  high[3] = _mm512_unpackhi_epi16(bh, dh);
}

#if defined(__AVX512VBMI__)
// Codes 4q .. 4q + 3 of a unit of 5- or 6-bit codes (kWidth top bits a code), their nibbles in
// `quad`: the top bits from `top`, the row that holds them (64 columns), ORed in above each nibble.
// Each column's top byte is widened to a dword, from which one `vpmultishiftqb` moves code t's bits
// to bit 4 of byte t (a rotation of the qword of two columns, which reads only zero bytes besides).
template <int kWidth>
static inline void AddTopBits(const uint8_t* top, int64_t q, __mmask64 mask, __m512i quad[4]) {
  const int64_t first = kWidth == 2 ? 0 : 4 * (q % 2);  // bit of code 4q's top bits in its byte
  uint64_t control = 0;
  for (int t = 0; t < 4; ++t) {
    const int64_t bit = first + kWidth * t;
    control |= static_cast<uint64_t>((bit - 4) & 63) << (8 * t);
    control |= static_cast<uint64_t>((32 + bit - 4) & 63) << (8 * (t + 4));
  }
  const __m512i spread = _mm512_set1_epi64(static_cast<int64_t>(control));
  const __m512i keep = _mm512_set1_epi8(static_cast<char>(((1 << kWidth) - 1) << 4));
  for (int v = 0; v < 4; ++v) {
    const __m512i bytes = _mm512_cvtepu8_epi32(
        _mm_maskz_loadu_epi8(static_cast<__mmask16>(mask >> (16 * v)), top + 16 * v));
    quad[v] = _mm512_ternarylogic_epi32(_mm512_multishift_epi64_epi8(spread, bytes), keep, quad[v],
                                        0xEA);  // (spread & keep) | quad
  }
}
#endif

// Codes of unit rows 4 rb .. 4 rb + 3 of nibbles, 64 columns from `base` (the unit's first row at
// the block's first column): codes 4 rb .. 4 rb + 3 of the unit (low) and half + 4 rb .. (high),
// with their top bits for 5 and 6 bits.
template <int kWidth>
static inline void DecodeQuads(const uint8_t* base, int64_t n, int64_t half, int64_t rb,
                               __mmask64 mask, __m512i low[4], __m512i high[4]) {
  NibbleQuads(base + 4 * rb * n, n, mask, low, high);
#if defined(__AVX512VBMI__)
  if constexpr (kWidth > 0) {
    const int64_t per_byte = 8 / kWidth, q_low = rb, q_high = half / 4 + rb;
    AddTopBits<kWidth>(base + (half + 4 * q_low / per_byte) * n, q_low, mask, low);
    AddTopBits<kWidth>(base + (half + 4 * q_high / per_byte) * n, q_high, mask, high);
  }
#endif
}

// Four bytes of x (values k .. k + 3 of its hi or lo) in every lane, as `vpdpbusd` pairs them.
static inline __m512i FourBytes(const int8_t* bytes) {
  int32_t word;
  std::memcpy(&word, bytes, sizeof word);
  return _mm512_set1_epi32(word);
}

// The next unit's rows of the block starting at `next` (its first row) fetched into cache while
// this one is multiplied: the rows of a block are 16 or more streams at a stride of N, which the
// hardware's prefetchers do not follow far enough ahead on their own.
static inline void PrefetchUnit(const uint8_t* next, int64_t n, int64_t rows) {
  for (int64_t r = 0; r < rows; ++r)
    _mm_prefetch(reinterpret_cast<const char*>(next + r * n), _MM_HINT_T0);
}

static inline __mmask64 ColumnMask(int64_t count) {
  return count >= 64 ? ~__mmask64{0} : (__mmask64{1} << count) - 1;
}

// 16 scales or minimums [K / G, N] from `at` (those of `keep`), stored as float16 or float32.
static inline __m512 GroupRow(const float* f, const uint16_t* h, int64_t at, __mmask16 keep) {
  if (h) return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(keep, h + at));
  return _mm512_maskz_loadu_ps(keep, f + at);
}

// y[m, j0 .. min(j0 + 64, je)) += group gi's sums of the codes times x's rounded row m (hi * 256
// + lo; less offset times x's group sum), times x's scale and the codes' scales, plus the codes'
// minimums times x's rounded group sum.
static inline void AddGroup(const Operands& o, const Packing& p, const RoundedX& x, int64_t n,
                            int64_t m, int64_t gi, int64_t j0, int64_t je, const __m512i hi[4],
                            const __m512i lo[4]) {
  const float scale = x.scale[m * x.groups + gi];
  const int32_t sum = x.sum[m * x.groups + gi];
  const __m512 xs = _mm512_set1_ps(scale), xsum = _mm512_set1_ps(scale * static_cast<float>(sum));
  const __m512i shift = _mm512_set1_epi32(static_cast<int32_t>(p.offset) * sum);
  for (int v = 0; v < 4 && j0 + 16 * v < je; ++v) {
    const int64_t j = j0 + 16 * v;
    const __mmask16 keep = je - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (je - j)) - 1);
    const __m512i total =
        _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(hi[v], 8), lo[v]), shift);
    const __m512 dot = _mm512_mul_ps(_mm512_cvtepi32_ps(total), xs);
    float* y = o.out + m * n + j;
    __m512 acc = _mm512_fmadd_ps(dot, GroupRow(o.s, o.s_half, gi * n + j, keep),
                                 _mm512_maskz_loadu_ps(keep, y));
    if (o.mn || o.mn_half)
      acc = _mm512_fmadd_ps(xsum, GroupRow(o.mn, o.mn_half, gi * n + j, keep), acc);
    _mm512_mask_storeu_ps(y, keep, acc);
  }
}

// One row of x, outputs [jb, je) of y (zeroed first), packed codes: per unit and block of 64
// columns, each group of four rows of nibbles is transposed in registers into the codes of two
// quads of K (its low and its high nibbles), which `vpdpbusd` multiplies by x's hi and lo bytes
// into int32 sums per column, [group of the unit][16 columns] (a unit holds one group, or two of
// 16 codes for Q6_K: the low nibbles' and the high ones').
template <int kWidth, bool kTwoGroups>
static void PackedOneRowVnni(const Operands& o, const Packing& p, const uint8_t* c, int64_t n,
                             const RoundedX& x, int64_t jb, int64_t je) {
  const int64_t g = o.k / o.groups, half = p.unit / 2;
  std::fill(o.out + jb, o.out + je, 0.0f);
  constexpr int second = kTwoGroups ? 1 : 0;  // the group of the high nibbles' codes
  for (int64_t u = 0; u < o.k / p.unit; ++u) {
    const int64_t k0 = u * p.unit;
    for (int64_t j0 = jb; j0 < je; j0 += 64) {
      const uint8_t* base = c + u * p.unit_rows * n + j0;
      if (u + 1 < o.k / p.unit) PrefetchUnit(base + p.unit_rows * n, n, p.unit_rows);
      const __mmask64 mask = ColumnMask(je - j0);
      __m512i hi[2][4], lo[2][4];  // [group of the unit][16 columns]
      for (int a = 0; a < 2; ++a)
        for (int v = 0; v < 4; ++v) hi[a][v] = lo[a][v] = _mm512_setzero_si512();
      for (int64_t rb = 0; rb < half / 4; ++rb) {
        __m512i low[4], high[4];
        DecodeQuads<kWidth>(base, n, half, rb, mask, low, high);
        const int64_t kl = k0 + 4 * rb, kh = k0 + half + 4 * rb;  // their first values of K
        const __m512i lh = FourBytes(x.hi.data() + kl);
        const __m512i ll = FourBytes(x.lo.data() + kl);
        const __m512i hh = FourBytes(x.hi.data() + kh);
        const __m512i hl = FourBytes(x.lo.data() + kh);
        for (int v = 0; v < 4; ++v) {
          hi[0][v] = _mm512_dpbusd_epi32(hi[0][v], low[v], lh);
          lo[0][v] = _mm512_dpbusd_epi32(lo[0][v], low[v], ll);
          hi[second][v] = _mm512_dpbusd_epi32(hi[second][v], high[v], hh);
          lo[second][v] = _mm512_dpbusd_epi32(lo[second][v], high[v], hl);
        }
      }
      for (int a = 0; a <= second; ++a) AddGroup(o, p, x, n, 0, k0 / g + a, j0, je, hi[a], lo[a]);
    }
  }
}

// Four rows of int8 codes from `row` (stride n), 64 columns -> quad[v], the columns 16 v ..
// 16 v + 15: a dword a column holding the four rows' codes plus 128, as unsigned bytes for
// `vpdpbusd` (128 times x's group sum comes off after, as a packed code's offset does).
static inline void ByteQuads(const int8_t* row, int64_t n, __mmask64 mask, __m512i quad[4]) {
  const uint8_t* r = reinterpret_cast<const uint8_t*>(row);
  const __m512i r0 = RowForUnpack(r, mask), r1 = RowForUnpack(r + n, mask);
  const __m512i r2 = RowForUnpack(r + 2 * n, mask), r3 = RowForUnpack(r + 3 * n, mask);
  const __m512i a = _mm512_unpacklo_epi8(r0, r1), b = _mm512_unpackhi_epi8(r0, r1);
  const __m512i c = _mm512_unpacklo_epi8(r2, r3), d = _mm512_unpackhi_epi8(r2, r3);
  const __m512i flip = _mm512_set1_epi8(-128);  // code ^ 0x80 = code + 128 as an unsigned byte
  quad[0] = _mm512_xor_si512(_mm512_unpacklo_epi16(a, c), flip);
  quad[1] = _mm512_xor_si512(_mm512_unpackhi_epi16(a, c), flip);
  quad[2] = _mm512_xor_si512(_mm512_unpacklo_epi16(b, d), flip);
  quad[3] = _mm512_xor_si512(_mm512_unpackhi_epi16(b, d), flip);
}

// Several rows of x (decode batches, and prefill chunks of up to 512 rows). Per block of 64
// columns and chunk of rows, every code of K is transposed once into quads (K bytes a column, in
// cache: 36 KiB at K = 576, 96 KiB at 1536) and the block's scales and minimums converted once to
// float32; then each block of four rows runs the whole of K against them, its float sums of 4
// rows x 32 columns held in registers beside a group's int32 sums (hi and lo), and y is written
// once. Adding each group's sums into y instead (y's rows read and written, the scales converted,
// per group and row) costs about as much as the dots at many rows: SmolLM2's Q4_1 gate (576 x
// 1536) at 272 rows took 3.96 ms that way against 2.71 ms so, and XLA's dequantize-and-dot 3.90
// ms (`scripts/quantized_dot_ffi/rows.py`, medians, a loaded 2-core machine). A code's offset
// comes off in integers: the lo sums start at minus offset times x's group sum. A tile issues
// about 76 other vector instructions beside 128 `vpdpbusd` (the group's sums into floats, the
// registers' initial values), and runs at about 60% of `vpdpbusd`'s peak. Tried and measured
// slower: `vpdpwssd` on x rounded once to int16 and codes widened to int16 pairs (one sum a
// column instead of hi and lo, but twice the decoded codes' bytes): 5.95 against 5.65 ms at 512
// rows, 0.32 against 0.20 at 16.

// MR rows of x (`rows`; kThird: wide rows, their third byte too) against 32 columns of a block
// (half h), the whole of K.
template <int MR, int G, bool kMins, bool kThird = false>
static inline void ManyRowsMicroVnni(const RoundedX& x, const __m512i (*quads)[4],
                                     const float* scale, const float* low, int64_t offset,
                                     const int64_t* rows, int h, float* y, int64_t n,
                                     const __mmask16 keep[2]) {
  __m512 acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t gi = 0; gi < x.groups; ++gi) {
    __m512i hi[MR][2], lo[MR][2], third[MR][2];
    for (int r = 0; r < MR; ++r) {
      const int64_t at = rows[r] * x.groups + gi;
      hi[r][0] = hi[r][1] = _mm512_setzero_si512();
      lo[r][0] = lo[r][1] = _mm512_set1_epi32(static_cast<int32_t>(-offset * x.sum[at]));
      if constexpr (kThird)
        third[r][0] = third[r][1] =
            _mm512_set1_epi32(static_cast<int32_t>(-offset * x.third_sum[at]));
    }
    const __m512i (*group)[4] = quads + gi * G / 4;
#pragma GCC unroll 16
    for (int q = 0; q < G / 4; ++q) {
      const __m512i c0 = group[q][2 * h], c1 = group[q][2 * h + 1];
      for (int r = 0; r < MR; ++r) {
        const int64_t k = rows[r] * x.k + gi * G + 4 * q;
        const __m512i bh = FourBytes(x.hi.data() + k), bl = FourBytes(x.lo.data() + k);
        hi[r][0] = _mm512_dpbusd_epi32(hi[r][0], c0, bh);
        hi[r][1] = _mm512_dpbusd_epi32(hi[r][1], c1, bh);
        lo[r][0] = _mm512_dpbusd_epi32(lo[r][0], c0, bl);
        lo[r][1] = _mm512_dpbusd_epi32(lo[r][1], c1, bl);
        if constexpr (kThird) {
          const __m512i bt = FourBytes(x.third.data() + k);
          third[r][0] = _mm512_dpbusd_epi32(third[r][0], c0, bt);
          third[r][1] = _mm512_dpbusd_epi32(third[r][1], c1, bt);
        }
      }
    }
    const float* sg = scale + gi * 64 + 32 * h;
    const float* mg = low + gi * 64 + 32 * h;
    for (int r = 0; r < MR; ++r) {
      const int64_t at = rows[r] * x.groups + gi;
      // a wide row's sums in units of 1/256 of a step (hi * 65536 + lo * 256 + third): in floats,
      // past int32's range
      const float unit = kThird ? 1.0f / 256 : 1.0f;
      const __m512 xs = _mm512_set1_ps(x.scale[at] * unit);
      const __m512 sum = _mm512_set1_ps(
          kThird ? 256.0f * x.sum[at] + x.third_sum[at] : static_cast<float>(x.sum[at]));
      for (int v = 0; v < 2; ++v) {
        const __m512i total = _mm512_add_epi32(_mm512_slli_epi32(hi[r][v], 8), lo[r][v]);
        __m512 dot = _mm512_cvtepi32_ps(total);
        if constexpr (kThird)
          dot = _mm512_fmadd_ps(dot, _mm512_set1_ps(256.0f), _mm512_cvtepi32_ps(third[r][v]));
        __m512 part = _mm512_mul_ps(dot, _mm512_load_ps(sg + 16 * v));
        if constexpr (kMins) part = _mm512_fmadd_ps(sum, _mm512_load_ps(mg + 16 * v), part);
        acc[r][v] = _mm512_fmadd_ps(xs, part, acc[r][v]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < 2; ++v)
      if (keep[v]) _mm512_mask_storeu_ps(y + rows[r] * n + 16 * v, keep[v], acc[r][v]);
}

// Rows [mb, me) of x against one block of 64 columns from `y`'s first, codes in groups of G: the
// rows that are not wide in blocks of four (then the rest), the wide ones in pairs.
template <int G, bool kMins>
static void ManyRowsBlockVnni(const RoundedX& x, int64_t mb, int64_t me,
                              const __m512i (*quads)[4], const float* scale, const float* low,
                              int64_t offset, float* y, int64_t n, int64_t columns) {
  std::vector<int64_t> narrow, wide;
  for (int64_t m = mb; m < me; ++m) (x.wide[m] ? wide : narrow).push_back(m);
  const int64_t count = static_cast<int64_t>(narrow.size());
  for (int h = 0; h < 2 && 32 * h < columns; ++h) {
    __mmask16 keep[2];
    for (int v = 0; v < 2; ++v) {
      const int64_t left = columns - 32 * h - 16 * v;
      keep[v] = left >= 16 ? 0xFFFF : left <= 0 ? 0 : static_cast<__mmask16>((1u << left) - 1);
    }
    float* yh = y + 32 * h;
    const int64_t* rows = narrow.data();
    int64_t i = 0;
    for (; i + 4 <= count; i += 4)
      ManyRowsMicroVnni<4, G, kMins>(x, quads, scale, low, offset, rows + i, h, yh, n, keep);
    const int64_t* rest = rows + i;
    switch (count - i) {
      case 3: ManyRowsMicroVnni<3, G, kMins>(x, quads, scale, low, offset, rest, h, yh, n, keep);
              break;
      case 2: ManyRowsMicroVnni<2, G, kMins>(x, quads, scale, low, offset, rest, h, yh, n, keep);
              break;
      case 1: ManyRowsMicroVnni<1, G, kMins>(x, quads, scale, low, offset, rest, h, yh, n, keep);
              break;
    }
    const int64_t pairs = static_cast<int64_t>(wide.size()) / 2 * 2;
    for (i = 0; i < pairs; i += 2)
      ManyRowsMicroVnni<2, G, kMins, true>(x, quads, scale, low, offset, wide.data() + i, h, yh, n,
                                           keep);
    if (pairs < static_cast<int64_t>(wide.size()))
      ManyRowsMicroVnni<1, G, kMins, true>(x, quads, scale, low, offset, wide.data() + pairs, h,
                                           yh, n, keep);
  }
}

// `ManyRowsBlockVnni` for groups of g (16, 32, 48 or 64).
template <bool kMins>
static auto ManyRowsBlockFor(int64_t g) {
  switch (g) {
    case 16: return ManyRowsBlockVnni<16, kMins>;
    case 32: return ManyRowsBlockVnni<32, kMins>;
    case 48: return ManyRowsBlockVnni<48, kMins>;
    default: return ManyRowsBlockVnni<64, kMins>;
  }
}

// Columns [j0, j0 + 64) of y (those below n), rows [mb, me) of x, codes of an offset `offset`:
// `decode(j0, mask, quads)` transposes all of K's codes of those columns (those of `mask`) into
// `quads` [K / 4][16 columns].
template <typename Decode>
static void ManyRowsVnni(const Operands& o, const RoundedX& x, int64_t offset, int64_t n,
                         int64_t j0, int64_t mb, int64_t me, const Decode& decode) {
  const int64_t g = o.k / o.groups;
  const bool mins = o.mn || o.mn_half;
  std::vector<__m512i> quads(o.k);  // [K / 4][4]
  std::vector<__m512> scales(o.groups * 4), lows(mins ? o.groups * 4 : 0);  // [groups][64]
  float* scale = reinterpret_cast<float*>(scales.data());
  float* low = reinterpret_cast<float*>(lows.data());
  const auto block = reinterpret_cast<__m512i (*)[4]>(quads.data());
  const __mmask64 mask = ColumnMask(n - j0);
  decode(j0, mask, block);
  for (int64_t gi = 0; gi < o.groups; ++gi)
    for (int v = 0; v < 4; ++v) {
      const __mmask16 keep = static_cast<__mmask16>(mask >> (16 * v));
      const int64_t at = gi * n + j0 + 16 * v;
      _mm512_store_ps(scale + gi * 64 + 16 * v, GroupRow(o.s, o.s_half, at, keep));
      if (mins) _mm512_store_ps(low + gi * 64 + 16 * v, GroupRow(o.mn, o.mn_half, at, keep));
    }
  const auto run = mins ? ManyRowsBlockFor<true>(g) : ManyRowsBlockFor<false>(g);
  run(x, mb, me, block, scale, low, offset, o.out + j0, n, std::min<int64_t>(64, n - j0));
}

// The rows of x a work item of `ManyRowsParallel` takes at most: at 512 rows (a prefill chunk's
// bucket), four items a block of columns, so that narrow kernels (k and v: 192 columns, three
// blocks) still keep every thread busy; a block's codes are decoded once an item.
constexpr int64_t kRowChunk = 128;

// `ManyRowsVnni` over every block of 64 columns and chunk of rows (about equal, in fours), claimed
// one at a time on the pool's threads and this one.
template <typename Decode>
static void ManyRowsParallel(ffi::ThreadPool& pool, const Operands& o, const RoundedX& x,
                             int64_t offset, int64_t n, const Decode& decode) {
  const int64_t chunks = (o.m + kRowChunk - 1) / kRowChunk;
  const int64_t rows = ((o.m + chunks - 1) / chunks + 3) / 4 * 4;
  ParallelFor(pool, (n + 63) / 64 * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t mb = i % chunks * rows;
      if (mb < o.m) ManyRowsVnni(o, x, offset, n, i / chunks * 64, mb, std::min(o.m, mb + rows),
                                 decode);
    }
  });
}

// Int8 codes [K, N] in groups of G (GGUF's Q8_0), outputs [jb, je) of y, one row of x: per group
// and block of 64 columns, the group's rows transposed into quads in registers and multiplied as
// packed codes are, with an offset of 128.
static void GroupedColumnsVnni(const Operands& o, const RoundedX& x, int64_t n, int64_t jb,
                               int64_t je) {
  const int64_t g = o.k / o.groups;
  const Packing p{8, 128, g, g};
  std::fill(o.out + jb, o.out + je, 0.0f);
  for (int64_t gi = 0; gi < o.groups; ++gi) {
    for (int64_t j0 = jb; j0 < je; j0 += 64) {
      const int8_t* base = o.c + gi * g * n + j0;
      if (gi + 1 < o.groups) PrefetchUnit(reinterpret_cast<const uint8_t*>(base + g * n), n, g);
      const __mmask64 mask = ColumnMask(je - j0);
      __m512i hi[4], lo[4];  // [16 columns]: int sums of the codes (plus 128) x hi / x lo
      for (int v = 0; v < 4; ++v) hi[v] = lo[v] = _mm512_setzero_si512();
      for (int64_t q = 0; q < g / 4; ++q) {
        __m512i quad[4];
        ByteQuads(base + 4 * q * n, n, mask, quad);
        const __m512i bh = FourBytes(x.hi.data() + gi * g + 4 * q);
        const __m512i bl = FourBytes(x.lo.data() + gi * g + 4 * q);
        for (int v = 0; v < 4; ++v) {
          hi[v] = _mm512_dpbusd_epi32(hi[v], quad[v], bh);
          lo[v] = _mm512_dpbusd_epi32(lo[v], quad[v], bl);
        }
      }
      AddGroup(o, p, x, n, 0, gi, j0, je, hi, lo);
    }
  }
}

// Whether the integer path serves codes in groups of g in this packing: int8 codes in groups of 16
// to 64; packed codes in groups of a multiple of 16 within units of at most 64 codes (every GGUF
// block type kept packed), and for 5 and 6 bits `vpmultishiftqb`.
static bool IntegerDotServes(int64_t g, const Packing& p) {
  if (p.bits == 8) return g % 16 == 0 && g <= 64;  // int8 codes, a unit a group
#if !defined(__AVX512VBMI__)
  if (p.bits != 4) return false;
#endif
  return g % 16 == 0 && p.unit <= 64 && p.unit % g == 0 && p.unit / g <= 2 &&
         (p.bits == 4 || p.unit / 2 == 16);
}


static bool IntegerGroupedDot(ffi::ThreadPool& pool, const Operands& o, int64_t n, int64_t grain) {
  const int64_t g = o.k / o.groups;
  if (!IntegerDotServes(g, Packing{8, 128, g, g})) return false;
  const RoundedX rounded = RoundX(o, pool);  // once, before the ranges share it
  if (o.m != 1) {
    ManyRowsParallel(pool, o, rounded, 128, n,
                     [&](int64_t j0, __mmask64 mask, __m512i (*quads)[4]) {
                       for (int64_t q = 0; q < o.k / 4; ++q)
                         ByteQuads(o.c + 4 * q * n + j0, n, mask, quads[q]);
                     });
    return true;
  }
  ParallelFor(pool, n, grain,
              [&](int64_t jb, int64_t je) { GroupedColumnsVnni(o, rounded, n, jb, je); });
  return true;
}

// Rows vi .. vi + 15 of the table [V, D] (those of `valid`), 64 values of D from `d0` -> quad[q]
// for q in 0..15: lane i holds row vi + i's values d0 + 4q .. d0 + 4q + 3 plus 128 (unsigned
// bytes): a 16 x 16 transpose of dwords, in three steps (pairs of rows, fours, then 128-bit lanes).
static inline void TableQuads(const int8_t* rows, int64_t d, int64_t d0, __mmask16 valid,
                              __m512i quad[16]) {
  const __mmask64 mask = ColumnMask(d - d0);
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i)
    r[i] = (valid >> i) & 1 ? _mm512_maskz_loadu_epi8(mask, rows + i * d + d0)
                            : _mm512_setzero_si512();
  // lane L of t[i]: dwords 4L, 4L + 1 of rows i and i + 1, interleaved; of t[i + 1]: 4L + 2, 4L + 3
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // lane L of r[i + j]: dword 4L + j of rows i .. i + 3
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  const __m512i flip = _mm512_set1_epi8(-128);
  for (int j = 0; j < 4; ++j) {  // the 128-bit lanes of r[j], r[4 + j], r[8 + j], r[12 + j]
    const __m512i a = r[j], b = r[4 + j], c = r[8 + j], e = r[12 + j];
    const __m512i ab01 = _mm512_shuffle_i32x4(a, b, 0x44), ce01 = _mm512_shuffle_i32x4(c, e, 0x44);
    const __m512i ab23 = _mm512_shuffle_i32x4(a, b, 0xEE), ce23 = _mm512_shuffle_i32x4(c, e, 0xEE);
    quad[j] = _mm512_xor_si512(_mm512_shuffle_i32x4(ab01, ce01, 0x88), flip);
    quad[4 + j] = _mm512_xor_si512(_mm512_shuffle_i32x4(ab01, ce01, 0xDD), flip);
    quad[8 + j] = _mm512_xor_si512(_mm512_shuffle_i32x4(ab23, ce23, 0x88), flip);
    quad[12 + j] = _mm512_xor_si512(_mm512_shuffle_i32x4(ab23, ce23, 0xDD), flip);
  }
}

// The scales (or minimums) of table rows vi .. vi + count - 1 as float32 [count, groups]: where
// they lie if they are float32 (`f`), else (`h`, float16) converted into `buf`.
static inline const float* TableBlockScales(const float* f, const uint16_t* h, int64_t groups,
                                            int64_t vi, int64_t count, float* buf) {
  if (!h) return f + vi * groups;
  const int64_t total = count * groups;
  for (int64_t i = 0; i < total; i += 16) {
    const __mmask16 keep =
        total - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (total - i)) - 1);
    _mm512_mask_storeu_ps(buf + i, keep,
                          _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(keep, h + vi * groups + i)));
  }
  return buf;
}

// MR rows of x from m0 against 16 rows of the table (`quads` [D / 4]: the block's codes plus
// 128, a lane a row), y[m0 .. m0 + MR, vi .. vi + 15] (those of `valid`): per group, the int32 sums
// of MR rows x 16 table rows stay in registers, then take x's scale and the rows' scales
// (`scale` [groups] vectors of 16 rows, and `low` the minimums, nullptr: none) into float sums
// in registers.
template <int MR>
static inline void TableRowsMicroVnni(const Operands& o, const RoundedX& x, int64_t v,
                                      const __m512i* quads, const __m512* scale, const __m512* low,
                                      int64_t vi, __mmask16 valid, int64_t m0) {
  const int64_t d = o.k, g = d / o.groups;
  __m512 y[MR];
  for (int r = 0; r < MR; ++r) y[r] = _mm512_setzero_ps();
  for (int64_t gi = 0; gi < o.groups; ++gi) {
    __m512i hi[MR], lo[MR];
    for (int r = 0; r < MR; ++r) hi[r] = lo[r] = _mm512_setzero_si512();
    for (int64_t q = gi * g / 4; q < (gi + 1) * g / 4; ++q)
      for (int r = 0; r < MR; ++r) {
        const int64_t k = (m0 + r) * d + 4 * q;
        hi[r] = _mm512_dpbusd_epi32(hi[r], quads[q], FourBytes(x.hi.data() + k));
        lo[r] = _mm512_dpbusd_epi32(lo[r], quads[q], FourBytes(x.lo.data() + k));
      }
    for (int r = 0; r < MR; ++r) {
      const float xs = x.scale[(m0 + r) * o.groups + gi];
      const int32_t sum = x.sum[(m0 + r) * o.groups + gi];
      const __m512i total = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(hi[r], 8), lo[r]),
                                             _mm512_set1_epi32(128 * sum));
      y[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(total), _mm512_set1_ps(xs)),
                             scale[gi], y[r]);
      if (low) y[r] = _mm512_fmadd_ps(_mm512_set1_ps(xs * static_cast<float>(sum)), low[gi], y[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(o.out + (m0 + r) * v + vi, valid, y[r]);
}

// Vocabulary rows [vb, ve) of the tied LM head for several rows of x, int8 codes in groups of 16
// to 64 along D: per block of 16 rows of the table, its codes transposed once into quads (a lane
// a row of the table, in cache) and its scales (and minimums) into vectors of 16 rows; then
// every row of x, four at a time, through `vpdpbusd` as the layer kernels do.
static void TableRowsVnni(const Operands& o, const RoundedX& x, int64_t v, int64_t vb,
                          int64_t ve) {
  const int64_t d = o.k, groups = o.groups;
  const bool mins = o.mn || o.mn_half;
  std::vector<__m512i> quads(d / 4 + 16);
  std::vector<__m512> scale(groups), low(groups);
  std::vector<float> scale_rows(16 * groups), low_rows(16 * groups);
  const __m512i row = _mm512_mullo_epi32(  // lane i: row i's first scale, i * groups
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
      _mm512_set1_epi32(static_cast<int32_t>(groups)));
  for (int64_t vi = vb; vi < ve; vi += 16) {
    const int64_t count = std::min<int64_t>(16, ve - vi);
    const __mmask16 valid = static_cast<__mmask16>((1u << count) - 1);
    for (int64_t d0 = 0; d0 < d; d0 += 64)
      TableQuads(o.c + vi * d, d, d0, valid, quads.data() + d0 / 4);
    const float* s = TableBlockScales(o.s, o.s_half, groups, vi, count, scale_rows.data());
    const float* mn = mins ? TableBlockScales(o.mn, o.mn_half, groups, vi, count, low_rows.data())
                           : nullptr;
    for (int64_t gi = 0; gi < groups; ++gi) {  // row vi + i's scale of group gi in lane i
      const __m512i at = _mm512_add_epi32(row, _mm512_set1_epi32(static_cast<int32_t>(gi)));
      scale[gi] = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), valid, at, s, 4);
      if (mn) low[gi] = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), valid, at, mn, 4);
    }
    const __m512* lows = mn ? low.data() : nullptr;
    int64_t m0 = 0;
    for (; m0 + 4 <= o.m; m0 += 4)
      TableRowsMicroVnni<4>(o, x, v, quads.data(), scale.data(), lows, vi, valid, m0);
    for (; m0 < o.m; ++m0)
      TableRowsMicroVnni<1>(o, x, v, quads.data(), scale.data(), lows, vi, valid, m0);
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
// With AMX (tile multiplies), the table's rows need no transposing: `tdpbssd` multiplies a tile
// A of 16 rows of the table by a group's G bytes of D (read where the rows lie, at a stride of D)
// by a tile B of x's rounded halves laid out as it wants them (four bytes of D a row of x, 16
// rows of x: `TableTilesX`, once a call), into exact int32 sums C [16 rows of the table][16 rows
// of x], 16 x 16 x G products an instruction; signed codes times signed halves, so no offset.
// Each group's two sums (hi, lo) then take the scales in floats as `TableRowsMicroVnni`'s do, a
// vector a row of the table (a lane a row of x), and the block's sums are transposed into y.

// Whether this process may use the tiles' state, which Linux grants on request (asked once).
static bool AmxPermitted() {
  static const bool permitted = [] {
    constexpr long kRequestPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
    constexpr long kTileData = 18;               // XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return permitted;
}

// The tiles' shapes (palette 1): 0 and 1 the int32 sums [16][16] (x's hi and lo), 2 the table's
// rows [16][G bytes], 3 and 4 x's hi and lo [G / 4][16 rows of x][4 bytes].
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// x rounded (`RoundedX`) as tiles B, per block of 16 rows of x (zeros past M) and group: hi and
// lo [G / 4][16][4]; and x's scales and scales times rounded group sums (for minimums), [16].
struct TableTilesX {
  int64_t blocks, tile_bytes;
  std::vector<int8_t> hi, lo;     // [blocks][groups][tile_bytes]
  std::vector<float> scale, low;  // [blocks][groups][16]
};

static TableTilesX TilesOfX(const Operands& o, const RoundedX& x) {
  const int64_t g = o.k / o.groups, blocks = (o.m + 15) / 16, tiles = blocks * o.groups;
  TableTilesX t{blocks, 16 * g, std::vector<int8_t>(tiles * 16 * g),
                std::vector<int8_t>(tiles * 16 * g), std::vector<float>(tiles * 16),
                std::vector<float>(tiles * 16)};
  for (int64_t m = 0; m < o.m; ++m)
    for (int64_t gi = 0; gi < o.groups; ++gi) {
      const int64_t tile = m / 16 * o.groups + gi, lane = m % 16;
      for (int64_t k = 0; k < g; ++k) {
        const int64_t at = tile * t.tile_bytes + k / 4 * 64 + lane * 4 + k % 4;
        t.hi[at] = x.hi[m * o.k + gi * g + k];
        t.lo[at] = x.lo[m * o.k + gi * g + k];
      }
      const float xs = x.scale[m * o.groups + gi];
      t.scale[tile * 16 + lane] = xs;
      t.low[tile * 16 + lane] = xs * static_cast<float>(x.sum[m * o.groups + gi]);
    }
  return t;
}

// Vocabulary rows [vb, ve) of the head for several rows of x, in blocks of 16 rows of the table
// through the tiles; a last block of fewer rows through `TableRowsVnni`.
static void TableRowsAmx(const Operands& o, const RoundedX& rounded, const TableTilesX& x,
                         int64_t v, int64_t vb, int64_t ve) {
  const int64_t d = o.k, groups = o.groups, g = d / groups;
  TileConfig config;
  for (int t = 0; t < 5; ++t) {
    config.rows[t] = t < 3 ? 16 : static_cast<uint8_t>(g / 4);
    config.colsb[t] = t == 2 ? static_cast<uint16_t>(g) : 64;
  }
  _tile_loadconfig(&config);
  alignas(64) int32_t sums[2][2][16][16];  // [group % 2][hi, lo][row of the table][row of x]
  alignas(64) float block[16][16];  // [row of the table][row of x]
  std::vector<float> scale_rows(16 * groups), low_rows(16 * groups);
  const __m512i column = _mm512_mullo_epi32(  // lane i: block[i][0]
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
      _mm512_set1_epi32(16));
  int64_t vi = vb;
  for (; vi + 16 <= ve; vi += 16) {
    const float* s = TableBlockScales(o.s, o.s_half, groups, vi, 16, scale_rows.data());
    const float* mn = o.mn || o.mn_half
                          ? TableBlockScales(o.mn, o.mn_half, groups, vi, 16, low_rows.data())
                          : nullptr;
    for (int64_t b = 0; b < x.blocks; ++b) {
      __m512 y[16];
      for (int i = 0; i < 16; ++i) y[i] = _mm512_setzero_ps();
      // group gi's sums (stored into sums[gi % 2]) take their scales while the next group's
      // tile products run
      const auto add_group = [&](int64_t gi) {
        const int64_t tile = b * groups + gi;
        const __m512 xs = _mm512_loadu_ps(x.scale.data() + tile * 16);
        const __m512 xl = _mm512_loadu_ps(x.low.data() + tile * 16);
        for (int i = 0; i < 16; ++i) {
          const __m512i total =
              _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(sums[gi % 2][0][i]), 8),
                               _mm512_load_si512(sums[gi % 2][1][i]));
          y[i] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(total), xs),
                                 _mm512_set1_ps(s[i * groups + gi]), y[i]);
          if (mn) y[i] = _mm512_fmadd_ps(xl, _mm512_set1_ps(mn[i * groups + gi]), y[i]);
        }
      };
      for (int64_t gi = 0; gi < groups; ++gi) {
        const int64_t tile = b * groups + gi;
        if (b == 0)  // the rows two blocks on (16 D bytes, contiguous), a group's share at a time
          for (int64_t at = gi * 16 * g; at < (gi + 1) * 16 * g; at += 64)
            _mm_prefetch(reinterpret_cast<const char*>(o.c + (vi + 32) * d + at), _MM_HINT_T0);
        _tile_loadd(2, o.c + vi * d + gi * g, d);
        _tile_loadd(3, x.hi.data() + tile * x.tile_bytes, 64);
        _tile_loadd(4, x.lo.data() + tile * x.tile_bytes, 64);
        _tile_zero(0);
        _tile_zero(1);
        _tile_dpbssd(0, 2, 3);
        _tile_dpbssd(1, 2, 4);
        if (gi > 0) add_group(gi - 1);
        _tile_stored(0, sums[gi % 2][0], 64);
        _tile_stored(1, sums[gi % 2][1], 64);
      }
      add_group(groups - 1);
      for (int i = 0; i < 16; ++i) _mm512_store_ps(block[i], y[i]);
      for (int64_t r = 0; r < 16 && 16 * b + r < o.m; ++r)
        _mm512_storeu_ps(o.out + (16 * b + r) * v + vi,
                         _mm512_i32gather_ps(_mm512_add_epi32(column, _mm512_set1_epi32(r)),
                                             &block[0][0], 4));
    }
  }
  _tile_release();
  if (vi < ve) TableRowsVnni(o, rounded, v, vi, ve);
}
#endif

static bool IntegerTableDot(ffi::ThreadPool& pool, const Operands& o, int64_t v, int64_t grain) {
  const int64_t g = o.k / o.groups;
  if (o.m < 2 || g % 16 || g > 64) return false;  // one row: the float kernel, at memory speed
  const RoundedX rounded = RoundX(o, pool);
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
  if (AmxPermitted()) {
    const TableTilesX tiles = TilesOfX(o, rounded);
    ParallelFor(pool, v, grain,
                [&](int64_t vb, int64_t ve) { TableRowsAmx(o, rounded, tiles, v, vb, ve); });
    return true;
  }
#endif
  ParallelFor(pool, v, grain,
              [&](int64_t vb, int64_t ve) { TableRowsVnni(o, rounded, v, vb, ve); });
  return true;
}

// `PackedOneRowVnni` for this packing's top bits and groups a unit.
static auto OneRowVnniFor(const Packing& p, int64_t g) {
  const bool two = p.unit / g == 2;  // Q6_K: two groups a unit
  switch (p.bits) {
    case 5: return two ? PackedOneRowVnni<1, true> : PackedOneRowVnni<1, false>;
    case 6: return two ? PackedOneRowVnni<2, true> : PackedOneRowVnni<2, false>;
    default: return two ? PackedOneRowVnni<0, true> : PackedOneRowVnni<0, false>;
  }
}

// Several rows of x, packed codes: `ManyRowsParallel` over the units' codes decoded into quads.
template <int kWidth>
static void PackedManyRowsVnni(ffi::ThreadPool& pool, const Operands& o, const Packing& p,
                               const uint8_t* c, int64_t n, const RoundedX& x) {
  const int64_t half = p.unit / 2, quads = p.unit / 4;  // a unit's quads of K
  ManyRowsParallel(pool, o, x, p.offset, n, [&](int64_t j0, __mmask64 mask, __m512i (*out)[4]) {
    for (int64_t u = 0; u < o.k / p.unit; ++u) {
      const uint8_t* base = c + u * p.unit_rows * n + j0;
      for (int64_t rb = 0; rb < half / 4; ++rb)
        DecodeQuads<kWidth>(base, n, half, rb, mask, out[u * quads + rb],
                            out[u * quads + half / 4 + rb]);
    }
  });
}

// y = x . W for packed codes through integer dots where they serve the packing; false where not.
// x is rounded once; one row of x runs in column ranges of `grain` (`PackedOneRowVnni`), several
// in blocks of columns and rows (`PackedManyRowsVnni`).
static bool IntegerPackedDot(ffi::ThreadPool& pool, const Operands& o, const Packing& p,
                             const uint8_t* c, int64_t n, int64_t grain) {
  const int64_t g = o.k / o.groups;
  if (!IntegerDotServes(g, p)) return false;
  const RoundedX x = RoundX(o, pool);  // once, before the ranges share it
  if (o.m != 1) {
    switch (p.bits) {
      case 5: PackedManyRowsVnni<1>(pool, o, p, c, n, x); break;
      case 6: PackedManyRowsVnni<2>(pool, o, p, c, n, x); break;
      default: PackedManyRowsVnni<0>(pool, o, p, c, n, x); break;
    }
    return true;
  }
  const auto one_row = OneRowVnniFor(p, g);
  ParallelFor(pool, n, grain, [&](int64_t jb, int64_t je) { one_row(o, p, c, n, x, jb, je); });
  return true;
}
#endif

// Scales and minimums come as float32 or as float16 (a file's Q4/Q5 blocks): the integer path
// reads float16 in place; the float path converts them once a call. Codes, scales and mins are
// each one layer's or a stack of them (`SelectLayer`).
static ffi::Error PackedDot(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                            ffi::Buffer<ffi::U8> codes, ffi::AnyBuffer scales,
                            ffi::AnyBuffer mins, ffi::BufferR0<ffi::S32> layer,
                            ffi::ResultBuffer<ffi::F32> y, int64_t bits, int64_t offset) {
  const auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("x must be 2-D");
  LayerMatrix cm, sm, mm;
  for (auto [dims, matrix] : {std::pair{codes.dimensions(), &cm}, {scales.dimensions(), &sm},
                              {mins.dimensions(), &mm}})
    if (ffi::Error error = SelectLayer(dims, layer.typed_data(), matrix); error.failure())
      return error;
  const int64_t k = xd[1], n = cm.cols, groups = sm.rows;
  if (sm.cols != n || groups == 0 || k % groups || (bits != 4 && bits != 5 && bits != 6))
    return ffi::Error::InvalidArgument("shapes or bits do not agree");
  const int64_t g = k / groups, unit = bits == 4 ? g : 32;
  const Packing p{bits, offset, unit, unit / 2 + unit * (bits - 4) / 8};
  if (k % unit || cm.rows != k / unit * p.unit_rows)
    return ffi::Error::InvalidArgument("codes do not pack x's contracted axis");
  const bool has_mins = mm.rows == groups && mm.cols == n;
  const bool half = scales.element_type() == ffi::DataType::F16;
  if ((!half && scales.element_type() != ffi::DataType::F32) ||
      (has_mins && mins.element_type() != scales.element_type()))
    return ffi::Error::InvalidArgument("scales and mins must both be float32 or float16");
  Operands o{xd[0], k, groups, x.typed_data(), nullptr, nullptr, nullptr, y->typed_data()};
  std::vector<float> scales32, mins32;  // the float path's copies of float16 ones
  if (!half) {
    o.s = static_cast<const float*>(scales.untyped_data()) + sm.offset;
    o.mn = has_mins ? static_cast<const float*>(mins.untyped_data()) + mm.offset : nullptr;
  } else {
    o.s_half = static_cast<const uint16_t*>(scales.untyped_data()) + sm.offset;
    o.mn_half = has_mins ? static_cast<const uint16_t*>(mins.untyped_data()) + mm.offset
                         : nullptr;
  }
  const uint8_t* c = codes.typed_data() + cm.offset;
  const int64_t grain = ColumnGrain(n, pool);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if (IntegerPackedDot(pool, o, p, c, n, grain)) return ffi::Error::Success();
#endif
  if (half) {
    scales32.resize(groups * n);
    for (int64_t i = 0; i < groups * n; ++i) scales32[i] = HalfToFloat(o.s_half[i]);
    o.s = scales32.data();
    if (has_mins) {
      mins32.resize(groups * n);
      for (int64_t i = 0; i < groups * n; ++i) mins32[i] = HalfToFloat(o.mn_half[i]);
      o.mn = mins32.data();
    }
  }
  ParallelFor(pool, n, grain, [&](int64_t jb, int64_t je) { PackedColumns(o, p, c, n, jb, je); });
  return ffi::Error::Success();
}

// The most rows of x a layer kernel takes for codes of `bits` (8: int8 codes; 4, 5, 6 packed) in
// groups of `group`, for `meshserve.model.native_dot.matmul`; beyond, XLA's dot of the
// dequantized layer. Where the integer path serves them: every row count the engine runs (up to
// 512: prefill chunks beside decodes). SmolLM2's MLP shapes (576 x 1536 and 1536 x 576), one dot,
// medians of 7 interleaved repeats on a loaded 2-core machine (`scripts/quantized_dot_ffi/rows.py
// --baseline HEAD`), this kernel against XLA's path, Q4_1 576 x 1536: 0.23 against 1.41 ms at 16
// rows, 1.36 against 2.16 at 128, 3.83 against 5.88 at 272, 7.16 against 10.68 at 512; Q6_K 6.43
// against 7.59 at 512; Q8_0 and Q5_0 as far ahead (minimums ahead everywhere). The float kernels
// (no VNNI, or groups the integer dots do not take) keep the 16 rows every kernel had before
// (beyond, XLA's blocked dot of the dequantized layer was taken to be as fast; not remeasured).
extern "C" int64_t MeshserveMaxRows(int64_t bits, int64_t group) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  const bool packed = bits != 8;
  const Packing p{bits, packed ? 0 : 128, packed && bits != 4 ? 32 : group, 0};  // as PackedDot
  if (group > 0 && IntegerDotServes(group, p)) return std::numeric_limits<int64_t>::max();
#endif
  return 16;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshservePackedDot, PackedDot,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("offset"));


// The table's scale (or minimum) `at`, stored as float16 (`h`) or float32 (`f`, h nullptr).
static inline float TableScale(const float* f, const uint16_t* h, int64_t at) {
#if defined(__AVX512F__) && defined(__F16C__)
  return h ? _cvtsh_ss(h[at]) : f[at];
#else
  return h ? HalfToFloat(h[at]) : f[at];
#endif
}

#if defined(__AVX512F__)
// One row of x against VR rows of the table from `vi`: each group's codes are converted and
// multiplied by x in registers (never stored as floats), the group's partial sum takes its scale
// in the running sum (and x's group sum, `xsum`, the group's minimum; nullptr: no minimums), one
// reduction a row.
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
    // the rows two calls ahead (VR D bytes, contiguous), a group's share at a time
    for (int64_t at = gi * VR * g; at < (gi + 1) * VR * g; at += 64)
      _mm_prefetch(reinterpret_cast<const char*>(o.c + (vi + 2 * VR) * d + at), _MM_HINT_T0);
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
      const int64_t at = (vi + a) * groups + gi;
      total[a] = _mm512_fmadd_ps(part[a], _mm512_set1_ps(TableScale(o.s, o.s_half, at)), total[a]);
      if (xsum) low[a] += TableScale(o.mn, o.mn_half, at) * xsum[gi];
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
// four rows of the table (with VNNI, the integer paths instead: `IntegerTableDot`). Otherwise
// each row of the table is dequantized and dotted plainly.
static void TableRows(const Operands& o, int64_t v, int64_t vb, int64_t ve) {
  const int64_t m = o.m, d = o.k, groups = o.groups, g = d / groups;
  constexpr int64_t kBlock = 4;
#if defined(__AVX512F__)
  if (m == 1 && g % 16 == 0) {
    std::vector<float> xsum(groups, 0.0f);
    for (int64_t gi = 0; gi < groups; ++gi)
      for (int64_t j = gi * g; j < (gi + 1) * g; ++j) xsum[gi] += o.xs[j];
    const float* sums = o.mn || o.mn_half ? xsum.data() : nullptr;
    int64_t vi = vb;
    for (; vi + kBlock <= ve; vi += kBlock) TableOneRowMicro<kBlock>(o, v, vi, sums);
    for (; vi < ve; ++vi) TableOneRowMicro<1>(o, v, vi, sums);
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
        const int64_t at = (vi + a) * groups + gi;
        const float scale = TableScale(o.s, o.s_half, at);
        const float low = o.mn || o.mn_half ? TableScale(o.mn, o.mn_half, at) : 0.0f;
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

// The table's scales and minimums come as float32 or as float16 (a GGUF's Q8_0 blocks), read in
// place either way: XLA's conversion would write and read again 4 bytes a group before each call
// (Gemma 3's 262,144 x 640 table: 21 MB, beside 168 MB of codes).
static ffi::Error TableDot(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                           ffi::Buffer<ffi::S8> codes, ffi::AnyBuffer scales, ffi::AnyBuffer mins,
                           ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), cd = codes.dimensions(), sd = scales.dimensions(),
             md = mins.dimensions();
  if (xd.size() != 2 || cd.size() != 2 || sd.size() != 2 || md.size() != 2)
    return ffi::Error::InvalidArgument("x, codes, scales and mins must be 2-D");
  const int64_t k = xd[1], v = cd[0], groups = sd[1];
  if (cd[1] != k || sd[0] != v || groups == 0 || k % groups)
    return ffi::Error::InvalidArgument("shapes do not agree");
  const bool has_mins = md[0] == v && md[1] == groups;
  const bool half = scales.element_type() == ffi::DataType::F16;
  if ((!half && scales.element_type() != ffi::DataType::F32) ||
      (has_mins && mins.element_type() != scales.element_type()))
    return ffi::Error::InvalidArgument("scales and mins must both be float32 or float16");
  Operands o{xd[0], k, groups, x.typed_data(), codes.typed_data(), nullptr, nullptr,
             y->typed_data()};
  if (half) {
    o.s_half = static_cast<const uint16_t*>(scales.untyped_data());
    o.mn_half = has_mins ? static_cast<const uint16_t*>(mins.untyped_data()) : nullptr;
  } else {
    o.s = static_cast<const float*>(scales.untyped_data());
    o.mn = has_mins ? static_cast<const float*>(mins.untyped_data()) : nullptr;
  }
  // Rows of the table a range takes: at least 64 KB of codes, and about 16 ranges a thread (the
  // calling one too), so that the start of a range, whose first rows no prefetch has fetched,
  // costs little; in blocks of 16.
  const int64_t threads = pool.num_threads() + 1;
  const int64_t grain = (std::max<int64_t>(65536 / std::max<int64_t>(o.k, 1), v / (16 * threads))
                         + 15) / 16 * 16;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if (IntegerTableDot(pool, o, v, grain)) return ffi::Error::Success();
#endif
  ParallelFor(pool, v, grain, [&](int64_t vb, int64_t ve) { TableRows(o, v, vb, ve); });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshserveTableDot, TableDot,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
