// Single-pass AdamW (for-loop / foreach op sequence of torch.optim.AdamW, float32, CPU); see
// cotangent/singlepass.py. Compiled with -ffp-contract=off: the only fused multiply-adds are
// the explicit ones, where ATen's kernels have them.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <omp.h>
#include <type_traits>
#include <utility>
#include <immintrin.h>

typedef void (*sqrt_fn_t)(int64_t, const float*, float*, long long);

// Test mutants: the tests' build of this file (-DCOT_MUTANT_RUNTIME; never a shipped one) breaks,
// for each bit i set in `cot_mutant_mask` (written through ctypes), one rule on purpose where
// `MUTANT(i)` stands below, so that the tests can show the probes catch that kind of error;
// with the mask 0 it computes what the shipped build computes. In a shipped build MUTANT(i)
// is 0 and every switch folds away. 0: the scalar tail's lerp takes the vector body's
// formula; 1: the register path divides through the reciprocal; 2: the general path does; 3:
// amsgrad's maximum in the tail as in the body; 4: in the body as in the tail; 5: a NaN
// maximum stays in registers; 6: the norm fuses every tail square into its sum; 7: fused
// AdamW's inline copy forgets the NaN sign under maximize; 8: the register path drops its NaN
// flags on grad - exp_avg and on the quotient.
#ifdef COT_MUTANT_RUNTIME
extern "C" int cot_mutant_mask;
int cot_mutant_mask = 0;
#define MUTANT(i) ((cot_mutant_mask >> (i)) & 1)
#else
#define MUTANT(i) 0
#endif

namespace {

constexpr int64_t BLOCK = 16384;  // floats per array per block: 64 KiB, in L2

inline uint32_t to_bits(float x) { uint32_t u; std::memcpy(&u, &x, 4); return u; }
inline float from_bits(uint32_t u) { float x; std::memcpy(&x, &u, 4); return x; }
inline bool is_nan(float x) { return __builtin_isnan(x); }
inline float quiet(float x) { return from_bits(to_bits(x) | 0x00400000u); }

struct Hyper {
  float decay, weight, weight_m1, one_minus_weight, beta2, value2, eps, clip;
};

// Pass 1 over a block, from memory: the clip multiply (written back: the clipped gradient),
// exp_avg, exp_avg_sq (and max_exp_avg_sq, also to s: the square root's input with amsgrad),
// and the decayed parameter to pd (reading the parameter here, with the other streams, keeps
// pass 2 in cache: measured 10% less time per step than reading it there).
template <bool MAXIMIZE, bool SMALL_WEIGHT, bool AMSGRAD, bool TAIL, bool CLIP, bool DECAY>
void moments(int64_t n, float* __restrict g_, float* __restrict m_, float* __restrict v_,
             float* __restrict vmax_, float* __restrict s_, const float* __restrict p_,
             float* __restrict pd_, const Hyper& h) {
  const float w = h.weight, wm1 = h.weight_m1, omw = h.one_minus_weight;
  const float b2 = h.beta2, val = h.value2, c = h.clip, decay = h.decay;
  for (int64_t i = 0; i < n; i++) {
    pd_[i] = DECAY ? p_[i] * decay : p_[i];  // param.mul_(1 - lr * weight_decay)
    float g = g_[i];
    if (CLIP) {
      // grad.mul_(clip_coef) (clip_grad_norm_): a NaN gradient stays itself (quieted). The
      // coefficient is never NaN here: with two NaNs ATen's multiply keeps one or the other by
      // position in a pattern of its compiled loops, which no probe could pin down
      const float gc = g * c;
      g = is_nan(g) ? quiet(g) : gc;
      g_[i] = g;
    }
    if (MAXIMIZE) g = -g;
    const float m = m_[i];
    // exp_avg.lerp_(grad, w): d = end - self, then fma(w, d, self) for |w| < 0.5; otherwise the
    // vector body computes fma(w - 1, d, end) and the scalar tail -(d * (1 - w)) + end, rounded
    // once (their zero signs differ at w == 1); with two NaNs ATen keeps the gradient's
    float d = g - m;
    d = is_nan(g) ? quiet(g) : d;
    float m1 = SMALL_WEIGHT ? __builtin_fmaf(w, d, m)
               : TAIL       ? (MUTANT(0) ? __builtin_fmaf(wm1, d, g) : __builtin_fmaf(-d, omw, g))
                            : __builtin_fmaf(wm1, d, g);
    m1 = is_nan(d) ? d : m1;
    m_[i] = m1;
    // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value): fma(value * g, g, v * beta2)
    const float vb = v_[i] * b2;
    const float sg = val * g;
    float v1 = __builtin_fmaf(sg, g, vb);
    v1 = is_nan(g) ? quiet(g) : v1;
    v_[i] = v1;
    if (AMSGRAD) {
      // torch.maximum(max_exp_avg_sq, exp_avg_sq): ATen's vector body and scalar tail differ
      const float a = vmax_[i];
      const bool any_nan = is_nan(a) || is_nan(v1);
      float r;
      if (TAIL) r = any_nan ? from_bits(0x7fc00000u) : (a < v1 ? v1 : a);
      else r = any_nan ? from_bits(0xffffffffu) : (a > v1 ? a : v1);
      vmax_[i] = r;
      s_[i] = r;
    }  // without amsgrad the square root reads exp_avg_sq itself
  }
}

// Pass 2 over a block (in cache): denominator and parameter update.
void update(int64_t n, float* __restrict p_, const float* __restrict pd_,
            const float* __restrict m_, const float* __restrict r_, float bc2s, float eps,
            float nstep) {
  for (int64_t i = 0; i < n; i++) {
    const float den = r_[i] / bc2s + eps;  // (sqrt(v) / bias_correction2_sqrt).add_(eps)
    const float t = nstep * m_[i];         // addcdiv_: (value * exp_avg) / denom + param
    float q = MUTANT(2) ? t * (1.0f / den) : t / den;
    q = is_nan(t) ? t : q;
    const float p = pd_[i];
    float r = q + p;
    r = is_nan(q) ? q : r;
    p_[i] = r;
  }
}

typedef void (*moments_fn)(int64_t, float*, float*, float*, float*, float*, const float*,
                           float*, const Hyper&);

// one instantiation per combination of the flags (the loops stay branch-free: vectorised)
template <bool MX, bool SW, bool AMS, bool TL, bool CL>
moments_fn pick5(bool decay) {
  return decay ? &moments<MX, SW, AMS, TL, CL, true> : &moments<MX, SW, AMS, TL, CL, false>;
}
template <bool MX, bool SW, bool AMS, bool TL>
moments_fn pick4(bool clip, bool decay) {
  return clip ? pick5<MX, SW, AMS, TL, true>(decay) : pick5<MX, SW, AMS, TL, false>(decay);
}
template <bool MX, bool SW, bool AMS>
moments_fn pick3(bool tail, bool clip, bool decay) {
  return tail ? pick4<MX, SW, AMS, true>(clip, decay) : pick4<MX, SW, AMS, false>(clip, decay);
}
template <bool MX, bool SW>
moments_fn pick2(bool ams, bool tail, bool clip, bool decay) {
  return ams ? pick3<MX, SW, true>(tail, clip, decay) : pick3<MX, SW, false>(tail, clip, decay);
}
template <bool MX>
moments_fn pick1(bool small, bool ams, bool tail, bool clip, bool decay) {
  return small ? pick2<MX, true>(ams, tail, clip, decay)
               : pick2<MX, false>(ams, tail, clip, decay);
}
moments_fn pick(bool maximize, bool small, bool ams, bool tail, bool clip, bool decay) {
  return maximize ? pick1<true>(small, ams, tail, clip, decay)
                  : pick1<false>(small, ams, tail, clip, decay);
}

void hw_sqrt(int64_t n, const float* a, float* r) {
  for (int64_t i = 0; i < n; i++) r[i] = __builtin_sqrtf(a[i]);
}

// ---- 16 (AVX-512) or 8 (AVX2) float lanes: the operations the register path and the MKL
// square root imitation use, each one IEEE operation per lane, rounded as the MXCSR says
// (callers run them under the default MXCSR only; the AVX-512 imitation also names its
// rounding). Partial vectors (len < W) load zeros into their unused lanes and store nothing
// there.
#ifdef __AVX512F__
struct Lanes {
  typedef __m512 V;
  static constexpr int W = 16;
  static __mmask16 valid(int64_t len) {
    return len >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << len) - 1u);
  }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V bits(uint32_t u) { return _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(u))); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load_part(const float* p, int64_t len) { return _mm512_maskz_loadu_ps(valid(len), p); }
  static void store(float* p, V x) { _mm512_storeu_ps(p, x); }
  static void store_part(float* p, int64_t len, V x) { _mm512_mask_storeu_ps(p, valid(len), x); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c, rounded once
  static V xor_(V a, V b) { return _mm512_xor_ps(a, b); }
  static V sqrt(V a) { return _mm512_sqrt_ps(a); }
  // lanes where a < b (ordered): x, else y; lanes where a > b: x, else y
  static V where_lt(V a, V b, V x, V y) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_LT_OQ), y, x);
  }
  static V where_gt(V a, V b, V x, V y) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_GT_OQ), y, x);
  }
  // bit i set where lane i of a or of b is NaN
  static unsigned unordered(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q); }
  static unsigned all_lanes(int64_t len) { return valid(len); }
};
#else
struct Lanes {
  typedef __m256 V;
  static constexpr int W = 8;
  static __m256i valid(int64_t len) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(len)),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V bits(uint32_t u) { return _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(u))); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load_part(const float* p, int64_t len) { return _mm256_maskload_ps(p, valid(len)); }
  static void store(float* p, V x) { _mm256_storeu_ps(p, x); }
  static void store_part(float* p, int64_t len, V x) { _mm256_maskstore_ps(p, valid(len), x); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V xor_(V a, V b) { return _mm256_xor_ps(a, b); }
  static V sqrt(V a) { return _mm256_sqrt_ps(a); }
  static V where_lt(V a, V b, V x, V y) {
    return _mm256_blendv_ps(y, x, _mm256_cmp_ps(a, b, _CMP_LT_OQ));
  }
  static V where_gt(V a, V b, V x, V y) {
    return _mm256_blendv_ps(y, x, _mm256_cmp_ps(a, b, _CMP_GT_OQ));
  }
  static unsigned unordered(V a, V b) {
    return static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_UNORD_Q)));
  }
  static unsigned all_lanes(int64_t len) { return len >= 8 ? 0xFFu : (1u << len) - 1u; }
};
#endif

