// Fused CPU kernel for softplus-l1 attention (LSSA, LSSAR with any p, softplus-l1).
//
// The host (lssar/ops/chunked.py) normalises q and k in float32 and passes everything as float32
// [BH, T, D] contiguous tensors. Forward: per block of query rows, scores by BLAS, weights in
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
#include <limits>
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

// log1p(t) for t in [0, 1]: 2 atanh(u), u = t / (2 + t) in [0, 1/3], by its series to u^17
// (truncation < 3e-9 relative): full relative precision near 0, where softplus(s) ~ exp(s).
inline Vec log1p_unit(Vec t) {
  const Vec u = t / (Vec(2.f) + t), u2 = u * u;
  Vec poly(1.f / 17.f);
  for (float c : {15.f, 13.f, 11.f, 9.f, 7.f, 5.f, 3.f, 1.f}) poly = at::vec::fmadd(poly, u2, Vec(1.f / c));
  return Vec(2.f) * u * poly;
}

// softplus(s) = max(s, 0) + log1p(exp(-|s|)), and t = exp(-|s|) for the sigmoid
inline Vec softplus_t(Vec s, Vec& t) {
  t = (Vec(0.f) - s.abs()).exp_u20();
  return at::vec::maximum(s, Vec(0.f)) + log1p_unit(t);
}

inline Vec softplus(Vec s) {
  Vec t;
  return softplus_t(s, t);
}

// sigmoid(s) from t = exp(-|s|): 1 / (1 + t) for s >= 0, t / (1 + t) below
inline Vec sigmoid_t(Vec s, Vec t) {
  const Vec inv = Vec(1.f) / (Vec(1.f) + t);
  return Vec::blendv(t * inv, inv, s >= Vec(0.f));
}


// r^p by repeated squaring (the multiplications of chunked._ipow), lane-wise
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

// r^p (forward weights); r in [0, 1]
inline Vec vpow(Vec r, float p) { return small_int(p) ? vipow(r, static_cast<int>(p)) : r.pow(Vec(p)); }

// r^(p-1) for the backward: 0 where r = 0 unless p > 1 makes it 0 anyway
inline Vec vpow_m1(Vec r, float p) {
  if (p > 1.f) return vpow(r, p - 1.f);
  Vec pw = r.pow(Vec(p - 1.f));
  return Vec::blendv(Vec(0.f), pw, r > Vec(0.f));
}

inline float hsum(Vec x) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, x);
}
inline float hmax(Vec x) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, x);
}

// The visibility of row i's keys 0..e-1 as floats (1 visible, 0 not) into `mf`, and N_i.
// Returns nullptr (every key visible) when there is no mask.
inline const float* visible_row(const Problem& P, int64_t bh, int64_t i, int64_t e, float* mf,
                                float& n) {
  if (!P.mask) {
    n = static_cast<float>(e);
    return nullptr;
  }
  const bool* m = P.mask_row(bh, i);
  int64_t cnt = 0;
  for (int64_t j = 0; j < e; ++j) {
    const bool b = m[j * P.ms_k];
    mf[j] = b ? 1.f : 0.f;
    cnt += b;
  }
  n = static_cast<float>(cnt);
  return mf;
}

