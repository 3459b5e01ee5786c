#include "daemon/engine/tiers.h"

#include <algorithm>
#include <utility>

#include "fmt/format.h"
#include "kvpool/util/check.h"
#include "kvpool/util/logging.h"
#include "kvpool/util/status_macros.h"
#include "tier/redis_block_store.h"

namespace kvpool::daemon {
namespace {

// Set while this thread runs TierSet::Invalidate (under the engine's lock): the disk tier's
// events it causes are drained by the engine itself then, not through on_events.
thread_local bool t_invalidating = false;

}  // namespace

namespace {

// A host store of `count` slots of `bytes` over host memory of its own (page-locked on CUDA: the
// tier's copies to and from the device then run asynchronously).
absl::Status MakeHostStore(kernels::Device* device, int64_t count, int64_t bytes,
                           int32_t tenant_shares, std::string_view what,
                           std::unique_ptr<kernels::DeviceBuffer>* memory,
                           std::unique_ptr<tier::HostBlockStore>* store) {
  if (count > (int64_t{1} << 46) / bytes) {
    return absl::InvalidArgumentError(
        fmt::format("tiers: {} host {} of {} bytes is too large", count, what, bytes));
  }
  KVPOOL_ASSIGN_OR_RETURN(*memory, device->AllocateHostBuffer(count * bytes));
  KVPOOL_ASSIGN_OR_RETURN(
      *store, tier::HostBlockStore::Create(count, bytes, static_cast<std::byte*>((*memory)->data()),
                                           tenant_shares));
  return absl::OkStatus();
}

// The disk tier's store of a component (checkpoints, window blocks) in `subdirectory` of the
// pool's, records of `bytes` under the layout fingerprint salted for it: null (logged) when it
// cannot be opened, as for the blocks' own.
std::unique_ptr<tier::DiskBlockStore> OpenDiskComponent(
    const tier::DiskTierOptions& disk, std::string_view subdirectory, int64_t capacity_bytes,
    uint64_t salted, int64_t bytes, const tier::DeploymentSecret& secret, const Clock* clock) {
  tier::DiskTierOptions options = disk;
  options.directory = fmt::format("{}/{}", disk.directory, subdirectory);
  options.capacity_bytes = capacity_bytes;
  const int64_t record = (bytes + 4095) / 4096 * 4096;
  options.write_queue_bytes = std::max(options.write_queue_bytes, record);
  absl::StatusOr<std::unique_ptr<tier::DiskBlockStore>> opened =
      tier::DiskBlockStore::Open(options, secret, salted, bytes, clock);
  if (opened.ok()) return *std::move(opened);
  Logger("daemon").error("disk tier {} is unavailable, the pool keeps no {} on disk: {}",
                         options.directory, subdirectory, opened.status().ToString());
  return nullptr;
}

}  // namespace

absl::StatusOr<std::unique_ptr<TierSet>> TierSet::Create(const TierOptions& options,
                                                         kernels::Device* device,
                                                         const kernels::PoolLayout& layout,
                                                         const tier::DeploymentSecret& secret,
                                                         const Clock* clock) {
  if (options.host_blocks < 0 || options.staged_blocks <= 0) {
    return absl::InvalidArgumentError(fmt::format("tiers: host_blocks {} and staged_blocks {}",
                                                  options.host_blocks, options.staged_blocks));
  }
  if (options.lookup_blocks <= 0) {
    return absl::InvalidArgumentError(
        fmt::format("tiers: lookup_blocks {} must be > 0", options.lookup_blocks));
  }
  Stores stores;
  if (options.host_blocks > 0) {
    KVPOOL_RETURN_IF_ERROR(MakeHostStore(device, options.host_blocks, layout.block_bytes(),
                                         options.tenant_shares, "blocks", &stores.host_memory,
                                         &stores.host));
  }
  if (options.redis.enabled) {
    KVPOOL_ASSIGN_OR_RETURN(stores.remote,
                            tier::RedisBlockStore::Create(options.redis, secret, clock));
  }
  if (options.disk.enabled()) {
    absl::StatusOr<std::unique_ptr<tier::DiskBlockStore>> opened = tier::DiskBlockStore::Open(
        options.disk, secret, layout.Hash(), layout.block_bytes(), clock);
    if (opened.ok()) {
      stores.disk = *std::move(opened);
    } else if (absl::IsInvalidArgument(opened.status())) {
      return opened.status();
    } else {
      // The directory, not the config: serve without the disk tier rather than not at all.
      Logger("daemon").error("disk tier {} is unavailable, the pool runs without it: {}",
                             options.disk.directory, opened.status().ToString());
    }
  }
  const bool state = layout.num_state_slots > 0 && layout.state_slot_bytes > 0;
  const bool window = layout.num_window_layers > 0 && layout.num_window_blocks > 0;
  if (options.host_checkpoints > 0 && stores.host && state) {
    KVPOOL_RETURN_IF_ERROR(MakeHostStore(device, options.host_checkpoints, layout.state_slot_bytes,
                                         options.tenant_shares, "checkpoints",
                                         &stores.checkpoint_memory, &stores.checkpoints));
  }
  if (options.host_window_blocks > 0 && stores.host && window) {
    KVPOOL_RETURN_IF_ERROR(MakeHostStore(device, options.host_window_blocks,
                                         layout.window_block_bytes(), options.tenant_shares,
                                         "window blocks", &stores.window_memory, &stores.windows));
  }
  if (stores.disk && state && options.disk_checkpoint_bytes > 0) {
    stores.disk_checkpoints = OpenDiskComponent(
        options.disk, "checkpoints", options.disk_checkpoint_bytes,
        layout.Hash() ^ kCheckpointKeySalt, layout.state_slot_bytes, secret, clock);
  }
  if (stores.disk && window && options.disk_window_bytes > 0) {
    stores.disk_windows = OpenDiskComponent(options.disk, "windows", options.disk_window_bytes,
                                            layout.Hash() ^ kWindowKeySalt,
                                            layout.window_block_bytes(), secret, clock);
  }
  return std::make_unique<TierSet>(device, layout, clock, std::move(stores), options.staged_blocks,
                                   options.lookup_blocks);
}

TierSet::TierSet(kernels::Device* device, const kernels::PoolLayout& layout, const Clock* clock,
                 Stores stores, int64_t staged_blocks, int64_t lookup_blocks)
    : device_(device),
      clock_(clock),
      block_bytes_(layout.block_bytes()),
      state_bytes_(layout.state_slot_bytes),
      window_bytes_(layout.num_window_layers > 0 ? layout.window_block_bytes() : 0),
      block_size_(layout.block_size),
      layout_fingerprint_(layout.Hash()),
      max_staged_(std::min(staged_blocks, std::max<int64_t>(1, kMaxStagedBytes / block_bytes_))),
      max_lookup_(std::min(lookup_blocks, std::max<int64_t>(1, kMaxStagedBytes / block_bytes_))),
      host_memory_(std::move(stores.host_memory)),
      host_(std::move(stores.host)),
      remote_(std::move(stores.remote)),
      disk_(std::move(stores.disk)),
      checkpoint_memory_(std::move(stores.checkpoint_memory)),
      checkpoints_(std::move(stores.checkpoints)),
      remote_checkpoints_(remote_ != nullptr && layout.num_state_slots > 0 && state_bytes_ > 0),
      window_memory_(std::move(stores.window_memory)),
      windows_(std::move(stores.windows)),
      remote_windows_(remote_ != nullptr && window_bytes_ > 0),
      disk_checkpoints_(std::move(stores.disk_checkpoints)),
      disk_windows_(std::move(stores.disk_windows)) {
  KVPOOL_CHECK(host_ == nullptr || host_->block_bytes() == block_bytes_);
  KVPOOL_CHECK(checkpoints_ == nullptr || checkpoints_->block_bytes() == state_bytes_);
  KVPOOL_CHECK(windows_ == nullptr || windows_->block_bytes() == window_bytes_);
  // Every store tells what it stores and drops, each component as its group's event.
  const auto tell = [this](KvMedium medium, std::optional<KvGroupKind> component) {
    return [this, medium, component](const tier::BlockSpace& space, const BlockHash& hash,
                                     const BlockHash& parent, bool stored) {
      OnStoreChange(medium, component, space, hash, parent, stored);
    };
  };
  if (host_) host_->set_listener(tell(KvMedium::kHost, std::nullopt));
  if (disk_) disk_->set_listener(tell(KvMedium::kDisk, std::nullopt));
  if (checkpoints_) checkpoints_->set_listener(tell(KvMedium::kHost, KvGroupKind::kStateSpace));
  if (disk_checkpoints_) {
    disk_checkpoints_->set_listener(tell(KvMedium::kDisk, KvGroupKind::kStateSpace));
  }
  if (windows_) windows_->set_listener(tell(KvMedium::kHost, KvGroupKind::kSlidingWindow));
  if (disk_windows_) {
    disk_windows_->set_listener(tell(KvMedium::kDisk, KvGroupKind::kSlidingWindow));
  }
  // What the disk stores found at start is theirs as much as what they store from now on: told
  // as stored (before any component, so each follows its block where both were found).
  for (const tier::DiskBlockStore* store :
       {disk_.get(), disk_checkpoints_.get(), disk_windows_.get()}) {
    if (store != nullptr) store->TellRecords();
  }
  writer_ = std::thread([this] { WriterLoop(); });
}

TierSet::~TierSet() { Stop(); }

void TierSet::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    changed_.SignalAll();
  }
  if (writer_.joinable()) writer_.join();
  // The disk tier's writer tells of its records until the store goes: never the engine again,
  // and none of its calls is still running when Stop returns.
  absl::MutexLock lock(&mu_);
  on_events_ = nullptr;
  while (telling_ > 0) changed_.Wait(&mu_);
}

