#pragma once

// Client: one session with kvpoold (DESIGN.md §7, §8), the C++ client library's entry point.
//
// Connect() attaches over <runtime_dir>/attach.sock, maps the pool (PoolMapping) and opens the
// gRPC channel to <runtime_dir>/kvpoold.sock. Every call below carries the session token and a
// deadline of ConnectOptions::timeout, and returns the daemon's status with its code and message
// unchanged (see client/status.h; RESOURCE_EXHAUSTED carries the shortfall, read it with
// GetShortfall()). A failed call changes nothing in the daemon; batched calls are all-or-nothing.
// Error codes of the calls: those of kvpool.proto (RESOURCE_EXHAUSTED, NOT_FOUND,
// PERMISSION_DENIED, INVALID_ARGUMENT, UNAUTHENTICATED, UNAVAILABLE, FAILED_PRECONDITION,
// INTERNAL), plus DEADLINE_EXCEEDED when the daemon does not answer in time, UNAVAILABLE when the
// gRPC socket cannot be reached, and INTERNAL when a response is malformed.
//
// The session lives as long as the Client: destroying it closes the attach connection, and the
// daemon then releases every sequence and reference the session holds.
//
// fork: the session belongs to the process that connected. A forked child holds no copy of the
// attach socket (a pthread_atfork handler closes it, client/internal/fork.h), so the parent's
// death, even by SIGKILL, ends the session while the child lives on. The child must make no call
// (gRPC, and the CUDA driver, cannot be used after fork); destroying the Client there sends no
// Detach and ends nothing of the parent's: it unmaps the child's own copies of a memfd pool and
// of the doorbell, and leaks the stub and a CUDA mapping rather than call their drivers, and the
// objects holding an absl::Mutex rather than destroy it (another thread of the parent may have
// held absl's deadlock-detection lock at fork(); nothing in the child would release it).
//
// Thread-safety: every method may be called concurrently from any number of threads (the channel
// and stub are thread-safe, the rest is immutable after Connect()).
// Ownership: Connect() returns the sole owner. mapping() and layout() stay valid for the Client's
// life; the caller must not destroy the Client while calls are in flight on other threads.

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/block_ref.h"
#include "client/pool_mapping.h"
#include "client/status.h"
#include "kvpool/util/unique_fd.h"
#include "kvpool/v1/kvpool.grpc.pb.h"

namespace kvpool::client {
namespace internal {
class ClientDoorbell;
}

struct ConnectOptions {
  std::string runtime_dir;  // where kvpoold's sockets are; empty: wire::DefaultRuntimeDir()
  std::string client_name;  // shown to operators (kvpoolctl sessions); empty: the program's name
  std::string tenant = "default";  // with `model` and the layout: the prefix-sharing namespace
  std::string model = "default";
  absl::Duration timeout = absl::Seconds(10);  // the attach's and every call's deadline
  // Ask for KV access: the pool mapped read-write (mapping()), and Allocate / Grow / Commit.
  // Refused at attach (PERMISSION_DENIED) unless the tenant grants it. Without it the session is
  // compute-only: it uses the daemon's model and receives no descriptor (docs/trust-model.md).
  bool kv_access = false;
  // Uids the daemon may run as, beyond root, this process's own, and the owner of a runtime
  // directory that only root could have placed (systemd's /run/kvpool). The directory and the
  // attach socket's peer (SO_PEERCRED) are checked before anything is sent (docs/trust-model.md).
  std::vector<uid_t> trusted_daemon_uids;
  // Ask for a decode doorbell (kvpool/v1/doorbell.h): Decode then goes through shared memory
  // instead of a gRPC round trip, when the daemon runs a model. It costs the daemon a thread for
  // the session's life.
  bool decode_doorbell = true;
};

// One sequence to allocate.
struct AllocateItem {
  std::span<const int32_t> prompt;  // matched against the prefix cache; must outlive the call
  int64_t num_tokens = 0;           // tokens to make room for; 0: prompt.size()
  int32_t priority = 0;             // prefix-cache class [0, 4) of the sequence's blocks
};

// One sequence to grow.
struct GrowItem {
  uint64_t sequence_id = 0;
  int64_t num_tokens = 0;  // the new length; <= the current length is a no-op
};

// One sequence's decode step.
struct DecodeItem {
  uint64_t sequence_id = 0;
  int32_t token = 0;  // its pending token (the one the previous Prefill or Decode returned)
};

class Client final {
 public:
  // Attaches to kvpoold and maps its pool.
  // Errors: UNAVAILABLE (no daemon listens in the runtime directory; the message names the
  // socket it tried), PERMISSION_DENIED (socket not accessible, or the daemon refused this peer),
  // DEADLINE_EXCEEDED (no answer within options.timeout), INVALID_ARGUMENT (timeout <= 0,
  // malformed answer or pool description), another code when the daemon refuses with it, and
  // PoolMapping::Create's errors. Nothing is held after an error.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const ConnectOptions& options);

  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;
  // Unmaps the pool and the doorbell, then says goodbye (a Detach frame) and closes the attach
  // socket: the session ends, counted as ended normally. A process that dies without it is
  // reclaimed all the same.
  // In a process other than the one that connected (a fork) it ends nothing: see "fork" above.
  ~Client();

