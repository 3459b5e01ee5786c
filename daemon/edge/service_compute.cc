// KvPoolService's compute calls: Prefill, Decode and Generate queue in the engine and complete
// when their model step has run (service.h).

#include <utility>

#include "absl/random/random.h"
#include "daemon/edge/grpc_call_context.h"
#include "daemon/edge/service.h"
#include "daemon/engine/generation.h"
#include "fmt/format.h"
#include "kvpool/util/fmt.h"
#include "kvpool/util/status_macros.h"

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
// REQUIRES: CheckSamplingCount(given.size(), sequences, false) is OK, and `sequences` within
// limits.decode_width (Engine::CheckDecodeWidth): this is the work per sequence that no call
// refused anyway may cause.
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

KvPoolService::Unary* KvPoolService::Compute(
    Context* context, absl::FunctionRef<absl::StatusOr<ComputeRequest>()> build,
    std::function<void(const ComputeResult&)> finish) {
  Unary* reactor = context->DefaultReactor();
  if (!BeginCall()) {
    reactor->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "kvpoold is shutting down"));
    return reactor;
  }
  absl::StatusOr<std::shared_ptr<const Session>> session = Authenticate(context, false);
  absl::StatusOr<ComputeRequest> request =
      session.ok() ? build() : absl::StatusOr<ComputeRequest>(session.status());
  if (!request.ok()) {
    reactor->Finish(ToGrpcStatus(request.status()));
    EndCall();
    return reactor;
  }
  auto done = [this, reactor, context, finish = std::move(finish)](ComputeCall& call) {
    if (call.result().status.ok()) finish(call.result());
    reactor->Finish(ToGrpcStatus(call.result().status, context));
    EndCall();
  };
  engine_->Submit(std::make_unique<ComputeCall>(*std::move(session), *std::move(request),
                                                std::make_shared<GrpcCallContext>(context, clock_),
                                                std::move(done)));
  return reactor;
}

