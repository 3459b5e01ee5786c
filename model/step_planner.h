#pragma once

// Turning Prefill and Decode requests into model steps against a KvCacheManager, and publishing
// what a step computed. The same three calls serve kvpoold (under its pool lock, with the step
// itself on the compute stream) and in-process users (tests, benchmarks):
//
//   PlanPrefill / PlanDecode   reserve the blocks (prefix match, grow by delta) -> PlannedItem
//   Model::Step                computes the items' tokens and writes their K/V
//   FinishItem                 records the tokens and commits the full blocks to the prefix cache
//   (UndoItem                  the step failed: give back what the plan took)
//
// A sequence's tokens split into those whose K/V is in the pool (`num_tokens`) and a pending one
// the caller holds: Prefill returns the first generated token without writing its K/V; the next
// Decode(seq, token) writes it and returns the one after.
//
// Not thread-safe: the caller serializes calls on one manager (the daemon's pool lock).

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "kvpool/kv_cache_manager.h"
#include "model/step_model.h"

namespace kvpool::model {

// One sequence's share of a step.
struct PlannedItem {
  SequenceId sequence;
  bool created = false;         // the plan made the sequence (a prefill of a new one)
  int64_t start = 0;            // tokens with K/V in the pool before the step
  int64_t reused = 0;           // prompt tokens the prefix cache supplied (new sequences)
  std::vector<int32_t> tokens;  // the tokens the step computes, from position `start`
  std::vector<int32_t> table;   // the sequence's block ids, covering start + tokens.size()
  // Its slot in the pool's state group (KvCacheManager::state_slot); kInvalidBlock without one.
  BlockId state_slot = kInvalidBlock;
  // Its table in the pool's window group (Sequence::window_table; -1 where the window has left
  // an entry), as long as `table`; empty without a window group.
  std::vector<int32_t> window_table;
  // Its window table's size before the step grew it (UndoItem gives back the entries the grow
  // added below `start`: GrowRequest::window_ahead); -1 for a sequence the step made.
  int32_t window_entries = -1;
  // The state checkpoints the step takes (KvCacheManager::PlanCheckpoints): positions in
  // (start, start + tokens.size()], ascending, each with its slot (StepItem::checkpoints).
  std::vector<PlannedCheckpoint> checkpoints;
  // What sampling penalties count (PenaltyHistory); empty unless the caller asked for them.
  std::vector<int32_t> history;

