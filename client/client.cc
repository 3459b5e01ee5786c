#include "client/client.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>  // program_invocation_short_name
#include <optional>
#include <utility>

#include "client/internal/attach.h"
#include "client/internal/doorbell.h"
#include "client/internal/fork.h"
#include "fmt/format.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "kvpool/util/status_macros.h"
#include "kvpool/v1/wire.h"

namespace kvpool::client {
namespace {

absl::Status Malformed(std::string_view rpc, std::string_view what) {
  return absl::InternalError(fmt::format("malformed {} response from kvpoold: {}", rpc, what));
}

// Checks that a response lists `want` sequences, each well-formed.
absl::Status CheckSequences(std::string_view rpc,
                            const google::protobuf::RepeatedPtrField<v1::SequenceInfo>& sequences,
                            size_t want) {
  if (static_cast<size_t>(sequences.size()) != want) {
    return Malformed(rpc, fmt::format("{} sequences for {} items", sequences.size(), want));
  }
  for (const v1::SequenceInfo& info : sequences) {
    if (absl::Status s = ValidateSequenceInfo(info); !s.ok()) {
      return Malformed(rpc, std::string(s.message()));
    }
  }
  return absl::OkStatus();
}

// Takes the doorbell's descriptor out of `attachment` (and its role out of the response's list)
// and maps it; null when the daemon granted none.
absl::StatusOr<std::unique_ptr<internal::ClientDoorbell>> TakeDoorbell(
    internal::Attachment* attachment) {
  v1::AttachResponse& r = attachment->response;
  const auto role = std::find(r.fds().begin(), r.fds().end(), v1::FD_ROLE_DOORBELL);
  const bool sent = role != r.fds().end();
  if (sent != r.decode_doorbell()) {
    return absl::InvalidArgumentError(
        "kvpoold's attach response and its descriptors disagree about the decode doorbell");
  }
  if (!sent) return nullptr;
  const auto index = static_cast<size_t>(role - r.fds().begin());
  if (index >= attachment->fds.size()) {
    return absl::InvalidArgumentError(
        fmt::format("the attach response lists {} descriptors but {} arrived", r.fds_size(),
                    attachment->fds.size()));
  }
  UniqueFd fd = std::move(attachment->fds[index]);
  attachment->fds.erase(attachment->fds.begin() + static_cast<std::ptrdiff_t>(index));
  r.mutable_fds()->erase(r.mutable_fds()->begin() + static_cast<int>(index));
  return internal::ClientDoorbell::Map(std::move(fd));
}

}  // namespace

Client::Client(std::string runtime_dir, absl::Duration timeout, UniqueFd attach_socket,
               v1::AttachResponse attach, std::unique_ptr<PoolMapping> mapping,
               std::unique_ptr<internal::ClientDoorbell> doorbell,
               std::unique_ptr<v1::KvPool::StubInterface> stub)
    : runtime_dir_(std::move(runtime_dir)),
      timeout_(timeout),
      owner_pid_(getpid()),
      attach_socket_(std::move(attach_socket)),
      fork_slot_(internal::RegisterAttachSocket(attach_socket_.get())),
      attach_(std::move(attach)),
      mapping_(std::move(mapping)),
      doorbell_(std::move(doorbell)),
      stub_(std::move(stub)) {}

Client::~Client() {
  if (getpid() != owner_pid_) {
    LeaveSessionToOwner();
    return;
  }
  // The pool and the doorbell go first: the daemon ends the session on Detach at once and may
  // hand its blocks to another tenant, so by then this process must not map them.
  doorbell_.reset();
  mapping_.reset();
  // Best effort: when the goodbye cannot be sent (the daemon is gone), the close that follows
  // ends the session all the same; it is then counted as reclaimed rather than detached.
  if (attach_socket_.valid()) {
    wire::SendFrame(attach_socket_.get(), v1::Detach()).IgnoreError();
  }
  // Unregistered before attach_socket_ closes (fork.h); always true in the owner.
  internal::UnregisterAttachSocket(fork_slot_);
}

void Client::LeaveSessionToOwner() {
  // A Detach frame from here would end the owner's session while it still maps the pool.
  // Nothing here may lock or destroy an absl::Mutex: another thread of the parent may have held
  // absl's global deadlock-detection lock at fork(), and no thread of the child will release it.
  internal::ClientDoorbell::UnmapInForkedChild(std::move(doorbell_));  // this process's copy
  (void)watches_.release();
  if (mapping_ != nullptr && !mapping_->host_accessible()) {
    (void)mapping_.release();  // the CUDA driver cannot be used after fork: leaked, not freed
  }
  mapping_.reset();       // this process's copy of a memfd pool
  (void)stub_.release();  // gRPC cannot be used after fork: its shutdown would wait forever
  if (!internal::UnregisterAttachSocket(fork_slot_)) {
    (void)attach_socket_.release();  // the fork handler closed it; the number may name another file
  }
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const ConnectOptions& options) {
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("ConnectOptions::timeout must be positive");
  }
  std::string dir = options.runtime_dir.empty() ? wire::DefaultRuntimeDir() : options.runtime_dir;
  v1::AttachRequest request;
  request.set_protocol_version(wire::kProtocolVersion);
  request.set_client_name(options.client_name.empty() ? program_invocation_short_name
                                                      : options.client_name);
  request.set_tenant(options.tenant);
  request.set_model(options.model);
  request.set_kv_access(options.kv_access);
  request.set_decode_doorbell(options.decode_doorbell);
  KVPOOL_ASSIGN_OR_RETURN(
      internal::Attachment attachment,
      internal::Attach(dir, request, options.timeout, options.trusted_daemon_uids));
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<internal::ClientDoorbell> doorbell,
                          TakeDoorbell(&attachment));
  std::unique_ptr<PoolMapping> mapping;
  if (attachment.response.kv_access()) {
    KVPOOL_ASSIGN_OR_RETURN(mapping,
                            PoolMapping::Create(attachment.response, std::move(attachment.fds)));
  } else if (!attachment.fds.empty()) {
    return absl::InvalidArgumentError(
        "kvpoold sent descriptors to a session it says is compute-only");
  }

  grpc::ChannelArguments args;
  // Whole-pool traces and sequence listings outgrow gRPC's 4 MiB default.
  args.SetMaxReceiveMessageSize(-1);
  // Channels connect lazily: a daemon that is attached-to but not yet serving gRPC is fine here.
  std::shared_ptr<grpc::Channel> channel = grpc::CreateCustomChannel(
      fmt::format("unix:{}/{}", dir, wire::kGrpcSocket), grpc::InsecureChannelCredentials(), args);
  std::unique_ptr<v1::KvPool::StubInterface> stub = v1::KvPool::NewStub(channel);

  v1::AttachResponse attach = std::move(attachment.response);
  attach.clear_fds();
  return std::unique_ptr<Client>(
      new Client(std::move(dir), options.timeout, std::move(attachment.socket), std::move(attach),
                 std::move(mapping), std::move(doorbell), std::move(stub)));
}