void TierSet::OnStoreChange(KvMedium medium, std::optional<KvGroupKind> component,
                            const tier::BlockSpace& space, const BlockHash& hash,
                            const BlockHash& parent, bool stored) {
  KvEvent e{.type = stored ? KvEventType::kBlockStored : KvEventType::kBlockRemoved,
            .ns = space.ns,
            .block_hashes = {hash},
            .block_size = block_size_,
            .medium = medium};
  if (component) e.group = KvEventGroup{.kind = *component};  // its index: the pool's
  if (stored && parent != BlockHash{}) e.parent_hash = parent;
  std::function<void()> on_events;
  {
    absl::MutexLock lock(&mu_);
    events_.push_back(std::move(e));
    // The disk tier tells from its own writer thread (or a lookup's, in a lock gap), long after
    // the staging that caused it: the engine is told at once. The host tier tells on threads
    // that either drain afterwards (the writer loop) or hold the engine's lock.
    if (medium == KvMedium::kDisk && !t_invalidating && on_events_) {
      on_events = on_events_;
      ++telling_;
    }
  }
  if (!on_events) return;
  on_events();
  absl::MutexLock lock(&mu_);
  --telling_;
  changed_.SignalAll();
}

void TierSet::TakeEvents(std::vector<KvEvent>* out) {
  out->clear();
  absl::MutexLock lock(&mu_);
  out->swap(events_);
}

void TierSet::set_on_events(std::function<void()> on_events) {
  absl::MutexLock lock(&mu_);
  on_events_ = std::move(on_events);
}

