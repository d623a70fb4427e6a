// Torch-facing side of the CPU ops: argument validation, ISA selection, tensor -> raw pointer, and the CPU
// kernel registrations for the schemas defined in apex_compile/ops/cpu_attention.py (namespace `apex`).
// The kernels themselves (cpu_attention.h and the attention_*.cpp / cache_append.cpp files) never see torch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif

#include "cpu_attention.h"

namespace {

using apex_cpu::Isa;

// Error messages are assembled here (std::to_string, string concatenation) and handed to TORCH_CHECK as one
// string: with torch 2.11 on the GPU machine, TORCH_CHECK messages formatting integers through c10::str
// crashed the process (segfault) instead of raising, while single-string messages raised correctly.
inline std::string message_part(const char* text) { return text; }
inline std::string message_part(const std::string& text) { return text; }
inline std::string message_part(int64_t value) { return std::to_string(value); }
inline std::string message_part(int32_t value) { return std::to_string(value); }
inline std::string message_part(at::ScalarType type) { return c10::toString(type); }
inline std::string message_part(const c10::Device& device) { return device.str(); }

template <class... Parts>
std::string message(const Parts&... parts) {
  std::string text;
  (text.append(message_part(parts)), ...);
  return text;
}

#define APEX_CHECK(cond, ...)                        \
  do {                                               \
    if (!(cond)) {                                   \
      TORCH_CHECK(false, message(__VA_ARGS__));      \
    }                                                \
  } while (false)

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::Avx512: return "avx512";
    case Isa::Avx2: return "avx2";
    case Isa::Scalar: return "scalar";
  }
  return "?";
}

// The kernel path for this call: APEX_CPU_ISA=avx512|avx2|scalar forces one (an error if this CPU or build
// lacks it); unset, empty or "auto" picks the best this CPU supports. Read on every call so tests can switch.
Isa select_isa() {
  const char* forced = std::getenv("APEX_CPU_ISA");
  const std::string name = forced != nullptr ? forced : "";
  if (name.empty() || name == "auto") {
    for (Isa isa : {Isa::Avx512, Isa::Avx2}) {
      if (apex_cpu::cpu_supports(isa)) return isa;
    }
    return Isa::Scalar;
  }
  for (Isa isa : {Isa::Avx512, Isa::Avx2, Isa::Scalar}) {
    if (name == isa_name(isa)) {
      APEX_CHECK(apex_cpu::cpu_supports(isa), "APEX_CPU_ISA=", name, " but this ",
                 apex_cpu::isa_compiled(isa) ? "CPU does not support it" : "build does not include it");
      return isa;
    }
  }
  APEX_CHECK(false, "APEX_CPU_ISA=", name, " is not one of avx512, avx2, scalar, auto");
}

apex_cpu::DType kernel_dtype(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return apex_cpu::DType::F32;
    case at::kBFloat16: return apex_cpu::DType::BF16;
    case at::kHalf: return apex_cpu::DType::F16;
    default: APEX_CHECK(false, "apex CPU ops support float32, bfloat16 and float16, got ", type);
  }
}

// "[d0, d1, ...]" of a tensor's shape, for error messages.
std::string shape_of(const at::Tensor& t) {
  std::string text = "[";
  for (int64_t i = 0; i < t.dim(); ++i) text += (i ? ", " : "") + std::to_string(t.size(i));
  return text + "]";
}

void check_cpu(const at::Tensor& t, const char* name) {
  APEX_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got device ", t.device());
}

// Checks the KV cache pair and returns (num_blocks, num_kv_heads, block_size, head_dim).
std::array<int64_t, 4> check_caches(const at::Tensor& key_cache, const at::Tensor& value_cache) {
  check_cpu(key_cache, "key_cache");
  check_cpu(value_cache, "value_cache");
  APEX_CHECK(key_cache.dim() == 4, "key_cache must be [num_blocks, num_kv_heads, block_size, head_dim], got ",
             shape_of(key_cache));
  APEX_CHECK(value_cache.sizes() == key_cache.sizes(), "value_cache shape ", shape_of(value_cache),
             " differs from key_cache shape ", shape_of(key_cache));
  APEX_CHECK(value_cache.scalar_type() == key_cache.scalar_type(), "value_cache dtype ",
             value_cache.scalar_type(), " differs from key_cache dtype ", key_cache.scalar_type());
  kernel_dtype(key_cache.scalar_type());
  APEX_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "key_cache and value_cache must be contiguous");
  const int64_t block_size = key_cache.size(2);
  const int64_t head_dim = key_cache.size(3);
  APEX_CHECK(block_size >= 16 && block_size <= 256 && (block_size & (block_size - 1)) == 0,
             "block_size must be a power of two in 16..256, got ", block_size);
  APEX_CHECK(head_dim >= 16 && head_dim <= apex_cpu::kMaxHeadDim && head_dim % 16 == 0,
             "head_dim must be a multiple of 16 in 16..256, got ", head_dim);
  APEX_CHECK(key_cache.size(1) >= 1, "num_kv_heads must be >= 1");
  return {key_cache.size(0), key_cache.size(1), block_size, head_dim};
}

// Checks a list of cache pairs of one geometry and dtype and the int32 [count] index picking one per row;
// returns the geometry and fills the raw pointers.
std::array<int64_t, 4> check_cache_list(at::TensorList key_caches, at::TensorList value_caches,
                                        const at::Tensor& cache_index, int64_t count, std::vector<void*>& keys,
                                        std::vector<void*>& values) {
  APEX_CHECK(!key_caches.empty() && key_caches.size() == value_caches.size(),
             "key_caches and value_caches must be non-empty lists of one length, got ", int64_t(key_caches.size()),
             " and ", int64_t(value_caches.size()));
  const std::array<int64_t, 4> geometry = check_caches(key_caches[0], value_caches[0]);
  for (size_t i = 0; i < key_caches.size(); ++i) {
    APEX_CHECK(check_caches(key_caches[i], value_caches[i]) == geometry &&
                   key_caches[i].scalar_type() == key_caches[0].scalar_type(),
               "every cache must have the shape and dtype of the first: cache ", int64_t(i), " is ",
               shape_of(key_caches[i]), " ", key_caches[i].scalar_type());
    keys.push_back(key_caches[i].data_ptr());
    values.push_back(value_caches[i].data_ptr());
  }
  check_cpu(cache_index, "cache_index");
  APEX_CHECK(cache_index.scalar_type() == at::kInt && cache_index.dim() == 1 && cache_index.size(0) == count,
             "cache_index must be int32 [", count, "], got ", cache_index.scalar_type(), " ", shape_of(cache_index));
  APEX_CHECK(cache_index.is_contiguous(), "cache_index must be contiguous");
  const int32_t* index = cache_index.data_ptr<int32_t>();
  for (int64_t i = 0; i < count; ++i) {
    APEX_CHECK(index[i] >= 0 && index[i] < int64_t(key_caches.size()), "cache_index[", i, "] = ", index[i],
               " is out of range for ", int64_t(key_caches.size()), " caches");
  }
  return geometry;
}

// One attention call checked and planned, ready to run (`run_attention`): the tensors it reads are held here.
struct AttentionCall {
  apex_cpu::PagedAttentionArgs args;
  apex_cpu::WorkPlan plan;
  apex_cpu::WorkPlanView view;
  Isa isa = Isa::Scalar;
  at::Tensor query, tables, lens, scratch;
  std::unique_ptr<std::atomic<int32_t>[]> merge_pending;
};

// Rows [begin, end) of an attention's metadata: each attends to at least one token, and the blocks its context
// needs lie in its block_tables row and in the cache.
void check_context_rows(const int32_t* lens, const int32_t* tables, int64_t table_stride, int64_t max_blocks,
                        int64_t num_blocks, int64_t block_size, int64_t begin, int64_t end) {
  for (int64_t s = begin; s < end; ++s) {
    const int64_t context = lens[s];
    APEX_CHECK(context >= 1, "context_lens[", s, "] = ", context,
               ": every sequence must attend to at least its current token (zero-length contexts are an error)");
    const int64_t needed = (context + block_size - 1) / block_size;
    APEX_CHECK(needed <= max_blocks, "context_lens[", s, "] = ", context, " needs ", needed, " blocks of ",
               block_size, " tokens but block_tables has ", max_blocks, " columns");
    const int32_t* row = tables + s * table_stride;
    for (int64_t b = 0; b < needed; ++b) {
      APEX_CHECK(row[b] >= 0 && row[b] < num_blocks, "block_tables[", s, ", ", b, "] = ", row[b],
                 " is out of range for a cache of ", num_blocks, " blocks");
    }
  }
}

// Slots [begin, end) of an append lie in the cache.
void check_slots(const int64_t* slots, int64_t begin, int64_t end, int64_t num_blocks, int64_t block_size) {
  const int64_t num_slots = num_blocks * block_size;
  for (int64_t i = begin; i < end; ++i) {
    APEX_CHECK(slots[i] < num_slots, "slot_mapping[", i, "] = ", slots[i], " is out of range for a cache of ",
               num_blocks, " blocks of ", block_size, " tokens");
  }
}

// The arguments of an attention over num_seqs sequences of query ([seqs, heads, head_dim], head_dim contiguous);
// keys / values / index (or null): the cache pair of each sequence, as PagedAttentionArgs::cache_index.
void fill_attention_args(apex_cpu::PagedAttentionArgs& args, const at::Tensor& query, const void* key_cache,
                         const void* value_cache, const int32_t* tables, int64_t table_stride, const int32_t* lens,
                         void* out, int64_t num_seqs, int64_t num_kv_heads, int64_t block_size, int64_t head_dim,
                         double scale, const int64_t* rows, void* const* keys, void* const* values,
                         const int32_t* index) {
  args.dtype = kernel_dtype(query.scalar_type());
  args.query = query.data_ptr();
  args.query_seq_stride = query.stride(0);
  args.query_head_stride = query.stride(1);
  args.key_cache = key_cache;
  args.value_cache = value_cache;
  args.block_tables = tables;
  args.block_table_stride = table_stride;
  args.context_lens = lens;
  args.out = out;
  args.num_seqs = int(num_seqs);
  args.num_heads = int(query.size(1));
  args.num_kv_heads = int(num_kv_heads);
  args.head_dim = int(head_dim);
  args.block_size = int(block_size);
  args.scale = float(scale);
  args.rows = rows;
  args.key_caches = const_cast<const void* const*>(keys);
  args.value_caches = const_cast<const void* const*>(values);
  args.cache_index = index;
}

