#pragma once

// Test doubles for the daemon side of kvpool's client contract, so the client library is tested
// without kvpoold: a memfd pool, an attach server (one connection, in a thread) and a scripted
// gRPC KvPool service on a Unix socket in a private temporary directory.
//
// Thread-safety: FakeKvPoolService's recorded fields are guarded; the rest is driven by one test
// thread.

#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "grpcpp/server.h"
#include "kvpool/util/unique_fd.h"
#include "kvpool/v1/attach.pb.h"
#include "kvpool/v1/kvpool.grpc.pb.h"

namespace kvpool::client::testing {

// A private directory under /tmp, removed with everything in it on destruction.
class TempDir final {
 public:
  TempDir();
  ~TempDir();
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// block_size 4, 2 layers, 2 kv heads x 8, f32, 16 blocks: chunk 256 B, block 1 KiB.
v1::PoolLayout SmallLayout();

// A pool as the daemon holds it: the arena and generation-table memfds, mapped read-write.
class FakePool final {
 public:
  explicit FakePool(const v1::PoolLayout& layout);
  ~FakePool();

  const v1::PoolLayout& layout() const { return layout_; }
  // The blocks, then the window blocks and the state slots if the layout has them.
  int64_t arena_bytes() const {
    if (layout_.num_state_slots() > 0) {
      return layout_.state_offset() +
             int64_t{layout_.num_state_slots()} * layout_.state_slot_bytes();
    }
    if (layout_.num_window_layers() > 0) {
      return layout_.window_offset() +
             int64_t{layout_.num_window_blocks()} * layout_.window_block_bytes();
    }
    return int64_t{layout_.num_blocks()} * layout_.block_bytes();
  }
  char* arena() const { return arena_; }
  uint32_t* generations() const { return generations_; }
  int arena_fd() const { return arena_fd_.get(); }
  int generation_fd() const { return generation_fd_.get(); }
  // Fresh duplicates for a PoolMapping to own.
  std::vector<UniqueFd> DupFds() const;
  // An accepted attach response describing this pool (fds: arena, generation table).
  v1::AttachResponse Response() const;

 private:
  v1::PoolLayout layout_;
  UniqueFd arena_fd_;
  UniqueFd generation_fd_;
  char* arena_ = nullptr;
  uint32_t* generations_ = nullptr;
};

// Serves one attach connection on <dir>/attach.sock from a thread.
class FakeAttachServer final {
 public:
  enum class Mode {
    kAccept,  // answer with the pool's descriptors, then wait for the client to hang up
    kRefuse,  // answer with `refuse_code` / `refuse_reason`, then close
    kHangUp,  // close without answering
    kSilent,  // never answer (until destroyed)
  };
  struct Options {
    Mode mode = Mode::kAccept;
    int32_t refuse_code = 7;  // PERMISSION_DENIED
    std::string refuse_reason = "uid 1000 is not in the allow-list";
    bool swap_fd_order = false;  // send the generation table first
  };

  FakeAttachServer(const std::string& dir, const FakePool* pool, Options options);
  ~FakeAttachServer();  // unblocks and joins the thread

  // The request the client sent (empty until it arrived).
  v1::AttachRequest request() const;
  // True once the client closed its end after an accepted attach.
  bool WaitForClientClose(absl::Duration limit);
  // Bytes the client sent after an accepted attach (a Detach frame is 4); final once
  // WaitForClientClose returned true.
  int64_t bytes_after_attach() const;

 private:
  void Serve();

