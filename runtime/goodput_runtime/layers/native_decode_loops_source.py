"""The decode kernel's loops over a batch (C++, compiled with native_attention_source.SOURCE in one
translation unit, between its folds and its entry point): the plan that splits a batch into units of
work, the one-pass loop that folds each chunk of keys into a running softmax (float32, and bfloat16
without AVX-512 BF16), and the two-pass loop for bfloat16 caches on a CPU with AVX-512 BF16.

The one-pass fold (``FoldAvx512``) folds every sixteen keys into a running softmax: a horizontal max,
an exponential for the correction, a rescale of the sums of values and a horizontal sum, per query
head and per sixteen keys, each waiting on the last. Here a unit (a sequence's kv heads with their
query groups) is attended in three passes instead: every key's score for every head of the unit into
a buffer, the maxima kept as vectors; each head's exponentials less its maximum, and their sum,
sixteen at a time with no chain between them; then each chunk's values widened to fp32 once for the
whole group and added, weighted, into each head's sums. Scores are pairwise bf16 products summed in
fp32 (``vdpbf16ps``) with the scaled queries rounded to bf16 (exact for head dims 16, 64 and 256,
whose scale is a power of two). The result is the same softmax summed in another order, equal to the
float32 kernel's on the same values within bf16's rounding (tests/runtime/test_bf16_cpu.py).

Against the one-pass fold in bf16, alternating in one process: 0.81-0.95x the time for 4-64 sequences
of 256-800 tokens, level for one sequence of 1,000 (three runs). Both read the cache at 10-12 GB/s
there, on a day the machine's memory read 12-14 GB/s: the loop is bound by memory, and the fold's
chain cost the rest.
"""

