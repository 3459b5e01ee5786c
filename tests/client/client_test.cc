#include "client/client.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <sstream>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "client/internal/attach.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvpool/v1/wire.h"
#include "tests/client/fake_daemon.h"

// Runs before a Detach frame leaves through sendmsg below; null: nothing runs.
std::atomic<const std::function<void()>*> before_detach_frame{nullptr};

// This test binary's sendmsg, every caller's (gRPC's too): the kernel's, except that a Detach
// frame (a lone frame of length 0: 4 zero bytes) first runs before_detach_frame on the sending
// thread, so a test sees what the client still holds at the moment the daemon learns that the
// session ended.
extern "C" ssize_t sendmsg(int fd, const msghdr* msg, int flags) {
  const std::function<void()>* hook = before_detach_frame.load();
  if (hook != nullptr && msg->msg_iovlen == 1 && msg->msg_iov[0].iov_len == 4 &&
      msg->msg_controllen == 0 && std::memcmp(msg->msg_iov[0].iov_base, "\0\0\0\0", 4) == 0) {
    (*hook)();
  }
  return static_cast<ssize_t>(syscall(SYS_sendmsg, fd, msg, flags));
}

namespace kvpool::client {
namespace {

// How many of this process's mappings map the file `fd` is open on (/proc/self/maps: address,
// permissions, offset, device, inode, path).
int MappingsOf(int fd) {
  struct stat st {};
  EXPECT_EQ(fstat(fd, &st), 0) << std::strerror(errno);
  char device[32];
  std::snprintf(device, sizeof(device), "%02x:%02x", major(st.st_dev), minor(st.st_dev));
  std::ifstream maps("/proc/self/maps");
  int count = 0;
  for (std::string line; std::getline(maps, line);) {
    std::istringstream fields(line);
    std::string address, permissions, offset, dev;
    ino_t inode = 0;
    fields >> address >> permissions >> offset >> dev >> inode;
    count += dev == device && inode == st.st_ino;
  }
  return count;
}

bool ConnectedTo(int fd, const std::string& path) {
  sockaddr_un peer{};
  socklen_t len = sizeof(peer);
  return getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &len) == 0 &&
         peer.sun_family == AF_UNIX && path == peer.sun_path;
}

// How many of this process's descriptors are sockets connected to the Unix socket `path`.
int SocketsConnectedTo(const std::string& path) {
  int count = 0;
  for (int fd = 0; fd < 1024; ++fd) count += ConnectedTo(fd, path);
  return count;
}

// The lowest such descriptor, or -1.
int FirstSocketConnectedTo(const std::string& path) {
  for (int fd = 0; fd < 1024; ++fd) {
    if (ConnectedTo(fd, path)) return fd;
  }
  return -1;
}

// Forks; the child runs `body` and exits with what it returns (no gtest there: a child of a
// multithreaded process). Returns the child's exit status, -1 if it did not exit normally (a
// child that hangs is killed by its alarm after `alarm_seconds`).
int InChild(const std::function<int()>& body, unsigned alarm_seconds = 10) {
  const pid_t pid = fork();
  if (pid == 0) {
    alarm(alarm_seconds);
    _exit(body());
  }
  int status = 0;
  if (pid < 0 || waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) return -1;
  return WEXITSTATUS(status);
}

using ::testing::ElementsAre;
using testing::FakeAttachServer;
using testing::FakeGrpcServer;
using testing::FakePool;
using ::testing::HasSubstr;
using testing::SmallLayout;
using testing::TempDir;

class ClientTest : public ::testing::Test {
 protected:
  ConnectOptions Options(absl::Duration timeout = absl::Seconds(10)) const {
    ConnectOptions options;
    options.runtime_dir = dir_.path();
    options.client_name = "client-test";
    options.tenant = "acme";
    options.model = "llama";
    options.timeout = timeout;
    options.kv_access = true;
    return options;
  }
  // Attaches through an accepting fake attach server (and no gRPC server unless started).
  std::unique_ptr<Client> ConnectOrDie() {
    auto client = Client::Connect(Options());
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? std::move(*client) : nullptr;
  }

