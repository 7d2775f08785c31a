// Fused CPU kernel for softplus-l1 attention (LSSA, LSSAR with any p, softplus-l1).
//
// The host (lssar/ops/chunked.py) normalises q and k in float32 (unit_forward below, through
// lssar/ops/cpu/unit.py) and passes float32 [B, H, T, D] tensors, read in place (rows of unit
// stride, any batch and head strides: View); the outputs are contiguous [B, H, T, D]. With bf16
// inputs it may also pass the bf16 q and k: the products Q K^T are then taken from them on
// AVX512-BF16 dot products (qk_tile_bf16, cosines_bf16), everything else as before.
// Forward: per block of query rows, scores by register-blocked micro-kernels, weights in
// vectorised passes over each row while it is in cache (softplus, Z_i and max_j a_ij; then
// r_ij^p), and a second GEMM with V; LSSA is also tiled over keys, LSSAR keeps a block's softplus
// values between its two passes. Backward: per batch x head (which owns its dk/dv), the weights
// again with sigmoid and r^(p-1) kept, then dP, dx, the F_i row term and dS (docs/method.md sections 4
// and 5, the same arithmetic as chunked's eager path). OpenMP through at::parallel_for.
//
// Rows where every visible softplus underflows float32 (all scores below about -104) are not
// handled here: the kernel reports them and the host recomputes the call on its eager path.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;

struct Problem {
  int64_t BH, H, t_q, t_k, d, dv, offset, rows;
  bool causal, log_n, reweight;
  float scale, p;
  const bool* mask = nullptr;  // [B, H, T_q, T_k] with (possibly zero) strides
  int64_t ms_b = 0, ms_h = 0, ms_q = 0, ms_k = 0;
  float min_keys;  // re-weighting centres rows with N_i > min_keys (common.REWEIGHT_MIN_KEYS)
  float tol;       // uniform-row tolerance (common.uniform_tolerance(float32))

  float row_scale(float n) const { return log_n ? scale * std::log(std::max(n, 1.f)) : scale; }

  // keys 0..row_end(i) - 1 can be visible to row i
  int64_t row_end(int64_t i) const {
    if (!causal) return t_k;
    return std::clamp<int64_t>(offset + i + 1, 0, t_k);
  }
  const bool* mask_row(int64_t bh, int64_t i) const {
    return mask + (bh / H) * ms_b + (bh % H) * ms_h + i * ms_q;
  }
  float count(int64_t bh, int64_t i) const {
    int64_t e = row_end(i);
    if (!mask) return static_cast<float>(e);
    const bool* m = mask_row(bh, i);
    int64_t n = 0;
    for (int64_t j = 0; j < e; ++j) n += m[j * ms_k];
    return static_cast<float>(n);
  }
};

// Softplus without a division or a general-purpose exp: softplus(s) = max(s, 0) + log1p(u) with
// u = exp(-|s|) from one bounded exp (the argument is never positive) and log1p(u) = u P(u), the
// Triton kernel's polynomial. The scores are s = c_i (q.k), rounded once as the reference
// rounds them: computing in base 2 (s log2(e), so that ln 2 cancels in the l1 normalisation)
// rounds every score a second, independent time, and with p = 15 that made LSSAR's gradients
// miss the accuracy rule on a grid point (1.6x the previous kernel's error); here the exp's
// range reduction takes log2(e) as two floats instead, one FMA more.

// exp(x) for x <= 0, flushed to 0 below about 2^-125.5 (the float32 exp of the previous kernel
// flushed below 2^-126): x log2(e) = n + f with n = round(x log2(e)) and f from two FMAs (log2(e)
// as hi + lo, so f carries x's full precision), 2^f by a degree-6 fit (relative error 1e-7),
// times 2^n. NaN stays NaN; -inf gives 0.
inline Vec exp_neg(Vec x) {
  const Vec t = x * Vec(1.4426950408889634f), lo(-125.5f);
#if defined(CPU_CAPABILITY_AVX512)
  const Vec n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  const Vec n = t.round();
#endif
  Vec f = at::vec::fmadd(x, Vec(1.4426950216293335f), Vec(0.f) - n);
  f = at::vec::fmadd(x, Vec(1.925963033500011e-8f), f);
  Vec p(1.5345706196967512e-4f);
  for (float c : {1.3399930903688073e-3f, 9.618489071726799e-3f, 5.550328642129898e-2f,
                  0.24022646248340607f, 0.6931471824645996f, 1.f})
    p = at::vec::fmadd(p, f, Vec(c));
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(t, lo, _CMP_GE_OQ), p, n);
#elif defined(CPU_CAPABILITY_AVX2)
  // n >= -125 where kept: the exponent field of p 2^n stays normal
  const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
  const __m256 y = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
  return _mm256_and_ps(y, _mm256_cmp_ps(t, lo, _CMP_GE_OQ));
#else
  return Vec::blendv(Vec(0.f), p * n.exp2(), t >= lo);
#endif
}

// -|x|: the sign bit set
inline Vec neg_abs(Vec x) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_castsi512_ps(
      _mm512_or_si512(_mm512_castps_si512(x), _mm512_set1_epi32(static_cast<int>(0x80000000u))));
#elif defined(CPU_CAPABILITY_AVX2)
  return _mm256_or_ps(x, _mm256_set1_ps(-0.f));
#else
  return Vec(0.f) - x.abs();
#endif
}

// softplus(s), and u = exp(-|s|) for the sigmoid. log1p(u) = u + u (u P(u)), P a degree-9 fit of
// (log1p(u) / u - 1) / u on [0, 1] (relative minimax error of log1p 1e-9): u enters exactly and
// only the correction rounds, 0.30 ulp rms and no bias (measured against float64 over
// s in [-6, 0]; torch's softplus: 0.42). Triton's degree-8 fit of log1p(u) / u, evaluated as
// u P(u), had a bias of +0.5 ulp, which p = 15 amplified into gradient errors beyond the rule on
// a grid point.
inline Vec softplus_u(Vec s, Vec& u) {
  u = exp_neg(neg_abs(s));
  Vec q(2.0092299673706293e-3f);
  for (float c : {-1.3290571980178356e-2f, 4.1201069951057434e-2f, -8.207687735557556e-2f,
                  0.1238923966884613f, -0.16091100871562958f, 0.1988624483346939f,
                  -0.24986454844474792f, 0.3333248198032379f, -0.4999997913837433f})
    q = at::vec::fmadd(q, u, Vec(c));
  return at::vec::maximum(s, Vec(0.f)) + at::vec::fmadd(u, u * q, u);
}

inline Vec softplus(Vec s) {
  Vec u;
  return softplus_u(s, u);
}

// 1 / x for x in [1, 2]: AVX-512's 14-bit estimate and one Newton step (error 2^-28)
inline Vec recip_1_2(Vec x) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 y = _mm512_rcp14_ps(x);
  return _mm512_mul_ps(y, _mm512_fnmadd_ps(x, y, _mm512_set1_ps(2.f)));
#else
  return Vec(1.f) / x;
#endif
}

// sigmoid(s) from u = exp(-|s|): 1 / (1 + u) for s >= 0, u / (1 + u) below
inline Vec sigmoid_u(Vec s, Vec u) {
  const Vec inv = recip_1_2(Vec(1.f) + u);
  return Vec::blendv(u * inv, inv, s >= Vec(0.f));
}

// A row loop: body(j, cnt, full) over [0, e) in full vectors (full = std::true_type: no lane
// count, no mask) and one tail (std::false_type, cnt < L lanes; loads fill the others with 0).
template <typename Body>
inline void row_loop(int64_t e, Body&& body) {
  constexpr int64_t L = Vec::size();
  int64_t j = 0;
  for (; j + L <= e; j += L) body(j, L, std::true_type{});
  if (j < e) body(j, e - j, std::false_type{});
}

template <bool Full>
inline Vec load(const float* p, int64_t cnt) {
  if constexpr (Full) return Vec::loadu(p);
  else return Vec::loadu(p, cnt);
}
template <bool Full>
inline void store(Vec x, float* p, int64_t cnt) {
  if constexpr (Full) x.store(p);
  else x.store(p, cnt);
}

// r^n by repeated squaring (the multiplications of chunked._ipow), lane-wise
inline Vec vipow(Vec r, int n) {
  Vec result(1.f), base = r;
  bool first = true;
  while (n) {
    if (n & 1) {
      result = first ? base : result * base;
      first = false;
    }
    n >>= 1;
    if (n) base = base * base;
  }
  return result;
}

inline bool small_int(float p) {
  int n = static_cast<int>(p);
  return static_cast<float>(n) == p && n >= 1 && n <= 64;
}

// Calls fn(pw) with pw(r) = r^p for r in [0, 1]: unrolled for the common integer powers (p = 15,
// the paper's; 3; and p - 1 = 14, 2 for the backward's r^(p-1)), a loop for other small
// integers, pow otherwise.
template <typename Fn>
inline void with_pow(float p, Fn&& fn) {
  // a constant n: the loop of vipow unrolls into the same products, in the same order
  if (p == 15.f) return fn([](Vec r) { return vipow(r, 15); });
  if (p == 14.f) return fn([](Vec r) { return vipow(r, 14); });
  if (p == 3.f) return fn([](Vec r) { return vipow(r, 3); });
  if (p == 2.f) return fn([](Vec r) { return r * r; });
  if (p == 1.f) return fn([](Vec r) { return r; });
  if (small_int(p)) {
    const int n = static_cast<int>(p);
    return fn([n](Vec r) { return vipow(r, n); });
  }
  const Vec pv(p);
  fn([pv](Vec r) { return r.pow(pv); });
}

// r^(p-1) for the backward: 0 where r = 0 (dx = 0 there; the power is 1 or unbounded at 0 for
// p <= 1)
template <typename Fn>
inline void with_pow_m1(float p, Fn&& fn) {
  if (p > 1.f) return with_pow(p - 1.f, fn);
  const Vec pv(p - 1.f);
  fn([pv](Vec r) { return Vec::blendv(Vec(0.f), r.pow(pv), r > Vec(0.f)); });
}

inline float hsum(Vec x) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, x);
}
inline float hmax(Vec x) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, x);
}

// The visibility of row i's keys k0 .. k0 + n - 1 as floats (1 visible, 0 not) into `mf`
// (nullptr without a mask: every key visible), and how many are visible.
inline const float* visible_keys(const Problem& P, int64_t bh, int64_t i, int64_t k0, int64_t n,
                                 float* mf, float* count = nullptr) {
  if (!P.mask) {
    if (count) *count = static_cast<float>(n);
    return nullptr;
  }
  const bool* m = P.mask_row(bh, i) + k0 * P.ms_k;
  int64_t cnt = 0;
  for (int64_t j = 0; j < n; ++j) {
    const bool b = m[j * P.ms_k];
    mf[j] = b ? 1.f : 0.f;
    cnt += b;
  }
  if (count) *count = static_cast<float>(cnt);
  return mf;
}