void TierSet::Stage(KvCacheManager& cache, const kernels::KvPoolView& view,
                    std::span<const PublishedBlock> published) {
  if (published.empty()) return;
  // The compute stream may still be writing what a step just published: copy after it.
  const Fence computed = device_->LastFence(kernels::StreamId::kCompute);
  if (computed.value != 0) {
    if (absl::Status s = device_->StreamWait(kernels::StreamId::kTransfer, computed); !s.ok()) {
      absl::MutexLock lock(&mu_);
      counters_.demote_failed += published.size();
      return;
    }
  }
  std::vector<BlockId> copied;
  Fence last;
  absl::MutexLock lock(&mu_);
  if (stopping_) {
    counters_.demote_dropped_full += published.size();
    return;
  }
  for (const PublishedBlock& p : published) {
    if (static_cast<int64_t>(queue_.size()) + in_flight_ >= max_staged_) {
      ++counters_.demote_dropped_full;
      continue;
    }
    Staged item{.space = {p.ns, layout_fingerprint_},
                .hash = p.hash,
                .parent = p.parent,
                .tags = tags_of_ ? tags_of_(p.ns) : tier::NamespaceTags{}};
    if (!spare_.empty()) {
      item.bytes = std::move(spare_.back());
      spare_.pop_back();
    } else if (absl::StatusOr<std::unique_ptr<kernels::DeviceBuffer>> made =
                   device_->AllocateHostBuffer(block_bytes_);
               made.ok()) {
      item.bytes = std::move(*made);
    } else {
      ++counters_.demote_failed;
      continue;
    }
    const std::byte* src =
        static_cast<const std::byte*>(view.base) + p.block.value() * block_bytes_;
    const absl::StatusOr<Fence> fence =
        device_->CopyToHost(kernels::StreamId::kTransfer, item.bytes->data(), src, block_bytes_);
    if (!fence.ok()) {
      GiveBack(std::move(item.bytes));
      ++counters_.demote_failed;
      continue;
    }
    item.fence = *fence;
    item.staged_ns = clock_->NowNanos();
    last = *fence;
    copied.push_back(p.block);
    queue_.push_back(std::move(item));
  }
  if (!copied.empty()) {
    // Until the copies have run the blocks stay out of the free list, whatever happens to them.
    KVPOOL_CHECK_OK(cache.MarkInFlight(copied, last));
    changed_.Signal();
  }
}

void TierSet::StageCheckpoints(KvCacheManager& cache, const kernels::KvPoolView& view,
                               std::span<const PublishedCheckpoint> published) {
  if (!keeps_checkpoints() || published.empty()) return;
  std::vector<ComponentCopy> copies;
  copies.reserve(published.size());
  for (const PublishedCheckpoint& c : published) {
    copies.push_back(
        {&c.block, reinterpret_cast<const std::byte*>(view.state(c.slot.value())), c.slot});
  }
  const auto [copied, last] = StageComponents(Staged::Kind::kCheckpoint, copies);
  // Until the copies have run the slots stay out of the free list, whatever happens to them.
  if (!copied.empty()) KVPOOL_CHECK_OK(cache.MarkStatesInFlight(copied, last));
}

void TierSet::StageWindowBlocks(KvCacheManager& cache, const kernels::KvPoolView& view,
                                std::span<const PublishedWindowBlock> published) {
  if (!keeps_window_blocks() || published.empty()) return;
  const auto* region = static_cast<const std::byte*>(view.Window().base);
  std::vector<ComponentCopy> copies;
  copies.reserve(published.size());
  for (const PublishedWindowBlock& w : published) {
    copies.push_back({&w.block, region + w.window.value() * window_bytes_, w.window});
  }
  const auto [copied, last] = StageComponents(Staged::Kind::kWindow, copies);
  // Until the copies have run the blocks stay out of the free list, whatever happens to them.
  if (!copied.empty()) KVPOOL_CHECK_OK(cache.MarkWindowInFlight(copied, last));
}

std::pair<std::vector<BlockId>, Fence> TierSet::StageComponents(
    Staged::Kind kind, std::span<const ComponentCopy> copies) {
  std::pair<std::vector<BlockId>, Fence> out;
  auto& [copied, last] = out;
  // The compute stream may still be writing what a step just took: copy after it.
  const Fence computed = device_->LastFence(kernels::StreamId::kCompute);
  if (computed.value != 0 && !device_->StreamWait(kernels::StreamId::kTransfer, computed).ok()) {
    // Not stored (the tiers miss them), counted as Stage counts blocks; nothing else changes.
    absl::MutexLock lock(&mu_);
    counters_.demote_failed += copies.size();
    return out;
  }
  const int64_t bytes = BytesOf(kind);
  // Staged components of a kind take at most kMaxStagedBytes (and their count, the staging
  // bound).
  const int64_t most = std::max<int64_t>(1, kMaxStagedBytes / bytes);
  absl::MutexLock lock(&mu_);
  if (stopping_) {  // Stop's contract: later calls only drop, counted
    counters_.demote_dropped_full += copies.size();
    return out;
  }
  int64_t& staged = kind == Staged::Kind::kCheckpoint ? staged_checkpoints_ : staged_windows_;
  for (const ComponentCopy& c : copies) {
    const PublishedBlock& b = *c.block;
    if (static_cast<int64_t>(queue_.size()) + in_flight_ >= max_staged_ || staged >= most) {
      ++counters_.demote_dropped_full;
      continue;
    }
    absl::StatusOr<std::unique_ptr<kernels::DeviceBuffer>> buffer =
        device_->AllocateHostBuffer(bytes);
    if (!buffer.ok()) {
      ++counters_.demote_failed;
      continue;
    }
    const absl::StatusOr<Fence> fence =
        device_->CopyToHost(kernels::StreamId::kTransfer, (*buffer)->data(), c.src, bytes);
    if (!fence.ok()) {
      ++counters_.demote_failed;
      continue;
    }
    queue_.push_back(Staged{.space = {b.ns, layout_fingerprint_},
                            .hash = b.hash,
                            .parent = b.parent,
                            .tags = tags_of_ ? tags_of_(b.ns) : tier::NamespaceTags{},
                            .bytes = *std::move(buffer),
                            .fence = *fence,
                            .staged_ns = clock_->NowNanos(),
                            .kind = kind});
    ++staged;
    last = *fence;
    copied.push_back(c.id);
  }
  if (!copied.empty()) changed_.Signal();
  return out;
}

