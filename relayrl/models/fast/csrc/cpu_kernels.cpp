// relayrl's CPU kernels (torch.ops.relayrl_cpu.*), loaded by relayrl/models/fast/kernels.py:
//   decode_step         one KV-cache decode step of a llama-family model (FastDecoder, native=True)
//   sample_inverse_cdf  one inverse-CDF draw per row (TokenSampler, native=True)
//   rms_norm_fwd/bwd, rope  RMSNorm and RoPE of the full-sequence passes, forward and backward (fast.forward)
//
// Why: at the sizes CPU RL runs at (hidden 128-1024, 8-64 rows), a decode step through PyTorch ops is ~400 ATen
// calls, and their dispatch costs more than the arithmetic. Here the matrix products stay ATen/MKL calls (seven per
// layer) and everything between them (RMSNorm, RoPE, the KV-cache write, attention over the cache, residual adds)
// runs as plain loops over contiguous float32 rows. Values match the PyTorch formulation (fast.decoder.FastDecoder)
// to float32 rounding; FastDecoder falls back to it whenever this library is unavailable.
//
// Layouts (all float32, contiguous): h [b, H]; k/v caches [b, Hkv, T, D]; cos / signed_sin tables [T_pos, D];
// positions [b] int64; key_bias [b, T] (0 or -inf) or undefined.
// bfloat16 decoding (policy.precision=bfloat16): the projection weights and biases, the LM head and the k/v caches
// are bfloat16; each matrix product takes its input rounded to bfloat16 and returns bfloat16 (as autocast's linear),
// SiLU x up stays bfloat16, and everything else (residual stream, norms, RoPE, scores, softmax) is float32, reading
// the bfloat16 caches in place. Returns the head's logits in the head's dtype. Per layer, `weights` holds 16 entries, the module's
// own parameter tensors read in place (biases may be None): in_norm, q w/b, k w/b, v w/b, o w/b, post_norm, gate w/b,
// up w/b, down w/b; `eps` holds (in_eps, post_eps) per layer.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kPerLayer = 16;
constexpr int64_t kMaxHeadDim = 512;  // RoPE works on a stack copy of one head
constexpr int64_t kRowGrain = 8;      // rows per task when torch runs several intra-op threads

// out[r] = w * (x[r] / sqrt(mean(x[r]^2) + eps)), the HF RMSNorm in float32; `inv_out` (optional) gets each row's
// 1 / sqrt(mean + eps) for a backward pass.
void rms_norm(const float* x, const float* w, float eps, float* out, int64_t rows, int64_t n,
              float* inv_out = nullptr) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    float* o = out + r * n;
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; ++i) acc += xr[i] * xr[i];
    const float inv = 1.f / std::sqrt(acc / static_cast<float>(n) + eps);
    if (inv_out != nullptr) inv_out[r] = inv;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) o[i] = w[i] * (xr[i] * inv);
  }
}

// In place: x = x * cos + rotate_half(x) * sin for `heads` vectors of size d (sign of rotate_half in signed_sin).
void rope(float* x, const float* cos, const float* ssin, int64_t heads, int64_t d) {
  const int64_t half = d / 2;
  float tmp[kMaxHeadDim];
  for (int64_t h = 0; h < heads; ++h) {
    float* v = x + h * d;
    for (int64_t i = 0; i < d; ++i) tmp[i] = v[i];
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) v[i] = tmp[i] * cos[i] + tmp[i + half] * ssin[i];
#pragma omp simd
    for (int64_t i = half; i < d; ++i) v[i] = tmp[i] * cos[i] + tmp[i - half] * ssin[i];
  }
}

// x @ w^T (+ b) in w's dtype (x is cast to it when they differ).
at::Tensor dense(const at::Tensor& x_in, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  const at::Tensor x = x_in.scalar_type() == w.scalar_type() ? x_in : x_in.to(w.scalar_type());
  return b.has_value() && b->defined() ? at::addmm(*b, x, w.t()) : at::mm(x, w.t());
}