KvPoolService::Unary* KvPoolService::Prefill(Context* c, const v1::PrefillRequest* q,
                                             v1::PrefillResponse* r) {
  auto build = [q]() -> absl::StatusOr<ComputeRequest> {
    KVPOOL_RETURN_IF_ERROR(CheckTopK(q->top_k()));
    ComputeRequest request{.kind = ComputeRequest::Kind::kPrefill,
                           .sequence = SequenceId(q->sequence_id()),
                           .tokens = {q->tokens().begin(), q->tokens().end()},
                           .priority = q->priority(),
                           .cache_salt = q->cache_salt(),
                           .top_k = q->top_k(),
                           .logprobs = q->logprobs()};
    if (q->has_sampling()) {
      request.sampling.push_back(
          FromProto(q->sampling(), q->sampling().has_seed() ? 0 : DrawSeed()));
    }
    return request;
  };
  const bool top = q->top_k() > 0;
  const bool logprobs = q->logprobs();
  return Compute(c, build, [=](const ComputeResult& done) {
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
  auto build = [this, q]() -> absl::StatusOr<ComputeRequest> {
    // What the wire bounds, then the width: a message of up to 4 MiB names millions of
    // sequences, so a call to refuse is refused before anything is built per sequence.
    const auto sequences = static_cast<size_t>(q->sequence_ids_size());
    KVPOOL_RETURN_IF_ERROR(CheckParallelArrays(*q));
    KVPOOL_RETURN_IF_ERROR(CheckTopK(q->top_k()));
    KVPOOL_RETURN_IF_ERROR(CheckSamplingCount(static_cast<size_t>(q->sampling_size()), sequences,
                                              /*prefill=*/false));
    KVPOOL_RETURN_IF_ERROR(engine_->CheckDecodeWidth(sequences));
    KVPOOL_ASSIGN_OR_RETURN(std::vector<model::DecodeInput> inputs, FromProto(*q));
    return ComputeRequest{.kind = ComputeRequest::Kind::kDecode,
                          .decode = std::move(inputs),
                          .top_k = q->top_k(),
                          .sampling = SamplingOf(q->sampling(), sequences),
                          .logprobs = q->logprobs()};
  };
  const bool top = q->top_k() > 0;
  const bool logprobs = q->logprobs();
  return Compute(c, build, [=](const ComputeResult& done) {
    for (size_t i = 0; i < done.results.size(); ++i) {
      r->add_next_tokens(done.results[i].next_token);
      if (logprobs) r->add_logprobs(done.results[i].logprob);
      r->add_num_tokens(done.lengths[i]);
      if (top) ToProto(done.results[i].top, r->add_top());
    }
    r->set_step_sequences(done.step_sequences);
  });
}

// A Generate stream: writes what its Generation (daemon/engine/generation.h) yields. Deletes
// itself when gRPC is done with it; the generation ends (OnEnd) only while no step of its own is
// queued or running, so no step completion can outlive the writer.
class GenerateWriter final : public grpc::ServerWriteReactor<v1::GenerateResponse>,
                             private Generation::Sink {
 public:
  GenerateWriter(KvPoolService* service, grpc::CallbackServerContext* context,
                 std::shared_ptr<const Session> session, GenerationRequest request)
      : service_(service),
        generation_(service->engine_, std::move(session), std::move(request),
                    std::make_shared<GrpcCallContext>(context, service->clock_), this) {}

  void Start() { generation_.Start(); }

  void OnWriteDone(bool ok) override { generation_.Delivered(ok); }
  void OnCancel() override { generation_.Cancel(); }
  void OnDone() override {
    service_->EndCall();
    delete this;
  }

 private:
  // The generation calls these one at a time, so response_ needs no lock.
  void OnToken(const GeneratedToken& token) override {
    response_.set_sequence_id(token.sequence.value());
    if (token.reused_tokens.has_value()) {
      response_.set_reused_tokens(*token.reused_tokens);
    } else {
      response_.clear_reused_tokens();
    }
    response_.set_token(token.token);
    response_.set_logprob(token.logprob);
    response_.clear_top();
    if (!token.top.empty()) ToProto(token.top, response_.mutable_top());
    response_.set_index(token.index);
    StartWrite(&response_);
  }
  void OnEnd(const absl::Status& status) override { Finish(ToGrpcStatus(status)); }

  KvPoolService* const service_;
  Generation generation_;
  v1::GenerateResponse response_;
};

grpc::ServerWriteReactor<v1::GenerateResponse>* KvPoolService::Generate(
    Context* c, const v1::GenerateRequest* q) {
  if (!BeginCall()) {
    return new Refusal<v1::GenerateResponse>(
        grpc::Status(grpc::StatusCode::UNAVAILABLE, "kvpoold is shutting down"));
  }
  absl::StatusOr<std::shared_ptr<const Session>> session = Authenticate(c, false);
  absl::Status error = session.status();
  if (error.ok()) error = CheckTopK(q->top_k());
  // (The stream keeps its stop tokens and checks every token it yields against them.)
  if (error.ok()) error = engine_->CheckStopTokens(static_cast<size_t>(q->stop_tokens_size()));
  if (!error.ok()) {
    EndCall();
    return new Refusal<v1::GenerateResponse>(ToGrpcStatus(error));
  }
  GenerationRequest request{.sequence = SequenceId(q->sequence_id()),
                            .prompt = {q->prompt().begin(), q->prompt().end()},
                            .priority = q->priority(),
                            .cache_salt = q->cache_salt(),
                            .top_k = q->top_k(),
                            .logprobs = q->logprobs(),
                            .max_tokens = q->max_tokens(),
                            .stop_tokens = {q->stop_tokens().begin(), q->stop_tokens().end()},
                            .free_when_done = q->free_when_done()};
  if (q->has_sampling()) {
    request.sampling = FromProto(q->sampling(), q->sampling().has_seed() ? 0 : DrawSeed());
  }
  auto* writer = new GenerateWriter(this, c, *std::move(session), std::move(request));
  writer->Start();
  return writer;
}

}  // namespace kvpool::daemon