// lanes j..j+L-1 that are inside the row (j + lane < e) and visible
inline Vec lanes(const float* mf, int64_t j, int64_t e) {
  const int64_t L = Vec::size();
  if (j + L <= e) return mf ? (Vec::loadu(mf + j) > Vec(0.f)) : (Vec(0.f) == Vec(0.f));
  Vec in = Vec::set(Vec(0.f), Vec(1.f), e - j);
  if (mf) in = in * Vec::loadu(mf + j, e - j);
  return in > Vec(0.f);
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

// Row statistics and weights over one score row `g` (raw cosines), written to `a` (length
// e_blk: keys e.. of the block are zero). Returns what the backward needs.
struct RowStats {
  float n, c, z, mu, x_max, den;
  bool big, has, underflow;
  int64_t top;  // a key of the largest re-weighted weight (backward only)
};

// For the backward, `sig` (may alias `g`) receives sigmoid(s_ij) and `rpm1` r_ij^(p-1), so no
// transcendental function is evaluated twice.
inline RowStats row_weights(const Problem& P, float n, const float* mf, const float* g, float* a,
                            int64_t e, int64_t e_blk, float* sig = nullptr,
                            float* rpm1 = nullptr) {
  RowStats st{};
  st.n = n;
  st.c = P.row_scale(n);
  const Vec cv(st.c), zero(0.f), ninf(-std::numeric_limits<float>::infinity());
  Vec zs(0.f), mx = ninf;
  for (int64_t j = 0; j < e; j += Vec::size()) {
    const int64_t cnt = std::min<int64_t>(Vec::size(), e - j);
    const Vec ok = lanes(mf, j, e);
    const Vec s = Vec::loadu(g + j, cnt) * cv;
    Vec t;
    const Vec av = Vec::blendv(zero, softplus_t(s, t), ok);  // select: masked inf/nan not read
    if (sig) sigmoid_t(s, t).store(sig + j, cnt);
    av.store(a + j, cnt);
    zs = zs + av;
    mx = at::vec::maximum(mx, av);
  }
  for (int64_t j = e; j < e_blk; ++j) a[j] = 0.f;  // causal tail of the block: never visible
  const float z = hsum(zs), a_max = hmax(mx);
  st.underflow = (z == 0.f) && (n > 0.f);
  st.z = z > 0.f ? z : 1.f;
  st.den = st.z;
  st.has = false;
  if (!P.reweight) return st;
  const Reweight rw = reweight_stats(P, n, z, a_max);
  st.big = rw.big;
  st.has = rw.has;
  if (!st.has) return st;  // no visible key, or a uniform row: LSSA weights a / Z
  st.mu = rw.mu;
  st.x_max = rw.x_max;
  const Vec inv(1.f / st.x_max), mu(st.mu);
  Vec ws(0.f), best(0.f), best_at(0.f);  // per lane: largest w so far (> 0) and its key
  for (int64_t j = 0; j < e; j += Vec::size()) {
    const int64_t cnt = std::min<int64_t>(Vec::size(), e - j);
    const Vec r = at::vec::maximum(Vec::loadu(a + j, cnt) - mu, zero) * inv;
    Vec w;
    if (rpm1) {  // r^(p-1) kept for dx; r^p from it with one multiply (as chunked does)
      const Vec rp = vpow_m1(r, P.p);
      rp.store(rpm1 + j, cnt);
      w = rp * r;
    } else {
      w = vpow(r, P.p);
    }
    if (cnt < Vec::size()) w = Vec::set(zero, w, cnt);
    w.store(a + j, cnt);
    ws = ws + w;
    if (rpm1) {  // keys as floats: exact below 2^24
      const Vec more = w > best;
      best = Vec::blendv(best, w, more);
      best_at = Vec::blendv(best_at, Vec::arange(static_cast<float>(j), 1.f), more);
    }
  }
  st.den = hsum(ws);
  if (rpm1) {  // the row has signal, so its top key has r = 1 and w > 0 in some lane
    float bw[Vec::size()], bk[Vec::size()];
    best.store(bw);
    best_at.store(bk);
    int64_t l = 0;
    for (int64_t m = 1; m < Vec::size(); ++m)
      if (bw[m] > bw[l]) l = m;
    st.top = static_cast<int64_t>(bk[l]);
  }
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

void check(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 3 &&
                  t.is_contiguous(),
              name, " must be a contiguous float32 CPU tensor [BH, T, D]");
}

}  // namespace

extern "C" void sgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b,
                       const int* ldb, const float* beta, float* c, const int* ldc);

