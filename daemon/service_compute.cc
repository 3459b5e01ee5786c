// KvPoolService's compute calls: Prefill, Decode and Generate go through the StepRunner and
// complete when their model step has run (service.h).

#include <utility>

#include "daemon/service.h"
#include "fmt/format.h"
#include "kvpool/util/fmt.h"
#include "kvpool/util/logging.h"

namespace kvpool::daemon {
namespace {

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

}  // namespace

KvPoolService::Unary* KvPoolService::Compute(Context* context, std::unique_ptr<ComputeCall> call,
                                             std::function<void(ComputeCall&)> finish) {
  Unary* reactor = context->DefaultReactor();
  if (!BeginCall()) {
    reactor->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "kvpoold is shutting down"));
    return reactor;
  }
  grpc::Status error;
  call->session = Authenticate(context, &error);
  if (call->session != nullptr && runner_ == nullptr) {
    error = grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                         "kvpoold runs no model (config: model { name: \"none\" })");
  } else if (call->session != nullptr && !call->status.ok()) {
    error = ToGrpcStatus(call->status);  // the request was malformed
  }
  if (!error.ok()) {
    reactor->Finish(error);
    EndCall();
    return reactor;
  }
  call->done = [this, reactor, context, finish = std::move(finish)](ComputeCall& done) {
    if (done.status.ok()) finish(done);
    reactor->Finish(ToGrpcStatus(done.status, context));
    NotifyEvents();  // commits publish blocks
    EndCall();
  };
  runner_->Submit(std::move(call));
  return reactor;
}

KvPoolService::Unary* KvPoolService::Prefill(Context* c, const v1::PrefillRequest* q,
                                             v1::PrefillResponse* r) {
  auto call = std::make_unique<ComputeCall>();
  call->prefill = true;
  call->sequence = SequenceId(q->sequence_id());
  call->tokens.assign(q->tokens().begin(), q->tokens().end());
  call->priority = q->priority();
  call->top_k = q->top_k();
  call->status = CheckTopK(q->top_k());
  return Compute(c, std::move(call), [r](ComputeCall& done) {
    const model::PlannedItem& item = done.items[0];
    r->set_sequence_id(item.sequence.value());
    r->set_next_token(done.results[0].next_token);
    r->set_reused_tokens(item.reused);
    r->set_computed_tokens(static_cast<int64_t>(item.tokens.size()));
    r->set_num_tokens(done.lengths[0]);
    if (done.top_k > 0) ToProto(done.results[0].top, r->mutable_top());
    r->set_step_sequences(done.step_sequences);
  });
}

KvPoolService::Unary* KvPoolService::Decode(Context* c, const v1::DecodeRequest* q,
                                            v1::DecodeResponse* r) {
  auto call = std::make_unique<ComputeCall>();
  call->top_k = q->top_k();
  call->status = CheckTopK(q->top_k());
  if (q->sequence_ids_size() != q->tokens_size()) {
    call->status = absl::InvalidArgumentError(fmt::format(
        "decode: {} sequence ids but {} tokens", q->sequence_ids_size(), q->tokens_size()));
  }
  for (int i = 0; i < std::min(q->sequence_ids_size(), q->tokens_size()); ++i) {
    call->decode.push_back({SequenceId(q->sequence_ids(i)), q->tokens(i)});
  }
  return Compute(c, std::move(call), [r](ComputeCall& done) {
    for (size_t i = 0; i < done.items.size(); ++i) {
      r->add_next_tokens(done.results[i].next_token);
      r->add_num_tokens(done.lengths[i]);
      if (done.top_k > 0) ToProto(done.results[i].top, r->add_top());
    }
    r->set_step_sequences(done.step_sequences);
  });
}

// A Generate stream: one Prefill, then one Decode per token, each written before the next is
// submitted. Deletes itself when gRPC is done with it; it finishes only while no step of its
// own is queued or running, so no step completion can outlive it.
class GenerateWriter final : public grpc::ServerWriteReactor<v1::GenerateResponse> {
 public:
  GenerateWriter(KvPoolService* service, std::shared_ptr<const Session> session,
                 const v1::GenerateRequest& request)
      : service_(service), session_(std::move(session)), request_(request) {}