// Points the call's view at its plan: the items, the merges and their pending counts (the scratch is set by the
// caller).
void view_plan(AttentionCall& call, int num_threads, bool in_team) {
  apex_cpu::WorkPlanView& view = call.view;
  view.items = call.plan.items.data();
  view.num_items = int64_t(call.plan.items.size());
  view.merges = call.plan.merges.data();
  view.num_merges = int64_t(call.plan.merges.size());
  view.num_threads = num_threads;
  view.in_team = in_team;
  call.merge_pending.reset(new std::atomic<int32_t>[call.plan.merges.size()]);
  for (size_t i = 0; i < call.plan.merges.size(); ++i) call.merge_pending[i].store(call.plan.merges[i].num_partials);
  view.merge_pending = call.merge_pending.get();
}

// Checks an attention call and plans its work. With cache_index defined each sequence reads the pair it names
// (key_cache / value_cache are then the first pair, for geometry). With rows defined (int64 [num_seqs], checked
// by the caller to lie in query's rows), sequence s reads query row rows[s] and writes output row rows[s] of
// `out`; without, query and out have num_seqs rows. team > 0: the call runs inside a parallel region of that
// many threads (scratch for each).
void prepare_attention(AttentionCall& call, const at::Tensor& query, const at::Tensor& key_cache,
                       const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& context_lens,
                       std::optional<double> scale, const std::vector<void*>* keys, const std::vector<void*>* values,
                       const at::Tensor* cache_index, void* out, const int64_t* rows, int team) {
  const std::array<int64_t, 4> geometry = check_caches(key_cache, value_cache);
  const int64_t num_blocks = geometry[0], num_kv_heads = geometry[1], block_size = geometry[2], head_dim = geometry[3];
  check_cpu(query, "query");
  check_cpu(block_tables, "block_tables");
  check_cpu(context_lens, "context_lens");
  APEX_CHECK(query.dim() == 3, "query must be [num_seqs, num_heads, head_dim], got ", shape_of(query));
  APEX_CHECK(query.scalar_type() == key_cache.scalar_type(), "query dtype ", query.scalar_type(),
             " must equal the KV cache dtype ", key_cache.scalar_type());
  const int64_t num_seqs = rows != nullptr ? block_tables.size(0) : query.size(0);
  const int64_t num_heads = query.size(1);
  APEX_CHECK(query.size(2) == head_dim, "query head_dim ", query.size(2), " differs from the cache's ", head_dim);
  APEX_CHECK(num_heads >= 1 && num_heads % num_kv_heads == 0, "num_heads (", num_heads,
             ") must be a positive multiple of num_kv_heads (", num_kv_heads, ")");
  APEX_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.size(0) == num_seqs,
             "block_tables must be int32 [num_seqs=", num_seqs, ", max_blocks], got ", block_tables.scalar_type(),
             " ", shape_of(block_tables));
  APEX_CHECK(context_lens.scalar_type() == at::kInt && context_lens.dim() == 1 && context_lens.size(0) == num_seqs,
             "context_lens must be int32 [num_seqs=", num_seqs, "], got ", context_lens.scalar_type(), " ",
             shape_of(context_lens));
  APEX_CHECK(num_seqs <= INT32_MAX && num_blocks <= INT32_MAX, "too many sequences or blocks");

  call.query = query.stride(2) == 1 ? query : query.contiguous();
  call.tables = block_tables.stride(1) == 1 ? block_tables : block_tables.contiguous();
  call.lens = context_lens.contiguous();
  const int32_t* lens_ptr = call.lens.data_ptr<int32_t>();
  const int32_t* tables_ptr = call.tables.data_ptr<int32_t>();
  const int64_t max_blocks = call.tables.size(1);
  check_context_rows(lens_ptr, tables_ptr, call.tables.stride(0), max_blocks, num_blocks, block_size, 0, num_seqs);

  call.isa = select_isa();
  const int threads = team > 0 ? team : std::max(1, at::get_num_threads());
  const int group = int(num_heads / num_kv_heads);
  fill_attention_args(call.args, call.query, key_cache.data_ptr(), value_cache.data_ptr(), tables_ptr,
                      call.tables.stride(0), lens_ptr, out, num_seqs, num_kv_heads, block_size, head_dim,
                      scale.has_value() ? *scale : 1.0 / std::sqrt(double(head_dim)), rows,
                      cache_index != nullptr ? keys->data() : nullptr, cache_index != nullptr ? values->data() : nullptr,
                      cache_index != nullptr ? cache_index->data_ptr<int32_t>() : nullptr);
  call.plan = apex_cpu::plan_work(lens_ptr, int(num_seqs), int(num_kv_heads),
                                  2 * head_dim * int64_t(key_cache.element_size()), threads);
  view_plan(call, team > 0 ? team : call.plan.num_threads, team > 0);  // every thread of a team needs its scratch
  apex_cpu::WorkPlanView& view = call.view;
  view.scratch = apex_cpu::scratch_layout(group, int(head_dim), int(block_size), call.plan.max_splits);
  const int64_t partial_floats = int64_t(group) * (head_dim + 2);
  call.scratch = at::empty({view.num_threads * view.scratch.total + call.plan.num_partials * partial_floats},
                           at::TensorOptions().dtype(at::kFloat));
  view.thread_scratch = call.scratch.data_ptr<float>();
  view.partials = view.thread_scratch + view.num_threads * view.scratch.total;
}

void run_attention(const AttentionCall& call) {
  if (call.args.num_seqs == 0) return;
  switch (call.isa) {
    case Isa::Avx512: apex_cpu::paged_attention_avx512(call.args, call.view); break;
    case Isa::Avx2: apex_cpu::paged_attention_avx2(call.args, call.view); break;
    case Isa::Scalar: apex_cpu::paged_attention_scalar(call.args, call.view); break;
  }
}

// Item i of a planned call by the calling thread, with the scratch of team thread `thread`.
void run_attention_item(const AttentionCall& call, int64_t i, int thread) {
  switch (call.isa) {
    case Isa::Avx512: apex_cpu::paged_attention_item_avx512(call.args, call.view, i, thread); break;
    case Isa::Avx2: apex_cpu::paged_attention_item_avx2(call.args, call.view, i, thread); break;
    case Isa::Scalar: apex_cpu::paged_attention_item_scalar(call.args, call.view, i, thread); break;
  }
}

// Shared body of paged_attention_cpu (one cache pair) and paged_attention_cpu_multi (cache_index defined).
at::Tensor paged_attention_impl(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                const at::Tensor& block_tables, const at::Tensor& context_lens,
                                std::optional<double> scale, const std::vector<void*>* keys,
                                const std::vector<void*>* values, const at::Tensor* cache_index) {
  at::Tensor out = at::empty(query.sizes(), query.options());
  AttentionCall call;
  prepare_attention(call, query, key_cache, value_cache, block_tables, context_lens, scale, keys, values,
                    cache_index, out.data_ptr(), nullptr, 0);
  run_attention(call);
  return out;
}

at::Tensor paged_attention_cpu(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                               const at::Tensor& block_tables, const at::Tensor& context_lens,
                               std::optional<double> scale) {
  return paged_attention_impl(query, key_cache, value_cache, block_tables, context_lens, scale, nullptr, nullptr,
                              nullptr);
}

// One call over several caches of one geometry (the staggered plan attends every layer's rows at once: one
// work split and one parallel region instead of one per layer).
at::Tensor paged_attention_cpu_multi(const at::Tensor& query, at::TensorList key_caches, at::TensorList value_caches,
                                     const at::Tensor& cache_index, const at::Tensor& block_tables,
                                     const at::Tensor& context_lens, std::optional<double> scale) {
  std::vector<void*> keys, values;
  check_cpu(query, "query");
  APEX_CHECK(query.dim() == 3, "query must be [num_seqs, num_heads, head_dim], got ", shape_of(query));
  check_cache_list(key_caches, value_caches, cache_index, query.size(0), keys, values);
  return paged_attention_impl(query, key_caches[0], value_caches[0], block_tables, context_lens, scale, &keys,
                              &values, &cache_index);
}

// One cache append checked, ready to run (apex_cpu::cache_append(call.args)): the tensors it reads are held here.
struct AppendCall {
  apex_cpu::CacheAppendArgs args;
  at::Tensor key, value, slots;
};

// The arguments of an append of num_tokens slots, read from key / value ([tokens, kv_heads, head_dim] strided
// views); keys / values / index (or null): the cache pair of each token, as CacheAppendArgs::cache_index.
void fill_append_args(apex_cpu::CacheAppendArgs& args, const at::Tensor& key, const at::Tensor& value, void* key_cache,
                      void* value_cache, int64_t element_size, const int64_t* slots, int64_t num_tokens,
                      int64_t num_kv_heads, int64_t block_size, int64_t head_dim, int threads, const int64_t* rows,
                      bool in_team, void* const* keys, void* const* values, const int32_t* index) {
  args.element_size = int(element_size);
  args.key = key.data_ptr();
  args.key_token_stride = key.stride(0);
  args.key_head_stride = key.stride(1);
  args.value = value.data_ptr();
  args.value_token_stride = value.stride(0);
  args.value_head_stride = value.stride(1);
  args.key_cache = key_cache;
  args.value_cache = value_cache;
  args.slot_mapping = slots;
  args.num_tokens = num_tokens;
  args.num_kv_heads = int(num_kv_heads);
  args.head_dim = int(head_dim);
  args.block_size = int(block_size);
  args.num_threads = threads;
  args.rows = rows;
  args.in_team = in_team;
  args.key_caches = keys;
  args.value_caches = values;
  args.cache_index = index;
}