void TierSet::WriterLoop() {
  for (;;) {
    Staged item;
    {
      absl::MutexLock lock(&mu_);
      while (queue_.empty() && !stopping_) changed_.Wait(&mu_);
      if (queue_.empty()) return;  // stopping, and everything staged was offered
      item = std::move(queue_.front());
      queue_.pop_front();
      ++in_flight_;
    }
    const absl::Status copied = device_->Synchronize(item.fence);
    const int64_t spent = clock_->NowNanos() - item.staged_ns;
    const int64_t bytes = BytesOf(item.kind);
    if (copied.ok()) {
      const tier::BlockToStore block{
          .hash = item.hash,
          .parent = item.parent,
          .coverage = static_cast<uint32_t>(block_size_),
          .bytes = {static_cast<const std::byte*>(item.bytes->data()), static_cast<size_t>(bytes)},
          .tags = item.tags};
      if (item.kind == Staged::Kind::kCheckpoint) {  // every tier, in a store of its own
        if (checkpoints_) checkpoints_->Put(item.space, block);
        if (disk_checkpoints_) disk_checkpoints_->Put(CheckpointSpace(item.space.ns), block);
        if (remote_checkpoints_) remote_->Put(CheckpointSpace(item.space.ns), block);
      } else if (item.kind == Staged::Kind::kWindow) {  // the same
        if (windows_) windows_->Put(item.space, block);
        if (disk_windows_) disk_windows_->Put(WindowSpace(item.space.ns), block);
        if (remote_windows_) remote_->Put(WindowSpace(item.space.ns), block);
      } else {
        if (host_) host_->Put(item.space, block);
        if (disk_) disk_->Put(item.space, block);  // queued: never waits for the disk
        if (remote_) remote_->Put(item.space, block);
      }
    }
    std::function<void()> on_events;
    {
      absl::MutexLock lock(&mu_);
      if (!events_.empty()) on_events = on_events_;
    }
    if (on_events) on_events();  // before in_flight_ drops: Flush implies the events are logged
    absl::MutexLock lock(&mu_);
    if (item.kind == Staged::Kind::kCheckpoint) {
      --staged_checkpoints_;  // its buffer goes (staging buffers are blocks)
    } else if (item.kind == Staged::Kind::kWindow) {
      --staged_windows_;
    } else {
      GiveBack(std::move(item.bytes));
    }
    --in_flight_;
    if (copied.ok()) {
      ++(item.kind == Staged::Kind::kCheckpoint ? counters_.demoted_checkpoints
         : item.kind == Staged::Kind::kWindow   ? counters_.demoted_window_blocks
                                                : counters_.demoted);
      counters_.demoted_bytes += static_cast<uint64_t>(bytes);
      counters_.demote_ns += spent;
    } else {
      ++counters_.demote_failed;
      Logger("daemon").warn("tier: copying a block out failed: {}", copied.ToString());
    }
    changed_.SignalAll();
  }
}

TierSet::Found TierSet::Lookup(NamespaceId ns, const BlockHash& parent,
                               std::span<const BlockHash> hashes) {
  Found found;
  if (hashes.empty()) return found;
  {
    absl::MutexLock lock(&mu_);
    ++counters_.lookups;
  }
  const int64_t granted = Reserve(static_cast<int64_t>(hashes.size()));
  if (granted == 0) return found;
  hashes = hashes.first(static_cast<size_t>(granted));
  const tier::BlockSpace space{ns, layout_fingerprint_};
  if (host_) {
    found.host = host_->LookupPinned(space, parent, hashes);
    found.hits = found.from_host = found.host.size();
  }
  // Staging buffers for what the host tier did not have, when a tier below can fill them.
  std::vector<std::span<std::byte>> out;
  const size_t below = hashes.size() - static_cast<size_t>(found.hits);
  if (below > 0 && (disk_ || remote_)) {
    for (size_t i = 0; i < below; ++i) {
      std::unique_ptr<kernels::DeviceBuffer> buffer = TakeBuffer();
      if (buffer == nullptr) break;  // look up as many as there are buffers for
      out.emplace_back(static_cast<std::byte*>(buffer->data()), static_cast<size_t>(block_bytes_));
      found.buffers.push_back(std::move(buffer));
    }
  }
  {
    absl::MutexLock lock(&mu_);  // the lookup blocks neither pinned nor buffered go back
    lookup_held_ -= granted - found.from_host - static_cast<int64_t>(found.buffers.size());
  }
  if (out.empty()) return found;
  const size_t at = static_cast<size_t>(found.hits);
  const BlockHash& after = at == 0 ? parent : hashes[at - 1];
  hashes = hashes.subspan(at, out.size());
  if (disk_) {
    found.from_disk = LookupBelow(*disk_, space, after, hashes, out, 0);
    found.hits += found.from_disk;
  }
  if (remote_ && found.from_disk < static_cast<int64_t>(hashes.size())) {
    found.hits += LookupBelow(*remote_, space, after, hashes, out, found.from_disk);
  }
  return found;
}