  uint64_t session_id() const { return attach_.session_id(); }
  uint64_t namespace_id() const { return attach_.namespace_id(); }
  uint64_t epoch() const { return attach_.epoch(); }  // the daemon's start (changes on restart)
  bool admin() const { return attach_.admin(); }      // may call the admin RPCs
  const std::string& daemon_version() const { return attach_.daemon_version(); }
  // The daemon's model: empty name when it runs none (the compute calls then fail).
  const std::string& model_name() const { return attach_.model_name(); }
  int32_t model_vocab_size() const { return attach_.model_vocab_size(); }
  int32_t model_max_position() const { return attach_.model_max_position(); }
  const std::string& runtime_dir() const { return runtime_dir_; }
  absl::Duration timeout() const { return timeout_; }
  const v1::PoolLayout& layout() const { return attach_.layout(); }
  const std::string& pool() const { return attach_.pool(); }
  bool kv_access() const { return mapping_ != nullptr; }
  bool decode_doorbell() const { return doorbell_ != nullptr; }  // the daemon granted one
  // The pool's mapping; null for a compute-only session.
  const PoolMapping* mapping() const { return mapping_.get(); }

  // --- Control ---
  // One sequence per item, all or none; full block tables in item order.
  absl::StatusOr<std::vector<v1::SequenceInfo>> Allocate(
      const std::vector<AllocateItem>& items) const;
  absl::StatusOr<v1::SequenceInfo> Allocate(std::span<const int32_t> prompt, int64_t num_tokens = 0,
                                            int32_t priority = 0) const;
  // The changed tail of each table, in item order (apply with ApplyGrow()).
  absl::StatusOr<std::vector<v1::SequenceInfo>> Grow(const std::vector<GrowItem>& items) const;
  absl::StatusOr<v1::SequenceInfo> Grow(uint64_t sequence_id, int64_t num_tokens) const;
  // The same for sequences the caller holds (a decode step's batch): grows held[i] to
  // num_tokens[i] and applies the reply to its tables in place (ApplyGrowResponse), without a
  // message per item. Errors: INVALID_ARGUMENT when the spans differ in length (nothing sent),
  // the daemon's, INTERNAL for a malformed reply, FAILED_PRECONDITION when a held table is not
  // the one the daemon extended; after a reply's error the sequences have grown but nothing
  // held changed.
  absl::Status Grow(std::span<HeldSequence> held, std::span<const int64_t> num_tokens) const;
  absl::Status Truncate(uint64_t sequence_id, int64_t num_tokens) const;
  // The child sequence, full table (sharing the parent's blocks copy-on-write).
  absl::StatusOr<v1::SequenceInfo> Fork(uint64_t sequence_id) const;
  // Publishes tokens [0, num_tokens) of the sequence into the prefix cache; `new_tokens` are the
  // tokens past the prompt that the daemon has not seen yet.
  absl::Status Commit(uint64_t sequence_id, int64_t num_tokens,
                      std::span<const int32_t> new_tokens = {}) const;
  // `commit`: publish each sequence's known tokens first.
  absl::Status Free(const std::vector<uint64_t>& sequence_ids, bool commit = false) const;
  // Leading tokens of `tokens` cached in this session's namespace (lookup only).
  absl::StatusOr<int64_t> MatchPrefix(std::span<const int32_t> tokens) const;
  // Retention pins (kvpool.proto PinRequest): keep the cached prefix `tokens` of this session's
  // namespace, or what `sequence_id` has published, from eviction for `ttl`, at `priority` (at
  // most the tenant's ceiling). The pin ends by itself, with Unpin, or when the session ends.
  absl::StatusOr<v1::PinInfo> PinPrefix(std::span<const int32_t> tokens, absl::Duration ttl,
                                        int32_t priority = 0) const;
  absl::StatusOr<v1::PinInfo> PinSequence(uint64_t sequence_id, absl::Duration ttl,
                                          int32_t priority = 0) const;
  // The pin now ends `ttl` from now.
  absl::StatusOr<v1::PinInfo> RenewPin(uint64_t pin_id, absl::Duration ttl) const;
  absl::Status Unpin(uint64_t pin_id) const;
  // This session's pins; with `all_sessions`, everyone's (admin sessions only).
  absl::StatusOr<std::vector<v1::PinInfo>> ListPins(bool all_sessions = false) const;
  absl::Status Ping() const;