// Checks a cache append. With rows defined (int64 [num_tokens], checked by the caller to lie in key's rows),
// token t reads key/value row rows[t]; without, key and value have one row per slot. team > 0: it runs inside
// a parallel region of that many threads.
void prepare_append(AppendCall& call, const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                    const at::Tensor& value_cache, const at::Tensor& slot_mapping, const std::vector<void*>* keys,
                    const std::vector<void*>* values, const at::Tensor* cache_index, const int64_t* rows, int team) {
  const std::array<int64_t, 4> geometry = check_caches(key_cache, value_cache);
  const int64_t num_blocks = geometry[0], num_kv_heads = geometry[1], block_size = geometry[2], head_dim = geometry[3];
  check_cpu(key, "key");
  check_cpu(value, "value");
  check_cpu(slot_mapping, "slot_mapping");
  APEX_CHECK(key.dim() == 3 && key.size(1) == num_kv_heads && key.size(2) == head_dim,
             "key must be [num_tokens, num_kv_heads=", num_kv_heads, ", head_dim=", head_dim, "], got ", shape_of(key));
  APEX_CHECK(value.sizes() == key.sizes(), "value shape ", shape_of(value), " differs from key shape ", shape_of(key));
  APEX_CHECK(key.scalar_type() == key_cache.scalar_type() && value.scalar_type() == key_cache.scalar_type(),
             "key/value dtypes (", key.scalar_type(), ", ", value.scalar_type(), ") must equal the cache dtype ",
             key_cache.scalar_type());
  APEX_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                 (rows != nullptr || slot_mapping.size(0) == key.size(0)),
             "slot_mapping must be int64 [num_tokens=", key.size(0), "], got ", slot_mapping.scalar_type(), " ",
             shape_of(slot_mapping));
  call.key = key.stride(2) == 1 ? key : key.contiguous();
  call.value = value.stride(2) == 1 ? value : value.contiguous();
  call.slots = slot_mapping.contiguous();
  const int64_t* slots_ptr = call.slots.data_ptr<int64_t>();
  check_slots(slots_ptr, 0, call.slots.size(0), num_blocks, block_size);
  fill_append_args(call.args, call.key, call.value, key_cache.data_ptr(), value_cache.data_ptr(),
                   key_cache.element_size(), slots_ptr, call.slots.size(0), num_kv_heads, block_size, head_dim,
                   team > 0 ? team : std::max(1, at::get_num_threads()), rows, team > 0,
                   cache_index != nullptr ? keys->data() : nullptr, cache_index != nullptr ? values->data() : nullptr,
                   cache_index != nullptr ? cache_index->data_ptr<int32_t>() : nullptr);
}

void cache_append_impl(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                       const at::Tensor& value_cache, const at::Tensor& slot_mapping, const std::vector<void*>* keys,
                       const std::vector<void*>* values, const at::Tensor* cache_index) {
  AppendCall call;
  prepare_append(call, key, value, key_cache, value_cache, slot_mapping, keys, values, cache_index, nullptr, 0);
  if (call.args.num_tokens > 0) apex_cpu::cache_append(call.args);
}

void cache_append_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
                      const at::Tensor& slot_mapping) {
  cache_append_impl(key, value, key_cache, value_cache, slot_mapping, nullptr, nullptr, nullptr);
}

// cache_append_cpu over several caches of one geometry: token t goes to the pair cache_index[t].
void cache_append_cpu_multi(const at::Tensor& key, const at::Tensor& value, at::TensorList key_caches,
                            at::TensorList value_caches, const at::Tensor& cache_index,
                            const at::Tensor& slot_mapping) {
  std::vector<void*> keys, values;
  check_cpu(key, "key");
  APEX_CHECK(key.dim() == 3, "key must be [num_tokens, num_kv_heads, head_dim], got ", shape_of(key));
  check_cache_list(key_caches, value_caches, cache_index, key.size(0), keys, values);
  cache_append_impl(key, value, key_caches[0], value_caches[0], slot_mapping, &keys, &values, &cache_index);
}

// One pause of a spin-wait: tells the core this thread only polls (the sibling hyperthread gets its slot).
inline void cpu_relax() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#else
  std::this_thread::yield();
#endif
}

// A waiting thread's pause between two polls of a flag another agent raises: spin ~100 us (the common wait is short
// and a wake-up would cost as much), then yield the core between polls.
constexpr int64_t kSpinPolls = 20000;
inline void flag_backoff(int64_t polls) {
  if (polls < kSpinPolls) {
    cpu_relax();
  } else {
    std::this_thread::yield();
  }
}

// A team thread's pause while it polls its team's shared state: a yield every 64 rounds.
inline void team_backoff(int64_t polls) {
  if (polls % 64 == 63) {
    std::this_thread::yield();
  } else {
    cpu_relax();
  }
}

// Longest wait for a soft flag (a negative value): a hint to start after something, not a guard.
constexpr double kSoftWaitS = 0.03;

// Waits until flags[i] >= values[i] for every i; returns the seconds waited. Each flag is a counter that only
// grows, raised by another agent (a GPU copy into pinned memory, another thread) once what it guards is done;
// it is read with acquire order, so what it guards is visible after. Spins for the first ~100 us (the common
// wait is short and a wake-up would cost as much), then yields the core between polls. Raises after timeout_s.
// A negative value -v is soft: flags[i] >= v is waited for at most kSoftWaitS (never raising), then the wait
// goes on without it.
double wait_flags(const at::Tensor& flags, at::IntArrayRef values, double timeout_s) {
  check_cpu(flags, "ready_flags");
  APEX_CHECK(flags.scalar_type() == at::kLong && flags.dim() == 1 && flags.is_contiguous() &&
                 flags.size(0) == int64_t(values.size()),
             "ready_flags must be a contiguous int64 [", int64_t(values.size()), "] (one per value), got ",
             flags.scalar_type(), " ", shape_of(flags));
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  int64_t* counters = flags.data_ptr<int64_t>();
  for (size_t i = 0; i < values.size(); ++i) {
    const bool soft = values[i] < 0;
    const int64_t target = soft ? -values[i] : values[i];
    const auto begin = clock::now();
    for (int64_t polls = 0; __atomic_load_n(counters + i, __ATOMIC_ACQUIRE) < target; ++polls) {
      flag_backoff(polls);
      if (polls >= kSpinPolls && polls % 256 == 0) {
        const auto now = clock::now();
        if (soft) {
          if (std::chrono::duration<double>(now - begin).count() > kSoftWaitS) break;
          continue;
        }
        APEX_CHECK(std::chrono::duration<double>(now - start).count() <= timeout_s, "waited more than ",
                   int64_t(timeout_s), " s for ready flag ", int64_t(i), " to reach ", target, " (it is ",
                   __atomic_load_n(counters + i, __ATOMIC_ACQUIRE), "): the copies it stands for never completed");
      }
    }
  }
  return std::chrono::duration<double>(clock::now() - start).count();
}

void wait_host_flags(const at::Tensor& flags, at::IntArrayRef values, double timeout_s) {
  wait_flags(flags, values, timeout_s);
}

// The checked inputs of a staggered CPU job (`stagger_cpu_job`, `stagger_layer_job`): the rows in use of the
// flattened [layers * width] block, and views of `staged` (each row's q, k, v heads side by side) read in place.
struct StaggerInputs {
  int64_t layers = 0, width = 0, count = 0;
  at::Tensor picked;  // int64 [count]: the rows in use
  at::Tensor query, key, value;  // [layers * width, heads, head_dim] views of staged
  std::vector<void*> keys, values;  // the caches' data pointers
};

// timings[5] (when given) receives the whole call's seconds, entry to return (checks, plans, frees included), set
// as the call returns: against the caller's wall time it separates the call's own costs from the caller's.
class CallTimer {
 public:
  ~CallTimer() {
    if (slot_ != nullptr) *slot_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }
  void report_to(const at::Tensor& timings) {
    if (timings.numel() == 6) slot_ = timings.data_ptr<double>() + 5;
  }

 private:
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  double* slot_ = nullptr;
};

void check_stagger_inputs(StaggerInputs& in, const at::Tensor& staged, at::TensorList key_caches,
                          at::TensorList value_caches, const at::Tensor& cache_index,
                          const std::optional<at::Tensor>& rows, int64_t num_heads, const at::Tensor& out,
                          const at::Tensor& timings) {
  check_cpu(staged, "staged");
  check_cpu(out, "out");
  check_cpu(timings, "timings");
  APEX_CHECK(timings.scalar_type() == at::kDouble &&
                 (timings.numel() == 2 || timings.numel() == 4 || timings.numel() == 5 || timings.numel() == 6) &&
                 timings.is_contiguous(),
             "timings must be a contiguous float64 tensor of 2, 4, 5 or 6 elements, got ", timings.scalar_type(), " ",
             shape_of(timings));
  APEX_CHECK(staged.dim() == 4 && staged.is_contiguous(),
             "staged must be a contiguous [layers, width, heads, head_dim] tensor, got ", shape_of(staged));
  const int64_t layers = staged.size(0), width = staged.size(1), head_dim = staged.size(3);
  const int64_t num_kv_heads = (staged.size(2) - num_heads) / 2;
  APEX_CHECK(num_heads >= 1 && num_kv_heads >= 1 && staged.size(2) == num_heads + 2 * num_kv_heads,
             "staged holds ", staged.size(2), " heads per row, not num_heads=", num_heads, " + 2 * num_kv_heads");
  APEX_CHECK(out.dim() == 4 && out.is_contiguous() && out.size(0) == layers && out.size(1) == width &&
                 out.size(2) == num_heads && out.size(3) == head_dim && out.scalar_type() == staged.scalar_type(),
             "out must be a contiguous [", layers, ", ", width, ", ", num_heads, ", ", head_dim, "] tensor of the "
             "staged dtype, got ", out.scalar_type(), " ", shape_of(out));
  const int64_t count = rows.has_value() ? rows->numel() : layers * width;
  if (rows.has_value()) {
    check_cpu(*rows, "rows");
    APEX_CHECK(rows->scalar_type() == at::kLong && rows->dim() == 1, "rows must be int64 [n], got ",
               rows->scalar_type(), " ", shape_of(*rows));
    in.picked = rows->contiguous();
    const int64_t* picked = in.picked.data_ptr<int64_t>();
    for (int64_t i = 0; i < count; ++i) {
      APEX_CHECK(picked[i] >= 0 && picked[i] < layers * width, "rows[", i, "] = ", picked[i],
                 " is out of range for ", layers * width, " rows");
    }
  } else {
    in.picked = at::arange(count, at::TensorOptions().dtype(at::kLong));
  }
  check_cache_list(key_caches, value_caches, cache_index, count, in.keys, in.values);
  const at::Tensor flat = staged.view({layers * width, staged.size(2), head_dim});
  in.query = flat.narrow(1, 0, num_heads);
  in.key = flat.narrow(1, num_heads, num_kv_heads);
  in.value = flat.narrow(1, num_heads + num_kv_heads, num_kv_heads);
  in.layers = layers;
  in.width = width;
  in.count = count;
}