// Row-major C[m x n] (ldc) = beta C + A[m x k] op(B): B is [n x k] (b_t: C = A B^T) or [k x n].
// BLAS directly (MKL, in libtorch_cpu): the tiled forward makes thousands of small GEMMs, and
// at::mm's dispatch would cost as much as the arithmetic.
inline void gemm(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
                 int64_t ldb, bool b_t, float beta, float* c, int64_t ldc) {
  const int M = m, N = n, K = k, LA = lda, LB = ldb, LC = ldc;
  const float one = 1.f;
  // column-major view: C^T (n x m) = op(B)^T A^T
  sgemm_(b_t ? "T" : "N", "N", &N, &M, &K, &one, b, &LB, a, &LA, &beta, c, &LC);
}

// The visibility of row i's keys k0..k0+n-1 as floats into `mf` (nullptr without a mask).
inline const float* visible_tile(const Problem& P, int64_t bh, int64_t i, int64_t k0, int64_t n,
                                 float* mf) {
  if (!P.mask) return nullptr;
  const bool* m = P.mask_row(bh, i) + k0 * P.ms_k;
  for (int64_t j = 0; j < n; ++j) mf[j] = m[j * P.ms_k] ? 1.f : 0.f;
  return mf;
}

// out [BH, T_q, Dv]; returns (out, any_underflow).
//
// Tiled over keys as well as query rows, so a block's scores, K tile and V tile stay in L2 at
// every length: LSSA in one pass (its normaliser is a plain sum, so tiles simply add up), LSSAR
// in two (Z_i and max_j a_ij over the key tiles first, then the weights r^p and their products
// with V; the scores are recomputed, one GEMM more, as docs/method.md section 5 counts).
std::tuple<at::Tensor, bool> forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const c10::optional<at::Tensor>& mask, int64_t H,
                                     bool causal, double scale, bool log_n, double p,
                                     double min_keys, double tol, int64_t rows,
                                     int64_t key_tile) {
  check(q, "q");
  check(k, "k");
  check(v, "v");
  const Problem P = make_problem(q.size(0), H, q.size(1), k.size(1), q.size(2), v.size(2), mask,
                                 causal, scale, log_n, p, min_keys, tol, rows);
  const int64_t KT = std::max<int64_t>(1, key_tile), D = P.d, DV = P.dv;
  auto out = at::zeros({P.BH, P.t_q, DV}, q.options());
  const int64_t n_blocks = (P.t_q + P.rows - 1) / P.rows;
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  std::atomic<bool> underflow{false};
  at::parallel_for(0, P.BH * n_blocks, 1, [&](int64_t begin, int64_t end) {
    const int64_t RR = P.rows;
    std::vector<float> sbuf(RR * KT), mfb(KT), c(RR), n(RR), z(RR), amax(RR), mu(RR), inv(RR),
        den(RR);
    std::vector<char> has(RR);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / n_blocks, i0 = (task % n_blocks) * RR;
      const int64_t i1 = std::min(P.t_q, i0 + RR), R = i1 - i0;
      const int64_t e_blk = P.row_end(i1 - 1);
      if (e_blk == 0) continue;
      const float* qb = qp + (bh * P.t_q + i0) * D;
      const float* kb = kp + bh * P.t_k * D;
      const float* vb = vp + bh * P.t_k * DV;
      float* ob = op + (bh * P.t_q + i0) * DV;
      for (int64_t r = 0; r < R; ++r) {
        n[r] = P.count(bh, i0 + r);
        c[r] = P.row_scale(n[r]);
        z[r] = 0.f;
        amax[r] = 0.f;
        den[r] = 0.f;
      }
      // stage 0: row statistics (and, with one key tile, the softplus values kept in sbuf);
      // 1: LSSA weights into the output; 2: LSSAR weights (from the kept values if one tile)
      const bool one_tile = e_blk <= KT;
      auto tiles = [&](int stage) {
        const Vec zero(0.f);
        for (int64_t k0 = 0; k0 < e_blk; k0 += KT) {
          const int64_t kt = std::min(KT, e_blk - k0);
          const bool kept = stage == 2 && one_tile;  // sbuf holds a_ij already
          if (!kept) gemm(R, kt, D, qb, D, kb + k0 * D, D, true, 0.f, sbuf.data(), kt);
          for (int64_t r = 0; r < R; ++r) {
            float* row = sbuf.data() + r * kt;
            const int64_t vis = std::clamp<int64_t>(P.row_end(i0 + r) - k0, 0, kt);
            const float* mf = visible_tile(P, bh, i0 + r, k0, vis, mfb.data());
            const Vec cv(c[r]), muv(mu[r]), iv(inv[r]);
            const bool rw = stage == 2 && has[r];
            Vec zs(0.f), mx(0.f);
            for (int64_t j = 0; j < vis; j += Vec::size()) {
              const int64_t cnt = std::min<int64_t>(Vec::size(), vis - j);
              const Vec ok = lanes(mf, j, vis);
              const Vec a = kept ? Vec::loadu(row + j, cnt)
                                 : Vec::blendv(zero, softplus(Vec::loadu(row + j, cnt) * cv), ok);
              if (stage == 0) {
                zs = zs + a;
                mx = at::vec::maximum(mx, a);
                if (one_tile) a.store(row + j, cnt);
              } else if (rw) {
                const Vec w = vpow(at::vec::maximum(a - muv, zero) * iv, P.p);  // 0 if masked
                w.store(row + j, cnt);
                zs = zs + Vec::set(zero, w, cnt);
              } else {
                a.store(row + j, cnt);
                zs = zs + a;
              }
            }
            for (int64_t j = vis; j < kt; ++j) row[j] = 0.f;  // causal tail: never visible
            if (stage == 0) {
              z[r] += hsum(zs);
              amax[r] = std::max(amax[r], hmax(mx));
            } else {
              den[r] += hsum(zs);
            }
          }
          if (stage != 0) gemm(R, DV, kt, sbuf.data(), kt, vb + k0 * DV, DV, false, 1.f, ob, DV);
        }
      };
      if (!P.reweight) {
        tiles(1);  // den = Z
      } else {
        tiles(0);
        for (int64_t r = 0; r < R; ++r) {
          const Reweight rw = reweight_stats(P, n[r], z[r], amax[r]);
          mu[r] = rw.mu;
          has[r] = rw.has;
          inv[r] = rw.has ? 1.f / rw.x_max : 0.f;
          if (z[r] == 0.f && n[r] > 0.f) underflow = true;
        }
        tiles(2);  // rows without `has` (uniform up to rounding) get the LSSA weights a / Z
      }
      for (int64_t r = 0; r < R; ++r) {
        if (!P.reweight && den[r] == 0.f && n[r] > 0.f) underflow = true;
        const float d = den[r] > 0.f ? den[r] : 1.f, iv = 1.f / d;
        for (int64_t x = 0; x < DV; ++x) ob[r * DV + x] *= iv;
      }
    }
  });
  return {out, underflow.load()};
}

