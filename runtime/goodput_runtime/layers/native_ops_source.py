"""The C++ source of the fused element-wise operations of a decoder layer on CPU (layers/fused.py).

Built into the same extension as the attention kernels (native_attention.py), after
``native_attention_source.SOURCE``, whose helpers (``exp16``) it uses. Each replaces a chain of
torch operations that each read and write the whole step once (and cost a dispatch each, which
is most of their time in a decode step): float32 only, AVX-512 only; elsewhere each returns an
undefined tensor (None in Python) and the caller runs the torch operations. Products and sums are
rounded as torch rounds them (the build does not contract them into FMAs), except the order of
the RMS norm's sum of squares and the exponential's last bit.
"""

OPS_SOURCE = r"""
namespace {

#if defined(__AVX512F__)
inline __mmask16 tail_mask(int64_t left) { return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1); }

// rows [begin, end) of h (row stride hs): residual (stride rs) += h when add, then out = rms_norm(residual) * w
void norm_rows(const float* h, int64_t hs, float* residual, int64_t rs, bool add, const float* w, float* out,
               int64_t width, float eps, int64_t begin, int64_t end) {
  for (int64_t t = begin; t < end; ++t) {
    const float* x = h + t * hs;
    float* r = residual + t * rs;
    float* o = out + t * width;
    __m512 sq = _mm512_setzero_ps();
    for (int64_t e = 0; e < width; e += 16) {
      const __mmask16 k = tail_mask(width - e);
      __m512 v = _mm512_maskz_loadu_ps(k, x + e);
      if (add) {
        v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(k, r + e));
        _mm512_mask_storeu_ps(r + e, k, v);
      }
      sq = _mm512_add_ps(sq, _mm512_mul_ps(v, v));
    }
    const float inv = 1.f / std::sqrt(_mm512_reduce_add_ps(sq) / static_cast<float>(width) + eps);
    const __m512 iv = _mm512_set1_ps(inv);
    const float* src = add ? r : x;
    for (int64_t e = 0; e < width; e += 16) {
      const __mmask16 k = tail_mask(width - e);
      const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, src + e), iv);
      _mm512_mask_storeu_ps(o + e, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, w + e), v));
    }
  }
}
#endif

bool fusable(const at::Tensor& t) { return t.scalar_type() == at::kFloat && !t.is_cuda(); }

}  // namespace

// rms_norm(h) * weight (add: residual += h first, in place, and the norm is of the sum) -> [T, width]
at::Tensor rms_norm(const at::Tensor& h, const at::Tensor& residual, bool add, const at::Tensor& weight, double eps) {
#if defined(__AVX512F__)
  if (!fusable(h) || !fusable(weight) || (add && !fusable(residual))) return at::Tensor();
  TORCH_CHECK(h.dim() == 2 && h.stride(1) == 1 && weight.is_contiguous() && weight.size(0) == h.size(1), "bad shapes");
  TORCH_CHECK(!add || (residual.sizes() == h.sizes() && residual.stride(1) == 1), "bad residual");
  const int64_t rows = h.size(0), width = h.size(1);
  at::Tensor out = at::empty({rows, width}, h.options());
  const float* x = h.data_ptr<float>();
  float* r = add ? residual.data_ptr<float>() : nullptr;
  const int64_t hs = h.stride(0), rs = add ? residual.stride(0) : 0;
  at::parallel_for(0, rows, rows * width < (int64_t)1 << 16 ? rows : 1, [&](int64_t begin, int64_t end) {
    norm_rows(x, hs, r, rs, add, weight.data_ptr<float>(), out.data_ptr<float>(), width, static_cast<float>(eps),
              begin, end);
  });
  return out;
#else
  return at::Tensor();
#endif
}

// the rotary embedding (rotate-half), in place, on qk [T, heads, D] (rows and heads strided, D
// contiguous) with cos, sin [T, D] contiguous; true where it ran
bool rotary_(at::Tensor qk, const at::Tensor& cos, const at::Tensor& sin) {
#if defined(__AVX512F__)
  if (!fusable(qk) || !fusable(cos) || !fusable(sin)) return false;
  TORCH_CHECK(qk.dim() == 3 && qk.stride(2) == 1 && cos.is_contiguous() && sin.is_contiguous(), "bad strides");
  const int64_t rows = qk.size(0), heads = qk.size(1), d = qk.size(2), half = d / 2;
  TORCH_CHECK(d % 2 == 0 && cos.size(0) == rows && cos.size(1) == d && sin.sizes() == cos.sizes(), "bad shapes");
  const int64_t s0 = qk.stride(0), s1 = qk.stride(1);
  float* base = qk.data_ptr<float>();
  const float* cb = cos.data_ptr<float>();
  const float* sb = sin.data_ptr<float>();
  at::parallel_for(0, rows, rows * heads * d < (int64_t)1 << 16 ? rows : 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cb + t * d;
      const float* s = sb + t * d;
      for (int64_t h = 0; h < heads; ++h) {
        float* x = base + t * s0 + h * s1;
        for (int64_t e = 0; e < half; e += 16) {
          const __mmask16 k = tail_mask(half - e);
          const __m512 lo = _mm512_maskz_loadu_ps(k, x + e), hi = _mm512_maskz_loadu_ps(k, x + half + e);
          // x * cos + rotate_half(x) * sin, rotate_half(x) = (-hi, lo)
          const __m512 out_lo = _mm512_add_ps(_mm512_mul_ps(lo, _mm512_maskz_loadu_ps(k, c + e)),
                                              _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), hi),
                                                            _mm512_maskz_loadu_ps(k, s + e)));
          const __m512 out_hi = _mm512_add_ps(_mm512_mul_ps(hi, _mm512_maskz_loadu_ps(k, c + half + e)),
                                              _mm512_mul_ps(lo, _mm512_maskz_loadu_ps(k, s + half + e)));
          _mm512_mask_storeu_ps(x + e, k, out_lo);
          _mm512_mask_storeu_ps(x + half + e, k, out_hi);
        }
      }
    }
  });
  return true;
#else
  return false;
#endif
}

// silu(gate) * up of gate_up [T, 2 * width] (gate first) -> [T, width]
at::Tensor silu_mul(const at::Tensor& gate_up, int64_t width) {
#if defined(__AVX512F__)
  if (!fusable(gate_up)) return at::Tensor();
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) == 2 * width, "bad shapes");
  const int64_t rows = gate_up.size(0), gs = gate_up.stride(0);
  at::Tensor out = at::empty({rows, width}, gate_up.options());
  const float* src = gate_up.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const __m512 one = _mm512_set1_ps(1.f);
  at::parallel_for(0, rows, rows * width < (int64_t)1 << 16 ? rows : 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = src + t * gs;
      const float* u = g + width;
      float* o = dst + t * width;
      for (int64_t e = 0; e < width; e += 16) {
        const __mmask16 k = tail_mask(width - e);
        const __m512 x = _mm512_maskz_loadu_ps(k, g + e);
        // torch's silu: x / (1 + e^-x)
        const __m512 silu = _mm512_div_ps(x, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
        _mm512_mask_storeu_ps(o + e, k, _mm512_mul_ps(silu, _mm512_maskz_loadu_ps(k, u + e)));
      }
    }
  });
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
