// Attention over the paged KV cache as a CPU kernel behind XLA's FFI: for every token of a
// ragged step, the keys of its sequence up to its own, read where they lie in the caches
// [L, K, P, S, h] (layer, kv head, page, slot, head dim), under one online softmax
// (`meshserve.model.attention`, `ragged_attention_jnp`). The step writes its own keys and values
// into their pages before it attends, so the cached context and the step's own keys are read
// alike: a prompt's token reads the keys of the prompt's earlier tokens from the pages they were
// just written to, and nothing else of the step.
//
// XLA's path computes the step's own keys densely, every token of the step against every other
// ([T, T] scores, masked to the token's own sequence and the causal order: a 512-token chunk in a
// bucket of 1024 took 83% of a SmolLM2 prefill step, 2.9 s of 3.5), and gathers each token's
// pages into a buffer before two small dots for the context. Here a page's keys for one (layer,
// kv head) are S rows of h floats in a row, so each token reads them in place: the scores of its
// G query heads against a page's keys, their soft-cap, then the online softmax (rescaling the
// state only when a head's running maximum grows) and the values weighted into the accumulator,
// each value row read once for all G heads.
//
// Token t sees the keys at positions [max(0, positions[t] - window + 1), key_ends[t]): its
// position + 1 (the step wrote its own key) bounds them, the window (int32; a large value for a
// layer without one) the start. Padding tokens (a key end of 0) read nothing, and their output
// is zeros. The output is each token's attention, acc / l, [T, K, G, h].
//
// Work is split over (token, kv head) pairs, claimed from a shared counter by XLA's intra-op
// threads and the calling one (`ParallelFor`); a step with little context runs on the calling
// thread alone. With AVX-512 a page's scores are taken 16 keys at a time where the head dim is a
// multiple of 16 (the 16 products' lanes summed together, `SumLanes16`), and the exponentials 16
// at a time (`Exp`); otherwise, and for the keys left over, scalar loops.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using meshserve_native::ParallelFor;

// Below this many multiply-adds of context (keys x query heads x head dim, scores and values
// together) a step runs on the calling thread: waking the pool costs more than it saves. One row
// of SmolLM2 (3 kv heads of 3 query heads, head dim 64) after 512 cached tokens is 0.59M of them:
// its 30 layers' attention took 2.3 ms on the caller alone against 3.2 ms split (medians, 2
// loaded cores); 16 such rows after 128 tokens (2.4M) about the same either way.
constexpr int64_t kParallelWork = 1 << 20;

float Dot(const float* a, const float* b, int64_t n) {
#if defined(__AVX512F__)
  if (n % 16 == 0) {
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16)
      sum = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), sum);
    return _mm512_reduce_add_ps(sum);
  }
#endif
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

#if defined(__AVX512F__)
// The sums of each of 16 vectors' lanes, as one vector (lane j: a[j]'s sum): pairs of vectors
// are interleaved and added, halving the lanes each holds per vector, four times.
__m512 SumLanes16(const __m512* a) {
  __m512 two[8], four[4], eight[2];
  for (int i = 0; i < 8; ++i)  // lanes {0, 2} + {1, 3} of each 128 bits: 2 vectors' partials
    two[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                           _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // then pairs of lanes: 4 vectors' partials per 128 bits
    const __m512d lo = _mm512_castps_pd(two[2 * i]), hi = _mm512_castps_pd(two[2 * i + 1]);
    four[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi)),
                            _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi)));
  }
  for (int i = 0; i < 2; ++i)  // then 128-bit blocks: 8 vectors' partials, two blocks each
    eight[i] = _mm512_add_ps(_mm512_shuffle_f32x4(four[2 * i], four[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(four[2 * i], four[2 * i + 1], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(eight[0], eight[1], 0x88),
                       _mm512_shuffle_f32x4(eight[0], eight[1], 0xdd));
}

// e^x of each lane for x <= 0 (a softmax's exponents): x = n ln 2 + r with |r| <= ln 2 / 2,
// e^r by its Taylor polynomial of degree 6 (relative error below 2e-7), times 2^n.
__m512 Exp(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));  // below, e^x is 0 in float32
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);  // ln 2 in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  for (float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}
#endif

