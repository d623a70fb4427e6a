// Portable (baseline ISA) KV-cache append: writes new K/V rows into their slots, K into the transposed
// 16-token panels, V as plain rows. The copy is bit-exact, so only the element size matters.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#include "cpu_attention.h"

namespace apex_cpu {

namespace {

// Below this many rows the parallel region costs more than the copy.
constexpr int64_t kParallelRows = 256;

// One row (token, kv head) of an append: K into its transposed panel, V as a plain row.
template <class T>
inline void append_row(const CacheAppendArgs& a, int64_t row, int64_t slab_elems) {
  const T* key = static_cast<const T*>(a.key);
  const T* value = static_cast<const T*>(a.value);
  const int64_t token = row / a.num_kv_heads;
  const int64_t source = a.rows != nullptr ? a.rows[token] : token;
  const int head = int(row % a.num_kv_heads);
  const int64_t slot = a.slot_mapping[token];
  if (slot < 0) return;  // padding token
  const int64_t block = slot / a.block_size;
  const int offset = int(slot % a.block_size);
  const int64_t slab = (block * a.num_kv_heads + head) * slab_elems;
  const int cache = a.cache_index != nullptr ? a.cache_index[token] : -1;
  T* key_cache = static_cast<T*>(cache >= 0 ? a.key_caches[cache] : a.key_cache);
  T* value_cache = static_cast<T*>(cache >= 0 ? a.value_caches[cache] : a.value_cache);
  const T* k = key + source * a.key_token_stride + head * a.key_head_stride;
  T* k_dst = key_cache + slab + int64_t(offset / kPanelTokens) * a.head_dim * kPanelTokens + offset % kPanelTokens;
  for (int d = 0; d < a.head_dim; ++d) k_dst[int64_t(d) * kPanelTokens] = k[d];
  const T* v = value + source * a.value_token_stride + head * a.value_head_stride;
  std::memcpy(value_cache + slab + int64_t(offset) * a.head_dim, v, sizeof(T) * a.head_dim);
}

// Tokens whose slots follow one another inside one block (and one cache pair): a prompt chunk's. Their K is written
// a panel tile at a time, 16 tokens' dim d side by side, so the panels fill in order, whole cache lines at once, not
// with one 2-byte store per cache line a row at a time.
struct Run {
  int64_t first;  // the run's first token
  int count;      // its tokens (1 for a padding token)
};

std::vector<Run> slot_runs(const CacheAppendArgs& a) {
  std::vector<Run> runs;
  for (int64_t t = 0; t < a.num_tokens;) {
    const int64_t slot = a.slot_mapping[t];
    int count = 1;
    if (slot >= 0) {
      const int64_t room = a.block_size - slot % a.block_size;
      const int cache = a.cache_index != nullptr ? a.cache_index[t] : -1;
      while (count < room && t + count < a.num_tokens && a.slot_mapping[t + count] == slot + count &&
             (a.cache_index == nullptr || a.cache_index[t + count] == cache)) {
        ++count;
      }
    }
    runs.push_back({t, count});
    t += count;
  }
  return runs;
}

// One kv head of one run: K tile by tile into its panels, V rows in order.
template <class T>
void append_run(const CacheAppendArgs& a, const Run& run, int head, int64_t slab_elems) {
  const int64_t slot = a.slot_mapping[run.first];
  if (slot < 0) return;  // padding token
  const int64_t block = slot / a.block_size;
  const int offset = int(slot % a.block_size);
  const int64_t slab = (block * a.num_kv_heads + head) * slab_elems;
  const int cache = a.cache_index != nullptr ? a.cache_index[run.first] : -1;
  T* key_cache = static_cast<T*>(cache >= 0 ? a.key_caches[cache] : a.key_cache) + slab;
  T* value_cache = static_cast<T*>(cache >= 0 ? a.value_caches[cache] : a.value_cache) + slab;
  const T* key = static_cast<const T*>(a.key);
  const T* value = static_cast<const T*>(a.value);
  for (int begin = 0; begin < run.count;) {  // the run's tokens within one panel
    const int position = offset + begin;
    const int lane = position % kPanelTokens;
    const int count = std::min(run.count - begin, kPanelTokens - lane);
    const T* rows[kPanelTokens];
    for (int i = 0; i < count; ++i) {
      const int64_t token = run.first + begin + i;
      rows[i] = key + (a.rows != nullptr ? a.rows[token] : token) * a.key_token_stride + head * a.key_head_stride;
    }
    T* panel = key_cache + int64_t(position / kPanelTokens) * a.head_dim * kPanelTokens + lane;
    for (int d = 0; d < a.head_dim; ++d) {
      for (int i = 0; i < count; ++i) panel[int64_t(d) * kPanelTokens + i] = rows[i][d];
    }
    begin += count;
  }
  for (int i = 0; i < run.count; ++i) {
    const int64_t token = run.first + i;
    const T* v = value + (a.rows != nullptr ? a.rows[token] : token) * a.value_token_stride + head * a.value_head_stride;
    std::memcpy(value_cache + int64_t(offset + i) * a.head_dim, v, sizeof(T) * a.head_dim);
  }
}

// The rows shared out over the threads of the enclosing parallel region (an orphaned loop, ending at its
// barrier; outside a region the calling thread copies them all).
template <class T>
void append_loop(const CacheAppendArgs& a) {
  const int64_t rows = a.num_tokens * a.num_kv_heads;
  const int64_t slab_elems = int64_t(a.block_size) * a.head_dim;
#pragma omp for schedule(static)
  for (int64_t row = 0; row < rows; ++row) append_row<T>(a, row, slab_elems);
}

// A call of its own (not in a team): by runs of a (run, kv head) each, or row by row when no token continues the
// one before (decode rows); a team's appends are decode rows, row by row.
template <class T>
void append_rows(const CacheAppendArgs& a) {
  if (a.in_team) {
    append_loop<T>(a);
    return;
  }
  const int64_t rows = a.num_tokens * a.num_kv_heads;
  const std::vector<Run> runs = slot_runs(a);
  if (int64_t(runs.size()) == a.num_tokens) {
#pragma omp parallel num_threads(a.num_threads) if (a.num_threads > 1 && rows >= kParallelRows)
    append_loop<T>(a);
    return;
  }
  const int64_t items = int64_t(runs.size()) * a.num_kv_heads;
  const int64_t slab_elems = int64_t(a.block_size) * a.head_dim;
#pragma omp parallel for schedule(static) num_threads(a.num_threads) if (a.num_threads > 1 && rows >= kParallelRows)
  for (int64_t item = 0; item < items; ++item) {
    append_run<T>(a, runs[item / a.num_kv_heads], int(item % a.num_kv_heads), slab_elems);
  }
}

}  // namespace

void cache_append(const CacheAppendArgs& args) {
  if (args.element_size == 4) {
    append_rows<uint32_t>(args);
  } else {
    append_rows<uint16_t>(args);
  }
}

void cache_append_row(const CacheAppendArgs& args, int64_t row) {
  const int64_t slab_elems = int64_t(args.block_size) * args.head_dim;
  if (args.element_size == 4) {
    append_row<uint32_t>(args, row, slab_elems);
  } else {
    append_row<uint16_t>(args, row, slab_elems);
  }
}

}  // namespace apex_cpu