// x where the key is visible (mf > 0), 0 elsewhere; without a mask, 0 on the tail's empty lanes
template <bool Masked, bool Full>
inline Vec visible(Vec x, const float* mf, int64_t j, int64_t cnt) {
  const Vec zero(0.f);
  if constexpr (Masked) return Vec::blendv(zero, x, load<Full>(mf + j, cnt) > zero);
  else if constexpr (Full) return x;
  else return Vec::set(zero, x, cnt);
}

// LSSAR's weights over a row of softplus values in place: ((a - mu) max 0 / x_max)^p, 0 wherever
// a = 0 (masked keys, keys after the row's last) since mu >= 0; returns their sum.
template <typename Pow>
inline float sharpen_row(float* row, int64_t len, float mu, float inv, Pow pw) {
  const Vec muv(mu), iv(inv), zero(0.f);
  Vec ws(0.f);
  row_loop(len, [&](int64_t j, int64_t cnt, auto full) {
    constexpr bool F = decltype(full)::value;
    const Vec w = pw(at::vec::maximum(load<F>(row + j, cnt) - muv, zero) * iv);
    store<F>(w, row + j, cnt);
    ws = ws + w;  // tail lanes: loaded as 0, so r = 0 and w = 0
  });
  return hsum(ws);
}

// The re-weighting's row statistics from N_i, Z_i and max_j a_ij (docs/method.md section 4): the
// centring mean mu_i, the largest x_ij = max_j relu(a_ij - mu_i), and whether the row has any
// signal (else every weight is equal up to rounding and the row keeps the LSSA weights).
struct Reweight {
  float mu, x_max;
  bool big, has;
};

inline Reweight reweight_stats(const Problem& P, float n, float z, float a_max) {
  Reweight rw{};
  rw.big = n > P.min_keys;
  rw.mu = rw.big ? (z > 0.f ? z : 1.f) / std::max(n, 1.f) : 0.f;
  rw.x_max = std::max(a_max - rw.mu, 0.f);
  rw.has = n > 0.f && rw.x_max > P.tol * rw.mu;
  return rw;
}

// What the backward keeps of a row's weights
struct RowStats {
  float n, c, z, mu, x_max, den;
  bool big, has, underflow;
  int64_t top;  // a key of the largest re-weighted weight
};

// The backward's weights of one row over its keys [0, e) (of a block row of e_blk): `g` holds the
// cosines and receives sigmoid(s_ij); `a` receives the unnormalised weights (0 on [e, e_blk)) and
// `rpm1` (re-weighting) r_ij^(p-1), so no transcendental function is evaluated twice.
template <bool Masked>
RowStats row_weights(const Problem& P, float n, const float* mf, float* g, float* a, int64_t e,
                     int64_t e_blk, float* rpm1) {
  RowStats st{};
  st.n = n;
  st.c = P.row_scale(n);
  const Vec cv(st.c);
  Vec zs(0.f), mx(0.f);
  row_loop(e, [&](int64_t j, int64_t cnt, auto full) {
    constexpr bool F = decltype(full)::value;
    const Vec s = load<F>(g + j, cnt) * cv;
    Vec u;
    const Vec av = visible<Masked, F>(softplus_u(s, u), mf, j, cnt);
    store<F>(sigmoid_u(s, u), g + j, cnt);
    store<F>(av, a + j, cnt);
    zs = zs + av;
    mx = at::vec::maximum(mx, av);
  });
  std::fill(a + e, a + e_blk, 0.f);  // causal tail of the block: never visible
  const float z = hsum(zs), a_max = hmax(mx);
  st.underflow = (z == 0.f) && (n > 0.f);
  st.z = z > 0.f ? z : 1.f;
  st.den = st.z;
  if (!P.reweight) return st;
  const Reweight rw = reweight_stats(P, n, z, a_max);
  st.big = rw.big;
  st.has = rw.has;
  if (!st.has) return st;  // no visible key, or a uniform row: LSSA weights a / Z
  st.mu = rw.mu;
  st.x_max = rw.x_max;
  st.top = std::find(a, a + e, a_max) - a;  // r = 1 there: the largest weight
  const Vec inv(1.f / st.x_max), mu(st.mu), zero(0.f);
  Vec ws(0.f);
  with_pow_m1(P.p, [&](auto pw) {
    row_loop(e, [&](int64_t j, int64_t cnt, auto full) {
      constexpr bool F = decltype(full)::value;
      const Vec r = at::vec::maximum(load<F>(a + j, cnt) - mu, zero) * inv;
      const Vec rp = pw(r);  // r^(p-1) kept for dx; r^p from it with one multiply (as chunked)
      store<F>(rp, rpm1 + j, cnt);
      const Vec w = rp * r;  // 0 on the tail's empty lanes (r = 0)
      store<F>(w, a + j, cnt);
      ws = ws + w;
    });
  });
  st.den = hsum(ws);
  return st;
}

// BH rows of heads (H per batch entry), each T_q queries over T_k keys (dims d, dv)
Problem make_problem(int64_t BH, int64_t H, int64_t t_q, int64_t t_k, int64_t d, int64_t dv,
                     const c10::optional<at::Tensor>& mask, bool causal, double scale,
                     bool log_n, double p, double min_keys, double tol, int64_t rows) {
  Problem P{};
  P.BH = BH;
  P.H = H;
  P.t_q = t_q;
  P.t_k = t_k;
  P.d = d;
  P.dv = dv;
  P.offset = P.t_k - P.t_q;
  P.rows = std::max<int64_t>(1, rows);
  P.causal = causal;
  P.log_n = log_n;
  P.reweight = p > 0;
  P.scale = static_cast<float>(scale);
  P.p = static_cast<float>(p);
  P.min_keys = static_cast<float>(min_keys);
  P.tol = static_cast<float>(tol);
  if (mask.has_value()) {
    const auto& m = *mask;  // [B, H, T_q, T_k] bool, expanded (strides may be 0)
    TORCH_CHECK(m.dim() == 4 && m.scalar_type() == at::kBool, "mask must be 4-D bool");
    P.mask = m.data_ptr<bool>();
    P.ms_b = m.stride(0);
    P.ms_h = m.stride(1);
    P.ms_q = m.stride(2);
    P.ms_k = m.stride(3);
  }
  return P;
}

// An input [B, H, T, D] read in place: any batch and head strides (0 included: GQA's expanded
// heads), rows of unit stride that lie apart (a view of a model's [B, T, 3 C] projection, a
// transposed gradient), so the host copies nothing
struct View {
  const float* p;
  int64_t sb, sh, ld, H;
  const float* row(int64_t bh, int64_t i) const { return p + (bh / H) * sb + (bh % H) * sh + i * ld; }
};

View check(const at::Tensor& t, const char* name, int64_t B, int64_t H) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 4 &&
                  t.size(0) == B && t.size(1) == H,
              name, " must be a float32 CPU tensor [B, H, T, D] of the query's B and H");
  const int64_t D = t.size(3), ld = t.size(2) > 1 ? t.stride(2) : D;
  TORCH_CHECK((t.stride(3) == 1 || D <= 1) && ld >= D && ld <= std::numeric_limits<int>::max(),
              name, " needs a unit last stride and a row stride in [D, 2^31)");
  return View{t.data_ptr<float>(), t.stride(0), t.stride(1), std::max<int64_t>(ld, 1), H};
}

}  // namespace

extern "C" void sgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b,
                       const int* ldb, const float* beta, float* c, const int* ldc);

// Row-major C[m x n] (ldc) = beta C + op(A) op(B): A is [m x k] (a_t: stored [k x m]), B is
// [n x k] (b_t: C = A B^T) or [k x n]. BLAS directly (MKL, in libtorch_cpu): the tiled forward
// makes thousands of small GEMMs, and at::mm's dispatch would cost as much as the arithmetic.
inline void gemm(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
                 int64_t ldb, bool b_t, float beta, float* c, int64_t ldc, bool a_t = false) {
  const int M = m, N = n, K = k, LA = lda, LB = ldb, LC = ldc;
  const float one = 1.f;
  // column-major view: C^T (n x m) = op(B)^T op(A)^T
  sgemm_(b_t ? "T" : "N", a_t ? "T" : "N", &N, &M, &K, &one, b, &LB, a, &LA, &beta, c, &LC);
}

// ------------------------------------------------------------------ the forward's products
// Register-blocked, without BLAS: each call of a small GEMM packs its operands again (MKL on a
// forward at T = 4K: 12% of SDPA's time and 23% of LSSAR's at 64 rows per block, the weights
// packed for the product with V costing as much as an element-wise pass). Here K is packed once
// per head, transposed into slabs of NB keys (D x NB floats each); a micro-tile of RB query rows
// x NB keys accumulates in registers and its epilogue applies the row scale, the softplus, the
// causal end and the mask before the scores reach memory (one element-wise pass fewer). The
// product with V reads the weights and V's rows as they are, RB rows x NV vectors at a time.
constexpr int64_t L = Vec::size();
constexpr int64_t NB = 2 * L;  // keys per micro-tile
#if defined(CPU_CAPABILITY_AVX512)
constexpr int RB = 6, NV = 4, REGS = 32;  // 12 score or 24 output accumulators
#elif defined(CPU_CAPABILITY_AVX2)
constexpr int RB = 6, NV = 2, REGS = 16;  // 12 accumulators either way
#else
constexpr int RB = 4, NV = 1, REGS = 16;
#endif
// Query rows a qk_tile of PAR partial sums keeps in registers (2 PAR accumulators a row, beside
// two key vectors and a broadcast): AVX-512 6 rows with two partials, 3 with four; AVX2 3 with
// two (6 rows' 24 accumulators spilled to memory: a quarter of the AVX2 forward's time at 4K)
template <int PAR>
constexpr int qk_fit() {
  return std::max(1, std::min(RB, (REGS - 3) / (2 * PAR)));
}

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// K [t_k, D] (row stride ldk) as slabs of NB keys, each D x NB (keys past t_k are 0)
void pack_keys(const float* k, int64_t ldk, int64_t t_k, int64_t D, float* out) {
  for (int64_t s = 0; s * NB < t_k; ++s) {
    float* slab = out + s * D * NB;
    const int64_t n = std::min(NB, t_k - s * NB);
    for (int64_t jj = 0; jj < NB; ++jj) {
      const float* kj = k + (s * NB + jj) * ldk;
      for (int64_t d = 0; d < D; ++d) slab[d * NB + jj] = jj < n ? kj[d] : 0.f;
    }
  }
}

