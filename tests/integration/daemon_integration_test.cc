// kvpoold as it runs in production: a real daemon process in a private runtime directory, real
// client processes, real sockets (label `integration`).

#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <fstream>
#include <sstream>

#include "client/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvpool/v1/attach.pb.h"
#include "kvpool/v1/wire.h"
#include "tests/integration/harness.h"

namespace kvpool::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

// A small pool: 256 blocks of 16 tokens.
constexpr char kConfig[] = R"pb(
  pool_bytes: 16777216 max_blocks_per_seq: 64
)pb";

std::unique_ptr<client::Client> Connect(const std::string& dir, const std::string& name = "test",
                                        const std::string& tenant = "default") {
  absl::StatusOr<std::unique_ptr<client::Client>> c = client::Client::Connect(
      {.runtime_dir = dir, .client_name = name, .tenant = tenant, .kv_access = true});
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

class DaemonIntegrationTest : public ::testing::Test {
 protected:
  void StartDaemon(const std::string& config = kConfig) {
    absl::StatusOr<std::unique_ptr<DaemonProcess>> d = DaemonProcess::Start(config);
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
  }
  std::vector<std::string> Client(std::string mode, int64_t a, int64_t b) {
    return {IntegrationClientBinary(), std::move(mode), daemon_->dir(), std::to_string(a),
            std::to_string(b)};
  }
  v1::GetStatsResponse Stats(const client::Client& admin) {
    absl::StatusOr<v1::GetStatsResponse> s = admin.GetStats();
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *s : v1::GetStatsResponse{};
  }

  std::unique_ptr<DaemonProcess> daemon_;
};

TEST_F(DaemonIntegrationTest, SecondProcessReadsTheFirstOnesKvByteForByte) {
  StartDaemon();
  const auto [write_rc, written] = RunToEnd(Client("write", 100, 42));
  ASSERT_EQ(write_rc, 0) << written;
  ASSERT_THAT(written, StartsWith("written "));
  const std::string checksum = written.substr(8, written.size() - 9);
  // Process A has exited (its session ended): its committed blocks are cached, not freed.
  const auto [read_rc, read] = RunToEnd(Client("read", 100, 42));
  ASSERT_EQ(read_rc, 0) << read;
  EXPECT_EQ(read, "matched 100 checksum " + checksum + "\n");
  // A different prompt gets no hit.
  const auto [other_rc, other] = RunToEnd(Client("read", 100, 43));
  EXPECT_THAT(other, StartsWith("matched 0 "));
}

// On an 8-bit pool a row is a byte per value: a client that wrote two bytes per value would spill
// into the block after its own (another sequence's) and read the spill back as its own. Here
// the second writer's sequence follows the first's in the pool, and the first still reads back
// exactly what it wrote.
TEST_F(DaemonIntegrationTest, EightBitRowsStayInsideTheirOwnBlocks) {
  StartDaemon(R"pb(pool_bytes: 16777216
                   max_blocks_per_seq: 64
                   shape { dtype: "int8" })pb");
  const auto [write_rc, written] = RunToEnd(Client("write", 100, 42));
  ASSERT_EQ(write_rc, 0) << written;
  const std::string checksum = written.substr(8, written.size() - 9);
  const auto [other_rc, other] = RunToEnd(Client("write", 100, 43));
  ASSERT_EQ(other_rc, 0) << other;
  const auto [read_rc, read] = RunToEnd(Client("read", 100, 42));
  ASSERT_EQ(read_rc, 0) << read;
  EXPECT_EQ(read, "matched 100 checksum " + checksum + "\n");
}

TEST_F(DaemonIntegrationTest, KilledClientGivesEverythingBackAndOthersKeepTheirs) {
  StartDaemon();
  std::unique_ptr<client::Client> admin = Connect(daemon_->dir(), "admin");
  // Another session holding a sequence of its own.
  const std::vector<int32_t> mine(40, 7);
  absl::StatusOr<v1::SequenceInfo> kept = admin->Allocate(mine);
  ASSERT_TRUE(kept.ok()) << kept.status();
  const int32_t kept_blocks = kept->block_ids_size();

  absl::StatusOr<Child> holder = Spawn(Client("hold", 5, 100));  // 5 x 7 blocks
  ASSERT_TRUE(holder.ok());
  ASSERT_EQ(ReadLine(*holder, absl::Seconds(10)).value_or("?"), "holding");
  EXPECT_EQ(Stats(*admin).active_blocks(), kept_blocks + 5 * 7);

  kill(holder->pid, SIGKILL);
  EXPECT_EQ(Wait(&*holder), -SIGKILL);
  // Generous bound: the reclaim itself is measured by rpc_bench.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  v1::GetStatsResponse s = Stats(*admin);
  while (s.active_blocks() != kept_blocks && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));
    s = Stats(*admin);
  }
  EXPECT_EQ(s.active_blocks(), kept_blocks);
  EXPECT_EQ(s.free_blocks() + s.cached_blocks() + s.active_blocks(), s.num_blocks());
  EXPECT_EQ(s.sessions_reclaimed(), 1u);
  // The survivor's sequence is intact.
  absl::StatusOr<v1::ListSequencesResponse> seqs = admin->ListSequences();
  ASSERT_TRUE(seqs.ok());
  ASSERT_EQ(seqs->sequences_size(), 1);
  EXPECT_EQ(seqs->sequences(0).sequence_id(), kept->sequence_id());
  EXPECT_TRUE(admin->CheckInvariants()->ok());
}

