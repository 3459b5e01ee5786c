// The gRPC service (daemon/edge/service.h) against an in-process Engine running a micro model:
// each input is decoded into a program of up to kMaxOps RPCs (every control, compute and admin
// call) issued over an in-process channel by five callers (two KV-access sessions of different
// tenants, a compute-only one, an admin one, and one without a token), some with deadlines short
// enough to give up mid-call, with sessions ending (detached or lost) and reopening between
// calls. A fresh engine and server per input keeps every input reproducible.
//
// Checked after every call: the engine's CheckInvariants(), and that the CheckInvariants RPC
// agrees. After every input, once every call has finished and every session has ended: no
// sequence left, no block ACTIVE (free + cached + retiring == all), invariants again.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "daemon/edge/service.h"
#include "daemon/engine/engine.h"
#include "fuzz/fuzz_util.h"
#include "fuzzer/FuzzedDataProvider.h"
#include "grpcpp/grpcpp.h"
#include "kernels/cpu_device.h"
#include "kvpool/v1/wire.h"
#include "model/model.h"
#include "model/weights.h"

namespace kvpool::fuzz {
namespace {

using daemon::Engine;
using daemon::Session;
using daemon::SessionSpec;

constexpr int kMaxOps = 48;
constexpr int32_t kVocab = 61;
constexpr int kCallers = 5;  // 0, 1: KV access (tenants t0, t1); 2: compute-only; 3: admin; 4: none

const kernels::PoolLayout& Layout() {
  static const kernels::PoolLayout kLayout{.block_size = 4,
                                           .num_layers = 1,
                                           .num_kv_heads = 1,
                                           .head_dim = 16,
                                           .dtype = kernels::DType::kF32,
                                           .num_blocks = 48};
  return kLayout;
}

// Shared by every input's engine (one at a time): the weights never change.
model::Model& MicroModel() {
  static model::Model* const kModel = [] {
    const model::ModelConfig config{.vocab_size = kVocab,
                                    .hidden_size = 32,
                                    .intermediate_size = 48,
                                    .num_layers = 1,
                                    .num_heads = 2,
                                    .num_kv_heads = 1,
                                    .head_dim = 16,
                                    .max_position = 128};
    auto m = model::Model::Create(model::SyntheticWeights(config, 7), Layout(), {.threads = 1});
    RequireOk(m.status(), "Model::Create");
    return m->release();
  }();
  return *kModel;
}

kernels::CpuDevice& Device() {
  static kernels::CpuDevice* const kDevice = new kernels::CpuDevice(1);
  return *kDevice;
}

SessionSpec SpecOf(int caller) {
  SessionSpec spec{.client_name = "fuzz", .pid = 1, .uid = 1000, .gid = 1000, .model = "m"};
  spec.tenant = caller == 1 ? "t1" : "t0";
  spec.kv_access = caller <= 1;
  spec.admin = caller == 3;
  return spec;
}

// One input's world: the engine, its service on an in-process channel, the callers' sessions and
// the sequence ids the calls returned.
class World final {
 public:
  explicit World(FuzzedDataProvider* in) : in_(*in) {
    daemon::EngineOptions options;
    options.pools = {{.name = "default", .layout = Layout()}};
    options.max_blocks_per_seq = 24;
    options.session_quota_blocks = 40;
    options.open_quota_blocks = {{"t1", 12}};
    options.model_name = "micro";
    options.gather_window_ns = 0;
    options.scheduler.max_step_tokens = 32;  // longer prompts are chunked
    auto engine = Engine::Create(options, &Device(), &MicroModel());
    RequireOk(engine.status(), "Engine::Create");
    engine_ = *std::move(engine);
    service_ = std::make_unique<daemon::KvPoolService>(engine_.get(), Clock::Real());
    engine_->AddEventListener(service_.get());
    grpc::ServerBuilder builder;
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    Require(server_ != nullptr, "BuildAndStart");
    stub_ = v1::KvPool::NewStub(server_->InProcessChannel(grpc::ChannelArguments()));
    for (int c = 0; c < kCallers - 1; ++c) Open(c);
  }

