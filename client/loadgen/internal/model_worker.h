#pragma once

// A kvpool-loadgen worker in model mode: a frontend with no model of its own that gets its
// tokens from the daemon. Each request is a Prefill of the prompt (the time to first token)
// and one Decode per further reply token (the inter-token latency); then the sequence is freed
// with commit, so the next turn of the conversation (whose prompt is this turn's prompt, the
// reply the model really generated, and a new user message) reuses it through the prefix cache.

#include <map>
#include <memory>
#include <vector>

#include "client/client.h"
#include "client/loadgen/internal/record.h"
#include "client/loadgen/loadgen.h"
#include "workload/generated.h"

namespace kvpool::loadgen::internal {

class ModelWorker final {
 public:
  ModelWorker(const Options& options, int fd) : options_(options), fd_(fd) {}
  void Serve(const workload::Request& request);

 private:
  struct Conversation {
    std::vector<int32_t> history;  // the model's view: prompts and the replies it generated
    size_t workload_tokens = 0;    // the workload's view of the same turns (prompt + reply)
  };
  client::Client* ClientFor(int32_t tenant);
  void Send(const Record& r);
  void Error(const std::string& why);

  const Options& options_;
  const int fd_;
  std::map<int32_t, std::unique_ptr<client::Client>> clients_;
  std::map<int32_t, Conversation> conversations_;
};

}  // namespace kvpool::loadgen::internal
