// AVX-512 build of the paged decode-attention kernel (attention_kernel.h): 16 fp32 lanes in one zmm register,
// bf16 widened by a 16-bit shift, fp16 by vcvtph2ps, exp by a degree-6 polynomial and vscalefps.
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
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))), \
                             apply_to = function)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#endif

namespace apex_cpu {
namespace avx512 {

constexpr int kScoreTileHeads = 8;
constexpr int kValueTileHeads = 4;
// 32 zmm registers: at least 8 independent FMA chains (4-cycle latency, 2 FMA ports) in every tile.
constexpr int score_splits(int heads) { return heads == 1 ? 8 : heads == 2 ? 4 : heads == 3 ? 4 : 2; }
constexpr int value_tile_vecs_max(int heads) { return heads <= 2 ? 8 : 4; }

struct V16 {
  __m512 v;
};

static inline V16 v_zero() { return {_mm512_setzero_ps()}; }
static inline V16 v_set1(float x) { return {_mm512_set1_ps(x)}; }
static inline V16 v_loadf(const float* p) { return {_mm512_loadu_ps(p)}; }
static inline void v_storef(float* p, V16 x) { _mm512_storeu_ps(p, x.v); }
static inline V16 v_load(const float* p) { return {_mm512_loadu_ps(p)}; }
static inline V16 v_load(const Bf16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16))};
}
static inline V16 v_load(const Fp16* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
static inline V16 v_fma(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
static inline V16 v_mul(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
static inline V16 v_add(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
static inline V16 v_sub(V16 a, V16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
static inline V16 v_max(V16 a, V16 b) { return {_mm512_max_ps(a.v, b.v)}; }
static inline float v_reduce_max(V16 a) { return _mm512_reduce_max_ps(a.v); }
static inline float v_reduce_add(V16 a) { return _mm512_reduce_add_ps(a.v); }
static inline void v_prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }

// exp(x) = 2^n * e^r with n = round(x / ln 2), r = x - n ln 2 (two-part ln 2), e^r by its degree-6 Taylor
// polynomial (|r| <= ln2 / 2, relative error < 2e-7); vscalefps applies 2^n with correct under/overflow.
// x is clamped below at -104 so that exp(-inf) = 0 exactly; NaN propagates.
static inline V16 v_exp(V16 x) {
  const __m512 clamped = _mm512_min_ps(_mm512_set1_ps(88.7f), _mm512_max_ps(_mm512_set1_ps(-104.0f), x.v));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(clamped, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), clamped);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return {_mm512_scalef_ps(p, n)};
}

}  // namespace avx512
}  // namespace apex_cpu

#define APEX_ISA_NS avx512
#include "attention_kernel.h"
#undef APEX_ISA_NS

namespace apex_cpu {

void paged_attention_avx512(const PagedAttentionArgs& args, const WorkPlanView& plan) {
  avx512::run_dtype(args, plan);
}

void paged_attention_item_avx512(const PagedAttentionArgs& args, const WorkPlanView& plan, int64_t item,
                                 int thread) {
  avx512::run_item_dtype(args, plan, item, thread);
}

}  // namespace apex_cpu

#if defined(__clang__)
#pragma clang attribute pop
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif

#else  // not x86-64: only the portable kernel exists; isa_compiled(Isa::Avx512) is false.

namespace apex_cpu {

void paged_attention_avx512(const PagedAttentionArgs&, const WorkPlanView&) { std::abort(); }
void paged_attention_item_avx512(const PagedAttentionArgs&, const WorkPlanView&, int64_t, int) { std::abort(); }

}  // namespace apex_cpu

#endif