// A float32 view of a product's output (no copy when it already is float32).
at::Tensor as_float(const at::Tensor& t) { return t.scalar_type() == at::kFloat ? t : t.to(at::kFloat); }

}  // namespace

template <typename C>  // k/v cache element: float or c10::BFloat16
at::Tensor decode_step_impl(const at::Tensor& tokens, const at::Tensor& embed,
                           const c10::List<std::optional<at::Tensor>>& weights, at::ArrayRef<double> eps,
                           at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& cos_table,
                           const at::Tensor& sin_table, const at::Tensor& positions,
                           const std::optional<at::Tensor>& key_bias, int64_t col, int64_t n_heads, int64_t n_kv,
                           int64_t head_dim, double scaling, const at::Tensor& final_norm, double final_eps,
                           const at::Tensor& head_w, const std::optional<at::Tensor>& head_b) {
  const int64_t b = tokens.size(0), hidden = embed.size(1), d = head_dim;
  const int64_t group = n_heads / n_kv, end = col + 1;
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kPerLayer, "cpu_decode_step: weights per layer");
  TORCH_CHECK(d <= kMaxHeadDim, "cpu_decode_step: head_dim > ", kMaxHeadDim);
  at::Tensor h = at::index_select(embed, 0, tokens);  // [b, H] residual stream (a fresh tensor)
  at::Tensor x = at::empty_like(h);
  at::Tensor attn = at::empty({b, n_heads * d}, h.options());
  at::Tensor scores = at::empty({b * n_heads, end}, h.options());
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cos_p = cos_table.data_ptr<float>();
  const float* sin_p = sin_table.data_ptr<float>();
  const bool has_bias = key_bias.has_value() && key_bias->defined();
  const at::Tensor bias_f = has_bias ? as_float(*key_bias) : at::Tensor();
  const float* bias_p = has_bias ? bias_f.data_ptr<float>() : nullptr;
  const int64_t bias_stride = has_bias ? bias_f.stride(0) : 0;
  const float scale = static_cast<float>(scaling);

  for (int64_t l = 0; l < layers; ++l) {
    auto w = [&](int64_t i) -> std::optional<at::Tensor> { return weights.get(l * kPerLayer + i); };
    const float in_eps = static_cast<float>(eps[2 * l]), post_eps = static_cast<float>(eps[2 * l + 1]);
    float* hp = h.data_ptr<float>();
    rms_norm(hp, w(0)->template data_ptr<float>(), in_eps, x.data_ptr<float>(), b, hidden);
    at::Tensor q = as_float(dense(x, *w(1), w(2)));  // [b, Hq D]
    at::Tensor k = as_float(dense(x, *w(3), w(4)));  // [b, Hkv D]
    at::Tensor v = as_float(dense(x, *w(5), w(6)));  // [b, Hkv D]
    float* q_p = q.data_ptr<float>();
    float* k_p = k.data_ptr<float>();
    const float* v_p = v.data_ptr<float>();
    C* kc = k_caches[l].data_ptr<C>();
    C* vc = v_caches[l].data_ptr<C>();
    const int64_t cap = k_caches[l].size(2);
    float* sp = scores.data_ptr<float>();
    // Rows are independent: RoPE, the cache write and the scores of a row; split over torch's intra-op threads.
    at::parallel_for(0, b, kRowGrain, [&](int64_t row_begin, int64_t row_end) {
      for (int64_t r = row_begin; r < row_end; ++r) {
        float* qr = q_p + r * n_heads * d;
        float* kr = k_p + r * n_kv * d;
        const float* c = cos_p + pos[r] * d;
        const float* s = sin_p + pos[r] * d;
        rope(qr, c, s, n_heads, d);
        rope(kr, c, s, n_kv, d);
        for (int64_t hk = 0; hk < n_kv; ++hk) {
          C* kdst = kc + ((r * n_kv + hk) * cap + col) * d;
          C* vdst = vc + ((r * n_kv + hk) * cap + col) * d;
          const float* ksrc = kr + hk * d;
          const float* vsrc = v_p + (r * n_kv + hk) * d;
          for (int64_t i = 0; i < d; ++i) {
            kdst[i] = static_cast<C>(ksrc[i]);
            vdst[i] = static_cast<C>(vsrc[i]);
          }
        }
        // Scores of every query head of this row against its KV head's cached keys.
        for (int64_t hq = 0; hq < n_heads; ++hq) {
          const float* q = qr + hq * d;
          const C* keys = kc + (r * n_kv + hq / group) * cap * d;
          float* out = sp + (r * n_heads + hq) * end;
          for (int64_t t = 0; t < end; ++t) {
            const C* k = keys + t * d;
            float acc = 0.f;
#pragma omp simd reduction(+ : acc)
            for (int64_t i = 0; i < d; ++i) acc += q[i] * static_cast<float>(k[i]);
            out[t] = acc * scale + (has_bias ? bias_p[r * bias_stride + t] : 0.f);
          }
        }
      }
    });
    at::Tensor probs = at::_softmax(scores, -1, false);  // [b * Hq, end]
    const float* pp = probs.data_ptr<float>();
    float* ap = attn.data_ptr<float>();
    at::parallel_for(0, b, kRowGrain, [&](int64_t row_begin, int64_t row_end) {
      for (int64_t r = row_begin; r < row_end; ++r) {
        for (int64_t hq = 0; hq < n_heads; ++hq) {
          const float* p = pp + (r * n_heads + hq) * end;
          const C* vals = vc + (r * n_kv + hq / group) * cap * d;
          float* out = ap + (r * n_heads + hq) * d;
          for (int64_t i = 0; i < d; ++i) out[i] = 0.f;
          for (int64_t t = 0; t < end; ++t) {
            const float pt = p[t];
            const C* v = vals + t * d;
#pragma omp simd
            for (int64_t i = 0; i < d; ++i) out[i] += pt * static_cast<float>(v[i]);
          }
        }
      }
    });
    at::Tensor o = as_float(dense(attn, *w(7), w(8)));  // [b, H]
    const float* op = o.data_ptr<float>();
    for (int64_t i = 0; i < b * hidden; ++i) hp[i] += op[i];
    rms_norm(hp, w(9)->template data_ptr<float>(), post_eps, x.data_ptr<float>(), b, hidden);
    at::Tensor act = dense(x, *w(10), w(11));  // [b, I] gate, then silu(gate) * up in place
    at::silu_(act).mul_(dense(x, *w(12), w(13)));
    at::Tensor down = as_float(dense(act, *w(14), w(15)));  // [b, H]
    const float* dp = down.data_ptr<float>();
    for (int64_t i = 0; i < b * hidden; ++i) hp[i] += dp[i];
  }
  rms_norm(h.data_ptr<float>(), final_norm.data_ptr<float>(), static_cast<float>(final_eps), x.data_ptr<float>(), b,
           hidden);
  return dense(x, head_w, head_b);
}

