"""The C++ source of the CPU decode-attention kernel that native_attention.py builds on first use: the
folds of a chunk of keys here, the loops over a batch in native_decode_loops_source.py (between these
kernels and the entry point)."""

from goodput_runtime.layers.native_decode_loops_source import LOOPS_SOURCE

_KERNELS = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kChunk = 16;  // keys folded into the running softmax at a time
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// fold(qf, acc, m, l, k, v, row, n, g, sc): n keys (1..kChunk) of one kv head, the first at k and v
// and each `row` elements after the last, into the running softmax of g query heads: qf [g, d] the
// scaled queries, acc [g, d] the sums of p * v, m [g] the maxima, l [g] the sums of p; sc [g, kChunk]
// scratch.
template <typename T>
struct FoldScalar {
  int64_t d;
  void operator()(const float* qf, float* acc, float* m, float* l, const T* k, const T* v, int64_t row, int64_t n,
                  int64_t g, float* sc) const {
    for (int64_t h = 0; h < g; ++h) {
      const float* q = qf + h * d;
      float* s = sc + h * kChunk;
      float mx = m[h];
      for (int64_t t = 0; t < n; ++t) {
        float dot = 0.f;
        for (int64_t i = 0; i < d; ++i) dot += q[i] * static_cast<float>(k[t * row + i]);
        s[t] = dot;
        mx = std::max(mx, dot);
      }
      const float corr = std::exp(m[h] - mx);  // 0 on the first keys (m = -inf)
      float sum = 0.f;
      for (int64_t t = 0; t < n; ++t) {
        s[t] = std::exp(s[t] - mx);
        sum += s[t];
      }
      l[h] = l[h] * corr + sum;
      m[h] = mx;
      float* a = acc + h * d;
      for (int64_t i = 0; i < d; ++i) a[i] *= corr;
      for (int64_t t = 0; t < n; ++t)
        for (int64_t i = 0; i < d; ++i) a[i] += s[t] * static_cast<float>(v[t * row + i]);
    }
  }
};

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {  // bf16 is the top half of an fp32
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// e^x for x <= 0: Cephes' expf polynomial on x - n ln 2, times 2^n by scalef (0 far below -88)
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// lane t: the sum of v[t]'s lanes (a tree of shuffles and adds over all sixteen at once)
inline __m512 hsum16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // lanes 0-7: halves of v[2i]; 8-15: of v[2i + 1]
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // quarter j: quarters of v[4i + j]
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_unpacklo_ps(b[2 * i], b[2 * i + 1]), _mm512_unpackhi_ps(b[2 * i], b[2 * i + 1]));
  const __m512 d = _mm512_add_ps(_mm512_unpacklo_ps(c[0], c[1]), _mm512_unpackhi_ps(c[0], c[1]));
  // quarter j holds the sums of v[j], v[8 + j], v[4 + j], v[12 + j]
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 1, 5, 9, 13, 3, 7, 11, 15), d);
}

// the same for d = 16 * NC, sixteen lanes at a time
template <typename T, int NC>
struct FoldAvx512 {
  void operator()(const float* qf, float* acc, float* m, float* l, const T* k, const T* v, int64_t row, int64_t n,
                  int64_t g, float* sc) const {
    constexpr int64_t D = NC * 16;
    const __mmask16 live = n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
    for (int64_t h = 0; h < g; ++h) {
      __m512 q[NC];
      for (int c = 0; c < NC; ++c) q[c] = _mm512_loadu_ps(qf + h * D + c * 16);
      float* s = sc + h * kChunk;
      __m512 dots[16];
      for (int64_t t = 0; t < 16; ++t) {
        if (t >= n) {
          dots[t] = _mm512_setzero_ps();
          continue;
        }
        const T* kt = k + t * row;
        __m512 dot = _mm512_mul_ps(q[0], load16(kt));
        for (int c = 1; c < NC; ++c) dot = _mm512_fmadd_ps(q[c], load16(kt + c * 16), dot);
        dots[t] = dot;
      }
      const __m512 sv = _mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), live, hsum16(dots));
      const float mx = std::max(m[h], _mm512_reduce_max_ps(sv));
      // e^(m - mx) without a call into libm (about 0 on the first keys, m = -inf, where acc and l are 0)
      const float corr = _mm512_cvtss_f32(exp16(_mm512_set1_ps(m[h] - mx)));
      const __m512 p = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(sv, _mm512_set1_ps(mx))));
      l[h] = l[h] * corr + _mm512_reduce_add_ps(p);
      m[h] = mx;
      _mm512_storeu_ps(s, p);
      __m512 a[NC], b[NC];  // even and odd keys: two chains of adds
      const __m512 cv = _mm512_set1_ps(corr);
      for (int c = 0; c < NC; ++c) {
        a[c] = _mm512_mul_ps(_mm512_loadu_ps(acc + h * D + c * 16), cv);
        b[c] = _mm512_setzero_ps();
      }
      int64_t t = 0;
      for (; t + 1 < n; t += 2) {
        const __m512 p0 = _mm512_set1_ps(s[t]), p1 = _mm512_set1_ps(s[t + 1]);
        const T* v0 = v + t * row;
        const T* v1 = v0 + row;
        for (int c = 0; c < NC; ++c) {
          a[c] = _mm512_fmadd_ps(p0, load16(v0 + c * 16), a[c]);
          b[c] = _mm512_fmadd_ps(p1, load16(v1 + c * 16), b[c]);
        }
      }
      if (t < n) {
        const __m512 p0 = _mm512_set1_ps(s[t]);
        for (int c = 0; c < NC; ++c) a[c] = _mm512_fmadd_ps(p0, load16(v + t * row + c * 16), a[c]);
      }
      for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + h * D + c * 16, _mm512_add_ps(a[c], b[c]));
    }
  }
};

