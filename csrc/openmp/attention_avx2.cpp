// AVX2 + FMA + F16C build of the paged decode-attention kernel (attention_kernel.h): 16 fp32 lanes as two ymm
// registers, bf16 widened by a 16-bit shift, fp16 by vcvtph2ps, exp by a degree-6 polynomial and an exponent add.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include <omp.h>

#include "cpu_attention.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

// Enable the ISA only after every standard header, so inline code from those headers stays baseline x86-64.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

namespace apex_cpu {
namespace avx2 {

constexpr int kScoreTileHeads = 4;
constexpr int kValueTileHeads = 2;
// 16 ymm registers, two per V16: at least 4 V16 chains per tile without spilling.
constexpr int score_splits(int heads) { return heads == 1 ? 4 : heads == 2 ? 2 : 1; }
constexpr int value_tile_vecs_max(int heads) { return heads == 1 ? 4 : 2; }

struct V16 {
  __m256 lo, hi;
};

static inline V16 v_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline V16 v_set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
static inline V16 v_loadf(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void v_storef(float* p, V16 x) {
  _mm256_storeu_ps(p, x.lo);
  _mm256_storeu_ps(p + 8, x.hi);
}
static inline V16 v_load(const float* p) { return v_loadf(p); }
static inline __m256 widen_bf16(const Bf16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
static inline V16 v_load(const Bf16* p) { return {widen_bf16(p), widen_bf16(p + 8)}; }
static inline V16 v_load(const Fp16* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
static inline V16 v_fma(V16 a, V16 b, V16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
static inline V16 v_mul(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
static inline V16 v_add(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
static inline V16 v_sub(V16 a, V16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
static inline V16 v_max(V16 a, V16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
static inline float reduce8(__m256 x, bool take_max) {
  __m128 v = take_max ? _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1))
                      : _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  const __m128 swapped = _mm_movehl_ps(v, v);
  v = take_max ? _mm_max_ps(v, swapped) : _mm_add_ps(v, swapped);
  const __m128 odd = _mm_shuffle_ps(v, v, 0x55);
  v = take_max ? _mm_max_ss(v, odd) : _mm_add_ss(v, odd);
  return _mm_cvtss_f32(v);
}
static inline float v_reduce_max(V16 a) { return reduce8(_mm256_max_ps(a.lo, a.hi), true); }
static inline float v_reduce_add(V16 a) { return reduce8(_mm256_add_ps(a.lo, a.hi), false); }
static inline void v_prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }

// exp(x) = 2^n * e^r with n = round(x / ln 2), r = x - n ln 2 (two-part ln 2), e^r by its degree-6 Taylor
// polynomial (relative error < 2e-7); 2^n built in the exponent field. x < -87.3 (incl. -inf) gives 0.
static inline __m256 exp8(__m256 x) {
  const __m256 low = _mm256_set1_ps(-87.3f);
  const __m256 clamped = _mm256_min_ps(_mm256_set1_ps(88.3f), _mm256_max_ps(low, x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(clamped, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), clamped);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 result = _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
  return _mm256_blendv_ps(result, _mm256_setzero_ps(), _mm256_cmp_ps(x, low, _CMP_LT_OQ));
}
static inline V16 v_exp(V16 x) { return {exp8(x.lo), exp8(x.hi)}; }

}  // namespace avx2
}  // namespace apex_cpu

#define APEX_ISA_NS avx2
#include "attention_kernel.h"
#undef APEX_ISA_NS

namespace apex_cpu {

void paged_attention_avx2(const PagedAttentionArgs& args, const WorkPlanView& plan) { avx2::run_dtype(args, plan); }
void paged_attention_item_avx2(const PagedAttentionArgs& args, const WorkPlanView& plan, int64_t item, int thread) {
  avx2::run_item_dtype(args, plan, item, thread);
}

}  // namespace apex_cpu

#if defined(__clang__)
#pragma clang attribute pop
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif

#else  // not x86-64: only the portable kernel exists; isa_compiled(Isa::Avx2) is false.

namespace apex_cpu {

void paged_attention_avx2(const PagedAttentionArgs&, const WorkPlanView&) { std::abort(); }
void paged_attention_item_avx2(const PagedAttentionArgs&, const WorkPlanView&, int64_t, int) { std::abort(); }

}  // namespace apex_cpu

#endif