TEST_F(DaemonIntegrationTest, PeerNotAllowedIsRefusedAndGetsNoDescriptor) {
  // Only uid/gid 4242 may attach: this process may not.
  StartDaemon(std::string(kConfig) + "allowed_uids: 4242\nallowed_gids: 4242\n");
  absl::StatusOr<std::unique_ptr<client::Client>> c =
      client::Client::Connect({.runtime_dir = daemon_->dir()});
  EXPECT_EQ(c.status().code(), absl::StatusCode::kPermissionDenied);
  // The raw handshake: an error, and no descriptor with it.
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const std::string path = daemon_->dir() + "/" + wire::kAttachSocket;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  v1::AttachRequest request;
  request.set_protocol_version(wire::kProtocolVersion);
  // The daemon refuses at accept and hangs up, often before this request is sent: the send may
  // then fail (the peer is gone), and the refusal is still there to read.
  const absl::Status sent = wire::SendFrame(fd, request);
  EXPECT_TRUE(sent.ok() || sent.code() == absl::StatusCode::kUnavailable) << sent;
  v1::AttachResponse response;
  std::vector<int> fds;
  ASSERT_TRUE(wire::ReceiveFrame(fd, &response, &fds, absl::Seconds(5)).ok());
  EXPECT_THAT(response.error(), HasSubstr("may not attach"));
  EXPECT_EQ(response.error_code(), static_cast<int>(absl::StatusCode::kPermissionDenied));
  EXPECT_TRUE(fds.empty());
  EXPECT_TRUE(response.session_token().empty());
  close(fd);
}