// grad [BH, T_q, Dv] -> (dq, dk, dv, any_underflow)
std::tuple<at::Tensor, at::Tensor, at::Tensor, bool> backward(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const c10::optional<at::Tensor>& mask, int64_t H, bool causal, double scale, bool log_n,
    double p, double min_keys, double tol, int64_t rows) {
  check(grad, "grad");
  check(q, "q");
  check(k, "k");
  check(v, "v");
  const Problem P = make_problem(q.size(0), H, q.size(1), k.size(1), q.size(2), v.size(2), mask,
                                 causal, scale, log_n, p, min_keys, tol, rows);
  auto dq = at::zeros_like(q), dk = at::zeros_like(k), dvv = at::zeros_like(v);
  std::atomic<bool> underflow{false};
  const int64_t n_blocks = (P.t_q + P.rows - 1) / P.rows;
  at::parallel_for(0, P.BH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> gbuf, wbuf, dbuf, rbuf, gden, mfb(P.rows * P.t_k);
    std::vector<RowStats> stats(P.rows);
    std::vector<const float*> mfs(P.rows);
    for (int64_t bh = begin; bh < end; ++bh) {
      for (int64_t blk = 0; blk < n_blocks; ++blk) {
        const int64_t i0 = blk * P.rows, i1 = std::min(P.t_q, i0 + P.rows), R = i1 - i0;
        const int64_t e_blk = P.row_end(i1 - 1);
        if (e_blk == 0) continue;
        gbuf.resize(R * e_blk);
        wbuf.resize(R * e_blk);
        dbuf.resize(R * e_blk);
        if (P.reweight) rbuf.resize(R * e_blk);
        gden.resize(R * P.dv);
        auto G = at::from_blob(gbuf.data(), {R, e_blk}, q.options());
        auto W = at::from_blob(wbuf.data(), {R, e_blk}, q.options());
        auto DP = at::from_blob(dbuf.data(), {R, e_blk}, q.options());
        auto GD = at::from_blob(gden.data(), {R, P.dv}, q.options());
        auto qb = q[bh].narrow(0, i0, R), kb = k[bh].narrow(0, 0, e_blk),
             vb = v[bh].narrow(0, 0, e_blk);
        at::mm_out(G, qb, kb.t());
        const float* gp = grad[bh].narrow(0, i0, R).data_ptr<float>();
        for (int64_t r = 0; r < R; ++r) {
          const int64_t e = P.row_end(i0 + r);
          float n;
          mfs[r] = visible_row(P, bh, i0 + r, e, mfb.data() + r * P.t_k, n);
          float* g = gbuf.data() + r * e_blk;  // cosines in, sigmoid(s) out
          stats[r] = row_weights(P, n, mfs[r], g, wbuf.data() + r * e_blk, e, e_blk, g,
                                 P.reweight ? rbuf.data() + r * e_blk : nullptr);
          if (stats[r].underflow) underflow = true;
          const float inv = 1.f / stats[r].den;
          for (int64_t c = 0; c < P.dv; ++c) gden[r * P.dv + c] = gp[r * P.dv + c] * inv;
        }
        at::mm_out(DP, GD, vb.t());  // dP / den
        for (int64_t r = 0; r < R; ++r) {
          const RowStats& st = stats[r];
          const int64_t e = P.row_end(i0 + r);
          const float* sg = gbuf.data() + r * e_blk;  // sigmoid(s_ij), from row_weights
          const float* w = wbuf.data() + r * e_blk;
          float* dp = dbuf.data() + r * e_blk;
          const float* mf = mfs[r];
          if (st.n == 0.f) {
            std::fill(dp, dp + e_blk, 0.f);
            continue;
          }
          const bool rw = P.reweight && st.has;
          // re-weighted rows: dP - D taken about the top key's dP (chunked.py says why: a
          // nearly one-hot row would cancel dP_top against D); 0 leaves LSSA rows as they were
          const Vec shift(rw ? dp[st.top] : 0.f);
          Vec wdv(0.f);  // D_i / den from the same slab (exact cancellation on one-key rows)
          for (int64_t j = 0; j < e; j += Vec::size()) {
            const int64_t cnt = std::min<int64_t>(Vec::size(), e - j);
            wdv = wdv + Vec::loadu(w + j, cnt) * (Vec::loadu(dp + j, cnt) - shift);
          }
          const Vec D(hsum(wdv) / st.den), cv(st.c), zero(0.f);
          float fn = 0.f;
          if (rw) {  // dx = p r^(p-1) (dP - D) / x_max, stored over dp; F_i its row sum
            const Vec kp(P.p / st.x_max);
            const float* rp = rbuf.data() + r * e_blk;  // r^(p-1), 0 on masked keys
            Vec fs(0.f);
            for (int64_t j = 0; j < e; j += Vec::size()) {
              const int64_t cnt = std::min<int64_t>(Vec::size(), e - j);
              const Vec ok = lanes(mf, j, e);
              const Vec dx =
                  Vec::loadu(rp + j, cnt) * (Vec::loadu(dp + j, cnt) - shift - D) * kp;
              dx.store(dp + j, cnt);
              fs = fs + Vec::blendv(zero, dx, ok);
            }
            if (st.big) fn = hsum(fs) / std::max(st.n, 1.f);
          } else {
            for (int64_t j = 0; j < e; j += Vec::size()) {
              const int64_t cnt = std::min<int64_t>(Vec::size(), e - j);
              (Vec::loadu(dp + j, cnt) - D).store(dp + j, cnt);
            }
          }
          // dS = (dx - F_i / N_i) sigmoid(s), times c_i (so dk gets sum_i c_i dS_ij q_i)
          const Vec fv(fn);
          for (int64_t j = 0; j < e; j += Vec::size()) {
            const int64_t cnt = std::min<int64_t>(Vec::size(), e - j);
            const Vec ok = lanes(mf, j, e);
            const Vec ds = (Vec::loadu(dp + j, cnt) - fv) * Vec::loadu(sg + j, cnt) * cv;
            Vec::blendv(zero, ds, ok).store(dp + j, cnt);
          }
          for (int64_t j = e; j < e_blk; ++j) dp[j] = 0.f;
        }
        // dv += W^T (g / den); dq = (c dS) K; dk += (c dS)^T q
        dvv[bh].narrow(0, 0, e_blk).addmm_(W.t(), GD);
        auto dqb = dq[bh].narrow(0, i0, R);
        at::mm_out(dqb, DP, kb);
        dk[bh].narrow(0, 0, e_blk).addmm_(DP.t(), qb);
      }
    }
  });
  return {dq, dk, dvv, underflow.load()};
}