// MKL's vmsSqrt as measured on AMD EPYC CPUs (torch 2.13.0+cpu's MKL, black-box: its outputs
// for every one of the 2**32 float32 inputs, no look at its code; Zen 5 with AVX-512, and a
// 2-core "AMD EPYC" VM with AVX2 only, MKL taking its AVX2 path). For a positive normal x below
// 0x7F7FF000: the 12-bit hardware estimate r ~ 1/sqrt(x) (VRSQRTPS; the estimate table is the
// CPU's own, so this holds only where `sqrt_kind` proved it against torch.sqrt), one
// Goldschmidt step and a residual correction, every product and sum rounded on its own (no
// fused multiply-add: -ffp-contract=off, and the AVX-512 forms name their rounding):
//   s = x*r, h = 0.5*r, e = 0.5 - s*h, s = s + s*e, h = h + h*e, d = x - s*s, sqrt = s + d*h.
// Everything else is correctly rounded there (the hardware square root: zeros, positive
// subnormals, +inf, NaNs quieted with their payload, the top 4096 finite values) except
// negative numbers, which give 0x7FC00000. MKL's results ignore the caller's MXCSR (flush-to-zero
// and denormals-are-zero are off under VML_FTZDAZ_OFF; directed rounding modes give the
// round-to-nearest bytes; unmasked exceptions do not trap, measured), so this runs under the
// default MXCSR (0x1F80: round to nearest, every exception masked, no flushing) and restores
// the caller's after.
#ifdef __AVX512F__
constexpr int EMU_RN = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

// `out` where `formula` holds, elsewhere what MKL gives there: the hardware's square root of
// x (zeros, +inf, NaNs quieted with their payload, and what else the imitation leaves to it),
// 0x7FC00000 for a negative non-NaN, non-zero x (bits in [0x80000001, 0xFF800000]).
inline __m512 beside_formula(__m512 x, __mmask16 formula, __m512 out) {
  if (__builtin_expect(formula == 0xFFFF, 1)) return out;
  __m512 other = _mm512_sqrt_ps(x);
  const __mmask16 negative = _mm512_cmplt_epu32_mask(
      _mm512_sub_epi32(_mm512_castps_si512(x), _mm512_set1_epi32(static_cast<int>(0x80000001u))),
      _mm512_set1_epi32(0x7F800000));
  other = _mm512_mask_mov_ps(other, negative, _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000)));
  return _mm512_mask_mov_ps(other, formula, out);
}

inline __m512 emu_sqrt(__m512 x) {
  const __m512 half = _mm512_set1_ps(0.5f);
  const __m256 r_lo = _mm256_rsqrt_ps(_mm512_castps512_ps256(x));
  const __m256 r_hi = _mm256_rsqrt_ps(_mm512_extractf32x8_ps(x, 1));
  const __m512 r = _mm512_insertf32x8(_mm512_castps256_ps512(r_lo), r_hi, 1);
  __m512 s = _mm512_mul_round_ps(x, r, EMU_RN);
  __m512 h = _mm512_mul_round_ps(half, r, EMU_RN);
  const __m512 e = _mm512_sub_round_ps(half, _mm512_mul_round_ps(s, h, EMU_RN), EMU_RN);
  s = _mm512_add_round_ps(s, _mm512_mul_round_ps(s, e, EMU_RN), EMU_RN);
  h = _mm512_add_round_ps(h, _mm512_mul_round_ps(h, e, EMU_RN), EMU_RN);
  const __m512 d = _mm512_sub_round_ps(x, _mm512_mul_round_ps(s, s, EMU_RN), EMU_RN);
  __m512 out = _mm512_add_round_ps(s, _mm512_mul_round_ps(d, h, EMU_RN), EMU_RN);
  const __m512i bits = _mm512_castps_si512(x);
  // lanes of the formula: bits - 0x00800000 < 0x7EFFF000 (unsigned), i.e. bits in
  // [0x00800000, 0x7F7FF000)
  const __mmask16 formula = _mm512_cmplt_epu32_mask(
      _mm512_sub_epi32(bits, _mm512_set1_epi32(0x00800000)), _mm512_set1_epi32(0x7EFFF000));
  return beside_formula(x, formula, out);
}
#else
// unsigned a < b for 32-bit lanes (AVX2 compares signed: flip the sign bits)
inline __m256i lt_epu32(__m256i a, __m256i b) {
  const __m256i flip = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  return _mm256_cmpgt_epi32(_mm256_xor_si256(b, flip), _mm256_xor_si256(a, flip));
}