// The micro-kernels' registers as the compiler's own vector type (arrays of at::vec's class
// were kept in memory beside the registers: every FMA stored its accumulator)
#if defined(CPU_CAPABILITY_AVX512)
using Reg = __m512;
inline Reg r_load(const float* p) { return _mm512_loadu_ps(p); }
inline Reg r_set1(float x) { return _mm512_set1_ps(x); }
inline Reg r_fma(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
inline Reg r_add(Reg a, Reg b) { return _mm512_add_ps(a, b); }
inline void r_store(float* p, Reg a) { _mm512_storeu_ps(p, a); }
#elif defined(CPU_CAPABILITY_AVX2)
using Reg = __m256;
inline Reg r_load(const float* p) { return _mm256_loadu_ps(p); }
inline Reg r_set1(float x) { return _mm256_set1_ps(x); }
inline Reg r_fma(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }
inline Reg r_add(Reg a, Reg b) { return _mm256_add_ps(a, b); }
inline void r_store(float* p, Reg a) { _mm256_storeu_ps(p, a); }
#else
using Reg = Vec;
inline Reg r_load(const float* p) { return Vec::loadu(p); }
inline Reg r_set1(float x) { return Vec(x); }
inline Reg r_fma(Reg a, Reg b, Reg c) { return at::vec::fmadd(a, b, c); }
inline Reg r_add(Reg a, Reg b) { return a + b; }
inline void r_store(float* p, Reg a) { a.store(p); }
#endif

// acc[r] = q_r . K_slab (RBn rows of q, row stride ldq; NB keys as two vectors), PAR partial sums
// over d (d mod PAR) added at the end. A single chain of D FMAs is 1.7x less accurate (rms, D =
// 64) than the BLAS the reference calls on short rows (which splits such sums, about as 4-8
// partials do) and p = 15 amplifies that into LSSAR's weights: the forward's errors were 1.3x
// the reference's in the median over seeds with two partials, 0.8x with four. Four take 3-row
// tiles (six would not fit the registers) and more loads per FMA, 1.15x the time of two at
// T = 4K, so rows of fewer than 256 keys get four, longer ones two (BLAS computes those in one
// chain: two are already more accurate). Not inlined into the epilogue's loop, whose softplus
// constants would take the registers the partial sums need.
template <int RBn, int PAR>
__attribute__((noinline)) void qk_tile(const float* q, int64_t ldq, const float* slab, int64_t D,
                                       Vec (*acc)[2]) {
  Reg a[PAR][RBn][2];
#pragma GCC unroll 8
  for (int x = 0; x < PAR; ++x)
#pragma GCC unroll 8
    for (int r = 0; r < RBn; ++r) a[x][r][0] = a[x][r][1] = r_set1(0.f);
  int64_t d = 0;
  for (; d + PAR <= D; d += PAR) {
#pragma GCC unroll 8
    for (int x = 0; x < PAR; ++x) {
      const float* kd = slab + (d + x) * NB;
      const Reg k0 = r_load(kd), k1 = r_load(kd + L);
#pragma GCC unroll 8
      for (int r = 0; r < RBn; ++r) {
        const Reg b = r_set1(q[r * ldq + d + x]);
        a[x][r][0] = r_fma(b, k0, a[x][r][0]);
        a[x][r][1] = r_fma(b, k1, a[x][r][1]);
      }
    }
  }
  for (; d < D; ++d) {
    const Reg k0 = r_load(slab + d * NB), k1 = r_load(slab + d * NB + L);
#pragma GCC unroll 8
    for (int r = 0; r < RBn; ++r) {
      const Reg b = r_set1(q[r * ldq + d]);
      a[0][r][0] = r_fma(b, k0, a[0][r][0]);
      a[0][r][1] = r_fma(b, k1, a[0][r][1]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < RBn; ++r)
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      Reg t = a[0][r][h];
#pragma GCC unroll 8
      for (int x = 1; x < PAR; ++x) t = r_add(t, a[x][r][h]);
      acc[r][h] = Vec(t);
    }
}

// o[r][0, cols) += sum_{j < n} w[r][j] v[j][0, cols) for RBn rows, NVn vectors of columns (the
// last one partial unless `full`), accumulated in registers
template <int RBn, int NVn, bool full>
inline void pv_tile(const float* w, int64_t ldw, const float* v, int64_t ldv, int64_t n, float* o,
                    int64_t ldo, int64_t cols) {
  const int64_t last = full ? L : cols - (NVn - 1) * L;  // lanes of the last vector
  auto get = [last](const float* p, int c) -> Reg {
    if (full || c < NVn - 1) return r_load(p);
    return Vec::loadu(p, last);
  };
  Reg acc[RBn][NVn];
#pragma GCC unroll 8
  for (int r = 0; r < RBn; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < NVn; ++c) acc[r][c] = get(o + r * ldo + c * L, c);
  for (int64_t j = 0; j < n; ++j) {
    Reg vj[NVn];
#pragma GCC unroll 8
    for (int c = 0; c < NVn; ++c) vj[c] = get(v + j * ldv + c * L, c);
#pragma GCC unroll 8
    for (int r = 0; r < RBn; ++r) {
      const Reg wr = r_set1(w[r * ldw + j]);
#pragma GCC unroll 8
      for (int c = 0; c < NVn; ++c) acc[r][c] = r_fma(wr, vj[c], acc[r][c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < RBn; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < NVn; ++c) {
      if (full || c < NVn - 1) r_store(o + r * ldo + c * L, acc[r][c]);
      else Vec(acc[r][c]).store(o + r * ldo + c * L, last);
    }
}

// o (rows x dv, ldo) += w (rows x n, ldw) v (n x dv, ldv), rows <= RB: tiles of NV vectors, then
// one of as many vectors as the columns left need (D = 32 in 16 lanes: two, not four with two
// of them empty, which cost the forward at B=32 H=4 D=32 T = 256 a third of its time)
template <int RBn>
inline void pv_rows(const float* w, int64_t ldw, const float* v, int64_t ldv, int64_t n, float* o,
                    int64_t ldo, int64_t dv) {
  int64_t c0 = 0;
  for (; c0 + NV * L <= dv; c0 += NV * L)
    pv_tile<RBn, NV, true>(w, ldw, v + c0, ldv, n, o + c0, ldo, NV * L);
  const int64_t rest = dv - c0;
  auto tile = [&](auto nv) {
    constexpr int m = decltype(nv)::value;
    if (rest == m * L) pv_tile<RBn, m, true>(w, ldw, v + c0, ldv, n, o + c0, ldo, rest);
    else pv_tile<RBn, m, false>(w, ldw, v + c0, ldv, n, o + c0, ldo, rest);
  };
  switch ((rest + L - 1) / L) {  // 0 .. NV - 1
    case 0: return;
    case 1: return tile(std::integral_constant<int, 1>{});
    case 2:
      if constexpr (NV > 2) tile(std::integral_constant<int, 2>{});
      return;
    default:
      if constexpr (NV > 3) tile(std::integral_constant<int, 3>{});
      return;
  }
}

// calls fn(std::integral_constant<int, rows>) for rows in 1 .. RB
template <typename Fn>
inline void with_rows(int64_t rows, Fn&& fn) {
  switch (rows) {
    case 1: return fn(std::integral_constant<int, 1>{});
    case 2: return fn(std::integral_constant<int, 2>{});
    case 3: return fn(std::integral_constant<int, 3>{});
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
    case 4: return fn(std::integral_constant<int, 4>{});
    case 5: return fn(std::integral_constant<int, 5>{});
    default: return fn(std::integral_constant<int, 6>{});
#else
    default: return fn(std::integral_constant<int, 4>{});
#endif
  }
}

// qk_tile over RBn rows in groups that fit the registers (qk_fit): each score's sums are the same
template <int RBn, int PAR>
inline void qk_rows(const float* q, int64_t ldq, const float* slab, int64_t D, Vec (*acc)[2]) {
  constexpr int QR = std::min(RBn, qk_fit<PAR>());
  qk_tile<QR, PAR>(q, ldq, slab, D, acc);
  if constexpr (RBn > QR) qk_rows<RBn - QR, PAR>(q + QR * ldq, ldq, slab, D, acc + QR);
}

// A micro-block of a query block: RBn rows over one key tile, and what its epilogue needs
struct Rows {
  const float* c;    // c_i per row
  const int64_t* e;  // keys 0 .. e - 1 (absolute) may be visible to the row
  const float* mf;   // visibility of the tile's keys as floats, row stride `ldm` (or nullptr)
  int64_t ldm;
};

// The softplus weights of RBn rows over the tile's keys [k0, k0 + jend) into `s` (row stride
// lds; keys from jend on are not written); adds each row's sum and largest value to zsum / amax.
// qk(slab, acc) computes the rows' products with one packed slab of NB keys (float32: qk_rows;
// bf16 inputs: qk_rows_bf16); KS: the products are scaled per key by ks[k] (the keys' inverse
// norms of the bf16 path) before the row scale.
template <int RBn, bool KS, typename QK>
void score_tile(QK&& qk, const float* ks, int64_t k0, int64_t jend, const Rows& rows, float* s,
                int64_t lds, float* zsum, float* amax) {
  Vec acc[RB][2], zs[RB], mx[RB];
  for (int r = 0; r < RBn; ++r) zs[r] = mx[r] = Vec(0.f);
  const Vec zero(0.f);
  for (int64_t jl = 0; jl < jend; jl += NB) {
    qk((k0 + jl) / NB, acc);
    for (int r = 0; r < RBn; ++r) {
      const int64_t lim = std::min(rows.e[r] - k0, jend) - jl;  // visible lanes (causal end)
      float* out = s + r * lds + jl;
      const Vec cv(rows.c[r]);
      for (int h = 0; h < 2; ++h) {
        Vec x = acc[r][h];
        if constexpr (KS) x = x * Vec::loadu(ks + k0 + jl + h * L);
        Vec a = softplus(x * cv);
        const int64_t cnt = lim - h * L;
        if (rows.mf) a = Vec::blendv(zero, a, Vec::loadu(rows.mf + r * rows.ldm + jl + h * L) > zero);
        if (cnt < L) a = cnt > 0 ? Vec::set(zero, a, cnt) : zero;  // select: inf / NaN not read
        a.store(out + h * L);
        zs[r] = zs[r] + a;
        mx[r] = at::vec::maximum(mx[r], a);
      }
    }
  }
  for (int r = 0; r < RBn; ++r) {
    zsum[r] += hsum(zs[r]);
    amax[r] = std::max(amax[r], hmax(mx[r]));
  }
}

// ------------------------------------------------ bf16 inputs: Q K^T on AVX512-BF16 dot products
// With bf16 q and k the products q_d k_d are exact in float32, so VDPBF16PS (two products added
// to a float32 accumulator per lane, 32 products an instruction against 16 for an FMA) computes
// the cosines' dot products from the raw inputs with float32 accumulation, and the norms are
// applied after: s_ij = c_i (q_i . k_j) / (||q_i|| ||k_j||). Each row is first scaled by the
// power of two that brings its largest magnitude into [1, 2) (exact in bf16), so no product
// overflows or falls below float32's normal range (the instruction flushes those to 0) unless it
// is below 2^-250 of the row's largest. Rows holding a NaN or an infinity are reported and the
// host reruns the call on the float32 path. Compiled into the AVX-512 build only, used where the
// CPU has the instruction (bf16_dot()); V and the weights stay float32 (see docs/history).
#if defined(CPU_CAPABILITY_AVX512)
#define LSSAR_BF16_DOT 1
#endif

bool bf16_dot() {
#if defined(LSSAR_BF16_DOT)
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

#if defined(LSSAR_BF16_DOT)
// A bf16 input [B, H, T, D] read in place, as View
struct View16 {
  const uint16_t* p = nullptr;
  int64_t sb = 0, sh = 0, ld = 1, H = 1;
  const uint16_t* row(int64_t bh, int64_t i) const {
    return p + (bh / H) * sb + (bh % H) * sh + i * ld;
  }
};

View16 check16(const at::Tensor& t, const char* name, int64_t B, int64_t H, int64_t T, int64_t D) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16 && t.dim() == 4 &&
                  t.size(0) == B && t.size(1) == H && t.size(2) == T && t.size(3) == D,
              name, " must be a bf16 CPU tensor shaped as its normalised float32 copy");
  const int64_t ld = T > 1 ? t.stride(2) : D;
  TORCH_CHECK((t.stride(3) == 1 || D <= 1) && ld >= D, name, " needs a unit last stride");
  return View16{reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()), t.stride(0),
                t.stride(1), std::max<int64_t>(ld, 1), H};
}

// cnt <= 16 bf16 values as float32 lanes (the others 0)
inline __m512 bf16_lanes(const uint16_t* p, int64_t cnt) {
  const __m256i h = cnt >= 16 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                              : _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << cnt) - 1), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Row x (n bf16 values) times 2^(1 - e), its largest magnitude (in [2^(e-1), 2^e)) brought into
// [1, 2), as bf16 into out[0, n) and a 0 after an odd n (so out holds (n + 1) / 2 pairs); returns
// 1 / ||scaled row|| (0 on a zero row), NaN where the row is not finite. The scaling is exact
// (bf16 keeps its 8 bits) except for values it takes below 2^-126, which the dot product would
// flush anyway; a row whose largest magnitude is beyond 2^(+-100) is scaled in double (2^(1 - e)
// may exceed float's range).
inline float scale_row_bf16(const uint16_t* x, int64_t n, uint16_t* out) {
  const __m512 inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  __m512 mx = _mm512_setzero_ps();
  __mmask16 bad = 0;
  for (int64_t j = 0; j < n; j += 16) {
    const __m512 f = _mm512_abs_ps(bf16_lanes(x + j, std::min<int64_t>(16, n - j)));
    bad |= _mm512_cmp_ps_mask(f, inf, _CMP_NLT_UQ);  // an infinity or a NaN
    mx = _mm512_max_ps(mx, f);
  }
  if (n % 2) out[n] = 0;
  if (bad) return std::numeric_limits<float>::quiet_NaN();
  const float big = _mm512_reduce_max_ps(mx);
  if (big == 0.f) {
    std::fill(out, out + n, 0);
    return 0.f;
  }
  int e;
  std::frexp(big, &e);
  if (e < -100 || e > 100) {
    double sum = 0.0;
    for (int64_t j = 0; j < n; ++j) {
      uint32_t u = static_cast<uint32_t>(x[j]) << 16;
      float f;
      std::memcpy(&f, &u, sizeof f);
      f = static_cast<float>(std::ldexp(static_cast<double>(f), 1 - e));
      sum += static_cast<double>(f) * f;
      std::memcpy(&u, &f, sizeof u);
      out[j] = static_cast<uint16_t>(u >> 16);
    }
    return static_cast<float>(1.0 / std::sqrt(sum));
  }
  const __m512 sc = _mm512_set1_ps(std::ldexp(1.f, 1 - e));
  __m512 ss = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const int64_t cnt = std::min<int64_t>(16, n - j);
    const __m512 y = _mm512_mul_ps(bf16_lanes(x + j, cnt), sc);
    ss = _mm512_fmadd_ps(y, y, ss);
    const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(y), 16));
    _mm256_mask_storeu_epi16(out + j, static_cast<__mmask16>((1u << cnt) - 1), h);
  }
  return 1.f / std::sqrt(_mm512_reduce_add_ps(ss));
}

