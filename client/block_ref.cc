#include "client/block_ref.h"

#include <algorithm>

#include "fmt/format.h"

namespace kvpool::client {
namespace {

// One table's part of a reply, read in place: a SequenceInfo's arrays, or one item's slice of a
// GrowResponse's concatenated tails. Every check and every apply goes through it, so that both
// forms are held to the same rules.
struct Tail {
  uint64_t sequence_id = 0;
  int64_t table_offset = 0;
  std::span<const int32_t> block_ids;
  std::span<const uint32_t> generations;
  std::span<const int32_t> window_block_ids;
  std::span<const uint32_t> window_generations;
  int64_t window_released_begin = 0;
  int64_t window_released_end = 0;

  bool has_window() const {
    return !window_block_ids.empty() || !window_generations.empty() || window_released_begin != 0 ||
           window_released_end != 0;
  }
};

template <typename T>
std::span<const T> Span(const google::protobuf::RepeatedField<T>& field) {
  return {field.data(), static_cast<size_t>(field.size())};
}

Tail TailOf(const v1::SequenceInfo& info) {
  return Tail{.sequence_id = info.sequence_id(),
              .table_offset = info.table_offset(),
              .block_ids = Span(info.block_ids()),
              .generations = Span(info.generations()),
              .window_block_ids = Span(info.window_block_ids()),
              .window_generations = Span(info.window_generations()),
              .window_released_begin = info.window_released_begin(),
              .window_released_end = info.window_released_end()};
}

// The window half of ValidateTail (the block half has passed).
absl::Status ValidateWindow(const Tail& t) {
  if (!t.has_window()) return absl::OkStatus();
  const uint64_t id = t.sequence_id;
  const size_t n = t.block_ids.size();
  if (t.window_block_ids.size() != n || t.window_generations.size() != n) {
    return absl::InvalidArgumentError(
        fmt::format("sequence {}: {} blocks but {} window block ids and {} window generations", id,
                    n, t.window_block_ids.size(), t.window_generations.size()));
  }
  const int64_t begin = t.window_released_begin;
  const int64_t end = t.window_released_end;
  const int64_t size = t.table_offset + static_cast<int64_t>(n);
  if (begin < 0 || begin > end || end > size) {
    return absl::InvalidArgumentError(
        fmt::format("sequence {}: released window run [{}, {}) outside a table of {} entries", id,
                    begin, end, size));
  }
  // Past the last window block: entries not allocated yet (a prefill in chunks takes them as it
  // goes), -1 like released ones.
  size_t allocated = n;
  while (allocated > 0 && t.window_block_ids[allocated - 1] < 0) --allocated;
  for (size_t i = 0; i < n; ++i) {
    const int64_t entry = t.table_offset + static_cast<int64_t>(i);
    const bool released = (entry >= begin && entry < end) || i >= allocated;
    const int32_t w = t.window_block_ids[i];
    if (released ? (w != -1 || t.window_generations[i] != 0) : w < 0) {
      return absl::InvalidArgumentError(fmt::format(
          "sequence {}: window entry {} is {} (generation {}), but the released run is [{}, {})",
          id, entry, w, t.window_generations[i], begin, end));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateTail(const Tail& t) {
  if (t.block_ids.size() != t.generations.size()) {
    return absl::InvalidArgumentError(fmt::format("sequence {}: {} block ids but {} generations",
                                                  t.sequence_id, t.block_ids.size(),
                                                  t.generations.size()));
  }
  if (t.table_offset < 0) {
    return absl::InvalidArgumentError(
        fmt::format("sequence {}: negative table_offset {}", t.sequence_id, t.table_offset));
  }
  for (size_t i = 0; i < t.block_ids.size(); ++i) {
    if (t.block_ids[i] < 0) {
      return absl::InvalidArgumentError(fmt::format("sequence {}: negative block id {} at entry {}",
                                                    t.sequence_id, t.block_ids[i],
                                                    t.table_offset + static_cast<int64_t>(i)));
    }
  }
  return ValidateWindow(t);
}

// ApplyGrow's check against the held table (`code`: what a table that does not fit is), and its
// change (after the check passed).
absl::Status CheckBlocksFit(const Tail& t, const std::vector<BlockRef>& table,
                            absl::StatusCode code) {
  if (static_cast<size_t>(t.table_offset) <= table.size()) return absl::OkStatus();
  return absl::Status(
      code,
      fmt::format("sequence {}: grow tail starts at entry {} but the held table has {} entries",
                  t.sequence_id, t.table_offset, table.size()));
}

void ApplyBlocks(const Tail& t, std::vector<BlockRef>* table) {
  const auto offset = static_cast<size_t>(t.table_offset);
  const size_t end = offset + t.block_ids.size();
  if (end > table->size()) table->resize(end);
  for (size_t i = 0; i < t.block_ids.size(); ++i) {
    (*table)[offset + i] = BlockRef{t.block_ids[i], t.generations[i]};
  }
}

// ApplyWindowGrow's, the same way.
absl::Status CheckWindowFits(const Tail& t, const std::vector<BlockRef>& window_table,
                             absl::StatusCode code) {
  if (!t.has_window()) {
    if (t.block_ids.empty()) return absl::OkStatus();  // no change
    return absl::InvalidArgumentError(fmt::format(
        "sequence {}: a grow tail without a window table (the pool has no window group?)",
        t.sequence_id));
  }
  if (static_cast<size_t>(t.table_offset) <= window_table.size()) return absl::OkStatus();
  return absl::Status(
      code,
      fmt::format(
          "sequence {}: grow tail starts at entry {} but the held window table has {} entries",
          t.sequence_id, t.table_offset, window_table.size()));
}

void ApplyWindow(const Tail& t, std::vector<BlockRef>* window_table) {
  if (!t.has_window()) return;
  const auto offset = static_cast<size_t>(t.table_offset);
  const size_t end = offset + t.window_block_ids.size();
  if (end > window_table->size()) window_table->resize(end);
  const auto released_end =
      std::min(window_table->size(), static_cast<size_t>(t.window_released_end));
  for (auto e = static_cast<size_t>(t.window_released_begin); e < released_end; ++e) {
    (*window_table)[e] = BlockRef{-1, 0};
  }
  for (size_t i = 0; i < t.window_block_ids.size(); ++i) {
    (*window_table)[offset + i] = BlockRef{t.window_block_ids[i], t.window_generations[i]};
  }
}

// A GrowResponse read item by item: the shape checked once, then each item's tail in place.
class GrowTails {
 public:
  // Errors: INVALID_ARGUMENT when the parallel arrays disagree in length with each other or with
  // the `n` items.
  static absl::StatusOr<GrowTails> Read(const v1::GrowResponse& r, size_t n) {
    const auto items = static_cast<int>(n);
    const int blocks = r.block_ids_size();
    const bool window = r.window_block_ids_size() > 0 || r.window_generations_size() > 0 ||
                        r.window_released_begin_size() > 0 || r.window_released_end_size() > 0;
    if (r.num_tokens_size() != items || r.table_offsets_size() != items ||
        r.tail_lengths_size() != items || r.generations_size() != blocks ||
        (window &&
         (r.window_released_begin_size() != items || r.window_released_end_size() != items ||
          r.window_block_ids_size() != blocks || r.window_generations_size() != blocks))) {
      return absl::InvalidArgumentError("arrays of the wrong length");
    }
    return GrowTails(r, window);
  }

  // Item i's tail, the items read in order. Errors: INVALID_ARGUMENT when it lies outside the
  // response or fails ValidateSequenceInfo's checks.
  absl::StatusOr<Tail> Next(int i, uint64_t sequence_id) {
    const int length = r_.tail_lengths(i);
    if (length < 0 || r_.table_offsets(i) < 0 || next_ + length > r_.block_ids_size()) {
      return absl::InvalidArgumentError("a tail outside the response");
    }
    const Tail t = Take(i, sequence_id);
    if (absl::Status s = ValidateTail(t); !s.ok()) return s;
    return t;
  }

  // The same, unchecked, for a response that Next has read whole without an error.
  Tail NextChecked(int i, uint64_t sequence_id) { return Take(i, sequence_id); }

  bool window() const { return window_; }  // the pool has a window group

  // Errors: INVALID_ARGUMENT when the items' tails left blocks over.
  absl::Status Finish() const {
    if (next_ != r_.block_ids_size()) return absl::InvalidArgumentError("blocks left over");
    return absl::OkStatus();
  }

 private:
  GrowTails(const v1::GrowResponse& r, bool window) : r_(r), window_(window) {}

  Tail Take(int i, uint64_t sequence_id) {
    const auto from = static_cast<size_t>(next_);
    const auto n = static_cast<size_t>(r_.tail_lengths(i));
    Tail t{.sequence_id = sequence_id,
           .table_offset = r_.table_offsets(i),
           .block_ids = Span(r_.block_ids()).subspan(from, n),
           .generations = Span(r_.generations()).subspan(from, n)};
    if (window_) {
      t.window_block_ids = Span(r_.window_block_ids()).subspan(from, n);
      t.window_generations = Span(r_.window_generations()).subspan(from, n);
      t.window_released_begin = r_.window_released_begin(i);
      t.window_released_end = r_.window_released_end(i);
    }
    next_ += static_cast<int>(n);
    return t;
  }

  const v1::GrowResponse& r_;
  bool window_;
  int next_ = 0;
};

// Calls fn(i, tail) for each item's tail of `r` (held[i]: item i's), in order; the first error,
// the response's or fn's, ends it. kChecked: `r` has been read whole without an error before, and
// is not checked again.
template <bool kChecked, typename Fn>
absl::Status ForEachTail(const v1::GrowResponse& r, std::span<const HeldSequence> held, Fn fn) {
  absl::StatusOr<GrowTails> tails = GrowTails::Read(r, held.size());
  if (!tails.ok()) return tails.status();
  for (size_t i = 0; i < held.size(); ++i) {
    const auto item = static_cast<int>(i);
    if constexpr (kChecked) {
      if (absl::Status s = fn(i, tails->NextChecked(item, held[i].sequence_id)); !s.ok()) return s;
    } else {
      absl::StatusOr<Tail> t = tails->Next(item, held[i].sequence_id);
      if (!t.ok()) return t.status();
      if (absl::Status s = fn(i, *t); !s.ok()) return s;
    }
  }
  return kChecked ? absl::OkStatus() : tails->Finish();
}

}  // namespace

absl::Status ValidateSequenceInfo(const v1::SequenceInfo& info) {
  return ValidateTail(TailOf(info));
}

std::vector<BlockRef> ToBlockRefs(const v1::SequenceInfo& info) {
  const int n = std::min(info.block_ids_size(), info.generations_size());
  std::vector<BlockRef> refs;
  refs.reserve(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) refs.push_back(BlockRef{info.block_ids(i), info.generations(i)});
  return refs;
}

std::vector<BlockRef> ToWindowRefs(const v1::SequenceInfo& info) {
  const int n = std::min(info.window_block_ids_size(), info.window_generations_size());
  std::vector<BlockRef> refs;
  refs.reserve(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    refs.push_back(BlockRef{info.window_block_ids(i), info.window_generations(i)});
  }
  return refs;
}

HeldSequence ToHeld(const v1::SequenceInfo& info) {
  return HeldSequence{.sequence_id = info.sequence_id(),
                      .num_tokens = info.num_tokens(),
                      .table = ToBlockRefs(info),
                      .window_table = ToWindowRefs(info)};
}

absl::StatusOr<std::vector<v1::SequenceInfo>> SplitGrowResponse(
    const v1::GrowResponse& r, std::span<const uint64_t> sequence_ids) {
  absl::StatusOr<GrowTails> tails = GrowTails::Read(r, sequence_ids.size());
  if (!tails.ok()) return tails.status();
  std::vector<v1::SequenceInfo> out(sequence_ids.size());
  for (size_t i = 0; i < sequence_ids.size(); ++i) {
    absl::StatusOr<Tail> t = tails->Next(static_cast<int>(i), sequence_ids[i]);
    if (!t.ok()) return t.status();
    v1::SequenceInfo& info = out[i];
    info.set_sequence_id(t->sequence_id);
    info.set_num_tokens(r.num_tokens(static_cast<int>(i)));
    info.set_table_offset(static_cast<int32_t>(t->table_offset));
    info.mutable_block_ids()->Add(t->block_ids.begin(), t->block_ids.end());
    info.mutable_generations()->Add(t->generations.begin(), t->generations.end());
    if (tails->window()) {
      info.set_window_released_begin(t->window_released_begin);
      info.set_window_released_end(t->window_released_end);
      info.mutable_window_block_ids()->Add(t->window_block_ids.begin(), t->window_block_ids.end());
      info.mutable_window_generations()->Add(t->window_generations.begin(),
                                             t->window_generations.end());
    }
  }
  if (absl::Status s = tails->Finish(); !s.ok()) return s;
  return out;
}

absl::Status ApplyGrowResponse(const v1::GrowResponse& response, std::span<HeldSequence> held) {
  // Three readings: the whole response checked, then every tail against its held tables, then
  // applied; so an error changes nothing, and a malformed response is told as such whatever is
  // held. (No copy of the tails is kept between the readings: a decode step's batch is hundreds
  // of items, most with nothing to apply.)
  constexpr absl::StatusCode kStale = absl::StatusCode::kFailedPrecondition;
  if (absl::Status s =
          ForEachTail<false>(response, held, [](size_t, const Tail&) { return absl::OkStatus(); });
      !s.ok()) {
    return s;
  }
  const bool window = response.window_released_begin_size() > 0;
  if (absl::Status s = ForEachTail<true>(
          response, held,
          [&](size_t i, const Tail& t) {
            if (absl::Status fit = CheckBlocksFit(t, held[i].table, kStale); !fit.ok() || !window) {
              return fit;
            }
            return CheckWindowFits(t, held[i].window_table, kStale);
          });
      !s.ok()) {
    return s;
  }
  return ForEachTail<true>(response, held, [&](size_t i, const Tail& t) {
    held[i].num_tokens = response.num_tokens(static_cast<int>(i));
    ApplyBlocks(t, &held[i].table);
    if (window) ApplyWindow(t, &held[i].window_table);
    return absl::OkStatus();
  });
}

absl::Status ApplyGrow(const v1::SequenceInfo& tail, std::vector<BlockRef>* table) {
  const Tail t = TailOf(tail);
  if (absl::Status s = ValidateTail(t); !s.ok()) return s;
  if (absl::Status s = CheckBlocksFit(t, *table, absl::StatusCode::kInvalidArgument); !s.ok()) {
    return s;
  }
  ApplyBlocks(t, table);
  return absl::OkStatus();
}

absl::Status ApplyWindowGrow(const v1::SequenceInfo& tail, std::vector<BlockRef>* window_table) {
  const Tail t = TailOf(tail);
  if (absl::Status s = ValidateTail(t); !s.ok()) return s;
  if (absl::Status s = CheckWindowFits(t, *window_table, absl::StatusCode::kInvalidArgument);
      !s.ok()) {
    return s;
  }
  ApplyWindow(t, window_table);
  return absl::OkStatus();
}

}  // namespace kvpool::client