  ~World() {
    // As Daemon::Shutdown: no new calls, wait for those running, stop compute, stop the server.
    engine_->Drain();
    service_->Stop();
    service_->EndStreams();
    Require(
        service_->WaitIdle(Clock::Real()->NowNanos() + absl::ToInt64Nanoseconds(absl::Seconds(30))),
        "calls still running after 30 s");
    engine_->StopCompute();
    server_->Shutdown(absl::ToChronoTime(absl::Now()));
    server_->Wait();
    engine_->RemoveEventListener(service_.get());
    for (auto& s : sessions_) {
      if (s) engine_->EndSession(s->id, daemon::SessionEnd::kShutdown);
    }
    RequireOk(Device().SynchronizeAll(), "SynchronizeAll");
    RequireOk(engine_->CheckInvariants(), "invariants once every session ended");
    const daemon::EngineStats stats = engine_->Stats();
    Require(stats.cache.sequences == 0, "sequences left after every session ended");
    Require(stats.cache.pool.active == 0, "ACTIVE blocks left after every session ended");
    Require(stats.cache.pins == 0 && stats.cache.pinned_blocks == 0,
            "pins left after every session ended");
    Require(stats.cache.pool.free + stats.cache.pool.cached + stats.cache.pool.retiring ==
                stats.cache.pool.num_blocks,
            "blocks unaccounted for");
  }

  void RunOne() {
    using Call = void (World::*)();
    static constexpr Call kCalls[] = {&World::Allocate,
                                      &World::Grow,
                                      &World::Truncate,
                                      &World::Fork,
                                      &World::Commit,
                                      &World::Free,
                                      &World::MatchPrefix,
                                      &World::Pin,
                                      &World::RenewPin,
                                      &World::Unpin,
                                      &World::ListPins,
                                      &World::Prefill,
                                      &World::Decode,
                                      &World::Generate,
                                      &World::Ping,
                                      &World::GetStats,
                                      &World::ListSessions,
                                      &World::ListSequences,
                                      &World::DumpBlockTrace,
                                      &World::WatchEvents,
                                      &World::ExplainMatch,
                                      &World::Evict,
                                      &World::CheckInvariantsRpc,
                                      &World::SetLogLevel,
                                      &World::Drain,
                                      &World::EndSession};
    (this->*kCalls[in_.ConsumeIntegralInRange<size_t>(0, std::size(kCalls) - 1)])();
    RequireOk(engine_->CheckInvariants(), "engine invariants after a call");
  }

 private:
  void Open(int caller) {
    auto s = engine_->OpenSession(SpecOf(caller));
    RequireOk(s.status(), "OpenSession");
    sessions_[caller] = *std::move(s);
  }

  // A context for the next call: some caller's token (or none, or an ended session's), and now
  // and then a deadline short enough to run out while the call runs.
  std::unique_ptr<grpc::ClientContext> Context() {
    auto c = std::make_unique<grpc::ClientContext>();
    const int caller = in_.ConsumeIntegralInRange(0, kCallers - 1);
    if (caller < kCallers - 1 && sessions_[caller]) {
      c->AddMetadata(wire::kSessionTokenKey, sessions_[caller]->token);
    } else if (!ended_.empty() && in_.ConsumeBool()) {
      c->AddMetadata(wire::kSessionTokenKey, ended_.back()->token);
    }
    if (in_.ConsumeIntegralInRange(0, 7) == 0) {
      c->set_deadline(std::chrono::system_clock::now() +
                      std::chrono::microseconds(in_.ConsumeIntegralInRange(0, 3000)));
    }
    return c;
  }

