#pragma once

// How a step's tokens are laid out for the dense layers and the two attention kernels, the same
// for both step models (the host's and the CUDA backend's; header-only for that reason).
//
// Rows (the step's tokens) go item by item, decode items first: an item with one new token is a
// sequence of the decode kernel, rows [0, num_decode); an item with several is a sequence of the
// prefill kernel, rows [num_decode, num_tokens), each item's tokens together. The dense layers do
// not care about the order; each item's result is read from its last row. An item marked
// `in_prefill` (a piece of a longer prefill cut at a state checkpoint: StepModel::RunPhase) goes
// to the prefill kernel whatever its length, as the tokens of a step ending there do.
//
// With a window group (docs/hybrid-groups.md §2) each sequence also has a packed window table and
// each row a window slot, for the sliding layers: the same rows and sequences, window block ids.

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "model/step_model.h"

namespace kvpool::model::internal {

struct StepLayout {
  int64_t num_tokens = 0;
  int32_t num_decode = 0;   // decode items = their rows, [0, num_decode)
  int32_t num_prefill = 0;  // prefill items; rows [num_decode, num_tokens)
  int32_t stride = 0;       // block table stride: blocks of the longest item after the step
  int32_t max_len = 0;      // the longest item's length after the step
  int32_t max_q_len = 0;    // most new tokens of a prefill item (0 without one)
  // Per row.
  std::vector<int32_t> tokens;
  std::vector<int32_t> positions;
  std::vector<int64_t> slots;         // block * block_size + offset of the row's K/V
  std::vector<int64_t> window_slots;  // the same in the window group (with one, else empty)
  // Per sequence of the kernels, decode items first: [num_decode + num_prefill].
  std::vector<int32_t> tables;  // [..][stride], padded with block 0
  // [..][stride]: the window tables (with a window group, else empty), released entries (< 0)
  // as the items give them, padded with block 0.
  std::vector<int32_t> window_tables;
  std::vector<int32_t> lens;      // length after the step
  std::vector<int32_t> q_starts;  // [num_prefill + 1] prefill rows, counted from num_decode
  // Per item, in the caller's order.
  std::vector<int32_t> last_rows;  // row of the item's last token
};

// Fills `out` (its vectors are reused). `in_prefill`: empty, or one entry per item (nonzero: a
// prefill item even with one token). `window_group`: the pool has one (the items' window tables
// are packed too). REQUIRES: StepModel::Step's checks passed.
inline void PlanStepLayout(std::span<const StepItem> items, std::span<const uint8_t> in_prefill,
                           int32_t block_size, bool window_group, StepLayout* out) {
  StepLayout& L = *out;
  const auto decode_item = [&](size_t i) {
    return items[i].tokens.size() == 1 && (in_prefill.empty() || in_prefill[i] == 0);
  };
  L.num_tokens = 0;
  L.num_decode = L.num_prefill = L.stride = L.max_len = L.max_q_len = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    const StepItem& it = items[i];
    const auto q_len = static_cast<int32_t>(it.tokens.size());
    const auto len = static_cast<int32_t>(it.start + q_len);
    L.num_tokens += q_len;
    L.stride = std::max(L.stride, (len + block_size - 1) / block_size);
    L.max_len = std::max(L.max_len, len);
    if (decode_item(i)) {
      ++L.num_decode;
    } else {
      ++L.num_prefill;
      L.max_q_len = std::max(L.max_q_len, q_len);
    }
  }
  const size_t n = static_cast<size_t>(L.num_tokens);
  const size_t seqs = static_cast<size_t>(L.num_decode + L.num_prefill);
  L.tokens.resize(n);
  L.positions.resize(n);
  L.slots.resize(n);
  L.tables.assign(seqs * static_cast<size_t>(L.stride), 0);
  L.window_slots.resize(window_group ? n : 0);
  L.window_tables.assign(window_group ? seqs * static_cast<size_t>(L.stride) : 0, 0);
  L.lens.resize(seqs);
  L.q_starts.assign(1, 0);
  L.last_rows.resize(items.size());
  // Decode items take sequences [0, num_decode) in item order, prefill items the rest.
  size_t decode_seq = 0, prefill_seq = static_cast<size_t>(L.num_decode);
  size_t decode_row = 0, prefill_row = static_cast<size_t>(L.num_decode);
  for (size_t i = 0; i < items.size(); ++i) {
    const StepItem& it = items[i];
    const bool decode = decode_item(i);
    size_t& seq = decode ? decode_seq : prefill_seq;
    size_t& row = decode ? decode_row : prefill_row;
    const auto len = static_cast<int32_t>(it.start + static_cast<int64_t>(it.tokens.size()));
    const size_t blocks = static_cast<size_t>((len + block_size - 1) / block_size);
    std::copy_n(it.block_table.begin(), blocks, L.tables.begin() + seq * L.stride);
    if (window_group) {
      std::copy_n(it.window_table.begin(), blocks, L.window_tables.begin() + seq * L.stride);
    }
    L.lens[seq++] = len;
    for (size_t j = 0; j < it.tokens.size(); ++j, ++row) {
      const int64_t pos = it.start + static_cast<int64_t>(j);
      L.tokens[row] = it.tokens[j];
      L.positions[row] = static_cast<int32_t>(pos);
      const size_t b = static_cast<size_t>(pos / block_size);
      L.slots[row] = static_cast<int64_t>(it.block_table[b]) * block_size + pos % block_size;
      if (window_group) {
        L.window_slots[row] =
            static_cast<int64_t>(it.window_table[b]) * block_size + pos % block_size;
      }
    }
    L.last_rows[i] = static_cast<int32_t>(row - 1);
    if (!decode) {
      L.q_starts.push_back(static_cast<int32_t>(row) - L.num_decode);
    }
  }
}

}  // namespace kvpool::model::internal