void Client::PrepareContext(grpc::ClientContext* context, bool deadline) const {
  context->AddMetadata(wire::kSessionTokenKey, attach_.session_token());
  if (deadline) context->set_deadline(absl::ToChronoTime(absl::Now() + timeout_));
}

template <typename Request, typename Response>
absl::Status Client::Unary(grpc::Status (v1::KvPool::StubInterface::*method)(grpc::ClientContext*,
                                                                             const Request&,
                                                                             Response*),
                           const Request& request, Response* response) const {
  grpc::ClientContext context;
  PrepareContext(&context);
  const grpc::Status status = (stub_.get()->*method)(&context, request, response);
  return FromGrpcStatus(status, context.GetServerTrailingMetadata());
}

absl::StatusOr<std::vector<v1::SequenceInfo>> Client::Allocate(
    const std::vector<AllocateItem>& items) const {
  v1::AllocateRequest request;
  for (const AllocateItem& item : items) {
    v1::AllocateItem* out = request.add_items();
    out->mutable_prompt()->Add(item.prompt.begin(), item.prompt.end());
    out->set_num_tokens(item.num_tokens != 0 ? item.num_tokens
                                             : static_cast<int64_t>(item.prompt.size()));
    out->set_priority(item.priority);
  }
  v1::AllocateResponse response;
  KVPOOL_RETURN_IF_ERROR(Unary(&v1::KvPool::StubInterface::Allocate, request, &response));
  KVPOOL_RETURN_IF_ERROR(CheckSequences("Allocate", response.sequences(), items.size()));
  return std::vector<v1::SequenceInfo>(
      std::make_move_iterator(response.mutable_sequences()->begin()),
      std::make_move_iterator(response.mutable_sequences()->end()));
}