// K [t_k, D] bf16 (row stride ldk) as slabs of NB keys, each D2 = ceil(D / 2) pairs x NB keys
// (uint32: a pair of bf16 of one key), and ks[k] = 1 / ||scaled key|| (0 past t_k); false if a
// key is not finite
bool pack_keys_bf16(const uint16_t* k, int64_t ldk, int64_t t_k, int64_t D, uint32_t* out,
                    float* ks) {
  const int64_t D2 = (D + 1) / 2;
  std::vector<uint32_t> row(D2);
  bool finite = true;
  for (int64_t s = 0; s * NB < t_k; ++s) {
    uint32_t* slab = out + s * D2 * NB;
    for (int64_t jj = 0; jj < NB; ++jj) {
      const int64_t j = s * NB + jj;
      float inv = 0.f;
      if (j < t_k) {
        inv = scale_row_bf16(k + j * ldk, D, reinterpret_cast<uint16_t*>(row.data()));
        finite = finite && !std::isnan(inv);
      } else {
        std::fill(row.begin(), row.end(), 0u);
      }
      ks[j] = inv;
      for (int64_t m = 0; m < D2; ++m) slab[m * NB + jj] = row[m];
    }
  }
  return finite;
}

// RBn query rows' products with one slab: tile_bf16 below over pairs [m, m + X), X <= PAR (a
// lambda would not inherit the caller's target, so the loop body is this function, inlined)
template <int RBn, int PAR, int X>
__attribute__((always_inline, target("avx512bf16"))) inline void dp_pairs(
    const uint32_t* q, int64_t ldq, const uint32_t* slab, int64_t m, __m512 (*a)[RBn][2]) {
#pragma GCC unroll 8
  for (int x = 0; x < X; ++x) {
    const uint32_t* km = slab + (m + x) * NB;
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(km);
    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(km + L);
#pragma GCC unroll 8
    for (int r = 0; r < RBn; ++r) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r * ldq + m + x]));
      a[x][r][0] = _mm512_dpbf16_ps(a[x][r][0], b, k0);
      a[x][r][1] = _mm512_dpbf16_ps(a[x][r][1], b, k1);
    }
  }
}

// qk_tile on bf16 pairs: acc[r] = q_r . K_slab over D2 pairs (q: RBn rows of D2 pairs, row
// stride ldq), PAR partial sums as qk_tile's (each instruction adds two products in turn, so a
// chain rounds as often as qk_tile's chain of FMAs over D)
template <int RBn, int PAR>
__attribute__((noinline, target("avx512bf16"))) void qk_tile_bf16(const uint32_t* q, int64_t ldq,
                                                                   const uint32_t* slab,
                                                                   int64_t D2, Vec (*acc)[2]) {
  __m512 a[PAR][RBn][2];
#pragma GCC unroll 8
  for (int x = 0; x < PAR; ++x)
#pragma GCC unroll 8
    for (int r = 0; r < RBn; ++r) a[x][r][0] = a[x][r][1] = _mm512_setzero_ps();
  int64_t m = 0;
  for (; m + PAR <= D2; m += PAR) dp_pairs<RBn, PAR, PAR>(q, ldq, slab, m, a);
  for (; m < D2; ++m) dp_pairs<RBn, PAR, 1>(q, ldq, slab, m, a);
#pragma GCC unroll 8
  for (int r = 0; r < RBn; ++r)
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      __m512 t = a[0][r][h];
#pragma GCC unroll 8
      for (int x = 1; x < PAR; ++x) t = _mm512_add_ps(t, a[x][r][h]);
      acc[r][h] = Vec(t);
    }
}

template <int RBn, int PAR>
inline void qk_rows_bf16(const uint32_t* q, int64_t ldq, const uint32_t* slab, int64_t D2,
                         Vec (*acc)[2]) {
  constexpr int QR = std::min(RBn, qk_fit<PAR>());
  qk_tile_bf16<QR, PAR>(q, ldq, slab, D2, acc);
  if constexpr (RBn > QR) qk_rows_bf16<RBn - QR, PAR>(q + QR * ldq, ldq, slab, D2, acc + QR);
}

// The backward's cosines of bf16 inputs: out[r][j] = (q_r . k_j) qs[r] ks[j] for R rows (q: their
// pairs, D2 a row) and keys [0, e) (the packed slabs), row stride ldo; the GEMM the float32 path
// leaves to BLAS
template <int PAR>
void cosines_bf16(const uint32_t* q, const float* qs, int64_t R, const uint32_t* slabs,
                  const float* ks, int64_t D2, int64_t e, float* out, int64_t ldo) {
  for (int64_t m0 = 0; m0 < R; m0 += RB) {
    with_rows(std::min<int64_t>(RB, R - m0), [&](auto RBn) {
      constexpr int rb = decltype(RBn)::value;
      Vec acc[RB][2];
      for (int64_t j = 0; j < e; j += NB) {
        qk_rows_bf16<rb, PAR>(q + m0 * D2, D2, slabs + j / NB * D2 * NB, D2, acc);
        for (int r = 0; r < rb; ++r) {
          const Vec qv(qs[m0 + r]);
          for (int h = 0; h < 2; ++h) {
            const int64_t cnt = std::min<int64_t>(L, e - j - h * L);
            if (cnt <= 0) break;
            const Vec x = acc[r][h] * Vec::loadu(ks + j + h * L) * qv;
            float* o = out + (m0 + r) * ldo + j + h * L;
            if (cnt == L) x.store(o);
            else x.store(o, cnt);
          }
        }
      }
    });
  }
}
#endif

// The bf16 q and k the host passed for Q K^T on the dot products (qr, kr), read in place: on
// where both are given and the CPU has the instruction (bf16_dot)
struct RawQK {
  bool on = false;
#if defined(LSSAR_BF16_DOT)
  View16 q, k;
#endif
};

RawQK raw_qk(const c10::optional<at::Tensor>& qr, const c10::optional<at::Tensor>& kr, int64_t B,
             int64_t H, int64_t t_q, int64_t t_k, int64_t D) {
  RawQK r;
  r.on = qr.has_value() && kr.has_value() && bf16_dot();
#if defined(LSSAR_BF16_DOT)
  if (r.on) {
    r.q = check16(*qr, "qr", B, H, t_q, D);
    r.k = check16(*kr, "kr", B, H, t_k, D);
  }
#endif
  return r;
}