  const FakePool* const pool_;
  const Options options_;
  UniqueFd listener_;
  mutable absl::Mutex mu_;
  v1::AttachRequest request_ ABSL_GUARDED_BY(mu_);
  int connection_ ABSL_GUARDED_BY(mu_) = -1;
  int64_t bytes_after_attach_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::Notification client_closed_;
  absl::Notification release_;
  std::thread thread_;
};

// A scripted KvPool service. Records the session token of every call.
class FakeKvPoolService final : public v1::KvPool::Service {
 public:
  grpc::Status Ping(grpc::ServerContext* context, const v1::PingRequest* request,
                    v1::PingResponse* response) override;
  grpc::Status Allocate(grpc::ServerContext* context, const v1::AllocateRequest* request,
                        v1::AllocateResponse* response) override;
  // Always RESOURCE_EXHAUSTED with "kvpool-shortfall: pool:3".
  grpc::Status Grow(grpc::ServerContext* context, const v1::GrowRequest* request,
                    v1::GrowResponse* response) override;
  grpc::Status Fork(grpc::ServerContext* context, const v1::ForkRequest* request,
                    v1::ForkResponse* response) override;
  grpc::Status Free(grpc::ServerContext* context, const v1::FreeRequest* request,
                    v1::FreeResponse* response) override;
  grpc::Status GetStats(grpc::ServerContext* context, const v1::GetStatsRequest* request,
                        v1::GetStatsResponse* response) override;
  grpc::Status ListSessions(grpc::ServerContext* context, const v1::ListSessionsRequest* request,
                            v1::ListSessionsResponse* response) override;
  grpc::Status ListSequences(grpc::ServerContext* context, const v1::ListSequencesRequest* request,
                             v1::ListSequencesResponse* response) override;
  grpc::Status DumpBlockTrace(grpc::ServerContext* context,
                              const v1::DumpBlockTraceRequest* request,
                              v1::DumpBlockTraceResponse* response) override;
  // Without follow: three messages (a snapshot, then two with one event each). With follow: one
  // message, then holds the stream open until the client cancels.
  grpc::Status WatchEvents(grpc::ServerContext* context, const v1::WatchEventsRequest* request,
                           grpc::ServerWriter<v1::WatchEventsResponse>* writer) override;
  grpc::Status ExplainMatch(grpc::ServerContext* context, const v1::ExplainMatchRequest* request,
                            v1::ExplainMatchResponse* response) override;
  grpc::Status Evict(grpc::ServerContext* context, const v1::EvictRequest* request,
                     v1::EvictResponse* response) override;
  // Reports a violation.
  grpc::Status CheckInvariants(grpc::ServerContext* context,
                               const v1::CheckInvariantsRequest* request,
                               v1::CheckInvariantsResponse* response) override;
  grpc::Status SetLogLevel(grpc::ServerContext* context, const v1::SetLogLevelRequest* request,
                           v1::SetLogLevelResponse* response) override;
  grpc::Status Drain(grpc::ServerContext* context, const v1::DrainRequest* request,
                     v1::DrainResponse* response) override;

  // Every admin call answers PERMISSION_DENIED.
  void set_deny_admin(bool deny) ABSL_LOCKS_EXCLUDED(mu_);
  // Allocate answers a table whose parallel arrays disagree.
  void set_malformed(bool malformed) ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<std::string> tokens() const ABSL_LOCKS_EXCLUDED(mu_);
  std::string log_level() const ABSL_LOCKS_EXCLUDED(mu_);
  // Blocks until a followed WatchEvents stream has sent its first message.
  void WaitForFollower() { follower_started_.WaitForNotification(); }

 private:
  grpc::Status Record(grpc::ServerContext* context, bool admin) ABSL_LOCKS_EXCLUDED(mu_);

  mutable absl::Mutex mu_;
  std::vector<std::string> tokens_ ABSL_GUARDED_BY(mu_);
  std::string log_level_ ABSL_GUARDED_BY(mu_);
  bool deny_admin_ ABSL_GUARDED_BY(mu_) = false;
  bool malformed_ ABSL_GUARDED_BY(mu_) = false;
  absl::Notification follower_started_;
};

// The fake service served on unix:<dir>/kvpoold.sock.
class FakeGrpcServer final {
 public:
  explicit FakeGrpcServer(const std::string& dir);
  ~FakeGrpcServer();
  FakeKvPoolService& service() { return service_; }

 private:
  FakeKvPoolService service_;
  std::unique_ptr<grpc::Server> server_;
};

// The trace the fake returns for DumpBlockTrace --all: blocks 3 and 5, two generations of 3.
v1::DumpBlockTraceResponse SampleTrace();

}  // namespace kvpool::client::testing