  void Start() {
    auto call = NewCall();
    call->prefill = true;
    call->sequence = SequenceId(request_.sequence_id());
    call->tokens.assign(request_.prompt().begin(), request_.prompt().end());
    call->priority = request_.priority();
    {
      absl::MutexLock lock(&mu_);
      busy_ = true;
    }
    // Outside the lock: a stopped runner completes the call at once, on this thread.
    service_->runner_->Submit(std::move(call));
  }

  void OnWriteDone(bool ok) override {
    std::unique_ptr<ComputeCall> next;
    {
      absl::MutexLock lock(&mu_);
      busy_ = false;
      if (!ok) return Close(grpc::Status(grpc::StatusCode::CANCELLED, "client went away"));
      const bool stop = std::find(request_.stop_tokens().begin(), request_.stop_tokens().end(),
                                  last_) != request_.stop_tokens().end();
      if (produced_ >= request_.max_tokens() || stop) return Close(grpc::Status::OK);
      if (cancelled_) return Close(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled"));
      if (service_->Stopping()) {
        return Close(grpc::Status(grpc::StatusCode::UNAVAILABLE, "kvpoold is shutting down"));
      }
      next = NewCall();
      next->decode.push_back({sequence_, last_});
      busy_ = true;
    }
    service_->runner_->Submit(std::move(next));
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
  std::unique_ptr<ComputeCall> NewCall() {
    auto call = std::make_unique<ComputeCall>();
    call->session = session_;
    call->done = [this](ComputeCall& done) { OnStep(done); };
    return call;
  }

  // A step of ours completed (runner thread).
  void OnStep(ComputeCall& done) {
    absl::MutexLock lock(&mu_);
    busy_ = false;
    if (!done.status.ok()) return Close(ToGrpcStatus(done.status));
    if (cancelled_) return Close(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled"));
    response_.Clear();
    if (done.prefill) {
      sequence_ = done.items[0].sequence;
      response_.set_reused_tokens(done.items[0].reused);
    }
    last_ = done.results[0].next_token;
    response_.set_sequence_id(sequence_.value());
    response_.set_token(last_);
    response_.set_index(produced_++);
    busy_ = true;
    StartWrite(&response_);
  }

  void Close(const grpc::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (closed_) return;
    closed_ = true;
    if (request_.free_when_done() && sequence_ != SequenceId(0)) {
      v1::FreeRequest free;
      free.add_sequence_ids(sequence_.value());
      free.set_commit(status.ok());
      if (absl::Status s = service_->pool_->Free(*session_, free); !s.ok()) {
        Logger("daemon").warn("generate: freeing sequence {}: {}", sequence_.value(), s.ToString());
      }
      service_->NotifyEvents();
    }
    Finish(status);
  }

  KvPoolService* const service_;
  const std::shared_ptr<const Session> session_;
  const v1::GenerateRequest request_;
  absl::Mutex mu_;
  SequenceId sequence_ ABSL_GUARDED_BY(mu_);
  int32_t last_ ABSL_GUARDED_BY(mu_) = 0;
  int32_t produced_ ABSL_GUARDED_BY(mu_) = 0;
  bool busy_ ABSL_GUARDED_BY(mu_) = false;  // a step or a write of ours is in flight
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  v1::GenerateResponse response_ ABSL_GUARDED_BY(mu_);
};

grpc::ServerWriteReactor<v1::GenerateResponse>* KvPoolService::Generate(
    Context* c, const v1::GenerateRequest* q) {
  class Refusal final : public grpc::ServerWriteReactor<v1::GenerateResponse> {
   public:
    explicit Refusal(const grpc::Status& s) { Finish(s); }
    void OnDone() override { delete this; }
  };
  if (!BeginCall()) {
    return new Refusal(grpc::Status(grpc::StatusCode::UNAVAILABLE, "kvpoold is shutting down"));
  }
  grpc::Status error;
  std::shared_ptr<const Session> session = Authenticate(c, &error);
  if (session != nullptr && runner_ == nullptr) {
    error = grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                         "kvpoold runs no model (config: model { name: \"none\" })");
  } else if (session != nullptr && q->max_tokens() < 1) {
    error = grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                         fmt::format("generate: max_tokens {} must be >= 1", q->max_tokens()));
  }
  if (!error.ok()) {
    EndCall();
    return new Refusal(error);
  }
  auto* writer = new GenerateWriter(this, std::move(session), *q);
  writer->Start();
  return writer;
}

}  // namespace kvpool::daemon
