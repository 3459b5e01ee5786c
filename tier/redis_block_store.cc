#include "tier/redis_block_store.h"

#include <hiredis/hiredis.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kvpool/util/check.h"
#include "kvpool/util/fmt.h"
#include "kvpool/util/logging.h"
#include "kvpool/util/status_macros.h"

namespace kvpool::tier {
namespace {

spdlog::logger& Log() { return Logger("tier"); }

absl::Status ValidateOptions(const RedisTierOptions& o) {
  if (!o.enabled) return absl::InvalidArgumentError("redis tier: enabled is false");
  if (o.connect_timeout <= absl::ZeroDuration() || o.command_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "redis tier: connect_timeout and command_timeout must be > 0");
  }
  if (o.max_redirects < 1) return absl::InvalidArgumentError("redis tier: max_redirects < 1");
  if (o.write_queue_blocks < 1 || o.write_queue_bytes < 1 || o.write_batch_blocks < 1) {
    return absl::InvalidArgumentError(
        "redis tier: write_queue_blocks, write_queue_bytes and write_batch_blocks must be >= 1");
  }
  if (o.ttl_seconds < 0) return absl::InvalidArgumentError("redis tier: ttl_seconds < 0");
  if (o.tenant_write_budget_bytes < 0 || o.tenant_shares < 0) {
    return absl::InvalidArgumentError(
        "redis tier: tenant_write_budget_bytes and tenant_shares must be >= 0");
  }
  if (o.tenant_write_budget_bytes > 0 && o.ttl_seconds == 0) {
    return absl::InvalidArgumentError(
        "redis tier: tenant_write_budget_bytes needs ttl_seconds > 0 (the budget counts the bytes "
        "written within one TTL: without one, a value lives until Redis evicts it)");
  }
  if (o.breaker_failure_threshold < 1) {
    return absl::InvalidArgumentError("redis tier: breaker_failure_threshold < 1");
  }
  if (o.breaker_backoff <= absl::ZeroDuration() || o.breaker_max_backoff < o.breaker_backoff) {
    return absl::InvalidArgumentError(
        "redis tier: need 0 < breaker_backoff <= breaker_max_backoff");
  }
  return absl::OkStatus();
}

// The first transport failure among `replies` (OK when every command reached Redis and got an
// answer; an error reply is Redis working, not a reason to open the breaker).
absl::Status TransportStatus(const std::vector<absl::StatusOr<RedisReply>>& replies) {
  for (const auto& reply : replies) {
    if (!reply.ok() && absl::IsUnavailable(reply.status())) return reply.status();
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<RedisBlockStore>> RedisBlockStore::Create(
    const RedisTierOptions& options, const DeploymentSecret& secret, const Clock* clock) {
  absl::Status status = ValidateOptions(options);
  if (!status.ok()) return status;
  absl::StatusOr<std::unique_ptr<RedisClient>> writer = CreateRedisClient(options);
  if (!writer.ok()) return writer.status();
  return absl::WrapUnique(new RedisBlockStore(options, secret, clock, std::move(*writer)));
}

RedisBlockStore::RedisBlockStore(const RedisTierOptions& options, const DeploymentSecret& secret,
                                 const Clock* clock, std::unique_ptr<RedisClient> writer)
    : options_(options),
      secret_(secret),
      clock_(clock),
      breaker_({.failure_threshold = options.breaker_failure_threshold,
                .backoff = options.breaker_backoff,
                .max_backoff = options.breaker_max_backoff},
               clock),
      writer_{.client = std::move(writer)} {
  if (options.tenant_write_budget_bytes > 0) {
    absl::MutexLock lock(&queue_mu_);
    budget_ = std::make_unique<internal::TenantWriteBudget>(options.tenant_write_budget_bytes,
                                                            options.ttl_seconds * 1'000'000'000,
                                                            options.tenant_shares);
  }
  writer_thread_ = std::thread([this] { WriterLoop(); });
}

RedisBlockStore::~RedisBlockStore() {
  {
    absl::MutexLock lock(&queue_mu_);
    stopping_ = true;
  }
  writer_thread_.join();
}

// --- reads ------------------------------------------------------------------------------------

RedisBlockStore::PooledClient RedisBlockStore::AcquireReader() {
  {
    absl::MutexLock lock(&readers_mu_);
    if (!idle_readers_.empty()) {
      PooledClient reader = std::move(idle_readers_.back());
      idle_readers_.pop_back();
      return reader;
    }
  }
  absl::StatusOr<std::unique_ptr<RedisClient>> client = CreateRedisClient(options_);
  // Create() built the writer's client from the same options, so this cannot fail.
  KVPOOL_CHECK_OK(client.status());
  return PooledClient{.client = std::move(*client)};
}

void RedisBlockStore::ReleaseReader(PooledClient reader) {
  AddClientStats(&reader);
  absl::MutexLock lock(&readers_mu_);
  idle_readers_.push_back(std::move(reader));
}

void RedisBlockStore::AddClientStats(PooledClient* pooled) {
  const RedisClientStats now = pooled->client->stats();
  RedisClientStats& was = pooled->reported;
  counters_.round_trips += now.round_trips - was.round_trips;
  counters_.connects += now.connects - was.connects;
  counters_.connect_failures += now.connect_failures - was.connect_failures;
  counters_.io_errors += now.io_errors - was.io_errors;
  counters_.moved_redirects += now.moved_redirects - was.moved_redirects;
  counters_.ask_redirects += now.ask_redirects - was.ask_redirects;
  counters_.slot_map_refreshes += now.slot_map_refreshes - was.slot_map_refreshes;
  counters_.refused_redirects += now.refused_redirects - was.refused_redirects;
  was = now;
}

void RedisBlockStore::ReportOutcome(const absl::Status& transport) {
  if (transport.ok()) {
    const BreakerState before = breaker_.state();
    breaker_.OnSuccess();
    if (before != BreakerState::kClosed) Log().info("redis tier: breaker closed, Redis is back");
    return;
  }
  const uint64_t opens = breaker_.opens();
  breaker_.OnFailure();
  if (breaker_.opens() != opens) {
    Log().warn("redis tier: breaker open (lookups miss, writes drop): {}", transport.message());
  }
}

void RedisBlockStore::LogFailure(Sent sent, const absl::Status& failure) {
  static constexpr std::array<std::pair<std::string_view, std::string_view>, 3> kWhat = {{
      {"GET", "lookup"},
      {"EXISTS", "checkpoint probe"},
      {"SET", "write"},
  }};
  const auto [command, what] = kWhat[static_cast<size_t>(sent)];
  if (absl::IsUnavailable(failure) ||
      refusal_logged_[static_cast<size_t>(sent)].exchange(true, std::memory_order_relaxed)) {
    Log().debug("redis tier: {}: {}", what, failure.message());
    return;
  }
  Log().warn(
      "redis tier: the server refused {} ({}); each {} it refuses is a miss or a drop, counted in "
      "the tier's errors and logged once here (the daemons' ACL user needs every command "
      "deploy/redis-kvpool-acl.rules allows)",
      command, failure.message(), what);
}

std::vector<RedisCommand> RedisBlockStore::PerBlock(std::string_view command,
                                                    const BlockSpace& space,
                                                    std::span<const BlockHash> hashes,
                                                    std::vector<std::string>* keys) const {
  const SpaceKeys space_keys(secret_, space, options_.key_slotting);
  keys->clear();
  keys->reserve(hashes.size());
  for (const BlockHash& hash : hashes) keys->push_back(space_keys.Key(hash));
  std::vector<RedisCommand> commands;
  commands.reserve(hashes.size());
  for (const std::string& key : *keys) commands.push_back(RedisCommand{.args = {command, key}});
  return commands;
}

LookupResult RedisBlockStore::LookupChecked(const BlockSpace& space, const BlockHash& parent,
                                            std::span<const BlockHash> hashes,
                                            std::span<const std::span<std::byte>> out) {
  LookupResult result;
  ++counters_.lookups;
  if (!breaker_.Allow()) {
    ++counters_.rejected_lookups;
    counters_.misses += hashes.size();
    return result;
  }
  std::vector<std::string> keys;
  std::vector<RedisCommand> commands = PerBlock("GET", space, hashes, &keys);
  // Each value is checked where hiredis read it and its payload copied into out[i] only when it
  // passed (one copy; ValueSink), so a lookup never holds a value beyond hiredis's read buffer.
  std::vector<ValueSink> sinks;
  sinks.reserve(hashes.size());
  size_t first_miss = hashes.size();  // lowest index known not to be a hit
  for (size_t i = 0; i < hashes.size(); ++i) {
    sinks.push_back({this, &space, keys[i], &hashes[i], i == 0 ? &parent : &hashes[i - 1], out[i],
                     i, &first_miss});
    commands[i].sink = &sinks[i];
  }
  std::vector<bool> verified(hashes.size(), false);
  absl::Status failure;  // the first failed command's status
  PooledClient reader = AcquireReader();
  reader.client->Stream(commands, [&](size_t i, absl::StatusOr<RedisReply> reply) {
    if (!reply.ok()) {
      if (failure.ok() || (absl::IsUnavailable(reply.status()) && !absl::IsUnavailable(failure))) {
        failure = reply.status();
      }
      first_miss = std::min(first_miss, i);
      return;
    }
    if (i > first_miss) return;  // past a gap: never part of the prefix
    ValueSink& sink = sinks[i];
    if (!sink.taken && (**reply).type == REDIS_REPLY_STRING) {  // not offered to the sink
      sink.verified =
          VerifyAndCopy(space, keys[i], hashes[i], *sink.parent,
                        std::string_view((**reply).str, (**reply).len), out[i], &sink.coverage);
    }
    if (sink.verified) {
      verified[i] = true;
    } else {
      first_miss = std::min(first_miss, i);  // nil (never stored, or evicted) or refused
    }
  });
  ReleaseReader(std::move(reader));
  ReportOutcome(absl::IsUnavailable(failure) ? failure : absl::OkStatus());
  if (!failure.ok()) {
    ++counters_.lookup_errors;
    LogFailure(Sent::kGet, failure);
  }
  while (result.hits < static_cast<int64_t>(hashes.size()) && verified[result.hits]) {
    result.coverage.push_back(sinks[result.hits].coverage);
    counters_.bytes_read += out[result.hits].size();
    ++result.hits;
  }
  counters_.hits += result.hits;
  counters_.misses += hashes.size() - result.hits;
  return result;
}

std::vector<bool> RedisBlockStore::MayHave(const BlockSpace& space,
                                           std::span<const BlockHash> hashes) {
  std::vector<bool> present(hashes.size(), false);
  if (hashes.empty() || !breaker_.Allow()) return present;
  std::vector<std::string> keys;
  const std::vector<RedisCommand> commands = PerBlock("EXISTS", space, hashes, &keys);
  absl::Status failure;
  PooledClient reader = AcquireReader();
  reader.client->Stream(commands, [&](size_t i, absl::StatusOr<RedisReply> reply) {
    if (!reply.ok()) {
      if (failure.ok()) failure = reply.status();
      return;
    }
    present[i] = (**reply).type == REDIS_REPLY_INTEGER && (**reply).integer == 1;
  });
  ReleaseReader(std::move(reader));
  ReportOutcome(absl::IsUnavailable(failure) ? failure : absl::OkStatus());
  if (!failure.ok()) {
    ++counters_.lookup_errors;
    LogFailure(Sent::kExists, failure);
  }
  return present;
}

bool RedisBlockStore::ValueSink::Take(std::string_view value) {
  taken = true;
  // Past a gap the value is never part of the prefix: dropped unchecked, as the reply would be.
  if (index <= *first_miss) {
    verified = store->VerifyAndCopy(*space, key, *hash, *parent, value, out, &coverage);
  }
  return true;
}

bool RedisBlockStore::ValueSink::Place(size_t len, Placement* where) {
  if (index > *first_miss || len != kBlockHeaderBytes + out.size()) return false;
  where->head = std::span<char>(head);
  where->tail = std::span<char>(reinterpret_cast<char*>(out.data()), out.size());
  return true;
}

void RedisBlockStore::ValueSink::Placed() {
  taken = true;
  const BlockExpectation expect{.layout_fingerprint = space->layout_fingerprint,
                                .hash = *hash,
                                .parent = parent,
                                .payload_bytes = static_cast<int64_t>(out.size())};
  BlockHeader header;
  const BlockCheck check = CheckBlockParts(
      store->secret_, key, std::string_view(head.data(), head.size()), out, expect, &header);
  verified = check == BlockCheck::kOk;
  if (verified) {
    coverage = header.coverage;
  } else {
    store->Refused(key, check, head.size() + out.size());
  }
}

void RedisBlockStore::Refused(std::string_view key, BlockCheck check, size_t value_bytes) {
  ++counters_.corrupt;
  if (check == BlockCheck::kMac) ++counters_.forged;
  Log().warn("redis tier: refused {}: {} ({} value bytes)", key, BlockCheckName(check),
             value_bytes);
}

bool RedisBlockStore::VerifyAndCopy(const BlockSpace& space, std::string_view key,
                                    const BlockHash& hash, const BlockHash& parent,
                                    std::string_view value, std::span<std::byte> out,
                                    uint32_t* coverage) {
  const BlockExpectation expect{.layout_fingerprint = space.layout_fingerprint,
                                .hash = hash,
                                .parent = &parent,
                                .payload_bytes = static_cast<int64_t>(out.size())};
  BlockHeader header;
  std::span<const std::byte> payload;
  const BlockCheck check = CheckBlockValue(secret_, key, value, expect, &header, &payload);
  if (check != BlockCheck::kOk) {
    Refused(key, check, value.size());
    return false;
  }
  std::memcpy(out.data(), payload.data(), payload.size());
  *coverage = header.coverage;
  return true;
}

// --- writes -----------------------------------------------------------------------------------

bool RedisBlockStore::Put(const BlockSpace& space, const BlockToStore& block) {
  ++counters_.puts;
  if (breaker_.state() == BreakerState::kOpen) {
    ++counters_.dropped_breaker_open;
    return false;
  }
  const int64_t value_bytes = kBlockHeaderBytes + static_cast<int64_t>(block.bytes.size());
  auto full = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(queue_mu_) {
    return static_cast<int64_t>(queue_.size()) >= options_.write_queue_blocks ||
           queued_bytes_ + value_bytes > options_.write_queue_bytes;
  };
  WriteItem item{.key = BlockKey(secret_, space, block.hash, options_.key_slotting)};
  {
    // Checked before the copy too, so a full queue or a spent budget costs no copy of the block.
    absl::MutexLock lock(&queue_mu_);
    if (full()) {
      ++counters_.dropped_queue_full;
      return false;
    }
    if (budget_) {
      item.reserved = entry_cost_.Of(static_cast<int64_t>(item.key.size()), value_bytes);
      item.share = budget_->Reserve(block.tags.tenant, item.reserved, clock_->NowNanos());
      if (item.share < 0) {
        ++counters_.dropped_over_budget;
        return false;
      }
    }
  }
  if (options_.put_gap_hook) options_.put_gap_hook();
  item.value.reserve(static_cast<size_t>(value_bytes));
  EncodeBlockValue(secret_, item.key, RandomValueNonce(),
                   {.layout_fingerprint = space.layout_fingerprint,
                    .hash = block.hash,
                    .parent = block.parent,
                    .coverage = block.coverage},
                   block.bytes, &item.value);
  absl::MutexLock lock(&queue_mu_);
  if (full() || stopping_) {
    ++(stopping_ ? counters_.dropped_shutdown : counters_.dropped_queue_full);
    if (item.share >= 0) budget_->Settle(item.share, item.reserved, false, 0);
    return false;
  }
  queued_bytes_ += value_bytes;
  ++enqueued_;
  queue_.push_back(std::move(item));
  return true;
}

void RedisBlockStore::WriterLoop() {
  std::vector<WriteItem> batch;
  for (;;) {
    batch.clear();
    {
      absl::MutexLock lock(&queue_mu_);
      queue_mu_.Await(absl::Condition(
          +[](RedisBlockStore* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->queue_mu_) {
            return s->stopping_ || !s->queue_.empty();
          },
          this));
      if (stopping_) {
        // Every reservation is given back (the store is going; keeps CheckInvariants true).
        for (const WriteItem& item : queue_) {
          if (item.share >= 0) budget_->Settle(item.share, item.reserved, false, 0);
        }
        counters_.dropped_shutdown += queue_.size();
        completed_ += static_cast<int64_t>(queue_.size());
        queue_.clear();
        queued_bytes_ = 0;
        return;
      }
      while (!queue_.empty() && static_cast<int>(batch.size()) < options_.write_batch_blocks) {
        batch.push_back(std::move(queue_.front()));
        queue_.pop_front();
      }
    }
    WriteBatch(batch);
    // Before the batch completes: a Flush sees its answer.
    if (options_.tenant_write_budget_bytes > 0) MeasureEntries(batch);
    CompleteBatch(batch);
  }
}

void RedisBlockStore::WriteBatch(std::vector<WriteItem>& batch) {
  if (!breaker_.Allow()) {
    counters_.dropped_breaker_open += batch.size();
    return;
  }
  const std::string ttl = absl::StrCat(options_.ttl_seconds);
  std::vector<RedisCommand> commands;
  commands.reserve(batch.size());
  for (const WriteItem& item : batch) {
    RedisCommand command{.args = {"SET", item.key, item.value, "NX"}};
    if (options_.ttl_seconds > 0) {
      command.args.push_back("EX");
      command.args.push_back(ttl);
    }
    commands.push_back(std::move(command));
  }
  std::vector<absl::StatusOr<RedisReply>> replies = writer_.client->Execute(commands);
  AddClientStats(&writer_);
  ReportOutcome(TransportStatus(replies));
  for (size_t i = 0; i < batch.size(); ++i) {
    if (!replies[i].ok()) {
      ++counters_.dropped_write_errors;
      LogFailure(Sent::kSet, replies[i].status());
    } else if ((*replies[i])->type == REDIS_REPLY_NIL) {
      ++counters_.already_present;
    } else {
      ++counters_.written;
      counters_.bytes_written += batch[i].value.size();
      batch[i].written = true;
    }
  }
}

void RedisBlockStore::CompleteBatch(const std::vector<WriteItem>& batch) {
  int64_t bytes = 0;
  for (const WriteItem& item : batch) bytes += static_cast<int64_t>(item.value.size());
  absl::MutexLock lock(&queue_mu_);
  if (budget_) {
    // After the round trip: a written value's TTL started before now, so counting its bytes from
    // now on counts them at least as long as Redis can hold them.
    const int64_t now = clock_->NowNanos();
    for (const WriteItem& item : batch) {
      if (item.share >= 0) budget_->Settle(item.share, item.reserved, item.written, now);
    }
  }
  queued_bytes_ -= bytes;
  completed_ += static_cast<int64_t>(batch.size());
}

void RedisBlockStore::MeasureEntries(const std::vector<WriteItem>& batch) {
  const WriteItem* sample = nullptr;
  {
    absl::MutexLock lock(&queue_mu_);
    for (const WriteItem& item : batch) {
      if (item.written && entry_cost_.Unmeasured(static_cast<int64_t>(item.value.size()))) {
        sample = &item;
        break;
      }
    }
  }
  if (sample == nullptr) return;
  const RedisCommand command{.args = {"MEMORY", "USAGE", sample->key}, .key_index = 2};
  std::vector<absl::StatusOr<RedisReply>> replies = writer_.client->Execute(std::span(&command, 1));
  AddClientStats(&writer_);
  int64_t usage = -1;
  if (replies[0].ok() && (*replies[0])->type == REDIS_REPLY_INTEGER) {
    usage = (*replies[0])->integer;
  } else if (replies[0].ok() && (*replies[0])->type == REDIS_REPLY_NIL) {
    return;  // evicted or expired already: asked again with the next one written
  } else if (!replies[0].ok() && absl::IsUnavailable(replies[0].status())) {
    return;  // not the server's answer: asked again
  } else {
    // Refused (an ACL without MEMORY USAGE, a server without the command): the model stands.
    Log().info(
        "redis tier: MEMORY USAGE not answered ({}); the write budget counts keys by its model of "
        "Redis with jemalloc",
        replies[0].ok() ? absl::string_view("not a number") : replies[0].status().message());
  }
  absl::MutexLock lock(&queue_mu_);
  entry_cost_.Measured(static_cast<int64_t>(sample->value.size()), usage);
}

absl::Status RedisBlockStore::Flush(absl::Duration timeout) {
  const int64_t deadline = clock_->NowNanos() + absl::ToInt64Nanoseconds(timeout);
  absl::MutexLock lock(&queue_mu_);
  const int64_t target = enqueued_;
  struct Arg {
    RedisBlockStore* store;
    int64_t target;
  } arg{this, target};
  const bool done = clock_->AwaitUntil(
      queue_mu_,
      absl::Condition(
          +[](Arg* a) ABSL_NO_THREAD_SAFETY_ANALYSIS { return a->store->completed_ >= a->target; },
          &arg),
      deadline);
  if (done) return absl::OkStatus();
  return absl::DeadlineExceededError(absl::StrCat("redis tier: ", target - completed_,
                                                  " queued blocks not written within the timeout"));
}

RemoteTierStats RedisBlockStore::stats() const {
  RemoteTierStats s;
  s.breaker = breaker_.state();
  s.breaker_opens = breaker_.opens();
  const Counters& c = counters_;
  s.lookups = c.lookups;
  s.rejected_lookups = c.rejected_lookups;
  s.lookup_errors = c.lookup_errors;
  s.hits = c.hits;
  s.misses = c.misses;
  s.corrupt = c.corrupt;
  s.forged = c.forged;
  s.puts = c.puts;
  s.written = c.written;
  s.already_present = c.already_present;
  s.dropped_queue_full = c.dropped_queue_full;
  s.dropped_over_budget = c.dropped_over_budget;
  s.dropped_breaker_open = c.dropped_breaker_open;
  s.dropped_write_errors = c.dropped_write_errors;
  s.dropped_shutdown = c.dropped_shutdown;
  s.bytes_read = c.bytes_read;
  s.bytes_written = c.bytes_written;
  absl::MutexLock lock(&queue_mu_);
  s.queued_blocks = static_cast<int64_t>(queue_.size());
  s.queued_bytes = queued_bytes_;
  return s;
}

absl::Status RedisBlockStore::SetTenantWeight(uint64_t tenant, int32_t weight) {
  absl::MutexLock lock(&queue_mu_);
  return budget_ ? budget_->SetWeight(tenant, weight) : absl::OkStatus();
}

TenantWrites RedisBlockStore::WritesOf(uint64_t tenant) const {
  absl::MutexLock lock(&queue_mu_);
  const int32_t share = budget_ && tenant != 0 ? budget_->FindShare(tenant) : -1;
  if (share <= 0) return {};  // none of its own: asking makes none
  const int64_t now = clock_->NowNanos();
  return {.live_bytes = budget_->HeldBytes(share, now),
          .budget_bytes = budget_->BudgetOf(share, now),
          .over_budget = budget_->Refused(share)};
}

RedisClientStats RedisBlockStore::client_stats() const {
  const Counters& c = counters_;
  return {.round_trips = c.round_trips,
          .connects = c.connects,
          .connect_failures = c.connect_failures,
          .io_errors = c.io_errors,
          .moved_redirects = c.moved_redirects,
          .ask_redirects = c.ask_redirects,
          .slot_map_refreshes = c.slot_map_refreshes,
          .refused_redirects = c.refused_redirects};
}

absl::Status RedisBlockStore::CheckInvariants() const {
  {
    absl::MutexLock lock(&queue_mu_);
    int64_t bytes_in_queue = 0;
    for (const WriteItem& item : queue_) bytes_in_queue += static_cast<int64_t>(item.value.size());
    // queued_bytes_ also counts the batch the writer holds, so it can exceed the queue's bytes.
    if (queued_bytes_ < bytes_in_queue || queued_bytes_ < 0) {
      return absl::InternalError("redis tier: queued bytes below the bytes in the queue");
    }
    if (completed_ > enqueued_ || enqueued_ - completed_ < static_cast<int64_t>(queue_.size())) {
      return absl::InternalError("redis tier: completed/enqueued counts out of step");
    }
    if (static_cast<int64_t>(queue_.size()) > options_.write_queue_blocks) {
      return absl::InternalError("redis tier: queue longer than write_queue_blocks");
    }
    if (budget_) KVPOOL_RETURN_IF_ERROR(budget_->CheckInvariants());
  }
  return breaker_.CheckInvariants();
}

}  // namespace kvpool::tier