at::Tensor cpu_decode_step(const at::Tensor& tokens, const at::Tensor& embed,
                           const c10::List<std::optional<at::Tensor>>& weights, at::ArrayRef<double> eps,
                           at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& cos_table,
                           const at::Tensor& sin_table, const at::Tensor& positions,
                           const std::optional<at::Tensor>& key_bias, int64_t col, int64_t n_heads, int64_t n_kv,
                           int64_t head_dim, double scaling, const at::Tensor& final_norm, double final_eps,
                           const at::Tensor& head_w, const std::optional<at::Tensor>& head_b) {
  TORCH_CHECK(!k_caches.empty(), "cpu_decode_step: no layers");
  const at::ScalarType cache = k_caches[0].scalar_type();
  TORCH_CHECK(cache == at::kFloat || cache == at::kBFloat16, "cpu_decode_step: float32 or bfloat16 caches only");
  if (cache == at::kBFloat16) {
    return decode_step_impl<c10::BFloat16>(tokens, embed, weights, eps, k_caches, v_caches, cos_table, sin_table,
                                           positions, key_bias, col, n_heads, n_kv, head_dim, scaling, final_norm,
                                           final_eps, head_w, head_b);
  }
  return decode_step_impl<float>(tokens, embed, weights, eps, k_caches, v_caches, cos_table, sin_table, positions,
                                 key_bias, col, n_heads, n_kv, head_dim, scaling, final_norm, final_eps, head_w,
                                 head_b);
}

