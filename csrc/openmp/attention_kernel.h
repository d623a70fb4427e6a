// The paged decode-attention algorithm, written once over a 16-lane fp32 vector type and compiled per ISA.
//
// Include this file from an ISA translation unit AFTER it has
//   1. included every standard header (this file includes none),
//   2. switched its target ISA on (#pragma GCC target / clang attribute), and
//   3. defined, in namespace apex_cpu::APEX_ISA_NS, the vector type V16 with
//        v_zero(), v_set1(float), v_loadf(const float*), v_storef(float*, V16), v_load(const E*) for
//        E = float / Bf16 / Fp16 (widening to fp32), v_fma(a, b, c) = a * b + c, v_mul, v_add, v_sub, v_max,
//        v_reduce_max, v_reduce_add, v_exp (exp(-inf) = 0), v_prefetch(const void*),
//      and the register-tile shapes: kScoreTileHeads (4 or 8) heads per score tile, score_splits(heads)
//      accumulators per head (a divisor of 16), kValueTileHeads (<= 4) heads per value tile and
//      value_tile_vecs_max(heads) (<= 8) 16-wide columns per value tile.
// Everything here lives in that ISA's namespace, so no symbol is shared between ISA builds.
//
// Per work item (sequence, kv head, token range) and per segment of the range (up to 128 tokens, or one block
// when blocks are larger; a segment's pieces come from consecutive blocks of the block table):
//   scores   S[g][t] = q_g . k_t for all `group` query heads of the kv head, one 16-token K panel at a time
//            (one vector load of K row d feeds one FMA per head: broadcast q_g[d] * 16 keys),
//   softmax  online: running max m_g and sum l_g, probabilities written over S, rescale factor alpha_g,
//   values   acc_g = alpha_g * acc_g + sum_t S[g][t] * v_t, in register tiles of heads x 16-wide columns.
// Each K/V byte of the range is loaded from memory once for the whole GQA group (head tiles beyond the first
// re-read the panel from L1); the next segment's blocks are software-prefetched while the current one is
// processed, because block tables scatter the blocks over memory. Segments longer than one small block
// amortise the per-segment costs (softmax reductions, accumulator loads and stores) over many tokens.
#pragma once

#if defined(__clang__)
#define APEX_UNROLL _Pragma("unroll")
#elif defined(__GNUC__)
#define APEX_UNROLL _Pragma("GCC unroll 16")
#else
#define APEX_UNROLL
#endif