  TempDir dir_;
  FakePool pool_{SmallLayout()};
};

TEST_F(ClientTest, WithoutADaemonConnectIsUnavailableAndSaysWhere) {
  auto client = Client::Connect(Options());
  EXPECT_EQ(client.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(client.status().message()), HasSubstr(dir_.path() + "/attach.sock"));
}

TEST_F(ClientTest, RefusalIsPermissionDenied) {
  FakeAttachServer server(dir_.path(), &pool_, {.mode = FakeAttachServer::Mode::kRefuse});
  auto client = Client::Connect(Options());
  EXPECT_EQ(client.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(client.status().message()),
              HasSubstr("uid 1000 is not in the allow-list"));
}

TEST_F(ClientTest, RefusalKeepsTheDaemonsCode) {
  FakeAttachServer server(
      dir_.path(), &pool_,
      {.mode = FakeAttachServer::Mode::kRefuse, .refuse_code = 14, .refuse_reason = "draining"});
  EXPECT_EQ(Client::Connect(Options()).status().code(), absl::StatusCode::kUnavailable);
}

// The daemon refuses a peer at accept and hangs up, so the client's send can fail with EPIPE
// while the refusal waits in its socket: the refusal is what the caller must see.
TEST(AttachExchangeTest, RefusalSentBeforeTheRequestKeepsItsCode) {
  int pair[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair), 0);
  UniqueFd ours(pair[0]);
  {
    UniqueFd daemon(pair[1]);
    v1::AttachResponse refusal;
    refusal.set_error("uid 7 gid 7 may not attach to this kvpoold");
    refusal.set_error_code(static_cast<int32_t>(absl::StatusCode::kPermissionDenied));
    ASSERT_TRUE(wire::SendFrame(daemon.get(), refusal).ok());
  }  // closed before the client sends: its send gets EPIPE
  v1::AttachRequest request;
  request.set_client_name("refused");
  auto attached =
      internal::Exchange(std::move(ours), "/run/kvpool/attach.sock", request, absl::Seconds(5));
  EXPECT_EQ(attached.status().code(), absl::StatusCode::kPermissionDenied) << attached.status();
  EXPECT_THAT(std::string(attached.status().message()), HasSubstr("may not attach"));
}

TEST(AttachExchangeTest, HangUpBeforeTheRequestWithoutAnswerIsUnavailable) {
  int pair[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair), 0);
  UniqueFd ours(pair[0]);
  close(pair[1]);
  auto attached = internal::Exchange(std::move(ours), "/run/kvpool/attach.sock",
                                     v1::AttachRequest(), absl::Seconds(5));
  EXPECT_EQ(attached.status().code(), absl::StatusCode::kUnavailable) << attached.status();
}

TEST_F(ClientTest, HangUpWithoutAnswerIsUnavailable) {
  FakeAttachServer server(dir_.path(), &pool_, {.mode = FakeAttachServer::Mode::kHangUp});
  auto client = Client::Connect(Options());
  EXPECT_EQ(client.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(client.status().message()), HasSubstr("without answering"));
}

TEST_F(ClientTest, SilentDaemonTimesOut) {
  FakeAttachServer server(dir_.path(), &pool_, {.mode = FakeAttachServer::Mode::kSilent});
  EXPECT_EQ(Client::Connect(Options(absl::Milliseconds(100))).status().code(),
            absl::StatusCode::kDeadlineExceeded);
}

TEST_F(ClientTest, AComputeOnlySessionAsksForNoDescriptorAndMapsNothing) {
  FakeAttachServer server(dir_.path(), &pool_, {});
  ConnectOptions options = Options();
  options.kv_access = false;
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_FALSE(server.request().kv_access());
  EXPECT_FALSE((*client)->kv_access());
  EXPECT_EQ((*client)->mapping(), nullptr);
  EXPECT_EQ((*client)->layout().block_bytes(), SmallLayout().block_bytes());  // still told
}

// A library must not change process-wide settings: Connect used to switch Abseil's deadlock
// detection off for the whole process, and with it the check every test (tests/test_main.cc) and
// daemon_test rely on. After a connect, a lock-order cycle must still abort the test program.
TEST_F(ClientTest, ConnectLeavesDeadlockDetectionToTheProgram) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto connect_then_invert_two_locks = [this] {
    FakeAttachServer server(dir_.path(), &pool_, {});
    std::unique_ptr<Client> client = ConnectOrDie();
    std::fprintf(stderr, "connected: %d\n", client != nullptr);
    absl::Mutex a, b;
    {
      absl::MutexLock la(&a);
      absl::MutexLock lb(&b);
    }
    {
      absl::MutexLock lb(&b);
      absl::MutexLock la(&a);  // the other order: a cycle
    }
  };
  EXPECT_DEATH(connect_then_invert_two_locks(), "Potential Mutex deadlock");
}