// The staggered plan's CPU job in one call, so that the thread running it never needs Python (nor its GIL,
// which the launching thread holds for most of the host work between two GPU steps) from the moment its inputs
// are ready until the job is done: wait for the ready flags (the staged q/k/v copied to the host, the output
// buffer's last copy to the device done), append every row's K/V to its layer's cache and attend, and write the
// rows of `out`. staged [layers, width, num_heads + 2 * num_kv_heads, head_dim] holds each row's q, k, v heads
// side by side; rows (int64, into the flattened [layers * width]) picks the rows holding a request (none: all,
// in order); cache_index / block_tables / context_lens / slot_mapping describe those rows.
// timings (float64 [2], or [4] with the running time by part: append, attention, or [5] with the team's
// thread-seconds inside work items after them: NaN where not measured, or [6] with the whole call's seconds last)
// receives (seconds waiting for the flags, seconds running[, its parts[, busy thread-seconds[, the call]]]).
void stagger_cpu_job(const at::Tensor& staged, at::TensorList key_caches, at::TensorList value_caches,
                     const at::Tensor& cache_index, const at::Tensor& block_tables, const at::Tensor& context_lens,
                     const at::Tensor& slot_mapping, const std::optional<at::Tensor>& rows, int64_t num_heads,
                     double scale, at::Tensor& out, const at::Tensor& ready_flags, at::IntArrayRef ready_values,
                     double timeout_s, at::Tensor& timings) {
  CallTimer call_timer;  // declared first: it reports after everything else is freed
  StaggerInputs in;
  check_stagger_inputs(in, staged, key_caches, value_caches, cache_index, rows, num_heads, out, timings);
  call_timer.report_to(timings);
  const int64_t count = in.count;

  // Everything is checked and planned before the wait, so that from the inputs' arrival the job only computes.
  // The rows in use are read in place from `staged` and written in place into `out` (no gathers, no scatter).
  const int64_t* row_ptr = in.picked.data_ptr<int64_t>();
  const int team = std::max(1, at::get_num_threads());
  AppendCall append;
  AttentionCall attention;
  prepare_append(append, in.key, in.value, key_caches[0], value_caches[0], slot_mapping, &in.keys, &in.values,
                 &cache_index, row_ptr, team);
  prepare_attention(attention, in.query, key_caches[0], value_caches[0], block_tables, context_lens, scale,
                    &in.keys, &in.values, &cache_index, out.data_ptr(), row_ptr, team);
  APEX_CHECK(append.args.num_tokens == count && block_tables.size(0) == count,
             "slot_mapping and block_tables must have one row per picked row (", count, "), got ",
             shape_of(slot_mapping), " and ", shape_of(block_tables));

  // One parallel region for the whole job: its threads are started before the wait and poll (pause, then
  // yield) beside the thread waiting for the flags, so no thread has gone to sleep when the inputs arrive
  // (waking a sleeping OpenMP team cost 0.3-1.2 ms on the GPU machine's virtual CPUs). Then the appends, a
  // barrier (the attention reads what other threads appended), and the attention.
  using clock = std::chrono::steady_clock;
  double waited = 0.0;
  std::string error;
  std::atomic<int> state{0};  // 0 waiting, 1 inputs ready, 2 the wait failed
  clock::time_point start, appended;
#pragma omp parallel num_threads(team) if (team > 1)
  {
    if (omp_get_thread_num() == 0) {
      try {
        waited = wait_flags(ready_flags, ready_values, timeout_s);
        start = clock::now();
        state.store(1, std::memory_order_release);
      } catch (const std::exception& e) {
        error = e.what();
        state.store(2, std::memory_order_release);
      }
    } else {
      for (int64_t polls = 0; state.load(std::memory_order_acquire) == 0; ++polls) team_backoff(polls);
    }
    if (state.load(std::memory_order_acquire) == 1 && count > 0) {
      apex_cpu::cache_append(append.args);  // ends at a barrier
#pragma omp master
      appended = clock::now();
      run_attention(attention);
    }
  }
  APEX_CHECK(error.empty(), error);
  const auto end = clock::now();
  if (count == 0) appended = start;
  double* seconds = timings.data_ptr<double>();
  seconds[0] = waited;
  seconds[1] = std::chrono::duration<double>(end - start).count();
  if (timings.numel() >= 4) {  // the running time by part: append, attention
    seconds[2] = std::chrono::duration<double>(appended - start).count();
    seconds[3] = std::chrono::duration<double>(end - appended).count();
  }
  if (timings.numel() >= 5) seconds[4] = std::nan("");  // busy thread-seconds: measured by the layered job only
}

// One layer's share of a layered job: its rows' append and attention, planned before the job's first wait. The
// calls point into the job's tensors (checked once for the whole job); the team's scratch and the layers'
// partials are one allocation of the job's.
struct LayerWork {
  AppendCall append;
  AttentionCall attention;
};

// Layer rows [begin, begin + n) of a layered job planned: its append and attention arguments (raw pointers into
// the job's checked tensors) and its work split. The scratch is assigned by the caller once every layer is planned.
void plan_layer(LayerWork& w, const StaggerInputs& in, const std::array<int64_t, 4>& geometry, int64_t element_size,
                const int32_t* tables, int64_t table_stride, const int32_t* lens, const int64_t* slots,
                const int32_t* index, const int64_t* rows, int64_t begin, int64_t n, double scale, void* out, Isa isa,
                int team) {
  const int64_t num_kv_heads = geometry[1], block_size = geometry[2], head_dim = geometry[3];
  fill_append_args(w.append.args, in.key, in.value, in.keys[0], in.values[0], element_size, slots + begin, n,
                   num_kv_heads, block_size, head_dim, team, rows + begin, true, in.keys.data(), in.values.data(),
                   index + begin);

  AttentionCall& call = w.attention;
  call.isa = isa;
  fill_attention_args(call.args, in.query, in.keys[0], in.values[0], tables + begin * table_stride, table_stride,
                      lens + begin, out, n, num_kv_heads, block_size, head_dim, scale, rows + begin, in.keys.data(),
                      in.values.data(), index + begin);
  call.plan = apex_cpu::plan_work(lens + begin, int(n), int(num_kv_heads), 2 * head_dim * element_size, team);
  view_plan(call, team, true);
}

// Checks a layered job's shapes and dtypes against the caches' geometry (its rows are checked per layer).
void check_layer_shapes(const StaggerInputs& in, const std::array<int64_t, 4>& geometry, const at::Tensor& tables,
                        const at::Tensor& lens) {
  const int64_t num_blocks = geometry[0], num_kv_heads = geometry[1], head_dim = geometry[3];
  const int64_t num_heads = in.query.size(1);
  APEX_CHECK(in.query.size(2) == head_dim, "query head_dim ", in.query.size(2), " differs from the cache's ", head_dim);
  APEX_CHECK(num_heads % num_kv_heads == 0 && in.key.size(1) == num_kv_heads, "staged holds ", in.key.size(1),
             " kv heads and ", num_heads, " query heads; the caches have ", num_kv_heads, " kv heads");
  APEX_CHECK(tables.scalar_type() == at::kInt && tables.dim() == 2, "block_tables must be int32 [rows, max_blocks], got ",
             tables.scalar_type(), " ", shape_of(tables));
  APEX_CHECK(lens.scalar_type() == at::kInt, "context_lens must be int32, got ", lens.scalar_type());
  APEX_CHECK(in.count <= INT32_MAX && num_blocks <= INT32_MAX, "too many sequences or blocks");
}

// How a layered job shares its work out over its team (no barrier). Tasks are every layer's attention items in
// layer order (a layer without rows is one empty task, so that its flags are still waited for and raised). A thread
// claims the next task; the first to claim one of layer l waits for ready_flags[l] and opens the layer, the
// others wait for it to open. An item holding a row's last token first appends that row's K/V (only that item
// reads it). The thread finishing a layer's last task raises done_flags[l] (acq_rel count: every item's writes
// are visible before). Timings: the waiting is the time the team had nothing to do (a layer's flag awaited after
// the layer before was done), the running time the rest of the job's span.
class LayerFlow {
 public:
  using clock = std::chrono::steady_clock;