absl::StatusOr<v1::SequenceInfo> Client::Allocate(std::span<const int32_t> prompt,
                                                  int64_t num_tokens, int32_t priority) const {
  KVPOOL_ASSIGN_OR_RETURN(std::vector<v1::SequenceInfo> sequences,
                          Allocate({AllocateItem{prompt, num_tokens, priority}}));
  return std::move(sequences.front());
}

absl::StatusOr<std::vector<v1::SequenceInfo>> Client::Grow(
    const std::vector<GrowItem>& items) const {
  v1::GrowRequest request;
  request.mutable_sequence_ids()->Reserve(static_cast<int>(items.size()));
  request.mutable_num_tokens()->Reserve(static_cast<int>(items.size()));
  for (const GrowItem& item : items) {
    request.add_sequence_ids(item.sequence_id);
    request.add_num_tokens(item.num_tokens);
  }
  v1::GrowResponse response;
  KVPOOL_RETURN_IF_ERROR(Unary(&v1::KvPool::StubInterface::Grow, request, &response));
  // The response is parallel arrays plus the concatenated tails: check the shape, then split.
  absl::StatusOr<std::vector<v1::SequenceInfo>> out = SplitGrowResponse(
      response, {request.sequence_ids().data(), static_cast<size_t>(request.sequence_ids_size())});
  if (!out.ok()) return Malformed("Grow", std::string(out.status().message()));
  return out;
}

absl::Status Client::Grow(std::span<HeldSequence> held, std::span<const int64_t> num_tokens) const {
  if (held.size() != num_tokens.size()) {
    return absl::InvalidArgumentError(
        fmt::format("Grow: {} held sequences but {} lengths", held.size(), num_tokens.size()));
  }
  v1::GrowRequest request;
  request.mutable_sequence_ids()->Reserve(static_cast<int>(held.size()));
  for (const HeldSequence& h : held) request.add_sequence_ids(h.sequence_id);
  request.mutable_num_tokens()->Add(num_tokens.begin(), num_tokens.end());
  v1::GrowResponse response;
  KVPOOL_RETURN_IF_ERROR(Unary(&v1::KvPool::StubInterface::Grow, request, &response));
  absl::Status applied = ApplyGrowResponse(response, held);
  if (absl::IsInvalidArgument(applied)) return Malformed("Grow", std::string(applied.message()));
  return applied;
}

absl::StatusOr<v1::SequenceInfo> Client::Grow(uint64_t sequence_id, int64_t num_tokens) const {
  KVPOOL_ASSIGN_OR_RETURN(std::vector<v1::SequenceInfo> sequences,
                          Grow({GrowItem{sequence_id, num_tokens}}));
  return std::move(sequences.front());
}

absl::Status Client::Truncate(uint64_t sequence_id, int64_t num_tokens) const {
  v1::TruncateRequest request;
  request.set_sequence_id(sequence_id);
  request.set_num_tokens(num_tokens);
  v1::TruncateResponse response;
  return Unary(&v1::KvPool::StubInterface::Truncate, request, &response);
}

absl::StatusOr<v1::SequenceInfo> Client::Fork(uint64_t sequence_id) const {
  v1::ForkRequest request;
  request.set_sequence_id(sequence_id);
  v1::ForkResponse response;
  KVPOOL_RETURN_IF_ERROR(Unary(&v1::KvPool::StubInterface::Fork, request, &response));
  if (absl::Status s = ValidateSequenceInfo(response.sequence()); !s.ok()) {
    return Malformed("Fork", std::string(s.message()));
  }
  return std::move(*response.mutable_sequence());
}

absl::Status Client::Commit(uint64_t sequence_id, int64_t num_tokens,
                            std::span<const int32_t> new_tokens) const {
  v1::CommitRequest request;
  request.set_sequence_id(sequence_id);
  request.set_num_tokens(num_tokens);
  request.mutable_new_tokens()->Add(new_tokens.begin(), new_tokens.end());
  v1::CommitResponse response;
  return Unary(&v1::KvPool::StubInterface::Commit, request, &response);
}

