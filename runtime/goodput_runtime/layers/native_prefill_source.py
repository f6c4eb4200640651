"""The C++ source of the CPU prefill-attention kernel, built with the decode kernel (native_attention.py).

It follows ``native_attention_source.SOURCE`` in one translation unit and uses its helpers
(``load16``, ``exp16``, ``kNegInf``).
"""

PREFILL_SOURCE = r"""
namespace {

#if defined(__AVX512F__)
constexpr int64_t kRows = 16;  // query rows of a tile are padded to a multiple of this

struct Add {
  __m512 operator()(__m512 a, __m512 b) const { return _mm512_add_ps(a, b); }
};
struct Max {
  __m512 operator()(__m512 a, __m512 b) const { return _mm512_max_ps(a, b); }
};

// lane t: v[t]'s sixteen lanes folded by op (hsum16's tree, with any associative op)
template <typename Op>
inline __m512 reduce16(const __m512* v, Op op) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = op(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44), _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    b[i] = op(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88), _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    c[i] = op(_mm512_unpacklo_ps(b[2 * i], b[2 * i + 1]), _mm512_unpackhi_ps(b[2 * i], b[2 * i + 1]));
  const __m512 d = op(_mm512_unpacklo_ps(c[0], c[1]), _mm512_unpackhi_ps(c[0], c[1]));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 1, 5, 9, 13, 3, 7, 11, 15), d);
}

// a kv head's context packed for the products: keys as [key block][d][16 keys] (a block's keys side
// by side, so a row of scores is sixteen FMAs wide), values as [key][d]; fp32, zeros past the context
template <typename T>
void pack(const at::Tensor& k_cache, const at::Tensor& v_cache, const int64_t* slots, int64_t ctx, int64_t nkb,
          float* kt, float* vt) {
  const int64_t kvh = k_cache.size(1), d = k_cache.size(2), row = kvh * d;
  const T* kc = k_cache.data_ptr<T>();
  const T* vc = v_cache.data_ptr<T>();
  at::parallel_for(0, kvh * nkb, ctx * row < (int64_t)1 << 15 ? kvh * nkb : 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t g = u / nkb, kb = u % nkb;
      float* kb_t = kt + u * d * 16;
      float* vb = vt + u * 16 * d;
      for (int64_t t = 0; t < 16; ++t) {
        const int64_t p = kb * 16 + t;
        if (p >= ctx) {
          for (int64_t e = 0; e < d; ++e) kb_t[e * 16 + t] = 0.f;
          std::fill(vb + t * d, vb + (t + 1) * d, 0.f);
          continue;
        }
        const T* ks = kc + slots[p] * row + g * d;
        const T* vs = vc + slots[p] * row + g * d;
        for (int64_t e = 0; e < d; ++e) {
          kb_t[e * 16 + t] = static_cast<float>(ks[e]);
          vb[t * d + e] = static_cast<float>(vs[e]);
        }
      }
    }
  });
}

// the scores of kRows query rows q [rows][D] against a packed key block kt [D][16]
template <int NC>
inline void score_rows(const float* q, const float* kt, __m512* acc) {
  constexpr int D = NC * 16;
  for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
  for (int e = 0; e < D; ++e) {
    const __m512 k = _mm512_loadu_ps(kt + e * 16);
    for (int r = 0; r < kRows; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * D + e]), k, acc[r]);
  }
}

// o [RO][D] = o * alpha + p [RO][16] . v [16][D]
template <int NC, int RO>
inline void add_values(const float* p, const float* alpha, const float* v, float* o) {
  constexpr int D = NC * 16;
  __m512 acc[RO][NC];
  for (int r = 0; r < RO; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + c * 16), a);
  }
  for (int t = 0; t < 16; ++t) {
    __m512 vv[NC];
    for (int c = 0; c < NC; ++c) vv[c] = _mm512_loadu_ps(v + t * D + c * 16);
    for (int r = 0; r < RO; ++r) {
      const __m512 pr = _mm512_set1_ps(p[r * 16 + t]);
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_fmadd_ps(pr, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RO; ++r)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(o + r * D + c * 16, acc[r][c]);
}

// rows of a value product at a time: as many as keep the accumulators within sixteen registers
constexpr int value_rows(int nc) { return nc == 1 ? 16 : nc == 2 ? 8 : nc <= 4 ? 4 : 2; }

template <typename T, int NC>
void prefill_run(const at::Tensor& query, const float* kt, const float* vt, int64_t kvh, int64_t nkb, int64_t start,
                 double scale, int64_t window, at::Tensor& out) {
  constexpr int D = NC * 16;
  constexpr int RO = value_rows(NC);
  const int64_t n = query.size(0), heads = query.size(1), group = heads / kvh;
  const int64_t qs0 = query.stride(0), qs1 = query.stride(1);
  const T* q = query.data_ptr<T>();
  T* o = out.data_ptr<T>();
  // a tile: `positions` consecutive query positions times the group's heads, about 48 rows
  const int64_t positions = std::max<int64_t>(1, 48 / group);
  const int64_t tiles = (n + positions - 1) / positions;
  const int64_t units = kvh * tiles;
  const int64_t ctx = start + n;
  const int64_t grain = n * std::min(ctx, window > 0 ? window : ctx) * heads * D < (int64_t)1 << 16 ? units : 1;
  const float sc = static_cast<float>(scale);
  const int64_t max_rows = (positions * group + kRows - 1) / kRows * kRows;
  at::parallel_for(0, units, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> work(max_rows * (2 * D + 16 + 3));
    float* qt = work.data();
    float* acc = qt + max_rows * D;
    float* pr = acc + max_rows * D;
    float* m = pr + max_rows * 16;
    float* l = m + max_rows;
    float* alpha = l + max_rows;
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t u = begin; u < end; ++u) {
      // units alternate between the first and the last tiles, so that any run of them carries
      // about the same number of keys (a tile's causal work grows with its position)
      const int64_t g = u % kvh, i = u / kvh;
      const int64_t tile = i % 2 == 0 ? i / 2 : tiles - 1 - i / 2;
      const int64_t p0 = tile * positions, np = std::min(positions, n - p0);
      const int64_t rows = np * group, padded = (rows + kRows - 1) / kRows * kRows;
      for (int64_t r = 0; r < padded; ++r) {
        if (r < rows) {
          const T* src = q + (p0 + r / group) * qs0 + (g * group + r % group) * qs1;
          for (int e = 0; e < D; ++e) qt[r * D + e] = static_cast<float>(src[e]) * sc;
        } else {
          std::fill(qt + r * D, qt + (r + 1) * D, 0.f);
        }
        m[r] = kNegInf;
        l[r] = 0.f;
      }
      std::fill(acc, acc + padded * D, 0.f);
      const int64_t first_pos = start + p0, last_pos = start + p0 + np - 1;
      const int64_t first_key = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
      const float* ktg = kt + g * nkb * D * 16;
      const float* vtg = vt + g * nkb * 16 * D;
      for (int64_t kb = first_key / 16; kb * 16 <= last_pos; ++kb) {
        const __m512i keys = _mm512_add_epi32(iota, _mm512_set1_epi32(static_cast<int>(kb * 16)));
        // every row sees every key of the block: no mask to build
        const bool whole = kb * 16 + 15 <= first_pos && (window <= 0 || kb * 16 > last_pos - window);
        for (int64_t r0 = 0; r0 < padded; r0 += kRows) {
          __m512 s[kRows];
          score_rows<NC>(qt + r0 * D, ktg + kb * D * 16, s);
          __mmask16 live[kRows];
          for (int r = 0; r < kRows; ++r) {
            live[r] = 0xFFFF;
            if (!whole) {  // padding rows take the last row's position
              const int64_t pos = start + p0 + std::min<int64_t>(r0 + r, rows - 1) / group;
              live[r] = _mm512_cmple_epi32_mask(keys, _mm512_set1_epi32(static_cast<int>(pos)));
              if (window > 0)
                live[r] &= _mm512_cmpgt_epi32_mask(keys, _mm512_set1_epi32(static_cast<int>(pos - window)));
              s[r] = _mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), live[r], s[r]);
            }
          }
          // the sixteen rows' running maxima, corrections and sums as one vector each (lane r: row r0 + r);
          // a row that has seen no key yet keeps the maximum -inf, is shifted by 0 and sums zeros
          const __m512 m_old = _mm512_loadu_ps(m + r0);
          const __m512 m_new = _mm512_max_ps(m_old, reduce16(s, Max{}));
          const __m512 shift = _mm512_mask_mov_ps(m_new, _mm512_cmp_ps_mask(m_new, _mm512_set1_ps(kNegInf), _CMP_EQ_OQ),
                                                  _mm512_setzero_ps());
          _mm512_storeu_ps(alpha + r0, exp16(_mm512_sub_ps(m_old, shift)));  // 0 where m_old is -inf
          _mm512_storeu_ps(m + r0, m_new);
          alignas(64) float sh[kRows];
          _mm512_store_ps(sh, shift);
          for (int r = 0; r < kRows; ++r) {
            s[r] = _mm512_maskz_mov_ps(live[r], exp16(_mm512_sub_ps(s[r], _mm512_set1_ps(sh[r]))));
            _mm512_storeu_ps(pr + (r0 + r) * 16, s[r]);
          }
          _mm512_storeu_ps(l + r0, _mm512_fmadd_ps(_mm512_loadu_ps(l + r0), _mm512_loadu_ps(alpha + r0),
                                                   reduce16(s, Add{})));
        }
        for (int64_t r0 = 0; r0 < padded; r0 += RO)
          add_values<NC, RO>(pr + r0 * 16, alpha + r0, vtg + kb * 16 * D, acc + r0 * D);
      }
      for (int64_t r = 0; r < rows; ++r) {
        const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
        T* dst = o + ((p0 + r / group) * heads + g * group + r % group) * D;
        for (int e = 0; e < D; ++e) dst[e] = static_cast<T>(acc[r * D + e] * inv);
      }
    }
  });
}

template <typename T>
at::Tensor prefill_typed(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& slots, int64_t start, double scale, int64_t window) {
  const int64_t n = query.size(0), d = query.size(2), kvh = k_cache.size(1), ctx = start + n;
  const int64_t nkb = (ctx + 15) / 16;
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t p = 0; p < ctx; ++p)
    TORCH_CHECK(sl[p] >= 0 && sl[p] < k_cache.size(0), "slot ", sl[p], " outside the cache");
  at::Tensor kt = at::empty({kvh * nkb * d * 16}, query.options().dtype(at::kFloat));
  at::Tensor vt = at::empty({kvh * nkb * 16 * d}, query.options().dtype(at::kFloat));
  pack<T>(k_cache, v_cache, sl, ctx, nkb, kt.data_ptr<float>(), vt.data_ptr<float>());
  at::Tensor out = at::empty({n, query.size(1), d}, query.options());
  switch (d) {
#define GOODPUT_CASE(NC)                                                                                      \
  case NC * 16:                                                                                               \
    prefill_run<T, NC>(query, kt.data_ptr<float>(), vt.data_ptr<float>(), kvh, nkb, start, scale, window, out); \
    break;
    GOODPUT_CASE(1) GOODPUT_CASE(2) GOODPUT_CASE(3) GOODPUT_CASE(4)
    GOODPUT_CASE(5) GOODPUT_CASE(6) GOODPUT_CASE(7) GOODPUT_CASE(8)
#undef GOODPUT_CASE
    default: return at::Tensor();
  }
  return out;
}
#endif

}  // namespace

// query [n, H, D] of a prompt chunk whose first position is `start`, attended causally over context
// positions 0 .. start + n - 1 (slots [start + n]: each position's cache slot) -> [n, H, D]; None
// (an undefined tensor) where this build has no kernel for it: no AVX-512, or D not 16 .. 128 in
// steps of 16
at::Tensor prefill(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& slots, int64_t start, double scale, int64_t window) {
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(query.stride(2) == 1 && k_cache.is_contiguous() && v_cache.is_contiguous(), "bad strides");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "mixed dtypes");
  TORCH_CHECK(query.size(2) == k_cache.size(2) && query.size(1) % k_cache.size(1) == 0, "bad heads");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && start >= 0 &&
              slots.size(0) == start + query.size(0), "bad slots");
#if defined(__AVX512F__)
  if (query.size(0) == 0) return at::empty(query.sizes(), query.options());
  if (query.scalar_type() == at::kFloat)
    return prefill_typed<float>(query, k_cache, v_cache, slots, start, scale, window);
  if (query.scalar_type() == at::kBFloat16)
    return prefill_typed<c10::BFloat16>(query, k_cache, v_cache, slots, start, scale, window);
#endif
  return at::Tensor();
}
"""

PREFILL_DECL = (
    "at::Tensor prefill(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache, "
    "const at::Tensor& slots, int64_t start, double scale, int64_t window);"
)
