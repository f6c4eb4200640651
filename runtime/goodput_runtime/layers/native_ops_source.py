"""The C++ source of the fused element-wise operations of a decoder layer on CPU (layers/fused.py).

Built into the same extension as the attention kernels (native_attention.py), after
``native_attention_source.SOURCE``, whose helpers (``exp16``) it uses. Each replaces a chain of
torch operations that each read and write the whole step once (and cost a dispatch each, which
is most of their time in a decode step): float32 and bfloat16 with AVX-512 (bfloat16 also needs
AVX-512 BW and VL, for its 16-bit lanes), float32 alone with AVX2 and FMA (eight lanes, the same
roundings); elsewhere each returns an undefined tensor (None in Python) and the caller runs the torch
operations. Products and sums are rounded as torch rounds them (the
build does not contract them into FMAs), except the order of the RMS norm's sum of squares and the
exponential's last bit. In bfloat16 every value is widened to fp32 on load, and each intermediate
result that torch's operations store as bfloat16 (the residual sum, the normalized row before the
weight, each product of the rotary embedding, the SiLU) is rounded to bfloat16 (nearest even) where
torch rounds it, so the fused functions stay torch's up to those same two differences.
"""

OPS_SOURCE = r"""
namespace {

#if defined(__AVX512F__)
inline __mmask16 tail_mask(int64_t left) { return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1); }

// Sixteen values of T at a time as fp32 lanes (masked: lanes off the mask read 0 and are not
// written), and round(v): v as T would hold it, the rounding torch makes where an operation's
// result is stored as T. For float all three are the plain fp32 operations.
template <typename T>
struct Lanes;

template <>
struct Lanes<float> {
  static __m512 load(__mmask16 k, const float* p) { return _mm512_maskz_loadu_ps(k, p); }
  static void store(float* p, __mmask16 k, __m512 v) { _mm512_mask_storeu_ps(p, k, v); }
  static __m512 round(__m512 v) { return v; }
};

#if defined(__AVX512BW__) && defined(__AVX512VL__)
#define GOODPUT_BF16_OPS 1
// fp32 to bf16 bits, rounded to nearest even as c10::BFloat16 rounds (a NaN stays a quiet NaN)
inline __m256i bf16_bits(__m512 v) {
#if defined(__AVX512BF16__)
  return (__m256i)_mm512_cvtneps_pbh(v);
#else
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
#endif
}

inline __m512 widen(__m256i bits) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)); }

template <>
struct Lanes<c10::BFloat16> {
  static __m512 load(__mmask16 k, const c10::BFloat16* p) { return widen(_mm256_maskz_loadu_epi16(k, p)); }
  static void store(c10::BFloat16* p, __mmask16 k, __m512 v) { _mm256_mask_storeu_epi16(p, k, bf16_bits(v)); }
  static __m512 round(__m512 v) { return widen(bf16_bits(v)); }
};
#endif

// rows [begin, end) of h (row stride hs): residual (stride rs) += h when add, then out = rms_norm(residual) * w.
// As torch computes it for T: the sum rounded to T, the norm in fp32, rounded to T, times w rounded to T.
template <typename T>
void norm_rows(const T* h, int64_t hs, T* residual, int64_t rs, bool add, const T* w, T* out, int64_t width,
               float eps, int64_t begin, int64_t end) {
  using L = Lanes<T>;
  for (int64_t t = begin; t < end; ++t) {
    const T* x = h + t * hs;
    T* r = residual + t * rs;
    T* o = out + t * width;
    __m512 sq = _mm512_setzero_ps();
    for (int64_t e = 0; e < width; e += 16) {
      const __mmask16 k = tail_mask(width - e);
      __m512 v = L::load(k, x + e);
      if (add) {
        v = L::round(_mm512_add_ps(v, L::load(k, r + e)));
        L::store(r + e, k, v);
      }
      sq = _mm512_add_ps(sq, _mm512_mul_ps(v, v));
    }
    const float inv = 1.f / std::sqrt(_mm512_reduce_add_ps(sq) / static_cast<float>(width) + eps);
    const __m512 iv = _mm512_set1_ps(inv);
    const T* src = add ? r : x;
    for (int64_t e = 0; e < width; e += 16) {
      const __mmask16 k = tail_mask(width - e);
      const __m512 v = L::round(_mm512_mul_ps(L::load(k, src + e), iv));
      L::store(o + e, k, _mm512_mul_ps(L::load(k, w + e), v));
    }
  }
}

// x * cos + rotate_half(x) * sin in place on qk's rows [begin, end), each product and the sum rounded to T
template <typename T>
void rotary_rows(T* base, int64_t s0, int64_t s1, int64_t heads, int64_t d, const T* cb, const T* sb, int64_t begin,
                 int64_t end) {
  using L = Lanes<T>;
  const int64_t half = d / 2;
  for (int64_t t = begin; t < end; ++t) {
    const T* c = cb + t * d;
    const T* s = sb + t * d;
    for (int64_t h = 0; h < heads; ++h) {
      T* x = base + t * s0 + h * s1;
      for (int64_t e = 0; e < half; e += 16) {
        const __mmask16 k = tail_mask(half - e);
        const __m512 lo = L::load(k, x + e), hi = L::load(k, x + half + e);
        // rotate_half(x) = (-hi, lo)
        const __m512 out_lo = _mm512_add_ps(
            L::round(_mm512_mul_ps(lo, L::load(k, c + e))),
            L::round(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), hi), L::load(k, s + e))));
        const __m512 out_hi = _mm512_add_ps(L::round(_mm512_mul_ps(hi, L::load(k, c + half + e))),
                                            L::round(_mm512_mul_ps(lo, L::load(k, s + half + e))));
        L::store(x + e, k, out_lo);
        L::store(x + half + e, k, out_hi);
      }
    }
  }
}

// silu(gate) * up of rows [begin, end) (torch's silu, x / (1 + e^-x), rounded to T, times up rounded to T)
template <typename T>
void silu_rows(const T* src, int64_t gs, T* dst, int64_t width, int64_t begin, int64_t end) {
  using L = Lanes<T>;
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t t = begin; t < end; ++t) {
    const T* g = src + t * gs;
    const T* u = g + width;
    T* o = dst + t * width;
    for (int64_t e = 0; e < width; e += 16) {
      const __mmask16 k = tail_mask(width - e);
      const __m512 x = L::load(k, g + e);
      const __m512 silu =
          L::round(_mm512_div_ps(x, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), x)))));
      L::store(o + e, k, _mm512_mul_ps(silu, L::load(k, u + e)));
    }
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
// The same three for float32 on a CPU with AVX2 and no AVX-512, eight lanes at a time (the tail by a
// lane mask), rounded as the AVX-512 versions round float32.
#define GOODPUT_AVX2_OPS 1
inline __m256i tail_mask8(int64_t left) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(left, 8))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

template <typename T>
void norm_rows(const T* h, int64_t hs, T* residual, int64_t rs, bool add, const T* w, T* out, int64_t width,
               float eps, int64_t begin, int64_t end) {
  static_assert(std::is_same<T, float>::value, "float32 only without AVX-512");
  for (int64_t t = begin; t < end; ++t) {
    const float* x = h + t * hs;
    float* r = residual + t * rs;
    float* o = out + t * width;
    __m256 sq = _mm256_setzero_ps();
    for (int64_t e = 0; e < width; e += 8) {
      const __m256i k = tail_mask8(width - e);
      __m256 v = _mm256_maskload_ps(x + e, k);
      if (add) {
        v = _mm256_add_ps(v, _mm256_maskload_ps(r + e, k));
        _mm256_maskstore_ps(r + e, k, v);
      }
      sq = _mm256_add_ps(sq, _mm256_mul_ps(v, v));
    }
    const float inv = 1.f / std::sqrt(sum8(sq) / static_cast<float>(width) + eps);
    const __m256 iv = _mm256_set1_ps(inv);
    const float* src = add ? r : x;
    for (int64_t e = 0; e < width; e += 8) {
      const __m256i k = tail_mask8(width - e);
      const __m256 v = _mm256_mul_ps(_mm256_maskload_ps(src + e, k), iv);
      _mm256_maskstore_ps(o + e, k, _mm256_mul_ps(_mm256_maskload_ps(w + e, k), v));
    }
  }
}

template <typename T>
void rotary_rows(T* base, int64_t s0, int64_t s1, int64_t heads, int64_t d, const T* cb, const T* sb, int64_t begin,
                 int64_t end) {
  static_assert(std::is_same<T, float>::value, "float32 only without AVX-512");
  const int64_t half = d / 2;
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t t = begin; t < end; ++t) {
    const float* c = cb + t * d;
    const float* s = sb + t * d;
    for (int64_t h = 0; h < heads; ++h) {
      float* x = base + t * s0 + h * s1;
      for (int64_t e = 0; e < half; e += 8) {
        const __m256i k = tail_mask8(half - e);
        const __m256 lo = _mm256_maskload_ps(x + e, k), hi = _mm256_maskload_ps(x + half + e, k);
        const __m256 out_lo = _mm256_add_ps(_mm256_mul_ps(lo, _mm256_maskload_ps(c + e, k)),
                                            _mm256_mul_ps(_mm256_xor_ps(hi, sign), _mm256_maskload_ps(s + e, k)));
        const __m256 out_hi = _mm256_add_ps(_mm256_mul_ps(hi, _mm256_maskload_ps(c + half + e, k)),
                                            _mm256_mul_ps(lo, _mm256_maskload_ps(s + half + e, k)));
        _mm256_maskstore_ps(x + e, k, out_lo);
        _mm256_maskstore_ps(x + half + e, k, out_hi);
      }
    }
  }
}

template <typename T>
void silu_rows(const T* src, int64_t gs, T* dst, int64_t width, int64_t begin, int64_t end) {
  static_assert(std::is_same<T, float>::value, "float32 only without AVX-512");
  const __m256 one = _mm256_set1_ps(1.f);
  for (int64_t t = begin; t < end; ++t) {
    const float* g = src + t * gs;
    const float* u = g + width;
    float* o = dst + t * width;
    for (int64_t e = 0; e < width; e += 8) {
      const __m256i k = tail_mask8(width - e);
      const __m256 x = _mm256_maskload_ps(g + e, k);
      const __m256 silu = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
      _mm256_maskstore_ps(o + e, k, _mm256_mul_ps(silu, _mm256_maskload_ps(u + e, k)));
    }
  }
}
#endif

// the dtypes the fused functions take: float32, and bfloat16 where the build has the 16-bit lane loads
bool fusable(const at::Tensor& t, at::ScalarType dtype) {
  if (t.is_cuda() || t.scalar_type() != dtype) return false;
#if defined(GOODPUT_BF16_OPS)
  return dtype == at::kFloat || dtype == at::kBFloat16;
#else
  return dtype == at::kFloat;
#endif
}

}  // namespace

// rms_norm(h) * weight (add: residual += h first, in place, and the norm is of the sum) -> [T, width]
at::Tensor rms_norm(const at::Tensor& h, const at::Tensor& residual, bool add, const at::Tensor& weight, double eps) {
#if defined(__AVX512F__) || defined(GOODPUT_AVX2_OPS)
  const auto dtype = h.scalar_type();
  if (!fusable(h, dtype) || !fusable(weight, dtype) || (add && !fusable(residual, dtype))) return at::Tensor();
  TORCH_CHECK(h.dim() == 2 && h.stride(1) == 1 && weight.is_contiguous() && weight.size(0) == h.size(1), "bad shapes");
  TORCH_CHECK(!add || (residual.sizes() == h.sizes() && residual.stride(1) == 1), "bad residual");
  const int64_t rows = h.size(0), width = h.size(1);
  at::Tensor out = at::empty({rows, width}, h.options());
  const int64_t hs = h.stride(0), rs = add ? residual.stride(0) : 0;
  const int64_t grain = rows * width < (int64_t)1 << 16 ? rows : 1;
  const auto run = [&](auto* typed) {
    using T = std::remove_pointer_t<decltype(typed)>;
    const T* x = h.data_ptr<T>();
    T* r = add ? residual.data_ptr<T>() : nullptr;
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
      norm_rows<T>(x, hs, r, rs, add, weight.data_ptr<T>(), out.data_ptr<T>(), width, static_cast<float>(eps),
                   begin, end);
    });
  };
  if (dtype == at::kFloat) {
    run(static_cast<float*>(nullptr));
#if defined(GOODPUT_BF16_OPS)
  } else {
    run(static_cast<c10::BFloat16*>(nullptr));
#endif
  }
  return out;
#else
  return at::Tensor();
#endif
}

// the rotary embedding (rotate-half), in place, on qk [T, heads, D] (rows and heads strided, D
// contiguous) with cos, sin [T, D] contiguous; true where it ran
bool rotary_(at::Tensor qk, const at::Tensor& cos, const at::Tensor& sin) {
#if defined(__AVX512F__) || defined(GOODPUT_AVX2_OPS)
  const auto dtype = qk.scalar_type();
  if (!fusable(qk, dtype) || !fusable(cos, dtype) || !fusable(sin, dtype)) return false;
  TORCH_CHECK(qk.dim() == 3 && qk.stride(2) == 1 && cos.is_contiguous() && sin.is_contiguous(), "bad strides");
  const int64_t rows = qk.size(0), heads = qk.size(1), d = qk.size(2);
  TORCH_CHECK(d % 2 == 0 && cos.size(0) == rows && cos.size(1) == d && sin.sizes() == cos.sizes(), "bad shapes");
  const int64_t s0 = qk.stride(0), s1 = qk.stride(1);
  const int64_t grain = rows * heads * d < (int64_t)1 << 16 ? rows : 1;
  const auto run = [&](auto* typed) {
    using T = std::remove_pointer_t<decltype(typed)>;
    T* base = qk.data_ptr<T>();
    const T* cb = cos.data_ptr<T>();
    const T* sb = sin.data_ptr<T>();
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
      rotary_rows<T>(base, s0, s1, heads, d, cb, sb, begin, end);
    });
  };
  if (dtype == at::kFloat) {
    run(static_cast<float*>(nullptr));
#if defined(GOODPUT_BF16_OPS)
  } else {
    run(static_cast<c10::BFloat16*>(nullptr));
#endif
  }
  return true;
#else
  return false;
#endif
}

// silu(gate) * up of gate_up [T, 2 * width] (gate first) -> [T, width]
at::Tensor silu_mul(const at::Tensor& gate_up, int64_t width) {
#if defined(__AVX512F__) || defined(GOODPUT_AVX2_OPS)
  const auto dtype = gate_up.scalar_type();
  if (!fusable(gate_up, dtype)) return at::Tensor();
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) == 2 * width, "bad shapes");
  const int64_t rows = gate_up.size(0), gs = gate_up.stride(0);
  at::Tensor out = at::empty({rows, width}, gate_up.options());
  const int64_t grain = rows * width < (int64_t)1 << 16 ? rows : 1;
  const auto run = [&](auto* typed) {
    using T = std::remove_pointer_t<decltype(typed)>;
    const T* src = gate_up.data_ptr<T>();
    T* dst = out.data_ptr<T>();
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
      silu_rows<T>(src, gs, dst, width, begin, end);
    });
  };
  if (dtype == at::kFloat) {
    run(static_cast<float*>(nullptr));
#if defined(GOODPUT_BF16_OPS)
  } else {
    run(static_cast<c10::BFloat16*>(nullptr));
#endif
  }
  return out;
#else
  return at::Tensor();
#endif
}
"""

OPS_DECL = (
    "at::Tensor rms_norm(const at::Tensor& h, const at::Tensor& residual, bool add, const at::Tensor& weight, "
    "double eps);\n"
    "bool rotary_(at::Tensor qk, const at::Tensor& cos, const at::Tensor& sin);\n"
    "at::Tensor silu_mul(const at::Tensor& gate_up, int64_t width);"
)
OPS_FUNCTIONS = ["rms_norm", "rotary_", "silu_mul"]