// scores[j] = q . keys[j] for `count` keys of h floats in a row.
void Scores(const float* q, const float* keys, int64_t count, int64_t h, float* scores) {
  int64_t j = 0;
#if defined(__AVX512F__)
  if (h % 16 == 0)
    for (; j + 16 <= count; j += 16) {
      __m512 products[16];
      for (int k = 0; k < 16; ++k) {
        const float* key = keys + (j + k) * h;
        __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(key));
        for (int64_t i = 16; i < h; i += 16)
          sum = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(key + i), sum);
        products[k] = sum;
      }
      _mm512_storeu_ps(scores + j, SumLanes16(products));
    }
#endif
  for (; j < count; ++j) scores[j] = Dot(q, keys + j * h, h);
}

// s[j] = e^(s[j] - top) for j < count; returns their sum.
float ExpSum(float* s, int64_t count, float top) {
  int64_t j = 0;
  float sum = 0.0f;
#if defined(__AVX512F__)
  __m512 sums = _mm512_setzero_ps();
  const __m512 shift = _mm512_set1_ps(top);
  for (; j < count; j += 16) {
    const __mmask16 lanes = count - j >= 16 ? 0xffff : (1u << (count - j)) - 1;
    const __m512 e = Exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, s + j), shift));
    _mm512_mask_storeu_ps(s + j, lanes, e);
    sums = _mm512_mask_add_ps(sums, lanes, sums, e);
  }
  sum = _mm512_reduce_add_ps(sums);
#endif
  for (; j < count; ++j) sum += s[j] = std::exp(s[j] - top);
  return sum;
}