inline __m256 emu_sqrt(__m256 x) {  // the same formula on 8 lanes, under the default MXCSR
  const __m256 half = _mm256_set1_ps(0.5f);
  const __m256 r = _mm256_rsqrt_ps(x);
  __m256 s = _mm256_mul_ps(x, r);
  __m256 h = _mm256_mul_ps(half, r);
  const __m256 e = _mm256_sub_ps(half, _mm256_mul_ps(s, h));
  s = _mm256_add_ps(s, _mm256_mul_ps(s, e));
  h = _mm256_add_ps(h, _mm256_mul_ps(h, e));
  const __m256 d = _mm256_sub_ps(x, _mm256_mul_ps(s, s));
  __m256 out = _mm256_add_ps(s, _mm256_mul_ps(d, h));
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i formula = lt_epu32(_mm256_sub_epi32(bits, _mm256_set1_epi32(0x00800000)),
                                   _mm256_set1_epi32(0x7EFFF000));
  if (__builtin_expect(_mm256_movemask_ps(_mm256_castsi256_ps(formula)) != 0xFF, 0)) {
    __m256 other = _mm256_sqrt_ps(x);
    const __m256i negative = lt_epu32(
        _mm256_sub_epi32(bits, _mm256_set1_epi32(static_cast<int>(0x80000001u))),
        _mm256_set1_epi32(0x7F800000));
    other = _mm256_blendv_ps(other, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)),
                             _mm256_castsi256_ps(negative));
    out = _mm256_blendv_ps(other, out, _mm256_castsi256_ps(formula));
  }
  return out;
}
#endif

void emulated_mkl_sqrt(int64_t n, const float* a, float* r, long long) {
  const unsigned csr = __builtin_ia32_stmxcsr();
  // control fields (bits 6-15: DAZ, exception masks, rounding, FTZ) other than the default's
  const bool other = (csr & 0xFFC0u) != 0x1F80u;
  if (other) __builtin_ia32_ldmxcsr((csr & ~0xFFC0u) | 0x1F80u);
  constexpr int W = Lanes::W;
  int64_t i = 0;
  for (; i + W <= n; i += W) Lanes::store(r + i, emu_sqrt(Lanes::load(a + i)));
  if (i < n) Lanes::store_part(r + i, n - i, emu_sqrt(Lanes::load_part(a + i, n - i)));
  if (other) __builtin_ia32_ldmxcsr(csr);
}

#ifdef __AVX512F__
// MKL's vmsSqrt as measured on an Intel Xeon with AVX-512 (torch 2.13.0+cpu's MKL, black-box:
// its outputs for every one of the 2**32 float32 inputs): for a positive finite x, r =
// VRSQRT14PS(x) (a 14-bit estimate whose every output the instruction set defines), s = x * r
// and h = 0.5 * r each rounded, then d = fma(-s, s, x) and sqrt = fma(d, h, s), each fused;
// an x below 2**-100 (the subnormals among them) scaled by 2**64 first and the result by
// 2**-32 (both exact). Zeros, +inf and NaNs: the hardware's square root (NaNs quieted with
// their payload); negative numbers: 0x7FC00000. Like `emu_sqrt`, under the default MXCSR, and
// used only where `sqrt_kind` proved it against torch.sqrt on this machine.
inline __m512 emu14_sqrt(__m512 x0) {
  const __mmask16 tiny = _mm512_cmp_ps_mask(x0, _mm512_set1_ps(0x1p-100f), _CMP_LT_OQ);
  const __m512 x = _mm512_mask_mul_ps(x0, tiny, x0, _mm512_set1_ps(0x1p64f));
  const __m512 r = _mm512_rsqrt14_ps(x);
  const __m512 s = _mm512_mul_round_ps(x, r, EMU_RN);
  const __m512 h = _mm512_mul_round_ps(_mm512_set1_ps(0.5f), r, EMU_RN);
  const __m512 d = _mm512_fnmadd_round_ps(s, s, x, EMU_RN);
  __m512 out = _mm512_fmadd_round_ps(d, h, s, EMU_RN);
  out = _mm512_mask_mul_ps(out, tiny, out, _mm512_set1_ps(0x1p-32f));
  // lanes of the formula: bits - 1 < 0x7F7FFFFF (unsigned), i.e. bits in [1, 0x7F800000)
  const __mmask16 formula = _mm512_cmplt_epu32_mask(
      _mm512_sub_epi32(_mm512_castps_si512(x0), _mm512_set1_epi32(1)),
      _mm512_set1_epi32(0x7F7FFFFF));
  return beside_formula(x0, formula, out);
}

void emulated_mkl_sqrt14(int64_t n, const float* a, float* r, long long) {
  const unsigned csr = __builtin_ia32_stmxcsr();
  const bool other = (csr & 0xFFC0u) != 0x1F80u;
  if (other) __builtin_ia32_ldmxcsr((csr & ~0xFFC0u) | 0x1F80u);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(r + i, emu14_sqrt(_mm512_loadu_ps(a + i)));
  if (i < n) Lanes::store_part(r + i, n - i, emu14_sqrt(Lanes::load_part(a + i, n - i)));
  if (other) __builtin_ia32_ldmxcsr(csr);
}
#endif

// The square roots of the register path: 0 the hardware's, 1 `emu_sqrt`, 2 `emu14_sqrt`.
template <int EMU, typename V>
inline V root(V s) {
#ifdef __AVX512F__
  if constexpr (EMU == 2) return emu14_sqrt(s);
#endif
  if constexpr (EMU == 1) return emu_sqrt(s);
  return Lanes::sqrt(s);
}

template <int EMU>
inline void root_block(int64_t n, const float* a, float* r) {
#ifdef __AVX512F__
  if constexpr (EMU == 2) return emulated_mkl_sqrt14(n, a, r, 0);
#endif
  if constexpr (EMU == 1) return emulated_mkl_sqrt(n, a, r, 0);
  hw_sqrt(n, a, r);
}

// ---- The same step with every element's whole op sequence in registers, W lanes at a time
// (no scratch arrays between the moments, the square root and the update), for the float32
// step where the square root is the imitation under the default MXCSR or the hardware's
// (measured, 2-core AMD EPYC Zen 5, AVX-512, 2 threads: 3.3M / 19.3M elements 1.32 / 10.65 ->
// 0.81 / 5.20 ms). Where any lane of a vector meets a NaN (the gradient, clipped; grad -
// exp_avg; value * exp_avg or its quotient; with amsgrad either operand of the maximum) the
// vector is redone by the general path above, element by element: every NaN rule of the
// general path is a select that leaves a non-NaN result as it is, so on the vectors kept here
// both paths compute the same IEEE operations on the same values (no fused multiply-adds but
// the explicit ones: -ffp-contract=off).
// One vector's results to memory at offset i: the clipped gradient (with the clip), exp_avg,
// exp_avg_sq, max_exp_avg_sq (with amsgrad) and the parameter; masked stores when the vector is
// partial (len < W).
template <bool CLIP, bool AMSGRAD>
inline void store_step(int64_t i, int64_t len, float* g_, float* m_, float* v_, float* vmax_,
                       float* p_, Lanes::V g, Lanes::V m, Lanes::V v, Lanes::V vmax, Lanes::V p) {
  typedef Lanes L;
  if (len == L::W) {
    if (CLIP) L::store(g_ + i, g);
    L::store(m_ + i, m);
    L::store(v_ + i, v);
    if (AMSGRAD) L::store(vmax_ + i, vmax);
    L::store(p_ + i, p);
    return;
  }
  if (CLIP) L::store_part(g_ + i, len, g);
  L::store_part(m_ + i, len, m);
  L::store_part(v_ + i, len, v);
  if (AMSGRAD) L::store_part(vmax_ + i, len, vmax);
  L::store_part(p_ + i, len, p);
}

template <typename F>
inline void with_bool(bool b, F f) {
  if (b) f(std::true_type{}); else f(std::false_type{});
}

template <bool MAXIMIZE, bool SMALL_WEIGHT, bool AMSGRAD, bool TAIL, bool CLIP, bool DECAY,
          int EMU>
