// Portable build of the paged decode-attention kernel (attention_kernel.h): 16 fp32 lanes as a plain array that
// the compiler vectorises for the baseline ISA (SSE2 on x86-64, NEON on AArch64); exp is std::exp.
#include <cmath>
#include <cstdint>
#include <cstring>

#include <omp.h>

#include "cpu_attention.h"

namespace apex_cpu {
namespace scalar {

constexpr int kScoreTileHeads = 4;
constexpr int kValueTileHeads = 2;
constexpr int score_splits(int heads) { return heads == 1 ? 4 : heads == 2 ? 2 : 1; }
constexpr int value_tile_vecs_max(int heads) { return heads == 1 ? 4 : 2; }

struct V16 {
  float x[kPanelTokens];
};

static inline V16 v_zero() {
  V16 r;
  for (int i = 0; i < kPanelTokens; ++i) r.x[i] = 0.0f;
  return r;
}
static inline V16 v_set1(float s) {
  V16 r;
  for (int i = 0; i < kPanelTokens; ++i) r.x[i] = s;
  return r;
}
static inline V16 v_loadf(const float* p) {
  V16 r;
  std::memcpy(r.x, p, sizeof(r.x));
  return r;
}
static inline void v_storef(float* p, V16 a) { std::memcpy(p, a.x, sizeof(a.x)); }
template <class E>
static inline V16 v_load(const E* p) {
  V16 r;
  for (int i = 0; i < kPanelTokens; ++i) r.x[i] = to_float(p[i]);
  return r;
}
static inline V16 v_fma(V16 a, V16 b, V16 c) {
  for (int i = 0; i < kPanelTokens; ++i) c.x[i] += a.x[i] * b.x[i];
  return c;
}
static inline V16 v_mul(V16 a, V16 b) {
  for (int i = 0; i < kPanelTokens; ++i) a.x[i] *= b.x[i];
  return a;
}
static inline V16 v_add(V16 a, V16 b) {
  for (int i = 0; i < kPanelTokens; ++i) a.x[i] += b.x[i];
  return a;
}
static inline V16 v_sub(V16 a, V16 b) {
  for (int i = 0; i < kPanelTokens; ++i) a.x[i] -= b.x[i];
  return a;
}
static inline V16 v_max(V16 a, V16 b) {
  for (int i = 0; i < kPanelTokens; ++i) a.x[i] = b.x[i] > a.x[i] ? b.x[i] : a.x[i];
  return a;
}
static inline float v_reduce_max(V16 a) {
  float m = a.x[0];
  for (int i = 1; i < kPanelTokens; ++i) m = a.x[i] > m ? a.x[i] : m;
  return m;
}
static inline float v_reduce_add(V16 a) {
  float s = 0.0f;
  for (int i = 0; i < kPanelTokens; ++i) s += a.x[i];
  return s;
}
static inline V16 v_exp(V16 a) {
  for (int i = 0; i < kPanelTokens; ++i) a.x[i] = std::exp(a.x[i]);
  return a;
}
static inline void v_prefetch(const void* p) {
#if defined(__GNUC__)
  __builtin_prefetch(p, 0, 2);  // read, keep in L2 (like prefetcht1)
#else
  (void)p;
#endif
}

}  // namespace scalar
}  // namespace apex_cpu

#define APEX_ISA_NS scalar
#include "attention_kernel.h"
#undef APEX_ISA_NS

namespace apex_cpu {

void paged_attention_scalar(const PagedAttentionArgs& args, const WorkPlanView& plan) {
  scalar::run_dtype(args, plan);
}

void paged_attention_item_scalar(const PagedAttentionArgs& args, const WorkPlanView& plan, int64_t item,
                                 int thread) {
  scalar::run_item_dtype(args, plan, item, thread);
}

}  // namespace apex_cpu