  StepItem AsStepItem() const {
    return {.tokens = tokens,
            .start = start,
            .block_table = table,
            .history = history,
            .window_table = window_table};
  }
};

// The tokens a penalized sample of `item` counts: the last kPenaltyWindow of the sequence's
// known tokens before item.start followed by item.tokens (a client that wrote K/V itself without
// committing its tokens leaves a gap that counts nothing). REQUIRES: the sequence exists.
std::vector<int32_t> PenaltyHistory(const KvCacheManager& cache, const PlannedItem& item);

// The model's StepItem::checkpoints for `item`'s checkpoints at positions in (from, to] of a
// step of its tokens [from, to): offsets from `from`, and each slot's state in `pool` (appended
// to `out`, which the caller keeps until the step has run).
void StepCheckpoints(const PlannedItem& item, int64_t from, int64_t to,
                     const kernels::KvPoolView& pool, int64_t state_bytes,
                     std::vector<StateCheckpoint>* out);

// What the model accepts: token ids in [0, vocab_size), and sequences of at most max_position
// tokens (the positions RoPE was trained for; ModelConfig::max_position).
struct TokenLimits {
  int32_t vocab_size = 0;
  int64_t max_position = 0;
};

// A prefill of `tokens`. With `sequence` == SequenceId(0), a new sequence in `ns`: the prompt is
// matched against the prefix cache and only the unmatched tail is computed (at least the last
// token, whose logits give the first generated token). With an existing sequence, `tokens` are
// appended after its current tokens (the next turn of a conversation).
// Errors: INVALID_ARGUMENT (no tokens, a token outside [0, vocab_size)), OUT_OF_RANGE (the
// sequence would outgrow max_position), FAILED_PRECONDITION (an existing sequence whose state was
// lost: KvCacheManager::CheckStateUsable), and those of KvCacheManager::AllocateBatch / GrowBatch
// (NOT_FOUND, PERMISSION_DENIED, RESOURCE_EXHAUSTED). Nothing changes on error. `plan` receives the
// device work to carry out before the step; `changes`, when given, what growing an existing
// sequence changed (for RevertGrow). `first_chunk` >= 0: the prefill is computed in chunks, the
// first of at most that many tokens, and only its window blocks are taken now
// (AllocateRequest::window_ahead; ExtendChunk takes each later chunk's).
absl::Status PlanPrefill(KvCacheManager& cache, SessionId caller, NamespaceId ns,
                         SequenceId sequence, std::span<const int32_t> tokens, int priority,
                         const TokenLimits& limits, PlannedItem* item, DevicePlan* plan,
                         std::vector<TableChange>* changes = nullptr, int64_t first_chunk = -1);

struct DecodeInput {
  SequenceId sequence;
  int32_t token = 0;  // the pending token: its K/V is written at position num_tokens
};

// One decode step for each input: grows each sequence by one token (all or none).
// Errors: INVALID_ARGUMENT (empty batch, a sequence listed twice, a token outside the
// vocabulary), OUT_OF_RANGE (a sequence already max_position tokens long), FAILED_PRECONDITION (a
// sequence whose state was lost: KvCacheManager::CheckStateUsable), and those of
// KvCacheManager::GrowBatch. Nothing changes on error. `changes`, when given, receives what the
// growth changed (for RevertGrow).
absl::Status PlanDecode(KvCacheManager& cache, SessionId caller,
                        std::span<const DecodeInput> inputs, const TokenLimits& limits,
                        std::vector<PlannedItem>* items, DevicePlan* plan,
                        std::vector<TableChange>* changes = nullptr);

// The step computed `item`: records that the sequence's state holds its tokens (AdvanceState),
// records its tokens as known and commits the sequence's full blocks to the prefix cache (and
// with them the step's checkpoints and window blocks), then slides its window past them
// (SlideWindow: the window blocks no later step reads are released, fenced) (a sequence whose
// earlier tokens are unknown, because its client wrote K/V itself, or whose blocks are no longer
// the ones the step wrote, because it was rewound and grown again meanwhile, is left unpublished).
// Errors: NOT_FOUND when the sequence was freed meanwhile.
absl::Status FinishItem(KvCacheManager& cache, SessionId caller, const PlannedItem& item);

// The step failed, or its caller gave up: frees a sequence the plan created, or rewinds one it
// grew to `start`. `ran`: the step may have run (in part), so a state it moved past `start`
// cannot be moved back: the sequence's state is lost (KvCacheManager::LoseState) and later steps
// of it are refused until a Truncate restores it. A sequence its client freed meanwhile is left
// as it is, and one its client changed meanwhile (rewound and grown again, or committed or slid
// past `start`: its own calls raced this one) keeps its tokens: the error says why.
absl::Status UndoItem(KvCacheManager& cache, SessionId caller, const PlannedItem& item, bool ran);

// Every block the step reads or writes (for KvCacheManager::MarkInFlight).
std::vector<BlockId> BlocksOf(std::span<const PlannedItem> items);
// Every state slot the step reads and writes, its checkpoints' included (for
// KvCacheManager::MarkStatesInFlight).
std::vector<BlockId> StatesOf(std::span<const PlannedItem> items);
// Every window block of the items' window tables (for KvCacheManager::MarkWindowInFlight).
std::vector<BlockId> WindowBlocksOf(std::span<const PlannedItem> items);

// A prefill computed in chunks (kvpoold): the sequence's first `computed` tokens are done.
// When the plan made the sequence, slides its window past them (SlideWindow) and marks the
// entries it released in `item->window_table` (-1), so that later chunks neither read nor fence
// them; a prefill of an existing sequence slides only when it finishes (UndoItem must be able to
// rewind it to item->start, whose window a slide would release). A sequence freed or rewound
// below `computed` meanwhile is left as it is.
void SlideChunk(KvCacheManager& cache, SessionId caller, int64_t computed, PlannedItem* item);
// Before the next chunk of a prefill in chunks, which ends at token `end`: takes the window
// blocks it writes (KvCacheManager::ExtendWindow, fills into `plan`) and puts them in
// `item->window_table`. Errors: those of ExtendWindow (RESOURCE_EXHAUSTED); nothing changes.
// REQUIRES: the sequence is as the plan left it (PrefillProgress::StillHolds).
absl::Status ExtendChunk(KvCacheManager& cache, SessionId caller, int64_t end, PlannedItem* item,
                         DevicePlan* plan);

}  // namespace kvpool::model