  // The tasks of `work` (planned layers, nullptr: a layer without rows); the job's span starts here.
  LayerFlow(const std::vector<std::unique_ptr<LayerWork>>& work, int64_t layers, const at::Tensor& ready_flags,
            at::Tensor& done_flags, int64_t turn, double timeout_s, int team, bool timed_items)
      : work_(work), layers_(layers), remaining_(new std::atomic<int64_t>[layers]),
        opened_(new std::atomic<int>[layers]), appends_(layers), ready_(ready_flags.data_ptr<int64_t>()),
        done_(done_flags.data_ptr<int64_t>()), turn_(turn), timeout_s_(timeout_s), wait_begin_(layers),
        ready_at_(layers), done_at_(layers), timed_items_(timed_items), busy_(team, 0.0) {
    for (int64_t l = 0; l < layers; ++l) {
      opened_[l].store(0, std::memory_order_relaxed);
      const LayerWork* w = work[l].get();
      if (w == nullptr) {
        task_layer_.push_back(l);
        task_item_.push_back(-1);
        remaining_[l].store(1, std::memory_order_relaxed);
        continue;
      }
      const apex_cpu::WorkPlanView& view = w->attention.view;
      const apex_cpu::PagedAttentionArgs& args = w->attention.args;
      appends_[l].assign(view.num_items, -1);
      for (int64_t i = 0; i < view.num_items; ++i) {
        const apex_cpu::WorkItem& item = view.items[i];
        if (item.token_end == args.context_lens[item.seq]) {
          appends_[l][i] = int64_t(item.seq) * args.num_kv_heads + item.kv_head;
        }
        task_layer_.push_back(l);
        task_item_.push_back(i);
      }
      remaining_[l].store(view.num_items, std::memory_order_relaxed);
    }
    start_ = clock::now();
    deadline_ = start_ + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(timeout_s));
  }

  // A team thread's share: claims tasks until none is left or a wait failed.
  void run(int thread) {
    const int64_t num_tasks = int64_t(task_layer_.size());
    double working = 0.0;  // this thread's seconds inside items (stored once: no shared line written per item)
    for (;;) {
      const int64_t t = next_.fetch_add(1, std::memory_order_relaxed);
      if (t >= num_tasks || failed_.load(std::memory_order_acquire)) break;
      const int64_t l = task_layer_[t];
      int state = 0;
      if (opened_[l].load(std::memory_order_acquire) != 2 &&
          opened_[l].compare_exchange_strong(state, 1, std::memory_order_acq_rel)) {
        wait_begin_[l] = clock::now();
        for (int64_t polls = 0; __atomic_load_n(ready_ + l, __ATOMIC_ACQUIRE) < turn_; ++polls) {
          flag_backoff(polls);
          if (polls >= kSpinPolls && polls % 256 == 0 && clock::now() > deadline_) {
            if (!failed_.exchange(true, std::memory_order_acq_rel)) {  // one message, from the first to fail
              error_ = message("waited more than ", int64_t(timeout_s_), " s for layer ", l, " of turn ", turn_,
                               " to be staged (its flag is ", __atomic_load_n(ready_ + l, __ATOMIC_ACQUIRE), ")");
            }
            break;
          }
        }
        ready_at_[l] = clock::now();
        opened_[l].store(2, std::memory_order_release);
      } else {
        for (int64_t polls = 0; opened_[l].load(std::memory_order_acquire) != 2; ++polls) {
          if (failed_.load(std::memory_order_acquire)) break;
          team_backoff(polls);
        }
      }
      if (failed_.load(std::memory_order_acquire)) break;
      const int64_t i = task_item_[t];
      if (i >= 0) {
        LayerWork& w = *work_[l];
        const auto began = timed_items_ ? clock::now() : clock::time_point();
        if (appends_[l][i] >= 0) apex_cpu::cache_append_row(w.append.args, appends_[l][i]);
        run_attention_item(w.attention, i, thread);
        if (timed_items_) working += std::chrono::duration<double>(clock::now() - began).count();
      }
      if (remaining_[l].fetch_sub(1, std::memory_order_acq_rel) == 1) {
        done_at_[l] = clock::now();
        __atomic_store_n(done_ + l, turn_, __ATOMIC_RELEASE);
      }
    }
    busy_[thread] = working;
  }

  // After the team is done: raises a failed wait's error, else writes the timings (as `stagger_cpu_job`'s).
  void report(const at::Tensor& timings) const {
    APEX_CHECK(error_.empty(), error_);
    const auto end = clock::now();
    double waited = 0.0;
    for (int64_t l = 0; l < layers_; ++l) {  // idle: the flag awaited after the layer before was done
      const auto from = l == 0 ? wait_begin_[0] : std::max(wait_begin_[l], done_at_[l - 1]);
      waited += std::max(0.0, std::chrono::duration<double>(ready_at_[l] - from).count());
    }
    double* seconds = timings.data_ptr<double>();
    seconds[0] = waited;
    seconds[1] = std::max(0.0, std::chrono::duration<double>(end - start_).count() - waited);
    if (timings.numel() >= 4) {  // the appends run inside the items: all of it counts as attention
      seconds[2] = 0.0;
      seconds[3] = seconds[1];
    }
    if (timed_items_) seconds[4] = std::accumulate(busy_.begin(), busy_.end(), 0.0);
  }

 private:
  const std::vector<std::unique_ptr<LayerWork>>& work_;
  const int64_t layers_;
  std::vector<int64_t> task_layer_, task_item_;  // item -1: an empty layer's task
  std::unique_ptr<std::atomic<int64_t>[]> remaining_;
  std::unique_ptr<std::atomic<int>[]> opened_;  // 0 closed, 1 opening, 2 open
  std::vector<std::vector<int64_t>> appends_;  // per layer, per item: the append row it does first, or -1
  const int64_t* ready_;
  int64_t* done_;
  const int64_t turn_;
  const double timeout_s_;
  std::vector<clock::time_point> wait_begin_, ready_at_, done_at_;
  std::atomic<int64_t> next_{0};
  std::atomic<bool> failed_{false};
  std::string error_;
  const bool timed_items_;  // each item timed: the team's busy thread-seconds
  std::vector<double> busy_;
  clock::time_point start_, deadline_;
};

// The one-lane staggered plan's CPU job (`stagger_layer_job`), checked at construction and run by a team:
// `team_part` is every team thread's share (the thread numbered 0 the one that constructed it), `finish` raises
// the first error or writes the timings once every thread is done. The op runs one in a parallel region of its
// own; the runner runs queued jobs one after the other inside one region (`JobRunner::run_chain`).
class LayerJob {
 public:
  LayerJob(const at::Tensor& staged, at::TensorList key_caches, at::TensorList value_caches,
           const at::Tensor& cache_index, const at::Tensor& block_tables, const at::Tensor& context_lens,
           const at::Tensor& slot_mapping, const std::optional<at::Tensor>& rows, int64_t num_heads, double scale,
           at::Tensor& out, const at::Tensor& ready_flags, at::Tensor& done_flags, int64_t turn, double timeout_s,
           at::Tensor& timings)
      : ready_flags_(ready_flags), done_flags_(done_flags), timings_(timings), turn_(turn), timeout_s_(timeout_s),
        scale_(scale) {
    check_stagger_inputs(in_, staged, key_caches, value_caches, cache_index, rows, num_heads, out, timings);
    const int64_t layers = in_.layers, width = in_.width, count = in_.count;
    for (const at::Tensor* flags : {&ready_flags, static_cast<const at::Tensor*>(&done_flags)}) {
      check_cpu(*flags, "ready_flags / done_flags");
      APEX_CHECK(flags->scalar_type() == at::kLong && flags->dim() == 1 && flags->is_contiguous() &&
                     flags->size(0) == layers,
                 "ready_flags and done_flags must be contiguous int64 [layers=", layers, "], got ",
                 flags->scalar_type(), " ", shape_of(*flags));
    }
    APEX_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.size(0) == count &&
                   block_tables.dim() == 2 && block_tables.size(0) == count && context_lens.dim() == 1 &&
                   context_lens.size(0) == count,
               "slot_mapping, block_tables and context_lens must have one row per picked row (", count, "), got ",
               shape_of(slot_mapping), ", ", shape_of(block_tables), " and ", shape_of(context_lens));
    row_ptr_ = in_.picked.data_ptr<int64_t>();
    index_ = cache_index.data_ptr<int32_t>();
    first_.assign(layers + 1, count);  // rows of layer l: [first_[l], first_[l + 1])
    for (int64_t i = count - 1; i >= 0; --i) {
      APEX_CHECK(index_[i] == row_ptr_[i] / width && (i == 0 || index_[i - 1] <= index_[i]),
                 "rows must be sorted by layer and cache_index must name each row's layer: row ", row_ptr_[i],
                 " has cache_index ", int64_t(index_[i]));
      first_[index_[i]] = i;
    }
    for (int64_t l = layers - 1; l >= 0; --l) first_[l] = std::min(first_[l], first_[l + 1]);

    team_ = std::max(1, at::get_num_threads());
    geometry_ = check_caches(key_caches[0], value_caches[0]);  // (all alike: checked)
    APEX_CHECK(in_.query.scalar_type() == key_caches[0].scalar_type(), "staged dtype ", in_.query.scalar_type(),
               " must equal the KV cache dtype ", key_caches[0].scalar_type());
    tables_ = block_tables.stride(-1) == 1 ? block_tables : block_tables.contiguous();
    lens_ = context_lens.contiguous();
    slots_ = slot_mapping.contiguous();
    check_layer_shapes(in_, geometry_, tables_, lens_);
    isa_ = select_isa();
    element_size_ = key_caches[0].element_size();
    work_.resize(layers);
    for (int64_t l = 0; l < layers; ++l) {
      if (first_[l + 1] > first_[l]) work_[l] = std::make_unique<LayerWork>();
    }
    failures_.resize(layers);
    out_ptr_ = out.data_ptr();
  }

  // The team's width the job was planned for (the OpenMP width of its caller).
  int team() const { return team_; }

  // Every team thread's share. The layers are planned by the team, a layer per thread at a time (planned by the
  // calling thread alone, the other threads would idle through it while the CPU is already behind the GPU); a
  // thread still waking finds them planned and goes straight to the flow. Thread 0 then allocates the
  // scratch and lays out the flow while the others poll, and calls before_flow (if given) once the others run it.
  void team_part(int thread, const std::function<void()>* before_flow = nullptr) {
    const int64_t layers = in_.layers;
    for (int64_t l = next_layer_.fetch_add(1, std::memory_order_relaxed); l < layers;
         l = next_layer_.fetch_add(1, std::memory_order_relaxed)) {
      plan(l);
      planned_.fetch_add(1, std::memory_order_release);
    }
    if (thread == 0) {
      for (int64_t polls = 0; planned_.load(std::memory_order_acquire) < layers; ++polls) team_backoff(polls);
      bool ok = std::none_of(failures_.begin(), failures_.end(), [](const std::exception_ptr& f) { return bool(f); });
      if (ok) {
        try {
          assign_scratch();
          flow_ = std::make_unique<LayerFlow>(work_, layers, ready_flags_, done_flags_, turn_, timeout_s_, team_,
                                              timings_.numel() >= 5);
        } catch (...) {
          setup_failure_ = std::current_exception();
          ok = false;
        }
      }
      phase_.store(ok ? 1 : 2, std::memory_order_release);
      if (ok && before_flow != nullptr) (*before_flow)();
    } else {
      for (int64_t polls = 0; phase_.load(std::memory_order_acquire) == 0; ++polls) team_backoff(polls);
    }
    if (phase_.load(std::memory_order_acquire) == 1) flow_->run(thread);
  }

  // Once every thread is out of `team_part`: raises the first failing layer's error (as a serial loop over the
  // layers would), else the flow's, else writes the timings.
  void finish() {
    for (const std::exception_ptr& failure : failures_) {
      if (failure) std::rethrow_exception(failure);
    }
    if (setup_failure_) std::rethrow_exception(setup_failure_);
    flow_->report(timings_);
  }

 private:
  // Checks and plans layer l (its rows' errors kept in failures_[l]).
  void plan(int64_t l) {
    if (work_[l] == nullptr) return;
    try {
      const int32_t* tables = tables_.data_ptr<int32_t>();
      const int32_t* lens = lens_.data_ptr<int32_t>();
      const int64_t* slots = slots_.data_ptr<int64_t>();
      check_slots(slots, first_[l], first_[l + 1], geometry_[0], geometry_[2]);  // (prepare_append's order)
      check_context_rows(lens, tables, tables_.stride(0), tables_.size(1), geometry_[0], geometry_[2], first_[l],
                         first_[l + 1]);
      plan_layer(*work_[l], in_, geometry_, element_size_, tables, tables_.stride(0), lens, slots, index_, row_ptr_,
                 first_[l], first_[l + 1] - first_[l], scale_, out_ptr_, isa_, team_);
    } catch (...) {
      failures_[l] = std::current_exception();
    }
  }

  // One scratch allocation for the job: each team thread's scratch, shared by every layer (a thread runs one
  // item at a time), laid out for the largest split of any layer; then each layer's partials.
  void assign_scratch() {
    const int64_t layers = in_.layers;
    const int64_t group = in_.query.size(1) / geometry_[1];
    const int64_t partial_floats = group * (geometry_[3] + 2);
    int max_splits = 1;
    std::vector<int64_t> partial_offset(layers, 0);
    int64_t partials = 0;
    for (int64_t l = 0; l < layers; ++l) {
      if (work_[l] == nullptr) continue;
      max_splits = std::max(max_splits, work_[l]->attention.plan.max_splits);
      partial_offset[l] = partials;
      partials += apex_cpu::round_up_16(work_[l]->attention.plan.num_partials * partial_floats);
    }
    const apex_cpu::ScratchLayout layout =
        apex_cpu::scratch_layout(int(group), int(geometry_[3]), int(geometry_[2]), max_splits);
    scratch_ = at::empty({team_ * layout.total + partials}, at::TensorOptions().dtype(at::kFloat));
    float* scratch = scratch_.data_ptr<float>();
    for (int64_t l = 0; l < layers; ++l) {
      if (work_[l] == nullptr) continue;
      apex_cpu::WorkPlanView& view = work_[l]->attention.view;
      view.scratch = layout;
      view.thread_scratch = scratch;
      view.partials = scratch + team_ * layout.total + partial_offset[l];
    }
  }

  StaggerInputs in_;
  at::Tensor ready_flags_, done_flags_, timings_;  // (handles: the job's owner may move its own)
  const int64_t turn_;
  const double timeout_s_, scale_;
  const int64_t* row_ptr_ = nullptr;
  const int32_t* index_ = nullptr;
  std::vector<int64_t> first_;
  int team_ = 1;
  std::array<int64_t, 4> geometry_{};
  at::Tensor tables_, lens_, slots_, scratch_;
  Isa isa_ = Isa::Scalar;
  int64_t element_size_ = 0;
  void* out_ptr_ = nullptr;
  std::vector<std::unique_ptr<LayerWork>> work_;
  std::vector<std::exception_ptr> failures_;  // per layer: its planning error
  std::exception_ptr setup_failure_;
  std::atomic<int64_t> next_layer_{0}, planned_{0};
  std::atomic<int> phase_{0};  // 0 planning, 1 the flow runs, 2 failed before it
  std::unique_ptr<LayerFlow> flow_;
};