// out [BH, T_q, Dv]; returns (out, status): 0, or 1 where a row's every softplus underflowed
// (the host's eager path recomputes the call), 2 where bf16 inputs qr / kr (given: Q K^T from
// them, see qk_tile_bf16) hold a NaN or an infinity (the host reruns without them).
//
// Tiled over query rows (blocks of `rows`) and keys (tiles of `key_tile`, rounded up to NB), so
// a tile's packed K and its V stay in L2 while every micro-block of the block's rows uses them.
// LSSA in one pass (its normaliser is a plain sum, so tiles simply add up): per tile and
// micro-block the weights, then their product with V. LSSAR in two passes over the block's rows
// of softplus values, kept between them (rows x T_k floats, written once and read once): pass 1
// per tile the weights into the kept rows (Z_i, max_j a_ij), pass 2 per tile the weights r^p in
// place and their product with V. No score is computed twice.
std::tuple<at::Tensor, int64_t> forward(const at::Tensor& q, const at::Tensor& k,
                                        const at::Tensor& v,
                                        const c10::optional<at::Tensor>& mask, int64_t H,
                                        bool causal, double scale, bool log_n, double p,
                                        double min_keys, double tol, int64_t rows,
                                        int64_t key_tile, const c10::optional<at::Tensor>& qr,
                                        const c10::optional<at::Tensor>& kr) {
  const int64_t B = q.size(0);
  const View Q = check(q, "q", B, H), K = check(k, "k", B, H), V = check(v, "v", B, H);
  const Problem P = make_problem(B * H, H, q.size(2), k.size(2), q.size(3), v.size(3), mask,
                                 causal, scale, log_n, p, min_keys, tol, rows);
  const int64_t KT = round_up(std::max<int64_t>(1, key_tile), NB), D = P.d, DV = P.dv;
  const bool short_rows = P.t_k < 256;  // four partial sums per score (qk_tile)
  const RawQK RQ = raw_qk(qr, kr, B, H, P.t_q, P.t_k, D);
  const bool raw = RQ.on;
  const int64_t D2 = (D + 1) / 2;
  std::atomic<bool> nonfinite{false};
  // zeroed by blocks where they are computed (while in cache), not beforehand
  auto out = at::empty({B, H, P.t_q, DV}, q.options());
  const int64_t n_blocks = (P.t_q + P.rows - 1) / P.rows;
  float* op = out.data_ptr<float>();
  std::atomic<bool> underflow{false};
  at::parallel_for(0, P.BH * n_blocks, 1, [&](int64_t begin, int64_t end) {
    const int64_t RR = P.rows;
    std::vector<float> slabs(raw ? 0 : round_up(P.t_k, NB) * D), mfb(RB * KT), n(RR), z(RR),
        amax(RR), mu(RR), inv(RR), den(RR), c(RR);
    std::vector<uint32_t> slabs16(raw ? round_up(P.t_k, NB) * D2 : 0), qpk(raw ? RR * D2 : 0);
    std::vector<float> ks(raw ? round_up(P.t_k, NB) : 0);
    std::vector<float> buf;  // LSSA: a micro-block's weights; LSSAR: the block's kept rows
    std::vector<int64_t> ends(RR);
    std::vector<char> has(RR);
    int64_t packed = -1;  // the head whose keys `slabs` holds
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / n_blocks, i0 = (task % n_blocks) * RR;
      const int64_t i1 = std::min(P.t_q, i0 + RR), R = i1 - i0;
      const int64_t e_blk = P.row_end(i1 - 1);
      float* ob = op + (bh * P.t_q + i0) * DV;
      std::fill(ob, ob + R * DV, 0.f);
      if (e_blk == 0) continue;
      if (packed != bh) {
        if (!raw) pack_keys(K.row(bh, 0), K.ld, P.t_k, D, slabs.data());
#if defined(LSSAR_BF16_DOT)
        else if (!pack_keys_bf16(RQ.k.row(bh, 0), RQ.k.ld, P.t_k, D, slabs16.data(), ks.data()))
          nonfinite = true;
#endif
        packed = bh;
      }
      const float* qb = Q.row(bh, i0);
      const float* vb = V.row(bh, 0);
      for (int64_t r = 0; r < R; ++r) {
        n[r] = P.count(bh, i0 + r);
        c[r] = P.row_scale(n[r]);
        ends[r] = P.row_end(i0 + r);
        z[r] = amax[r] = den[r] = 0.f;
#if defined(LSSAR_BF16_DOT)
        if (raw) {  // c_i / ||q_i||, the query's pairs scaled as the keys'
          uint16_t* qrow = reinterpret_cast<uint16_t*>(qpk.data() + r * D2);
          const float iq = scale_row_bf16(RQ.q.row(bh, i0 + r), D, qrow);
          if (std::isnan(iq)) nonfinite = true;
          c[r] *= iq;
        }
#endif
      }
      const int64_t ld = P.reweight ? round_up(e_blk, NB) : KT;  // row stride of buf
      const int64_t need = P.reweight ? R * ld : RB * KT;
      if (static_cast<int64_t>(buf.size()) < need) buf.resize(need);
      // micro-block m0 (RBn rows) over tile k0: its rows, and the keys any of them may see
      auto rows_of = [&](int64_t m0, int64_t rn, int64_t k0, int64_t kt) {
        Rows rs{c.data() + m0, ends.data() + m0, nullptr, KT};
        if (P.mask) {
          for (int64_t r = 0; r < rn; ++r)
            visible_keys(P, bh, i0 + m0 + r, k0, kt, mfb.data() + r * KT);
          rs.mf = mfb.data();
        }
        const int64_t last = *std::max_element(ends.begin() + m0, ends.begin() + m0 + rn);
        return std::make_pair(rs, std::clamp<int64_t>(last - k0, 0, kt));
      };
      for (int64_t k0 = 0; k0 < e_blk; k0 += KT) {  // LSSA: the output; LSSAR: pass 1
        const int64_t kt = std::min(KT, e_blk - k0);
        for (int64_t m0 = 0; m0 < R; m0 += RB) {
          const int64_t rn = std::min<int64_t>(RB, R - m0);
          const auto [rs, jend] = rows_of(m0, rn, k0, kt);
          if (jend == 0) continue;
          float* s = P.reweight ? buf.data() + m0 * ld + k0 : buf.data();
          with_rows(rn, [&](auto RBn) {
            constexpr int rb = decltype(RBn)::value;
            float *zr = z.data() + m0, *ar = amax.data() + m0;
            const float* qm = qb + m0 * Q.ld;
            auto qk = [&](auto par) {
              constexpr int PAR = decltype(par)::value;
              return [&, qm](int64_t sl, Vec(*acc)[2]) {
                qk_rows<rb, PAR>(qm, Q.ld, slabs.data() + sl * D * NB, D, acc);
              };
            };
#if defined(LSSAR_BF16_DOT)
            auto qk16 = [&](auto par) {
              constexpr int PAR = decltype(par)::value;
              const uint32_t* qm16 = qpk.data() + m0 * D2;
              return [&, qm16](int64_t sl, Vec(*acc)[2]) {
                qk_rows_bf16<rb, PAR>(qm16, D2, slabs16.data() + sl * D2 * NB, D2, acc);
              };
            };
            if (raw && short_rows)
              score_tile<rb, true>(qk16(std::integral_constant<int, 4>{}), ks.data(), k0, jend,
                                   rs, s, ld, zr, ar);
            else if (raw)
              score_tile<rb, true>(qk16(std::integral_constant<int, 2>{}), ks.data(), k0, jend,
                                   rs, s, ld, zr, ar);
            else
#endif
            if (short_rows)
              score_tile<rb, false>(qk(std::integral_constant<int, 4>{}), nullptr, k0, jend, rs,
                                    s, ld, zr, ar);
            else
              score_tile<rb, false>(qk(std::integral_constant<int, 2>{}), nullptr, k0, jend, rs,
                                    s, ld, zr, ar);
            if (!P.reweight)
              pv_rows<rb>(s, ld, vb + k0 * V.ld, V.ld, jend, ob + m0 * DV, DV, DV);
          });
        }
      }
      if (!P.reweight) {
        for (int64_t r = 0; r < R; ++r) den[r] = z[r];
      } else {
        for (int64_t r = 0; r < R; ++r) {
          const Reweight rw = reweight_stats(P, n[r], z[r], amax[r]);
          mu[r] = rw.mu;
          has[r] = rw.has;
          inv[r] = rw.has ? 1.f / rw.x_max : 0.f;
          if (!rw.has) den[r] = z[r];  // uniform up to rounding: the LSSA weights a / Z
        }
        with_pow(P.p, [&](auto pw) {  // pass 2
          for (int64_t k0 = 0; k0 < e_blk; k0 += KT) {
            const int64_t kt = std::min(KT, e_blk - k0);
            for (int64_t m0 = 0; m0 < R; m0 += RB) {
              const int64_t rn = std::min<int64_t>(RB, R - m0);
              const int64_t last = *std::max_element(ends.begin() + m0, ends.begin() + m0 + rn);
              const int64_t jend = std::clamp<int64_t>(last - k0, 0, kt);
              if (jend == 0) continue;
              float* w = buf.data() + m0 * ld + k0;
              for (int64_t r = 0; r < rn; ++r)
                if (has[m0 + r]) den[m0 + r] += sharpen_row(w + r * ld, jend, mu[m0 + r], inv[m0 + r], pw);
              with_rows(rn, [&](auto RBn) {
                pv_rows<decltype(RBn)::value>(w, ld, vb + k0 * V.ld, V.ld, jend, ob + m0 * DV, DV,
                                              DV);
              });
            }
          }
        });
      }
      for (int64_t r = 0; r < R; ++r) {
        if (z[r] == 0.f && n[r] > 0.f) underflow = true;
        const float d = den[r] > 0.f ? den[r] : 1.f, iv = 1.f / d;
        for (int64_t x = 0; x < DV; ++x) ob[r * DV + x] *= iv;
      }
    }
  });
  return {out, nonfinite.load() ? 2 : underflow.load() ? 1 : 0};
}

// The backward's element-wise work on one row between the GEMMs: dP / den in `dp` (over the
// row's keys [0, e)) becomes c_i dS (0 on masked keys and on [e, e_blk)).
template <bool Masked>
void score_grads(const Problem& P, const RowStats& st, const float* mf, const float* w,
                 const float* sg, const float* rp, float* dp, int64_t e, int64_t e_blk) {
  const Vec zero(0.f);
  const bool rw = P.reweight && st.has;
  // re-weighted rows: dP - D taken about the top key's dP (chunked.py says why: a nearly one-hot
  // row would cancel dP_top against D); 0 leaves LSSA rows as they were
  const Vec shift(rw ? dp[st.top] : 0.f);
  Vec wdv(0.f);  // D_i / den from the same slab (exact cancellation on one-key rows)
  row_loop(e, [&](int64_t j, int64_t cnt, auto full) {
    constexpr bool F = decltype(full)::value;
    wdv = at::vec::fmadd(load<F>(w + j, cnt), load<F>(dp + j, cnt) - shift, wdv);
  });
  const Vec D(hsum(wdv) / st.den), cv(st.c);
  float fn = 0.f;
  if (rw) {  // dx = p r^(p-1) (dP - D) / x_max, stored over dp; F_i its row sum
    const Vec kp(P.p / st.x_max);
    Vec fs(0.f);
    row_loop(e, [&](int64_t j, int64_t cnt, auto full) {
      constexpr bool F = decltype(full)::value;
      const Vec dx = load<F>(rp + j, cnt) * (load<F>(dp + j, cnt) - shift - D) * kp;
      store<F>(dx, dp + j, cnt);
      fs = fs + visible<Masked, F>(dx, mf, j, cnt);
    });
    if (st.big) fn = hsum(fs) / std::max(st.n, 1.f);
  }
  // dS = (dx - F_i / N_i) sigmoid(s), times c_i (so dk gets sum_i c_i dS_ij q_i); LSSA
  // rows: dx = dP - D
  const Vec fv(rw ? fn : 0.f), sub = rw ? fv : D;
  row_loop(e, [&](int64_t j, int64_t cnt, auto full) {
    constexpr bool F = decltype(full)::value;
    const Vec ds = (load<F>(dp + j, cnt) - sub) * load<F>(sg + j, cnt) * cv;
    store<F>(visible<Masked, F>(ds, mf, j, cnt), dp + j, cnt);
  });
  std::fill(dp + e, dp + e_blk, 0.f);
}