TEST_F(ClientTest, ConnectSendsTheRequestAndMapsThePool) {
  FakeAttachServer server(dir_.path(), &pool_, {});
  std::unique_ptr<Client> client = ConnectOrDie();
  ASSERT_NE(client, nullptr);

  const v1::AttachRequest request = server.request();
  EXPECT_EQ(request.protocol_version(), 1u);
  EXPECT_EQ(request.client_name(), "client-test");
  EXPECT_EQ(request.tenant(), "acme");
  EXPECT_EQ(request.model(), "llama");
  EXPECT_TRUE(request.kv_access());

  EXPECT_EQ(client->session_id(), 42u);
  EXPECT_EQ(client->namespace_id(), 7u);
  EXPECT_EQ(client->epoch(), 3u);
  EXPECT_TRUE(client->admin());
  EXPECT_EQ(client->daemon_version(), "fake-1");
  EXPECT_EQ(client->runtime_dir(), dir_.path());
  EXPECT_EQ(client->layout().block_bytes(), SmallLayout().block_bytes());

  auto k = client->mapping()->K(1, BlockRef{2, 1});
  ASSERT_TRUE(k.ok()) << k.status();
  std::memcpy(*k, "kv!", 4);
  const int64_t offset = 2 * SmallLayout().block_bytes() + 2 * SmallLayout().chunk_bytes();
  EXPECT_STREQ(pool_.arena() + offset, "kv!");

  pool_.generations()[2] = 2;
  EXPECT_EQ(client->mapping()->K(1, BlockRef{2, 1}).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(ClientTest, DescriptorsMayArriveInAnyOrder) {
  FakeAttachServer server(dir_.path(), &pool_, {.swap_fd_order = true});
  std::unique_ptr<Client> client = ConnectOrDie();
  ASSERT_NE(client, nullptr);
  pool_.generations()[9] = 4;
  EXPECT_EQ(client->mapping()->generation(9), 4u);
  EXPECT_TRUE(client->mapping()->V(0, BlockRef{9, 4}).ok());
}

TEST_F(ClientTest, DestroyingTheClientClosesTheAttachSocket) {
  FakeAttachServer server(dir_.path(), &pool_, {});
  std::unique_ptr<Client> client = ConnectOrDie();
  ASSERT_NE(client, nullptr);
  client.reset();
  EXPECT_TRUE(server.WaitForClientClose(absl::Seconds(10)));
}

// The daemon ends a session on its Detach frame at once and may hand its blocks to another tenant
// (scrubbed, or written by the next owner): when the frame leaves, this process must no longer
// map the pool. The check runs on the client's thread as the frame is sent.
TEST_F(ClientTest, ThePoolIsUnmappedBeforeTheDetachFrameIsSent) {
  FakeAttachServer server(dir_.path(), &pool_, {});
  const int arena = MappingsOf(pool_.arena_fd());  // the fake daemon's own mappings
  const int generations = MappingsOf(pool_.generation_fd());
  std::unique_ptr<Client> client = ConnectOrDie();
  ASSERT_NE(client, nullptr);
  ASSERT_GT(MappingsOf(pool_.arena_fd()), arena);
  ASSERT_GT(MappingsOf(pool_.generation_fd()), generations);

  int frames = 0;
  int arena_then = -1;
  int generations_then = -1;
  const std::function<void()> check = [&] {
    ++frames;
    arena_then = MappingsOf(pool_.arena_fd());
    generations_then = MappingsOf(pool_.generation_fd());
  };
  before_detach_frame = &check;
  client.reset();
  before_detach_frame = nullptr;
  EXPECT_EQ(frames, 1);
  EXPECT_EQ(arena_then, arena) << "the arena was still mapped when the Detach frame left";
  EXPECT_EQ(generations_then, generations)
      << "the generation table was still mapped when the Detach frame left";
  EXPECT_TRUE(server.WaitForClientClose(absl::Seconds(10)));
}

// The session belongs to the process that connected. A Client destroyed in a forked child says
// no goodbye: a Detach frame would end the parent's session while the parent still maps it.
TEST_F(ClientTest, AClientDestroyedInAForkedChildLeavesTheSessionToTheParent) {
  FakeAttachServer server(dir_.path(), &pool_, {});
  std::unique_ptr<Client> client = ConnectOrDie();
  ASSERT_NE(client, nullptr);
  EXPECT_EQ(InChild([&] {
              client.reset();
              return 0;
            }),
            0);
  pool_.generations()[9] = 4;
  EXPECT_TRUE(client->mapping()->V(0, BlockRef{9, 4}).ok()) << "the parent's mapping went";
  client.reset();  // the parent's goodbye: the only frame after the attach
  ASSERT_TRUE(server.WaitForClientClose(absl::Seconds(10)));
  EXPECT_EQ(server.bytes_after_attach(), 4) << "the child sent a Detach frame too";
}

// The child of a multithreaded parent inherits every lock as it was at fork(), held ones
// included. absl's deadlock detection (on in debug builds of absl, as Debian's, unless the
// program turns it off) serializes every Mutex lock, and every Mutex's destruction, on one
// global spin lock: a child that destroys or locks an absl::Mutex waits for ever when another
// thread held that lock at the fork. So ~Client in a child touches no absl::Mutex. Here other
// threads lock Mutexes without pause while the test forks, as gRPC's threads do now and then.
TEST_F(ClientTest, AClientDestroyedInAForkedChildWaitsOnNoLockTheParentHeld) {
  FakeAttachServer server(dir_.path(), &pool_, {});
  std::unique_ptr<Client> client = ConnectOrDie();
  ASSERT_NE(client, nullptr);
  std::atomic<bool> stop{false};
  std::vector<std::thread> lockers;
  for (int i = 0; i < 2; ++i) {
    lockers.emplace_back([&stop] {
      while (!stop.load(std::memory_order_relaxed)) {
        absl::Mutex mu;
        absl::MutexLock lock(&mu);
      }
    });
  }
  int hung = 0;
  for (int i = 0; i < 20; ++i) {
    hung += InChild(
                [&] {
                  client.reset();
                  return 0;
                },
                /*alarm_seconds=*/3) != 0;
  }
  stop = true;
  for (std::thread& t : lockers) t.join();
  EXPECT_EQ(hung, 0) << "children that did not finish destroying their Client";
  client.reset();
  ASSERT_TRUE(server.WaitForClientClose(absl::Seconds(10)));
  EXPECT_EQ(server.bytes_after_attach(), 4) << "a child sent a Detach frame too";
}

// A forked child holds no copy of the attach socket: the parent's death (even by SIGKILL) ends
// the session although the child lives on. The descriptor number is then free in the child, and
// the child's Client does not close whatever took it.
TEST_F(ClientTest, AForkedChildHoldsNoCopyOfTheAttachSocket) {
  FakeAttachServer server(dir_.path(), &pool_, {});
  std::unique_ptr<Client> client = ConnectOrDie();
  ASSERT_NE(client, nullptr);
  const std::string path = dir_.path() + "/" + wire::kAttachSocket;
  ASSERT_EQ(SocketsConnectedTo(path), 1);
  const int fd = FirstSocketConnectedTo(path);
  EXPECT_EQ(InChild([&] { return SocketsConnectedTo(path); }), 0);
  EXPECT_EQ(InChild([&] {
              const int held = SocketsConnectedTo(path);
              UniqueFd null_fd(open("/dev/null", O_RDONLY | O_CLOEXEC));
              if (dup2(null_fd.get(), fd) != fd) return 20;
              client.reset();
              return held + (fcntl(fd, F_GETFD) == -1 ? 10 : 0);
            }),
            0);
  EXPECT_EQ(SocketsConnectedTo(path), 1);
  client.reset();
  ASSERT_TRUE(server.WaitForClientClose(absl::Seconds(10)));
  EXPECT_EQ(server.bytes_after_attach(), 4);
}

TEST_F(ClientTest, CallsWithoutAGrpcServerAreUnavailable) {
  FakeAttachServer server(dir_.path(), &pool_, {});
  std::unique_ptr<Client> client = ConnectOrDie();
  ASSERT_NE(client, nullptr);
  EXPECT_EQ(client->Ping().code(), absl::StatusCode::kUnavailable);
}

class ClientRpcTest : public ClientTest {
 protected:
  void SetUp() override {
    client_ = ConnectOrDie();
    ASSERT_NE(client_, nullptr);
  }
  FakeAttachServer attach_{dir_.path(), &pool_, {}};
  FakeGrpcServer grpc_{dir_.path()};
  std::unique_ptr<Client> client_;
};

TEST_F(ClientRpcTest, EveryCallCarriesTheSessionToken) {
  ASSERT_TRUE(client_->Ping().ok());
  ASSERT_TRUE(client_->GetStats().ok());
  EXPECT_THAT(grpc_.service().tokens(), ElementsAre("token-42", "token-42"));
}

TEST_F(ClientRpcTest, AllocateReturnsFullTables) {
  const std::vector<int32_t> prompt = {1, 2, 3, 4, 5, 6};
  auto batch = client_->Allocate({AllocateItem{prompt, 8, 0}, AllocateItem{prompt}});
  ASSERT_TRUE(batch.ok()) << batch.status();
  ASSERT_EQ(batch->size(), 2u);
  EXPECT_EQ((*batch)[0].sequence_id(), 100u);
  EXPECT_EQ((*batch)[0].matched_tokens(), 3);
  EXPECT_EQ(ToBlockRefs((*batch)[0]), (std::vector<BlockRef>{{0, 1}, {1, 1}}));
  EXPECT_EQ((*batch)[1].num_tokens(), 6);  // 0 tokens asked: the prompt's size

  auto one = client_->Allocate(prompt, 12);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->block_ids_size(), 3);
}

TEST_F(ClientRpcTest, MalformedResponsesAreInternal) {
  grpc_.service().set_malformed(true);
  const std::vector<int32_t> prompt = {1, 2};
  EXPECT_EQ(client_->Allocate(prompt).status().code(), absl::StatusCode::kInternal);
}

TEST_F(ClientRpcTest, ResourceExhaustedCarriesTheShortfall) {
  auto grown = client_->Grow(100, 64);
  EXPECT_EQ(grown.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(grown.status().message(), "Grow: pool short by 3 blocks");
  const std::optional<Shortfall> shortfall = GetShortfall(grown.status());
  ASSERT_TRUE(shortfall.has_value());
  EXPECT_EQ(shortfall->resource, "pool");
  EXPECT_EQ(shortfall->blocks, 3);
}

TEST_F(ClientRpcTest, ForkAndFreePassTheirArguments) {
  auto child = client_->Fork(100);
  ASSERT_TRUE(child.ok()) << child.status();
  EXPECT_EQ(child->sequence_id(), 101u);
  EXPECT_EQ(client_->Fork(5).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(client_->Free({100, 101}, /*commit=*/true).ok());
}

TEST_F(ClientRpcTest, AdminCallsReturnTheDaemonsAnswers) {
  auto stats = client_->GetStats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->free_blocks(), 10);
  auto sequences = client_->ListSequences(43);
  ASSERT_TRUE(sequences.ok());
  EXPECT_THAT(sequences->session_ids(), ElementsAre(43u));
  auto trace = client_->DumpBlockTrace(5);
  ASSERT_TRUE(trace.ok());
  EXPECT_EQ(trace->entries_size(), 1);
  auto all = client_->DumpAllBlockTraces();
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->entries_size(), 5);
  auto evicted = client_->Evict(4);
  ASSERT_TRUE(evicted.ok());
  EXPECT_EQ(*evicted, 4);
  EXPECT_EQ(*client_->EvictAll(), 9);
  ASSERT_TRUE(client_->SetLogLevel("debug").ok());
  EXPECT_EQ(grpc_.service().log_level(), "debug");
  EXPECT_EQ(*client_->Drain(), 2);
  const std::vector<int32_t> tokens = {1, 2, 3, 4};
  EXPECT_EQ(client_->ExplainMatch(tokens)->matched_tokens(), 2);

  grpc_.service().set_deny_admin(true);
  EXPECT_EQ(client_->GetStats().status().code(), absl::StatusCode::kPermissionDenied);
}

TEST_F(ClientRpcTest, WatchEventsDeliversEachMessageUntilTheStreamEnds) {
  std::vector<v1::WatchEventsResponse> got;
  v1::WatchEventsRequest request;
  request.set_from_seq(20);
  ASSERT_TRUE(client_
                  ->WatchEvents(request,
                                [&](const v1::WatchEventsResponse& r) {
                                  got.push_back(r);
                                  return true;
                                })
                  .ok());
  ASSERT_EQ(got.size(), 3u);
  EXPECT_TRUE(got[0].snapshot());
  EXPECT_EQ(got[1].events(0).seq(), 20u);
  EXPECT_EQ(got[2].events(0).seq(), 21u);
}

TEST_F(ClientRpcTest, WatchEventsStopsWhenTheCallbackSaysSo) {
  int calls = 0;
  const absl::Status status = client_->WatchEvents(
      v1::WatchEventsRequest(), [&](const v1::WatchEventsResponse&) { return ++calls < 2; });
  EXPECT_TRUE(status.ok()) << status;
  EXPECT_EQ(calls, 2);
}

TEST_F(ClientRpcTest, CancelWatchesEndsAFollowedStream) {
  v1::WatchEventsRequest request;
  request.set_follow(true);
  int calls = 0;
  absl::Status status = absl::UnknownError("not run");
  std::thread watcher([&] {
    status = client_->WatchEvents(request, [&](const v1::WatchEventsResponse&) {
      ++calls;
      return true;
    });
  });
  // The call registers its context before it reaches the server, so once the server streams,
  // one cancel is enough.
  grpc_.service().WaitForFollower();
  client_->CancelWatches();
  watcher.join();
  EXPECT_TRUE(status.ok()) << status;
  EXPECT_LE(calls, 1);
}

}  // namespace
}  // namespace kvpool::client
