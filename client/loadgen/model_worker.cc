#include "client/loadgen/internal/model_worker.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "fmt/format.h"

namespace kvpool::loadgen::internal {
namespace {

using Clock = std::chrono::steady_clock;

int64_t Since(Clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
}

}  // namespace

client::Client* ModelWorker::ClientFor(int32_t tenant) {
  std::unique_ptr<client::Client>& c = clients_[tenant];
  if (c == nullptr) {
    absl::StatusOr<std::unique_ptr<client::Client>> made =
        client::Client::Connect({.runtime_dir = options_.runtime_dir,
                                 .client_name = fmt::format("loadgen-{}", getpid()),
                                 .tenant = fmt::format("tenant-{}", tenant),
                                 .model = "loadgen",
                                 .timeout = absl::Seconds(120),
                                 .decode_doorbell = options_.decode_doorbell});
    if (!made.ok()) {
      Error(fmt::format("connect: {}", made.status().ToString()));
      clients_.erase(tenant);
      return nullptr;
    }
    c = *std::move(made);
  }
  return c.get();
}

void ModelWorker::Serve(const workload::Request& request) {
  client::Client* c = ClientFor(request.tenant);
  if (c == nullptr) return;
  const int32_t vocab = c->model_vocab_size();
  if (c->model_name().empty() || vocab <= 0) {
    return Error("the daemon runs no model (model { name: \"none\" }): use --mode=kv");
  }
  // The prompt as the model sees it: the conversation so far (with the replies the model
  // generated), then this turn's new user tokens, folded into the model's vocabulary.
  Conversation& conv = conversations_[request.conversation];
  if (request.turn == 0) conv = Conversation{};
  std::vector<int32_t> prompt = conv.history;
  for (size_t i = std::min(conv.workload_tokens, request.prompt.size()); i < request.prompt.size();
       ++i) {
    prompt.push_back(request.prompt[i] % vocab);
  }
  const int64_t reply = std::max<int64_t>(1, static_cast<int64_t>(request.reply.size()));
  // Fit the model's context and this worker's share of the pool; cutting keeps the beginning,
  // so prefixes still line up across requests.
  const v1::PoolLayout& l = c->layout();
  int64_t room = static_cast<int64_t>(c->model_max_position()) - reply;
  if (options_.max_prompt_tokens > 0) room = std::min(room, options_.max_prompt_tokens);
  room = std::min(room, static_cast<int64_t>(l.num_blocks()) * l.block_size() / 2 /
                                std::max(1, options_.workers) -
                            reply);
  if (room < 1) return Error("the pool is too small for one request per worker");
  if (static_cast<int64_t>(prompt.size()) > room) prompt.resize(static_cast<size_t>(room));

  Clock::time_point start = Clock::now();
  absl::StatusOr<v1::PrefillResponse> first = c->Prefill(0, prompt);
  if (!first.ok()) {
    if (absl::IsResourceExhausted(first.status())) {
      return Send({.kind = Record::Kind::kRequest, .op = Op::kPrefill, .rejected = true});
    }
    return Error(fmt::format("prefill: {}", first.status().ToString()));
  }
  Send({.kind = Record::Kind::kLatency, .op = Op::kPrefill, .a = Since(start)});
  std::vector<int32_t> generated = {first->next_token()};
  client::DecodeItem item{first->sequence_id(), first->next_token()};
  while (static_cast<int64_t>(generated.size()) < reply) {
    start = Clock::now();
    absl::StatusOr<v1::DecodeResponse> next = c->Decode(std::span(&item, 1));
    if (!next.ok()) {
      if (absl::IsResourceExhausted(next.status())) break;  // the pool is full: end the reply
      (void)c->Free({item.sequence_id});
      return Error(fmt::format("decode: {}", next.status().ToString()));
    }
    Send({.kind = Record::Kind::kLatency, .op = Op::kDecode, .a = Since(start)});
    item.token = next->next_tokens(0);
    generated.push_back(item.token);
  }
  // Publish what the model wrote (the prompt and all but the pending last token).
  if (absl::Status s = c->Free({item.sequence_id}, /*commit=*/true); !s.ok()) {
    return Error(fmt::format("free: {}", s.ToString()));
  }
  conv.history = prompt;
  conv.history.insert(conv.history.end(), generated.begin(), generated.end());
  conv.workload_tokens = request.prompt.size() + request.reply.size();
  Send({.kind = Record::Kind::kRequest,
        .a = static_cast<int64_t>(prompt.size()),
        .b = first->reused_tokens(),
        .c = static_cast<int64_t>(generated.size())});
}

void ModelWorker::Error(const std::string& why) {
  std::fprintf(stderr, "\n[loadgen worker %d] %s\n", getpid(), why.c_str());
  Send({.kind = Record::Kind::kError});
}

void ModelWorker::Send(const Record& r) { (void)write(fd_, &r, sizeof(r)); }

}  // namespace kvpool::loadgen::internal
