#include "daemon/engine/prefill_progress.h"

#include <algorithm>

#include "fmt/format.h"

namespace kvpool::daemon {

model::StepItem PrefillProgress::NextChunk(int64_t max_tokens) const {
  const int64_t n = std::clamp<int64_t>(max_tokens, 1, left());
  return {
      .tokens =
          std::span(item_.tokens).subspan(static_cast<size_t>(computed_), static_cast<size_t>(n)),
      .start = item_.start + computed_,
      .block_table = item_.table,
      .history = item_.history,
      .window_table = item_.window_table};
}

bool PrefillProgress::SameWindow(const Sequence& seq) const {
  if (seq.window_table.size() < item_.window_table.size()) return false;
  for (size_t i = 0; i < item_.window_table.size(); ++i) {
    const int32_t b = item_.window_table[i];
    if (b >= 0 && seq.window_table[i] != BlockId(b)) return false;
  }
  return true;
}

absl::Status PrefillProgress::StillHolds(const KvCacheManager& cache, SessionId owner) const {
  const Sequence* seq = cache.Find(item_.sequence);
  const int64_t end = item_.start + static_cast<int64_t>(item_.tokens.size());
  const bool same = seq != nullptr && seq->session == owner && seq->num_tokens == end &&
                    seq->state_slot == item_.state_slot &&
                    seq->table.size() >= item_.table.size() &&
                    std::equal(item_.table.begin(), item_.table.end(), seq->table.begin(),
                               [](int32_t a, BlockId b) { return a == b.value(); }) &&
                    SameWindow(*seq);
  if (same) return absl::OkStatus();
  return absl::AbortedError(fmt::format(
      "sequence {} was freed or changed while its prefill was in progress ({} of {} prompt "
      "tokens computed)",
      item_.sequence.value(), computed_, item_.tokens.size()));
}

}  // namespace kvpool::daemon
