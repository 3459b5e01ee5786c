// KvPoolService: the gRPC edge over an in-process channel (no sockets, no processes):
// authentication, the admin role, the status mapping (with the shortfall trailer) and the
// translation of requests and replies.

#include "daemon/edge/service.h"

#include <sys/resource.h>

#include <chrono>
#include <limits>

#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kvpool/v1/wire.h"
#include "tests/daemon/engine_test_util.h"

namespace kvpool::daemon {
namespace {

using testing::SmallPool;
using testing::Spec;

TEST(ToGrpcStatusTest, KeepsCodeAndMessage) {
  const grpc::Status s = ToGrpcStatus(absl::NotFoundError("no sequence 7"));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(s.error_message(), "no sequence 7");
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
  EXPECT_EQ(ToGrpcStatus(absl::DeadlineExceededError("late")).error_code(),
            grpc::StatusCode::DEADLINE_EXCEEDED);
}

class ServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    engine_ = std::move(*Engine::Create(SmallPool(32), &device_, /*model=*/nullptr));
    SetUp2();
  }
  void SetUp2() {
    service_ = std::make_unique<KvPoolService>(engine_.get(), Clock::Real());
    engine_->AddEventListener(service_.get());
    grpc::ServerBuilder builder;
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    stub_ = v1::KvPool::NewStub(server_->InProcessChannel(grpc::ChannelArguments()));
    SessionSpec admin = Spec("t", "admin");
    admin.admin = true;
    admin_ = *engine_->OpenSession(admin);
    user_ = *engine_->OpenSession(Spec("t", "user"));
  }
  void TearDown() override {
    service_->EndStreams();
    server_->Shutdown();
    server_->Wait();
    engine_->RemoveEventListener(service_.get());
  }
  // Rebuilds the engine with `options` (the service, server and sessions with it), running the
  // tiny model when `with_model`.
  void Remake(const EngineOptions& options, bool with_model = false) {
    TearDown();
    admin_.reset();
    user_.reset();
    stub_.reset();
    server_.reset();
    service_.reset();
    engine_.reset();
    model_ = with_model ? testing::TinyModel(options.pools[0].layout) : nullptr;
    engine_ = std::move(*Engine::Create(options, &device_, model_.get()));
    SetUp2();
  }

  // A context carrying `session`'s token (none when null).
  static std::unique_ptr<grpc::ClientContext> As(const std::shared_ptr<const Session>& session) {
    auto c = std::make_unique<grpc::ClientContext>();
    if (session) c->AddMetadata(wire::kSessionTokenKey, session->token);
    return c;
  }

  kernels::CpuDevice device_{1};
  std::unique_ptr<model::Model> model_;  // null: none; outlives the engine that runs it
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<KvPoolService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::KvPool::Stub> stub_;
  std::shared_ptr<const Session> admin_, user_;
};