// The one-lane staggered plan's CPU job: as `stagger_cpu_job`, but layer by layer as the GPU step that stages
// them runs. Layer l's rows (the rows of [l * width, (l + 1) * width) in use; rows must be sorted by layer and
// cache_index must name each row's layer) are appended and attended once ready_flags[l] >= turn (raised by the
// step behind its staging of layer l; it also says the step has read layer l's outputs of the turn before), and
// done_flags[l] is then set to turn (release order: layer l's rows of `out` are written), which the next step's
// layer l waits for. Every layer's flags are waited for and raised, with rows or without. timings as in
// `stagger_cpu_job`, the waiting summed over layers and the running time without it.
void stagger_layer_job(const at::Tensor& staged, at::TensorList key_caches, at::TensorList value_caches,
                       const at::Tensor& cache_index, const at::Tensor& block_tables, const at::Tensor& context_lens,
                       const at::Tensor& slot_mapping, const std::optional<at::Tensor>& rows, int64_t num_heads,
                       double scale, at::Tensor& out, const at::Tensor& ready_flags, at::Tensor& done_flags,
                       int64_t turn, double timeout_s, at::Tensor& timings) {
  CallTimer call_timer;  // declared first: it reports after everything else is freed
  LayerJob job(staged, key_caches, value_caches, cache_index, block_tables, context_lens, slot_mapping, rows,
               num_heads, scale, out, ready_flags, done_flags, turn, timeout_s, timings);
  call_timer.report_to(timings);
  // One parallel region for the whole job, so that its team is woken once (a team asleep since the last job is slow
  // to wake, and a second region after the plans would wake it again).
  const int team = job.team();
#pragma omp parallel num_threads(team) if (team > 1)
  job.team_part(omp_get_thread_num());
  job.finish();
}

// ---------------------------------------------------------------------------------------------------------------
// The layered jobs' runner (`stagger_runner_*`): one C++ thread, pinned to its cores with an OpenMP team that wide,
// runs the queued jobs in submission order, back to back in one parallel region while they keep coming. No job
// needs Python to start, return or hand over its timings, so the team never idles while the worker thread waits for
// the GIL, which the launching thread holds for most of a step.

constexpr int64_t kAbortedFlag = int64_t(1) << 62;  // a failed job's done flags (stagger.ABORTED): the GPU goes on
// Per finished job, doubles: turn, waiting for the layers' flags, running (NaN: the job failed), the team's busy
// thread-seconds (NaN without rows), the C++ job call's seconds, waiting for the gate, and steady-clock seconds
// when it was submitted, started and ended (the clock of Python's time.perf_counter on Linux).
constexpr int kRecordFields = 9;

// Sets every counter of flags (int64, contiguous) to value, release order: what it stands for is visible first.
void set_flags(const at::Tensor& flags, int64_t value) {
  int64_t* data = flags.data_ptr<int64_t>();
  for (int64_t i = 0; i < flags.numel(); ++i) __atomic_store_n(data + i, value, __ATOMIC_RELEASE);
}

double clock_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct RunnerJob {
  int64_t turn = 0;
  at::Tensor staged;  // undefined: a turn without rows (its done flags rise once the jobs before are done)
  at::Tensor cache_index, block_tables, context_lens, slot_mapping;
  at::Tensor rows;  // undefined: every row
  int64_t num_heads = 0;
  double scale = 1.0, timeout_s = 60.0;
  at::Tensor out, ready, done;
  at::Tensor gate;  // (if defined) waited for first: gate[0] >= gate_value (the prompt exports landed)
  int64_t gate_value = 0;
  double submitted = 0.0;
};

class JobRunner {
 public:
  JobRunner(std::vector<at::Tensor> keys, std::vector<at::Tensor> values, std::vector<int64_t> cores)
      : keys_(std::move(keys)), values_(std::move(values)), cores_(std::move(cores)) {
    thread_ = std::thread([this] { loop(); });
  }

  ~JobRunner() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

  void submit(RunnerJob job) {
    job.submitted = clock_seconds();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      APEX_CHECK(!stop_, "stagger_runner_submit: the runner is stopped");
      queue_.push_back(std::move(job));
      submitted_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_one();
  }