absl::Status Client::Free(const std::vector<uint64_t>& sequence_ids, bool commit) const {
  v1::FreeRequest request;
  request.mutable_sequence_ids()->Add(sequence_ids.begin(), sequence_ids.end());
  request.set_commit(commit);
  v1::FreeResponse response;
  return Unary(&v1::KvPool::StubInterface::Free, request, &response);
}

absl::StatusOr<int64_t> Client::MatchPrefix(std::span<const int32_t> tokens) const {
  v1::MatchPrefixRequest request;
  request.mutable_tokens()->Add(tokens.begin(), tokens.end());
  v1::MatchPrefixResponse response;
  KVPOOL_RETURN_IF_ERROR(Unary(&v1::KvPool::StubInterface::MatchPrefix, request, &response));
  return response.matched_tokens();
}

absl::StatusOr<v1::PinInfo> Client::PinPrefix(std::span<const int32_t> tokens, absl::Duration ttl,
                                              int32_t priority) const {
  v1::PinRequest request;
  request.mutable_tokens()->Add(tokens.begin(), tokens.end());
  request.set_ttl_ms(absl::ToInt64Milliseconds(ttl));
  request.set_priority(priority);
  v1::PinResponse response;
  KVPOOL_RETURN_IF_ERROR(Unary(&v1::KvPool::StubInterface::Pin, request, &response));
  return response.pin();
}

absl::StatusOr<v1::PinInfo> Client::PinSequence(uint64_t sequence_id, absl::Duration ttl,
                                                int32_t priority) const {
  v1::PinRequest request;
  request.set_sequence_id(sequence_id);
  request.set_ttl_ms(absl::ToInt64Milliseconds(ttl));
  request.set_priority(priority);
  v1::PinResponse response;
  KVPOOL_RETURN_IF_ERROR(Unary(&v1::KvPool::StubInterface::Pin, request, &response));
  return response.pin();
}

absl::StatusOr<v1::PinInfo> Client::RenewPin(uint64_t pin_id, absl::Duration ttl) const {
  v1::RenewPinRequest request;
  request.set_pin_id(pin_id);
  request.set_ttl_ms(absl::ToInt64Milliseconds(ttl));
  v1::RenewPinResponse response;
  KVPOOL_RETURN_IF_ERROR(Unary(&v1::KvPool::StubInterface::RenewPin, request, &response));
  return response.pin();
}

absl::Status Client::Unpin(uint64_t pin_id) const {
  v1::UnpinRequest request;
  request.set_pin_id(pin_id);
  v1::UnpinResponse response;
  return Unary(&v1::KvPool::StubInterface::Unpin, request, &response);
}

absl::StatusOr<std::vector<v1::PinInfo>> Client::ListPins(bool all_sessions) const {
  v1::ListPinsRequest request;
  request.set_all_sessions(all_sessions);
  v1::ListPinsResponse response;
  KVPOOL_RETURN_IF_ERROR(Unary(&v1::KvPool::StubInterface::ListPins, request, &response));
  return std::vector<v1::PinInfo>(response.pins().begin(), response.pins().end());
}

absl::Status Client::Ping() const {
  v1::PingResponse response;
  return Unary(&v1::KvPool::StubInterface::Ping, v1::PingRequest(), &response);
}

absl::StatusOr<v1::PrefillResponse> Client::Prefill(uint64_t sequence_id,
                                                    std::span<const int32_t> tokens, int32_t top_k,
                                                    int32_t priority) const {
  v1::PrefillRequest request;
  request.set_sequence_id(sequence_id);
  request.mutable_tokens()->Add(tokens.begin(), tokens.end());
  request.set_top_k(top_k);
  request.set_priority(priority);
  return Prefill(request);
}

absl::StatusOr<v1::PrefillResponse> Client::Prefill(const v1::PrefillRequest& request) const {
  v1::PrefillResponse response;
  KVPOOL_RETURN_IF_ERROR(Unary(&v1::KvPool::StubInterface::Prefill, request, &response));
  return response;
}