// grad [BH, T_q, Dv] -> (dq, dk, dv, status): status as forward's (qr, kr: the cosines from the
// bf16 inputs, cosines_bf16)
std::tuple<at::Tensor, at::Tensor, at::Tensor, int64_t> backward(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const c10::optional<at::Tensor>& mask, int64_t H, bool causal, double scale, bool log_n,
    double p, double min_keys, double tol, int64_t rows, const c10::optional<at::Tensor>& qr,
    const c10::optional<at::Tensor>& kr) {
  const int64_t B = q.size(0);
  const View G = check(grad, "grad", B, H), Q = check(q, "q", B, H), K = check(k, "k", B, H),
             V = check(v, "v", B, H);
  const Problem P = make_problem(B * H, H, q.size(2), k.size(2), q.size(3), v.size(3), mask,
                                 causal, scale, log_n, p, min_keys, tol, rows);
  // [B, H, T, D] contiguous, zeroed per head where they are computed
  auto dq = at::empty({B, H, P.t_q, P.d}, q.options());
  auto dk = at::empty({B, H, P.t_k, P.d}, q.options()), dvv = at::empty({B, H, P.t_k, P.dv}, q.options());
  std::atomic<bool> underflow{false}, nonfinite{false};
  const int64_t n_blocks = (P.t_q + P.rows - 1) / P.rows, D = P.d, DV = P.dv;
  const RawQK RQ = raw_qk(qr, kr, B, H, P.t_q, P.t_k, D);
  const bool raw = RQ.on;
  const int64_t D2 = (D + 1) / 2;
  float *dqp = dq.data_ptr<float>(), *dkp = dk.data_ptr<float>(), *dvp = dvv.data_ptr<float>();
  at::parallel_for(0, P.BH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> gbuf, wbuf, dbuf, rbuf, gden(P.rows * DV), mfb(P.rows * P.t_k);
    std::vector<RowStats> stats(P.rows);
    std::vector<const float*> mfs(P.rows);
    std::vector<uint32_t> slabs16(raw ? round_up(P.t_k, NB) * D2 : 0), qpk(raw ? P.rows * D2 : 0);
    std::vector<float> ks(raw ? round_up(P.t_k, NB) : 0), qs(raw ? P.rows : 0);
    for (int64_t bh = begin; bh < end; ++bh) {
      const float* kb = K.row(bh, 0);
      const float* vb = V.row(bh, 0);
#if defined(LSSAR_BF16_DOT)
      if (raw && !pack_keys_bf16(RQ.k.row(bh, 0), RQ.k.ld, P.t_k, D, slabs16.data(), ks.data()))
        nonfinite = true;
#endif
      std::fill(dkp + bh * P.t_k * D, dkp + (bh + 1) * P.t_k * D, 0.f);
      std::fill(dvp + bh * P.t_k * DV, dvp + (bh + 1) * P.t_k * DV, 0.f);
      for (int64_t blk = 0; blk < n_blocks; ++blk) {
        const int64_t i0 = blk * P.rows, i1 = std::min(P.t_q, i0 + P.rows), R = i1 - i0;
        const int64_t e_blk = P.row_end(i1 - 1);
        if (e_blk == 0) {  // rows before the first key: no gradient
          std::fill(dqp + (bh * P.t_q + i0) * D, dqp + (bh * P.t_q + i1) * D, 0.f);
          continue;
        }
        gbuf.resize(R * e_blk);
        wbuf.resize(R * e_blk);
        dbuf.resize(R * e_blk);
        if (P.reweight) rbuf.resize(R * e_blk);
        const float* qb = Q.row(bh, i0);
        const float* gb = G.row(bh, i0);
        if (!raw) gemm(R, e_blk, D, qb, Q.ld, kb, K.ld, true, 0.f, gbuf.data(), e_blk);  // cosines
#if defined(LSSAR_BF16_DOT)
        if (raw) {
          for (int64_t r = 0; r < R; ++r) {
            uint16_t* qrow = reinterpret_cast<uint16_t*>(qpk.data() + r * D2);
            qs[r] = scale_row_bf16(RQ.q.row(bh, i0 + r), D, qrow);
            if (std::isnan(qs[r])) nonfinite = true;
          }
          if (P.t_k < 256)  // four partial sums on short rows, as the forward
            cosines_bf16<4>(qpk.data(), qs.data(), R, slabs16.data(), ks.data(), D2, e_blk,
                            gbuf.data(), e_blk);
          else
            cosines_bf16<2>(qpk.data(), qs.data(), R, slabs16.data(), ks.data(), D2, e_blk,
                            gbuf.data(), e_blk);
        }
#endif
        for (int64_t r = 0; r < R; ++r) {
          const int64_t e = P.row_end(i0 + r);
          float n;
          mfs[r] = visible_keys(P, bh, i0 + r, 0, e, mfb.data() + r * P.t_k, &n);
          float* g = gbuf.data() + r * e_blk;  // cosines in, sigmoid(s) out
          float* w = wbuf.data() + r * e_blk;
          float* rp = P.reweight ? rbuf.data() + r * e_blk : nullptr;
          stats[r] = mfs[r] ? row_weights<true>(P, n, mfs[r], g, w, e, e_blk, rp)
                            : row_weights<false>(P, n, mfs[r], g, w, e, e_blk, rp);
          if (stats[r].underflow) underflow = true;
          const float inv = 1.f / stats[r].den;
          for (int64_t c = 0; c < DV; ++c) gden[r * DV + c] = gb[r * G.ld + c] * inv;
        }
        gemm(R, e_blk, DV, gden.data(), DV, vb, V.ld, true, 0.f, dbuf.data(), e_blk);  // dP / den
        for (int64_t r = 0; r < R; ++r) {
          float* dp = dbuf.data() + r * e_blk;
          if (stats[r].n == 0.f) {
            std::fill(dp, dp + e_blk, 0.f);
            continue;
          }
          const int64_t e = P.row_end(i0 + r);
          const float* w = wbuf.data() + r * e_blk;
          const float* sg = gbuf.data() + r * e_blk;  // sigmoid(s_ij), from row_weights
          const float* rp = P.reweight ? rbuf.data() + r * e_blk : nullptr;  // r^(p-1)
          if (mfs[r])
            score_grads<true>(P, stats[r], mfs[r], w, sg, rp, dp, e, e_blk);
          else
            score_grads<false>(P, stats[r], mfs[r], w, sg, rp, dp, e, e_blk);
        }
        // dv += W^T (g / den); dq = (c dS) K; dk += (c dS)^T q
        gemm(e_blk, DV, R, wbuf.data(), e_blk, gden.data(), DV, false, 1.f,
             dvp + bh * P.t_k * DV, DV, true);
        gemm(R, D, e_blk, dbuf.data(), e_blk, kb, K.ld, false, 0.f, dqp + (bh * P.t_q + i0) * D,
             D);
        gemm(e_blk, D, R, dbuf.data(), e_blk, qb, Q.ld, false, 1.f, dkp + bh * P.t_k * D, D, true);
      }
    }
  });
  return {dq, dk, dvv, nonfinite.load() ? 2 : underflow.load() ? 1 : 0};
}

// ---------------------------------------------------------------------------- the decode step
// A cache's rows as float32 vectors, converted in registers as they are loaded (bf16: the bits
// shifted into a float's high half; fp16: the F16C conversion), cnt < L lanes on a row's tail
template <typename T>
inline Vec load_f32(const T* p, int64_t cnt = L) {
  if constexpr (std::is_same_v<T, float>) {
    return cnt == L ? Vec::loadu(p) : Vec::loadu(p, cnt);
  } else {
#if defined(CPU_CAPABILITY_AVX512)
    if (cnt == L) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      if constexpr (std::is_same_v<T, at::BFloat16>)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      else
        return _mm512_cvtph_ps(h);
    }
#elif defined(CPU_CAPABILITY_AVX2)
    if (cnt == L) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
      if constexpr (std::is_same_v<T, at::BFloat16>)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
      else
        return _mm256_cvtph_ps(h);
    }
#endif
    float buf[L] = {};
    for (int64_t i = 0; i < cnt; ++i) buf[i] = static_cast<float>(p[i]);
    return Vec::loadu(buf);
  }
}

// lane j of the result = the sum of v[j]'s lanes: L horizontal sums at once, by a transposing
// tree of shuffles and adds (AVX-512: 45 instructions for 16 sums; one horizontal sum alone takes
// about 8)
inline Vec sum_lanes(Vec (&v)[L]) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    const __m512 a = v[2 * i], b = v[2 * i + 1];
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: the lane's sums of v[4i .. 4i + 3]
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
#elif defined(CPU_CAPABILITY_AVX2)
  __m256 t[4], u[2];
  for (int i = 0; i < 4; ++i) t[i] = _mm256_hadd_ps(v[2 * i], v[2 * i + 1]);
  for (int i = 0; i < 2; ++i) u[i] = _mm256_hadd_ps(t[2 * i], t[2 * i + 1]);
  return _mm256_add_ps(_mm256_permute2f128_ps(u[0], u[1], 0x20),
                       _mm256_permute2f128_ps(u[0], u[1], 0x31));
#else
  float s[L];
  for (int64_t i = 0; i < L; ++i) s[i] = hsum(v[i]);
  return Vec::loadu(s);
#endif
}

// 1 / ||k|| of one key, scaled by its largest magnitude first (as common.unit does), 0 for a
// zero or non-finite key (cosine 0 with every query): the rare keys whose squares over- or
// underflow float32
inline float robust_inv_norm(const float* k, int64_t d) {
  float big = 0.f;
  for (int64_t x = 0; x < d; ++x) big = std::max(big, std::abs(k[x]));
  if (!(big > 0.f) || !std::isfinite(big)) return 0.f;
  float ss = 0.f;
  for (int64_t x = 0; x < d; ++x) ss += (k[x] / big) * (k[x] / big);
  const float nrm = std::sqrt(ss) * big;
  return nrm > 0.f && std::isfinite(nrm) ? 1.f / nrm : 0.f;
}

// A block of nk <= L keys (rows of a cache, stride ldk) as float32 rows of D (`buf`, or the
// cache itself when it is float32)
template <typename T>
inline const float* keys_f32(const T* k, int64_t ldk, int64_t nk, int64_t D, float* buf,
                             int64_t& ld) {
  if constexpr (std::is_same_v<T, float>) {
    ld = ldk;
    return k;
  } else {
    ld = D;
    for (int64_t j = 0; j < nk; ++j)
      for (int64_t x = 0; x < D; x += L) {
        const int64_t cnt = std::min<int64_t>(L, D - x);
        const Vec y = load_f32(k + j * ldk + x, cnt);
        if (cnt == L) y.store(buf + j * D + x);
        else y.store(buf + j * D + x, cnt);
      }
    return buf;
  }
}

