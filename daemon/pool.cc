#include "daemon/pool.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/container/flat_hash_set.h"
#include "fmt/format.h"
#include "kvpool/util/fmt.h"
#include "kvpool/util/logging.h"
#include "kvpool/util/status_macros.h"
#include "xxhash.h"

namespace kvpool::daemon {
namespace {

v1::DType ToProto(kernels::DType d) {
  switch (d) {
    case kernels::DType::kF32:
      return v1::DTYPE_F32;
    case kernels::DType::kF16:
      return v1::DTYPE_F16;
    case kernels::DType::kBF16:
      return v1::DTYPE_BF16;
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

void ToProto(const kernels::PoolLayout& layout, v1::PoolLayout* out) {
  out->set_block_size(layout.block_size);
  out->set_num_layers(layout.num_layers);
  out->set_num_kv_heads(layout.num_kv_heads);
  out->set_head_dim(layout.head_dim);
  out->set_dtype(ToProto(layout.dtype));
  out->set_num_blocks(layout.num_blocks);
  out->set_chunk_bytes(layout.chunk_bytes());
  out->set_block_bytes(layout.block_bytes());
  out->set_layout_hash(layout.Hash());
}

void ToProto(const BlockHash& h, v1::BlockHash* out) {
  out->set_lo(h.lo);
  out->set_hi(h.hi);
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
  return out;
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

template <typename Field>
std::span<const int32_t> Span(const Field& field) {
  return {field.data(), static_cast<size_t>(field.size())};
}

}  // namespace

absl::StatusOr<std::unique_ptr<DaemonPool>> DaemonPool::Create(const v1::DaemonConfig& config,
                                                               kernels::Device* device,
                                                               uint64_t epoch) {
  KVPOOL_ASSIGN_OR_RETURN(kernels::DType dtype, kernels::ParseDType(config.shape().dtype()));
  KVPOOL_ASSIGN_OR_RETURN(kernels::FillPolicy policy,
                          kernels::ParseFillPolicy(config.fill_policy()));
  (void)policy;
  KVPOOL_ASSIGN_OR_RETURN(kernels::PoolLayout layout,
                          kernels::LayoutForBudget({.block_size = config.shape().block_size(),
                                                    .num_layers = config.shape().num_layers(),
                                                    .num_kv_heads = config.shape().num_kv_heads(),
                                                    .head_dim = config.shape().head_dim(),
                                                    .dtype = dtype},
                                                   config.pool_bytes()));
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<kernels::Arena> arena,
                          device->CreateArena(layout.arena_bytes()));
  auto steps = std::make_unique<StepTimeline>(device);
  KVPOOL_ASSIGN_OR_RETURN(
      std::unique_ptr<KvCacheManager> cache,
      KvCacheManager::Create({.block_size = layout.block_size,
                              .num_blocks = layout.num_blocks,
                              .max_blocks_per_seq = config.max_blocks_per_seq(),
                              .trace_depth = config.trace_depth(),
                              .fences = steps.get(),
                              .prefix_cache = !config.disable_prefix_cache(),
                              .eviction_policy = config.eviction_policy(),
                              .epoch = epoch,
                              .event_capacity = static_cast<size_t>(config.event_capacity())}));
  // The generation table: one uint32 per block, shared read-only with clients.
  const size_t table_bytes = static_cast<size_t>(layout.num_blocks) * sizeof(uint32_t);
  const int fd = memfd_create("kvpool-generations", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return absl::InternalError(fmt::format("memfd_create: {}", std::strerror(errno)));
  if (ftruncate(fd, static_cast<off_t>(table_bytes)) != 0 ||
      fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    const int err = errno;
    close(fd);
    return absl::InternalError(fmt::format("generation table: {}", std::strerror(err)));
  }
  void* table = mmap(nullptr, table_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (table == MAP_FAILED) {
    const int err = errno;
    close(fd);
    return absl::InternalError(fmt::format("mmap(generation table): {}", std::strerror(err)));
  }
  return std::unique_ptr<DaemonPool>(new DaemonPool(config, device, epoch, layout, std::move(arena),
                                                    std::move(steps), std::move(cache), fd,
                                                    static_cast<uint32_t*>(table)));
}

DaemonPool::DaemonPool(const v1::DaemonConfig& config, kernels::Device* device, uint64_t epoch,
                       kernels::PoolLayout layout, std::unique_ptr<kernels::Arena> arena,
                       std::unique_ptr<StepTimeline> steps, std::unique_ptr<KvCacheManager> cache,
                       int generation_fd, uint32_t* generations)
    : config_(config),
      device_(device),
      epoch_(epoch),
      layout_(layout),
      started_(absl::Now()),
      arena_(std::move(arena)),
      steps_(std::move(steps)),
      cache_(std::move(cache)),
      executor_(device, kernels::StreamId::kTransfer, kernels::KvPoolView{arena_->base(), layout},
                *kernels::ParseFillPolicy(config.fill_policy())),
      generation_fd_(generation_fd),
      generations_(generations) {}

DaemonPool::~DaemonPool() {
  (void)device_->SynchronizeAll();  // nothing may still touch the arena when it goes
  munmap(generations_, static_cast<size_t>(layout_.num_blocks) * sizeof(uint32_t));
  close(generation_fd_);
}

NamespaceId DaemonPool::NamespaceOf(const std::string& tenant, const std::string& model) const {
  const std::string key = fmt::format("{}\x1f{}\x1f{:016x}", tenant, model, layout_.Hash());
  const uint64_t h = XXH3_64bits(key.data(), key.size());
  return NamespaceId(h == 0 ? 1 : h);
}

absl::StatusOr<AttachGrant> DaemonPool::Attach(const Session& s) {
  struct {
    std::string name;
    int32_t vocab_size, max_position;
  } grant_model;
  {
    absl::MutexLock lock(&mu_);
    grant_model = {model_.name, model_.vocab_size, model_.max_position};
    if (config_.session_quota_blocks() > 0) {
      KVPOOL_RETURN_IF_ERROR(cache_->SetSessionQuota(s.id, config_.session_quota_blocks()));
    }
    if (auto it = config_.tenant_quota_blocks().find(s.tenant);
        it != config_.tenant_quota_blocks().end()) {
      KVPOOL_RETURN_IF_ERROR(cache_->SetNamespaceQuota(s.ns, it->second));
    }
  }
  KVPOOL_ASSIGN_OR_RETURN(kernels::ArenaExport exported, arena_->Export());
  AttachGrant grant;
  v1::AttachResponse& r = grant.response;
  r.set_session_id(s.id.value());
  r.set_session_token(s.token);
  r.set_admin(s.admin);
  r.set_namespace_id(s.ns.value());
  r.set_epoch(epoch_);
  r.set_daemon_version("kvpoold 0.1.0");
  r.set_model_name(grant_model.name);
  r.set_model_vocab_size(grant_model.vocab_size);
  r.set_model_max_position(grant_model.max_position);
  ToProto(layout_, r.mutable_layout());
  r.set_arena_kind(ToProto(exported.kind));
  r.set_arena_bytes(layout_.arena_bytes());
  r.set_mapped_bytes(exported.mapped_bytes);
  r.set_device_ordinal(exported.device_ordinal);
  r.set_cuda_ipc_handle(exported.ipc_handle);
  if (exported.fd >= 0) {
    grant.fds.push_back(exported.fd);
    r.add_fds(v1::FD_ROLE_ARENA);
  }
  const int table = fcntl(generation_fd_, F_DUPFD_CLOEXEC, 0);
  if (table < 0) {
    for (int fd : grant.fds) close(fd);
    return absl::InternalError(fmt::format("dup(generation table): {}", std::strerror(errno)));
  }
  grant.fds.push_back(table);
  r.add_fds(v1::FD_ROLE_GENERATION_TABLE);
  return grant;
}

int64_t DaemonPool::ReleaseSession(SessionId session) {
  absl::MutexLock lock(&mu_);
  ++sessions_reclaimed_;
  return cache_->FreeSession(session);
}

absl::StatusOr<Fence> DaemonPool::Carry(const DevicePlan& plan) {
  if (plan.empty()) return Fence{};
  KVPOOL_ASSIGN_OR_RETURN(Fence fence, executor_.Execute(plan));
  const std::vector<BlockId> touched = kernels::PlanExecutor::TouchedBlocks(plan);
  if (fence.value != 0) KVPOOL_RETURN_IF_ERROR(cache_->MarkInFlight(touched, fence));
  // Blocks handed out (fresh ones and copy targets) have new generations: publish them.
  auto publish = [&](BlockId b) {
    __atomic_store_n(&generations_[b.value()], cache_->pool().generation(b), __ATOMIC_RELEASE);
  };
  for (const BlockFill& f : plan.fills) publish(f.block);
  for (const BlockCopy& c : plan.copies) publish(c.dst);
  return fence;
}

absl::Status DaemonPool::Wait(Fence fence) {
  if (fence.value == 0) return absl::OkStatus();
  absl::Status s = device_->Synchronize(fence);
  if (!s.ok()) {
    Logger("daemon").error("device work failed: {}", s.ToString());
    return absl::InternalError(fmt::format("device: {}", s.message()));
  }
  return absl::OkStatus();
}

void DaemonPool::Describe(const Sequence& seq, int32_t table_offset, v1::SequenceInfo* info) const {
  info->set_sequence_id(seq.id.value());
  info->set_num_tokens(seq.num_tokens);
  info->set_table_offset(table_offset);
  for (size_t i = static_cast<size_t>(table_offset); i < seq.table.size(); ++i) {
    info->add_block_ids(seq.table[i].value());
    info->add_generations(cache_->pool().generation(seq.table[i]));
  }
}

absl::Status DaemonPool::Allocate(const Session& s, const v1::AllocateRequest& request,
                                  v1::AllocateResponse* response) {
  std::vector<AllocateRequest> items;
  for (const v1::AllocateItem& item : request.items()) {
    items.push_back({.ns = s.ns,
                     .num_tokens = item.num_tokens(),
                     .prompt = Span(item.prompt()),
                     .priority = item.priority()});
  }
  Fence fence;
  {
    absl::MutexLock lock(&mu_);
    if (draining_) return absl::UnavailableError("kvpoold is draining: no new sequences");
    std::vector<AllocateResult> results;
    DevicePlan plan;
    KVPOOL_RETURN_IF_ERROR(cache_->AllocateBatch(s.id, items, &results, &plan));
    KVPOOL_ASSIGN_OR_RETURN(fence, Carry(plan));
    for (const AllocateResult& r : results) {
      v1::SequenceInfo* info = response->add_sequences();
      Describe(*cache_->Find(r.sequence), 0, info);
      info->set_matched_tokens(r.matched_tokens);
    }
  }
  return Wait(fence);
}

absl::Status DaemonPool::Grow(const Session& s, const v1::GrowRequest& request,
                              v1::GrowResponse* response) {
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
  Fence fence;
  {
    absl::MutexLock lock(&mu_);
    // What the tables looked like: a grow appends, and may replace the (partial) last block.
    std::vector<std::pair<size_t, BlockId>> before;
    before.reserve(items.size());
    for (const GrowRequest& g : items) {
      const Sequence* seq = cache_->Find(g.sequence);
      before.emplace_back(seq ? seq->table.size() : 0,
                          seq && !seq->table.empty() ? seq->table.back() : kInvalidBlock);
    }
    DevicePlan plan;
    KVPOOL_RETURN_IF_ERROR(cache_->GrowBatch(s.id, items, &plan));
    KVPOOL_ASSIGN_OR_RETURN(fence, Carry(plan));
    for (size_t k = 0; k < items.size(); ++k) {
      const Sequence& seq = *cache_->Find(items[k].sequence);
      const auto [size, last] = before[k];
      const size_t offset = size > 0 && seq.table[size - 1] != last ? size - 1 : size;
      response->add_num_tokens(seq.num_tokens);
      response->add_table_offsets(static_cast<int32_t>(offset));
      response->add_tail_lengths(static_cast<int32_t>(seq.table.size() - offset));
      for (size_t i = offset; i < seq.table.size(); ++i) {
        response->add_block_ids(seq.table[i].value());
        response->add_generations(cache_->pool().generation(seq.table[i]));
      }
    }
  }
  return Wait(fence);
}

absl::Status DaemonPool::Truncate(const Session& s, const v1::TruncateRequest& request) {
  absl::MutexLock lock(&mu_);
  return cache_->Truncate(s.id, SequenceId(request.sequence_id()), request.num_tokens());
}

absl::Status DaemonPool::Fork(const Session& s, const v1::ForkRequest& request,
                              v1::ForkResponse* response) {
  Fence fence;
  {
    absl::MutexLock lock(&mu_);
    if (draining_) return absl::UnavailableError("kvpoold is draining: no new sequences");
    DevicePlan plan;
    KVPOOL_ASSIGN_OR_RETURN(SequenceId child,
                            cache_->Fork(s.id, SequenceId(request.sequence_id()), &plan));
    KVPOOL_ASSIGN_OR_RETURN(fence, Carry(plan));
    Describe(*cache_->Find(child), 0, response->mutable_sequence());
  }
  return Wait(fence);
}

absl::Status DaemonPool::Commit(const Session& s, const v1::CommitRequest& request) {
  absl::MutexLock lock(&mu_);
  return cache_->Commit(s.id, SequenceId(request.sequence_id()), request.num_tokens(),
                        Span(request.new_tokens()));
}

absl::Status DaemonPool::Free(const Session& s, const v1::FreeRequest& request) {
  absl::MutexLock lock(&mu_);
  // All or nothing: check every id first.
  if (request.sequence_ids().empty()) return absl::InvalidArgumentError("free: empty batch");
  absl::flat_hash_set<uint64_t> seen;
  for (uint64_t id : request.sequence_ids()) {
    const Sequence* seq = cache_->Find(SequenceId(id));
    if (seq == nullptr) return absl::NotFoundError(fmt::format("no sequence {}", id));
    if (seq->session != s.id) {
      return absl::PermissionDeniedError(fmt::format("sequence {} belongs to another session", id));
    }
    if (!seen.insert(id).second) {
      return absl::InvalidArgumentError(fmt::format("sequence {} appears twice", id));
    }
  }
  const OnFree mode = request.commit() ? OnFree::kCommit : OnFree::kDiscard;
  for (uint64_t id : request.sequence_ids()) {
    KVPOOL_RETURN_IF_ERROR(cache_->Free(s.id, SequenceId(id), mode));
  }
  return absl::OkStatus();
}

int64_t DaemonPool::MatchPrefix(const Session& s, const v1::MatchPrefixRequest& request) const {
  absl::MutexLock lock(&mu_);
  return cache_->MatchPrefix(s.ns, Span(request.tokens()));
}

void DaemonPool::Stats(v1::GetStatsResponse* r) const {
  absl::MutexLock lock(&mu_);
  const KvCacheStats s = cache_->stats();
  r->set_num_blocks(s.pool.num_blocks);
  r->set_free_blocks(s.pool.free);
  r->set_active_blocks(s.pool.active);
  r->set_cached_blocks(s.pool.cached);
  r->set_retiring_blocks(s.pool.retiring);
  r->set_sequences(s.sequences);
  r->set_sessions(s.sessions);
  r->set_allocate_calls(s.allocate_calls);
  r->set_grow_calls(s.grow_calls);
  r->set_truncate_calls(s.truncate_calls);
  r->set_fork_calls(s.fork_calls);
  r->set_commit_calls(s.commit_calls);
  r->set_free_calls(s.free_calls);
  r->set_blocks_allocated(s.pool.allocated);
  r->set_blocks_freed(s.pool.freed);
  r->set_cow_copies(s.cow_copies);
  r->set_scrubs(s.pool.scrubs);
  r->set_exhausted(s.exhausted);
  r->set_over_releases(s.pool.over_releases);
  r->set_prompt_tokens(s.prompt_tokens);
  r->set_hit_tokens(s.hit_tokens);
  r->set_evictions(s.evictions);
  r->set_cache_nodes(s.cache.nodes);
  r->set_events_next_seq(cache_->events() ? cache_->events()->next_seq() : 0);
  r->set_epoch(epoch_);
  r->set_device(device_->name());
  r->set_uptime_seconds(absl::ToDoubleSeconds(absl::Now() - started_));
  r->set_draining(draining_);
  r->set_sessions_reclaimed(sessions_reclaimed_);
  r->set_model(model_.name);
  r->set_model_steps(model_.steps);
  r->set_model_step_sequences(model_.step_sequences);
  r->set_prefill_calls(model_.prefill_calls);
  r->set_prefill_tokens_computed(model_.prefill_computed);
  r->set_prefill_tokens_reused(model_.prefill_reused);
  r->set_decode_tokens(model_.decode_tokens);
  r->set_model_busy_us(static_cast<uint64_t>(absl::ToInt64Microseconds(model_.busy)));
  r->set_prefill_chunks(model_.prefill_chunks);
  ToProto(layout_, r->mutable_layout());
}

void DaemonPool::ListSequences(uint64_t session_id, v1::ListSequencesResponse* response) const {
  absl::MutexLock lock(&mu_);
  std::vector<const Sequence*> seqs;
  cache_->ForEachSequence([&](const Sequence& seq) {
    if (session_id == 0 || seq.session.value() == session_id) seqs.push_back(&seq);
  });
  std::sort(seqs.begin(), seqs.end(), [](const auto* a, const auto* b) { return a->id < b->id; });
  for (const Sequence* seq : seqs) {
    Describe(*seq, 0, response->add_sequences());
    response->add_session_ids(seq->session.value());
  }
}

absl::Status DaemonPool::DumpBlockTrace(const v1::DumpBlockTraceRequest& request,
                                        v1::DumpBlockTraceResponse* response) const {
  absl::MutexLock lock(&mu_);
  const BlockPool& pool = cache_->pool();
  if (!request.all() && !pool.Contains(BlockId(request.block_id()))) {
    return absl::InvalidArgumentError(
        fmt::format("no block {} (pool has {})", request.block_id(), pool.num_blocks()));
  }
  const std::vector<BlockTraceEntry> entries =
      request.all() ? pool.trace().All() : pool.trace().History(BlockId(request.block_id()));
  for (const BlockTraceEntry& e : entries) {
    v1::TraceEntry* t = response->add_entries();
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
  return absl::OkStatus();
}

void DaemonPool::Explain(NamespaceId ns, const v1::ExplainMatchRequest& request,
                         v1::ExplainMatchResponse* response) const {
  absl::MutexLock lock(&mu_);
  const MatchExplanation e = cache_->ExplainMatch(ns, Span(request.tokens()));
  response->set_matched_tokens(e.matched_tokens);
  response->set_stop(std::string(StopName(e.stop)));
  response->set_explanation(e.ToString());
}

absl::StatusOr<int64_t> DaemonPool::Evict(const v1::EvictRequest& request) {
  absl::MutexLock lock(&mu_);
  if (request.all()) {
    const int64_t before = cache_->stats().cache.nodes;
    KVPOOL_RETURN_IF_ERROR(cache_->ClearCache());
    return before;
  }
  if (request.blocks() < 0) return absl::InvalidArgumentError("evict: negative block count");
  return cache_->EvictCached(request.blocks());
}

absl::Status DaemonPool::CheckInvariants() const {
  absl::MutexLock lock(&mu_);
  KVPOOL_RETURN_IF_ERROR(cache_->CheckInvariants());
  for (int32_t b = 0; b < layout_.num_blocks; ++b) {
    const uint32_t shared = __atomic_load_n(&generations_[b], __ATOMIC_ACQUIRE);
    if (shared != cache_->pool().generation(BlockId(b))) {
      return absl::InternalError(fmt::format("block {} generation {} but clients see {}", b,
                                             cache_->pool().generation(BlockId(b)), shared));
    }
  }
  return absl::OkStatus();
}

int64_t DaemonPool::Drain() {
  absl::MutexLock lock(&mu_);
  draining_ = true;
  return cache_->stats().sequences;
}

bool DaemonPool::draining() const {
  absl::MutexLock lock(&mu_);
  return draining_;
}

std::pair<int64_t, int64_t> DaemonPool::Usage(SessionId session) const {
  absl::MutexLock lock(&mu_);
  int64_t sequences = 0, refs = 0;
  cache_->ForEachSequence([&](const Sequence& seq) {
    if (seq.session != session) return;
    ++sequences;
    refs += static_cast<int64_t>(seq.table.size());
  });
  return {sequences, refs};
}

bool DaemonPool::ReadEvents(uint64_t from, size_t max, std::vector<v1::KvEvent>* out) const {
  absl::MutexLock lock(&mu_);
  const EventLog* log = cache_->events();
  if (log == nullptr) return true;
  std::vector<KvEvent> events;
  if (!log->ReadFrom(from, max, &events)) return false;
  for (const KvEvent& e : events) out->push_back(ToProto(e));
  return true;
}

std::vector<v1::KvEvent> DaemonPool::SnapshotEvents(uint64_t* resume_seq) const {
  absl::MutexLock lock(&mu_);
  std::vector<v1::KvEvent> out;
  for (const KvEvent& e : cache_->SnapshotEvents(resume_seq)) out.push_back(ToProto(e));
  return out;
}

uint64_t DaemonPool::next_event_seq() const {
  absl::MutexLock lock(&mu_);
  return cache_->events() ? cache_->events()->next_seq() : 1;
}

}  // namespace kvpool::daemon
