// Daemon: the life cycle in process (sockets in a private directory, the client library in this
// process): health for both service names, operators attaching while it drains, ordered
// shutdown.

#include "daemon/daemon.h"

#include <unistd.h>

#include <filesystem>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "client/client.h"
#include "daemon/edge/config.h"
#include "gmock/gmock.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kvpool/v1/wire.h"

namespace kvpool::daemon {
namespace {

// grpc.health.v1.Health/Check for `service`, spoken by hand (Debian ships no generated stubs for
// the health protocol): the request is field 1 (string), the reply field 1 (enum). Returns the
// serving status (1 SERVING, 2 NOT_SERVING) or the call's error.
absl::StatusOr<int> HealthCheck(const std::string& dir, const std::string& service) {
  auto channel = grpc::CreateChannel("unix:" + dir + "/" + wire::kGrpcSocket,
                                     grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  std::string bytes = {0x0a, static_cast<char>(service.size())};
  bytes += service;
  grpc::Slice slice(bytes);
  grpc::ByteBuffer request(&slice, 1), response;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  absl::Notification done;
  grpc::Status status;
  stub.UnaryCall(&context, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response,
                 [&](grpc::Status s) {
                   status = std::move(s);
                   done.Notify();
                 });
  done.WaitForNotification();
  if (!status.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
  }
  std::vector<grpc::Slice> slices;
  if (!response.Dump(&slices).ok()) return absl::InternalError("unreadable health reply");
  std::string reply;
  for (const grpc::Slice& s : slices)
    reply.append(reinterpret_cast<const char*>(s.begin()), s.size());
  if (reply.empty()) return 0;  // UNKNOWN (the default value is not sent)
  if (reply.size() != 2 || reply[0] != 0x08) return absl::InternalError("unexpected health reply");
  return static_cast<int>(reply[1]);
}

class DaemonTest : public ::testing::Test {
 protected:
  void Start(const std::vector<uint32_t>& admin_uids) {
    dir_ = ::testing::TempDir() + "/kvpoold-" + std::to_string(getpid()) + "-" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    v1::DaemonConfig config = DefaultConfig();
    config.set_runtime_dir(dir_);
    config.set_pool_bytes(int64_t{64} << 16);
    config.mutable_admin_uids()->Clear();
    for (uint32_t uid : admin_uids) config.add_admin_uids(uid);
    daemon_ = std::move(*Daemon::Create(config, Clock::Real()));
    ASSERT_TRUE(daemon_->Start().ok());
  }
  void TearDown() override {
    if (daemon_) daemon_->Shutdown();
    std::filesystem::remove_all(dir_);
  }
  absl::StatusOr<std::unique_ptr<client::Client>> Connect() {
    return client::Client::Connect(
        {.runtime_dir = dir_, .client_name = "daemon_test", .kv_access = true});
  }

  std::string dir_;
  std::unique_ptr<Daemon> daemon_;
};

// Issue 10: probes that named the service got NOT_FOUND.
TEST_F(DaemonTest, HealthAnswersForTheServiceNameAndForTheServer) {
  Start({getuid()});
  EXPECT_EQ(HealthCheck(dir_, "").value_or(-1), 1);
  EXPECT_EQ(HealthCheck(dir_, Daemon::kServiceName).value_or(-1), 1);
  EXPECT_EQ(HealthCheck(dir_, "no.such.Service").status().code(), absl::StatusCode::kNotFound);
}

// Issue 10: after `kvpoolctl drain` every kvpoolctl command failed to attach.
TEST_F(DaemonTest, OperatorsAttachWhileTheDaemonDrainsOthersDoNot) {
  Start({getuid()});
  {
    absl::StatusOr<std::unique_ptr<client::Client>> op = Connect();
    ASSERT_TRUE(op.ok()) << op.status();
    ASSERT_TRUE((*op)->Drain().ok());
  }
  absl::StatusOr<std::unique_ptr<client::Client>> later = Connect();
  ASSERT_TRUE(later.ok()) << later.status();  // an admin: it watches the drain
  absl::StatusOr<v1::GetStatsResponse> stats = (*later)->GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_TRUE(stats->draining());
  EXPECT_EQ((*later)->Allocate(std::vector<int32_t>(10, 1)).status().code(),
            absl::StatusCode::kUnavailable);  // but it cannot start work
}

TEST_F(DaemonTest, ANonAdminCannotAttachWhileTheDaemonDrains) {
  Start({/*admins: nobody here*/ getuid() + 1});
  daemon_->engine().Drain();
  EXPECT_EQ(Connect().status().code(), absl::StatusCode::kUnavailable);
}

TEST_F(DaemonTest, ClientsThatSayGoodbyeAreCountedApartFromReclaimedOnes) {
  Start({getuid()});
  { ASSERT_TRUE(Connect().ok()); }  // detaches in its destructor
  absl::StatusOr<std::unique_ptr<client::Client>> op = Connect();
  ASSERT_TRUE(op.ok());
  // The goodbye travels on the attach socket; the stats follow once the daemon has read it.
  absl::StatusOr<v1::GetStatsResponse> stats = (*op)->GetStats();
  for (int i = 0; i < 1000 && stats.ok() && stats->sessions_detached() == 0; ++i) {
    absl::SleepFor(absl::Milliseconds(2));
    stats = (*op)->GetStats();
  }
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->sessions_detached(), 1u);
  EXPECT_EQ(stats->sessions_reclaimed(), 0u);
  EXPECT_EQ(stats->attached_sessions(), 1);
}

TEST_F(DaemonTest, ShutdownTurnsHealthDownAndEndsEverySession) {
  Start({getuid()});
  absl::StatusOr<std::unique_ptr<client::Client>> c = Connect();
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE((*c)->Allocate(std::vector<int32_t>(20, 3)).ok());
  daemon_->Shutdown();
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/" + wire::kAttachSocket));
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/" + wire::kGrpcSocket));
  EXPECT_EQ((*c)->Ping().code(), absl::StatusCode::kUnavailable);
}

// Sampling over gRPC (issue 30): a Generate stream keeps one seed, so the same seed gives the
// same tokens; without one each stream draws its own; log-probabilities and top tokens come back
// with every token; out-of-range parameters fail with INVALID_ARGUMENT.
TEST_F(DaemonTest, SampledGenerationsFollowTheirSeed) {
  Start({});
  absl::StatusOr<std::unique_ptr<client::Client>> c = Connect();
  ASSERT_TRUE(c.ok()) << c.status();
  auto generate = [&](std::optional<uint64_t> seed) {
    v1::GenerateRequest request;
    for (int32_t t = 1; t <= 12; ++t) request.add_prompt(t * 37);
    request.set_max_tokens(12);
    request.set_free_when_done(true);
    request.set_logprobs(true);
    request.set_top_k(3);
    request.mutable_sampling()->set_temperature(1.5F);
    if (seed) request.mutable_sampling()->set_seed(*seed);
    std::vector<int32_t> tokens;
    const absl::Status s = (*c)->Generate(request, [&](const v1::GenerateResponse& r) {
      tokens.push_back(r.token());
      EXPECT_LE(r.logprob(), 0);
      EXPECT_LT(r.logprob(), 0) << "a sampled token's log-probability was not returned";
      EXPECT_EQ(r.top().tokens_size(), 3);
      return true;
    });
    EXPECT_TRUE(s.ok()) << s;
    return tokens;
  };
  const std::vector<int32_t> seeded = generate(42);
  EXPECT_EQ(seeded.size(), 12u);
  EXPECT_EQ(generate(42), seeded);
  EXPECT_NE(generate(std::nullopt), generate(std::nullopt));

  v1::PrefillRequest bad;
  bad.add_tokens(5);
  bad.mutable_sampling()->set_top_p(0);
  absl::StatusOr<v1::PrefillResponse> refused = (*c)->Prefill(bad);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), ::testing::HasSubstr("top_p"));
  v1::DecodeRequest two_for_three;
  for (uint64_t id : {1, 2, 3}) {
    two_for_three.add_sequence_ids(id);
    two_for_three.add_tokens(1);
  }
  two_for_three.add_sampling();
  two_for_three.add_sampling();
  EXPECT_EQ((*c)->Decode(two_for_three).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvpool::daemon

namespace kvpool::daemon {
namespace {

// Issue 27: shutdown ended the streams in flight (a Generate was closed with UNAVAILABLE at its
// next token) instead of letting them finish within the drain timeout.
TEST_F(DaemonTest, ShutdownLetsAGenerationInFlightFinish) {
  Start({});
  absl::StatusOr<std::unique_ptr<client::Client>> c = Connect();
  ASSERT_TRUE(c.ok()) << c.status();
  v1::GenerateRequest request;
  for (int32_t t = 1; t <= 8; ++t) request.add_prompt(t);
  request.set_max_tokens(64);
  request.set_free_when_done(true);
  absl::Notification first;
  std::thread shutdown;
  int tokens = 0;
  const absl::Status generated = (*c)->Generate(request, [&](const v1::GenerateResponse&) {
    if (++tokens == 1) shutdown = std::thread([this] { daemon_->Shutdown(); });
    return true;
  });
  EXPECT_TRUE(generated.ok()) << generated;
  EXPECT_EQ(tokens, 64);
  shutdown.join();
}

}  // namespace
}  // namespace kvpool::daemon

namespace kvpool::daemon {
namespace {

// A uid gets limits.doorbells_per_uid doorbells (daemon threads); a session past it decodes over
// gRPC, counted.
TEST_F(DaemonTest, AUidPastItsDoorbellsDecodesOverGrpc) {
  dir_ = ::testing::TempDir() + "/kvpoold-" + std::to_string(getpid()) + "-doorbells";
  v1::DaemonConfig config = DefaultConfig();
  config.set_runtime_dir(dir_);
  config.set_pool_bytes(int64_t{64} << 16);
  config.mutable_limits()->set_doorbells_per_uid(1);
  daemon_ = std::move(*Daemon::Create(config, Clock::Real()));
  ASSERT_TRUE(daemon_->Start().ok());
  absl::StatusOr<std::unique_ptr<client::Client>> first = Connect();
  absl::StatusOr<std::unique_ptr<client::Client>> second = Connect();
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_TRUE((*first)->decode_doorbell());
  EXPECT_FALSE((*second)->decode_doorbell());
  const std::vector<int32_t> prompt = {1, 2, 3, 4, 5};
  absl::StatusOr<v1::PrefillResponse> p = (*second)->Prefill(0, prompt);
  ASSERT_TRUE(p.ok()) << p.status();
  const client::DecodeItem item{.sequence_id = p->sequence_id(), .token = p->next_token()};
  EXPECT_TRUE((*second)->Decode(std::span(&item, 1)).ok());
  absl::StatusOr<v1::GetStatsResponse> stats = (*first)->GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->doorbells_refused(), 1u);
}

// metrics.listen on port 0: the endpoint takes a free port and is reported; an address already
// in use fails Start with UNAVAILABLE, the daemon's sockets gone again.
TEST_F(DaemonTest, MetricsEndpointBindsOrFailsStart) {
  dir_ = ::testing::TempDir() + "/kvpoold-" + std::to_string(getpid()) + "-metrics";
  v1::DaemonConfig config = DefaultConfig();
  config.set_runtime_dir(dir_);
  config.set_pool_bytes(int64_t{64} << 16);
  config.mutable_metrics()->set_listen("127.0.0.1:0");
  daemon_ = std::move(*Daemon::Create(config, Clock::Real()));
  ASSERT_TRUE(daemon_->Start().ok());
  const int port = daemon_->metrics_port();
  ASSERT_GT(port, 0);

  config.set_runtime_dir(dir_ + "-second");
  config.mutable_metrics()->set_listen(absl::StrCat("127.0.0.1:", port));
  std::unique_ptr<Daemon> second = std::move(*Daemon::Create(config, Clock::Real()));
  EXPECT_EQ(second->Start().code(), absl::StatusCode::kUnavailable);
  second.reset();
  EXPECT_FALSE(std::filesystem::exists(dir_ + "-second/" + wire::kGrpcSocket));
  std::filesystem::remove_all(dir_ + "-second");
}

}  // namespace
}  // namespace kvpool::daemon
