// A prototype of the quantized dot as a CPU kernel behind XLA's FFI: y [M, N] = x [M, K] .
// W [K, N], where W = codes * scale (+ min) per group of G rows of K, the layout of meshserve's
// grouped int8 kernels (codes int8 [K, N], scales and mins float32 [K / G, N]).
//
// For each group, the rows' codes are converted and accumulated into a float buffer of one
// group's partial sums per output ([M, N], in cache), which then takes the group's scale (and
// the group's sum of x times its minimum): the codes are read once, never written out as
// floats (for several rows of x, one row of codes at a time is converted into a buffer that
// every row of x then reads). The inner loops run over N, contiguous, which the compiler
// vectorizes. One thread.
#include <cstdint>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

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