  int32_t Token() {
    const int k = in_.ConsumeIntegralInRange(0, 31);
    if (k == 0) return in_.ConsumeIntegral<int32_t>();  // usually out of range
    return in_.ConsumeIntegralInRange(0, 3) == 0 ? k % kVocab : in_.ConsumeIntegralInRange(0, 7);
  }
  template <typename Field>
  void Tokens(Field* out, int max) {
    const int n = in_.ConsumeIntegralInRange(0, max);
    for (int i = 0; i < n; ++i) out->Add(Token());
  }
  int64_t Length() {
    return in_.ConsumeIntegralInRange(0, 15) == 0 ? in_.ConsumeIntegral<int64_t>()
                                                  : in_.ConsumeIntegralInRange<int64_t>(0, 100);
  }
  // A sequence some call returned, or now and then any number.
  uint64_t Sequence() {
    if (ids_.empty() || in_.ConsumeIntegralInRange(0, 9) == 0) {
      return in_.ConsumeIntegralInRange<uint64_t>(0, 64);
    }
    return ids_[in_.ConsumeIntegralInRange<size_t>(0, ids_.size() - 1)];
  }
  void Remember(uint64_t id) {
    if (id != 0 && ids_.size() < 256) ids_.push_back(id);
  }
  std::string Pool() {
    static const char* const kPools[] = {"", "default", "nope"};
    return kPools[in_.ConsumeIntegralInRange(0, 2)];
  }
  int32_t TopK() { return in_.ConsumeIntegralInRange(-1, 66); }

