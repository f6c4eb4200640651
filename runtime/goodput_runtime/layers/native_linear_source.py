"""The C++ source of the skinny float32 product of a CPU decode step's projections (the ``native`` form of
layers/step_plan.py).

A decode step multiplies a few rows (one a sequence) by every weight of the model, so it is bound by
reading the weights, not by arithmetic. MKL's GEMM takes slow paths for such products on some CPUs
(on the project's AMD EPYC, 8 GB/s of weights for one row where a plain sum reads 26). This walks each
weight row once: eight output rows at a time, their dot products with one input row at a time kept in
eight eight-lane accumulators while the eight weight rows stay in cache for the next input row (on that
EPYC this beat tiles of 4 x 3 and 3 x 4 outputs at every row count from 1 to 32). The threads take
contiguous ranges of output rows, so each streams its own part of the weight. Built into the same
extension as the attention kernels (native_attention.py), after their source, whose ``sum8`` it uses;
compiled where the CPU has AVX2 and FMA, elsewhere ``skinny_linear`` returns an undefined tensor (None
in Python) and the step plan never offers the form. Sums run in another order than MKL's, so results
agree to float rounding, not bit for bit; each row's sums are the same whatever rows share the call.
"""

LINEAR_SOURCE = r"""
namespace {

#if defined(__AVX2__) && defined(__FMA__)
// y[r] = x . w[r] (+ bias[r]) for R rows of w (row stride k), y's entries at stride 1.
template <int R>
inline void skinny_tile(const float* x, const float* w, int64_t k, const float* bias, float* y) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    const __m256 xv = _mm256_loadu_ps(x + i);
    for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(w + r * k + i), xv, acc[r]);
  }
  for (int r = 0; r < R; ++r) {
    float s = sum8(acc[r]);  // native_attention_source's
    for (int64_t j = i; j < k; ++j) s += w[r * k + j] * x[j];
    y[r] = bias ? s + bias[r] : s;
  }
}

// Output rows [begin, end) of y = x @ w^T (+ bias): eight at a time, against each input row in turn while
// the eight weight rows stay in cache.
void skinny_rows(const float* x, int64_t ldx, int64_t rows, const float* w, int64_t k, const float* bias, float* y,
                 int64_t ldy, int64_t begin, int64_t end) {
  int64_t n = begin;
  for (; n + 8 <= end; n += 8) {
    for (int64_t m = 0; m < rows; ++m)
      skinny_tile<8>(x + m * ldx, w + n * k, k, bias ? bias + n : nullptr, y + m * ldy + n);
  }
  for (; n < end; ++n) {
    for (int64_t m = 0; m < rows; ++m)
      skinny_tile<1>(x + m * ldx, w + n * k, k, bias ? bias + n : nullptr, y + m * ldy + n);
  }
}
#endif

}  // namespace

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
#if defined(__AVX2__) && defined(__FMA__)
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "skinny_linear: shapes");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "skinny_linear: float32 only");
  TORCH_CHECK(x.stride(1) == 1 && weight.is_contiguous(), "skinny_linear: rows must be dense");
  const int64_t rows = x.size(0), k = x.size(1), out_rows = weight.size(0);
  at::Tensor out = at::empty({rows, out_rows}, x.options());
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == out_rows,
                "skinny_linear: bias");
    b = bias->data_ptr<float>();
  }
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  // contiguous ranges of whole eight-row blocks, one a thread
  at::parallel_for(0, (out_rows + 7) / 8, 1, [&](int64_t first, int64_t last) {
    skinny_rows(xp, ldx, rows, wp, k, b, yp, out_rows, first * 8, std::min(out_rows, last * 8));
  });
  return out;
#else
  return at::Tensor();
#endif
}
"""

LINEAR_DECL = (
    "at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);"
)
LINEAR_FUNCTIONS = ["skinny_linear"]