#endif

#if defined(__AVX2__) && defined(__FMA__)
// the same eight lanes at a time, for a CPU with AVX2 and no AVX-512 (where FoldScalar's dot products
// would run one lane at a time: its sums are not reordered without -ffast-math)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// e^x, exp16's polynomial, 2^n written into the exponent bits: 0 below -87 and inf from 88.7 on, where n
// would leave the normal range (the fused SiLU's e^-x reaches both)
inline __m256 exp8(__m256 x) {
  const __m256 floor = _mm256_set1_ps(-87.f);
  const __m256 under = _mm256_cmp_ps(x, floor, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, floor), _mm256_set1_ps(88.7228f));  // n = 128 there: the exponent of inf
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// lane t: the sum of v[t]'s lanes
inline __m256 hsum8(const __m256* v) {
  const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
  // each half: the sums of the low (high) four lanes of v[0..3], then of v[4..7]
  const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

inline float max8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// d = 8 * NC: the chunk's keys in two eights, each eight's scores summed across lanes at once
template <typename T, int NC>
struct FoldAvx2 {
  void operator()(const float* qf, float* acc, float* m, float* l, const T* k, const T* v, int64_t row, int64_t n,
                  int64_t g, float* sc) const {
    constexpr int64_t D = NC * 8;
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 live[2] = {_mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), lane)),
                            _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)n - 8), lane))};
    for (int64_t h = 0; h < g; ++h) {
      const float* q = qf + h * D;
      float* s = sc + h * kChunk;
      __m256 sv[2];
      for (int half = 0; half < 2; ++half) {
        __m256 dots[8];
        for (int64_t u = 0; u < 8; ++u) {
          const int64_t t = half * 8 + u;
          if (t >= n) {
            dots[u] = _mm256_setzero_ps();
            continue;
          }
          const T* kt = k + t * row;
          __m256 dot = _mm256_mul_ps(_mm256_loadu_ps(q), load8(kt));
          for (int c = 1; c < NC; ++c) dot = _mm256_fmadd_ps(_mm256_loadu_ps(q + c * 8), load8(kt + c * 8), dot);
          dots[u] = dot;
        }
        sv[half] = _mm256_blendv_ps(_mm256_set1_ps(kNegInf), hsum8(dots), live[half]);
      }
      const float mx = std::max(m[h], max8(_mm256_max_ps(sv[0], sv[1])));
      // e^(m - mx): 0 on the first keys (m = -inf), where acc and l are 0
      const float corr = _mm256_cvtss_f32(exp8(_mm256_set1_ps(m[h] - mx)));
      const __m256 mv = _mm256_set1_ps(mx);
      const __m256 p0 = _mm256_and_ps(live[0], exp8(_mm256_sub_ps(sv[0], mv)));
      const __m256 p1 = _mm256_and_ps(live[1], exp8(_mm256_sub_ps(sv[1], mv)));
      l[h] = l[h] * corr + sum8(_mm256_add_ps(p0, p1));
      m[h] = mx;
      _mm256_storeu_ps(s, p0);
      _mm256_storeu_ps(s + 8, p1);
      const __m256 cv = _mm256_set1_ps(corr);
      __m256 a[NC];  // NC chains of adds, one per eight lanes of d
      for (int c = 0; c < NC; ++c) a[c] = _mm256_mul_ps(_mm256_loadu_ps(acc + h * D + c * 8), cv);
      for (int64_t t = 0; t < n; ++t) {
        const __m256 pt = _mm256_set1_ps(s[t]);
        const T* vt = v + t * row;
        for (int c = 0; c < NC; ++c) a[c] = _mm256_fmadd_ps(pt, load8(vt + c * 8), a[c]);
      }
      for (int c = 0; c < NC; ++c) _mm256_storeu_ps(acc + h * D + c * 8, a[c]);
    }
  }
};
#endif

