// KvPoolService's compute calls: Prefill, Decode and Generate queue in the engine and complete
// when their model step has run (service.h).

#include <algorithm>
#include <utility>

#include "absl/random/random.h"
#include "daemon/edge/grpc_call_context.h"
#include "daemon/edge/service.h"
#include "fmt/format.h"
#include "kvpool/util/fmt.h"
#include "kvpool/util/logging.h"

namespace kvpool::daemon {
namespace {

// The RPC's own bound on top_k (kvpool.proto: a response carries at most this many per token);
// the model's (the vocabulary) is the engine's admission gate's (daemon/engine/admission.h).
constexpr int32_t kMaxTopK = 64;

void ToProto(const std::vector<model::TokenLogProb>& top, v1::TopTokens* out) {
  for (const model::TokenLogProb& t : top) {
    v1::TopToken* p = out->add_tokens();
    p->set_token(t.token);
    p->set_logprob(t.logprob);
  }
}

absl::Status CheckTopK(int32_t top_k) {
  if (top_k < 0 || top_k > kMaxTopK) {
    return absl::InvalidArgumentError(fmt::format("top_k {} outside [0, {}]", top_k, kMaxTopK));
  }
  return absl::OkStatus();
}

uint64_t DrawSeed() {
  absl::BitGen gen;
  return absl::Uniform<uint64_t>(gen);
}

// A decode's sampling parameters, one set per sequence where one set without a seed stands for
// several (each sequence draws its own: a shared seed would correlate their samples).
std::vector<model::SamplingParams> SamplingOf(
    const google::protobuf::RepeatedPtrField<v1::SamplingParams>& given, size_t sequences) {
  std::vector<model::SamplingParams> out;
  if (given.size() == 1 && !given[0].has_seed() && sequences > 1) {
    for (size_t i = 0; i < sequences; ++i) out.push_back(FromProto(given[0], DrawSeed()));
    return out;
  }
  for (const v1::SamplingParams& p : given)
    out.push_back(FromProto(p, p.has_seed() ? 0 : DrawSeed()));
  return out;
}

}  // namespace

KvPoolService::Unary* KvPoolService::Compute(Context* context, ComputeRequest request,
                                             absl::Status malformed,
                                             std::function<void(const ComputeResult&)> finish) {
  Unary* reactor = context->DefaultReactor();
  if (!BeginCall()) {
    reactor->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "kvpoold is shutting down"));
    return reactor;
  }
  absl::StatusOr<std::shared_ptr<const Session>> session = Authenticate(context, false);
  if (!session.ok() || !malformed.ok()) {
    reactor->Finish(ToGrpcStatus(session.ok() ? malformed : session.status()));
    EndCall();
    return reactor;
  }
  auto done = [this, reactor, context, finish = std::move(finish)](ComputeCall& call) {
    if (call.result().status.ok()) finish(call.result());
    reactor->Finish(ToGrpcStatus(call.result().status, context));
    EndCall();
  };
  engine_->Submit(std::make_unique<ComputeCall>(*std::move(session), std::move(request),
                                                std::make_shared<GrpcCallContext>(context, clock_),
                                                std::move(done)));
  return reactor;
}

KvPoolService::Unary* KvPoolService::Prefill(Context* c, const v1::PrefillRequest* q,
                                             v1::PrefillResponse* r) {
  ComputeRequest request{.kind = ComputeRequest::Kind::kPrefill,
                         .sequence = SequenceId(q->sequence_id()),
                         .tokens = {q->tokens().begin(), q->tokens().end()},
                         .priority = q->priority(),
                         .cache_salt = q->cache_salt(),
                         .top_k = q->top_k(),
                         .logprobs = q->logprobs()};
  if (q->has_sampling()) {
    request.sampling.push_back(FromProto(q->sampling(), q->sampling().has_seed() ? 0 : DrawSeed()));
  }
  const bool top = q->top_k() > 0;
  const bool logprobs = q->logprobs();
  return Compute(c, std::move(request), CheckTopK(q->top_k()), [=](const ComputeResult& done) {
    r->set_sequence_id(done.sequences[0].value());
    r->set_next_token(done.results[0].next_token);
    if (logprobs) r->set_logprob(done.results[0].logprob);
    r->set_reused_tokens(done.reused);
    r->set_computed_tokens(done.computed);
    r->set_num_tokens(done.lengths[0]);
    if (top) ToProto(done.results[0].top, r->mutable_top());
    r->set_step_sequences(done.step_sequences);
  });
}