namespace apex_cpu {
namespace APEX_ISA_NS {

// One block's share of a segment: K slab, first V row, first 16-token panel and token count.
template <class E>
struct Piece {
  const E* key_slab;
  const E* values;
  int panel_begin;
  int count;
};

// Scores of NH query heads for one 16-token K panel ([head_dim][16]); NJ independent accumulators per head
// split the dot product over d so that small head tiles still have enough FMA chains in flight. Every 64-byte
// line of prefetch_panel (the same panel of a block further ahead) is prefetched on the way.
template <class E, int NH, int NJ>
inline void score_panel(const E* panel, const E* prefetch_panel, const float* query, int head_dim,
                        float* scores, int score_stride) {
  constexpr int kRowBytes = kPanelTokens * int(sizeof(E));
  V16 acc[NH][NJ];
  APEX_UNROLL for (int h = 0; h < NH; ++h) {
    APEX_UNROLL for (int j = 0; j < NJ; ++j) acc[h][j] = v_zero();
  }
  for (int d = 0; d < head_dim; d += NJ) {
    APEX_UNROLL for (int j = 0; j < NJ; ++j) {
      const V16 keys = v_load(panel + (d + j) * kPanelTokens);
      if (prefetch_panel != nullptr && ((d + j) * kRowBytes) % 64 == 0) {
        v_prefetch(prefetch_panel + (d + j) * kPanelTokens);
      }
      APEX_UNROLL for (int h = 0; h < NH; ++h) {
        acc[h][j] = v_fma(v_set1(query[h * head_dim + d + j]), keys, acc[h][j]);
      }
    }
  }
  APEX_UNROLL for (int h = 0; h < NH; ++h) {
    V16 sum = acc[h][0];
    APEX_UNROLL for (int j = 1; j < NJ; ++j) sum = v_add(sum, acc[h][j]);
    v_storef(scores + h * score_stride, sum);
  }
}

template <class E>
inline void score_head_tile(int num_heads, const E* panel, const E* prefetch_panel, const float* query,
                            int head_dim, float* scores, int score_stride) {
#define APEX_SCORE_TILE(NH)                                                                                   \
  case NH:                                                                                                    \
    if constexpr (kScoreTileHeads >= NH) {                                                                    \
      score_panel<E, NH, score_splits(NH)>(panel, prefetch_panel, query, head_dim, scores, score_stride);   \
    }                                                                                                         \
    break;
  switch (num_heads) {
    APEX_SCORE_TILE(1)
    APEX_SCORE_TILE(2)
    APEX_SCORE_TILE(3)
    APEX_SCORE_TILE(4)
    APEX_SCORE_TILE(5)
    APEX_SCORE_TILE(6)
    APEX_SCORE_TILE(7)
    APEX_SCORE_TILE(8)
    default: break;
  }
#undef APEX_SCORE_TILE
}

// Scores of all heads for the pieces of one segment, written contiguously: scores[g * score_stride + i].
// K of the next segment's pieces is prefetched piece by piece, panel by panel.
template <class E>
inline void score_segment(const Piece<E>* pieces, int num_pieces, const Piece<E>* next, int num_next,
                          const float* query, int group, int head_dim, float* scores, int score_stride) {
  const int64_t panel_elems = int64_t(kPanelTokens) * head_dim;
  int offset = 0;
  for (int i = 0; i < num_pieces; ++i) {
    const Piece<E>& piece = pieces[i];
    const int panel_end = piece.panel_begin + (piece.count + kPanelTokens - 1) / kPanelTokens;
    for (int p = piece.panel_begin; p < panel_end; ++p, offset += kPanelTokens) {
      const E* panel = piece.key_slab + p * panel_elems;
      const E* prefetch_panel = i < num_next ? next[i].key_slab + p * panel_elems : nullptr;
      for (int g = 0; g < group; g += kScoreTileHeads) {
        const int heads = group - g < kScoreTileHeads ? group - g : kScoreTileHeads;
        score_head_tile<E>(heads, panel, g == 0 ? prefetch_panel : nullptr, query + int64_t(g) * head_dim,
                           head_dim, scores + int64_t(g) * score_stride + offset, score_stride);
      }
    }
  }
}

// Online-softmax step for `count` new scores per head: updates max/sum, writes probabilities over the scores
// and the factor alpha by which the accumulators must be rescaled.
inline void softmax_segment(float* scores, int score_stride, int count, int group, float* max, float* sum,
                            float* alpha) {
  const int vectors = (count + kPanelTokens - 1) / kPanelTokens;
  for (int g = 0; g < group; ++g) {
    float* s = scores + int64_t(g) * score_stride;
    for (int t = count; t < vectors * kPanelTokens; ++t) s[t] = -INFINITY;  // lanes past the context
    V16 block_max = v_set1(-INFINITY);
    for (int i = 0; i < vectors; ++i) block_max = v_max(block_max, v_loadf(s + i * kPanelTokens));
    const float reduced = v_reduce_max(block_max);
    const float new_max = reduced > max[g] ? reduced : max[g];
    alpha[g] = std::exp(max[g] - new_max);  // 0 on the first segment (max = -inf)
    max[g] = new_max;
    const V16 shift = v_set1(new_max);
    V16 block_sum = v_zero();
    for (int i = 0; i < vectors; ++i) {
      const V16 p = v_exp(v_sub(v_loadf(s + i * kPanelTokens), shift));
      v_storef(s + i * kPanelTokens, p);
      block_sum = v_add(block_sum, p);
    }
    sum[g] = sum[g] * alpha[g] + v_reduce_add(block_sum);
  }
}

// acc[h][column : column + 16 * ND] = alpha[h] * acc[h] + sum_t probs[h][t] * v_t[column : ...] for NH heads
// over all tokens of a segment's pieces; accumulators stay in registers across the pieces. V of the next
// segment's pieces is prefetched row by row when `next` is given.
template <class E, int NH, int ND>
inline void value_tile(const Piece<E>* pieces, int num_pieces, const Piece<E>* next, int num_next, int column,
                       int head_dim, const float* probs, int prob_stride, const float* alpha, float* acc) {
  constexpr int kVecBytes = kPanelTokens * int(sizeof(E));
  V16 tile[NH][ND];
  APEX_UNROLL for (int h = 0; h < NH; ++h) {
    const V16 scale = v_set1(alpha[h]);
    APEX_UNROLL for (int j = 0; j < ND; ++j) {
      tile[h][j] = v_mul(v_loadf(acc + h * head_dim + column + j * kPanelTokens), scale);
    }
  }
  int offset = 0;
  for (int i = 0; i < num_pieces; ++i) {
    const E* values = pieces[i].values + column;
    const E* prefetch_values = i < num_next ? next[i].values + column : nullptr;
    const float* p_row = probs + offset;
    const int count = pieces[i].count;
    for (int t = 0; t < count; ++t) {
      V16 row[ND];
      APEX_UNROLL for (int j = 0; j < ND; ++j) {
        row[j] = v_load(values + int64_t(t) * head_dim + j * kPanelTokens);
        if (prefetch_values != nullptr && (j * kVecBytes) % 64 == 0) {
          v_prefetch(prefetch_values + int64_t(t) * head_dim + j * kPanelTokens);
        }
      }
      APEX_UNROLL for (int h = 0; h < NH; ++h) {
        const V16 p = v_set1(p_row[h * prob_stride + t]);
        APEX_UNROLL for (int j = 0; j < ND; ++j) tile[h][j] = v_fma(p, row[j], tile[h][j]);
      }
    }
    offset += count;
  }
  APEX_UNROLL for (int h = 0; h < NH; ++h) {
    APEX_UNROLL for (int j = 0; j < ND; ++j) v_storef(acc + h * head_dim + column + j * kPanelTokens, tile[h][j]);
  }
}

template <class E, int NH>
inline void value_tile_vecs(int vecs, const Piece<E>* pieces, int num_pieces, const Piece<E>* next, int num_next,
                            int column, int head_dim, const float* probs, int prob_stride, const float* alpha,
                            float* acc) {
#define APEX_VALUE_TILE(ND)                                                                                  \
  case ND:                                                                                                   \
    if constexpr (value_tile_vecs_max(NH) >= ND) {                                                           \
      value_tile<E, NH, ND>(pieces, num_pieces, next, num_next, column, head_dim, probs, prob_stride, alpha, \
                            acc);                                                                            \
    }                                                                                                        \
    break;
  switch (vecs) {
    APEX_VALUE_TILE(1)
    APEX_VALUE_TILE(2)
    APEX_VALUE_TILE(3)
    APEX_VALUE_TILE(4)
    APEX_VALUE_TILE(5)
    APEX_VALUE_TILE(6)
    APEX_VALUE_TILE(7)
    APEX_VALUE_TILE(8)
    default: break;
  }
#undef APEX_VALUE_TILE
}

// Accumulates the value rows of a segment's pieces into all heads' accumulators, tile by tile.
template <class E>
inline void value_segment(const Piece<E>* pieces, int num_pieces, const Piece<E>* next, int num_next,
                          const float* probs, int prob_stride, int group, int head_dim, const float* alpha,
                          float* acc) {
  const int head_vecs = head_dim / kPanelTokens;
  for (int g = 0; g < group; g += kValueTileHeads) {
    const int heads = group - g < kValueTileHeads ? group - g : kValueTileHeads;
    const int max_vecs = value_tile_vecs_max(heads);
    for (int v = 0; v < head_vecs;) {
      // Split the columns into near-equal tiles of at most max_vecs vectors.
      const int tiles_left = (head_vecs - v + max_vecs - 1) / max_vecs;
      const int vecs = (head_vecs - v + tiles_left - 1) / tiles_left;
      const int column = v * kPanelTokens;
      const Piece<E>* prefetch = g == 0 ? next : nullptr;
      const int num_prefetch = g == 0 ? num_next : 0;
      const float* p = probs + int64_t(g) * prob_stride;
      float* a = acc + int64_t(g) * head_dim;
#define APEX_VALUE_HEADS(NH)                                                                              \
  case NH:                                                                                                 \
    if constexpr (kValueTileHeads >= NH) {                                                                 \
      value_tile_vecs<E, NH>(vecs, pieces, num_pieces, prefetch, num_prefetch, column, head_dim, p,          \
                             prob_stride, alpha + g, a);                                                   \
    }                                                                                                      \
    break;
      switch (heads) {
        APEX_VALUE_HEADS(1)
        APEX_VALUE_HEADS(2)
        APEX_VALUE_HEADS(3)
        APEX_VALUE_HEADS(4)
        default: break;
      }
#undef APEX_VALUE_HEADS
      v += vecs;
    }
  }
}

// Software prefetch of every 64-byte line of [data, data + bytes).
inline void prefetch_bytes(const void* data, int64_t bytes) {
  const char* p = static_cast<const char*>(data);
  for (int64_t offset = 0; offset < bytes; offset += 64) v_prefetch(p + offset);
}

// Writes `scale * src[0:head_dim]` to dst in the output dtype.
template <class E>
inline void store_row(E* dst, const float* src, float scale, int head_dim) {
  for (int d = 0; d < head_dim; ++d) dst[d] = from_float<E>(src[d] * scale);
}

template <class E>
void process_item(const PagedAttentionArgs& args, const WorkPlanView& plan, const WorkItem& item,
                  float* scratch) {
  const int group = args.num_heads / args.num_kv_heads;
  const int head_dim = args.head_dim;
  const int block_size = args.block_size;
  const ScratchLayout& layout = plan.scratch;
  float* query = scratch + layout.query;
  float* scores = scratch + layout.scores;
  float* acc = scratch + layout.acc;
  float* max = scratch + layout.max;
  float* sum = scratch + layout.sum;
  float* alpha = scratch + layout.alpha;

  const int64_t row_index = args.rows != nullptr ? args.rows[item.seq] : item.seq;
  const E* query_rows = static_cast<const E*>(args.query) + row_index * args.query_seq_stride +
                        int64_t(item.kv_head) * group * args.query_head_stride;
  for (int g = 0; g < group; ++g) {
    const E* row = query_rows + g * args.query_head_stride;
    for (int d = 0; d < head_dim; ++d) query[g * head_dim + d] = to_float(row[d]) * args.scale;
    max[g] = -INFINITY;
    sum[g] = 0.0f;
  }
  for (int64_t i = 0; i < int64_t(group) * head_dim; ++i) acc[i] = 0.0f;

  const int cache = args.cache_index != nullptr ? args.cache_index[item.seq] : -1;
  const E* key_cache = static_cast<const E*>(cache >= 0 ? args.key_caches[cache] : args.key_cache);
  const E* value_cache = static_cast<const E*>(cache >= 0 ? args.value_caches[cache] : args.value_cache);
  const int32_t* block_table = args.block_tables + item.seq * args.block_table_stride;
  const int64_t slab_elems = int64_t(block_size) * head_dim;
  const int segment_tokens = segment_capacity(block_size);

  // Cuts [token, item.token_end) into the pieces of one segment (whole blocks, at most segment_tokens tokens,
  // the first piece may start mid-block at a panel boundary); returns the number of pieces.
  auto build_segment = [&](int token, Piece<E>* pieces) {
    int num = 0;
    int taken = 0;
    while (token < item.token_end && taken < segment_tokens) {
      const int b = token / block_size;
      const int begin = token - b * block_size;
      int end = item.token_end - b * block_size < block_size ? item.token_end - b * block_size : block_size;
      if (end - begin > segment_tokens - taken) end = begin + segment_tokens - taken;
      const int64_t slab = (int64_t(block_table[b]) * args.num_kv_heads + item.kv_head) * slab_elems;
      pieces[num++] = {key_cache + slab, value_cache + slab + int64_t(begin) * head_dim, begin / kPanelTokens,
                       end - begin};
      taken += end - begin;
      token += end - begin;
    }
    return num;
  };

  // The segment processed now and the next one, whose K and V are prefetched meanwhile.
  Piece<E> buffers[2][kMaxSegmentPieces];
  Piece<E>* current = buffers[0];
  Piece<E>* next = buffers[1];
  int token = item.token_begin;
  int num_current = build_segment(token, current);
  // The first segment has had no predecessor to prefetch it: request all its lines at once, so its misses
  // overlap instead of arriving one panel at a time.
  for (int i = 0; i < num_current; ++i) {
    const Piece<E>& piece = current[i];
    const int panels = (piece.count + kPanelTokens - 1) / kPanelTokens;
    prefetch_bytes(piece.key_slab + int64_t(piece.panel_begin) * kPanelTokens * head_dim,
                   int64_t(panels) * kPanelTokens * head_dim * int64_t(sizeof(E)));
    prefetch_bytes(piece.values, int64_t(piece.count) * head_dim * int64_t(sizeof(E)));
  }
  while (num_current > 0) {
    int count = 0;
    for (int i = 0; i < num_current; ++i) count += current[i].count;
    token += count;
    const int num_next = build_segment(token, next);
    score_segment<E>(current, num_current, next, num_next, query, group, head_dim, scores, segment_tokens);
    softmax_segment(scores, segment_tokens, count, group, max, sum, alpha);
    value_segment<E>(current, num_current, next, num_next, scores, segment_tokens, group, head_dim, alpha, acc);
    Piece<E>* done = current;
    current = next;
    next = done;
    num_current = num_next;
  }

  if (item.partial_index < 0) {
    E* out = static_cast<E*>(args.out) + (row_index * args.num_heads + int64_t(item.kv_head) * group) * head_dim;
    for (int g = 0; g < group; ++g) {
      store_row(out + int64_t(g) * head_dim, acc + int64_t(g) * head_dim, 1.0f / sum[g], head_dim);
    }
  } else {
    float* partial = plan.partials + int64_t(item.partial_index) * group * (head_dim + 2);
    for (int64_t i = 0; i < int64_t(group) * head_dim; ++i) partial[i] = acc[i];
    for (int g = 0; g < group; ++g) {
      partial[int64_t(group) * head_dim + g] = max[g];
      partial[int64_t(group) * (head_dim + 1) + g] = sum[g];
    }
  }
}

// Log-sum-exp merge of the partial results of one (seq, kv_head).
template <class E>
void merge_task(const PagedAttentionArgs& args, const WorkPlanView& plan, const MergeTask& task, float* scratch) {
  const int group = args.num_heads / args.num_kv_heads;
  const int head_dim = args.head_dim;
  const int64_t partial_floats = int64_t(group) * (head_dim + 2);
  const float* first = plan.partials + task.first_partial * partial_floats;
  float* weights = scratch + plan.scratch.weights;
  float* row = scratch + plan.scratch.acc;
  const int64_t row_index = args.rows != nullptr ? args.rows[task.seq] : task.seq;
  E* out = static_cast<E*>(args.out) + (row_index * args.num_heads + int64_t(task.kv_head) * group) * head_dim;
  for (int g = 0; g < group; ++g) {
    float global_max = -INFINITY;
    for (int i = 0; i < task.num_partials; ++i) {
      const float m = first[i * partial_floats + int64_t(group) * head_dim + g];
      global_max = m > global_max ? m : global_max;
    }
    float total = 0.0f;
    for (int i = 0; i < task.num_partials; ++i) {
      const float* partial = first + i * partial_floats;
      weights[i] = std::exp(partial[int64_t(group) * head_dim + g] - global_max);
      total += weights[i] * partial[int64_t(group) * (head_dim + 1) + g];
    }
    for (int d = 0; d < head_dim; d += kPanelTokens) {
      V16 o = v_zero();
      for (int i = 0; i < task.num_partials; ++i) {
        o = v_fma(v_set1(weights[i]), v_loadf(first + i * partial_floats + int64_t(g) * head_dim + d), o);
      }
      v_storef(row + d, o);
    }
    store_row(out + int64_t(g) * head_dim, row, 1.0f / total, head_dim);
  }
}

// The items shared out over the threads of the enclosing parallel region (an orphaned loop: outside one, the
// calling thread runs them all).
// Item i of the plan with `scratch`, then its task's merge if it wrote the task's last partial.
template <class E>
void run_item(const PagedAttentionArgs& args, const WorkPlanView& plan, int64_t i, float* scratch) {
  const WorkItem& item = plan.items[i];
  process_item<E>(args, plan, item, scratch);
  // acq_rel: the thread that writes a task's last partial sees the other partials' writes.
  if (item.merge_index >= 0 && plan.merge_pending[item.merge_index].fetch_sub(1, std::memory_order_acq_rel) == 1) {
    merge_task<E>(args, plan, plan.merges[item.merge_index], scratch);
  }
}

template <class E>
void run_items(const PagedAttentionArgs& args, const WorkPlanView& plan) {
  float* scratch = plan.thread_scratch + int64_t(omp_get_thread_num()) * plan.scratch.total;
#pragma omp for schedule(dynamic, 1) nowait
  for (int64_t i = 0; i < plan.num_items; ++i) run_item<E>(args, plan, i, scratch);
}

template <class E>
void run(const PagedAttentionArgs& args, const WorkPlanView& plan) {
  if (plan.in_team) {
    run_items<E>(args, plan);
    return;
  }
  const int threads = plan.num_threads;
#pragma omp parallel num_threads(threads) if (threads > 1)
  run_items<E>(args, plan);
}

inline void run_dtype(const PagedAttentionArgs& args, const WorkPlanView& plan) {
  switch (args.dtype) {
    case DType::F32: run<float>(args, plan); break;
    case DType::BF16: run<Bf16>(args, plan); break;
    case DType::F16: run<Fp16>(args, plan); break;
  }
}

// One item by the calling thread with the scratch of team thread `thread` (a caller sharing items out itself).
inline void run_item_dtype(const PagedAttentionArgs& args, const WorkPlanView& plan, int64_t i, int thread) {
  float* scratch = plan.thread_scratch + int64_t(thread) * plan.scratch.total;
  switch (args.dtype) {
    case DType::F32: run_item<float>(args, plan, i, scratch); break;
    case DType::BF16: run_item<Bf16>(args, plan, i, scratch); break;
    case DType::F16: run_item<Fp16>(args, plan, i, scratch); break;
  }
}

}  // namespace APEX_ISA_NS
}  // namespace apex_cpu
