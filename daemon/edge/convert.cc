#include "daemon/edge/convert.h"

#include "daemon/metrics/stats_proto.h"
#include "fmt/format.h"
#include "kvpool/util/errors.h"
#include "kvpool/util/fmt.h"
#include "kvpool/util/status_macros.h"
#include "kvpool/v1/wire.h"
#include "tier/circuit_breaker.h"

namespace kvpool::daemon {
namespace {

const char* MediumName(KvMedium medium) {
  switch (medium) {
    case KvMedium::kDevice:
      return "device";
    case KvMedium::kHost:
      return "host";
    case KvMedium::kDisk:
      return "disk";
  }
  return "device";
}

v1::DType ToProto(kernels::DType d) {
  switch (d) {
    case kernels::DType::kF32:
      return v1::DTYPE_F32;
    case kernels::DType::kF16:
      return v1::DTYPE_F16;
    case kernels::DType::kBF16:
      return v1::DTYPE_BF16;
    case kernels::DType::kFp8E4M3:
      return v1::DTYPE_FP8_E4M3;
    case kernels::DType::kInt8:
      return v1::DTYPE_INT8;
  }
  return v1::DTYPE_UNSPECIFIED;
}

v1::ArenaKind ToProto(kernels::ArenaExport::Kind k) {
  switch (k) {
    case kernels::ArenaExport::Kind::kMemfd:
      return v1::ARENA_KIND_MEMFD;
    case kernels::ArenaExport::Kind::kCudaVmm:
      return v1::ARENA_KIND_CUDA_VMM;
    case kernels::ArenaExport::Kind::kCudaIpc:
      return v1::ARENA_KIND_CUDA_IPC;
  }
  return v1::ARENA_KIND_UNSPECIFIED;
}

void ToProto(const BlockHash& h, v1::BlockHash* out) {
  out->set_lo(h.lo);
  out->set_hi(h.hi);
}

}  // namespace

std::optional<std::string> ShortfallValue(const absl::Status& status) {
  std::optional<Shortfall> shortfall = GetShortfall(status);
  if (!shortfall) return std::nullopt;
  return fmt::format("{}:{}", ResourceName(shortfall->resource), shortfall->blocks);
}

grpc::Status ToGrpcStatus(const absl::Status& status, grpc::ServerContextBase* context) {
  if (status.ok()) return grpc::Status::OK;
  if (context != nullptr) {
    if (std::optional<std::string> shortfall = ShortfallValue(status)) {
      context->AddTrailingMetadata(wire::kShortfallKey, *shortfall);
    }
  }
  // absl and gRPC share the canonical code numbering.
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

void ToProto(const kernels::PoolLayout& layout, v1::PoolLayout* out) {
  out->set_block_size(layout.block_size);
  out->set_num_layers(layout.num_layers);
  out->set_num_kv_heads(layout.num_kv_heads);
  out->set_head_dim(layout.head_dim);
  out->set_dtype(ToProto(layout.uniform() ? layout.k_dtype(0) : layout.dtype));
  out->set_num_blocks(layout.num_blocks);
  out->set_chunk_bytes(layout.uniform() ? layout.chunk_bytes() : 0);
  out->set_block_bytes(layout.block_bytes());
  out->set_layout_hash(layout.Hash());
  if (layout.num_state_slots > 0) {
    out->set_num_state_slots(layout.num_state_slots);
    out->set_state_slot_bytes(layout.state_slot_bytes);
    out->set_state_offset(layout.state_offset());
  }
  if (layout.num_window_layers > 0) {
    out->set_num_window_layers(layout.num_window_layers);
    out->set_num_window_blocks(layout.num_window_blocks);
    out->set_window_block_bytes(layout.window_block_bytes());
    out->set_window_offset(layout.window_offset());
  }
  out->clear_layers();
  for (int32_t l = 0; l < layout.num_layers; ++l) {
    const kernels::LayerLayout g = layout.Layer(l);
    v1::LayerLayout* p = out->add_layers();
    p->set_k_dtype(ToProto(g.k_dtype));
    p->set_v_dtype(ToProto(g.v_dtype));
    p->set_k_offset(g.k_offset);
    p->set_v_offset(g.v_offset);
    p->set_k_chunk_bytes(layout.chunk_bytes(l, kernels::KvSide::kK));
    p->set_v_chunk_bytes(layout.chunk_bytes(l, kernels::KvSide::kV));
    if (kernels::DTypeHasScales(g.k_dtype)) p->set_k_scales_offset(g.k_scales_offset);
    if (kernels::DTypeHasScales(g.v_dtype)) p->set_v_scales_offset(g.v_scales_offset);
    p->set_bytes_per_token(layout.bytes_per_token(l));
  }
}

v1::KvEvent ToProto(const KvEvent& e) {
  v1::KvEvent out;
  out.set_seq(e.seq);
  out.set_epoch(e.epoch);
  switch (e.type) {
    case KvEventType::kBlockStored:
      out.set_type(v1::KvEvent::TYPE_BLOCK_STORED);
      break;
    case KvEventType::kBlockRemoved:
      out.set_type(v1::KvEvent::TYPE_BLOCK_REMOVED);
      break;
    case KvEventType::kAllBlocksCleared:
      out.set_type(v1::KvEvent::TYPE_ALL_BLOCKS_CLEARED);
      break;
  }
  out.set_namespace_id(e.ns.value());
  for (const BlockHash& h : e.block_hashes) ToProto(h, out.add_block_hashes());
  if (e.parent_hash) ToProto(*e.parent_hash, out.mutable_parent_hash());
  out.mutable_token_ids()->Add(e.token_ids.begin(), e.token_ids.end());
  out.set_block_size(e.block_size);
  out.set_medium(MediumName(e.medium));
  if (e.group) {
    v1::KvEventGroup* g = out.mutable_group();
    g->set_index(e.group->index);
    g->set_kind(std::string(GroupKindName(e.group->kind)));
    g->set_sliding_window(e.group->sliding_window);
  }
  return out;
}

void ToProto(const BlockTraceEntry& e, v1::TraceEntry* t) {
  t->set_op_seq(e.op_seq);
  t->set_time_ns(e.time_ns);
  t->set_block_id(e.block.value());
  t->set_op(std::string(BlockOpName(e.op)));
  t->set_refs_after(e.refs_after);
  t->set_generation(e.generation);
  t->set_session_id(e.session.value());
  t->set_sequence_id(e.sequence.value());
  std::string_view file = e.site.file_name();
  if (size_t slash = file.rfind('/'); slash != std::string_view::npos)
    file.remove_prefix(slash + 1);
  t->set_site(fmt::format("{}:{} ({})", file, e.site.line(), e.site.function_name()));
}

namespace {

double Gbps(uint64_t bytes, int64_t ns) {
  return ns > 0 ? static_cast<double>(bytes) / static_cast<double>(ns) : 0.0;
}

// What of the tiers is not a figure of the stats table: which stores exist (in the order host,
// disk, redis), their breakers' states, why the disk tier started empty, and the copy rates
// (ratios of two rows). The tier rows fill every number (daemon/metrics/tier_stat_rows.h).
void TierTextToProto(const TierStats& t, v1::TierStats* out) {
  if (t.host) out->add_stores()->set_medium("host");
  if (t.disk) {
    v1::TierStoreStats* disk = out->add_stores();
    disk->set_medium("disk");
    disk->set_breaker(tier::BreakerStateName(t.disk_store.breaker));
    disk->set_started_empty(t.disk_tier.started_empty);
  }
  if (t.remote) {
    v1::TierStoreStats* redis = out->add_stores();
    redis->set_medium("redis");
    redis->set_breaker(tier::BreakerStateName(t.remote_store.breaker));
  }
  out->set_demote_gbps(Gbps(t.demoted_bytes, t.demote_ns));
  out->set_promote_gbps(Gbps(t.promoted_bytes, t.promote_ns));
}

}  // namespace

void ToProto(const EngineStats& st, const AttachCounters* attach, const RpcCounters* rpcs,
             v1::GetStatsResponse* r, const EventStreamStats* streams,
             const ZmqEventCounters* zmq) {
  // What is not a number of the stats table; the figures come from the table (stats_table.cc).
  r->set_device(st.device);
  r->set_epoch(st.epoch);  // an identity of 64 random bits, not a figure: a double would round it
  ToProto(st.layout, r->mutable_layout());
  r->set_model(st.model_info.name);
  if (!st.health.ok()) r->set_failure(st.health.ToString());
  r->set_pool(st.pool);
  for (const std::string& p : st.pools) r->add_pools(p);
  if (st.tiers.host || st.tiers.disk || st.tiers.remote) {
    TierTextToProto(st.tiers, r->mutable_tiers());
  }
  FillStats({.engine = &st, .attach = attach, .rpcs = rpcs, .streams = streams, .zmq = zmq}, r);
}

void ToProto(const SessionListing& l, int64_t now_ns, v1::SessionInfo* info) {
  const Session& s = *l.session;
  info->set_session_id(s.id.value());
  info->set_client_name(s.spec.client_name);
  info->set_pid(static_cast<uint32_t>(s.spec.pid));
  info->set_uid(s.spec.uid);
  info->set_gid(s.spec.gid);
  info->set_tenant(s.spec.tenant);
  info->set_model(s.spec.model);
  info->set_namespace_id(s.ns.value());
  info->set_admin(s.spec.admin);
  info->set_sequences(l.sequences);
  info->set_block_refs(l.block_refs);
  info->set_attached_seconds(static_cast<double>(now_ns - s.opened_ns) * 1e-9);
  info->set_kv_access(s.spec.kv_access);
  if (l.quota) {
    info->set_quota_used(l.quota->used);
    info->set_quota_bound(l.quota->bound);
    info->set_quota_unit(l.quota->bytes ? "bytes" : "blocks");
  }
  if (l.share) {
    info->set_cache_share_blocks(l.share->evictable);
    info->set_cache_share_bytes(l.share->bytes);
    info->set_cache_share_weight(l.share->weight);
    info->set_cache_share_evicted(l.share->evicted);
  }
}

void ToProto(const PoolGrant& g, v1::AttachResponse* r) {
  const Session& s = *g.session;
  r->set_session_id(s.id.value());
  r->set_session_token(s.token);
  r->set_admin(s.spec.admin);
  r->set_namespace_id(s.ns.value());
  r->set_epoch(g.epoch);
  r->set_daemon_version(g.daemon_version);
  r->set_model_name(g.model.name);
  r->set_model_vocab_size(g.model.vocab_size);
  r->set_model_max_position(g.model.max_position);
  ToProto(g.layout, r->mutable_layout());
  r->set_pool(g.pool);
  r->set_kv_access(g.arena.has_value());
  if (!g.arena) return;  // compute-only: nothing to map
  r->set_arena_kind(ToProto(g.arena->kind));
  r->set_arena_bytes(g.layout.arena_bytes());
  r->set_mapped_bytes(g.arena->mapped_bytes);
  r->set_device_ordinal(g.arena->device_ordinal);
  r->set_cuda_ipc_handle(g.arena->ipc_handle);
  if (g.arena->fd.valid()) r->add_fds(v1::FD_ROLE_ARENA);
  if (g.generation_table.valid()) r->add_fds(v1::FD_ROLE_GENERATION_TABLE);
}

std::string_view StopName(MatchStop stop) {
  switch (stop) {
    case MatchStop::kPromptEnd:
      return "prompt_end";
    case MatchStop::kUnknownNamespace:
      return "unknown_namespace";
    case MatchStop::kNoChild:
      return "no_child";
    case MatchStop::kDiverged:
      return "diverged";
    case MatchStop::kInsufficientCoverage:
      return "insufficient_coverage";
    case MatchStop::kEvicted:
      return "evicted";
  }
  return "?";
}

void ToProto(const Tables& tables, size_t slice, size_t first_block, v1::SequenceInfo* info) {
  const TableSlice& s = tables.slices[slice];
  info->set_sequence_id(s.sequence.value());
  info->set_num_tokens(s.num_tokens);
  info->set_matched_tokens(s.matched_tokens);
  info->set_table_offset(s.table_offset);
  if (s.state_slot != kInvalidBlock) info->set_state_slot(s.state_slot.value());
  auto* ids = info->mutable_block_ids();
  auto* gens = info->mutable_generations();
  ids->Reserve(s.length);
  gens->Reserve(s.length);
  for (size_t i = first_block; i < first_block + static_cast<size_t>(s.length); ++i) {
    ids->AddAlreadyReserved(tables.blocks[i].value());
    gens->AddAlreadyReserved(tables.generations[i]);
  }
  if (tables.window_blocks.empty()) return;  // no window group
  info->set_window_released_begin(s.window_released_begin);
  info->set_window_released_end(s.window_released_end);
  auto* window_ids = info->mutable_window_block_ids();
  auto* window_gens = info->mutable_window_generations();
  window_ids->Reserve(s.length);
  window_gens->Reserve(s.length);
  for (size_t i = first_block; i < first_block + static_cast<size_t>(s.length); ++i) {
    window_ids->AddAlreadyReserved(tables.window_blocks[i].value());
    window_gens->AddAlreadyReserved(tables.window_generations[i]);
  }
}

void ToProto(const Tables& tables, google::protobuf::RepeatedPtrField<v1::SequenceInfo>* out) {
  size_t first = 0;
  for (size_t i = 0; i < tables.slices.size(); ++i) {
    ToProto(tables, i, first, out->Add());
    first += static_cast<size_t>(tables.slices[i].length);
  }
}

void ToProto(const Tables& tables, v1::GrowResponse* r) {
  const int n = static_cast<int>(tables.slices.size());
  r->mutable_num_tokens()->Reserve(n);
  r->mutable_table_offsets()->Reserve(n);
  r->mutable_tail_lengths()->Reserve(n);
  for (const TableSlice& s : tables.slices) {
    r->mutable_num_tokens()->AddAlreadyReserved(s.num_tokens);
    r->mutable_table_offsets()->AddAlreadyReserved(s.table_offset);
    r->mutable_tail_lengths()->AddAlreadyReserved(s.length);
  }
  r->mutable_block_ids()->Reserve(static_cast<int>(tables.blocks.size()));
  for (BlockId b : tables.blocks) r->mutable_block_ids()->AddAlreadyReserved(b.value());
  r->mutable_generations()->Add(tables.generations.begin(), tables.generations.end());
  if (tables.window_blocks.empty()) return;  // no window group
  r->mutable_window_released_begin()->Reserve(n);
  r->mutable_window_released_end()->Reserve(n);
  for (const TableSlice& s : tables.slices) {
    r->mutable_window_released_begin()->AddAlreadyReserved(s.window_released_begin);
    r->mutable_window_released_end()->AddAlreadyReserved(s.window_released_end);
  }
  r->mutable_window_block_ids()->Reserve(static_cast<int>(tables.window_blocks.size()));
  for (BlockId b : tables.window_blocks) {
    r->mutable_window_block_ids()->AddAlreadyReserved(b.value());
  }
  r->mutable_window_generations()->Add(tables.window_generations.begin(),
                                       tables.window_generations.end());
}

std::vector<AllocateRequest> FromProto(const v1::AllocateRequest& request) {
  std::vector<AllocateRequest> items;
  items.reserve(static_cast<size_t>(request.items_size()));
  for (const v1::AllocateItem& item : request.items()) {
    items.push_back({.num_tokens = item.num_tokens(),
                     .prompt = Tokens(item.prompt()),
                     .priority = item.priority()});
  }
  return items;
}

absl::StatusOr<std::vector<GrowRequest>> FromProto(const v1::GrowRequest& request) {
  if (request.sequence_ids_size() != request.num_tokens_size()) {
    return absl::InvalidArgumentError(fmt::format("grow: {} sequence ids but {} token counts",
                                                  request.sequence_ids_size(),
                                                  request.num_tokens_size()));
  }
  std::vector<GrowRequest> items;
  items.reserve(static_cast<size_t>(request.sequence_ids_size()));
  for (int i = 0; i < request.sequence_ids_size(); ++i) {
    items.push_back({SequenceId(request.sequence_ids(i)), request.num_tokens(i)});
  }
  return items;
}

model::SamplingParams FromProto(const v1::SamplingParams& params, uint64_t drawn_seed) {
  return {.temperature = params.temperature(),
          .top_p = params.has_top_p() ? params.top_p() : 1.0F,
          .top_k = params.top_k(),
          .presence_penalty = params.presence_penalty(),
          .frequency_penalty = params.frequency_penalty(),
          .seed = params.has_seed() ? params.seed() : drawn_seed};
}

absl::Status CheckParallelArrays(const v1::DecodeRequest& request) {
  if (request.sequence_ids_size() != request.tokens_size()) {
    return absl::InvalidArgumentError(fmt::format("decode: {} sequence ids but {} tokens",
                                                  request.sequence_ids_size(),
                                                  request.tokens_size()));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<model::DecodeInput>> FromProto(const v1::DecodeRequest& request) {
  KVPOOL_RETURN_IF_ERROR(CheckParallelArrays(request));
  std::vector<model::DecodeInput> inputs;
  inputs.reserve(static_cast<size_t>(request.sequence_ids_size()));
  for (int i = 0; i < request.sequence_ids_size(); ++i) {
    inputs.push_back({SequenceId(request.sequence_ids(i)), request.tokens(i)});
  }
  return inputs;
}

}  // namespace kvpool::daemon
