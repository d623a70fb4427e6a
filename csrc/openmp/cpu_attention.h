// Plain C++ interface between the torch-facing op file (cpu_ops.cpp) and the kernel translation units.
//
// Nothing here includes torch headers: the kernel files are compiled with different target ISAs, and keeping
// torch's inline functions and templates out of them means no ISA-specific copy of a shared (ODR) symbol can
// leak into the rest of the library.
//
// KV cache layout (shared with the GPU pool, see notes/CONVENTIONS.md): key_cache and value_cache are contiguous
// with logical shape [num_blocks, num_kv_heads, block_size, head_dim]. V is stored as its logical shape
// (token-major rows of head_dim). K is stored inside each (block, kv_head) slab of block_size * head_dim
// elements in 16-token panels, transposed: element (token t, dim d) lives at ((t / 16) * head_dim + d) * 16 +
// t % 16, so one 16-lane vector load gives dim d of 16 consecutive tokens.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

namespace apex_cpu {

constexpr int kPanelTokens = 16;  // tokens per transposed K panel; also the fp32 vector width used by kernels
constexpr int kMaxHeadDim = 256;
constexpr int kSegmentTokens = 128;  // tokens per online-softmax step (unless a block is larger)
constexpr int kMaxSegmentPieces = kSegmentTokens / kPanelTokens;

// Tokens per online-softmax step: kSegmentTokens, or one whole block when blocks are larger.
static inline int segment_capacity(int block_size) {
  return block_size > kSegmentTokens ? block_size : kSegmentTokens;
}

enum class DType : int { F32 = 0, BF16 = 1, F16 = 2 };
enum class Isa : int { Scalar = 0, Avx2 = 1, Avx512 = 2 };

// 16-bit storage types, distinguished so that overloads pick the right conversion.
struct Bf16 {
  uint16_t bits;
};
struct Fp16 {
  uint16_t bits;
};

static inline float to_float(float x) { return x; }

static inline float to_float(Bf16 x) {
  uint32_t u = uint32_t(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

static inline float to_float(Fp16 x) {
  const uint32_t sign = uint32_t(x.bits & 0x8000u) << 16;
  const uint32_t exponent = (x.bits >> 10) & 0x1fu;
  const uint32_t mantissa = x.bits & 0x3ffu;
  uint32_t u;
  if (exponent == 0x1f) {
    u = sign | 0x7f800000u | (mantissa << 13);  // inf / NaN
  } else if (exponent == 0) {
    const float magnitude = float(mantissa) * 5.9604644775390625e-8f;  // subnormal: mantissa * 2^-24
    return sign ? -magnitude : magnitude;
  } else {
    u = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  }
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

template <class E>
static inline E from_float(float x);

template <>
inline float from_float<float>(float x) {
  return x;
}

// Round to nearest even; NaN stays NaN.
template <>
inline Bf16 from_float<Bf16>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return Bf16{uint16_t((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return Bf16{uint16_t(u >> 16)};
}

// Round to nearest even, overflow to inf, subnormals kept; NaN stays NaN.
template <>
inline Fp16 from_float<Fp16>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  uint32_t magnitude = u & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return Fp16{uint16_t(sign | 0x7e00u)};
  if (magnitude >= 0x477ff000u) return Fp16{uint16_t(sign | 0x7c00u)};  // >= 65520 rounds to inf
  if (magnitude < 0x38800000u) {  // below 2^-14: half subnormal (or zero)
    float value;
    std::memcpy(&value, &magnitude, sizeof(value));
    // Adding 0.5 leaves an ulp of 2^-24 (the half subnormal step), so the float add rounds to nearest even.
    const float rounded = value + 0.5f;
    uint32_t r;
    std::memcpy(&r, &rounded, sizeof(r));
    return Fp16{uint16_t(sign | (r - 0x3f000000u))};
  }
  magnitude += 0xfffu + ((magnitude >> 13) & 1u);
  return Fp16{uint16_t(sign | ((magnitude - (112u << 23)) >> 13))};
}

// Everything the attention kernel needs, as raw pointers; strides are in elements.
struct PagedAttentionArgs {
  DType dtype;
  const void* query;  // [num_seqs, num_heads, head_dim], last dim contiguous
  int64_t query_seq_stride;
  int64_t query_head_stride;
  const void* key_cache;    // see the layout note at the top
  const void* value_cache;  // [num_blocks, num_kv_heads, block_size, head_dim]
  const int32_t* block_tables;  // [num_seqs, block_table_stride]
  int64_t block_table_stride;
  const int32_t* context_lens;  // [num_seqs], each >= 1, validated by the caller
  void* out;                    // [num_seqs, num_heads, head_dim], contiguous
  int num_seqs;
  int num_heads;
  int num_kv_heads;
  int head_dim;
  int block_size;
  float scale;
  // Several caches of one geometry (e.g. every layer's) in one call: when cache_index is set, sequence s reads
  // key_caches[cache_index[s]] / value_caches[cache_index[s]] instead of key_cache / value_cache.
  const void* const* key_caches = nullptr;
  const void* const* value_caches = nullptr;
  const int32_t* cache_index = nullptr;
  // When set, sequence s reads query row rows[s] and writes output row rows[s] (out then holds at least
  // max(rows) + 1 rows): the staggered job attends the rows in use of its staged buffer in place.
  const int64_t* rows = nullptr;
};

// One unit of parallel work: all query heads of one kv head of one sequence over tokens [token_begin,
// token_end) (token_begin a multiple of 16). partial_index < 0: the item covers the whole context and writes
// the output; otherwise it writes partial results (acc, max, sum) to that slot for a log-sum-exp merge.
struct WorkItem {
  int32_t seq;
  int32_t kv_head;
  int32_t token_begin;
  int32_t token_end;
  int32_t partial_index;
  int32_t merge_index;  // the MergeTask its partial belongs to (-1 with partial_index)
};

// Merges partial slots [first_partial, first_partial + num_partials) into the output of (seq, kv_head).
struct MergeTask {
  int32_t seq;
  int32_t kv_head;
  int32_t first_partial;
  int32_t num_partials;
};

// The work split of one call (built by plan_work on the caller's side).
struct WorkPlan {
  std::vector<WorkItem> items;  // largest first, for dynamic scheduling
  std::vector<MergeTask> merges;
  int64_t num_partials = 0;
  int max_splits = 1;   // most partial slots merged into one (seq, kv_head)
  int num_threads = 1;  // threads worth waking for this call (<= the threads allowed, <= items)
};

// Parameters of the work split (process-wide; set_work_plan_params exists for tuning sweeps):
//   items_per_thread  each piece is the work not yet cut over threads * items_per_thread (guided schedule),
//   min_item_bytes    smallest piece of one (seq, kv_head) worth its own item (K+V bytes),
//   min_thread_bytes  K+V bytes below which one more thread costs more (waking it, joining it) than it reads.
struct WorkPlanParams {
  int64_t items_per_thread;
  int64_t min_item_bytes;
  int64_t min_thread_bytes;
};
WorkPlanParams work_plan_params();
void set_work_plan_params(const WorkPlanParams& params);

// Splits the work of one call by KV bytes: picks the thread count (at most max_threads, at least
// min_thread_bytes of K+V per thread), then cuts every (seq, kv_head) into pieces that shrink as the cut proceeds
// (see WorkPlanParams), none smaller than min_item_bytes (or than one panel).
// kv_bytes_per_token counts K and V of one kv head.
WorkPlan plan_work(const int32_t* context_lens, int num_seqs, int num_kv_heads, int64_t kv_bytes_per_token,
                   int max_threads);

// Offsets (in floats, 16-float aligned) of one thread's scratch areas.
struct ScratchLayout {
  int64_t query;    // group * head_dim: scaled fp32 query rows
  int64_t scores;   // group * segment_capacity(block_size): scores, then probabilities, of one segment
  int64_t acc;      // group * head_dim: un-normalised output accumulators
  int64_t max;      // group: running max score
  int64_t sum;      // group: running sum of exp(score - max)
  int64_t alpha;    // group: rescale factor of the current block
  int64_t weights;  // max_splits: merge weights
  int64_t total;
};

static inline int64_t round_up_16(int64_t n) { return (n + 15) / 16 * 16; }

static inline ScratchLayout scratch_layout(int group, int head_dim, int block_size, int max_splits) {
  ScratchLayout s;
  s.query = 0;
  s.scores = s.query + round_up_16(int64_t(group) * head_dim);
  s.acc = s.scores + round_up_16(int64_t(group) * segment_capacity(block_size));
  s.max = s.acc + round_up_16(int64_t(group) * head_dim);
  s.sum = s.max + round_up_16(group);
  s.alpha = s.sum + round_up_16(group);
  s.weights = s.alpha + round_up_16(group);
  s.total = s.weights + round_up_16(max_splits);
  return s;
}

// A WorkPlan as raw pointers, with the float scratch the kernels need (allocated by the caller).
struct WorkPlanView {
  const WorkItem* items;
  int64_t num_items;
  const MergeTask* merges;
  int64_t num_merges;
  ScratchLayout scratch;  // of one thread
  int num_threads;
  float* thread_scratch;  // num_threads * scratch.total floats, 64-byte aligned
  float* partials;        // num_partials * group * (head_dim + 2): acc rows, then max, then sum
  // Per merge task, its partials not yet written (starts at num_partials): the item that writes the last one
  // merges them, so no thread waits at a barrier for the merges.
  std::atomic<int32_t>* merge_pending;
  // The caller is already inside a parallel region of num_threads threads, all of which call the kernel: the
  // items are shared out by an orphaned worksharing loop instead of a parallel region of the kernel's own.
  bool in_team = false;
};

// Kernels, one per ISA; the AVX ones exist only on x86-64 builds (isa_compiled tells).
void paged_attention_scalar(const PagedAttentionArgs& args, const WorkPlanView& plan);
void paged_attention_avx2(const PagedAttentionArgs& args, const WorkPlanView& plan);
void paged_attention_avx512(const PagedAttentionArgs& args, const WorkPlanView& plan);
// Item `item` of the plan by the calling thread, with the scratch of thread `thread` of plan.num_threads (a caller
// that shares the items out itself), and its merge if it wrote the last partial of its (seq, kv_head).
void paged_attention_item_scalar(const PagedAttentionArgs& args, const WorkPlanView& plan, int64_t item, int thread);
void paged_attention_item_avx2(const PagedAttentionArgs& args, const WorkPlanView& plan, int64_t item, int thread);
void paged_attention_item_avx512(const PagedAttentionArgs& args, const WorkPlanView& plan, int64_t item, int thread);

bool isa_compiled(Isa isa);
bool cpu_supports(Isa isa);

// Writes key/value rows [num_tokens, num_kv_heads, head_dim] (last dim contiguous) into the caches at
// slot_mapping; negative slots are skipped. Slots are validated by the caller.
struct CacheAppendArgs {
  int element_size;  // 2 or 4 bytes; the copy is bit-exact, so only the size matters
  const void* key;
  int64_t key_token_stride;
  int64_t key_head_stride;
  const void* value;
  int64_t value_token_stride;
  int64_t value_head_stride;
  void* key_cache;
  void* value_cache;
  const int64_t* slot_mapping;
  int64_t num_tokens;
  int num_kv_heads;
  int head_dim;
  int block_size;
  int num_threads;
  // As in PagedAttentionArgs: when cache_index is set, token t goes to the caches numbered cache_index[t].
  void* const* key_caches = nullptr;
  void* const* value_caches = nullptr;
  const int32_t* cache_index = nullptr;
  // When set, token t reads key/value row rows[t] (as PagedAttentionArgs::rows).
  const int64_t* rows = nullptr;
  // As WorkPlanView::in_team: every thread of the enclosing parallel region calls cache_append, which shares the
  // rows out and ends at a barrier (an attention after it reads what other threads appended).
  bool in_team = false;
};

void cache_append(const CacheAppendArgs& args);
// Row `row` (token * num_kv_heads + kv_head) of an append, by the calling thread alone.
void cache_append_row(const CacheAppendArgs& args, int64_t row);

}  // namespace apex_cpu