void TierSet::LookupCheckpoint(NamespaceId ns, std::span<const BlockHash> chain, size_t from,
                               size_t upto, Found* found) {
  // REQUIRES: nothing reads what an earlier call found (its copy ran, or none was queued).
  found->checkpoint = -1;
  found->checkpoint_pin.Release();
  if (found->checkpoint_buffer != nullptr) {
    found->checkpoint_buffer.reset();
    absl::MutexLock lock(&mu_);
    --checkpoint_buffers_;
  }
  upto = std::min(upto, chain.size());
  const auto parent_of = [&](size_t at) { return at == 0 ? BlockHash{} : chain[at - 1]; };
  if (checkpoints_) {
    const tier::BlockSpace space{ns, layout_fingerprint_};
    for (size_t i = upto; i > from; --i) {
      tier::HostBlockStore::Pins pin =
          checkpoints_->LookupPinned(space, parent_of(i - 1), chain.subspan(i - 1, 1));
      if (pin.size() == 1) {
        found->checkpoint = static_cast<int64_t>(i - 1);
        found->checkpoint_pin = std::move(pin);
        return;
      }
    }
  }
  if ((!remote_checkpoints_ && !disk_checkpoints_) || upto <= from) return;
  {
    absl::MutexLock lock(&mu_);
    if (checkpoint_buffers_ >= std::max<int64_t>(1, kMaxStagedBytes / state_bytes_)) {
      ++counters_.lookup_truncated;
      return;
    }
    ++checkpoint_buffers_;
  }
  absl::StatusOr<std::unique_ptr<kernels::DeviceBuffer>> buffer =
      device_->AllocateHostBuffer(state_bytes_);
  const auto give_back = [this] {
    absl::MutexLock lock(&mu_);
    --checkpoint_buffers_;
  };
  if (!buffer.ok()) return give_back();
  const std::span<std::byte> out(static_cast<std::byte*>((*buffer)->data()),
                                 static_cast<size_t>(state_bytes_));
  const tier::BlockSpace space = CheckpointSpace(ns);
  // The disk's index answers a miss without I/O: every block is asked; Redis for the deepest few,
  // which of them it has in one round trip (MayHave), then only those, deepest first.
  std::vector<BlockHash> deepest;  // chain[upto - 1], chain[upto - 2], ...
  for (auto [store, most] :
       {std::pair<tier::RemoteTier*, size_t>{disk_checkpoints_.get(), upto},
        {remote_checkpoints_ ? remote_.get() : nullptr, size_t{kMaxRemoteCheckpointProbes}}}) {
    if (store == nullptr) continue;
    deepest.clear();
    for (size_t i = upto; i > from && deepest.size() < most; --i) deepest.push_back(chain[i - 1]);
    const std::vector<bool> may_have = store->MayHave(space, deepest);
    for (size_t k = 0; k < deepest.size(); ++k) {
      if (!may_have[k]) continue;
      const size_t at = upto - 1 - k;
      const absl::StatusOr<tier::LookupResult> r =
          store->Lookup(space, parent_of(at), chain.subspan(at, 1), std::span(&out, 1));
      if (r.ok() && r->hits == 1) {
        found->checkpoint = static_cast<int64_t>(at);
        found->checkpoint_buffer = *std::move(buffer);
        return;  // held until Recycle
      }
    }
  }
  give_back();
}

size_t TierSet::LookupWindow(NamespaceId ns, std::span<const BlockHash> chain, size_t from,
                             size_t upto, const WindowReach& reach, Found* found) {
  // REQUIRES: nothing reads what an earlier call found (its copy ran, or none was queued).
  for (size_t i = 0; i < found->window_pins.size(); ++i) {
    DropWindowBlock(found, static_cast<size_t>(found->window_from) + i);
  }
  found->window_from = static_cast<int64_t>(from);
  upto = std::min(upto, chain.size());
  found->window_pins.clear();
  found->window_buffers.clear();
  if (!keeps_window_blocks() || upto <= from) return from;
  found->window_pins.resize(upto - from);
  found->window_buffers.resize(upto - from);
  // The host tier is asked for each block at most once, pinned: a window store keeps blocks, not
  // chains.
  const tier::BlockSpace space{ns, layout_fingerprint_};
  std::vector<bool> asked(upto - from, false);
  const auto have = [&](size_t i) {
    if (!asked[i - from] && windows_) {
      asked[i - from] = true;
      found->window_pins[i - from] =
          windows_->LookupPinned(space, i == 0 ? BlockHash{} : chain[i - 1], chain.subspan(i, 1));
    }
    return found->window_pins[i - from].size() == 1 || found->window_buffers[i - from] != nullptr;
  };
  const auto sinks = static_cast<size_t>(reach.sink_blocks);
  // The disk, then Redis, for what a candidate point's window reaches and neither the host tier
  // nor an earlier round had: one lookup per run of consecutive blocks (the sinks', the window's)
  // in each. At most kMaxWindowRounds candidates are asked of them; past that only what is at hand
  // counts.
  std::vector<bool> asked_below(upto - from, false);
  int rounds = 0;
  bool starved = false;  // no window buffer was left for a round: none is for the next
  const auto ask_below = [&](size_t point) {
    if ((!remote_windows_ && !disk_windows_) || starved || rounds++ >= kMaxWindowRounds) return;
    const auto start = static_cast<size_t>(reach.Start(static_cast<int64_t>(point)));
    std::vector<std::pair<size_t, size_t>> runs;
    const auto add = [&](size_t i) {
      if (have(i) || asked_below[i - from]) return;
      asked_below[i - from] = true;
      if (!runs.empty() && runs.back().second == i) {
        ++runs.back().second;
      } else {
        runs.emplace_back(i, i + 1);
      }
    };
    for (size_t i = from; i < std::min(sinks, start); ++i) add(i);
    for (size_t i = std::max(from, start); i < point; ++i) add(i);
    for (const auto& [first, end] : runs) {
      size_t at = first;
      if (disk_windows_) at += ReadWindows(*disk_windows_, ns, chain, at, end, found, &starved);
      if (remote_windows_ && at < end) ReadWindows(*remote_, ns, chain, at, end, found, &starved);
    }
  };
  // Deepest point first; a block no tier has rules out every point whose window reaches it, so
  // the next candidate ends just before it (KvCacheManager::CutToWindow, over the tiers).
  size_t point = upto;
  while (point > from) {
    ask_below(point);
    size_t missing = point;
    const auto begin = static_cast<size_t>(reach.Start(static_cast<int64_t>(point)));
    for (size_t i = point; i > std::max(from, begin) && missing == point;) {
      if (!have(--i)) missing = i;
    }
    for (size_t i = std::min(sinks, begin); i > from && missing == point;) {
      if (!have(--i)) missing = i;
    }
    if (missing == point) break;  // every block it reaches was found
    point = missing;
  }
  if (point == from || !KeepWindowBlocks(point, reach, found)) {
    KeepWindowBlocks(from, reach, found);  // none: drops them all
    return from;
  }
  return point;
}