// out [R, DV] = W [R, kt] (row stride lda) times V [kt, DV] (row stride ldv), reading only the
// rows of V with a nonzero weight in some row of W: masked keys (and keys LSSAR zeroes) are never
// read, so padding there may hold anything, NaN included, as in the forward's select.
inline void weights_v(int64_t R, int64_t kt, const float* w, int64_t lda, const float* v,
                      int64_t ldv, int64_t DV, float* out) {
  std::fill(out, out + R * DV, 0.f);
  for (int64_t j = 0; j < kt; ++j) {
    const float* vj = v + j * ldv;
    for (int64_t r = 0; r < R; ++r) {
      const float x = w[r * lda + j];
      if (x == 0.f) continue;
      const Vec xv(x);
      float* o = out + r * DV;
      for (int64_t y = 0; y < DV; y += Vec::size()) {
        const int64_t cnt = std::min<int64_t>(Vec::size(), DV - y);
        at::vec::fmadd(xv, Vec::loadu(vj + y, cnt), Vec::loadu(o + y, cnt)).store(o + y, cnt);
      }
    }
  }
}

// n rows of d values (row stride ld) of a half-precision cache, as float32 into dst [n, d]
template <typename T>
void rows_to_float(const T* src, int64_t n, int64_t d, int64_t ld, float* dst) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t x = 0; x < d; ++x) dst[i * d + x] = static_cast<float>(src[i * ld + x]);
}