void fused(int64_t n, float* __restrict g_, float* __restrict m_, float* __restrict v_,
           float* __restrict vmax_, float* __restrict p_, const Hyper& h, float bc2s,
           float nstep, float* scratch) {
  typedef Lanes L;
  typedef L::V V;
  constexpr int W = L::W;
  const V c = L::set1(h.clip), decay = L::set1(h.decay);
  const V w = L::set1(h.weight), wm1 = L::set1(h.weight_m1);
  const V omw = L::set1(h.one_minus_weight), b2 = L::set1(h.beta2);
  const V val = L::set1(h.value2), eps = L::set1(h.eps);
  const V bc = L::set1(bc2s), ns = L::set1(nstep);
  const V sign = L::bits(0x80000000u);
  for (int64_t i = 0; i < n; i += W) {
    const int64_t len = n - i < W ? n - i : W;
    const bool full = len == W;  // masked loads and stores only for the last vector
    const V g0 = full ? L::load(g_ + i) : L::load_part(g_ + i, len);
    const V m = full ? L::load(m_ + i) : L::load_part(m_ + i, len);
    const V v = full ? L::load(v_ + i) : L::load_part(v_ + i, len);
    const V p = full ? L::load(p_ + i) : L::load_part(p_ + i, len);
    const V pd = DECAY ? L::mul(p, decay) : p;
    const V gc = CLIP ? L::mul(g0, c) : g0;
    const V g = MAXIMIZE ? L::xor_(gc, sign) : gc;
    const V d = L::sub(g, m);
    const V m1 = SMALL_WEIGHT ? L::fma(w, d, m)
                 : TAIL       ? (MUTANT(0) ? L::fma(wm1, d, g) : L::fma(L::xor_(d, sign), omw, g))
                              : L::fma(wm1, d, g);
    const V v1 = L::fma(L::mul(val, g), g, L::mul(v, b2));
    // amsgrad: torch.maximum(max_exp_avg_sq, exp_avg_sq) without NaNs (a lane with one goes to
    // the general path): the vector body keeps exp_avg_sq unless max_exp_avg_sq is greater,
    // the scalar tail keeps max_exp_avg_sq unless exp_avg_sq is greater (+0.0 vs -0.0)
    V a = v1, s = v1;
    if (AMSGRAD) {
      a = full ? L::load(vmax_ + i) : L::load_part(vmax_ + i, len);
      s = TAIL ? (MUTANT(3) ? L::where_gt(a, v1, a, v1) : L::where_lt(a, v1, v1, a))
               : (MUTANT(4) ? L::where_lt(a, v1, v1, a) : L::where_gt(a, v1, a, v1));
    }
    const V r = root<EMU>(s);
    const V den = L::add(L::div(r, bc), eps);
    const V t = L::mul(ns, m1);
    const V q = MUTANT(1) ? L::mul(t, L::div(L::set1(1.0f), den)) : L::div(t, den);
    const V p1 = L::add(q, pd);
    // (unused lanes of a partial vector hold zeros, whose quotient may be NaN: not counted)
    const unsigned nan = ((MUTANT(8) ? 0u : L::unordered(g, d) | L::unordered(t, q)) |
                          ((AMSGRAD && !MUTANT(5)) ? L::unordered(a, v1) : 0u)) &
                         L::all_lanes(len);
    if (__builtin_expect(nan != 0, 0)) {
      float* r_ = scratch + 16;
      float* pd_ = scratch + 32;
      moments<MAXIMIZE, SMALL_WEIGHT, AMSGRAD, TAIL, CLIP, DECAY>(
          len, g_ + i, m_ + i, v_ + i, AMSGRAD ? vmax_ + i : nullptr, scratch, p_ + i, pd_, h);
      const float* root_in = AMSGRAD ? scratch : v_ + i;
      root_block<EMU>(len, root_in, r_);
      update(len, p_ + i, pd_, m_ + i, r_, bc2s, h.eps, nstep);
      continue;
    }
    store_step<CLIP, AMSGRAD>(i, len, g_, m_, v_, vmax_, p_, gc, m1, v1, s, p1);
  }
}

// (the tail flag matters to the lerp's large-weight branch and to amsgrad's maximum only)
// `emu`: the square root (`root`): 0 the hardware's, 1 `emu_sqrt`, 2 `emu14_sqrt`
template <typename F>
inline void with_root(int emu, F f) {
#ifdef __AVX512F__
  if (emu == 2) return f(std::integral_constant<int, 2>{});
#endif
  if (emu == 1) f(std::integral_constant<int, 1>{}); else f(std::integral_constant<int, 0>{});
}

void fused_step(bool maximize, bool small, bool ams, bool tail, bool clip, bool decay,
                int emu, int64_t n, float* g, float* m, float* v, float* vmax, float* p,
                const Hyper& h, float bc2s, float nstep, float* scratch) {
  with_bool(maximize, [&](auto MX) { with_bool(small, [&](auto SW) {
    with_bool(ams, [&](auto AM) { with_bool(tail && (!small || ams), [&](auto TL) {
      with_bool(clip, [&](auto CL) { with_bool(decay, [&](auto DC) {
        with_root(emu, [&](auto EM) {
          fused<decltype(MX)::value, decltype(SW)::value, decltype(AM)::value,
                decltype(TL)::value, decltype(CL)::value, decltype(DC)::value,
                decltype(EM)::value>(n, g, m, v, vmax, p, h, bc2s, nstep, scratch);
        }); }); }); }); }); }); });
}

// ---- The bits of ATen's fused CPU AdamW (`torch._fused_adamw_`: `adam_math` of
// FusedAdamKernel.cpp, ADAMW mode, float32), as measured on torch 2.13.0+cpu (x86-64: its AVX2
// build runs on AVX2 and AVX512 machines alike, a vector body of 8 lanes and a scalar tail of
// the last numel % 8 elements of each tensor; its thread chunks are whole cache lines, so the
// tail does not move with the thread count). Its scalars are floats rounded from doubles, its
// square root is the hardware's (correctly rounded, not MKL's), and its compiler contracted
// two products into fused multiply-adds, in the body and the tail alike:
//   param * decay; exp_avg = fma(w, grad - exp_avg, exp_avg) for |w| < 0.5, else
//   fma(w - 1, d, grad) in the body and fma(-d, 1 - w, grad) in the tail;
//   exp_avg_sq = fma((1 - beta2) * grad, grad, exp_avg_sq * beta2);
//   denom = sqrt(exp_avg_sq) / bias_correction2_sqrt + eps;
//   param = param * decay + (-step_size * exp_avg) / denom.
// Body and tail differ where NaNs meet: maximize multiplies by -1 in the body (a NaN keeps its
// sign) and negates in the tail; amsgrad's maximum is Vectorized's `maximum` in the body (any
// NaN gives 0xFFFFFFFF; of +0.0 and -0.0 it keeps exp_avg_sq) and std::max in the tail (keeps
// max_exp_avg_sq unless exp_avg_sq is greater, so a NaN exp_avg_sq is dropped); where two NaNs
// meet in one operation the NaN kept is named at each select below (measured with the probe's
// grids). The clip multiply first, as for the other implementations.
template <bool MAXIMIZE, bool SMALL_WEIGHT, bool AMSGRAD, bool TAIL, bool CLIP, bool DECAY,
          bool INLINE>