// lane j: a . k_j over D for the block's nk keys (0 on the other lanes)
inline Vec dot_lanes(const float* a, const float* kb, int64_t ld, int64_t nk, int64_t D) {
  Vec acc[L];
  for (int64_t j = 0; j < L; ++j) {
    Vec s(0.f);
    if (j < nk)
      for (int64_t x = 0; x < D; x += L) {
        const int64_t cnt = std::min<int64_t>(L, D - x);
        s = at::vec::fmadd(cnt == L ? Vec::loadu(a + x) : Vec::loadu(a + x, cnt),
                           cnt == L ? Vec::loadu(kb + j * ld + x) : Vec::loadu(kb + j * ld + x, cnt), s);
      }
    acc[j] = s;
  }
  return sum_lanes(acc);
}

// 1 / ||k_j|| of the block's keys: one sum of squares per key, summed L keys at a time; keys
// whose squares leave [1e-30, 1e30] go to robust_inv_norm
inline Vec inv_norms(const float* kb, int64_t ld, int64_t nk, int64_t D) {
  Vec acc[L];
  for (int64_t j = 0; j < L; ++j) {
    Vec s(0.f);
    if (j < nk)
      for (int64_t x = 0; x < D; x += L) {
        const int64_t cnt = std::min<int64_t>(L, D - x);
        const Vec y = cnt == L ? Vec::loadu(kb + j * ld + x) : Vec::loadu(kb + j * ld + x, cnt);
        s = at::vec::fmadd(y, y, s);
      }
    acc[j] = s;
  }
  const Vec ss = sum_lanes(acc);
  Vec inv = Vec(1.f) / ss.sqrt();
  float sv[L], iv[L];
  ss.store(sv);
  bool odd = false;
  for (int64_t j = 0; j < nk; ++j) odd |= !(sv[j] >= 1e-30f && sv[j] <= 1e30f);
  if (odd) {
    inv.store(iv);
    for (int64_t j = 0; j < nk; ++j)
      if (!(sv[j] >= 1e-30f && sv[j] <= 1e30f)) iv[j] = robust_inv_norm(kb + j * ld, D);
    inv = Vec::loadu(iv);
  }
  return inv;
}

// V's row as float32 vectors where its weight is nonzero, and zeros without reading memory where
// it is 0 (AVX-512: masked loads, which neither fault nor read; else a branch): masked keys (and
// keys LSSAR zeroes) are never read, so padding there may hold anything, NaN included, as in the
// forward's select. Branch-free where the ISA allows: LSSAR zeroes about half the keys in no
// pattern a branch predictor could follow.
template <typename T>
inline Vec load_if(const T* p, int64_t cnt, bool keep) {
#if defined(CPU_CAPABILITY_AVX512)
  const __mmask16 m = keep ? static_cast<__mmask16>((1u << cnt) - 1u) : 0;
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_maskz_loadu_ps(m, p);
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(m, p);
    if constexpr (std::is_same_v<T, at::BFloat16>)
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    else
      return _mm512_cvtph_ps(h);
  }
#else
  return keep ? load_f32(p, cnt) : Vec(0.f);
#endif
}

// out [R, DV] = W [R, kt] (row stride ldw) times V [kt, DV] (row stride ldv, a cache's rows,
// converted as they are loaded), reading only the rows of V with a nonzero weight (load_if)
template <typename T>
void weights_v(int64_t R, int64_t kt, const float* w, int64_t ldw, const T* v, int64_t ldv,
               int64_t DV, float* out) {
  constexpr int64_t C = 4;  // vectors of a row's output in registers
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c0 = 0; c0 < DV; c0 += C * L) {
      Vec acc[C];
      int64_t cnt[C];
      for (int64_t c = 0; c < C; ++c) {
        acc[c] = Vec(0.f);
        cnt[c] = std::clamp<int64_t>(DV - c0 - c * L, 0, L);
      }
      const int64_t nv = (std::min<int64_t>(C * L, DV - c0) + L - 1) / L;
      for (int64_t j = 0; j < kt; ++j) {
        const float x = w[r * ldw + j];
        const T* vj = v + j * ldv + c0;
#if !defined(CPU_CAPABILITY_AVX512)
        if (x == 0.f) continue;
#endif
        const Vec xv(x);
        if (nv == C) {
#pragma GCC unroll 4
          for (int64_t c = 0; c < C; ++c)
            acc[c] = at::vec::fmadd(xv, load_if(vj + c * L, cnt[c], x != 0.f), acc[c]);
        } else {
          for (int64_t c = 0; c < nv; ++c)
            acc[c] = at::vec::fmadd(xv, load_if(vj + c * L, cnt[c], x != 0.f), acc[c]);
        }
      }
      for (int64_t c = 0; c < nv; ++c)
        if (cnt[c] == L) acc[c].store(out + r * DV + c0 + c * L);
        else acc[c].store(out + r * DV + c0 + c * L, cnt[c]);
    }
}

// A decode step: T_q (a few) new queries of every head against a long cache of T_k keys, no
// gradient. q [B, H_q, T_q, D] float32 contiguous (unit vectors when `norm_k`); k [B, H_k, T_k, D]
// and v [B, H_k, T_k, Dv] views with unit last stride (a KV cache's buffers, read in place: no
// copy), float32, or bf16 / fp16 converted in registers as they are read; H_q = G H_k (GQA: a
// kv head's G query heads share each read of its keys).
// `norm_k`: the scores are divided by the keys' norms: `k_inv` [B, H_k, T_k] (unit last stride)
// when the cache keeps them (computed once, when a key enters it), else computed here from the
// keys as they are read (L keys' sums of squares at once). Keys are cut into chunks of `chunk`,
// each (b, kv head, chunk) one task, so one head's long cache keeps every thread busy (split-K):
//   pass 1 (over K): per block of L keys their dot products with the rows' queries (L at once),
//     times the row scale and the keys' inverse norms, softplus kept in a [B H_k, G T_q, T_k]
//     buffer (1/D of K's size per query row); per-chunk Z_i and max_j a_ij (and, for LSSA, the
//     chunk's A V);
//   pass 2 (over V, LSSAR only): the weights r^p from the kept values and the chunk's W V.
// Masked keys are never read into a result (scores by select, values only where a weight is
// nonzero: weights_v), so the host need not zero the padding of the cache first.
// The chunks' sums are added in chunk order. Returns (out [B, H_q, T_q, Dv], any_underflow).
template <typename T>
std::tuple<at::Tensor, bool> decode_impl(const at::Tensor& q, const at::Tensor& k,
                                         const at::Tensor& v, const c10::optional<at::Tensor>& k_inv,
                                         const c10::optional<at::Tensor>& mask, bool causal,
                                         double scale, bool log_n, bool norm_k, double p,
                                         double min_keys, double tol, int64_t chunk) {
  const int64_t B = q.size(0), HQ = q.size(1), TQ = q.size(2), D = q.size(3);
  const int64_t HK = k.size(1), TK = k.size(2), DV = v.size(3);
  const int64_t G = HQ / HK, R = G * TQ, U = B * HK;  // rows per kv head, units (b, kv head)
  const int64_t CH = round_up(std::max<int64_t>(1, chunk), L), NC = (TK + CH - 1) / CH;
  // the row rules (ends, counts, scales, re-weighting) as the forward's, per query head
  const Problem P = make_problem(B * HQ, HQ, TQ, TK, D, DV, mask, causal, scale, log_n, p,
                                 min_keys, tol, 1);
  // row r of unit u = (b, hk): query head hk G + r / T_q, query r % T_q; bh as the forward's
  auto bh_of = [&](int64_t u, int64_t r) { return (u / HK) * HQ + (u % HK) * G + r / TQ; };
  std::vector<float> n(U * R), c(U * R);
  at::parallel_for(0, U * R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t x = begin; x < end; ++x) {
      const int64_t u = x / R, r = x % R;
      n[x] = P.count(bh_of(u, r), r % TQ);
      c[x] = P.row_scale(n[x]);
    }
  });
  auto kept = at::empty({U, R, TK}, q.options());  // softplus values (pass 1) -> weights
  auto part = at::zeros({U, NC, R, DV}, q.options());
  std::vector<float> zp(U * NC * R), mp(U * NC * R), dp(U * NC * R);
  const float* qp = q.data_ptr<float>();
  float* ap = kept.data_ptr<float>();
  float* pp = part.data_ptr<float>();
  const T* kp = static_cast<const T*>(k.data_ptr());
  const T* vp = static_cast<const T*>(v.data_ptr());
  // the first key / value of unit u, and the inverse norms given with the cache
  auto key0 = [&](int64_t u) { return kp + (u / HK) * k.stride(0) + (u % HK) * k.stride(1); };
  auto value0 = [&](int64_t u) { return vp + (u / HK) * v.stride(0) + (u % HK) * v.stride(1); };
  const float* ip = k_inv.has_value() ? k_inv->data_ptr<float>() : nullptr;
  auto inv0 = [&](int64_t u) {
    return ip + (u / HK) * k_inv->stride(0) + (u % HK) * k_inv->stride(1);
  };
  const int64_t ldk = k.stride(2), ldv = v.stride(2);
  at::parallel_for(0, U * NC, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> kbuf(L * D), mfb(CH);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t u = task / NC, ch = task % NC, k0 = ch * CH, kt = std::min(CH, TK - k0);
      float* a = ap + u * R * TK + k0;  // row r at a + r TK
      const float* qu = qp + u * R * D;
      Vec zs[16], mx[16];  // rows' sums and maxima over the chunk (R <= 16 at a time)
      for (int64_t r0 = 0; r0 < R; r0 += 16) {
        const int64_t rn = std::min<int64_t>(16, R - r0);
        for (int64_t r = 0; r < rn; ++r) zs[r] = mx[r] = Vec(0.f);
        for (int64_t j = 0; j < kt; j += L) {
          const int64_t nk = std::min<int64_t>(L, kt - j);
          int64_t ld;
          const float* kb = keys_f32(key0(u) + (k0 + j) * ldk, ldk, nk, D, kbuf.data(), ld);
          Vec ik(1.f);
          if (norm_k)
            ik = ip ? Vec::loadu(inv0(u) + k0 + j, nk) : inv_norms(kb, ld, nk, D);
          for (int64_t r = r0; r < r0 + rn; ++r) {
            const int64_t x = u * R + r;
            const int64_t vis = std::clamp<int64_t>(P.row_end(r % TQ) - k0 - j, 0, nk);
            float* row = a + r * TK + j;
            if (vis == 0) {
              std::fill(row, row + nk, 0.f);
              continue;
            }
            // a key of norm 0 (or NaN, inf) has cosine 0, as common.unit makes it
            const Vec s = Vec::blendv(dot_lanes(qu + r * D, kb, ld, nk, D) * ik * Vec(c[x]),
                                      Vec(0.f), ik == Vec(0.f));
            Vec av = softplus(s);
            if (P.mask) {
              visible_keys(P, bh_of(u, r), r % TQ, k0 + j, vis, mfb.data());
              av = visible<true, false>(av, mfb.data(), 0, vis);
            } else {
              av = visible<false, false>(av, nullptr, 0, vis);
            }
            av.store(row, nk);
            zs[r - r0] = zs[r - r0] + av;
            mx[r - r0] = at::vec::maximum(mx[r - r0], av);
          }
        }
        for (int64_t r = r0; r < r0 + rn; ++r) {
          zp[(u * NC + ch) * R + r] = hsum(zs[r - r0]);
          mp[(u * NC + ch) * R + r] = hmax(mx[r - r0]);
        }
      }
      if (!P.reweight)  // LSSA: this chunk's A V, normalised once every chunk's Z is known
        weights_v(R, kt, a, TK, value0(u) + k0 * ldv, ldv, DV, pp + (u * NC + ch) * R * DV);
    }
  });
  // the rows' statistics over every chunk
  std::vector<float> z(U * R, 0.f), den(U * R), mu(U * R, 0.f), iv(U * R, 0.f);
  std::vector<char> has(U * R, 0);
  bool underflow = false;
  for (int64_t u = 0; u < U; ++u)
    for (int64_t r = 0; r < R; ++r) {
      const int64_t x = u * R + r;
      float amax = 0.f;
      for (int64_t ch = 0; ch < NC; ++ch) {
        z[x] += zp[(u * NC + ch) * R + r];
        amax = std::max(amax, mp[(u * NC + ch) * R + r]);
      }
      if (z[x] == 0.f && n[x] > 0.f) underflow = true;
      den[x] = z[x];
      if (P.reweight) {
        const Reweight rw = reweight_stats(P, n[x], z[x], amax);
        has[x] = rw.has;
        mu[x] = rw.mu;
        iv[x] = rw.has ? 1.f / rw.x_max : 0.f;
      }
    }
  if (underflow) return {at::empty({0}, q.options()), true};
  if (P.reweight) {
    at::parallel_for(0, U * NC, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t u = task / NC, ch = task % NC, k0 = ch * CH, kt = std::min(CH, TK - k0);
        float* a = ap + u * R * TK + k0;
        for (int64_t r = 0; r < R; ++r) {
          const int64_t x = u * R + r;
          float* row = a + r * TK;
          // else a uniform row (or no key): the LSSA weights a / Z, kept as they are
          float ws = 0.f;
          if (has[x]) with_pow(P.p, [&](auto pw) { ws = sharpen_row(row, kt, mu[x], iv[x], pw); });
          dp[(u * NC + ch) * R + r] = ws;
        }
        weights_v(R, kt, a, TK, value0(u) + k0 * ldv, ldv, DV, pp + (u * NC + ch) * R * DV);
      }
    });
    for (int64_t u = 0; u < U; ++u)
      for (int64_t r = 0; r < R; ++r) {
        const int64_t x = u * R + r;
        if (!has[x]) continue;
        den[x] = 0.f;
        for (int64_t ch = 0; ch < NC; ++ch) den[x] += dp[(u * NC + ch) * R + r];
      }
  }
  auto out = at::zeros({B, HQ, TQ, DV}, q.options());  // rows (u, r) in this order: contiguous
  float* op = out.data_ptr<float>();
  at::parallel_for(0, U * R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t x = begin; x < end; ++x) {
      const int64_t u = x / R, r = x % R;
      const float inv = 1.f / (den[x] > 0.f ? den[x] : 1.f);
      float* o = op + x * DV;
      for (int64_t ch = 0; ch < NC; ++ch) {
        const float* src = pp + ((u * NC + ch) * R + r) * DV;
        for (int64_t y = 0; y < DV; ++y) o[y] += src[y];
      }
      for (int64_t y = 0; y < DV; ++y) o[y] *= inv;
    }
  });
  return {out, false};
}