absl::StatusOr<v1::DecodeResponse> Client::Decode(std::span<const DecodeItem> items,
                                                  int32_t top_k) const {
  if (doorbell_ != nullptr && top_k == 0) {
    if (std::optional<absl::StatusOr<v1::DecodeResponse>> r =
            doorbell_->Decode(items, absl::Now() + timeout_, attach_socket_.get())) {
      return *std::move(r);
    }
  }
  v1::DecodeRequest request;
  for (const DecodeItem& item : items) {
    request.add_sequence_ids(item.sequence_id);
    request.add_tokens(item.token);
  }
  request.set_top_k(top_k);
  return Decode(request);
}

absl::StatusOr<v1::DecodeResponse> Client::Decode(const v1::DecodeRequest& request) const {
  v1::DecodeResponse response;
  KVPOOL_RETURN_IF_ERROR(Unary(&v1::KvPool::StubInterface::Decode, request, &response));
  if (response.next_tokens_size() != request.sequence_ids_size()) {
    return absl::InternalError(fmt::format("Decode: {} tokens back for {} sequences",
                                           response.next_tokens_size(),
                                           request.sequence_ids_size()));
  }
  return response;
}

absl::Status Client::Generate(const v1::GenerateRequest& request,
                              absl::FunctionRef<bool(const v1::GenerateResponse&)> on_token) const {
  grpc::ClientContext context;
  PrepareContext(&context, /*deadline=*/false);
  std::unique_ptr<grpc::ClientReaderInterface<v1::GenerateResponse>> reader =
      stub_->Generate(&context, request);
  v1::GenerateResponse response;
  bool stopped = false;
  while (reader->Read(&response)) {
    if (!on_token(response)) {
      stopped = true;
      context.TryCancel();
      break;
    }
  }
  const grpc::Status status = reader->Finish();
  if (stopped && status.error_code() == grpc::StatusCode::CANCELLED) return absl::OkStatus();
  return FromGrpcStatus(status, context.GetServerTrailingMetadata());
}

absl::StatusOr<v1::GetStatsResponse> Client::GetStats(std::string_view pool) const {
  v1::GetStatsRequest request;
  request.set_pool(std::string(pool));
  v1::GetStatsResponse response;
  KVPOOL_RETURN_IF_ERROR(Unary(&v1::KvPool::StubInterface::GetStats, request, &response));
  return response;
}

absl::StatusOr<v1::ListSessionsResponse> Client::ListSessions() const {
  v1::ListSessionsResponse response;
  KVPOOL_RETURN_IF_ERROR(
      Unary(&v1::KvPool::StubInterface::ListSessions, v1::ListSessionsRequest(), &response));
  return response;
}

absl::StatusOr<v1::ListSequencesResponse> Client::ListSequences(uint64_t session_id,
                                                                std::string_view pool) const {
  v1::ListSequencesRequest request;
  request.set_session_id(session_id);
  request.set_pool(std::string(pool));
  v1::ListSequencesResponse response;
  KVPOOL_RETURN_IF_ERROR(Unary(&v1::KvPool::StubInterface::ListSequences, request, &response));
  if (response.session_ids_size() != response.sequences_size()) {
    return Malformed("ListSequences",
                     fmt::format("{} sequences but {} owners", response.sequences_size(),
                                 response.session_ids_size()));
  }
  for (const v1::SequenceInfo& info : response.sequences()) {
    if (absl::Status s = ValidateSequenceInfo(info); !s.ok()) {
      return Malformed("ListSequences", std::string(s.message()));
    }
  }
  return response;
}

absl::StatusOr<v1::DumpBlockTraceResponse> Client::DumpBlockTrace(int32_t block_id,
                                                                  std::string_view pool) const {
  v1::DumpBlockTraceRequest request;
  request.set_block_id(block_id);
  request.set_pool(std::string(pool));
  v1::DumpBlockTraceResponse response;
  KVPOOL_RETURN_IF_ERROR(Unary(&v1::KvPool::StubInterface::DumpBlockTrace, request, &response));
  return response;
}

absl::StatusOr<v1::DumpBlockTraceResponse> Client::DumpAllBlockTraces(std::string_view pool) const {
  v1::DumpBlockTraceRequest request;
  request.set_all(true);
  request.set_pool(std::string(pool));
  v1::DumpBlockTraceResponse response;
  KVPOOL_RETURN_IF_ERROR(Unary(&v1::KvPool::StubInterface::DumpBlockTrace, request, &response));
  return response;
}

