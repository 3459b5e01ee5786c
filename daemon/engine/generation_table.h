#pragma once

// GenerationTable: the generation of every block of the pool (DESIGN.md §1: a client detects
// that a block was freed and handed out again by its (id, generation)), in a sealed memfd the
// daemon maps read-write and hands clients to map read-only (sealed F_SEAL_FUTURE_WRITE once the
// daemon has mapped it: a client cannot map it writable). Entries are written with release
// stores and read with acquire loads, so a client that sees a generation also sees the block
// table that named it.
//
// Thread-compatible for writers (the engine's lock); Get() may be called from any thread.

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "kvpool/util/strong_id.h"
#include "kvpool/util/unique_fd.h"

namespace kvpool::daemon {

class GenerationTable final {
 public:
  // Errors: INVALID_ARGUMENT (num_blocks <= 0), INTERNAL (memfd, seal or map failed).
  static absl::StatusOr<std::unique_ptr<GenerationTable>> Create(int32_t num_blocks);
  ~GenerationTable();  // unmaps; clients keep their own mappings

  GenerationTable(const GenerationTable&) = delete;
  GenerationTable& operator=(const GenerationTable&) = delete;

  // REQUIRES: 0 <= block < num_blocks() for both.
  void Publish(BlockId block, uint32_t generation) {
    __atomic_store_n(&table_[block.value()], generation, __ATOMIC_RELEASE);
  }
  uint32_t Get(BlockId block) const {
    return __atomic_load_n(&table_[block.value()], __ATOMIC_ACQUIRE);
  }

  // A new descriptor of the table for a client. Errors: INTERNAL.
  absl::StatusOr<UniqueFd> Export() const;
  int32_t num_blocks() const { return num_blocks_; }

 private:
  GenerationTable(UniqueFd fd, uint32_t* table, int32_t num_blocks)
      : fd_(std::move(fd)), table_(table), num_blocks_(num_blocks) {}

  const UniqueFd fd_;
  uint32_t* const table_;  // [num_blocks], mapped shared
  const int32_t num_blocks_;
};

}  // namespace kvpool::daemon