// One draw per row from probs [b, V] (float32, rows sum to ~1) by inverse CDF with the given uniforms u [b]:
// the same arithmetic as sampling.sample_inverse_cdf (torch's CPU cumsum accumulates float in double and stores
// float; target = min(u * total, nextafter(total, 0)); first index whose cdf exceeds the target), so the same tokens.
// Returns (tokens int64 [b], log of each token's probability float32 [b]).
std::tuple<at::Tensor, at::Tensor> sample_inverse_cdf(const at::Tensor& probs_in, const at::Tensor& u) {
  const at::Tensor probs = probs_in.contiguous();
  const int64_t b = probs.size(0), vocab = probs.size(1);
  at::Tensor tokens = at::empty({b}, probs.options().dtype(at::kLong));
  at::Tensor logprobs = at::empty({b}, probs.options());
  const float* pp = probs.data_ptr<float>();
  const float* up = u.data_ptr<float>();
  const int64_t u_stride = u.stride(0);
  int64_t* tp = tokens.data_ptr<int64_t>();
  float* lp = logprobs.data_ptr<float>();
  for (int64_t r = 0; r < b; ++r) {
    const float* p = pp + r * vocab;
    double acc = 0.0;
    for (int64_t i = 0; i < vocab; ++i) acc += p[i];
    const float total = static_cast<float>(acc);
    const float target = std::min(up[r * u_stride] * total, std::nextafter(total, 0.f));
    int64_t pick = vocab - 1;
    acc = 0.0;
    for (int64_t i = 0; i < vocab; ++i) {
      acc += p[i];
      if (static_cast<float>(acc) > target) {
        pick = i;
        break;
      }
    }
    tp[r] = pick;
    lp[r] = std::log(p[pick]);
  }
  return {tokens, logprobs};
}

// ---------------------------------------------------------------------------------------------------------------
// RMSNorm and RoPE of the full-sequence passes (fast.forward), forward and backward, on packed rows.

// y = w * x * inv, inv[r] = 1 / sqrt(mean(x[r]^2) + eps); x [rows, n]. Returns (y, inv [rows]) (inv for backward).
std::tuple<at::Tensor, at::Tensor> rms_norm_fwd(const at::Tensor& x_in, const at::Tensor& w, double eps) {
  const at::Tensor x = x_in.contiguous();
  const int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
  at::Tensor y = at::empty_like(x);
  at::Tensor inv = at::empty({rows}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  float* ip = inv.data_ptr<float>();
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    rms_norm(xp + begin * n, w.data_ptr<float>(), static_cast<float>(eps), yp + begin * n, end - begin, n, ip + begin);
  });
  return {y, inv};
}