KvPoolService::Unary* KvPoolService::Decode(Context* c, const v1::DecodeRequest* q,
                                            v1::DecodeResponse* r) {
  absl::StatusOr<std::vector<model::DecodeInput>> inputs = FromProto(*q);
  absl::Status malformed = inputs.ok() ? CheckTopK(q->top_k()) : inputs.status();
  ComputeRequest request{
      .kind = ComputeRequest::Kind::kDecode,
      .decode = inputs.ok() ? *std::move(inputs) : std::vector<model::DecodeInput>{},
      .top_k = q->top_k(),
      .sampling = SamplingOf(q->sampling(), static_cast<size_t>(q->sequence_ids_size())),
      .logprobs = q->logprobs()};
  const bool top = q->top_k() > 0;
  const bool logprobs = q->logprobs();
  return Compute(c, std::move(request), std::move(malformed), [=](const ComputeResult& done) {
    for (size_t i = 0; i < done.results.size(); ++i) {
      r->add_next_tokens(done.results[i].next_token);
      if (logprobs) r->add_logprobs(done.results[i].logprob);
      r->add_num_tokens(done.lengths[i]);
      if (top) ToProto(done.results[i].top, r->add_top());
    }
    r->set_step_sequences(done.step_sequences);
  });
}

// A Generate stream: one Prefill, then one Decode per token, each written before the next is
// submitted. Deletes itself when gRPC is done with it; it finishes only while no step of its own
// is queued or running, so no step completion can outlive it. A sequence it created is freed when
// the stream ends before the client received its id (the first message), and with
// free_when_done.
class GenerateWriter final : public grpc::ServerWriteReactor<v1::GenerateResponse> {
 public:
  GenerateWriter(KvPoolService* service, grpc::CallbackServerContext* context,
                 std::shared_ptr<const Session> session, const v1::GenerateRequest& request)
      : service_(service),
        session_(std::move(session)),
        request_(request),
        call_context_(std::make_shared<GrpcCallContext>(context, service->clock_)) {
    if (request_.has_sampling()) {
      // One seed for the stream: its tokens are a function of it (and the prompt) alone.
      sampling_.push_back(
          FromProto(request_.sampling(), request_.sampling().has_seed() ? 0 : DrawSeed()));
    }
  }

  void Start() {
    {
      absl::MutexLock lock(&mu_);
      busy_ = true;
    }
    // Outside the lock: a stopped engine completes the call at once, on this thread.
    Submit({.kind = ComputeRequest::Kind::kPrefill,
            .sequence = SequenceId(request_.sequence_id()),
            .tokens = {request_.prompt().begin(), request_.prompt().end()},
            .priority = request_.priority(),
            .cache_salt = request_.cache_salt(),
            .top_k = request_.top_k(),
            .sampling = sampling_,
            .logprobs = request_.logprobs()});
  }