// GOODPUT_DECODE_FOLD=avx2 (or scalar) asks for that fold where the CPU has a wider one: the tests check
// each fold the CPU can run, and bench/decode_attention.py --folds times them side by side
inline int fold_asked() {
  const char* asked = std::getenv("GOODPUT_DECODE_FOLD");
  if (asked == nullptr) return 0;
  return !std::strcmp(asked, "avx2") ? 1 : !std::strcmp(asked, "scalar") ? 2 : 0;
}

// body(begin, end) over `units` split into up to `threads` contiguous ranges of about equal total
// cost(u), one range a thread. at::parallel_for splits by count: over a decode batch ordered longest
// context first, as the engine orders it, the first thread would take most of the keys and the
// others would wait for it.
template <typename Cost, typename Body>
void parallel_balanced(int64_t threads, int64_t units, const Cost& cost, const Body& body) {
  threads = std::min(threads, units);
  if (threads <= 1) {
    if (units > 0) body(0, units);
    return;
  }
  std::vector<int64_t> bounds(threads + 1, units);
  bounds[0] = 0;
  double total = 0.0;
  for (int64_t u = 0; u < units; ++u) total += static_cast<double>(cost(u));
  double sum = 0.0;
  int64_t t = 1;
  for (int64_t u = 0; u < units && t < threads; ++u) {
    sum += static_cast<double>(cost(u));
    while (t < threads && sum >= total * static_cast<double>(t) / static_cast<double>(threads)) bounds[t++] = u + 1;
  }
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r)
      if (bounds[r] < bounds[r + 1]) body(bounds[r], bounds[r + 1]);
  });
}

"""

_ENTRY = r"""
template <typename T>
void dispatch(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& blocks,
              const at::Tensor& lens, int64_t bs, double scale, int64_t window, at::Tensor& out) {
  const DecodePlan plan(query, k_cache, blocks, lens, bs, window);
  const int asked = fold_asked();
#if defined(__AVX512F__)
  if (asked == 0) {
    if (two_pass<T>(query, k_cache, v_cache, plan, scale, out)) return;
    switch (plan.d) {
#define GOODPUT_CASE(NC) \
  case NC * 16: return run<T>(query, k_cache, v_cache, plan, scale, FoldAvx512<T, NC>{}, out);
      GOODPUT_CASE(1) GOODPUT_CASE(2) GOODPUT_CASE(3) GOODPUT_CASE(4)
      GOODPUT_CASE(5) GOODPUT_CASE(6) GOODPUT_CASE(7) GOODPUT_CASE(8)
#undef GOODPUT_CASE
      default: break;
    }
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (asked <= 1) switch (plan.d) {
#define GOODPUT_CASE(NC) \
  case NC * 16: return run<T>(query, k_cache, v_cache, plan, scale, FoldAvx2<T, 2 * NC>{}, out);
      GOODPUT_CASE(1) GOODPUT_CASE(2) GOODPUT_CASE(3) GOODPUT_CASE(4)
      GOODPUT_CASE(5) GOODPUT_CASE(6) GOODPUT_CASE(7) GOODPUT_CASE(8)
#undef GOODPUT_CASE
      default: break;
    }
#endif
  run<T>(query, k_cache, v_cache, plan, scale, FoldScalar<T>{plan.d}, out);
}

}  // namespace

at::Tensor decode(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& blocks, const at::Tensor& lens, int64_t block_size, double scale, int64_t window) {
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(query.stride(2) == 1 && k_cache.is_contiguous() && v_cache.is_contiguous(), "bad strides");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "mixed dtypes");
  TORCH_CHECK(blocks.scalar_type() == at::kLong && blocks.dim() == 2 && blocks.stride(1) == 1, "bad blocks");
  TORCH_CHECK(lens.scalar_type() == at::kLong && lens.is_contiguous() && lens.size(0) == query.size(0), "bad lens");
  TORCH_CHECK(query.size(2) == k_cache.size(2) && query.size(1) % k_cache.size(1) == 0, "bad heads");
  at::Tensor out = at::empty(query.sizes(), query.options());
  if (query.scalar_type() == at::kFloat) {
    dispatch<float>(query, k_cache, v_cache, blocks, lens, block_size, scale, window, out);
  } else if (query.scalar_type() == at::kBFloat16) {
    dispatch<c10::BFloat16>(query, k_cache, v_cache, blocks, lens, block_size, scale, window, out);
  } else {
    TORCH_CHECK(false, "unsupported dtype ", query.scalar_type());
  }
  return out;
}
"""

SOURCE = _KERNELS + LOOPS_SOURCE + _ENTRY


CPP_DECL = (
    "at::Tensor decode(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache, "
    "const at::Tensor& blocks, const at::Tensor& lens, int64_t block_size, double scale, int64_t window);"
)