size_t TierSet::LookupResume(NamespaceId ns, std::span<const BlockHash> chain, size_t from,
                             size_t upto, bool checkpoint, const WindowReach* window,
                             Found* found) {
  if (upto <= from) return from;
  if (!checkpoint)
    return window == nullptr ? upto : LookupWindow(ns, chain, from, upto, *window, found);
  // A checkpoint, deepest first; with a window group, one whose window the tiers have whole. A
  // checkpoint whose window is not is passed over for the deepest one at or below the deepest
  // point whose window is (LookupWindow's answer).
  size_t bound = upto;
  for (int tries = 0; tries < kMaxResumeTries && bound > from; ++tries) {
    LookupCheckpoint(ns, chain, from, bound, found);
    if (found->checkpoint < 0) break;
    const auto end = static_cast<size_t>(found->checkpoint) + 1;
    if (window == nullptr) return end;
    const size_t point = LookupWindow(ns, chain, from, end, *window, found);
    if (point == end) return end;
    bound = point;
  }
  // None: lets go of what was found (a checkpoint, the window blocks of a point before it).
  LookupCheckpoint(ns, chain, from, from, found);
  if (window != nullptr) LookupWindow(ns, chain, from, from, *window, found);
  return from;
}

size_t TierSet::ReadWindows(tier::RemoteTier& store, NamespaceId ns,
                            std::span<const BlockHash> chain, size_t first, size_t end,
                            Found* found, bool* starved) {
  const auto from = static_cast<size_t>(found->window_from);
  size_t take = end - first;
  {
    absl::MutexLock lock(&mu_);
    const int64_t most = std::max<int64_t>(1, kMaxStagedBytes / window_bytes_);
    const auto left = static_cast<size_t>(std::max<int64_t>(0, most - window_buffers_));
    if (left < take) {
      take = left;
      ++counters_.lookup_truncated;
      *starved = true;
    }
    window_buffers_ += static_cast<int64_t>(take);
  }
  std::vector<std::span<std::byte>> out;
  for (size_t i = first; i < first + take; ++i) {
    absl::StatusOr<std::unique_ptr<kernels::DeviceBuffer>> buffer =
        device_->AllocateHostBuffer(window_bytes_);
    if (!buffer.ok()) break;
    out.emplace_back(static_cast<std::byte*>((*buffer)->data()),
                     static_cast<size_t>(window_bytes_));
    found->window_buffers[i - from] = *std::move(buffer);
  }
  if (out.size() < take) {
    absl::MutexLock lock(&mu_);
    window_buffers_ -= static_cast<int64_t>(take - out.size());
  }
  if (out.empty()) return 0;
  const absl::StatusOr<tier::LookupResult> r =
      store.Lookup(WindowSpace(ns), first == 0 ? BlockHash{} : chain[first - 1],
                   chain.subspan(first, out.size()), out);
  const size_t hits = r.ok() ? static_cast<size_t>(r->hits) : 0;
  for (size_t i = first + hits; i < first + out.size(); ++i) DropWindowBlock(found, i);
  return hits;
}

void TierSet::DropWindowBlock(Found* found, size_t i) {
  const size_t at = i - static_cast<size_t>(found->window_from);
  if (at >= found->window_pins.size()) return;
  found->window_pins[at].Release();
  if (found->window_buffers[at] != nullptr) {
    found->window_buffers[at].reset();
    absl::MutexLock lock(&mu_);
    --window_buffers_;
  }
}

bool TierSet::KeepWindowBlocks(size_t blocks, const WindowReach& reach, Found* found) {
  const auto from = static_cast<size_t>(found->window_from);
  const size_t have = found->window_pins.size();
  const auto found_at = [&](size_t i) {
    return i - from < have &&
           (found->window_pins[i - from].size() == 1 || found->window_buffers[i - from] != nullptr);
  };
  for (size_t i = from; i < blocks; ++i) {
    if (reach.Needs(static_cast<int64_t>(i), static_cast<int64_t>(blocks)) && !found_at(i)) {
      return false;
    }
  }
  for (size_t i = from; i < from + have; ++i) {
    if (!reach.Needs(static_cast<int64_t>(i), static_cast<int64_t>(blocks))) {
      DropWindowBlock(found, i);
    }
  }
  return true;
}

void TierSet::KeepWindowsInHost(NamespaceId ns, std::span<const BlockHash> chain, size_t upto,
                                const Found& found) {
  if (!windows_) return;
  const tier::BlockSpace space{ns, layout_fingerprint_};
  const tier::NamespaceTags tags = tags_of_ ? tags_of_(ns) : tier::NamespaceTags{};
  const auto from = static_cast<size_t>(found.window_from);
  for (size_t i = from; i < std::min(upto, from + found.window_buffers.size()); ++i) {
    const std::unique_ptr<kernels::DeviceBuffer>& buffer = found.window_buffers[i - from];
    if (buffer == nullptr) continue;
    windows_->Put(space, {.hash = chain[i],
                          .parent = i == 0 ? BlockHash{} : chain[i - 1],
                          .coverage = static_cast<uint32_t>(block_size_),
                          .bytes = {static_cast<const std::byte*>(buffer->data()),
                                    static_cast<size_t>(window_bytes_)},
                          .tags = tags});
  }
}

std::span<const std::byte> TierSet::Found::window_block(int64_t entry) const {
  const int64_t i = entry - window_from;
  KVPOOL_CHECK_MSG(i >= 0 && i < static_cast<int64_t>(window_pins.size()),
                   "tier lookup: window block not found");
  const auto at = static_cast<size_t>(i);
  if (window_pins[at].size() == 1) return window_pins[at].block(0);
  KVPOOL_CHECK_MSG(window_buffers[at] != nullptr, "tier lookup: window block not found");
  return {static_cast<const std::byte*>(window_buffers[at]->data()),
          static_cast<size_t>(window_buffers[at]->bytes())};
}