  // The records of the jobs finished since the last poll. A failed job's error is raised once instead, the
  // records kept for the next poll. The finished jobs' tensors are let go here, on the caller's thread (`finished_`).
  at::Tensor poll() {
    std::vector<std::array<double, kRecordFields>> records;
    std::vector<RunnerJob> finished;
    std::string error;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      finished.swap(finished_);
      if (error_.empty()) {
        records.swap(records_);
      } else {
        error.swap(error_);
      }
    }
    finished.clear();
    APEX_CHECK(error.empty(), error);
    at::Tensor out = at::empty({int64_t(records.size()), kRecordFields}, at::TensorOptions().dtype(at::kDouble));
    double* data = out.data_ptr<double>();
    for (size_t i = 0; i < records.size(); ++i) {
      std::copy(records[i].begin(), records[i].end(), data + i * kRecordFields);
    }
    return out;
  }

  // What the runner is doing, for a caller that finds a job late: [jobs submitted, jobs queued and not taken, jobs
  // finished, phase (kIdle, kGate, kChecks, kRunning), the turn of the job in that phase (-1: none)].
  at::Tensor state() {
    at::Tensor out = at::empty({5}, at::TensorOptions().dtype(at::kLong));
    int64_t* data = out.data_ptr<int64_t>();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      data[1] = int64_t(queue_.size());
    }
    data[0] = submitted_.load(std::memory_order_acquire);
    data[2] = finished_jobs_.load(std::memory_order_acquire);
    data[3] = phase_.load(std::memory_order_acquire);
    data[4] = phase_turn_.load(std::memory_order_acquire);
    return out;
  }

  // Returns once every job submitted before is done.
  void drain() {
    std::vector<RunnerJob> finished;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      idle_.wait(lock, [this] { return queue_.empty() && !busy_; });
      finished.swap(finished_);
    }
  }

 private:
  void loop() {
#if defined(__linux__)
    pthread_setname_np(pthread_self(), "apex-runner");
    if (!cores_.empty()) {  // the team the first parallel region starts inherits this thread's cores
      cpu_set_t set;
      CPU_ZERO(&set);
      for (int64_t c : cores_) CPU_SET(int(c), &set);
      sched_setaffinity(0, sizeof(set), &set);
    }
#endif
    c10::InferenceMode inference;  // as the Python worker ran its jobs: no autograd or version counting on its tensors
    at::get_num_threads();  // ATen's per-thread set-up first, so that it does not reset the width set here
    omp_set_num_threads(std::max<int>(1, int(cores_.size())));
    for (Slot& slot : slots_) slot.timings = at::zeros({6}, at::TensorOptions().dtype(at::kDouble));
    for (;;) {
      poll_for_submission();
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [this] { return stop_ || !queue_.empty(); });
        if (!pop(slots_[0].job)) return;  // stopped with nothing left to run
        busy_ = true;
      }
      run_chain();
    }
  }

  // The next job is mostly submitted within a step: poll for it ~kSpinPolls rounds before sleeping or ending a
  // chain, so that picking it up costs no wake-up (the worker's cores are its own).
  void poll_for_submission() const {
    for (int64_t polls = 0; polls < kSpinPolls && submitted_.load(std::memory_order_acquire) == taken_; ++polls) {
      cpu_relax();
    }
  }

  // Moves the first queued job into `job` (false: none queued); mutex_ held.
  bool pop(RunnerJob& job) {
    if (queue_.empty()) return false;
    job = std::move(queue_.front());
    queue_.pop_front();
    ++taken_;
    return true;
  }

  // A job of a chain, from when the runner takes it until it is handed over (`done`).
  struct Slot {
    RunnerJob job;
    bool taken = false;  // holds a job
    bool checked = false;  // its checks already ran (`layer` or `error` set), ahead of its turn
    std::unique_ptr<LayerJob> layer;  // the checked job the team runs
    std::string error;  // its checks' failure
    double call_s = 0.0;  // seconds of its C++ part so far (checks, then from its publication to its frees)
    std::array<double, kRecordFields> record{};
    at::Tensor timings;  // the job's timings (each slot its own, allocated once)
  };

  // Runs slot 0's job and the jobs queued after it (or submitted within ~kSpinPolls polls of the last one's end) inside
  // one parallel region: the team is woken once for the chain, not once a job. This thread (the
  // region's thread 0) checks each job and publishes it; the others poll for it between jobs, then each job's team
  // part runs. While the others run a job's flow, thread 0 takes the next queued job and checks it ahead of its
  // turn, so that the team does not wait for those checks between the two jobs.
  void run_chain() {
    int cur = 0;  // the slot of the job in turn
    slots_[0].taken = true;
    std::atomic<LayerJob*> published{nullptr};
    std::atomic<int64_t> generation{0};
    std::atomic<int> left{0};  // threads other than 0 out of the current job's team part
    double published_at = 0.0;
    const std::function<void()> check_next = [this, &cur] { check_ahead(slots_[1 - cur]); };
    const int width = std::max(1, omp_get_max_threads());
#pragma omp parallel num_threads(width) if (width > 1)
    {
      const int thread = omp_get_thread_num();
      int64_t seen = 0;
      for (;;) {
        if (thread == 0) {
          LayerJob* next = nullptr;
          while (next == nullptr && slots_[cur].taken) {
            next = start(slots_[cur]);
            if (next == nullptr) cur = advance(cur);  // that job is over (no rows, or it failed)
          }
          published_at = clock_seconds();
          if (next != nullptr) set_phase(kRunning, slots_[cur].job.turn);
          published.store(next, std::memory_order_relaxed);
          generation.fetch_add(1, std::memory_order_release);
        } else {
          for (int64_t polls = 0; generation.load(std::memory_order_acquire) == seen; ++polls) team_backoff(polls);
        }
        seen = generation.load(std::memory_order_acquire);
        LayerJob* running = published.load(std::memory_order_relaxed);
        if (running == nullptr) break;  // the chain ended: the region ends
        running->team_part(thread, thread == 0 ? &check_next : nullptr);
        if (thread != 0) {
          left.fetch_add(1, std::memory_order_acq_rel);
          continue;
        }
        const int others = omp_get_num_threads() - 1;
        for (int64_t polls = 0; left.load(std::memory_order_acquire) < others; ++polls) team_backoff(polls);
        left.store(0, std::memory_order_relaxed);  // (no thread adds to it before the next job is published)
        Slot& slot = slots_[cur];
        std::string error;
        try {
          slot.layer->finish();
        } catch (const std::exception& e) {
          error = e.what();
        }
        slot.layer.reset();  // its frees, before its tensors are handed over (`done`)
        const double* seconds = slot.timings.data_ptr<double>();
        slot.record[1] = seconds[0];
        slot.record[2] = seconds[1];
        slot.record[3] = seconds[4];
        slot.record[4] = slot.call_s + clock_seconds() - published_at;
        done(slot, error);
        cur = advance(cur);
      }
    }
  }

  // Thread 0 of a chain, at a job's turn: starts its record, waits for its gate, then either runs it at once (a turn
  // without rows: its done flags; a job whose checks fail: recorded as failed; nullptr returned) or returns the
  // checked job for the team.
  LayerJob* start(Slot& slot) {
    std::array<double, kRecordFields>& record = slot.record;
    RunnerJob& job = slot.job;
    record.fill(0.0);
    record[0] = double(job.turn);
    record[3] = std::nan("");
    record[6] = job.submitted;
    record[7] = clock_seconds();
    if (!slot.checked) {
      try {
        if (job.gate.defined()) {
          set_phase(kGate, job.turn);
          record[5] = wait_flags(job.gate, {job.gate_value}, job.timeout_s);
        }
        if (job.staged.defined()) {
          set_phase(kChecks, job.turn);
          check(slot);
        } else {
          set_flags(job.done, job.turn);
        }
      } catch (const std::exception& e) {
        slot.error = e.what();
      }
    }
    if (slot.layer != nullptr) return slot.layer.get();
    done(slot, slot.error);
    return nullptr;
  }

  // Checks a slot's job (`LayerJob`), keeping its failure; its timings zeroed first.
  void check(Slot& slot) {
    RunnerJob& job = slot.job;
    const double begin = clock_seconds();
    std::fill(slot.timings.data_ptr<double>(), slot.timings.data_ptr<double>() + 6, 0.0);
    try {
      const std::optional<at::Tensor> rows = job.rows.defined() ? std::optional<at::Tensor>(job.rows) : std::nullopt;
      slot.layer = std::make_unique<LayerJob>(job.staged, keys_, values_, job.cache_index, job.block_tables,
                                              job.context_lens, job.slot_mapping, rows, job.num_heads, job.scale,
                                              job.out, job.ready, job.done, job.turn, job.timeout_s, slot.timings);
    } catch (const std::exception& e) {
      slot.error = e.what();
    }
    slot.checked = true;
    slot.call_s += clock_seconds() - begin;
  }

  // Thread 0, while the team runs the current job's flow: the next queued job (if any) goes into `slot`, checked
  // now if it has rows and no gate (a gate is waited for at its turn, and a turn without rows raises its done flags
  // only after the jobs before it).
  void check_ahead(Slot& slot) {
    if (slot.taken) return;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!pop(slot.job)) return;
      slot.taken = true;
    }
    if (slot.job.staged.defined() && !slot.job.gate.defined()) check(slot);
  }

  // The job of slot `cur` is over: the next one's slot (the one checked ahead, or `cur` again with the next queued
  // job, polled for up to ~kSpinPolls rounds; not taken if none came: the chain ends).
  int advance(int cur) {
    if (slots_[1 - cur].taken) return 1 - cur;
    slots_[cur].taken = take_next(slots_[cur].job);
    return cur;
  }

  // A slot's job is over (error: its failure, else empty): its record kept for `poll`, its tensors handed over to be
  // let go on the polling thread; a failed job's done flags are lifted past any turn (the GPU must not wait for
  // layers it will never finish) and its running time recorded as NaN (it tells nothing). The slot is emptied.
  void done(Slot& slot, const std::string& error) {
    std::array<double, kRecordFields>& record = slot.record;
    if (!error.empty()) {
      record[2] = std::nan("");
      set_flags(slot.job.done, kAbortedFlag);
    }
    record[8] = clock_seconds();
    finished_jobs_.fetch_add(1, std::memory_order_release);
    set_phase(kIdle, -1);  // until the next job's turn starts
    {
      std::lock_guard<std::mutex> lock(mutex_);
      records_.push_back(record);
      finished_.push_back(std::move(slot.job));
      if (!error.empty() && error_.empty()) {
        error_ = message("the staggered CPU job of turn ", int64_t(record[0]), " failed: ", error);
      }
    }
    slot.taken = slot.checked = false;
    slot.layer.reset();
    slot.error.clear();
    slot.call_s = 0.0;
  }

  // Takes the next queued job into `job` after polling up to ~kSpinPolls rounds for one to be submitted; false (and
  // the runner idle) if none came.
  bool take_next(RunnerJob& job) {
    poll_for_submission();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (pop(job)) return true;
      busy_ = false;
    }
    idle_.notify_all();
    return false;
  }

  // What thread 0 is doing (`state`): no job in its turn, waiting for a job's gate, checking it, its team running it.
  enum Phase : int64_t { kIdle = 0, kGate = 1, kChecks = 2, kRunning = 3 };
  void set_phase(Phase phase, int64_t turn) {
    phase_turn_.store(turn, std::memory_order_release);
    phase_.store(phase, std::memory_order_release);
  }

  std::vector<at::Tensor> keys_, values_;
  std::vector<int64_t> cores_;
  std::mutex mutex_;
  std::condition_variable wake_, idle_;
  std::deque<RunnerJob> queue_;
  std::vector<std::array<double, kRecordFields>> records_;
  // Jobs done, their tensors still held: most were made in Python, and letting go of the last reference besides
  // Python's takes the GIL, which this thread must never wait for (the launching thread holds it for most of a
  // step); `poll`, `drain` and the destructor let go of them on their caller's thread.
  std::vector<RunnerJob> finished_;
  std::string error_;
  bool stop_ = false, busy_ = false;
  std::atomic<int64_t> submitted_{0};  // jobs ever queued (polled without the lock while the runner is idle)
  std::atomic<int64_t> finished_jobs_{0}, phase_{kIdle}, phase_turn_{-1};  // (`state`)
  int64_t taken_ = 0;  // jobs taken from the queue (the runner thread's only)
  std::array<Slot, 2> slots_;  // a chain's job in turn and the next one (the runner thread's only)
  std::thread thread_;  // last: started once every member above exists
};

// The runtime's C++ threads behind int64 handles: the ops take a handle, the registry keeps its object alive.
template <class T>
class Handles {
 public:
  explicit Handles(const char* what) : what_(what) {}

  int64_t add(std::shared_ptr<T> object) {
    std::lock_guard<std::mutex> lock(mutex_);
    objects_[next_] = std::move(object);
    return next_++;
  }

  std::shared_ptr<T> find(int64_t handle, const char* op) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = objects_.find(handle);
    APEX_CHECK(it != objects_.end(), op, ": no ", what_, " ", handle, " (never started, or stopped)");
    return it->second;
  }

  // Forgets the handle; returns its object (null if none: never started, or already taken).
  std::shared_ptr<T> take(int64_t handle) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = objects_.find(handle);
    if (it == objects_.end()) return nullptr;
    std::shared_ptr<T> object = std::move(it->second);
    objects_.erase(it);
    return object;
  }

 private:
  const char* what_;
  std::mutex mutex_;
  std::map<int64_t, std::shared_ptr<T>> objects_;
  int64_t next_ = 1;
};

Handles<JobRunner> g_runners("runner");

// Starts a runner over the host pool's per-layer caches (every job attends them), pinned to `cores` (none: not
// pinned) with an OpenMP team that wide; returns its handle.
int64_t stagger_runner_start(at::TensorList key_caches, at::TensorList value_caches, at::IntArrayRef cores) {
  APEX_CHECK(key_caches.size() == value_caches.size() && !key_caches.empty(),
             "stagger_runner_start: key_caches and value_caches must be non-empty and as many, got ",
             int64_t(key_caches.size()), " and ", int64_t(value_caches.size()));
  for (size_t i = 0; i < key_caches.size(); ++i) {
    check_cpu(key_caches[i], "key_caches");
    check_cpu(value_caches[i], "value_caches");
  }
  return g_runners.add(std::make_shared<JobRunner>(key_caches.vec(), value_caches.vec(), cores.vec()));
}

