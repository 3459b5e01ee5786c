#pragma once

// kvpool's cache events in vLLM's KV-event wire format (vllm/distributed/kv_events.py, the
// msgspec structs with array_like=True, tag=True), so a router written for vLLM reads kvpool
// unchanged (docs/events.md). A batch is the msgpack array
//
//   [ts, [event, ...], data_parallel_rank]
//
// and an event the array of its tag (the struct's name) and its fields in declaration order:
//
//   ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
//   ["BlockRemoved", block_hashes, medium]
//   ["AllBlocksCleared"]
//
// In a pool of more than one layer group (KvEvent::group) Stored and Removed events go on with
// vLLM's later fields: Stored with lora_name (nil), extra_keys (nil), group_idx,
// kv_cache_spec_kind and kv_cache_spec_sliding_window (nil but for a window group); Removed
// with group_idx. A consumer decoding the shorter form ignores trailing fields (msgspec does).
//
// A block hash (vLLM's ExternalBlockHash, bytes | int) is kvpool's 128-bit hash as 16 bytes,
// big-endian (hi then lo); lora_id is nil; medium names where the blocks are as vLLM does: "GPU"
// (the device pool, whatever its backend), "CPU" (the host tier), "DISK" (the disk tier).
// Pure functions; thread-safe.

#include <span>
#include <string>
#include <string_view>

#include "kvpool/kv_events.h"

namespace kvpool::daemon {

// vLLM's name of `medium`.
std::string_view VllmMedium(KvMedium medium);

// One batch of `events` in order, stamped `ts` (seconds since the Unix epoch, vLLM's
// time.time()). `clear_first`: an AllBlocksCleared event before them (a resync after events
// were lost, docs/events.md).
std::string EncodeVllmBatch(std::span<const KvEvent> events, double ts, int64_t data_parallel_rank,
                            bool clear_first = false);

}  // namespace kvpool::daemon