  void OnWriteDone(bool ok) override {
    SequenceId sequence;
    int32_t last;
    {
      absl::MutexLock lock(&mu_);
      busy_ = false;
      if (!ok) return Close(grpc::Status(grpc::StatusCode::CANCELLED, "client went away"));
      delivered_ = true;  // the client knows the sequence now
      const bool stop = std::find(request_.stop_tokens().begin(), request_.stop_tokens().end(),
                                  last_) != request_.stop_tokens().end();
      if (produced_ >= request_.max_tokens() || stop) return Close(grpc::Status::OK);
      if (cancelled_) return Close(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled"));
      // A shutdown lets the stream run on within its drain timeout; past it the engine stops
      // computing, and the next step's UNAVAILABLE closes the stream.
      busy_ = true;
      sequence = sequence_;
      last = last_;
    }
    Submit({.kind = ComputeRequest::Kind::kDecode,
            .decode = {{sequence, last}},
            .top_k = request_.top_k(),
            .sampling = sampling_,
            .logprobs = request_.logprobs()});
  }

  void OnCancel() override {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    if (!busy_) Close(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled"));
  }

  void OnDone() override {
    service_->EndCall();
    delete this;
  }

 private:
  void Submit(ComputeRequest request) {
    service_->engine_->Submit(std::make_unique<ComputeCall>(
        session_, std::move(request), call_context_, [this](ComputeCall& c) { OnStep(c); }));
  }

  // A step of ours completed (runner thread).
  void OnStep(ComputeCall& call) {
    absl::MutexLock lock(&mu_);
    busy_ = false;
    const ComputeResult& done = call.result();
    if (!done.status.ok()) return Close(ToGrpcStatus(done.status));
    if (call.request().prefill()) {
      sequence_ = done.sequences[0];
      created_ = call.request().creates();
      response_.set_reused_tokens(done.reused);
    } else {
      response_.clear_reused_tokens();
    }
    if (cancelled_) return Close(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled"));
    const model::ItemResult& result = done.results[0];
    last_ = result.next_token;
    response_.set_sequence_id(sequence_.value());
    response_.set_token(last_);
    if (request_.logprobs()) response_.set_logprob(result.logprob);
    response_.clear_top();
    if (request_.top_k() > 0) ToProto(result.top, response_.mutable_top());
    response_.set_index(produced_++);
    busy_ = true;
    StartWrite(&response_);
  }

  void Close(const grpc::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (closed_) return;
    closed_ = true;
    const bool orphan = created_ && !delivered_;  // the client never learned of it
    if (sequence_ != SequenceId(0) && (request_.free_when_done() || orphan)) {
      const SequenceId id = sequence_;
      const OnFree mode = status.ok() ? OnFree::kCommit : OnFree::kDiscard;
      if (absl::Status s = service_->engine_->Free(*session_, std::span(&id, 1), mode,
                                                   CallContext::Uncancellable());
          !s.ok() && !absl::IsNotFound(s)) {
        Logger("daemon").warn("generate: freeing sequence {}: {}", id.value(), s.ToString());
      }
    }
    Finish(status);
  }

  KvPoolService* const service_;
  const std::shared_ptr<const Session> session_;
  const v1::GenerateRequest request_;
  const std::shared_ptr<const CallContext> call_context_;
  std::vector<model::SamplingParams> sampling_;  // every step's (set once, before the first)
  absl::Mutex mu_;
  SequenceId sequence_ ABSL_GUARDED_BY(mu_);
  bool created_ ABSL_GUARDED_BY(mu_) = false;    // the stream's prefill made the sequence
  bool delivered_ ABSL_GUARDED_BY(mu_) = false;  // a message reached the client
  int32_t last_ ABSL_GUARDED_BY(mu_) = 0;
  int32_t produced_ ABSL_GUARDED_BY(mu_) = 0;
  bool busy_ ABSL_GUARDED_BY(mu_) = false;  // a step or a write of ours is in flight
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  v1::GenerateResponse response_ ABSL_GUARDED_BY(mu_);
};

grpc::ServerWriteReactor<v1::GenerateResponse>* KvPoolService::Generate(
    Context* c, const v1::GenerateRequest* q) {
  if (!BeginCall()) {
    return new Refusal<v1::GenerateResponse>(
        grpc::Status(grpc::StatusCode::UNAVAILABLE, "kvpoold is shutting down"));
  }
  absl::StatusOr<std::shared_ptr<const Session>> session = Authenticate(c, false);
  absl::Status error = session.status();
  if (error.ok() && !engine_->has_model()) {
    error =
        absl::FailedPreconditionError("kvpoold runs no model (config: model { name: \"none\" })");
  } else if (error.ok() && q->max_tokens() < 1) {
    error = absl::InvalidArgumentError(
        fmt::format("generate: max_tokens {} must be >= 1", q->max_tokens()));
  } else if (error.ok()) {
    error = CheckTopK(q->top_k());
  }
  if (!error.ok()) {
    EndCall();
    return new Refusal<v1::GenerateResponse>(ToGrpcStatus(error));
  }
  auto* writer = new GenerateWriter(this, c, *std::move(session), *q);
  writer->Start();
  return writer;
}

}  // namespace kvpool::daemon