// Rows j0 .. j0 + n - 1 of head `u` (= b H + h) of a [B, H, T, d] cache as float32: the cache
// itself (float32: no copy), or the rows converted into `buf` (bf16, fp16). Returns the rows
// and their stride.
struct CacheRows {
  const char* base;
  at::ScalarType type;
  int64_t H, s0, s1, s2, d, esize;
  CacheRows(const at::Tensor& t)
      : base(static_cast<const char*>(t.data_ptr())), type(t.scalar_type()), H(t.size(1)),
        s0(t.stride(0)), s1(t.stride(1)), s2(t.stride(2)), d(t.size(3)),
        esize(t.element_size()) {}
  std::pair<const float*, int64_t> at(int64_t u, int64_t j0, int64_t n, float* buf) const {
    const char* p = base + ((u / H) * s0 + (u % H) * s1 + j0 * s2) * esize;
    if (type == at::kFloat) return {reinterpret_cast<const float*>(p), s2};
    if (type == at::kBFloat16)
      rows_to_float(reinterpret_cast<const at::BFloat16*>(p), n, d, s2, buf);
    else
      rows_to_float(reinterpret_cast<const at::Half*>(p), n, d, s2, buf);
    return {buf, d};
  }
};

// A decode step: T_q (a few) new queries of every head against a long cache of T_k keys, no
// gradient. q [B, H_q, T_q, D] float32 contiguous (unit vectors when `norm_k`); k [B, H_k, T_k, D]
// and v [B, H_k, T_k, Dv] views with unit last stride (a KV cache's buffers, read in place: no
// copy), float32, or bf16 / fp16 converted chunk by chunk as they are read; H_q = G H_k (GQA: a
// kv head's G query heads share each read of its keys).
// `norm_k`: the keys are divided by their norms here, as they are read (scaled by their largest
// magnitude first, as common.unit does), so a step reads each key once instead of normalising
// the whole cache first. Keys are cut into chunks of `chunk`, each (b, kv head, chunk) one task,
// so one head's long cache keeps every thread busy (split-K):
//   pass 1 (over K): scores by BLAS on the raw keys, the row scale and the key's inverse norm,
//     softplus kept in a [B H_k, G T_q, T_k] buffer (1/D of K's size per query row); per-chunk
//     Z_i and max_j a_ij (and, for LSSA, the chunk's A V);
//   pass 2 (over V, LSSAR only): the weights r^p from the kept values and the chunk's W V.
// Masked keys are never read into a result (scores by select, values only where a weight is
// nonzero: weights_v), so the host need not zero the padding of the cache first.
// The chunks' sums are added in chunk order. Returns (out [B, H_q, T_q, Dv], any_underflow).
std::tuple<at::Tensor, bool> decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
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
  const int64_t B = q.size(0), HQ = q.size(1), TQ = q.size(2), D = q.size(3);
  const int64_t HK = k.size(1), TK = k.size(2), DV = v.size(3);
  TORCH_CHECK(HQ % HK == 0 && k.size(0) == B && v.size(0) == B && v.size(1) == HK &&
                  v.size(2) == TK && k.size(3) == D,
              "decode: shapes of q, k, v do not agree");
  const int64_t G = HQ / HK, R = G * TQ, U = B * HK;  // rows per kv head, units (b, kv head)
  const int64_t CH = std::max<int64_t>(1, chunk), NC = (TK + CH - 1) / CH;
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
  const CacheRows keys(k), values(v);
  const bool half = kv_type != at::kFloat;
  at::parallel_for(0, U * NC, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> inv(CH), mfb(CH), kbuf(half ? CH * D : 0), vbuf(half ? CH * DV : 0);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t u = task / NC, ch = task % NC, k0 = ch * CH, kt = std::min(CH, TK - k0);
      const auto [kb, ldk] = keys.at(u, k0, kt, kbuf.data());
      float* a = ap + u * R * TK + k0;  // row r at a + r TK
      // the rows' scores on the raw keys (BLAS reads the cache in place, ldb = its row stride)
      gemm(R, kt, D, qp + u * R * D, D, kb, ldk, true, 0.f, a, TK);
      for (int64_t j = 0; j < kt; ++j) {  // 1 / ||k_j||, from the chunk just read (in cache)
        if (!norm_k) {
          inv[j] = 1.f;
          continue;
        }
        const float* kj = kb + j * ldk;
        Vec mx(0.f);
        for (int64_t x = 0; x < D; x += Vec::size())
          mx = at::vec::maximum(mx, Vec::loadu(kj + x, std::min<int64_t>(Vec::size(), D - x)).abs());
        const float big = hmax(mx);
        const bool ok = big > 0.f && std::isfinite(big);
        const Vec rb(ok ? 1.f / big : 1.f);
        Vec ss(0.f);
        for (int64_t x = 0; x < D; x += Vec::size()) {
          const Vec y = Vec::loadu(kj + x, std::min<int64_t>(Vec::size(), D - x)) * rb;
          ss = at::vec::fmadd(y, y, ss);
        }
        const float nrm = std::sqrt(hsum(ss)) * (ok ? big : 1.f);
        inv[j] = nrm > 0.f ? 1.f / nrm : 0.f;  // a zero key: cosine 0 with every query
      }
      const Vec zero(0.f);
      for (int64_t r = 0; r < R; ++r) {
        const int64_t x = u * R + r, vis = std::clamp<int64_t>(P.row_end(r % TQ) - k0, 0, kt);
        float* row = a + r * TK;
        const float* mf = visible_tile(P, bh_of(u, r), r % TQ, k0, vis, mfb.data());
        const Vec cv(c[x]);
        Vec zs(0.f), mx(0.f);
        for (int64_t j = 0; j < vis; j += Vec::size()) {
          const int64_t cnt = std::min<int64_t>(Vec::size(), vis - j);
          const Vec ik = Vec::loadu(inv.data() + j, cnt);
          // a key of norm 0 (or NaN, inf) has cosine 0, as common.unit makes it
          const Vec s = Vec::blendv(Vec::loadu(row + j, cnt) * ik * cv, zero, ik == zero);
          const Vec av = Vec::blendv(zero, softplus(s), lanes(mf, j, vis));
          av.store(row + j, cnt);
          zs = zs + av;
          mx = at::vec::maximum(mx, av);
        }
        for (int64_t j = vis; j < kt; ++j) row[j] = 0.f;  // after the row's last key
        zp[(u * NC + ch) * R + r] = hsum(zs);
        mp[(u * NC + ch) * R + r] = hmax(mx);
      }
      if (!P.reweight) {  // LSSA: this chunk's A V, normalised once every chunk's Z is known
        const auto [vb, ldv] = values.at(u, k0, kt, vbuf.data());
        weights_v(R, kt, a, TK, vb, ldv, DV, pp + (u * NC + ch) * R * DV);
      }
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
      const Vec zero(0.f);
      std::vector<float> vbuf(half ? CH * DV : 0);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t u = task / NC, ch = task % NC, k0 = ch * CH, kt = std::min(CH, TK - k0);
        float* a = ap + u * R * TK + k0;
        for (int64_t r = 0; r < R; ++r) {
          const int64_t x = u * R + r;
          float* row = a + r * TK;
          Vec ws(0.f);
          if (has[x]) {  // else a uniform row (or no key): the LSSA weights a / Z, kept as are
            const Vec muv(mu[x]), ivv(iv[x]);
            for (int64_t j = 0; j < kt; j += Vec::size()) {
              const int64_t cnt = std::min<int64_t>(Vec::size(), kt - j);
              Vec w = vpow(at::vec::maximum(Vec::loadu(row + j, cnt) - muv, zero) * ivv, P.p);
              if (cnt < Vec::size()) w = Vec::set(zero, w, cnt);
              w.store(row + j, cnt);
              ws = ws + w;
            }
          }
          dp[(u * NC + ch) * R + r] = hsum(ws);
        }
        const auto [vb, ldv] = values.at(u, k0, kt, vbuf.data());
        weights_v(R, kt, a, TK, vb, ldv, DV, pp + (u * NC + ch) * R * DV);
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward, "fused softplus-l1 attention forward (float32, CPU, key-tiled)");
  m.def("backward", &backward, "fused softplus-l1 attention backward (float32, CPU)");
  m.def("decode", &decode, "fused softplus-l1 attention for a few queries over a KV cache");
}