  // --- Compute: the daemon's model (FAILED_PRECONDITION when it runs none) ---
  // sequence_id 0: a new sequence, its prompt matched against the prefix cache; otherwise
  // `tokens` extend that sequence.
  absl::StatusOr<v1::PrefillResponse> Prefill(uint64_t sequence_id, std::span<const int32_t> tokens,
                                              int32_t top_k = 0, int32_t priority = 0) const;
  // Any PrefillRequest (sampling, log-probabilities, a cache salt).
  absl::StatusOr<v1::PrefillResponse> Prefill(const v1::PrefillRequest& request) const;
  // One step for every item (all or none). Through the decode doorbell when the session has one
  // and it is free, top_k is 0 and there are at most wire::kDoorbellMaxItems items; over gRPC
  // otherwise. Either way the same checks, step and answer.
  absl::StatusOr<v1::DecodeResponse> Decode(std::span<const DecodeItem> items,
                                            int32_t top_k = 0) const;
  // Any DecodeRequest (sampling, log-probabilities), over gRPC.
  absl::StatusOr<v1::DecodeResponse> Decode(const v1::DecodeRequest& request) const;
  // Streams generated tokens to `on_token` until the daemon ends the stream (OK) or the callback
  // returns false (the call is cancelled; OK). No deadline. Errors: the stream's status.
  absl::Status Generate(const v1::GenerateRequest& request,
                        absl::FunctionRef<bool(const v1::GenerateResponse&)> on_token) const;