absl::Status Client::WatchEvents(
    const v1::WatchEventsRequest& request,
    absl::FunctionRef<bool(const v1::WatchEventsResponse&)> on_response) const {
  grpc::ClientContext context;
  // A followed stream is open-ended; only a one-shot replay gets the usual deadline.
  PrepareContext(&context, /*deadline=*/!request.follow());
  {
    absl::MutexLock lock(&watches_->mu);
    watches_->calls.insert(&context);
  }
  std::unique_ptr<grpc::ClientReaderInterface<v1::WatchEventsResponse>> reader =
      stub_->WatchEvents(&context, request);
  v1::WatchEventsResponse response;
  bool stopped = false;
  while (reader->Read(&response)) {
    if (!on_response(response)) {
      stopped = true;
      context.TryCancel();
      break;
    }
  }
  const grpc::Status status = reader->Finish();
  bool cancelled;
  {
    absl::MutexLock lock(&watches_->mu);
    cancelled = watches_->calls.erase(&context) == 0;  // CancelWatches() took it out
  }
  if ((stopped || cancelled) && status.error_code() == grpc::StatusCode::CANCELLED) {
    return absl::OkStatus();
  }
  return FromGrpcStatus(status, context.GetServerTrailingMetadata());
}

void Client::CancelWatches() const {
  absl::MutexLock lock(&watches_->mu);
  for (grpc::ClientContext* context : watches_->calls) context->TryCancel();
  watches_->calls.clear();
}

absl::StatusOr<v1::ExplainMatchResponse> Client::ExplainMatch(std::span<const int32_t> tokens,
                                                              uint64_t namespace_id,
                                                              std::string_view pool) const {
  v1::ExplainMatchRequest request;
  request.mutable_tokens()->Add(tokens.begin(), tokens.end());
  request.set_namespace_id(namespace_id);
  request.set_pool(std::string(pool));
  v1::ExplainMatchResponse response;
  KVPOOL_RETURN_IF_ERROR(Unary(&v1::KvPool::StubInterface::ExplainMatch, request, &response));
  return response;
}

absl::StatusOr<int64_t> Client::Evict(int64_t blocks, std::string_view pool) const {
  v1::EvictRequest request;
  request.set_blocks(blocks);
  request.set_pool(std::string(pool));
  v1::EvictResponse response;
  KVPOOL_RETURN_IF_ERROR(Unary(&v1::KvPool::StubInterface::Evict, request, &response));
  return response.evicted();
}

absl::StatusOr<int64_t> Client::EvictAll(std::string_view pool) const {
  v1::EvictRequest request;
  request.set_all(true);
  request.set_pool(std::string(pool));
  v1::EvictResponse response;
  KVPOOL_RETURN_IF_ERROR(Unary(&v1::KvPool::StubInterface::Evict, request, &response));
  return response.evicted();
}

absl::StatusOr<v1::InvalidateResponse> Client::Invalidate(std::string_view tenant,
                                                          std::string_view model) const {
  v1::InvalidateRequest request;
  request.set_tenant(std::string(tenant));
  request.set_model(std::string(model));
  v1::InvalidateResponse response;
  KVPOOL_RETURN_IF_ERROR(Unary(&v1::KvPool::StubInterface::Invalidate, request, &response));
  return response;
}

absl::StatusOr<v1::CheckInvariantsResponse> Client::CheckInvariants() const {
  v1::CheckInvariantsResponse response;
  KVPOOL_RETURN_IF_ERROR(
      Unary(&v1::KvPool::StubInterface::CheckInvariants, v1::CheckInvariantsRequest(), &response));
  return response;
}

absl::Status Client::SetLogLevel(std::string_view level) const {
  v1::SetLogLevelRequest request;
  request.set_level(std::string(level));
  v1::SetLogLevelResponse response;
  return Unary(&v1::KvPool::StubInterface::SetLogLevel, request, &response);
}

absl::StatusOr<int64_t> Client::Drain() const {
  v1::DrainResponse response;
  KVPOOL_RETURN_IF_ERROR(Unary(&v1::KvPool::StubInterface::Drain, v1::DrainRequest(), &response));
  return response.sequences();
}

}  // namespace kvpool::client