TEST_F(DaemonIntegrationTest, BadInputGetsItsCodeAndChangesNothing) {
  StartDaemon(std::string(kConfig) + "session_quota_blocks: 20\n");
  std::unique_ptr<client::Client> a = Connect(daemon_->dir(), "a");
  std::unique_ptr<client::Client> b = Connect(daemon_->dir(), "b");
  const std::vector<int32_t> prompt(50, 3);
  absl::StatusOr<v1::SequenceInfo> seq = a->Allocate(prompt);
  ASSERT_TRUE(seq.ok());
  const uint64_t id = seq->sequence_id();
  const v1::GetStatsResponse before = Stats(*a);
  auto code = [](const absl::Status& s) { return s.code(); };
  using C = absl::StatusCode;

  // Unknown sequence, on every call that names one.
  EXPECT_EQ(code(a->Grow(999999, 60).status()), C::kNotFound);
  EXPECT_EQ(code(a->Truncate(999999, 1)), C::kNotFound);
  EXPECT_EQ(code(a->Fork(999999).status()), C::kNotFound);
  EXPECT_EQ(code(a->Commit(999999, 1)), C::kNotFound);
  EXPECT_EQ(code(a->Free({999999})), C::kNotFound);
  // Another session's sequence.
  EXPECT_EQ(code(b->Grow(id, 60).status()), C::kPermissionDenied);
  EXPECT_EQ(code(b->Truncate(id, 1)), C::kPermissionDenied);
  EXPECT_EQ(code(b->Fork(id).status()), C::kPermissionDenied);
  EXPECT_EQ(code(b->Commit(id, 1)), C::kPermissionDenied);
  EXPECT_EQ(code(b->Free({id})), C::kPermissionDenied);
  // Negative and impossible token counts.
  EXPECT_EQ(code(a->Grow(id, -5).status()), C::kInvalidArgument);
  EXPECT_EQ(code(a->Truncate(id, -1)), C::kInvalidArgument);
  EXPECT_EQ(code(a->Truncate(id, 51)), C::kInvalidArgument);
  EXPECT_EQ(code(a->Commit(id, 60)), C::kInvalidArgument);
  EXPECT_EQ(code(a->Allocate(prompt, 10).status()), C::kInvalidArgument);  // shorter than prompt
  // Table overflow (64 blocks of 16) and a huge count: RESOURCE_EXHAUSTED with the shortfall.
  absl::Status overflow = a->Grow(id, 64 * 16 + 1).status();
  EXPECT_EQ(code(overflow), C::kResourceExhausted);
  ASSERT_TRUE(client::GetShortfall(overflow).has_value());
  EXPECT_EQ(client::GetShortfall(overflow)->resource, "max_blocks_per_seq");
  EXPECT_EQ(client::GetShortfall(overflow)->blocks, 1);
  EXPECT_EQ(code(a->Grow(id, int64_t{1} << 60).status()), C::kResourceExhausted);
  // Over the session quota (20 block references; the sequence holds 4).
  absl::Status quota = a->Grow(id, 30 * 16).status();
  EXPECT_EQ(code(quota), C::kResourceExhausted);
  EXPECT_EQ(client::GetShortfall(quota)->resource, "session quota");
  EXPECT_EQ(client::GetShortfall(quota)->blocks, 10);
  // Empty batches.
  EXPECT_EQ(code(a->Allocate(std::vector<client::AllocateItem>{}).status()), C::kInvalidArgument);
  EXPECT_EQ(code(a->Grow(std::vector<client::GrowItem>{}).status()), C::kInvalidArgument);
  EXPECT_EQ(code(a->Free({})), C::kInvalidArgument);
  // A wrong session token, and none at all.
  {
    grpc::ClientContext context;
    context.AddMetadata(wire::kSessionTokenKey, "0123456789abcdef0123456789abcdef");
    v1::PingResponse r;
    EXPECT_EQ(a->stub().Ping(&context, v1::PingRequest(), &r).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  {
    grpc::ClientContext context;
    v1::PingResponse r;
    EXPECT_EQ(a->stub().Ping(&context, v1::PingRequest(), &r).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }

  // Nothing changed: the same blocks in the same states, the same sequence, invariants hold, and
  // `kvpoolctl check` agrees.
  const v1::GetStatsResponse after = Stats(*a);
  EXPECT_EQ(after.free_blocks(), before.free_blocks());
  EXPECT_EQ(after.active_blocks(), before.active_blocks());
  EXPECT_EQ(after.cached_blocks(), before.cached_blocks());
  EXPECT_EQ(after.blocks_allocated(), before.blocks_allocated());
  EXPECT_EQ(after.sequences(), 1);
  const auto [rc, out] = RunToEnd({KvpoolctlBinary(), "--socket_dir=" + daemon_->dir(), "check"});
  EXPECT_EQ(rc, 0) << out;
}

// Client::Grow's held form, as a decode loop calls it: three sequences (one forked, so that its
// first grow copies the shared last block) grown one token a step across block boundaries; the
// tables the client holds equal the daemon's. A held table the daemon did not extend is refused
// with FAILED_PRECONDITION and left as it was; spans of different lengths send nothing.
TEST_F(DaemonIntegrationTest, HeldGrowKeepsTheClientsTablesEqualToTheDaemons) {
  StartDaemon();
  std::unique_ptr<client::Client> a = Connect(daemon_->dir());
  auto listed = [&](uint64_t id) {
    absl::StatusOr<v1::ListSequencesResponse> all = a->ListSequences();
    EXPECT_TRUE(all.ok()) << all.status();
    for (const v1::SequenceInfo& info : all->sequences()) {
      if (info.sequence_id() == id) return info;
    }
    ADD_FAILURE() << "sequence " << id << " not listed";
    return v1::SequenceInfo();
  };
  absl::StatusOr<v1::SequenceInfo> one = a->Allocate(std::vector<int32_t>(20, 3));
  absl::StatusOr<v1::SequenceInfo> two = a->Allocate(std::vector<int32_t>(33, 4));
  ASSERT_TRUE(one.ok() && two.ok());
  absl::StatusOr<v1::SequenceInfo> child = a->Fork(one->sequence_id());
  ASSERT_TRUE(child.ok()) << child.status();
  std::vector<client::HeldSequence> held = {client::ToHeld(*one), client::ToHeld(*two),
                                            client::ToHeld(*child)};
  for (int step = 0; step < 40; ++step) {
    std::vector<int64_t> lengths;
    for (const client::HeldSequence& h : held) lengths.push_back(h.num_tokens + 1);
    ASSERT_TRUE(a->Grow(std::span(held), lengths).ok()) << "step " << step;
  }
  for (const client::HeldSequence& h : held) {
    const v1::SequenceInfo daemon = listed(h.sequence_id);
    EXPECT_EQ(h.num_tokens, daemon.num_tokens());
    EXPECT_EQ(h.table, client::ToBlockRefs(daemon));
  }
  EXPECT_EQ(held[2].table.size(), 4u);            // 60 tokens
  EXPECT_NE(held[2].table[1], held[0].table[1]);  // the child's copy of the shared block

  std::vector<client::HeldSequence> stale = {held[1]};
  stale[0].table.resize(1);
  const std::vector<client::HeldSequence> before = stale;
  const int64_t longer = held[1].num_tokens + 16;
  EXPECT_EQ(a->Grow(std::span(stale), std::vector<int64_t>{longer}).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(stale, before);
  EXPECT_EQ(listed(held[1].sequence_id).num_tokens(), longer);  // the daemon's growth stands
  EXPECT_EQ(a->Grow(std::span(held), std::vector<int64_t>{1, 2}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(listed(held[0].sequence_id).num_tokens(), held[0].num_tokens);
}

TEST_F(DaemonIntegrationTest, NonAdminSessionsCannotCallAdminRpcs) {
  StartDaemon(std::string(kConfig) + "admin_uids: 4242\n");
  std::unique_ptr<client::Client> c = Connect(daemon_->dir());
  EXPECT_FALSE(c->admin());
  EXPECT_EQ(c->GetStats().status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(c->Drain().status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(c->Ping().ok());
}

// Issue 10: after `kvpoolctl drain`, every kvpoolctl command failed to attach.
TEST_F(DaemonIntegrationTest, OperatorsWatchADrainWithKvpoolctl) {
  StartDaemon();
  const std::string dir = "--socket_dir=" + daemon_->dir();
  const auto [drain_rc, drained] = RunToEnd({KvpoolctlBinary(), dir, "drain"});
  ASSERT_EQ(drain_rc, 0) << drained;
  const auto [stats_rc, stats] = RunToEnd({KvpoolctlBinary(), dir, "stats"});
  EXPECT_EQ(stats_rc, 0) << stats;
  EXPECT_THAT(stats, HasSubstr("DRAINING"));
  const auto [check_rc, checked] = RunToEnd({KvpoolctlBinary(), dir, "check"});
  EXPECT_EQ(check_rc, 0) << checked;
}

TEST_F(DaemonIntegrationTest, RestartIsSeenAsUnavailableThenANewEpoch) {
  StartDaemon();
  const std::string dir = daemon_->dir();
  std::unique_ptr<client::Client> c = Connect(dir);
  const uint64_t old_epoch = c->epoch();
  ASSERT_TRUE(c->Ping().ok());
  EXPECT_EQ(daemon_->Stop(), 0);  // clean shutdown
  EXPECT_EQ(c->Ping().code(), absl::StatusCode::kUnavailable);

  absl::StatusOr<std::unique_ptr<DaemonProcess>> again = DaemonProcess::Start(kConfig, dir);
  ASSERT_TRUE(again.ok()) << again.status();
  daemon_ = *std::move(again);
  // The old session died with the old daemon; reconnect.
  EXPECT_NE(c->Ping().code(), absl::StatusCode::kOk);
  std::unique_ptr<client::Client> fresh = Connect(dir);
  ASSERT_NE(fresh, nullptr);
  EXPECT_NE(fresh->epoch(), old_epoch);
  // Cache events carry the new epoch.
  const std::vector<int32_t> prompt(32, 9);
  absl::StatusOr<v1::SequenceInfo> seq = fresh->Allocate(prompt);
  ASSERT_TRUE(seq.ok());
  ASSERT_TRUE(fresh->Free({seq->sequence_id()}, /*commit=*/true).ok());
  v1::WatchEventsRequest request;
  request.set_from_seq(1);
  std::vector<v1::KvEvent> events;
  ASSERT_TRUE(fresh
                  ->WatchEvents(request,
                                [&](const v1::WatchEventsResponse& r) {
                                  events.insert(events.end(), r.events().begin(), r.events().end());
                                  return true;
                                })
                  .ok());
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events[0].epoch(), fresh->epoch());
  EXPECT_EQ(events[0].seq(), 1u);
  EXPECT_EQ(events[0].type(), v1::KvEvent::TYPE_BLOCK_STORED);
}

TEST_F(DaemonIntegrationTest, InvalidConfigExitsWithOneLinePerProblem) {
  const std::string path = "/tmp/kvpool-bad-config.textproto";
  std::ofstream(path) << "backend: \"tpu\"\npool_bytes: -1\n";
  const auto [rc, out] = RunToEnd({DaemonBinary(), "--config=" + path});
  EXPECT_EQ(rc, 2);
}

}  // namespace
}  // namespace kvpool::testing