std::tuple<at::Tensor, bool> decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const c10::optional<at::Tensor>& k_inv,
                                    const c10::optional<at::Tensor>& mask, bool causal,
                                    double scale, bool log_n, bool norm_k, double p,
                                    double min_keys, double tol, int64_t chunk) {
  for (auto* t : {&q, &k, &v})
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 4 && t->stride(3) == 1,
                "decode takes CPU tensors [B, H, T, D] with unit last stride");
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous(),
              "decode: q must be contiguous float32");
  const auto kv_type = k.scalar_type();
  TORCH_CHECK(v.scalar_type() == kv_type && (kv_type == at::kFloat || kv_type == at::kBFloat16 ||
                                             kv_type == at::kHalf),
              "decode: k and v must share one of float32, bfloat16, float16");
  // 0 kv heads is checked before the modulo (a SIGFPE)
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0 && k.size(0) == q.size(0) &&
                  v.size(0) == q.size(0) && v.size(1) == k.size(1) && v.size(2) == k.size(2) &&
                  k.size(3) == q.size(3),
              "decode: shapes of q, k, v do not agree");
  // the entry's contract: a float32 key cache's rows lie apart (a row stride in [D, 2^31)); a
  // time-expanded (stride 0) or unfolded view is refused here, and the host copies such a cache
  // first (common.separate_rows)
  const int64_t ldk_max = std::numeric_limits<int>::max();
  TORCH_CHECK(kv_type != at::kFloat || (k.stride(2) >= k.size(3) && k.stride(2) <= ldk_max),
              "decode: a float32 key cache needs a row stride in [D, 2^31), got ", k.stride(2));
  if (k_inv.has_value())
    TORCH_CHECK(k_inv->scalar_type() == at::kFloat && k_inv->dim() == 3 &&
                    k_inv->size(0) == k.size(0) && k_inv->size(1) == k.size(1) &&
                    k_inv->size(2) == k.size(2) && k_inv->stride(2) == 1,
                "decode: k_inv must be float32 [B, H_k, T_k] with unit last stride");
  const auto args = std::make_tuple(mask, causal, scale, log_n, norm_k, p, min_keys, tol, chunk);
  auto run = [&](auto tag) {
    using T = decltype(tag);
    return std::apply(
        [&](auto&&... a) { return decode_impl<T>(q, k, v, k_inv, a...); }, args);
  };
  if (kv_type == at::kBFloat16) return run(at::BFloat16{});
  if (kv_type == at::kHalf) return run(at::Half{});
  return run(float{});
}

// ------------------------------------------------------------------- the QK-norm, x / ||x||
// common.unit's arithmetic per row of D, in one pass each way instead of a dozen eager ones (at
// B=32 H=4 T=256 D=32 the eager unit of q and k took 20 ms of a 60 ms SDPA forward+backward):
// the row divided by its largest magnitude `big`, then by that vector's norm (both divisions,
// as unit rounds them). `inv` [N] keeps 1 / (norm big) for the backward, dx = (dy - y (y.dy)) inv
// (big is a constant there: the result is scale-invariant). As unit: a zero row gives zeros and
// a zero gradient (inv = 0); a row holding a NaN gives zeros, one holding an infinity (no NaN)
// x / inf, and both a NaN gradient (inv = NaN; unit's norm backward divides by a NaN or an
// infinite norm).
std::tuple<at::Tensor, at::Tensor> unit_forward(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.is_contiguous(),
              "unit_forward takes a contiguous float32 CPU tensor [N, D]");
  const int64_t N = x.size(0), D = x.size(1);
  auto y = at::empty_like(x);
  auto inv = at::empty({N}, x.options());
  const float* xp = x.data_ptr<float>();
  float *yp = y.data_ptr<float>(), *ip = inv.data_ptr<float>();
  at::parallel_for(0, N, std::max<int64_t>(1, 16384 / std::max<int64_t>(D, 1)),
                   [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* xr = xp + i * D;
      float* yr = yp + i * D;
      Vec mx(0.f);
      row_loop(D, [&](int64_t j, int64_t cnt, auto full) {
        constexpr bool F = decltype(full)::value;
        const Vec a = load<F>(xr + j, cnt).abs();
        mx = at::vec::maximum(mx, a);  // NaN propagates
      });
      const float big = hmax(mx);
      if (std::isnan(big) || big == 0.f) {  // unit: cosine 0 with everything
        std::fill(yr, yr + D, 0.f);
        ip[i] = big == 0.f ? 0.f : std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      if (std::isinf(big)) {  // unit divides by the infinite norm
        for (int64_t j = 0; j < D; ++j) yr[j] = xr[j] / std::numeric_limits<float>::infinity();
        ip[i] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      const Vec bv(big);
      Vec ss(0.f);
      row_loop(D, [&](int64_t j, int64_t cnt, auto full) {
        constexpr bool F = decltype(full)::value;
        const Vec s = load<F>(xr + j, cnt) / bv;
        store<F>(s, yr + j, cnt);
        ss = at::vec::fmadd(s, s, ss);  // tail lanes load as 0
      });
      const float norm = std::sqrt(hsum(ss));  // >= 1: the largest entry of y is +-1
      const Vec nv(norm);
      row_loop(D, [&](int64_t j, int64_t cnt, auto full) {
        constexpr bool F = decltype(full)::value;
        store<F>(load<F>(yr + j, cnt) / nv, yr + j, cnt);
      });
      ip[i] = 1.f / norm / big;
    }
  });
  return {y, inv};
}

// dx [N, D] from dy, the forward's y and inv (rows with inv = 0: zeros, whatever dy holds)
at::Tensor unit_backward(const at::Tensor& dy, const at::Tensor& y, const at::Tensor& inv) {
  for (auto* t : {&dy, &y})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 2 &&
                    t->is_contiguous() && t->sizes() == y.sizes(),
                "unit_backward takes contiguous float32 CPU tensors [N, D] of one shape");
  TORCH_CHECK(inv.scalar_type() == at::kFloat && inv.is_contiguous() && inv.dim() == 1 &&
                  inv.size(0) == y.size(0),
              "unit_backward: inv must be float32 [N]");
  const int64_t N = y.size(0), D = y.size(1);
  auto dx = at::empty_like(y);
  const float *gp = dy.data_ptr<float>(), *yp = y.data_ptr<float>(), *ip = inv.data_ptr<float>();
  float* dp = dx.data_ptr<float>();
  at::parallel_for(0, N, std::max<int64_t>(1, 16384 / std::max<int64_t>(D, 1)),
                   [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float *g = gp + i * D, *yr = yp + i * D;
      float* o = dp + i * D;
      if (ip[i] == 0.f) {
        std::fill(o, o + D, 0.f);
        continue;
      }
      Vec dot(0.f);
      row_loop(D, [&](int64_t j, int64_t cnt, auto full) {
        constexpr bool F = decltype(full)::value;
        dot = at::vec::fmadd(load<F>(yr + j, cnt), load<F>(g + j, cnt), dot);
      });
      const Vec dv(hsum(dot)), iv(ip[i]);
      row_loop(D, [&](int64_t j, int64_t cnt, auto full) {
        constexpr bool F = decltype(full)::value;
        const Vec r = (load<F>(g + j, cnt) - load<F>(yr + j, cnt) * dv) * iv;
        store<F>(r, o + j, cnt);
      });
    }
  });
  return dx;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward, "fused softplus-l1 attention forward (float32, CPU, key-tiled)");
  m.def("bf16_dot", &bf16_dot, "whether forward computes Q K^T of bf16 inputs on AVX512-BF16");
  m.def("backward", &backward, "fused softplus-l1 attention backward (float32, CPU)");
  m.def("decode", &decode, "fused softplus-l1 attention for a few queries over a KV cache");
  m.def("unit_forward", &unit_forward, "x / ||x|| per row (common.unit), and 1 / ||x|| kept");
  m.def("unit_backward", &unit_backward, "the gradient of unit_forward");
}