  // --- Admin (PERMISSION_DENIED unless admin()) ---
  // `pool`: the pool asked about (empty: this session's; every pool for ListSequences).
  // NOT_FOUND for an unknown pool.
  absl::StatusOr<v1::GetStatsResponse> GetStats(std::string_view pool = {}) const;
  absl::StatusOr<v1::ListSessionsResponse> ListSessions() const;
  // session_id 0: every session's sequences.
  absl::StatusOr<v1::ListSequencesResponse> ListSequences(uint64_t session_id = 0,
                                                          std::string_view pool = {}) const;
  absl::StatusOr<v1::DumpBlockTraceResponse> DumpBlockTrace(int32_t block_id,
                                                            std::string_view pool = {}) const;
  absl::StatusOr<v1::DumpBlockTraceResponse> DumpAllBlockTraces(std::string_view pool = {}) const;
  // Streams cache events, calling `on_response` for each message until the stream ends, the
  // callback returns false, or CancelWatches() runs; each of those returns OK. Without
  // request.follow() the call has the usual deadline; with it, none. Errors: the stream's status.
  absl::Status WatchEvents(
      const v1::WatchEventsRequest& request,
      absl::FunctionRef<bool(const v1::WatchEventsResponse&)> on_response) const;
  // Ends every WatchEvents call in flight (from any thread).
  void CancelWatches() const;
  // namespace_id 0: this session's namespace.
  absl::StatusOr<v1::ExplainMatchResponse> ExplainMatch(std::span<const int32_t> tokens,
                                                        uint64_t namespace_id = 0,
                                                        std::string_view pool = {}) const;
  // Evicts up to `blocks` unused cached blocks; returns how many were evicted.
  absl::StatusOr<int64_t> Evict(int64_t blocks, std::string_view pool = {}) const;
  // Empties the prefix cache. FAILED_PRECONDITION while cached blocks are in use.
  absl::StatusOr<int64_t> EvictAll(std::string_view pool = {}) const;
  // Drops every tier's blocks of `tenant`'s namespaces (of its model `model` only, unless
  // empty). Admin only.
  absl::StatusOr<v1::InvalidateResponse> Invalidate(std::string_view tenant,
                                                    std::string_view model = {}) const;
  absl::StatusOr<v1::CheckInvariantsResponse> CheckInvariants() const;
  absl::Status SetLogLevel(std::string_view level) const;
  // Stops the daemon taking new sequences; returns how many are still live.
  absl::StatusOr<int64_t> Drain() const;

  // For callers that drive the stub themselves (async calls, benchmarks): the stub, and a
  // context set up as every call above sets it up (session token; deadline when `deadline`).
  v1::KvPool::StubInterface& stub() const { return *stub_; }
  void PrepareContext(grpc::ClientContext* context, bool deadline = true) const;

 private:
  Client(std::string runtime_dir, absl::Duration timeout, UniqueFd attach_socket,
         v1::AttachResponse attach, std::unique_ptr<PoolMapping> mapping,
         std::unique_ptr<internal::ClientDoorbell> doorbell,
         std::unique_ptr<v1::KvPool::StubInterface> stub);

  template <typename Request, typename Response>
  absl::Status Unary(grpc::Status (v1::KvPool::StubInterface::*method)(grpc::ClientContext*,
                                                                       const Request&, Response*),
                     const Request& request, Response* response) const;

  // ~Client in a process other than owner_pid_ (a forked child): no Detach; frees only what
  // needs no driver (the child's own memfd pages and doorbell page), leaks the rest.
  void LeaveSessionToOwner();

  const std::string runtime_dir_;
  const absl::Duration timeout_;
  const pid_t owner_pid_;  // the process that connected: only it may end the session
  // The session ends with the Detach frame ~Client sends on it, or with its close. ~Client drops
  // mapping_ and doorbell_ before it sends Detach, and the socket, declared before them, closes
  // after them: the session ends only once this process can no longer touch the pool.
  UniqueFd attach_socket_;
  const int fork_slot_;  // internal::RegisterAttachSocket's slot of attach_socket_ (-1: none)
  const v1::AttachResponse attach_;                     // layout, token, ids; no descriptors
  std::unique_ptr<PoolMapping> mapping_;                // null: compute-only (or ~Client began)
  std::unique_ptr<internal::ClientDoorbell> doorbell_;  // null: none granted (or ~Client began)
  std::unique_ptr<v1::KvPool::StubInterface> stub_;     // leaked, not destroyed, in a forked child

  // WatchEvents calls in flight; CancelWatches() cancels and removes them. Behind a pointer so
  // that a forked child leaks it rather than destroy its Mutex (see "fork" above).
  struct Watches {
    absl::Mutex mu;
    absl::flat_hash_set<grpc::ClientContext*> calls ABSL_GUARDED_BY(mu);
  };
  std::unique_ptr<Watches> watches_ = std::make_unique<Watches>();
};

}  // namespace kvpool::client