void aten_fused_general(int64_t n, float* __restrict g_, float* __restrict m_,
                        float* __restrict v_, float* __restrict vmax_, float* __restrict p_,
                        const Hyper& h, float bc2s, float nstep) {
  const float w = h.weight, wm1 = h.weight_m1, omw = h.one_minus_weight;
  const float b2 = h.beta2, val = h.value2, coef = h.clip, decay = h.decay, eps = h.eps;
  for (int64_t i = 0; i < n; i++) {
    const float par0 = p_[i];
    const float decayed = DECAY ? par0 * decay : par0;
    float gr = g_[i];
    if (CLIP) {
      const float clipped = gr * coef;
      gr = is_nan(gr) ? quiet(gr) : clipped;
      g_[i] = gr;
    }
    if (MAXIMIZE) gr = -gr;  // (grad * -1 in the body: the compiler made it a negation)
    const float avg = m_[i];
    float diff = gr - avg;
    diff = is_nan(gr) ? quiet(gr) : diff;  // grad - exp_avg: the gradient's NaN first
    float avg1 = SMALL_WEIGHT ? __builtin_fmaf(w, diff, avg)
                 : TAIL       ? __builtin_fmaf(-diff, omw, gr)
                              : __builtin_fmaf(wm1, diff, gr);
    avg1 = is_nan(diff) ? diff : avg1;  // the difference's NaN over exp_avg's
    m_[i] = avg1;
    // exp_avg_sq: the tail's contraction is the other one, fma(exp_avg_sq, beta2, value*g*g),
    // and keeps exp_avg_sq's NaN first; the body keeps the gradient's, and under maximize the
    // copy in the parallel region keeps the sign it had before the negation
    const float sq0 = v_[i];
    const float sg = val * gr;
    float sq1 = TAIL ? __builtin_fmaf(sq0, b2, sg * gr) : __builtin_fmaf(sg, gr, sq0 * b2);
    if (TAIL) sq1 = is_nan(sq0) ? quiet(sq0) : (is_nan(gr) ? quiet(gr) : sq1);
    else sq1 = is_nan(gr) ? ((MAXIMIZE && !INLINE && !MUTANT(7)) ? quiet(-gr) : quiet(gr)) : sq1;
    v_[i] = sq1;
    float root_in = sq1;
    if (AMSGRAD) {
      const float prev = vmax_[i];
      if (TAIL) root_in = prev < sq1 ? sq1 : prev;  // std::max(max_exp_avg_sq, exp_avg_sq)
      else root_in = (is_nan(prev) || is_nan(sq1)) ? from_bits(0xffffffffu)
                                                   : (prev > sq1 ? prev : sq1);
      vmax_[i] = root_in;
    }
    const float denom = __builtin_sqrtf(root_in) / bc2s + eps;
    const float num = nstep * avg1;
    float quo = num / denom;
    quo = is_nan(num) ? num : quo;  // (-step_size * exp_avg) / denom: the numerator's NaN
    // param + quotient: the body keeps the quotient's NaN, the tail (param - step_size *
    // exp_avg / denom) the parameter's
    float out = decayed + quo;
    if (TAIL) out = is_nan(decayed) ? quiet(decayed) : (is_nan(quo) ? quo : out);
    else out = is_nan(quo) ? quo : out;
    p_[i] = out;
  }
}

// The vector body in registers, W lanes at a time: a vector where any lane meets a NaN (the
// gradient, clipped; grad - exp_avg; the decayed parameter; exp_avg_sq, or with amsgrad its
// maximum's other operand; -step_size * exp_avg or its quotient) is redone by the general path
// above, whose NaN selects leave every other lane's result as it is: so on the vectors kept
// here both compute the same IEEE operations on the same values.
template <bool MAXIMIZE, bool SMALL_WEIGHT, bool AMSGRAD, bool CLIP, bool DECAY, bool INLINE>
void aten_fused_body(int64_t n, float* __restrict g_, float* __restrict m_,
                     float* __restrict v_, float* __restrict vmax_, float* __restrict p_,
                     const Hyper& h, float bc2s, float nstep) {
  typedef Lanes L;
  typedef L::V V;
  constexpr int W = L::W;
  const V coef = L::set1(h.clip), decay = L::set1(h.decay);
  const V w = L::set1(h.weight), wm1 = L::set1(h.weight_m1), b2 = L::set1(h.beta2);
  const V val = L::set1(h.value2), eps = L::set1(h.eps);
  const V bc = L::set1(bc2s), ns = L::set1(nstep);
  const V sign = L::bits(0x80000000u);
  for (int64_t i = 0; i < n; i += W) {
    const int64_t len = n - i < W ? n - i : W;
    const bool full = len == W;
    const V raw = full ? L::load(g_ + i) : L::load_part(g_ + i, len);
    const V avg = full ? L::load(m_ + i) : L::load_part(m_ + i, len);
    const V sq = full ? L::load(v_ + i) : L::load_part(v_ + i, len);
    const V par = full ? L::load(p_ + i) : L::load_part(p_ + i, len);
    const V decayed = DECAY ? L::mul(par, decay) : par;
    const V clipped = CLIP ? L::mul(raw, coef) : raw;
    const V gr = MAXIMIZE ? L::xor_(clipped, sign) : clipped;
    const V diff = L::sub(gr, avg);
    const V avg1 = SMALL_WEIGHT ? L::fma(w, diff, avg) : L::fma(wm1, diff, gr);
    const V sq1 = L::fma(L::mul(val, gr), gr, L::mul(sq, b2));
    V prev = sq1, root_in = sq1;
    if (AMSGRAD) {
      prev = full ? L::load(vmax_ + i) : L::load_part(vmax_ + i, len);
      root_in = L::where_gt(prev, sq1, prev, sq1);  // max_exp_avg_sq where it is greater
    }
    const V denom = L::add(L::div(L::sqrt(root_in), bc), eps);
    const V num = L::mul(ns, avg1);
    const V quo = L::div(num, denom);
    const V par1 = L::add(decayed, quo);
    const unsigned nan = (L::unordered(gr, diff) | L::unordered(num, quo) |
                          L::unordered(decayed, sq1) |
                          (AMSGRAD ? L::unordered(prev, sq1) : 0u)) & L::all_lanes(len);
    if (__builtin_expect(nan != 0, 0)) {
      aten_fused_general<MAXIMIZE, SMALL_WEIGHT, AMSGRAD, false, CLIP, DECAY, INLINE>(
          len, g_ + i, m_ + i, v_ + i, AMSGRAD ? vmax_ + i : nullptr, p_ + i, h, bc2s, nstep);
      continue;
    }
    store_step<CLIP, AMSGRAD>(i, len, g_, m_, v_, vmax_, p_, clipped, avg1, sq1, root_in, par1);
  }
}

void aten_fused_step(bool maximize, bool small, bool ams, bool tail, bool clip, bool decay,
                     bool inl, int64_t n, float* gr, float* avg, float* sq, float* vmax,
                     float* par, const Hyper& h, float bc2s, float nstep) {
  with_bool(maximize, [&](auto MX) { with_bool(small, [&](auto SW) {
    with_bool(ams, [&](auto AM) { with_bool(tail, [&](auto TL) {
      with_bool(clip, [&](auto CL) { with_bool(decay, [&](auto DC) {
        with_bool(inl, [&](auto IN) {
        if (!decltype(TL)::value) {
          aten_fused_body<decltype(MX)::value, decltype(SW)::value, decltype(AM)::value,
                          decltype(CL)::value, decltype(DC)::value, decltype(IN)::value>(
              n, gr, avg, sq, vmax, par, h, bc2s, nstep);
          return;
        }
        aten_fused_general<decltype(MX)::value, decltype(SW)::value, decltype(AM)::value,
                           decltype(TL)::value, decltype(CL)::value, decltype(DC)::value,
                           decltype(IN)::value>(n, gr, avg, sq, vmax, par, h, bc2s, nstep);
      }); }); }); }); }); }); });
}

// ---- bfloat16 buffers. Each ATen op of the for-loop / foreach AdamW on bfloat16 tensors reads
// bfloat16, computes in float (the same float formulas as above) and rounds its result to
// bfloat16 (round to nearest even); a NaN result becomes 0xFFFF in the op's vector body
// (`convert_float_bfloat16`) and 0x7FC0 in its scalar tail (c10::BFloat16), except
// torch.sqrt, vectorised everywhere (0xFFFF), whose float square root is the hardware's.
inline float bf16_float(uint16_t x) { return from_bits(static_cast<uint32_t>(x) << 16); }

