#include "tests/client/fake_daemon.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "absl/time/clock.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "kvpool/v1/wire.h"

namespace kvpool::client::testing {
namespace {

UniqueFd Memfd(const char* name, int64_t bytes) {
  UniqueFd fd(memfd_create(name, MFD_CLOEXEC));
  EXPECT_TRUE(fd.valid()) << std::strerror(errno);
  EXPECT_EQ(ftruncate(fd.get(), bytes), 0) << std::strerror(errno);
  return fd;
}

void* MapShared(int fd, int64_t bytes) {
  void* p = mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  EXPECT_NE(p, MAP_FAILED) << std::strerror(errno);
  return p;
}

}  // namespace

TempDir::TempDir() {
  char pattern[] = "/tmp/kvpool-client-test-XXXXXX";
  const char* made = mkdtemp(pattern);
  EXPECT_NE(made, nullptr) << std::strerror(errno);
  path_ = made != nullptr ? made : "/tmp";
}

TempDir::~TempDir() {
  std::error_code ignored;
  if (path_ != "/tmp") std::filesystem::remove_all(path_, ignored);
}

v1::PoolLayout SmallLayout() {
  v1::PoolLayout layout;
  layout.set_block_size(4);
  layout.set_num_layers(2);
  layout.set_num_kv_heads(2);
  layout.set_head_dim(8);
  layout.set_dtype(v1::DTYPE_F32);
  layout.set_num_blocks(16);
  layout.set_chunk_bytes(4 * 2 * 8 * 4);
  layout.set_block_bytes(2 * 2 * layout.chunk_bytes());
  layout.set_layout_hash(0x1234);
  return layout;
}

FakePool::FakePool(const v1::PoolLayout& layout) : layout_(layout) {
  arena_fd_ = Memfd("fake-arena", arena_bytes());
  generation_fd_ = Memfd("fake-generations", int64_t{layout_.num_blocks()} * 4);
  arena_ = static_cast<char*>(MapShared(arena_fd_.get(), arena_bytes()));
  generations_ =
      static_cast<uint32_t*>(MapShared(generation_fd_.get(), int64_t{layout_.num_blocks()} * 4));
  for (int b = 0; b < layout_.num_blocks(); ++b) generations_[b] = 1;
}

FakePool::~FakePool() {
  munmap(arena_, static_cast<size_t>(arena_bytes()));
  munmap(generations_, static_cast<size_t>(layout_.num_blocks()) * 4);
}

std::vector<UniqueFd> FakePool::DupFds() const {
  std::vector<UniqueFd> fds;
  fds.emplace_back(fcntl(arena_fd_.get(), F_DUPFD_CLOEXEC, 0));
  fds.emplace_back(fcntl(generation_fd_.get(), F_DUPFD_CLOEXEC, 0));
  return fds;
}

v1::AttachResponse FakePool::Response() const {
  v1::AttachResponse r;
  r.set_session_id(42);
  r.set_session_token("token-42");
  r.set_admin(true);
  r.set_namespace_id(7);
  r.set_epoch(3);
  r.set_daemon_version("fake-1");
  *r.mutable_layout() = layout_;
  r.set_arena_kind(v1::ARENA_KIND_MEMFD);
  r.set_arena_bytes(arena_bytes());
  r.set_mapped_bytes(arena_bytes());
  r.add_fds(v1::FD_ROLE_ARENA);
  r.add_fds(v1::FD_ROLE_GENERATION_TABLE);
  return r;
}

FakeAttachServer::FakeAttachServer(const std::string& dir, const FakePool* pool, Options options)
    : pool_(pool), options_(std::move(options)) {
  listener_.reset(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const std::string path = dir + "/" + wire::kAttachSocket;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  EXPECT_EQ(bind(listener_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0)
      << std::strerror(errno);
  EXPECT_EQ(listen(listener_.get(), 4), 0) << std::strerror(errno);
  thread_ = std::thread([this] { Serve(); });
}

FakeAttachServer::~FakeAttachServer() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    // Wakes a blocked accept() or read().
    shutdown(listener_.get(), SHUT_RDWR);
    if (connection_ >= 0) shutdown(connection_, SHUT_RDWR);
  }
  if (!release_.HasBeenNotified()) release_.Notify();
  thread_.join();
}

v1::AttachRequest FakeAttachServer::request() const {
  absl::MutexLock lock(&mu_);
  return request_;
}

bool FakeAttachServer::WaitForClientClose(absl::Duration limit) {
  return client_closed_.WaitForNotificationWithTimeout(limit);
}

int64_t FakeAttachServer::bytes_after_attach() const {
  absl::MutexLock lock(&mu_);
  return bytes_after_attach_;
}

void FakeAttachServer::Serve() {
  UniqueFd connection(accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
  if (!connection.valid()) return;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    connection_ = connection.get();
  }
  v1::AttachRequest request;
  std::vector<int> fds;
  if (!wire::ReceiveFrame(connection.get(), &request, &fds, absl::Seconds(10)).ok()) return;
  {
    absl::MutexLock lock(&mu_);
    request_ = request;
  }
  switch (options_.mode) {
    case Mode::kHangUp:
      break;
    case Mode::kSilent:
      release_.WaitForNotification();
      break;
    case Mode::kRefuse: {
      v1::AttachResponse response;
      response.set_error(options_.refuse_reason);
      response.set_error_code(options_.refuse_code);
      EXPECT_TRUE(wire::SendFrame(connection.get(), response).ok());
      break;
    }
    case Mode::kAccept: {
      v1::AttachResponse response = pool_->Response();
      std::vector<int> send = {pool_->arena_fd(), pool_->generation_fd()};
      if (!request.kv_access()) {  // compute-only: no descriptor
        response.clear_fds();
        send.clear();
      }
      response.set_kv_access(request.kv_access());
      if (options_.swap_fd_order) {
        response.clear_fds();
        response.add_fds(v1::FD_ROLE_GENERATION_TABLE);
        response.add_fds(v1::FD_ROLE_ARENA);
        std::swap(send[0], send[1]);
      }
      EXPECT_TRUE(wire::SendFrame(connection.get(), response, send).ok());
      char bytes[64];
      for (ssize_t n; (n = read(connection.get(), bytes, sizeof(bytes))) > 0;) {
        absl::MutexLock lock(&mu_);
        bytes_after_attach_ += n;
      }
      absl::MutexLock lock(&mu_);
      if (!stopping_) client_closed_.Notify();
      break;
    }
  }
  absl::MutexLock lock(&mu_);
  connection_ = -1;
}

FakeGrpcServer::FakeGrpcServer(const std::string& dir) {
  grpc::ServerBuilder builder;
  builder.AddListeningPort("unix:" + dir + "/" + wire::kGrpcSocket,
                           grpc::InsecureServerCredentials());
  builder.RegisterService(&service_);
  server_ = builder.BuildAndStart();
  EXPECT_NE(server_, nullptr);
}

FakeGrpcServer::~FakeGrpcServer() {
  if (server_ != nullptr) server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
}

v1::DumpBlockTraceResponse SampleTrace() {
  v1::DumpBlockTraceResponse trace;
  const auto add = [&](uint64_t seq, int64_t t, int32_t block, const char* op, uint32_t refs,
                       uint32_t gen, uint64_t session, uint64_t sequence) {
    v1::TraceEntry* e = trace.add_entries();
    e->set_op_seq(seq);
    e->set_time_ns(t);
    e->set_block_id(block);
    e->set_op(op);
    e->set_refs_after(refs);
    e->set_generation(gen);
    e->set_session_id(session);
    e->set_sequence_id(sequence);
    e->set_site("block_pool.cc:120 (Allocate)");
  };
  add(1, 1'000'000, 3, "alloc", 1, 1, 42, 100);
  add(2, 1'500'000, 5, "alloc", 1, 1, 42, 100);
  add(3, 2'000'000, 3, "free", 0, 1, 42, 100);
  add(4, 3'000'000, 3, "alloc", 1, 2, 43, 101);
  add(5, 4'000'000, 3, "retain", 2, 2, 43, 102);
  return trace;
}

}  // namespace kvpool::client::testing
