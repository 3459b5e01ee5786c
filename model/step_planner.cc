#include "model/step_planner.h"

#include <algorithm>

#include "absl/container/flat_hash_set.h"
#include "fmt/format.h"
#include "kvpool/util/check.h"
#include "kvpool/util/status_macros.h"

namespace kvpool::model {
namespace {

absl::Status CheckTokens(std::span<const int32_t> tokens, int32_t vocab_size) {
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= vocab_size) {
      return absl::InvalidArgumentError(fmt::format(
          "token {} at index {} is outside the vocabulary [0, {})", tokens[i], i, vocab_size));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckLength(SequenceId sequence, int64_t length, const TokenLimits& limits) {
  if (length > limits.max_position) {
    return absl::OutOfRangeError(fmt::format(
        "sequence {} would be {} tokens long: the model's context is {} positions",
        sequence == SequenceId(0) ? std::string("(new)") : std::to_string(sequence.value()), length,
        limits.max_position));
  }
  return absl::OkStatus();
}

void FillTable(const Sequence& seq, PlannedItem* item) {
  item->table.clear();
  item->table.reserve(seq.table.size());
  for (BlockId b : seq.table) item->table.push_back(b.value());
  item->state_slot = seq.state_slot;
  item->window_table.clear();
  item->window_table.reserve(seq.window_table.size());
  for (BlockId b : seq.window_table) item->window_table.push_back(b.value());
}

// The window group: `seq` has computed its first `computed` tokens (a no-op without a window
// group). REQUIRES: `seq` is the caller's and computed <= seq.num_tokens (so it cannot fail).
void Slide(KvCacheManager& cache, SessionId caller, const Sequence& seq, int64_t computed) {
  if (cache.window() == nullptr) return;
  KVPOOL_CHECK_OK(cache.SlideWindow(caller, seq.id, computed));
}

}  // namespace

absl::Status PlanPrefill(KvCacheManager& cache, SessionId caller, NamespaceId ns,
                         SequenceId sequence, std::span<const int32_t> tokens, int priority,
                         const TokenLimits& limits, PlannedItem* item, DevicePlan* plan,
                         std::vector<TableChange>* changes, int64_t first_chunk) {
  if (tokens.empty()) return absl::InvalidArgumentError("prefill: no tokens");
  KVPOOL_RETURN_IF_ERROR(CheckTokens(tokens, limits.vocab_size));
  const int64_t len = static_cast<int64_t>(tokens.size());
  const Sequence* existing = sequence == SequenceId(0) ? nullptr : cache.Find(sequence);
  // (An unknown or foreign sequence: GrowBatch says so, and nothing about its length.)
  if (sequence == SequenceId(0) || (existing != nullptr && existing->session == caller)) {
    KVPOOL_RETURN_IF_ERROR(
        CheckLength(sequence, (existing ? existing->num_tokens : 0) + len, limits));
    if (existing != nullptr) KVPOOL_RETURN_IF_ERROR(cache.CheckStateUsable(*existing));
  }
  *item = PlannedItem{};
  if (sequence == SequenceId(0)) {
    // Match all but the last prompt token: its logits give the first generated token, so it is
    // computed even when the whole prompt is cached (and then written into a private block).
    const AllocateRequest request{.ns = ns,
                                  .num_tokens = len,
                                  .prompt = tokens.first(static_cast<size_t>(len - 1)),
                                  .priority = priority,
                                  .window_ahead = first_chunk};
    std::vector<AllocateResult> results;
    KVPOOL_RETURN_IF_ERROR(cache.AllocateBatch(caller, std::span(&request, 1), &results, plan));
    item->sequence = results[0].sequence;
    item->created = true;
    item->start = results[0].matched_tokens;
    item->reused = results[0].matched_tokens;
    item->tokens.assign(tokens.begin() + item->start, tokens.end());
  } else {
    const GrowRequest grow{sequence, (existing ? existing->num_tokens : 0) + len, first_chunk};
    const auto window_entries =
        existing ? static_cast<int32_t>(existing->window_table.size()) : int32_t{-1};
    KVPOOL_RETURN_IF_ERROR(cache.GrowBatch(caller, std::span(&grow, 1), plan, changes));
    item->window_entries = window_entries;
    item->sequence = sequence;
    item->start = grow.num_tokens - len;
    item->tokens.assign(tokens.begin(), tokens.end());
  }
  FillTable(*cache.Find(item->sequence), item);
  // Cannot fail: the sequence is the caller's and the step's range within it.
  KVPOOL_CHECK_OK(cache.PlanCheckpoints(caller, item->sequence, item->start,
                                        item->start + static_cast<int64_t>(item->tokens.size()),
                                        /*prefill=*/true, &item->checkpoints));
  return absl::OkStatus();
}

absl::Status PlanDecode(KvCacheManager& cache, SessionId caller,
                        std::span<const DecodeInput> inputs, const TokenLimits& limits,
                        std::vector<PlannedItem>* items, DevicePlan* plan,
                        std::vector<TableChange>* changes) {
  if (inputs.empty()) return absl::InvalidArgumentError("decode: empty batch");
  std::vector<GrowRequest> grows;
  grows.reserve(inputs.size());
  std::vector<int32_t> window_entries;
  window_entries.reserve(inputs.size());
  for (const DecodeInput& in : inputs) {
    KVPOOL_RETURN_IF_ERROR(CheckTokens(std::span(&in.token, 1), limits.vocab_size));
    const Sequence* seq = cache.Find(in.sequence);
    // (An unknown or foreign sequence: GrowBatch says so.)
    if (seq != nullptr && seq->session == caller) {
      KVPOOL_RETURN_IF_ERROR(CheckLength(in.sequence, seq->num_tokens + 1, limits));
      KVPOOL_RETURN_IF_ERROR(cache.CheckStateUsable(*seq));
    }
    grows.push_back({in.sequence, (seq ? seq->num_tokens : 0) + 1});
    window_entries.push_back(seq ? static_cast<int32_t>(seq->window_table.size()) : -1);
  }
  // GrowBatch checks ownership, duplicates and room, all before changing anything.
  KVPOOL_RETURN_IF_ERROR(cache.GrowBatch(caller, grows, plan, changes));
  items->clear();
  items->reserve(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    PlannedItem& item = items->emplace_back();
    item.sequence = inputs[i].sequence;
    item.start = grows[i].num_tokens - 1;
    item.tokens = {inputs[i].token};
    item.window_entries = window_entries[i];
    FillTable(*cache.Find(item.sequence), &item);
    KVPOOL_CHECK_OK(cache.PlanCheckpoints(caller, item.sequence, item.start, item.start + 1,
                                          /*prefill=*/false, &item.checkpoints));
  }
  return absl::OkStatus();
}

absl::Status FinishItem(KvCacheManager& cache, SessionId caller, const PlannedItem& item) {
  const Sequence* seq = cache.Find(item.sequence);
  if (seq == nullptr || seq->session != caller) {
    return absl::NotFoundError(
        fmt::format("sequence {} was freed during its step", item.sequence.value()));
  }
  const int64_t end = item.start + static_cast<int64_t>(item.tokens.size());
  const int64_t known = static_cast<int64_t>(seq->tokens.size());
  // Where nothing can be published, nothing is claimed of the state either (AdvanceState -1: no
  // checkpoint is taken from it).
  const auto unpublished = [&] { return cache.AdvanceState(caller, item.sequence, -1); };
  // The blocks the step wrote must still be the sequence's: a rewind and regrowth while the step
  // ran (a KV client's Truncate, then Grow) hands it fresh blocks the step never wrote.
  const size_t written = static_cast<size_t>((end + cache.block_size() - 1) / cache.block_size());
  const bool same_blocks =
      seq->table.size() >= written && item.table.size() >= written &&
      std::equal(item.table.begin(), item.table.begin() + static_cast<ptrdiff_t>(written),
                 seq->table.begin(), [](int32_t a, BlockId b) { return a == b.value(); });
  // Tokens before `start` the cache does not know (a client wrote their K/V itself), a sequence
  // rewound during the step, or one rewound and grown again: nothing can be published.
  if (known < item.start || known > end || seq->num_tokens < end || !same_blocks) {
    // Its window moves past what the step computed only while those tokens are its own: after a
    // rewind (and regrowth) its window is the regrown tokens', which its client computes next.
    if (seq->num_tokens >= end && same_blocks) Slide(cache, caller, *seq, end);
    return unpublished();
  }
  KVPOOL_RETURN_IF_ERROR(cache.AdvanceState(caller, item.sequence, end));
  const std::span<const int32_t> fresh =
      std::span(item.tokens).subspan(static_cast<size_t>(known - item.start));
  const int64_t block_size = cache.block_size();
  // Committed first: the tree keeps the window blocks of what it takes while they are live, so
  // the blocks the slide then releases stay cached for prompts that resume there.
  const absl::Status committed =
      cache.Commit(caller, item.sequence, end / block_size * block_size, fresh);
  Slide(cache, caller, *seq, end);
  return committed;
}

std::vector<int32_t> PenaltyHistory(const KvCacheManager& cache, const PlannedItem& item) {
  const Sequence& seq = *cache.Find(item.sequence);
  const size_t known = std::min(seq.tokens.size(), static_cast<size_t>(item.start));
  const size_t window = static_cast<size_t>(kPenaltyWindow);
  const size_t fresh = std::min(item.tokens.size(), window);
  const size_t before = std::min(known, window - fresh);
  std::vector<int32_t> out;
  out.reserve(before + fresh);
  out.insert(out.end(), seq.tokens.begin() + static_cast<ptrdiff_t>(known - before),
             seq.tokens.begin() + static_cast<ptrdiff_t>(known));
  out.insert(out.end(), item.tokens.end() - static_cast<ptrdiff_t>(fresh), item.tokens.end());
  return out;
}

absl::Status UndoItem(KvCacheManager& cache, SessionId caller, const PlannedItem& item, bool ran) {
  const Sequence* seq = cache.Find(item.sequence);
  if (seq == nullptr || seq->session != caller) return absl::OkStatus();  // freed meanwhile
  if (item.created) return cache.Free(caller, item.sequence);  // (cannot fail: the caller's)
  // Only the growth this step made, while the sequence is still as the step left it: after a
  // Truncate and Grow meanwhile its blocks past `start` are the ones the client was given then.
  const int64_t end = item.start + static_cast<int64_t>(item.tokens.size());
  const bool as_planned = seq->num_tokens == end && seq->table.size() == item.table.size() &&
                          std::equal(item.table.begin(), item.table.end(), seq->table.begin(),
                                     [](int32_t a, BlockId b) { return a == b.value(); });
  absl::Status undone = absl::OkStatus();
  if (seq->num_tokens <= item.start) {
    // Rewound meanwhile: nothing of the step's is left.
  } else if (!as_planned) {
    undone = absl::AbortedError(
        fmt::format("sequence {} was changed during its step: its tokens past {} stay",
                    item.sequence.value(), item.start));
  } else {
    // Refused where the client committed past `start` meanwhile (a state with no checkpoint
    // there) or slid its window past it: the tokens stay.
    undone = cache.TakeBackGrowth(caller, item.sequence, item.start, item.window_entries);
  }
  if (ran && item.state_slot != kInvalidBlock) {
    KVPOOL_CHECK_OK(cache.LoseState(caller, item.sequence));  // (the caller's: cannot fail)
  }
  return undone;
}

std::vector<BlockId> BlocksOf(std::span<const PlannedItem> items) {
  std::vector<BlockId> blocks;
  for (const PlannedItem& item : items) {
    for (int32_t b : item.table) blocks.push_back(BlockId(b));
  }
  std::sort(blocks.begin(), blocks.end());
  blocks.erase(std::unique(blocks.begin(), blocks.end()), blocks.end());
  return blocks;
}

std::vector<BlockId> StatesOf(std::span<const PlannedItem> items) {
  std::vector<BlockId> slots;
  for (const PlannedItem& item : items) {
    if (item.state_slot != kInvalidBlock) slots.push_back(item.state_slot);
    for (const PlannedCheckpoint& c : item.checkpoints) slots.push_back(c.slot);
  }
  return slots;  // distinct: a step holds a sequence once, and sequences never share a slot
}

std::vector<BlockId> WindowBlocksOf(std::span<const PlannedItem> items) {
  std::vector<BlockId> blocks;
  for (const PlannedItem& item : items) {
    for (int32_t b : item.window_table) {
      if (b >= 0) blocks.push_back(BlockId(b));
    }
  }
  std::sort(blocks.begin(), blocks.end());
  blocks.erase(std::unique(blocks.begin(), blocks.end()), blocks.end());
  return blocks;
}

void SlideChunk(KvCacheManager& cache, SessionId caller, int64_t computed, PlannedItem* item) {
  // Only a sequence the prefill made: UndoItem rewinds one it grew to item->start, whose window
  // a slide past it would release (Truncate refuses a length whose window is gone).
  if (!item->created) return;
  const Sequence* seq = cache.Find(item->sequence);
  if (seq == nullptr || seq->session != caller || seq->num_tokens < computed) return;
  Slide(cache, caller, *seq, computed);
  const size_t n = std::min(item->window_table.size(), seq->window_table.size());
  for (size_t i = 0; i < n; ++i) {
    if (seq->window_table[i] == kInvalidBlock) item->window_table[i] = -1;
  }
}

absl::Status ExtendChunk(KvCacheManager& cache, SessionId caller, int64_t end, PlannedItem* item,
                         DevicePlan* plan) {
  KVPOOL_RETURN_IF_ERROR(cache.ExtendWindow(caller, item->sequence, end, plan));
  const Sequence& seq = *cache.Find(item->sequence);
  for (size_t i = item->window_table.size(); i < seq.window_table.size(); ++i) {
    item->window_table.push_back(seq.window_table[i].value());
  }
  return absl::OkStatus();
}

void StepCheckpoints(const PlannedItem& item, int64_t from, int64_t to,
                     const kernels::KvPoolView& pool, int64_t state_bytes,
                     std::vector<StateCheckpoint>* out) {
  for (const PlannedCheckpoint& c : item.checkpoints) {
    if (c.position <= from || c.position > to) continue;
    out->push_back({.offset = c.position - from,
                    .state = {reinterpret_cast<float*>(pool.state(c.slot.value())),
                              static_cast<size_t>(state_bytes / sizeof(float))}});
  }
}

}  // namespace kvpool::model