template <bool TAIL>
inline uint16_t to_bf16(float f) {
  if (is_nan(f)) return TAIL ? 0x7FC0 : 0xFFFF;
  const uint32_t u = to_bits(f);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

template <bool TAIL>
inline float round_bf16(float f) { return bf16_float(to_bf16<TAIL>(f)); }

template <bool MAXIMIZE, bool SMALL_WEIGHT, bool TAIL, bool DECAY>
void bf16_step(int64_t n, uint16_t* __restrict p_, const uint16_t* __restrict g_,
               uint16_t* __restrict m_, uint16_t* __restrict v_, const Hyper& h, float bc2s,
               float nstep) {
  const float w = h.weight, wm1 = h.weight_m1, omw = h.one_minus_weight;
  const float b2 = h.beta2, val = h.value2, eps = h.eps, decay = h.decay;
  for (int64_t i = 0; i < n; i++) {
    float g = bf16_float(g_[i]);
    if (MAXIMIZE) g = -g;
    float p = bf16_float(p_[i]);
    if (DECAY) p = round_bf16<TAIL>(p * decay);                 // param.mul_(decay)
    const float m = bf16_float(m_[i]);
    const float d = g - m;                                      // exp_avg.lerp_(grad, w)
    const uint16_t m1 = to_bf16<TAIL>(SMALL_WEIGHT ? __builtin_fmaf(w, d, m)
                                      : TAIL       ? (MUTANT(0) ? __builtin_fmaf(wm1, d, g)
                                                                : __builtin_fmaf(-d, omw, g))
                                                   : __builtin_fmaf(wm1, d, g));
    const float vb = round_bf16<TAIL>(bf16_float(v_[i]) * b2);  // exp_avg_sq.mul_(beta2)
    const uint16_t v1 = to_bf16<TAIL>(__builtin_fmaf(val * g, g, vb));  // .addcmul_
    const float s = round_bf16<false>(__builtin_sqrtf(bf16_float(v1)));  // .sqrt()
    const float den = round_bf16<TAIL>(round_bf16<TAIL>(s / bc2s) + eps);  // / bc2s, + eps
    m_[i] = m1;
    v_[i] = v1;
    p_[i] = to_bf16<TAIL>((nstep * bf16_float(m1)) / den + p);  // param.addcdiv_
  }
}

typedef void (*bf16_fn)(int64_t, uint16_t*, const uint16_t*, uint16_t*, uint16_t*, const Hyper&,
                        float, float);

template <bool MX, bool SW, bool TL>
bf16_fn bf16_pick3(bool decay) {
  return decay ? &bf16_step<MX, SW, TL, true> : &bf16_step<MX, SW, TL, false>;
}
template <bool MX, bool SW>
bf16_fn bf16_pick2(bool tail, bool decay) {
  return tail ? bf16_pick3<MX, SW, true>(decay) : bf16_pick3<MX, SW, false>(decay);
}
template <bool MX>
bf16_fn bf16_pick1(bool small, bool tail, bool decay) {
  return small ? bf16_pick2<MX, true>(tail, decay) : bf16_pick2<MX, false>(tail, decay);
}
bf16_fn bf16_pick(bool maximize, bool small, bool tail, bool decay) {
  return maximize ? bf16_pick1<true>(small, tail, decay) : bf16_pick1<false>(small, tail, decay);
}

// The scalars as float (c10::Scalar::to<float>()), with the lerp's derived weights.
Hyper make_hyper(double decay, double weight, double beta2, double value2, double eps,
                 double clip) {
  Hyper h;
  h.decay = static_cast<float>(decay);
  h.weight = static_cast<float>(weight);
  h.weight_m1 = h.weight - 1.0f;
  h.one_minus_weight = 1.0f - h.weight;
  h.beta2 = static_cast<float>(beta2);
  h.value2 = static_cast<float>(value2);
  h.eps = static_cast<float>(eps);
  h.clip = static_cast<float>(clip);
  return h;
}

// Runs body(piece, start, length, scratch) over every block (at most BLOCK elements) of every
// piece, the blocks split statically among nthreads OpenMP threads, each thread with
// `scratch_floats` floats of scratch memory of its own (64-byte aligned; none for 0).
template <typename Body>
void for_each_block(const int64_t* pieces, int64_t npieces, int nthreads,
                    int64_t scratch_floats, Body body) {
  int64_t total = 0;
  int64_t* first = new int64_t[npieces + 1];
  for (int64_t k = 0; k < npieces; k++) {
    first[k] = total;
    total += (pieces[4 * k + 1] + BLOCK - 1) / BLOCK;
  }
  first[npieces] = total;
  // elements before each block, so that every thread gets about the same number of elements
  // (not of blocks: many small tensors make many short blocks). Which thread updates an
  // element does not change its bits (every member computes under the same float modes,
  // checked by the caller).
  int64_t* before = new int64_t[total + 1];
  int64_t elements = 0;
  for (int64_t k = 0, b = 0; k < npieces; k++) {
    for (int64_t off = 0; off < pieces[4 * k + 1]; off += BLOCK, b++) {
      before[b] = elements;
      const int64_t left = pieces[4 * k + 1] - off;
      elements += left < BLOCK ? left : BLOCK;
    }
  }
  before[total] = elements;
#pragma omp parallel num_threads(nthreads)
  {
    float* scratch = scratch_floats ? static_cast<float*>(
        std::aligned_alloc(64, scratch_floats * sizeof(float))) : nullptr;
    const int64_t t = omp_get_thread_num(), size = omp_get_num_threads();
    // blocks [lo, hi): those whose first element lies in this thread's share of the elements
    const int64_t* lo_it = std::lower_bound(before, before + total, elements * t / size);
    const int64_t* hi_it = std::lower_bound(before, before + total, elements * (t + 1) / size);
    const int64_t lo = lo_it - before, hi = t + 1 == size ? total : hi_it - before;
    int64_t k = 0;
    for (int64_t b = lo; b < hi; b++) {
      while (first[k + 1] <= b) k++;
      while (first[k] > b) k--;
      const int64_t* pc = pieces + 4 * k;
      const int64_t off = (b - first[k]) * BLOCK;
      const int64_t len = (pc[1] - off) < BLOCK ? (pc[1] - off) : BLOCK;
      body(pc, pc[0] + off, len, scratch);
    }
    std::free(scratch);
  }
  delete[] before;
  delete[] first;
}

// ---- Per-tensor 2-norms of contiguous float32 tensors with the bits of ATen's CPU norm
// (`torch.linalg.vector_norm` / `torch._foreach_norm`, ord 2: ReduceOpsKernel.cpp's
// last-dimension fast path, whose AVX2 build runs on AVX2 and AVX512 machines alike), as
// measured on torch 2.13.0+cpu: eight lane sums of x * x, each product rounded (no fused
// multiply-add), folded left to right; then the last numel % 8 elements added one at a time,
// the products rounded for the first multiple of four of them (the compiler squared those
// four at a time) and fused into the sum for the others; then the square root. One element:
// its absolute value (the sign bit cleared, a NaN's payload kept, even a signalling one).
//
// Where two NaNs meet in an add, x86 keeps the first source's, and a compiler may swap a
// commutative add's operands as its register allocation likes (a rebuild that only added
// another function swapped some here, and 11,660 of 22,960 two-NaN tensors then had the
// other NaN than ATen's), so each add and the fused multiply-add is written in asm with the
// operand order ATen's binary has (measured against torch on every pair of positions of two
// NaNs of opposite signs in tensors of 2 to 41 elements): the lanes and the fused tail keep
// the running sum's NaN; of the four squares added one at a time, the first three keep the
// square's and the fourth the sum's.

// a + b (vaddss); where both are NaN, a's
inline float add_keep_first(float a, float b) {
  float r;
  asm("vaddss %2, %1, %0" : "=x"(r) : "x"(a), "x"(b));
  return r;
}

// sum + v * v in one rounding (vfmadd231ss, the running sum as its first operand)
inline float fma_square(float sum, float v) {
  asm("vfmadd231ss %1, %1, %0" : "+x"(sum) : "x"(v));
  return sum;
}

// acc + x[0..8) * x[0..8), the products rounded (the running sums' NaNs kept)
inline __m256 add_squares(__m256 acc, const float* x) {
  const __m256 v = _mm256_loadu_ps(x);
  const __m256 square = _mm256_mul_ps(v, v);
  asm("vaddps %1, %0, %0" : "+x"(acc) : "x"(square));
  return acc;
}

// The norm from the eight lane sums `acc` of the first `body` elements of x[0..n), n > 1.
float finish_norm2(__m256 acc, const float* x, int64_t body, int64_t n) {
  float lane[8];
  _mm256_storeu_ps(lane, acc);
  float sum = lane[0];
  for (int j = 1; j < 8; j++) sum = add_keep_first(sum, lane[j]);
  const int64_t tail = n - body, rounded = MUTANT(6) ? 0 : tail / 4 * 4;
  if (rounded == 4) {
    const float* t = x + body;
    const float s0 = t[0] * t[0], s1 = t[1] * t[1], s2 = t[2] * t[2], s3 = t[3] * t[3];
    sum = add_keep_first(s0, sum);
    sum = add_keep_first(s1, sum);
    sum = add_keep_first(s2, sum);
    sum = add_keep_first(sum, s3);
  }
  for (int64_t i = rounded; i < tail; i++) sum = fma_square(sum, x[body + i]);
  return __builtin_sqrtf(sum);
}

float aten_norm2(const float* x, int64_t n) {
  if (n == 1) return from_bits(to_bits(x[0]) & 0x7fffffffu);
  __m256 acc = _mm256_setzero_ps();
  const int64_t body = n - n % 8;
  for (int64_t d = 0; d < body; d += 8) acc = add_squares(acc, x + d);
  return finish_norm2(acc, x, body, n);
}

// `aten_norm2` of four tensors at once: each tensor's sums run in its own order, the four
// chains of dependent adds side by side (one chain waits on its add's latency: four keep the
// adder busy; the bits are each tensor's own).
void aten_norm2_four(const float* const* x, const int64_t* n, float* out) {
  int64_t body[4], common = INT64_MAX;
  for (int j = 0; j < 4; j++) {
    body[j] = n[j] > 1 ? n[j] - n[j] % 8 : 0;
    common = body[j] < common ? body[j] : common;
  }
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t d = 0; d < common; d += 8) {
    a0 = add_squares(a0, x[0] + d);
    a1 = add_squares(a1, x[1] + d);
    a2 = add_squares(a2, x[2] + d);
    a3 = add_squares(a3, x[3] + d);
  }
  __m256 acc[4] = {a0, a1, a2, a3};
  for (int j = 0; j < 4; j++) {
    if (n[j] == 1) {
      out[j] = from_bits(to_bits(x[j][0]) & 0x7fffffffu);
      continue;
    }
    for (int64_t d = common; d < body[j]; d += 8) acc[j] = add_squares(acc[j], x[j] + d);
    out[j] = finish_norm2(acc[j], x[j], body[j], n[j]);
  }
}