  void Allocate() {
    v1::AllocateRequest q;
    const int items = in_.ConsumeIntegralInRange(0, 3);
    for (int i = 0; i < items; ++i) {
      v1::AllocateItem* item = q.add_items();
      item->set_num_tokens(Length());
      Tokens(item->mutable_prompt(), 40);
      item->set_priority(in_.ConsumeIntegralInRange(-1, 4));
    }
    v1::AllocateResponse r;
    if (stub_->Allocate(Context().get(), q, &r).ok()) {
      for (const v1::SequenceInfo& s : r.sequences()) Remember(s.sequence_id());
    }
  }
  void Grow() {
    v1::GrowRequest q;
    const int n = in_.ConsumeIntegralInRange(0, 3);
    for (int i = 0; i < n; ++i) q.add_sequence_ids(Sequence());
    const int m = in_.ConsumeBool() ? n : in_.ConsumeIntegralInRange(0, 3);  // ragged now and then
    for (int i = 0; i < m; ++i) q.add_num_tokens(Length());
    v1::GrowResponse r;
    stub_->Grow(Context().get(), q, &r);
  }
  void Truncate() {
    v1::TruncateRequest q;
    q.set_sequence_id(Sequence());
    q.set_num_tokens(Length());
    v1::TruncateResponse r;
    stub_->Truncate(Context().get(), q, &r);
  }
  void Fork() {
    v1::ForkRequest q;
    q.set_sequence_id(Sequence());
    v1::ForkResponse r;
    if (stub_->Fork(Context().get(), q, &r).ok()) Remember(r.sequence().sequence_id());
  }
  void Commit() {
    v1::CommitRequest q;
    q.set_sequence_id(Sequence());
    q.set_num_tokens(Length());
    Tokens(q.mutable_new_tokens(), 40);
    v1::CommitResponse r;
    stub_->Commit(Context().get(), q, &r);
  }
  void Free() {
    v1::FreeRequest q;
    const int n = in_.ConsumeIntegralInRange(0, 3);
    for (int i = 0; i < n; ++i) q.add_sequence_ids(Sequence());
    q.set_commit(in_.ConsumeBool());
    v1::FreeResponse r;
    stub_->Free(Context().get(), q, &r);
  }
  void MatchPrefix() {
    v1::MatchPrefixRequest q;
    Tokens(q.mutable_tokens(), 40);
    v1::MatchPrefixResponse r;
    stub_->MatchPrefix(Context().get(), q, &r);
  }
  // A pin some call returned, or now and then any number.
  uint64_t PinOf() {
    if (pins_.empty() || in_.ConsumeIntegralInRange(0, 9) == 0) {
      return in_.ConsumeIntegralInRange<uint64_t>(0, 16);
    }
    return pins_[in_.ConsumeIntegralInRange<size_t>(0, pins_.size() - 1)];
  }
  int64_t TtlMs() {
    return in_.ConsumeIntegralInRange(0, 7) == 0 ? in_.ConsumeIntegral<int64_t>()
                                                 : in_.ConsumeIntegralInRange<int64_t>(0, 50);
  }
  void Pin() {
    v1::PinRequest q;
    if (in_.ConsumeBool()) q.set_sequence_id(Sequence());
    if (in_.ConsumeBool()) Tokens(q.mutable_tokens(), 40);
    q.set_ttl_ms(TtlMs());
    q.set_priority(in_.ConsumeIntegralInRange(-1, 4));
    v1::PinResponse r;
    if (stub_->Pin(Context().get(), q, &r).ok() && pins_.size() < 256) {
      pins_.push_back(r.pin().pin_id());
    }
  }
  void RenewPin() {
    v1::RenewPinRequest q;
    q.set_pin_id(PinOf());
    q.set_ttl_ms(TtlMs());
    v1::RenewPinResponse r;
    stub_->RenewPin(Context().get(), q, &r);
  }
  void Unpin() {
    v1::UnpinRequest q;
    q.set_pin_id(PinOf());
    v1::UnpinResponse r;
    stub_->Unpin(Context().get(), q, &r);
  }
  void ListPins() {
    v1::ListPinsRequest q;
    q.set_all_sessions(in_.ConsumeBool());
    v1::ListPinsResponse r;
    stub_->ListPins(Context().get(), q, &r);
  }
  void Prefill() {
    v1::PrefillRequest q;
    q.set_sequence_id(in_.ConsumeBool() ? 0 : Sequence());
    Tokens(q.mutable_tokens(), 80);
    q.set_priority(in_.ConsumeIntegralInRange(-1, 4));
    q.set_top_k(TopK());
    v1::PrefillResponse r;
    if (stub_->Prefill(Context().get(), q, &r).ok()) Remember(r.sequence_id());
  }
  void Decode() {
    v1::DecodeRequest q;
    const int n = in_.ConsumeIntegralInRange(0, 4);
    for (int i = 0; i < n; ++i) q.add_sequence_ids(Sequence());
    const int m = in_.ConsumeBool() ? n : in_.ConsumeIntegralInRange(0, 4);
    for (int i = 0; i < m; ++i) q.add_tokens(Token());
    q.set_top_k(TopK());
    v1::DecodeResponse r;
    stub_->Decode(Context().get(), q, &r);
  }
  void Generate() {
    v1::GenerateRequest q;
    q.set_sequence_id(in_.ConsumeBool() ? 0 : Sequence());
    Tokens(q.mutable_prompt(), 40);
    q.set_max_tokens(in_.ConsumeIntegralInRange(-1, 8));
    Tokens(q.mutable_stop_tokens(), 3);
    q.set_priority(in_.ConsumeIntegralInRange(-1, 4));
    q.set_free_when_done(in_.ConsumeBool());
    auto context = Context();
    auto stream = stub_->Generate(context.get(), q);
    v1::GenerateResponse r;
    while (stream->Read(&r)) Remember(r.sequence_id());
    stream->Finish();
  }
  void Ping() {
    v1::PingResponse r;
    stub_->Ping(Context().get(), {}, &r);
  }
  void GetStats() {
    v1::GetStatsRequest q;
    q.set_pool(Pool());
    v1::GetStatsResponse r;
    stub_->GetStats(Context().get(), q, &r);
  }
  void ListSessions() {
    v1::ListSessionsResponse r;
    stub_->ListSessions(Context().get(), {}, &r);
  }
  void ListSequences() {
    v1::ListSequencesRequest q;
    const int caller = in_.ConsumeIntegralInRange(0, kCallers - 1);
    q.set_session_id(caller < kCallers - 1 && sessions_[caller] ? sessions_[caller]->id.value()
                                                                : in_.ConsumeIntegral<uint8_t>());
    q.set_pool(Pool());
    v1::ListSequencesResponse r;
    stub_->ListSequences(Context().get(), q, &r);
  }
  void DumpBlockTrace() {
    v1::DumpBlockTraceRequest q;
    q.set_block_id(in_.ConsumeIntegralInRange(-2, Layout().num_blocks + 2));
    q.set_all(in_.ConsumeBool());
    q.set_pool(Pool());
    v1::DumpBlockTraceResponse r;
    stub_->DumpBlockTrace(Context().get(), q, &r);
  }
  void WatchEvents() {
    v1::WatchEventsRequest q;
    q.set_from_seq(in_.ConsumeIntegralInRange<uint64_t>(0, 200));
    q.set_snapshot(in_.ConsumeBool());
    q.set_pool(Pool());  // never `follow`: the stream would stay open
    auto context = Context();
    auto stream = stub_->WatchEvents(context.get(), q);
    v1::WatchEventsResponse r;
    while (stream->Read(&r)) {
    }
    stream->Finish();
  }
  void ExplainMatch() {
    v1::ExplainMatchRequest q;
    Tokens(q.mutable_tokens(), 40);
    q.set_namespace_id(in_.ConsumeIntegralInRange<uint64_t>(0, 4));
    q.set_pool(Pool());
    v1::ExplainMatchResponse r;
    stub_->ExplainMatch(Context().get(), q, &r);
  }
  void Evict() {
    v1::EvictRequest q;
    q.set_blocks(in_.ConsumeIntegralInRange<int64_t>(-1, Layout().num_blocks + 1));
    q.set_all(in_.ConsumeBool());
    q.set_pool(Pool());
    v1::EvictResponse r;
    stub_->Evict(Context().get(), q, &r);
  }
  void CheckInvariantsRpc() {
    v1::CheckInvariantsResponse r;
    if (stub_->CheckInvariants(Context().get(), {}, &r).ok()) {
      Require(r.ok(), "the CheckInvariants RPC reports a violation: " + r.violation());
    }
  }
  void SetLogLevel() {
    static const char* const kLevels[] = {"error", "off", "critical", "nonsense", ""};
    v1::SetLogLevelRequest q;
    q.set_level(kLevels[in_.ConsumeIntegralInRange(0, 4)]);
    v1::SetLogLevelResponse r;
    stub_->SetLogLevel(Context().get(), q, &r);
  }
  void Drain() {
    v1::DrainResponse r;
    stub_->Drain(Context().get(), {}, &r);
  }
  void EndSession() {
    const int caller = in_.ConsumeIntegralInRange(0, kCallers - 2);
    if (!sessions_[caller]) return;
    engine_->EndSession(sessions_[caller]->id, in_.ConsumeBool()
                                                   ? daemon::SessionEnd::kDetached
                                                   : daemon::SessionEnd::kConnectionLost);
    ended_.push_back(std::move(sessions_[caller]));
    if (!engine_->draining()) Open(caller);
  }

  FuzzedDataProvider& in_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<daemon::KvPoolService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::KvPool::Stub> stub_;
  std::shared_ptr<const Session> sessions_[kCallers - 1];
  std::vector<std::shared_ptr<const Session>> ended_;
  std::vector<uint64_t> ids_;
  std::vector<uint64_t> pins_;
};

}  // namespace
}  // namespace kvpool::fuzz

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  kvpool::fuzz::QuietLogs();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  {
    kvpool::fuzz::World world(&in);
    for (int op = 0; op < kvpool::fuzz::kMaxOps && in.remaining_bytes() > 0; ++op) world.RunOne();
  }
  kvpool::fuzz::QuietLogs();  // a SetLogLevel call may have changed it
  return 0;
}
