// kvpool's cache events in vLLM's KV-event wire format (vllm_events.h).

#include "daemon/edge/vllm_events.h"

#define MSGPACK_NO_BOOST
#include <msgpack.hpp>

namespace kvpool::daemon {
namespace {

using Packer = msgpack::packer<msgpack::sbuffer>;

void PackStr(Packer& p, std::string_view s) {
  p.pack_str(static_cast<uint32_t>(s.size()));
  p.pack_str_body(s.data(), static_cast<uint32_t>(s.size()));
}

void PackHash(Packer& p, const BlockHash& h) {
  char bytes[16];
  for (int i = 0; i < 8; ++i) {
    bytes[i] = static_cast<char>(h.hi >> (56 - 8 * i));
    bytes[8 + i] = static_cast<char>(h.lo >> (56 - 8 * i));
  }
  p.pack_bin(sizeof(bytes));
  p.pack_bin_body(bytes, sizeof(bytes));
}

void PackHashes(Packer& p, const std::vector<BlockHash>& hashes) {
  p.pack_array(static_cast<uint32_t>(hashes.size()));
  for (const BlockHash& h : hashes) PackHash(p, h);
}

void PackEvent(Packer& p, const KvEvent& e) {
  switch (e.type) {
    case KvEventType::kBlockStored:
      p.pack_array(e.group ? 12 : 7);
      PackStr(p, "BlockStored");
      PackHashes(p, e.block_hashes);
      if (e.parent_hash) {
        PackHash(p, *e.parent_hash);
      } else {
        p.pack_nil();
      }
      p.pack_array(static_cast<uint32_t>(e.token_ids.size()));
      for (int32_t t : e.token_ids) p.pack_int32(t);
      p.pack_int32(e.block_size);
      p.pack_nil();  // lora_id
      PackStr(p, VllmMedium(e.medium));
      if (e.group) {
        p.pack_nil();  // lora_name
        p.pack_nil();  // extra_keys
        p.pack_int32(e.group->index);
        PackStr(p, GroupKindName(e.group->kind));
        if (e.group->kind == KvGroupKind::kSlidingWindow) {
          p.pack_int32(e.group->sliding_window);
        } else {
          p.pack_nil();
        }
      }
      return;
    case KvEventType::kBlockRemoved:
      p.pack_array(e.group ? 4 : 3);
      PackStr(p, "BlockRemoved");
      PackHashes(p, e.block_hashes);
      PackStr(p, VllmMedium(e.medium));
      if (e.group) p.pack_int32(e.group->index);
      return;
    case KvEventType::kAllBlocksCleared:
      p.pack_array(1);
      PackStr(p, "AllBlocksCleared");
      return;
  }
}

}  // namespace

std::string_view VllmMedium(KvMedium medium) {
  switch (medium) {
    case KvMedium::kDevice:
      return "GPU";
    case KvMedium::kHost:
      return "CPU";
    case KvMedium::kDisk:
      return "DISK";
  }
  return "GPU";
}

std::string EncodeVllmBatch(std::span<const KvEvent> events, double ts, int64_t data_parallel_rank,
                            bool clear_first) {
  msgpack::sbuffer buffer;
  Packer p(&buffer);
  p.pack_array(3);
  p.pack_double(ts);
  p.pack_array(static_cast<uint32_t>(events.size() + (clear_first ? 1 : 0)));
  if (clear_first) {
    p.pack_array(1);
    PackStr(p, "AllBlocksCleared");
  }
  for (const KvEvent& e : events) PackEvent(p, e);
  p.pack_int64(data_parallel_rank);
  return std::string(buffer.data(), buffer.size());
}

}  // namespace kvpool::daemon