// out[i] = aten_norm2 of the n[i] floats at ptr[i] for i in [0, count), in one parallel region
// of nthreads: the tensors in order of length, four of like length at a time
// (`aten_norm2_four`), the groups shared dynamically. Writes each member's MXCSR into
// team[1 + member] and the team's size into team[0] (-1 with dynamic teams) where `team`.
void norms_by_four(const int64_t* ptr, const int64_t* n, int64_t count, float* out, int nthreads,
                   int* team) {
  int64_t* order = new int64_t[count];
  for (int64_t i = 0; i < count; i++) order[i] = i;
  std::sort(order, order + count, [n](int64_t a, int64_t b) { return n[a] < n[b]; });
  const int64_t groups = (count + 3) / 4;
  int size = 0;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1 || team != nullptr)
  {
    if (team != nullptr) {
      team[1 + omp_get_thread_num()] = static_cast<int>(__builtin_ia32_stmxcsr());
    }
#pragma omp single nowait
    size = omp_get_num_threads();
#pragma omp for schedule(dynamic, 1)
    for (int64_t g = groups - 1; g >= 0; g--) {  // (the longest first)
      const int64_t first = 4 * g, k = count - first < 4 ? count - first : 4;
      if (k == 4) {
        const float* x[4];
        int64_t len[4];
        float result[4];
        for (int j = 0; j < 4; j++) {
          x[j] = reinterpret_cast<const float*>(ptr[order[first + j]]);
          len[j] = n[order[first + j]];
        }
        aten_norm2_four(x, len, result);
        for (int j = 0; j < 4; j++) out[order[first + j]] = result[j];
      } else {
        for (int64_t j = first; j < first + k; j++) {
          out[order[j]] = aten_norm2(reinterpret_cast<const float*>(ptr[order[j]]), n[order[j]]);
        }
      }
    }
  }
  if (team != nullptr) team[0] = omp_get_dynamic() ? -1 : size;
  delete[] order;
}

}  // namespace

