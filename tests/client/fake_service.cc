// FakeKvPoolService (fake_daemon.h): scripted answers for the client tests.

#include <chrono>
#include <thread>

#include "fmt/format.h"
#include "kvpool/v1/wire.h"
#include "tests/client/fake_daemon.h"

namespace kvpool::client::testing {

grpc::Status FakeKvPoolService::Record(grpc::ServerContext* context, bool admin) {
  std::string token;
  const auto& metadata = context->client_metadata();
  if (auto it = metadata.find(wire::kSessionTokenKey); it != metadata.end()) {
    token.assign(it->second.data(), it->second.size());
  }
  absl::MutexLock lock(&mu_);
  tokens_.push_back(token);
  if (token.empty()) return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "no session token");
  if (admin && deny_admin_) {
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED, "session 42 is not an admin");
  }
  return grpc::Status::OK;
}

void FakeKvPoolService::set_deny_admin(bool deny) {
  absl::MutexLock lock(&mu_);
  deny_admin_ = deny;
}

void FakeKvPoolService::set_malformed(bool malformed) {
  absl::MutexLock lock(&mu_);
  malformed_ = malformed;
}

std::vector<std::string> FakeKvPoolService::tokens() const {
  absl::MutexLock lock(&mu_);
  return tokens_;
}

std::string FakeKvPoolService::log_level() const {
  absl::MutexLock lock(&mu_);
  return log_level_;
}

grpc::Status FakeKvPoolService::Ping(grpc::ServerContext* context, const v1::PingRequest*,
                                     v1::PingResponse*) {
  return Record(context, false);
}

grpc::Status FakeKvPoolService::Allocate(grpc::ServerContext* context,
                                         const v1::AllocateRequest* request,
                                         v1::AllocateResponse* response) {
  if (grpc::Status s = Record(context, false); !s.ok()) return s;
  int32_t next_block = 0;
  for (int i = 0; i < request->items_size(); ++i) {
    const v1::AllocateItem& item = request->items(i);
    v1::SequenceInfo* info = response->add_sequences();
    info->set_sequence_id(100 + static_cast<uint64_t>(i));
    info->set_num_tokens(item.num_tokens());
    info->set_matched_tokens(item.prompt_size() / 2);
    for (int64_t t = 0; t < item.num_tokens(); t += 4) {
      info->add_block_ids(next_block++);
      info->add_generations(1);
    }
  }
  absl::MutexLock lock(&mu_);
  if (malformed_ && response->sequences_size() > 0) {
    response->mutable_sequences(0)->add_block_ids(15);
  }
  return grpc::Status::OK;
}

grpc::Status FakeKvPoolService::Grow(grpc::ServerContext* context, const v1::GrowRequest*,
                                     v1::GrowResponse*) {
  if (grpc::Status s = Record(context, false); !s.ok()) return s;
  context->AddTrailingMetadata(wire::kShortfallKey, "pool:3");
  return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "Grow: pool short by 3 blocks");
}

grpc::Status FakeKvPoolService::Fork(grpc::ServerContext* context, const v1::ForkRequest* request,
                                     v1::ForkResponse* response) {
  if (grpc::Status s = Record(context, false); !s.ok()) return s;
  if (request->sequence_id() != 100) {
    return grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown sequence");
  }
  response->mutable_sequence()->set_sequence_id(101);
  response->mutable_sequence()->add_block_ids(0);
  response->mutable_sequence()->add_generations(1);
  return grpc::Status::OK;
}

grpc::Status FakeKvPoolService::Free(grpc::ServerContext* context, const v1::FreeRequest* request,
                                     v1::FreeResponse*) {
  if (grpc::Status s = Record(context, false); !s.ok()) return s;
  if (request->sequence_ids_size() != 2 || !request->commit()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "want two ids and commit");
  }
  return grpc::Status::OK;
}

grpc::Status FakeKvPoolService::GetStats(grpc::ServerContext* context, const v1::GetStatsRequest*,
                                         v1::GetStatsResponse* response) {
  if (grpc::Status s = Record(context, true); !s.ok()) return s;
  response->set_num_blocks(16);
  response->set_free_blocks(10);
  response->set_active_blocks(4);
  response->set_cached_blocks(2);
  response->set_prompt_tokens(200);
  response->set_hit_tokens(50);
  response->set_epoch(3);
  response->set_device("cpu");
  response->set_uptime_seconds(3723.5);
  return grpc::Status::OK;
}

grpc::Status FakeKvPoolService::ListSessions(grpc::ServerContext* context,
                                             const v1::ListSessionsRequest*,
                                             v1::ListSessionsResponse* response) {
  if (grpc::Status s = Record(context, true); !s.ok()) return s;
  v1::SessionInfo* a = response->add_sessions();
  a->set_session_id(42);
  a->set_client_name("kvpoolctl");
  a->set_pid(1234);
  a->set_tenant("default");
  a->set_model("default");
  a->set_namespace_id(7);
  a->set_admin(true);
  v1::SessionInfo* b = response->add_sessions();
  b->set_session_id(43);
  b->set_client_name("vllm-worker-0");
  b->set_pid(99999);
  b->set_tenant("acme");
  b->set_model("llama-3-8b");
  b->set_namespace_id(0xabcdef);
  b->set_sequences(12);
  b->set_block_refs(340);
  b->set_attached_seconds(75);
  return grpc::Status::OK;
}