// Queues `stagger_layer_job` of `turn` (staged None: a turn without rows, whose done flags are set to turn once the
// jobs before it are done) behind the runner's jobs; gate (optional int64 [1]): it starts once gate[0] >= gate_value.
// Errors of the job are raised by the next `stagger_runner_poll`; its done flags are then set to 1 << 62.
void stagger_runner_submit(int64_t handle, int64_t turn, const std::optional<at::Tensor>& staged,
                           const std::optional<at::Tensor>& cache_index, const std::optional<at::Tensor>& block_tables,
                           const std::optional<at::Tensor>& context_lens,
                           const std::optional<at::Tensor>& slot_mapping, const std::optional<at::Tensor>& rows,
                           int64_t num_heads, double scale, const at::Tensor& out, const at::Tensor& ready_flags,
                           const at::Tensor& done_flags, double timeout_s, const std::optional<at::Tensor>& gate,
                           int64_t gate_value) {
  std::shared_ptr<JobRunner> runner = g_runners.find(handle, "stagger_runner_submit");
  for (const at::Tensor* flags : {&ready_flags, &done_flags}) {
    check_cpu(*flags, "ready_flags / done_flags");
    APEX_CHECK(flags->scalar_type() == at::kLong && flags->dim() == 1 && flags->is_contiguous(),
               "stagger_runner_submit: ready_flags and done_flags must be contiguous int64 [layers], got ",
               flags->scalar_type(), " ", shape_of(*flags));
  }
  if (gate.has_value()) {
    check_cpu(*gate, "gate");
    APEX_CHECK(gate->scalar_type() == at::kLong && gate->dim() == 1 && gate->size(0) == 1,
               "stagger_runner_submit: gate must be an int64 [1] counter, got ", gate->scalar_type(), " ",
               shape_of(*gate));
  }
  RunnerJob job;
  job.turn = turn;
  if (staged.has_value()) {
    APEX_CHECK(cache_index.has_value() && block_tables.has_value() && context_lens.has_value() &&
                   slot_mapping.has_value(),
               "stagger_runner_submit: a job with staged rows needs cache_index, block_tables, context_lens and "
               "slot_mapping");
    job.staged = *staged;
    job.cache_index = *cache_index;
    job.block_tables = *block_tables;
    job.context_lens = *context_lens;
    job.slot_mapping = *slot_mapping;
    if (rows.has_value()) job.rows = *rows;
  }
  job.num_heads = num_heads;
  job.scale = scale;
  job.timeout_s = timeout_s;
  job.out = out;
  job.ready = ready_flags;
  job.done = done_flags;
  if (gate.has_value()) job.gate = *gate;
  job.gate_value = gate_value;
  runner->submit(std::move(job));
}

at::Tensor stagger_runner_poll(int64_t handle) { return g_runners.find(handle, "stagger_runner_poll")->poll(); }

at::Tensor stagger_runner_state(int64_t handle) { return g_runners.find(handle, "stagger_runner_state")->state(); }

void stagger_runner_drain(int64_t handle) { g_runners.find(handle, "stagger_runner_drain")->drain(); }

// Runs the jobs still queued, stops the thread and forgets the handle (a second stop is a no-op).
void stagger_runner_stop(int64_t handle) {
  g_runners.take(handle).reset();  // joins once the queue is empty
}

// ---------------------------------------------------------------------------------------------------------------
// The prompt K/V exports' lander (`kv_export_*`, KVExports on a GPU): one C++ thread appends each export into the host
// cache once the GPU has raised its copy flag (copied[0] >= the export's index: its K/V are in their pinned buffers),
// in submission order, then sets landed[0] to that index. Landing needs no Python, no GIL and no CUDA call, so a
// staggered job gated on `landed` (and the GPU waiting for that job) never waits for whatever the launching thread
// is blocked in; an export that failed (or whose flag never came) still raises `landed`, its error kept for `poll`.

struct ExportTask {
  int64_t index = 0;
  at::Tensor key, value, key_cache, value_cache, slots;
};

class ExportLander {
 public:
  ExportLander(at::Tensor copied, at::Tensor landed, int64_t threads, double timeout_s)
      : copied_(std::move(copied)), landed_(std::move(landed)), threads_(std::max<int64_t>(1, threads)),
        timeout_s_(timeout_s) {
    thread_ = std::thread([this] { loop(); });
  }

  ~ExportLander() { stop(); }

  // Lands the exports still queued, then ends the thread.
  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

  void submit(ExportTask task) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      APEX_CHECK(!stop_, "kv_export_submit: the lander is stopped");
      queue_.push_back(std::move(task));
    }
    wake_.notify_one();
  }

  // Lets go of the landed exports' tensors on the caller's thread (Python made them: the last reference's release
  // may take the GIL, and a pinned buffer's free is a CUDA allocator call) and raises the first failed export's error
  // once.
  void poll() {
    std::vector<ExportTask> finished;
    std::string error;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      finished.swap(finished_);
      error.swap(error_);
    }
    finished.clear();
    APEX_CHECK(error.empty(), error);
  }

 private:
  void loop() {
#if defined(__linux__)
    pthread_setname_np(pthread_self(), "apex-kv-export");
#endif
    c10::InferenceMode inference;
    at::get_num_threads();  // ATen's per-thread set-up first, so that it does not reset the width set here
    omp_set_num_threads(int(threads_));
    int64_t* landed = landed_.data_ptr<int64_t>();
    for (;;) {
      ExportTask task;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [this] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopped with nothing left
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      std::string error;
      try {
        // the flags come in order: once one never came, the later ones are not waited for (a lost device)
        APEX_CHECK(!flags_lost_, "an earlier export's copy flag never came");
        try {
          wait_flags(copied_, {task.index}, timeout_s_);
        } catch (const std::exception&) {
          flags_lost_ = true;
          throw;
        }
        AppendCall call;
        prepare_append(call, task.key, task.value, task.key_cache, task.value_cache, task.slots, nullptr, nullptr,
                       nullptr, nullptr, 0);
        if (call.args.num_tokens > 0) apex_cpu::cache_append(call.args);
      } catch (const std::exception& e) {
        error = message("the K/V export ", task.index, " into the host cache failed: ", e.what());
      }
      const int64_t index = task.index;
      {  // its error recorded before it counts as landed: a poll after a waiter saw `landed` raises it
        std::lock_guard<std::mutex> lock(mutex_);
        finished_.push_back(std::move(task));
        if (!error.empty() && error_.empty()) error_ = std::move(error);
      }
      __atomic_store_n(landed, index, __ATOMIC_RELEASE);
    }
  }

  at::Tensor copied_, landed_;
  int64_t threads_;
  double timeout_s_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<ExportTask> queue_;
  std::vector<ExportTask> finished_;
  std::string error_;
  bool stop_ = false;
  bool flags_lost_ = false;  // an export's copy flag did not come in time (the lander thread's only)
  std::thread thread_;  // last: started once every member above exists
};

Handles<ExportLander> g_landers("K/V export lander");

void check_counter(const at::Tensor& counter, const char* name) {
  check_cpu(counter, name);
  APEX_CHECK(counter.scalar_type() == at::kLong && counter.dim() == 1 && counter.size(0) == 1,
             name, " must be an int64 [1] counter, got ", counter.scalar_type(), " ", shape_of(counter));
}

// Starts a lander: exports wait for copied[0] >= their index (at most timeout_s), then land and set landed[0] to it;
// appends run on `threads` OpenMP threads. Returns its handle.
int64_t kv_export_start(const at::Tensor& copied, const at::Tensor& landed, int64_t threads, double timeout_s) {
  check_counter(copied, "copied");
  check_counter(landed, "landed");
  return g_landers.add(std::make_shared<ExportLander>(copied, landed, threads, timeout_s));
}

// Queues export `index` (above every earlier one): key/value [n, kv_heads, head_dim] into the caches at slots
// (int64 [n], negative: skipped), once copied[0] >= index. Its checks run when it lands (errors: `kv_export_poll`).
void kv_export_submit(int64_t handle, int64_t index, const at::Tensor& key, const at::Tensor& value,
                      const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& slots) {
  g_landers.find(handle, "kv_export_submit")->submit(ExportTask{index, key, value, key_cache, value_cache, slots});
}

void kv_export_poll(int64_t handle) { g_landers.find(handle, "kv_export_poll")->poll(); }

// Lands the exports still queued, stops the thread and forgets the handle (a second stop is a no-op); their errors
// are raised.
void kv_export_stop(int64_t handle) {
  std::shared_ptr<ExportLander> lander = g_landers.take(handle);
  if (lander == nullptr) return;
  lander->stop();
  lander->poll();
}

// Code of the kernel path the next call will use: 0 scalar, 1 avx2, 2 avx512 (errors like the ops would).
int64_t cpu_isa_code() { return int64_t(select_isa()); }

// Sets the work-split parameters (values <= 0 keep the current one); returns those now in effect.
std::vector<int64_t> cpu_attention_work_split(int64_t items_per_thread, int64_t min_item_bytes,
                                              int64_t min_thread_bytes) {
  apex_cpu::WorkPlanParams params = apex_cpu::work_plan_params();
  if (items_per_thread > 0) params.items_per_thread = items_per_thread;
  if (min_item_bytes > 0) params.min_item_bytes = min_item_bytes;
  if (min_thread_bytes > 0) params.min_thread_bytes = min_thread_bytes;
  apex_cpu::set_work_plan_params(params);
  params = apex_cpu::work_plan_params();
  return {params.items_per_thread, params.min_item_bytes, params.min_thread_bytes};
}

}  // namespace

TORCH_LIBRARY_IMPL(apex, CPU, m) {
  m.impl("paged_attention_cpu", &paged_attention_cpu);
  m.impl("cache_append_cpu", &cache_append_cpu);
  m.impl("paged_attention_cpu_multi", &paged_attention_cpu_multi);
  m.impl("cache_append_cpu_multi", &cache_append_cpu_multi);
  m.impl("stagger_cpu_job", &stagger_cpu_job);
  m.impl("stagger_layer_job", &stagger_layer_job);
  m.impl("stagger_runner_submit", &stagger_runner_submit);
  m.impl("kv_export_submit", &kv_export_submit);
  m.impl("wait_host_flags", &wait_host_flags);
}

TORCH_LIBRARY_IMPL(apex, CompositeExplicitAutograd, m) {
  m.impl("cpu_isa_code", &cpu_isa_code);
  m.impl("cpu_attention_work_split", &cpu_attention_work_split);
  m.impl("stagger_runner_start", &stagger_runner_start);
  m.impl("stagger_runner_poll", &stagger_runner_poll);
  m.impl("stagger_runner_state", &stagger_runner_state);
  m.impl("stagger_runner_drain", &stagger_runner_drain);
  m.impl("stagger_runner_stop", &stagger_runner_stop);
  m.impl("kv_export_start", &kv_export_start);
  m.impl("kv_export_poll", &kv_export_poll);
  m.impl("kv_export_stop", &kv_export_stop);
}