std::span<const std::byte> TierSet::Found::checkpoint_bytes(int64_t bytes) const {
  KVPOOL_CHECK_MSG(checkpoint >= 0, "tier lookup: no checkpoint found");
  if (checkpoint_pin.size() == 1) return checkpoint_pin.block(0);
  KVPOOL_CHECK_MSG(checkpoint_buffer != nullptr, "tier lookup: no checkpoint found");
  return {static_cast<const std::byte*>(checkpoint_buffer->data()), static_cast<size_t>(bytes)};
}

void TierSet::KeepCheckpointInHost(NamespaceId ns, const BlockHash& parent, const BlockHash& hash,
                                   const Found& found) {
  if (!checkpoints_ || found.checkpoint < 0 || found.checkpoint_buffer == nullptr) return;
  checkpoints_->Put({ns, layout_fingerprint_},
                    {.hash = hash,
                     .parent = parent,
                     .coverage = static_cast<uint32_t>(block_size_),
                     .bytes = found.checkpoint_bytes(state_bytes_),
                     .tags = tags_of_ ? tags_of_(ns) : tier::NamespaceTags{}});
}

int64_t TierSet::LookupBelow(tier::RemoteTier& store, const tier::BlockSpace& space,
                             const BlockHash& parent, std::span<const BlockHash> hashes,
                             std::span<const std::span<std::byte>> out, int64_t from) {
  const size_t at = static_cast<size_t>(from);
  const BlockHash& after = at == 0 ? parent : hashes[at - 1];
  const absl::StatusOr<tier::LookupResult> r =
      store.Lookup(space, after, hashes.subspan(at), out.subspan(at));
  return r.ok() ? r->hits : 0;
}

int64_t TierSet::Reserve(int64_t want) {
  absl::MutexLock lock(&mu_);
  const int64_t granted = std::clamp<int64_t>(max_lookup_ - lookup_held_, 0, want);
  if (granted < want) ++counters_.lookup_truncated;
  lookup_held_ += granted;
  return granted;
}

std::unique_ptr<kernels::DeviceBuffer> TierSet::TakeBuffer() {
  {
    absl::MutexLock lock(&mu_);
    if (!spare_.empty()) {
      std::unique_ptr<kernels::DeviceBuffer> buffer = std::move(spare_.back());
      spare_.pop_back();
      return buffer;
    }
  }
  absl::StatusOr<std::unique_ptr<kernels::DeviceBuffer>> made =
      device_->AllocateHostBuffer(block_bytes_);
  return made.ok() ? std::move(*made) : nullptr;
}

void TierSet::GiveBack(std::unique_ptr<kernels::DeviceBuffer> buffer) {
  // Keep as many as staging may use at once; lookups beyond that allocate and free.
  if (static_cast<int64_t>(spare_.size()) < max_staged_) spare_.push_back(std::move(buffer));
}

void TierSet::Recycle(Found* found) {
  if (!device_->HasPassed(found->reads)) {
    // A copy queued from these slots and buffers may still run (a promotion that failed after
    // queueing some): neither is reused before it has.
    const absl::Status s = device_->Synchronize(found->reads);
    if (!device_->HasPassed(found->reads)) {
      Logger("daemon").error(
          "tier: a promotion's copies never completed ({}): {} host slots and "
          "{} buffers stay held",
          s.ToString(), found->host.size(), found->buffers.size());
      absl::MutexLock lock(&mu_);
      kept_.push_back(std::move(*found));
      *found = Found{};
      return;
    }
  }
  const int64_t pinned = found->host.size();
  found->host.Release();
  found->checkpoint_pin.Release();
  found->window_pins.clear();  // unpins
  int64_t window_buffers = 0;
  for (auto& buffer : found->window_buffers) window_buffers += buffer != nullptr ? 1 : 0;
  found->window_buffers.clear();
  const bool buffered = found->checkpoint_buffer != nullptr;
  found->checkpoint_buffer.reset();
  found->checkpoint = -1;
  absl::MutexLock lock(&mu_);
  checkpoint_buffers_ -= buffered ? 1 : 0;
  window_buffers_ -= window_buffers;
  lookup_held_ -= pinned + static_cast<int64_t>(found->buffers.size());
  for (auto& buffer : found->buffers) GiveBack(std::move(buffer));
  found->buffers.clear();
  found->hits = found->from_host = found->from_disk = 0;
  found->reads = Fence{};
}

void TierSet::KeepInHost(NamespaceId ns, const BlockHash& parent, std::span<const BlockHash> hashes,
                         const Found& found, size_t first) {
  if (!host_) return;
  const tier::BlockSpace space{ns, layout_fingerprint_};
  const tier::NamespaceTags tags = tags_of_ ? tags_of_(ns) : tier::NamespaceTags{};
  for (size_t i = 0; i < hashes.size() && first + i < static_cast<size_t>(found.hits); ++i) {
    host_->Put(space, {.hash = hashes[i],
                       .parent = i == 0 ? parent : hashes[i - 1],
                       .coverage = static_cast<uint32_t>(block_size_),
                       .bytes = found.block(first + i, block_bytes_),
                       .tags = tags});
  }
}

std::span<const std::byte> TierSet::Found::block(size_t i, int64_t bytes) const {
  KVPOOL_CHECK_MSG(i < static_cast<size_t>(hits), "tier lookup: hit index out of range");
  if (i < static_cast<size_t>(from_host)) return host.block(i);
  const size_t b = i - static_cast<size_t>(from_host);
  KVPOOL_CHECK_MSG(b < buffers.size(), "tier lookup: hit index out of range");
  return {static_cast<const std::byte*>(buffers[b]->data()), static_cast<size_t>(bytes)};
}