grpc::Status FakeKvPoolService::ListSequences(grpc::ServerContext* context,
                                              const v1::ListSequencesRequest* request,
                                              v1::ListSequencesResponse* response) {
  if (grpc::Status s = Record(context, true); !s.ok()) return s;
  for (uint64_t owner : {uint64_t{42}, uint64_t{43}}) {
    if (request->session_id() != 0 && request->session_id() != owner) continue;
    v1::SequenceInfo* info = response->add_sequences();
    info->set_sequence_id(owner * 10);
    info->set_num_tokens(owner == 42 ? 5 : 40);
    for (int b = 0; b < (owner == 42 ? 2 : 10); ++b) {
      info->add_block_ids(b);
      info->add_generations(1);
    }
    response->add_session_ids(owner);
  }
  return grpc::Status::OK;
}

grpc::Status FakeKvPoolService::DumpBlockTrace(grpc::ServerContext* context,
                                               const v1::DumpBlockTraceRequest* request,
                                               v1::DumpBlockTraceResponse* response) {
  if (grpc::Status s = Record(context, true); !s.ok()) return s;
  const v1::DumpBlockTraceResponse all = SampleTrace();
  for (const v1::TraceEntry& e : all.entries()) {
    if (request->all() || e.block_id() == request->block_id()) *response->add_entries() = e;
  }
  return grpc::Status::OK;
}

grpc::Status FakeKvPoolService::WatchEvents(grpc::ServerContext* context,
                                            const v1::WatchEventsRequest* request,
                                            grpc::ServerWriter<v1::WatchEventsResponse>* writer) {
  if (grpc::Status s = Record(context, true); !s.ok()) return s;
  v1::WatchEventsResponse snapshot;
  snapshot.set_snapshot(true);
  snapshot.set_resume_seq(11);
  v1::KvEvent* cached = snapshot.add_events();
  cached->set_type(v1::KvEvent::TYPE_BLOCK_STORED);
  cached->set_epoch(3);
  cached->set_namespace_id(7);
  cached->add_block_hashes()->set_lo(1);
  cached->set_block_size(4);
  cached->add_token_ids(1);
  writer->Write(snapshot);
  if (request->follow()) {
    follower_started_.Notify();
    // The sync API offers no cancellation callback; poll until the client goes away.
    while (!context->IsCancelled()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return grpc::Status::CANCELLED;
  }
  for (uint64_t seq = request->from_seq(); seq < request->from_seq() + 2; ++seq) {
    v1::WatchEventsResponse message;
    v1::KvEvent* e = message.add_events();
    e->set_seq(seq);
    e->set_epoch(3);
    e->set_namespace_id(7);
    e->set_type(seq % 2 == 0 ? v1::KvEvent::TYPE_BLOCK_STORED : v1::KvEvent::TYPE_BLOCK_REMOVED);
    v1::BlockHash* hash = e->add_block_hashes();
    hash->set_hi(0xfeed);
    hash->set_lo(seq);
    if (!writer->Write(message)) break;
  }
  return grpc::Status::OK;
}

grpc::Status FakeKvPoolService::ExplainMatch(grpc::ServerContext* context,
                                             const v1::ExplainMatchRequest* request,
                                             v1::ExplainMatchResponse* response) {
  if (grpc::Status s = Record(context, true); !s.ok()) return s;
  response->set_matched_tokens(request->tokens_size() / 2);
  response->set_stop("diverged");
  response->set_explanation(fmt::format("namespace {}: {} tokens; diverged at token {}",
                                        request->namespace_id(), request->tokens_size(),
                                        request->tokens_size() / 2));
  return grpc::Status::OK;
}

grpc::Status FakeKvPoolService::Evict(grpc::ServerContext* context, const v1::EvictRequest* request,
                                      v1::EvictResponse* response) {
  if (grpc::Status s = Record(context, true); !s.ok()) return s;
  response->set_evicted(request->all() ? 9 : request->blocks());
  return grpc::Status::OK;
}

grpc::Status FakeKvPoolService::CheckInvariants(grpc::ServerContext* context,
                                                const v1::CheckInvariantsRequest*,
                                                v1::CheckInvariantsResponse* response) {
  if (grpc::Status s = Record(context, true); !s.ok()) return s;
  response->set_ok(false);
  response->set_violation("free + active + cached + retiring = 15 != 16");
  return grpc::Status::OK;
}

grpc::Status FakeKvPoolService::SetLogLevel(grpc::ServerContext* context,
                                            const v1::SetLogLevelRequest* request,
                                            v1::SetLogLevelResponse*) {
  if (grpc::Status s = Record(context, true); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  log_level_ = request->level();
  return grpc::Status::OK;
}

grpc::Status FakeKvPoolService::Drain(grpc::ServerContext* context, const v1::DrainRequest*,
                                      v1::DrainResponse* response) {
  if (grpc::Status s = Record(context, true); !s.ok()) return s;
  response->set_sequences(2);
  return grpc::Status::OK;
}

}  // namespace kvpool::client::testing