TEST_F(ServiceTest, CallsWithoutAValidTokenAreUnauthenticated) {
  v1::PingResponse r;
  EXPECT_EQ(stub_->Ping(As(nullptr).get(), {}, &r).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  auto forged = std::make_unique<grpc::ClientContext>();
  forged->AddMetadata(wire::kSessionTokenKey, "0123456789abcdef0123456789abcdef");
  EXPECT_EQ(stub_->Ping(forged.get(), {}, &r).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(stub_->Ping(As(user_).get(), {}, &r).ok());
  // A session that ended: its token is no longer good.
  engine_->EndSession(user_->id, SessionEnd::kDetached);
  EXPECT_EQ(stub_->Ping(As(user_).get(), {}, &r).error_code(), grpc::StatusCode::UNAUTHENTICATED);
}

TEST_F(ServiceTest, AdminCallsNeedTheAdminRole) {
  v1::GetStatsResponse stats;
  EXPECT_EQ(stub_->GetStats(As(user_).get(), {}, &stats).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  ASSERT_TRUE(stub_->GetStats(As(admin_).get(), {}, &stats).ok());
  EXPECT_EQ(stats.num_blocks(), 32);
  EXPECT_EQ(stats.attached_sessions(), 2);
  v1::DrainResponse drained;
  EXPECT_EQ(stub_->Drain(As(user_).get(), {}, &drained).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_FALSE(engine_->draining());
  // A stream too.
  auto context = As(user_);
  std::unique_ptr<grpc::ClientReader<v1::WatchEventsResponse>> events =
      stub_->WatchEvents(context.get(), {});
  v1::WatchEventsResponse event;
  while (events->Read(&event)) {
  }
  EXPECT_EQ(events->Finish().error_code(), grpc::StatusCode::PERMISSION_DENIED);
}

TEST_F(ServiceTest, ErrorsKeepTheirCodeAndShortfallsTravelAsATrailer) {
  v1::AllocateRequest too_big;
  too_big.add_items()->set_num_tokens(33 * 16);  // one block more than the pool
  v1::AllocateResponse allocated;
  auto context = As(user_);
  const grpc::Status s = stub_->Allocate(context.get(), too_big, &allocated);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  const auto& trailers = context->GetServerTrailingMetadata();
  auto it = trailers.find(wire::kShortfallKey);
  ASSERT_NE(it, trailers.end());
  EXPECT_EQ(std::string(it->second.data(), it->second.size()), "pool:1");

  v1::GrowRequest ragged;  // parallel arrays of different lengths
  ragged.add_sequence_ids(1);
  v1::GrowResponse grown;
  EXPECT_EQ(stub_->Grow(As(user_).get(), ragged, &grown).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  v1::TruncateRequest missing;
  missing.set_sequence_id(424242);
  v1::TruncateResponse truncated;
  EXPECT_EQ(stub_->Truncate(As(user_).get(), missing, &truncated).error_code(),
            grpc::StatusCode::NOT_FOUND);
  v1::PrefillRequest prefill;
  prefill.add_tokens(1);
  v1::PrefillResponse prefilled;
  EXPECT_EQ(stub_->Prefill(As(user_).get(), prefill, &prefilled).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);  // this engine runs no model
  EXPECT_TRUE(engine_->CheckInvariants().ok());
  EXPECT_EQ(engine_->Stats().cache.sequences, 0);
}

TEST_F(ServiceTest, RepliesCarryTheTablesAndOnlyTheChangedTails) {
  v1::AllocateRequest request;
  request.add_items()->set_num_tokens(20);
  request.add_items()->set_num_tokens(40);
  v1::AllocateResponse allocated;
  ASSERT_TRUE(stub_->Allocate(As(user_).get(), request, &allocated).ok());
  ASSERT_EQ(allocated.sequences_size(), 2);
  EXPECT_EQ(allocated.sequences(0).block_ids_size(), 2);
  EXPECT_EQ(allocated.sequences(1).block_ids_size(), 3);
  EXPECT_EQ(allocated.sequences(1).generations_size(), 3);
  v1::GrowRequest grow;
  grow.add_sequence_ids(allocated.sequences(0).sequence_id());
  grow.add_num_tokens(50);  // 2 -> 4 blocks
  grow.add_sequence_ids(allocated.sequences(1).sequence_id());
  grow.add_num_tokens(10);  // a no-op
  v1::GrowResponse grown;
  ASSERT_TRUE(stub_->Grow(As(user_).get(), grow, &grown).ok());
  EXPECT_THAT(grown.num_tokens(), ::testing::ElementsAre(50, 40));
  EXPECT_THAT(grown.table_offsets(), ::testing::ElementsAre(2, 3));
  EXPECT_THAT(grown.tail_lengths(), ::testing::ElementsAre(2, 0));
  EXPECT_EQ(grown.block_ids_size(), 2);
  // Another session's sequence.
  v1::FreeRequest theirs;
  theirs.add_sequence_ids(allocated.sequences(0).sequence_id());
  v1::FreeResponse freed;
  EXPECT_EQ(stub_->Free(As(admin_).get(), theirs, &freed).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  v1::ListSequencesResponse listed;
  ASSERT_TRUE(stub_->ListSequences(As(admin_).get(), {}, &listed).ok());
  EXPECT_EQ(listed.sequences_size(), 2);
  EXPECT_THAT(listed.session_ids(), ::testing::Each(user_->id.value()));
}

TEST_F(ServiceTest, PinsAreMadeListedAndEndedThroughTheProtocol) {
  v1::AllocateRequest allocate;
  v1::AllocateItem* item = allocate.add_items();
  item->set_num_tokens(32);
  for (int32_t t = 0; t < 32; ++t) item->add_prompt(t);
  v1::AllocateResponse allocated;
  ASSERT_TRUE(stub_->Allocate(As(user_).get(), allocate, &allocated).ok());
  v1::CommitRequest commit;
  commit.set_sequence_id(allocated.sequences(0).sequence_id());
  commit.set_num_tokens(32);
  v1::CommitResponse committed;
  ASSERT_TRUE(stub_->Commit(As(user_).get(), commit, &committed).ok());

  v1::PinRequest both;  // a prefix and a sequence at once
  both.add_tokens(0);
  both.set_sequence_id(allocated.sequences(0).sequence_id());
  both.set_ttl_ms(1000);
  v1::PinResponse pinned;
  EXPECT_EQ(stub_->Pin(As(user_).get(), both, &pinned).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  v1::PinRequest forever;  // a ttl past int64 nanoseconds
  for (int32_t t = 0; t < 32; ++t) forever.add_tokens(t);
  forever.set_ttl_ms(std::numeric_limits<int64_t>::max());
  EXPECT_EQ(stub_->Pin(As(user_).get(), forever, &pinned).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  v1::PinRequest prefix = forever;
  prefix.set_ttl_ms(60'000);
  prefix.set_priority(1);
  ASSERT_TRUE(stub_->Pin(As(user_).get(), prefix, &pinned).ok());
  EXPECT_EQ(pinned.pin().tokens(), 32);
  EXPECT_EQ(pinned.pin().blocks(), 2);
  EXPECT_EQ(pinned.pin().session_id(), user_->id.value());
  EXPECT_EQ(pinned.pin().pool(), "default");
  EXPECT_GT(pinned.pin().expires_in_ms(), 59'000);
  EXPECT_LE(pinned.pin().expires_in_ms(), 60'000);

  // Everyone's pins: admin sessions only.
  v1::ListPinsRequest all;
  all.set_all_sessions(true);
  v1::ListPinsResponse listed;
  EXPECT_EQ(stub_->ListPins(As(user_).get(), all, &listed).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  ASSERT_TRUE(stub_->ListPins(As(admin_).get(), all, &listed).ok());
  ASSERT_EQ(listed.pins_size(), 1);
  EXPECT_EQ(listed.pins(0).pin_id(), pinned.pin().pin_id());
  listed.Clear();
  ASSERT_TRUE(stub_->ListPins(As(admin_).get(), {}, &listed).ok());
  EXPECT_EQ(listed.pins_size(), 0);  // the admin's own
  v1::GetStatsResponse stats;
  ASSERT_TRUE(stub_->GetStats(As(admin_).get(), {}, &stats).ok());
  EXPECT_EQ(stats.pins(), 1);
  EXPECT_EQ(stats.pinned_blocks(), 2);
  EXPECT_EQ(stats.pins_made(), 1u);

  v1::UnpinRequest unpin;
  unpin.set_pin_id(pinned.pin().pin_id());
  v1::UnpinResponse unpinned;
  EXPECT_EQ(stub_->Unpin(As(admin_).get(), unpin, &unpinned).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);  // not the admin's pin
  EXPECT_TRUE(stub_->Unpin(As(user_).get(), unpin, &unpinned).ok());
  EXPECT_EQ(stub_->Unpin(As(user_).get(), unpin, &unpinned).error_code(),
            grpc::StatusCode::NOT_FOUND);
  v1::RenewPinRequest renew;
  renew.set_pin_id(pinned.pin().pin_id());
  renew.set_ttl_ms(1000);
  v1::RenewPinResponse renewed;
  EXPECT_EQ(stub_->RenewPin(As(user_).get(), renew, &renewed).error_code(),
            grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(engine_->CheckInvariants().ok());
}

// The engine tells the service of every event it appends (EventListener), whatever made it: here
// the host tier's writer thread, on its own schedule, after a commit made on the engine directly.
// Before the listener the edges pumped the streams after each RPC, so this follower waited for
// some unrelated RPC (none comes here) and its deadline passed.
TEST_F(ServiceTest, AFollowerSeesTheHostTiersEventsWithNoOtherCall) {
  EngineOptions options = SmallPool(32);
  options.tiers.host_blocks = 32;
  Remake(options);
  auto context = As(admin_);
  context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::WatchEventsRequest request;
  request.set_snapshot(true);
  request.set_follow(true);
  std::unique_ptr<grpc::ClientReader<v1::WatchEventsResponse>> stream =
      stub_->WatchEvents(context.get(), request);
  v1::WatchEventsResponse response;
  ASSERT_TRUE(stream->Read(&response));  // the (empty) snapshot: the stream is open
  ASSERT_TRUE(response.snapshot());
  EXPECT_EQ(response.events_size(), 0);

  const std::vector<int32_t> prompt = testing::Prompt(48, 1);  // 3 full blocks
  const AllocateRequest allocate{.num_tokens = 48, .prompt = prompt};
  absl::StatusOr<Tables> t =
      engine_->Allocate(*user_, std::span(&allocate, 1), CallContext::Uncancellable());
  ASSERT_TRUE(t.ok()) << t.status();
  const SequenceId id = t->slices[0].sequence;
  ASSERT_TRUE(
      engine_->Free(*user_, std::span(&id, 1), OnFree::kCommit, CallContext::Uncancellable()).ok());

  int device_stored = 0;
  int host_stored = 0;
  uint64_t next_seq = 1;
  while (host_stored < 3 && stream->Read(&response)) {
    for (const v1::KvEvent& e : response.events()) {
      EXPECT_EQ(e.seq(), next_seq++);  // gap-free, in order
      if (e.type() != v1::KvEvent::TYPE_BLOCK_STORED) continue;
      (e.medium() == "host" ? host_stored : device_stored) += e.block_hashes_size();
    }
  }
  EXPECT_EQ(device_stored, 3);
  EXPECT_EQ(host_stored, 3) << "the host tier's events did not reach the follower";
  context->TryCancel();
}

TEST_F(ServiceTest, AStoppedServiceRefusesEveryCall) {
  service_->Stop();
  v1::PingResponse r;
  EXPECT_EQ(stub_->Ping(As(user_).get(), {}, &r).error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_TRUE(service_->WaitIdle(Clock::Real()->NowNanos() + 5'000'000'000));
}

// The GetStats row `name` (with label value `label`, when given).
const v1::Stat* FindStat(const v1::GetStatsResponse& r, std::string_view name,
                         std::string_view label = "") {
  for (const v1::Stat& s : r.stats()) {
    if (s.name() != name) continue;
    if (label.empty()) return &s;
    for (const std::string& v : s.label_values()) {
      if (v == label) return &s;
    }
  }
  return nullptr;
}

// The WatchEvents figures of GetStats: snapshots by why, followers now, and a lag observation
// per batch sent.
TEST_F(ServiceTest, WatchEventsCountsSnapshotsFollowersAndLag) {
  EngineOptions options = SmallPool(32);
  options.event_capacity = 2;  // the log keeps the last two events
  Remake(options);
  for (int i = 0; i < 3; ++i) {  // 3 calls, each 1 block stored: seq 1 leaves the log
    const std::vector<int32_t> prompt = testing::Prompt(16, 10 + i);
    const AllocateRequest allocate{.num_tokens = 16, .prompt = prompt};
    absl::StatusOr<Tables> t =
        engine_->Allocate(*user_, std::span(&allocate, 1), CallContext::Uncancellable());
    ASSERT_TRUE(t.ok()) << t.status();
    const SequenceId id = t->slices[0].sequence;
    ASSERT_TRUE(
        engine_->Free(*user_, std::span(&id, 1), OnFree::kCommit, CallContext::Uncancellable())
            .ok());
  }
  ASSERT_GT(engine_->next_event_seq(0), 3u);
  auto read_all = [&](const v1::WatchEventsRequest& request) {
    auto context = As(admin_);
    auto stream = stub_->WatchEvents(context.get(), request);
    v1::WatchEventsResponse response;
    while (stream->Read(&response)) {
    }
    EXPECT_TRUE(stream->Finish().ok());
  };
  v1::WatchEventsRequest behind;
  behind.set_from_seq(1);  // dropped from the log: a snapshot instead
  read_all(behind);
  v1::WatchEventsRequest recent;
  recent.set_from_seq(engine_->next_event_seq(0) - 1);  // still in the log: one batch
  read_all(recent);
  // Past the head (a consumer of the daemon before its restart): a snapshot, not a wait for
  // that number that skips every event before it. Before, the stream ended with nothing.
  v1::WatchEventsRequest ahead;
  ahead.set_from_seq(engine_->next_event_seq(0) + 100);
  {
    auto context = As(admin_);
    auto stream = stub_->WatchEvents(context.get(), ahead);
    v1::WatchEventsResponse response;
    ASSERT_TRUE(stream->Read(&response));
    EXPECT_TRUE(response.snapshot());
    EXPECT_EQ(response.resume_seq(), engine_->next_event_seq(0));
    while (stream->Read(&response)) {
    }
    EXPECT_TRUE(stream->Finish().ok());
  }

  auto context = As(admin_);
  v1::WatchEventsRequest follow;
  follow.set_snapshot(true);
  follow.set_follow(true);
  auto stream = stub_->WatchEvents(context.get(), follow);
  v1::WatchEventsResponse response;
  ASSERT_TRUE(stream->Read(&response));
  ASSERT_TRUE(response.snapshot());

  v1::GetStatsResponse stats;
  ASSERT_TRUE(stub_->GetStats(As(admin_).get(), {}, &stats).ok());
  const v1::Stat* requested = FindStat(stats, "event_snapshots", "requested");
  const v1::Stat* fell_behind = FindStat(stats, "event_snapshots", "fell_behind");
  const v1::Stat* followers = FindStat(stats, "event_followers");
  const v1::Stat* lag = FindStat(stats, "event_follower_lag_events");
  ASSERT_TRUE(requested && fell_behind && followers && lag);
  EXPECT_EQ(requested->value(), 1);
  EXPECT_EQ(fell_behind->value(), 2);  // from 1, and from past the head
  EXPECT_EQ(followers->value(), 1);
  EXPECT_EQ(lag->count(), 1u);  // the one batch the `recent` stream was sent
  EXPECT_EQ(lag->sum(), 0);     // it held everything up to the log's head
  EXPECT_EQ(FindStat(stats, "zmq_event_batches"), nullptr);  // no publisher: no rows
  context->TryCancel();
}

// ASan keeps freed memory in quarantine, resident, so there the peak RSS counts every buffer gRPC
// and protobuf ever used: the bound below is checked in the release tree only.
#if defined(__SANITIZE_ADDRESS__)
#define KVPOOL_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVPOOL_ASAN 1
#endif
#endif

// This process's peak resident set so far, in bytes.
int64_t PeakRssBytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return int64_t{usage.ru_maxrss} * 1024;
}

// A Decode as wide as a 4 MiB message carries: 2M sequences (1-byte ids and tokens), one set of
// sampling parameters without a seed for all of them. Decode used to expand it, before it knew
// its caller and before any bound on the width, into a DecodeInput and a SamplingParams with a
// freshly drawn seed per sequence (about 100 MiB at its peak, and 2M generators seeded). Now the
// caller and the width come first: whether unauthenticated or over limits.decode_width, the
// call is refused having built nothing per sequence, so the process's peak RSS grows by little
// more than the messages both ends hold (24 MiB of repeated fields each, and gRPC's buffers):
// 35-66 MiB measured, against about 190 MiB before.
TEST_F(ServiceTest, AWideDecodeIsRefusedBeforeAnythingIsBuiltPerSequence) {
  Remake(SmallPool(32), /*with_model=*/true);
  constexpr int kSequences = 2'000'000;
  v1::DecodeRequest wide;
  wide.mutable_sequence_ids()->Resize(kSequences, 1);
  wide.mutable_tokens()->Resize(kSequences, 0);
  wide.add_sampling()->set_temperature(1.0F);
  v1::DecodeResponse decoded;
  [[maybe_unused]] const int64_t before = PeakRssBytes();

  EXPECT_EQ(stub_->Decode(As(nullptr).get(), wide, &decoded).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  const grpc::Status over = stub_->Decode(As(user_).get(), wide, &decoded);
  EXPECT_EQ(over.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(over.error_message(), ::testing::HasSubstr("limits.decode_width"));
  // What the wire bounds comes before the width (INVALID_ARGUMENT before RESOURCE_EXHAUSTED).
  wide.mutable_tokens()->RemoveLast();
  EXPECT_EQ(stub_->Decode(As(user_).get(), wide, &decoded).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);

  EXPECT_EQ(engine_->Stats().calls.over_limit, 1u);  // counted as the gate counts it
  EXPECT_TRUE(engine_->CheckInvariants().ok());
#ifndef KVPOOL_ASAN
  const int64_t growth = PeakRssBytes() - before;
  EXPECT_LT(growth, int64_t{128} << 20)
      << "Decode built something per sequence: the peak RSS grew by " << (growth >> 20) << " MiB";
#endif
}

// A Generate stream keeps its stop tokens for its whole life and checks every token it yields
// against them: their number is bounded (limits.stop_tokens) before the stream copies them.
// Before, a 4 MiB message's 4M one-byte stop tokens were kept twice (the request and the
// stream's copy) and scanned once per token, for every stream.
TEST_F(ServiceTest, AGenerateWithMoreStopTokensThanTheLimitIsRefused) {
  Remake(SmallPool(32), /*with_model=*/true);
  v1::GenerateRequest request;
  request.add_prompt(1);
  request.set_max_tokens(1);
  request.mutable_stop_tokens()->Resize(257, 3);
  std::unique_ptr<grpc::ClientContext> context = As(user_);
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> stream =
      stub_->Generate(context.get(), request);
  v1::GenerateResponse response;
  EXPECT_FALSE(stream->Read(&response));
  const grpc::Status refused = stream->Finish();
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(refused.error_message(), ::testing::HasSubstr("limits.stop_tokens"));
  EXPECT_EQ(engine_->Stats().calls.over_limit, 1u);
  // At the limit it runs.
  request.mutable_stop_tokens()->RemoveLast();
  std::unique_ptr<grpc::ClientContext> again = As(user_);
  stream = stub_->Generate(again.get(), request);
  EXPECT_TRUE(stream->Read(&response));
  while (stream->Read(&response)) {
  }
  EXPECT_TRUE(stream->Finish().ok());
}

// A follower that cancels on an idle pool (no event comes to wake its stream) is finished at once:
// its call ends and it no longer counts as a follower. Before OnCancel it stayed open, holding a
// call and the event_followers gauge, until the next event of the pool.
TEST_F(ServiceTest, ACancelledFollowerOnAnIdlePoolIsFinished) {
  auto context = As(admin_);
  v1::WatchEventsRequest follow;
  follow.set_snapshot(true);
  follow.set_follow(true);
  auto stream = stub_->WatchEvents(context.get(), follow);
  v1::WatchEventsResponse response;
  ASSERT_TRUE(stream->Read(&response));  // the snapshot: the stream is open and idle
  ASSERT_TRUE(response.snapshot());
  context->TryCancel();
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);

  // The stream's call is the only one: the service is idle once the stream is finished.
  EXPECT_TRUE(service_->WaitIdle(Clock::Real()->NowNanos() + 5'000'000'000))
      << "the cancelled stream was not finished";
  v1::GetStatsResponse stats;
  ASSERT_TRUE(stub_->GetStats(As(admin_).get(), {}, &stats).ok());
  const v1::Stat* followers = FindStat(stats, "event_followers");
  ASSERT_NE(followers, nullptr);
  EXPECT_EQ(followers->value(), 0);
}

}  // namespace
}  // namespace kvpool::daemon
