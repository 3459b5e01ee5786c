// Hostile and buggy clients against a real kvpoold (issue 12): one test per hole a client, or any
// local user, could use to hold the daemon up or exhaust it; each checks the daemon still serves
// afterwards. Label `integration`; the tests that switch uids or chown need root (CI and the
// README's test command run as root) and skip otherwise.
//
// KVPOOL_TEST_DAEMON=<an older kvpoold> runs them against another build (harness.h).

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "client/client.h"
#include "client/internal/attach.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvpool/util/unique_fd.h"
#include "kvpool/v1/doorbell.h"
#include "kvpool/v1/wire.h"
#include "model/weights.h"
#include "tests/integration/harness.h"

namespace kvpool::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr uid_t kStranger = 4246;

// Calls wait minutes: on a loaded machine, or under sanitizers, a long prefill admitted in a test
// takes seconds, and the deadline must never be what refuses a call these tests expect to pass.
std::unique_ptr<client::Client> Connect(const std::string& dir, const std::string& name = "test",
                                        absl::Duration timeout = absl::Minutes(2)) {
  absl::StatusOr<std::unique_ptr<client::Client>> c = client::Client::Connect(
      {.runtime_dir = dir, .client_name = name, .timeout = timeout, .kv_access = true});
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

// A connection to attach.sock that never says anything (non-blocking: a full backlog is not
// waited on).
UniqueFd Silent(const std::string& dir) {
  UniqueFd fd(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const std::string path = dir + "/" + wire::kAttachSocket;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  return fd;
}

// kvpoolctl check: the daemon answers and its pools are consistent.
void ExpectServingAndConsistent(const std::string& dir) {
  const auto [rc, out] = RunToEnd({KvpoolctlBinary(), "--socket_dir=" + dir, "check"});
  EXPECT_EQ(rc, 0) << out;
}

// Runs kvpoold on `config` (with runtime_dir `dir`) until it exits, at most 10 s; returns its
// exit code and what it printed.
std::pair<int, std::string> RunDaemon(const std::string& config, const std::string& dir) {
  const std::string path = dir + ".textproto";
  std::ofstream(path) << config << "\nruntime_dir: \"" << dir << "\"\n";
  std::pair<int, std::string> result = RunToEnd(
      {"/bin/sh", "-c", "exec timeout 10 " + DaemonBinary() + " --config=" + path + " 2>&1"});
  std::filesystem::remove(path);
  return result;
}

std::string TempPath(const std::string& name) {
  return ::testing::TempDir() + "/hostile-" + std::to_string(getpid()) + "-" + name;
}

// --- The attach socket ---

TEST(HostileIntegrationTest, SilentConnectionsHoldUpNeitherAttachNorReclaim) {
  absl::StatusOr<std::unique_ptr<DaemonProcess>> d = DaemonProcess::Start("");
  ASSERT_TRUE(d.ok()) << d.status();
  const std::string dir = (*d)->dir();
  std::unique_ptr<client::Client> admin = Connect(dir, "admin");
  ASSERT_NE(admin, nullptr);
  absl::StatusOr<Child> victim = Spawn({TrustClientBinary(), "hold", dir, "default", "0"});
  ASSERT_TRUE(victim.ok());
  absl::Cleanup reap = [&] {  // whatever fails below, the victim does not outlive the test
    if (victim->pid > 0 && kill(victim->pid, SIGKILL) == 0) Wait(&*victim);
  };
  ASSERT_EQ(ReadLine(*victim, absl::Seconds(10)).value_or("?"), "holding");

  std::vector<UniqueFd> silent;
  for (int i = 0; i < 200; ++i) silent.push_back(Silent(dir));
  absl::SleepFor(absl::Milliseconds(50));  // the daemon has seen them

  // A well-behaved client attaches at once.
  v1::AttachRequest request;
  request.set_protocol_version(wire::kProtocolVersion);
  request.set_client_name("good");
  const absl::Time start = absl::Now();
  absl::StatusOr<client::internal::Attachment> good =
      client::internal::Attach(dir, request, absl::Seconds(5));
  const absl::Duration took = absl::Now() - start;
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_LT(took, absl::Milliseconds(100));

  // A client killed meanwhile is reclaimed at once.
  auto sessions = [&] {
    absl::StatusOr<v1::ListSessionsResponse> list = admin->ListSessions();
    return list.ok() ? list->sessions_size() : -1;
  };
  const int before = sessions();
  ASSERT_EQ(before, 3);  // admin, victim, good
  kill(victim->pid, SIGKILL);
  const absl::Time killed = absl::Now();
  Wait(&*victim);
  victim->pid = -1;
  while (sessions() == before && absl::Now() - killed < absl::Seconds(5)) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_LT(absl::Now() - killed, absl::Milliseconds(100));
  EXPECT_EQ(sessions(), 2);
  silent.clear();
  ExpectServingAndConsistent(dir);
}

// --- Limits: each hit with its code, the daemon still serving ---

TEST(HostileIntegrationTest, SessionsPerUid) {
  absl::StatusOr<std::unique_ptr<DaemonProcess>> d =
      DaemonProcess::Start("limits { sessions_per_uid: 2 }");
  ASSERT_TRUE(d.ok()) << d.status();
  const std::string dir = (*d)->dir();
  std::unique_ptr<client::Client> first = Connect(dir), second = Connect(dir);
  ASSERT_NE(second, nullptr);
  absl::StatusOr<std::unique_ptr<client::Client>> third =
      client::Client::Connect({.runtime_dir = dir, .client_name = "third"});
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted) << third.status();
  EXPECT_THAT(std::string(third.status().message()), HasSubstr("limits.sessions_per_uid"));
  first.reset();  // its slot comes back
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_NE(Connect(dir), nullptr);
}

TEST(HostileIntegrationTest, BatchItemsDecodeWidthAndQueuedCalls) {
  absl::StatusOr<std::unique_ptr<DaemonProcess>> d =
      DaemonProcess::Start("limits { batch_items: 8 decode_width: 4 queued_calls_per_session: 2 }");
  ASSERT_TRUE(d.ok()) << d.status();
  const std::string dir = (*d)->dir();
  std::unique_ptr<client::Client> c = Connect(dir);
  ASSERT_NE(c, nullptr);
  std::vector<client::AllocateItem> nine(9, client::AllocateItem{.num_tokens = 16});
  EXPECT_EQ(c->Allocate(nine).status().code(), absl::StatusCode::kResourceExhausted);
  nine.pop_back();
  absl::StatusOr<std::vector<v1::SequenceInfo>> eight = c->Allocate(nine);
  ASSERT_TRUE(eight.ok()) << eight.status();

  std::vector<int32_t> prompt(16, 7);
  std::vector<client::DecodeItem> wide;
  for (int i = 0; i < 5; ++i) {
    absl::StatusOr<v1::PrefillResponse> p = c->Prefill(0, prompt);
    ASSERT_TRUE(p.ok()) << p.status();
    wide.push_back({p->sequence_id(), p->next_token()});
  }
  const absl::Status too_wide = c->Decode(wide).status();
  EXPECT_EQ(too_wide.code(), absl::StatusCode::kResourceExhausted) << too_wide;
  wide.pop_back();
  EXPECT_TRUE(c->Decode(wide).ok());

  // Eight concurrent long prefills from one session: at most two are queued or running at once,
  // the others are refused at once.
  std::vector<int32_t> long_prompt(2000, 3);
  std::atomic<int> ok{0}, exhausted{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&, i] {
      std::vector<int32_t> mine = long_prompt;
      mine[0] = i;
      const absl::Status s = c->Prefill(0, mine).status();
      (s.ok() ? ok : exhausted).fetch_add(1);
      if (!s.ok()) {
        EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_GE(ok.load(), 1);
  EXPECT_GE(exhausted.load(), 1);
  absl::StatusOr<v1::GetStatsResponse> stats = c->GetStats();
  ASSERT_TRUE(stats.ok());
  EXPECT_GE(stats->calls_over_limit(), 2u + static_cast<uint64_t>(exhausted.load()));
  ExpectServingAndConsistent(dir);
}

// --- Compute calls ---

// A process holding a decode doorbell writes whatever it likes into the page, rings as fast as it
// can, then vanishes mid-ring; another tenant's session decodes throughout, and the daemon serves
// and stays consistent.
TEST(HostileIntegrationTest, AScribblingDoorbellClientHurtsOnlyItself) {
  absl::StatusOr<std::unique_ptr<DaemonProcess>> d = DaemonProcess::Start("");
  ASSERT_TRUE(d.ok()) << d.status();
  const std::string dir = (*d)->dir();
  std::unique_ptr<client::Client> victim = Connect(dir, "victim");
  ASSERT_NE(victim, nullptr);
  absl::StatusOr<v1::PrefillResponse> p = victim->Prefill(0, std::vector<int32_t>(20, 9));
  ASSERT_TRUE(p.ok()) << p.status();
  client::DecodeItem item{p->sequence_id(), p->next_token()};

  v1::AttachRequest request;
  request.set_protocol_version(wire::kProtocolVersion);
  request.set_client_name("scribbler");
  request.set_tenant("other");
  request.set_model("default");
  request.set_decode_doorbell(true);
  absl::StatusOr<client::internal::Attachment> a =
      client::internal::Attach(dir, request, absl::Seconds(10), {});
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(a->response.decode_doorbell());
  ASSERT_EQ(a->fds.size(), 1u);
  EXPECT_NE(ftruncate(a->fds[0].get(), 0), 0);  // sealed: the daemon's reads stay in bounds
  void* map =
      mmap(nullptr, wire::kDoorbellBytes, PROT_READ | PROT_WRITE, MAP_SHARED, a->fds[0].get(), 0);
  ASSERT_NE(map, MAP_FAILED);
  auto* page = static_cast<wire::DoorbellPage*>(map);
  uint64_t x = 88172645463325252ull;
  auto next = [&x] { return x ^= x << 13, x ^= x >> 7, x ^= x << 17; };
  for (int round = 0; round < 300; ++round) {
    auto* bytes = reinterpret_cast<uint64_t*>(page);
    for (size_t i = 0; i < wire::kDoorbellBytes / 8; ++i) bytes[i] = next();
    // Half the rounds name the victim's sequence (another tenant's), with plausible counts.
    if (round % 2 == 0) {
      page->num_items = 1 + static_cast<uint32_t>(next() % 4);
      page->items[0].sequence_id = item.sequence_id;
    }
    page->ring.fetch_add(1);
    wire::FutexWakeAll(&page->ring);
    if (round % 50 == 0) {
      absl::StatusOr<v1::DecodeResponse> r = victim->Decode(std::span(&item, 1));
      ASSERT_TRUE(r.ok()) << r.status();
      item.token = r->next_tokens(0);
    }
  }
  munmap(map, wire::kDoorbellBytes);
  a->socket = UniqueFd();  // the scribbler goes away, its last ring perhaps unanswered

  // The victim's sequence advanced only by its own decodes: 20 prompt tokens, six steps.
  absl::StatusOr<v1::DecodeResponse> r = victim->Decode(std::span(&item, 1));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->num_tokens(0), 27);
  ExpectServingAndConsistent(dir);
}

// A model of 256 positions: a 260-token prompt used to be computed anyway.
TEST(HostileIntegrationTest, APromptBeyondTheContextIsRefused) {
  const std::string checkpoint = TempPath("context256");
  model::ModelConfig config = *model::NamedConfig("tiny");
  config.max_position = 256;
  ASSERT_TRUE(model::SaveCheckpoint(model::SyntheticWeights(config, 3), checkpoint, "f32").ok());
  absl::StatusOr<std::unique_ptr<DaemonProcess>> d =
      DaemonProcess::Start("model { checkpoint: \"" + checkpoint + "\" }");
  ASSERT_TRUE(d.ok()) << d.status();
  std::unique_ptr<client::Client> c = Connect((*d)->dir());
  ASSERT_NE(c, nullptr);
  ASSERT_EQ(c->model_max_position(), 256);
  const std::vector<int32_t> prompt(260, 5);
  const absl::Status s = c->Prefill(0, prompt).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange) << s;
  absl::StatusOr<v1::PrefillResponse> fits = c->Prefill(0, std::span(prompt).first(250));
  ASSERT_TRUE(fits.ok()) << fits.status();
  std::vector<int32_t> turn(7, 5);  // 257 tokens
  EXPECT_EQ(c->Prefill(fits->sequence_id(), turn).status().code(), absl::StatusCode::kOutOfRange);
  std::vector<client::DecodeItem> next = {{fits->sequence_id(), fits->next_token()}};
  for (int i = 0; i < 6; ++i) ASSERT_TRUE(c->Decode(next).ok());  // 256: the last position
  EXPECT_EQ(c->Decode(next).status().code(), absl::StatusCode::kOutOfRange);
  ExpectServingAndConsistent((*d)->dir());
  std::filesystem::remove_all(checkpoint);
}

// A model of 32 tokens: a top_k of 40 passes the RPC's own bound (64) but no step can serve it.
// Before, the step ran the widest top_k of its calls and failed every call in it.
TEST(HostileIntegrationTest, OneCallsTopKFailsThatCallAlone) {
  const std::string checkpoint = TempPath("vocab32");
  model::ModelConfig config = *model::NamedConfig("tiny");
  config.vocab_size = 32;
  ASSERT_TRUE(model::SaveCheckpoint(model::SyntheticWeights(config, 3), checkpoint, "f32").ok());
  absl::StatusOr<std::unique_ptr<DaemonProcess>> d = DaemonProcess::Start(
      "model { checkpoint: \"" + checkpoint + "\" max_step_tokens: 64 } pool_bytes: 33554432");
  ASSERT_TRUE(d.ok()) << d.status();
  std::unique_ptr<client::Client> a = Connect((*d)->dir(), "a"), b = Connect((*d)->dir(), "b");
  ASSERT_NE(b, nullptr);
  // b's long prompt runs in chunks; a's bad call arrives while it does and joins its next step.
  std::vector<int32_t> long_prompt(1000, 1);
  absl::Status b_status;
  std::thread b_thread([&] { b_status = b->Prefill(0, long_prompt, /*top_k=*/2).status(); });
  absl::Status a_status;
  for (int i = 0; i < 20; ++i) {
    a_status = a->Prefill(0, std::vector<int32_t>(8, 1), /*top_k=*/40).status();
    absl::SleepFor(absl::Milliseconds(2));
  }
  b_thread.join();
  EXPECT_EQ(a_status.code(), absl::StatusCode::kInvalidArgument) << a_status;
  EXPECT_TRUE(b_status.ok()) << b_status;
  absl::StatusOr<v1::PrefillResponse> good = a->Prefill(0, std::vector<int32_t>(8, 2), 5);
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_EQ(good->top().tokens_size(), 5);
  std::filesystem::remove_all(checkpoint);
}

TEST(HostileIntegrationTest, ACheckpointBeyondTheKernelsIsRefusedAtLoad) {
  const std::string checkpoint = TempPath("wide-heads");
  model::ModelConfig config = *model::NamedConfig("tiny");
  config.num_layers = 1;
  config.num_heads = 256;  // the CPU decode kernel serves 128 query heads
  config.num_kv_heads = 4;
  config.head_dim = 8;
  config.hidden_size = 256;
  config.vocab_size = 64;
  ASSERT_TRUE(model::SaveCheckpoint(model::SyntheticWeights(config, 3), checkpoint, "f32").ok());
  const std::string dir = TempPath("wide-heads-run");
  const auto [rc, out] = RunDaemon("model { checkpoint: \"" + checkpoint + "\" }", dir);
  EXPECT_NE(rc, 0);
  EXPECT_NE(rc, 124) << "kvpoold started with a model it cannot run";
  EXPECT_THAT(out, HasSubstr("query heads"));
  std::filesystem::remove_all(checkpoint);
  std::filesystem::remove_all(dir);
}

// --- The runtime directory ---

TEST(HostileIntegrationTest, AForeignSymlinkedOrSharedRuntimeDirectoryIsRefused) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to chown";
  const std::string foreign = TempPath("foreign");
  ASSERT_EQ(mkdir(foreign.c_str(), 0700), 0);
  ASSERT_EQ(chown(foreign.c_str(), kStranger, kStranger), 0);
  auto [rc, out] = RunDaemon("", foreign);
  EXPECT_NE(rc, 0);
  EXPECT_NE(rc, 124) << "kvpoold served from another uid's directory";
  EXPECT_THAT(out, HasSubstr("belongs to uid 4246"));
  EXPECT_FALSE(std::filesystem::exists(foreign + "/attach.sock"));

  const std::string target = TempPath("target"), link = TempPath("link");
  ASSERT_EQ(mkdir(target.c_str(), 0700), 0);
  ASSERT_EQ(symlink(target.c_str(), link.c_str()), 0);
  std::tie(rc, out) = RunDaemon("", link);
  EXPECT_NE(rc, 124) << "kvpoold served through a symbolic link";
  EXPECT_THAT(out, HasSubstr("symbolic link"));

  const std::string shared = TempPath("shared");
  ASSERT_EQ(mkdir(shared.c_str(), 0700), 0);
  ASSERT_EQ(chmod(shared.c_str(), 0777), 0);
  std::tie(rc, out) = RunDaemon("", shared);
  EXPECT_NE(rc, 124) << "kvpoold served from a directory anyone may write to";
  EXPECT_THAT(out, HasSubstr("may be written by others"));
  for (const std::string& p : {foreign, target, link, shared}) std::filesystem::remove_all(p);
}

TEST(HostileIntegrationTest, AClientSendsNothingToAListenerOfAnotherUid) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to become another uid";
  const std::string dir = TempPath("impostor");
  ASSERT_EQ(mkdir(dir.c_str(), 0755), 0);  // root's: a directory the client trusts
  absl::StatusOr<Child> impostor =
      Spawn({TrustClientBinary(), "listen", dir, "-", std::to_string(kStranger)});
  ASSERT_TRUE(impostor.ok());
  absl::Cleanup reap = [&] {
    kill(impostor->pid, SIGKILL);
    Wait(&*impostor);
  };
  ASSERT_EQ(ReadLine(*impostor, absl::Seconds(10)).value_or("?"), "listening");
  absl::StatusOr<std::unique_ptr<client::Client>> c =
      client::Client::Connect({.runtime_dir = dir, .timeout = absl::Seconds(3)});
  EXPECT_EQ(c.status().code(), absl::StatusCode::kPermissionDenied) << c.status();
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("runs as uid 4246"));
  EXPECT_EQ(ReadLine(*impostor, absl::Seconds(10)).value_or("?"), "received 0");
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kvpool::testing