// y += a * x over n floats (the compiler vectorizes it).
void Axpy(float* __restrict y, float a, const float* __restrict x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

struct Problem {
  int64_t kv_heads, groups, head_dim, pages, page_size, max_pages;
  const float* q;          // [T, K, G, h], scaled
  const float* cache_k;    // layer `layer` of [L, K, P, S, h]
  const float* cache_v;
  const int32_t* token_pages;  // [T, M]
  const int32_t* key_ends;     // [T]
  const int32_t* positions;    // [T]
  int64_t window;
  float softcap;  // 0: none
  float* out;     // [T, K, G, h]

  // The first key token t sees and the end of its keys.
  int64_t First(int64_t t) const {
    return std::max<int64_t>(0, int64_t{positions[t]} - window + 1);
  }
  int64_t End(int64_t t) const { return key_ends[t]; }
};

// Token t's attention at kv head `head`, page by page. `scores` holds G x page_size floats,
// `state` G x (h + 2).
void Attend(const Problem& p, int64_t t, int64_t head, float* scores, float* state) {
  const int64_t g_count = p.groups, h = p.head_dim, size = p.page_size;
  const int64_t row = t * p.kv_heads + head;  // (t, head) in [T, K]
  float* m = state;
  float* l = state + g_count;
  float* acc = state + 2 * g_count;  // [G, h]
  std::fill(m, m + g_count, -std::numeric_limits<float>::infinity());
  std::fill(l, l + g_count, 0.0f);
  std::fill(acc, acc + g_count * h, 0.0f);
  const float* q = p.q + row * g_count * h;
  const int32_t* pages = p.token_pages + t * p.max_pages;
  const int64_t end = p.End(t);
  for (int64_t begin = p.First(t); begin < end;) {
    const int64_t index = begin / size, slot = begin % size;
    const int64_t count = std::min(size - slot, end - begin);
    const int64_t at = ((head * p.pages + pages[index]) * size + slot) * h;
    const float* keys = p.cache_k + at;
    const float* values = p.cache_v + at;
    for (int64_t g = 0; g < g_count; ++g) Scores(q + g * h, keys, count, h, scores + g * size);
    if (p.softcap != 0.0f)
      for (int64_t g = 0; g < g_count; ++g)
        for (int64_t j = 0; j < count; ++j)
          scores[g * size + j] = p.softcap * std::tanh(scores[g * size + j] / p.softcap);
    for (int64_t g = 0; g < g_count; ++g) {
      float* s = scores + g * size;
      const float top = *std::max_element(s, s + count);
      if (top > m[g]) {
        const float rescale = std::exp(m[g] - top);
        l[g] *= rescale;
        for (int64_t i = 0; i < h; ++i) acc[g * h + i] *= rescale;
        m[g] = top;
      }
      l[g] += ExpSum(s, count, m[g]);
    }
    for (int64_t j = 0; j < count; ++j)
      for (int64_t g = 0; g < g_count; ++g)
        Axpy(acc + g * h, scores[g * size + j], values + j * h, h);
    begin += count;
  }
  float* out = p.out + row * g_count * h;
  for (int64_t g = 0; g < g_count; ++g)  // no keys (padding): zeros
    for (int64_t i = 0; i < h; ++i) out[g * h + i] = l[g] > 0.0f ? acc[g * h + i] / l[g] : 0.0f;
}

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                          ffi::Buffer<ffi::F32> cache_k, ffi::Buffer<ffi::F32> cache_v,
                          ffi::BufferR0<ffi::S32> layer, ffi::Buffer<ffi::S32> token_pages,
                          ffi::Buffer<ffi::S32> key_ends, ffi::Buffer<ffi::S32> positions,
                          ffi::BufferR0<ffi::S32> window, ffi::ResultBuffer<ffi::F32> out,
                          float softcap) {
  const auto qd = q.dimensions(), cd = cache_k.dimensions(), pd = token_pages.dimensions();
  if (qd.size() != 4 || cd.size() != 5 || pd.size() != 2)
    return ffi::Error::InvalidArgument("q must be 4-D, the caches 5-D, the page tables 2-D");
  const int64_t tokens = qd[0], kv_heads = qd[1], groups = qd[2], head_dim = qd[3];
  const auto vd = cache_v.dimensions();
  for (size_t i = 0; i < 5; ++i)
    if (vd[i] != cd[i]) return ffi::Error::InvalidArgument("the caches' shapes differ");
  if (cd[1] != kv_heads || cd[4] != head_dim || pd[0] != tokens ||
      key_ends.element_count() != tokens || positions.element_count() != tokens)
    return ffi::Error::InvalidArgument("shapes do not agree");
  const int64_t index = *layer.typed_data();
  if (index < 0 || index >= cd[0]) return ffi::Error::InvalidArgument("layer out of range");
  const int64_t layer_size = cd[1] * cd[2] * cd[3] * cd[4];
  Problem p{kv_heads, groups, head_dim, cd[2], cd[3], pd[1],
            q.typed_data(), cache_k.typed_data() + index * layer_size,
            cache_v.typed_data() + index * layer_size, token_pages.typed_data(),
            key_ends.typed_data(), positions.typed_data(), *window.typed_data(), softcap,
            out->typed_data()};
  // A page index outside the cache would read outside it: refuse the call instead.
  int64_t work = 0;
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t first = p.First(t), end = p.End(t);
    if (end > first) {
      if (end > p.max_pages * p.page_size)
        return ffi::Error::InvalidArgument("a key end runs past its page table");
      for (int64_t i = first / p.page_size; i <= (end - 1) / p.page_size; ++i) {
        const int32_t page = p.token_pages[t * p.max_pages + i];
        if (page < 0 || page >= p.pages) return ffi::Error::InvalidArgument("page out of range");
      }
      work += (end - first) * 2 * groups * head_dim * kv_heads;
    }
  }
  const int64_t items = tokens * kv_heads;
  auto body = [&](int64_t begin, int64_t end) {
    std::vector<float> scores(groups * p.page_size), state(groups * (head_dim + 2));
    for (int64_t i = begin; i < end; ++i)
      Attend(p, i / kv_heads, i % kv_heads, scores.data(), state.data());
  };
  if (work < kParallelWork)
    body(0, items);
  else
    ParallelFor(pool, items, 1, body);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshservePagedAttention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()      // q
                                  .Arg<ffi::Buffer<ffi::F32>>()      // cache_k
                                  .Arg<ffi::Buffer<ffi::F32>>()      // cache_v
                                  .Arg<ffi::BufferR0<ffi::S32>>()    // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()      // token_pages
                                  .Arg<ffi::Buffer<ffi::S32>>()      // key_ends
                                  .Arg<ffi::Buffer<ffi::S32>>()      // positions
                                  .Arg<ffi::BufferR0<ffi::S32>>()    // window
                                  .Ret<ffi::Buffer<ffi::F32>>()      // out
                                  .Attr<float>("softcap"));
