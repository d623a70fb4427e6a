// Portable (baseline ISA) parts of the attention op: the split of one call into work items, and CPU feature
// detection for the runtime ISA dispatch.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <utility>
#include <vector>

#include "cpu_attention.h"

namespace apex_cpu {

namespace {

// Defaults chosen by benchmarks/cpu_attention_sweep.py on a 16-core host.
std::atomic<int64_t> g_items_per_thread{1};
std::atomic<int64_t> g_min_item_bytes{128 * 1024};
std::atomic<int64_t> g_min_thread_bytes{64 * 1024};

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Tokens of the next piece when `rest` tokens of a (seq, kv_head) are left and pieces are now `size` long. No
// sliver is left: a rest of less than 1.5 pieces is halved, so that no piece exceeds `size` (one above a
// thread's share would delay the end of the call), or taken whole where the halves would be below min_chunk.
int64_t next_piece(int64_t rest, int64_t size, int64_t min_chunk) {
  if (rest <= size) return rest;
  if (rest >= size + size / 2) return size;
  const int64_t half = round_up_16(ceil_div(rest, 2));
  return half >= min_chunk ? half : rest;
}

}  // namespace

WorkPlanParams work_plan_params() {
  return {g_items_per_thread.load(), g_min_item_bytes.load(), g_min_thread_bytes.load()};
}

void set_work_plan_params(const WorkPlanParams& params) {
  g_items_per_thread.store(std::max<int64_t>(1, params.items_per_thread));
  g_min_item_bytes.store(std::max<int64_t>(1, params.min_item_bytes));
  g_min_thread_bytes.store(std::max<int64_t>(1, params.min_thread_bytes));
}

WorkPlan plan_work(const int32_t* context_lens, int num_seqs, int num_kv_heads, int64_t kv_bytes_per_token,
                   int max_threads) {
  const WorkPlanParams params = work_plan_params();
  WorkPlan plan;
  int64_t total_tokens = 0;
  for (int s = 0; s < num_seqs; ++s) total_tokens += int64_t(context_lens[s]) * num_kv_heads;
  const int64_t threads =
      std::max<int64_t>(1, std::min<int64_t>(max_threads, total_tokens * kv_bytes_per_token / params.min_thread_bytes));

  // Guided split (like OpenMP's guided schedule, by KV bytes): each piece is the work not yet cut over
  // threads * items_per_thread, at least min_item_bytes, panel-aligned. Pieces shrink as the cut proceeds, and
  // run largest first, so the first pieces are long (few item starts) and the call ends on small ones (a slow
  // thread delays the end by little).
  const int64_t min_chunk = round_up_16(ceil_div(params.min_item_bytes, kv_bytes_per_token));
  const int64_t divisor = threads * params.items_per_thread;
  int64_t uncut = total_tokens;
  std::vector<std::pair<int64_t, int64_t>> pieces;  // token ranges of one (seq, kv_head)

  for (int s = 0; s < num_seqs; ++s) {
    const int64_t context = context_lens[s];
    for (int h = 0; h < num_kv_heads; ++h) {
      pieces.clear();
      for (int64_t begin = 0; begin < context;) {
        const int64_t size = threads > 1 ? std::max(min_chunk, round_up_16(ceil_div(uncut, divisor))) : context;
        const int64_t end = begin + next_piece(context - begin, size, min_chunk);
        pieces.emplace_back(begin, end);
        uncut -= end - begin;
        begin = end;
      }
      if (pieces.size() == 1) {
        plan.items.push_back({s, h, 0, int32_t(context), -1, -1});
        continue;
      }
      const int32_t merge_index = int32_t(plan.merges.size());
      plan.merges.push_back({s, h, int32_t(plan.num_partials), int32_t(pieces.size())});
      for (const auto& [begin, end] : pieces) {
        plan.items.push_back({s, h, int32_t(begin), int32_t(end), int32_t(plan.num_partials++), merge_index});
      }
      plan.max_splits = std::max(plan.max_splits, int(pieces.size()));
    }
  }
  std::stable_sort(plan.items.begin(), plan.items.end(), [](const WorkItem& a, const WorkItem& b) {
    return a.token_end - a.token_begin > b.token_end - b.token_begin;
  });
  plan.num_threads = int(std::min<int64_t>(threads, int64_t(plan.items.size())));
  return plan;
}

bool isa_compiled(Isa isa) {
#if defined(__x86_64__) || defined(_M_X64)
  (void)isa;
  return true;
#else
  return isa == Isa::Scalar;
#endif
}

bool cpu_supports(Isa isa) {
  if (!isa_compiled(isa)) return false;
#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  switch (isa) {
    case Isa::Avx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("fma");
    case Isa::Avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case Isa::Scalar:
      return true;
  }
  return false;
#else
  return isa == Isa::Scalar;
#endif
}

}  // namespace apex_cpu