// Gradients of rms_norm_fwd: with a = w * g, dx = inv * a - x * inv^3 * mean(a * x); dw = sum over rows of g * x * inv.
std::tuple<at::Tensor, at::Tensor> rms_norm_bwd(const at::Tensor& g_in, const at::Tensor& x_in, const at::Tensor& w,
                                                const at::Tensor& inv) {
  const at::Tensor g = g_in.contiguous(), x = x_in.contiguous();
  const int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
  at::Tensor dx = at::empty_like(x);
  at::Tensor dw = at::empty({n}, w.options());
  std::vector<double> dw_acc(n, 0.0);  // summed over rows in double: float32 running sums drift over ~1e3 rows
  const float* gp = g.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* ip = inv.data_ptr<float>();
  float* dxp = dx.data_ptr<float>();
  float* dwp = dw.data_ptr<float>();
  double* dwa = dw_acc.data();
  for (int64_t r = 0; r < rows; ++r) {
    const float* gr = gp + r * n;
    const float* xr = xp + r * n;
    const float s = ip[r];
    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
    for (int64_t i = 0; i < n; ++i) dot += wp[i] * gr[i] * xr[i];
    const float c = s * s * s * dot / static_cast<float>(n);
    float* dxr = dxp + r * n;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      dxr[i] = s * wp[i] * gr[i] - c * xr[i];
      dwa[i] += static_cast<double>(gr[i] * xr[i] * s);
    }
  }
  for (int64_t i = 0; i < n; ++i) dwp[i] = static_cast<float>(dwa[i]);
  return {dx, dw};
}

// RoPE on x [rows, heads, d] with per-row tables cos / signed_sin [rows, d]: y = x * cos + roll(x, d/2) * signed_sin
// (fast.kernels.rope). With `transpose`, the adjoint: y[j] = x[j] * cos[j] + x[j'] * signed_sin[j'], j' = (j+d/2) % d,
// which is the gradient of the forward map.
at::Tensor rope_rows(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& ssin, bool transpose) {
  at::Tensor y = x_in.contiguous().clone();
  const int64_t d = y.size(-1), heads = y.size(-2), rows = y.numel() / std::max<int64_t>(heads * d, 1);
  TORCH_CHECK(d <= kMaxHeadDim && d % 2 == 0, "rope: head_dim must be even and <= ", kMaxHeadDim);
  const int64_t half = d / 2;
  float* yp = y.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = ssin.data_ptr<float>();
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    float tmp[kMaxHeadDim];
    for (int64_t r = begin; r < end; ++r) {
      const float* c = cp + r * d;
      const float* s = sp + r * d;
      float* v = yp + r * heads * d;
      if (!transpose) {
        rope(v, c, s, heads, d);
        continue;
      }
      for (int64_t h = 0; h < heads; ++h, v += d) {
        for (int64_t i = 0; i < d; ++i) tmp[i] = v[i];
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) v[i] = tmp[i] * c[i] + tmp[i + half] * s[i + half];
#pragma omp simd
        for (int64_t i = half; i < d; ++i) v[i] = tmp[i] * c[i] + tmp[i - half] * s[i - half];
      }
    }
  });
  return y;
}

TORCH_LIBRARY(relayrl_cpu, m) {
  m.def(
      "decode_step(Tensor tokens, Tensor embed, Tensor?[] weights, float[] eps, Tensor[] k_caches, Tensor[] v_caches, "
      "Tensor cos_table, Tensor sin_table, Tensor positions, Tensor? key_bias, int col, int n_heads, int n_kv, "
      "int head_dim, float scaling, Tensor final_norm, float final_eps, Tensor head_w, Tensor? head_b) -> Tensor",
      &cpu_decode_step);
  m.def("sample_inverse_cdf(Tensor probs, Tensor u) -> (Tensor, Tensor)", &sample_inverse_cdf);
  m.def("rms_norm_fwd(Tensor x, Tensor w, float eps) -> (Tensor, Tensor)", &rms_norm_fwd);
  m.def("rms_norm_bwd(Tensor g, Tensor x, Tensor w, Tensor inv) -> (Tensor, Tensor)", &rms_norm_bwd);
  m.def("rope(Tensor x, Tensor cos, Tensor ssin, bool transpose) -> Tensor", &rope_rows);
}