void TierSet::CountRaced() {
  absl::MutexLock lock(&mu_);
  ++counters_.promote_raced;
}

void TierSet::CountHoldEnd(bool adopted) {
  absl::MutexLock lock(&mu_);
  ++(adopted ? counters_.promote_adopted : counters_.promote_unused);
}

void TierSet::CountPromotion(int64_t from_host, int64_t from_disk, int64_t from_remote,
                             int64_t ns_spent, bool failed, bool checkpoint,
                             int64_t window_blocks) {
  const int64_t blocks = from_host + from_disk + from_remote;
  absl::MutexLock lock(&mu_);
  if (failed) {
    counters_.promote_failed += static_cast<uint64_t>(blocks);
    return;
  }
  if (checkpoint) {
    ++counters_.promoted_checkpoints;
    counters_.promoted_bytes += static_cast<uint64_t>(state_bytes_);
  }
  counters_.promoted_window_blocks += static_cast<uint64_t>(window_blocks);
  counters_.promoted_bytes += static_cast<uint64_t>(window_blocks * window_bytes_);
  counters_.promoted_from_host += static_cast<uint64_t>(from_host);
  counters_.promoted_from_disk += static_cast<uint64_t>(from_disk);
  counters_.promoted_from_remote += static_cast<uint64_t>(from_remote);
  counters_.promoted_bytes += static_cast<uint64_t>(blocks * block_bytes_);
  counters_.promote_ns += ns_spent;
}

absl::Status TierSet::Flush(absl::Duration timeout) {
  const int64_t deadline_ns = clock_->NowNanos() + absl::ToInt64Nanoseconds(timeout);
  {
    absl::MutexLock lock(&mu_);
    auto drained = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return queue_.empty() && in_flight_ == 0;
    };
    if (!clock_->AwaitUntil(mu_, absl::Condition(&drained), deadline_ns)) {
      return absl::DeadlineExceededError("tier: staged copies still pending");
    }
  }
  // The stores take a timeout: what is left of the deadline on the same clock.
  auto left = [&] {
    return absl::Nanoseconds(std::max<int64_t>(deadline_ns - clock_->NowNanos(), 0));
  };
  for (tier::DiskBlockStore* disk : {disk_.get(), disk_checkpoints_.get(), disk_windows_.get()}) {
    if (disk != nullptr) KVPOOL_RETURN_IF_ERROR(disk->Flush(left()));
  }
  if (remote_) return remote_->Flush(left());
  return absl::OkStatus();
}

TierStats TierSet::stats() const {
  TierStats out;
  {
    absl::MutexLock lock(&mu_);
    out = counters_;
    out.demote_queued = static_cast<int64_t>(queue_.size()) + in_flight_;
  }
  out.host = host_ != nullptr;
  out.remote = remote_ != nullptr;
  if (host_) {
    out.host_capacity_blocks = host_->capacity();
    out.host_blocks = host_->stored();
    out.host_evicted = host_->evicted();
    out.host_store = host_->stats();
  }
  if (remote_) out.remote_store = remote_->stats();
  if (checkpoints_) {
    out.host_checkpoint_capacity = checkpoints_->capacity();
    out.host_checkpoints = checkpoints_->stored();
  }
  if (windows_) {
    out.host_window_capacity = windows_->capacity();
    out.host_window_blocks = windows_->stored();
  }
  if (disk_checkpoints_) out.disk_checkpoints = disk_checkpoints_->disk_stats().blocks;
  if (disk_windows_) out.disk_window_blocks = disk_windows_->disk_stats().blocks;
  out.disk = disk_ != nullptr;
  if (disk_) {
    out.disk_store = disk_->stats();
    out.disk_tier = disk_->disk_stats();
  }
  return out;
}

int64_t TierSet::Invalidate(const tier::TagFilter& filter) {
  // Checkpoints and window blocks are derived from their prefix's KV: they go with the blocks.
  if (checkpoints_) checkpoints_->Invalidate(filter);
  if (windows_) windows_->Invalidate(filter);
  const int64_t from_host = host_ ? host_->Invalidate(filter) : 0;
  // The disk stores tell of what they drop on this thread, which holds the engine's lock: their
  // events wait for the engine's drain (OnStoreChange).
  t_invalidating = true;
  if (disk_checkpoints_) disk_checkpoints_->Invalidate(filter);
  if (disk_windows_) disk_windows_->Invalidate(filter);
  const int64_t from_disk = disk_ ? disk_->Invalidate(filter) : 0;
  t_invalidating = false;
  absl::MutexLock lock(&mu_);
  counters_.host_invalidated += static_cast<uint64_t>(from_host);
  return from_host + from_disk;
}

void TierSet::SetTenantWeight(uint64_t tenant, int32_t weight) {
  // RESOURCE_EXHAUSTED (no share left) leaves the tenant in the default order, as in the pool.
  for (tier::HostBlockStore* store : {host_.get(), checkpoints_.get(), windows_.get()}) {
    if (store != nullptr) (void)store->SetTenantWeight(tenant, weight);
  }
  for (tier::DiskBlockStore* store : {disk_.get(), disk_checkpoints_.get(), disk_windows_.get()}) {
    if (store != nullptr) (void)store->SetTenantWeight(tenant, weight);
  }
  if (remote_) (void)remote_->SetTenantWeight(tenant, weight);  // its write budget's share
}

TierSet::TenantUse TierSet::UseOf(uint64_t tenant) const {
  TenantUse use;
  if (host_) {
    use.blocks += host_->stored_by(tenant);
    use.evicted += host_->evicted_from(tenant);
  }
  if (disk_) {
    use.blocks += disk_->stored_by(tenant);
    use.evicted += disk_->evicted_from(tenant);
  }
  if (remote_) {
    const tier::TenantWrites writes = remote_->WritesOf(tenant);
    use.remote_bytes = writes.live_bytes;
    use.remote_over_budget = writes.over_budget;
  }
  return use;
}

}  // namespace kvpool::daemon