LOOPS_SOURCE = r"""
// what both decode loops share: the checks, and the batch's split into units of work. A unit: one
// sequence with all its heads (each block read whole, in turn), or where that leaves the threads too
// few units to share out evenly, one kv head of it with its query group, or one query head
struct DecodePlan {
  int64_t b, heads, d, kvh, group, row, nblocks, blocks_stride, qs0, qs1, bs, window;
  int64_t threads, kv_per, g, per_seq, units;
  bool fork;  // enough work to share among threads
  const int64_t* bl;
  const int64_t* ln;

  DecodePlan(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& blocks, const at::Tensor& lens,
             int64_t block_size, int64_t window_)
      : b(query.size(0)), heads(query.size(1)), d(query.size(2)), kvh(k_cache.size(1)), group(heads / kvh),
        row(kvh * d), nblocks(blocks.size(1)), blocks_stride(blocks.stride(0)), qs0(query.stride(0)),
        qs1(query.stride(1)), bs(block_size), window(window_), bl(blocks.data_ptr<int64_t>()),
        ln(lens.data_ptr<int64_t>()) {
    int64_t total = 0;
    for (int64_t i = 0; i < b; ++i) {
      // keys past the row's blocks are masked off, as decode_mask masks them over the group's width
      const int64_t n = len(i);
      TORCH_CHECK(ln[i] >= 1, "context length ", ln[i]);
      for (int64_t j = 0; j * bs < n; ++j) {
        const int64_t block = bl[i * blocks_stride + j];
        TORCH_CHECK(block >= 0 && (block + 1) * bs <= k_cache.size(0), "block ", block, " outside the cache");
      }
      total += n - first(i);
    }
    threads = at::get_num_threads();
    kv_per = b >= 4 * threads ? kvh : 1;
    g = kv_per == 1 && b * kvh < 4 * threads ? 1 : group;
    per_seq = heads / (kv_per * g);
    units = b * per_seq;
    fork = total * heads * d >= (int64_t)1 << 16;  // little work: no fork
  }
  int64_t len(int64_t i) const { return std::min(ln[i], nblocks * bs); }
  int64_t first(int64_t i) const { return window > 0 ? std::max<int64_t>(0, ln[i] - window) : 0; }
  // a unit costs its keys (and a little for its heads' set-up and output)
  int64_t cost(int64_t u) const {
    const int64_t i = u / per_seq;
    return len(i) - first(i) + 8;
  }
  // unit u's sequence, first kv head and first query head within that head's group
  void unit(int64_t u, int64_t& i, int64_t& kv0, int64_t& j0) const {
    i = u / per_seq;
    const int64_t part = u % per_seq;
    kv0 = kv_per == 1 ? (g == 1 ? part / group : part) : 0;
    j0 = g == 1 ? part % group : 0;
  }
  // body(begin, end) over ranges of the units, shared among the threads
  template <typename Body>
  void for_units(const Body& body) const {
    parallel_balanced(fork ? threads : 1, units, [&](int64_t u) { return cost(u); }, body);
  }
  // a unit's output rows: each of its heads' sums of values `acc` [kv_per * g, d] over its sum `l`
  template <typename T>
  void write(T* o, int64_t i, int64_t kv0, int64_t j0, const float* acc, const float* l) const {
    for (int64_t x = 0; x < kv_per; ++x)
      for (int64_t j = 0; j < g; ++j) {
        const int64_t s = x * g + j;
        const float inv = l[s] > 0.f ? 1.f / l[s] : 0.f;
        T* oh = o + (i * heads + (kv0 + x) * group + j0 + j) * d;
        for (int64_t e = 0; e < d; ++e) oh[e] = static_cast<T>(acc[s * d + e] * inv);
      }
  }
};

template <typename T, typename Fold>
void run(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache, const DecodePlan& pl,
         double scale, const Fold& fold, at::Tensor& out) {
  const int64_t d = pl.d, row = pl.row, bs = pl.bs, kv_per = pl.kv_per, g = pl.g, group = pl.group;
  const T* q = query.data_ptr<T>();
  const T* kc = k_cache.data_ptr<T>();
  const T* vc = v_cache.data_ptr<T>();
  T* o = out.data_ptr<T>();
  const float sc = static_cast<float>(scale);
  pl.for_units([&](int64_t begin, int64_t end) {
    const int64_t hs = kv_per * g;
    std::vector<float> work(hs * (2 * d + 2) + g * kChunk);
    float* qf = work.data();
    float* acc = qf + hs * d;
    float* m = acc + hs * d;
    float* l = m + hs;
    float* scratch = l + hs;
    for (int64_t u = begin; u < end; ++u) {
      int64_t i, kv0, j0;
      pl.unit(u, i, kv0, j0);
      for (int64_t x = 0; x < kv_per; ++x)
        for (int64_t j = 0; j < g; ++j) {
          const T* qh = q + i * pl.qs0 + ((kv0 + x) * group + j0 + j) * pl.qs1;
          const int64_t s = x * g + j;
          for (int64_t e = 0; e < d; ++e) qf[s * d + e] = static_cast<float>(qh[e]) * sc;
          m[s] = kNegInf;
          l[s] = 0.f;
        }
      std::fill(acc, acc + hs * d, 0.f);
      const int64_t len = pl.len(i), first = pl.first(i);
      const int64_t* table = pl.bl + i * pl.blocks_stride;
      for (int64_t blk = first / bs; blk * bs < len; ++blk) {
        const int64_t lo = std::max(first, blk * bs), hi = std::min(len, (blk + 1) * bs);
        const int64_t slot0 = table[blk] * bs - blk * bs;  // slot of context position p: slot0 + p
        if ((blk + 1) * bs < len) {  // the next block's rows of these heads, on their way while this one runs
          const int64_t next = table[blk + 1] * bs * row + kv0 * d;
          for (int64_t r = 0; r < bs; ++r)
            for (int64_t e = 0; e < kv_per * d; e += 64 / (int64_t)sizeof(T)) {
              __builtin_prefetch(kc + next + r * row + e);
              __builtin_prefetch(vc + next + r * row + e);
            }
        }
        for (int64_t x = 0; x < kv_per; ++x)
          for (int64_t c0 = lo; c0 < hi; c0 += kChunk) {
            const int64_t off = (slot0 + c0) * row + (kv0 + x) * d;
            fold(qf + x * g * d, acc + x * g * d, m + x * g, l + x * g, kc + off, vc + off, row,
                 std::min(kChunk, hi - c0), g, scratch);
          }
      }
      pl.write(o, i, kv0, j0, acc, l);
    }
  });
}

template <typename T>
bool two_pass(const at::Tensor&, const at::Tensor&, const at::Tensor&, const DecodePlan&, double, at::Tensor&) {
  return false;
}

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
// acc [16 * NC] += the sum over n keys of p[t] * vw[t] (vw: the keys' values widened to fp32, 16 * NC
// a row, 64-byte aligned)
template <int NC>
inline void add_values(float* acc, const float* p, const float* vw, int64_t n) {
  constexpr int64_t D = NC * 16;
  __m512 a[NC], b[NC];  // even and odd keys: two chains of adds
  for (int c = 0; c < NC; ++c) {
    a[c] = _mm512_loadu_ps(acc + c * 16);
    b[c] = _mm512_setzero_ps();
  }
  int64_t t = 0;
  for (; t + 1 < n; t += 2) {
    const __m512 p0 = _mm512_set1_ps(p[t]), p1 = _mm512_set1_ps(p[t + 1]);
    for (int c = 0; c < NC; ++c) {
      a[c] = _mm512_fmadd_ps(p0, _mm512_load_ps(vw + t * D + c * 16), a[c]);
      b[c] = _mm512_fmadd_ps(p1, _mm512_load_ps(vw + (t + 1) * D + c * 16), b[c]);
    }
  }
  if (t < n) {
    const __m512 p0 = _mm512_set1_ps(p[t]);
    for (int c = 0; c < NC; ++c) a[c] = _mm512_fmadd_ps(p0, _mm512_load_ps(vw + t * D + c * 16), a[c]);
  }
  for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + c * 16, _mm512_add_ps(a[c], b[c]));
}

template <int NC>
void run_two_pass(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache, const DecodePlan& pl,
                  double scale, at::Tensor& out) {
  using T = c10::BFloat16;
  constexpr int64_t D = NC * 16;
  constexpr int NP = (NC + 1) / 2;  // vectors of 32 bf16 lanes a row takes (the last half empty for odd NC)
  const int64_t row = pl.row, bs = pl.bs, kv_per = pl.kv_per, g = pl.g, group = pl.group;
  const T* q = query.data_ptr<T>();
  const T* kc = k_cache.data_ptr<T>();
  const T* vc = v_cache.data_ptr<T>();
  T* o = out.data_ptr<T>();
  const float sc = static_cast<float>(scale);
  pl.for_units([&](int64_t begin, int64_t end) {
    const int64_t hs = kv_per * g;
    std::vector<__m512bh> qb(hs * NP);
    std::vector<__m512> maxv(hs);
    std::vector<float> acc(hs * D), l(hs), scores;
    alignas(64) float qf[D];
    alignas(64) float vw[kChunk * D];
    for (int64_t u = begin; u < end; ++u) {
      int64_t i, kv0, j0;
      pl.unit(u, i, kv0, j0);
      const int64_t len = pl.len(i), first = pl.first(i), n = len - first, npad = (n + 15) / 16 * 16;
      if ((int64_t)scores.size() < hs * npad) scores.resize(hs * npad);
      float* S = scores.data();
      for (int64_t x = 0; x < kv_per; ++x)
        for (int64_t j = 0; j < g; ++j) {
          const T* qh = q + i * pl.qs0 + ((kv0 + x) * group + j0 + j) * pl.qs1;
          const int64_t s = x * g + j;
          for (int64_t e = 0; e < D; ++e) qf[e] = static_cast<float>(qh[e]) * sc;
          for (int p = 0; p < NP; ++p) {
            const __m512 lo = _mm512_load_ps(qf + p * 32);
            const __m512 hi = 2 * p + 1 < NC ? _mm512_load_ps(qf + p * 32 + 16) : _mm512_setzero_ps();
            qb[s * NP + p] = _mm512_cvtne2ps_pbh(hi, lo);
          }
          maxv[s] = _mm512_set1_ps(kNegInf);
        }
      const int64_t* table = pl.bl + i * pl.blocks_stride;
      // the unit's keys in chunks of up to sixteen within a block, the next block's rows of `cache`
      // prefetched while one runs: body(the chunk's first slot, its first context position, its keys)
      const auto chunks = [&](const T* cache, const auto& body) {
        for (int64_t blk = first / bs; blk * bs < len; ++blk) {
          const int64_t lo = std::max(first, blk * bs), hi = std::min(len, (blk + 1) * bs);
          if ((blk + 1) * bs < len) {
            const int64_t next = table[blk + 1] * bs * row + kv0 * D;
            for (int64_t r = 0; r < bs; ++r)
              for (int64_t e = 0; e < kv_per * D; e += 32) __builtin_prefetch(cache + next + r * row + e);
          }
          for (int64_t c0 = lo; c0 < hi; c0 += kChunk)
            body(table[blk] * bs - blk * bs + c0, c0, std::min(kChunk, hi - c0));
        }
      };
      // pass 1: the scores
      chunks(kc, [&](int64_t slot, int64_t c0, int64_t nk) {
        const __mmask16 live = nk >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nk) - 1);
        for (int64_t x = 0; x < kv_per; ++x) {
          const T* k = kc + slot * row + (kv0 + x) * D;
          for (int64_t j = 0; j < g; ++j) {
            const int64_t s = x * g + j;
            __m512 dots[16];
            for (int64_t t = 0; t < 16; ++t) {
              __m512 dot = _mm512_setzero_ps();
              if (t < nk)
                for (int p = 0; p < NP; ++p) {
                  const T* kp = k + t * row + p * 32;
                  const __m512i kv = 2 * p + 1 < NC ? _mm512_loadu_si512(kp) : _mm512_maskz_loadu_epi16(0xFFFF, kp);
                  dot = _mm512_dpbf16_ps(dot, qb[s * NP + p], (__m512bh)kv);
                }
              dots[t] = dot;
            }
            const __m512 sv = hsum16(dots);
            _mm512_mask_storeu_ps(S + s * npad + (c0 - first), live, sv);
            maxv[s] = _mm512_mask_max_ps(maxv[s], live, maxv[s], sv);
          }
        }
      });
      // pass 2: each head's exponentials and their sum
      for (int64_t s = 0; s < hs; ++s) {
        const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(maxv[s]));
        __m512 sum = _mm512_setzero_ps();
        float* sh = S + s * npad;
        for (int64_t t = 0; t < n; t += 16) {
          const __mmask16 live = n - t >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - t)) - 1);
          const __m512 p = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, sh + t), mx)));
          _mm512_storeu_ps(sh + t, p);
          sum = _mm512_add_ps(sum, p);
        }
        l[s] = _mm512_reduce_add_ps(sum);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      // pass 3: the values, widened once a chunk for the whole group
      chunks(vc, [&](int64_t slot, int64_t c0, int64_t nk) {
        for (int64_t x = 0; x < kv_per; ++x) {
          const T* v = vc + slot * row + (kv0 + x) * D;
          for (int64_t t = 0; t < nk; ++t)
            for (int c = 0; c < NC; ++c) _mm512_store_ps(vw + t * D + c * 16, load16(v + t * row + c * 16));
          for (int64_t j = 0; j < g; ++j) {
            const int64_t s = x * g + j;
            add_values<NC>(acc.data() + s * D, S + s * npad + (c0 - first), vw, nk);
          }
        }
      });
      pl.write(o, i, kv0, j0, acc.data(), l.data());
    }
  });
}

template <>
bool two_pass<c10::BFloat16>(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const DecodePlan& plan, double scale, at::Tensor& out) {
  switch (plan.d) {
#define GOODPUT_CASE(NC) \
  case NC * 16: run_two_pass<NC>(query, k_cache, v_cache, plan, scale, out); return true;
    GOODPUT_CASE(1) GOODPUT_CASE(2) GOODPUT_CASE(3) GOODPUT_CASE(4)
    GOODPUT_CASE(5) GOODPUT_CASE(6) GOODPUT_CASE(7) GOODPUT_CASE(8)
#undef GOODPUT_CASE
    default: return false;
  }
}
#endif
"""