extern "C" {

// out[i] = the 2-norm of the n[i] contiguous floats at ptr[i] (`aten_norm2`), the tensors
// shared among nthreads OpenMP threads (each tensor's sum is one thread's, in ATen's order).
void cot_singlepass_norms(const int64_t* ptr, const int64_t* n, int64_t count, float* out,
                          int nthreads) {
  norms_by_four(ptr, n, count, out, nthreads, nullptr);
}

// The bfloat16 step (flags: bit0 decay, bit1 maximize; no amsgrad, no clip): base pointers,
// pieces, nstep, bc2s and the scalars as for cot_singlepass_adamw; every element is read and
// written once.
int cot_singlepass_adamw_bf16(uint16_t* const* p, uint16_t* const* g, uint16_t* const* m,
                              uint16_t* const* v, const int64_t* pieces, int64_t npieces,
                              const double* nstep, const double* bc2s, double decay,
                              double weight, double beta2, double value2, double eps, int flags,
                              int nthreads) {
  const Hyper h = make_hyper(decay, weight, beta2, value2, eps, 0.0);
  const bool has_decay = flags & 1, maximize = flags & 2;
  const bool small = __builtin_fabsf(h.weight) < 0.5f;
  for_each_block(pieces, npieces, nthreads, 0,
                 [&](const int64_t* pc, int64_t start, int64_t len, float*) {
    const int64_t k = pc[2];
    bf16_pick(maximize, small, pc[3] != 0, has_decay)(
        len, p[k] + start, g[k] + start, m[k] + start, v[k] + start, h,
        static_cast<float>(bc2s[pc[2]]), static_cast<float>(nstep[pc[2]]));
  });
  return 0;
}

int cot_singlepass_version() { return 15; }

// The float32 step counters at ptr[0..n): out[i] = step + 1 as `step_t += 1` rounds it (the
// calling thread's float modes, like ATen's one-element add), written back when `write`.
void cot_singlepass_steps(const int64_t* ptr, int64_t n, double* out, int write) {
  for (int64_t i = 0; i < n; i++) {
    float* s = reinterpret_cast<float*>(ptr[i]);
    const float t = *s + 1.0f;
    out[i] = t;
    if (write) *s = t;
  }
}

// 1 when no two of the n byte spans [start[i], start[i] + nbytes[i]) overlap (empty spans
// never do), else 0: the kernel reads and writes every tensor as its own.
int cot_singlepass_disjoint(const int64_t* start, const int64_t* nbytes, int64_t n) {
  std::pair<int64_t, int64_t>* spans = new std::pair<int64_t, int64_t>[n];
  int64_t k = 0;
  for (int64_t i = 0; i < n; i++) {
    if (nbytes[i] > 0) spans[k++] = {start[i], start[i] + nbytes[i]};
  }
  std::sort(spans, spans + k);
  int ok = 1;
  for (int64_t i = 1; i < k; i++) {
    if (spans[i].first < spans[i - 1].second) { ok = 0; break; }
  }
  delete[] spans;
  return ok;
}

// The calling thread's SSE control/status register (MXCSR): its flush-to-zero (bit 15),
// denormals-are-zero (bit 6) and rounding-mode (bits 13-14) fields change float results.
int cot_singlepass_mxcsr() { return static_cast<int>(__builtin_ia32_stmxcsr()); }

// The OpenMP team an ATen-style `#pragma omp parallel num_threads(n)` gets here (its size
// decides ATen's chunks; OMP_THREAD_LIMIT can make it smaller than n), each member's MXCSR into
// mxcsr[0..n), and whether the runtime may change team sizes (omp_get_dynamic). Returns the
// team size, or -1 with dynamic teams.
int cot_singlepass_team(int n, int* mxcsr) {
  int size = 0;
#pragma omp parallel num_threads(n)
  {
    mxcsr[omp_get_thread_num()] = static_cast<int>(__builtin_ia32_stmxcsr());
#pragma omp single
    size = omp_get_num_threads();
  }
  return omp_get_dynamic() ? -1 : size;
}

// clip_grad_norm_'s total 2-norm and clip coefficient from the per-tensor norms norms[0..n),
// into *total and *coef: total = `aten_norm2` of the norms (torch.linalg.vector_norm of their
// stack: the same last-dimension reduction; 0 for none), coef = clamp((total + 1e-6)
// .reciprocal() * max_norm, max=1.0) with ATen's float ops on 0-d float tensors, each rounded
// to float (the Python scalars converted to float first: 1e-6f, (float)max_norm) and a NaN
// kept by the clamp. The caller uses them where the norm probe proved them native's.
void cot_singlepass_clip_scalars(const float* norms, int64_t n, double max_norm, float* total,
                                 float* coef) {
  const float t = n > 0 ? aten_norm2(norms, n) : 0.0f;
  const float r = 1.0f / (t + static_cast<float>(1e-6));
  const float c = r * static_cast<float>(max_norm);
  *total = t;
  *coef = is_nan(c) ? c : (c > 1.0f ? 1.0f : c);
}

// cot_singlepass_norms and cot_singlepass_team in one parallel region: the norms into
// out[0..count), the team that computed them into team[0] (its size, or -1 with dynamic
// teams) and team[1 + i] (member i's MXCSR). The caller uses the norms only where the team
// passes the norm probe's checks (one region less per step than asking the team first).
void cot_singlepass_norms_team(const int64_t* ptr, const int64_t* n, int64_t count, float* out,
                               int nthreads, int* team) {
  norms_by_four(ptr, n, count, out, nthreads, team);
}

// The address of the MKL vmsSqrt emulation (a sqrt_fn for the kernels).
void* cot_singlepass_emulated_sqrt() { return reinterpret_cast<void*>(&emulated_mkl_sqrt); }

// The address of the VRSQRT14PS imitation (`emu14_sqrt`), null in AVX2 builds.
void* cot_singlepass_emulated_sqrt14() {
#ifdef __AVX512F__
  return reinterpret_cast<void*>(&emulated_mkl_sqrt14);
#else
  return nullptr;
#endif
}

// Square roots only (for the probe that picks the square root): r = sqrt(a) as the kernel
// computes it, in blocks like the kernel.
void cot_singlepass_sqrt(int64_t n, const float* a, float* r, void* sqrt_fn, long long mode) {
  sqrt_fn_t f = reinterpret_cast<sqrt_fn_t>(sqrt_fn);
  for (int64_t s = 0; s < n; s += BLOCK) {
    const int64_t len = (n - s) < BLOCK ? (n - s) : BLOCK;
    if (f) f(len, a + s, r + s, mode); else hw_sqrt(len, a + s, r + s);
  }
}

// p, g, m, v (and vmax with amsgrad): one base pointer per segment (a native tensor: its
// parameter, gradient, exp_avg, exp_avg_sq, max_exp_avg_sq; the caller checked they are dense,
// alike in layout and disjoint); pieces: npieces rows of (start, length, segment, tail) int64,
// start counted in elements from the segment's base; per segment: nstep[seg] is addcdiv's
// value (-step_size) and bc2s[seg] the bias_correction2_sqrt, both as doubles rounded here to
// float like c10::Scalar::to<float>(). flags: bit0 decay, bit1 maximize, bit2 amsgrad, bit3 clip
// (multiply the gradients by clip_coef first, in place, as clip_grad_norm_ does).
int cot_singlepass_adamw(float* const* p, float* const* g, float* const* m, float* const* v,
                         float* const* vmax,
                         const int64_t* pieces, int64_t npieces,
                         const double* nstep, const double* bc2s,
                         double decay, double weight, double beta2, double value2, double eps,
                         int flags, void* sqrt_fn, long long sqrt_mode, int nthreads,
                         double clip_coef) {
  const Hyper h = make_hyper(decay, weight, beta2, value2, eps, clip_coef);
  const bool has_decay = flags & 1, maximize = flags & 2, ams = flags & 4, clip = flags & 8;
  const bool small = __builtin_fabsf(h.weight) < 0.5f;  // at::native::is_lerp_weight_small
  sqrt_fn_t sq = reinterpret_cast<sqrt_fn_t>(sqrt_fn);
  if (flags & 16) {  // the bits of ATen's fused AdamW (pieces: its vector body and tail)
    for_each_block(pieces, npieces, nthreads, 0,
                   [&](const int64_t* pc, int64_t start, int64_t len, float*) {
      const int64_t k = pc[2];
      aten_fused_step(maximize, small, ams, pc[3] & 1, clip, has_decay, pc[3] & 2, len,
                      g[k] + start,
                      m[k] + start, v[k] + start, ams ? vmax[k] + start : nullptr,
                      p[k] + start, h, static_cast<float>(bc2s[k]),
                      static_cast<float>(nstep[k]));
    });
    return 0;
  }
  // scratch per thread: s (the square root's input with amsgrad), r (the roots), pd (the
  // decayed parameter)
  for_each_block(pieces, npieces, nthreads, 3 * BLOCK,
                 [&](const int64_t* pc, int64_t start, int64_t len, float* s) {
    // the register path: the imitation needs the default MXCSR (it is what it was proven
    // under; the general path switches to it around each call), the hardware's any
#ifdef __AVX512F__
    const int emu = sq == &emulated_mkl_sqrt ? 1 : sq == &emulated_mkl_sqrt14 ? 2 : 0;
#else
    const int emu = sq == &emulated_mkl_sqrt ? 1 : 0;
#endif
    const int64_t k = pc[2];
    float* const pk = p[k] + start;
    float* const gk = g[k] + start;
    float* const mk = m[k] + start;
    float* const vk = v[k] + start;
    float* const vmaxk = ams ? vmax[k] + start : nullptr;
    if (sq == nullptr || (emu && (__builtin_ia32_stmxcsr() & 0xFFC0u) == 0x1F80u)) {
      fused_step(maximize, small, ams, pc[3] != 0, clip, has_decay, emu, len, gk, mk, vk, vmaxk,
                 pk, h, static_cast<float>(bc2s[k]), static_cast<float>(nstep[k]), s);
      return;
    }
    float* r = s + BLOCK;
    float* pd = s + 2 * BLOCK;
    pick(maximize, small, ams, pc[3] != 0, clip, has_decay)(len, gk, mk, vk, vmaxk, s, pk, pd, h);
    const float* root_in = ams ? s : vk;
    if (sq) sq(len, root_in, r, sqrt_mode); else hw_sqrt(len, root_in, r);
    update(len, pk, pd, mk, r, static_cast<float>(bc2s[k]), h.eps, static_cast<float>(nstep[k]));
  });
  return 0;
}

}  // extern "C"
