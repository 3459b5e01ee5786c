#pragma once

// A generated serving workload, deterministic for a seed: a few tenants, each with its own system
// prompt, and multi-turn conversations. Turn k's prompt is the system prompt, every earlier turn
// (user message and reply) and a new user message, so consecutive turns share a growing prefix
// and conversations of one tenant share the system prompt: what a prefix cache lives on.
//
// The default workload of kvpool-loadgen (a fresh machine has no trace files).

#include <cstdint>
#include <vector>

#include "workload/mooncake_trace.h"

namespace kvpool::workload {

struct GeneratorOptions {
  uint64_t seed = 1;
  int32_t tenants = 3;
  int32_t conversations = 24;  // over all tenants
  int32_t turns = 4;           // per conversation
  int32_t system_prompt_tokens = 512;
  int32_t user_tokens_min = 32;
  int32_t user_tokens_max = 256;
  int32_t reply_tokens_min = 16;
  int32_t reply_tokens_max = 128;
  int32_t vocab = 32000;
};

struct Request {
  int32_t tenant = 0;
  int32_t conversation = 0;
  int32_t turn = 0;
  std::vector<int32_t> prompt;
  std::vector<int32_t> reply;  // the tokens the serving engine generates for it
};

// Every turn of every conversation, in arrival order: turn 0 of each conversation, then turn 1 of
// each, and so on (a conversation's turns arrive in order, interleaved with others').
std::vector<Request> GenerateConversations(const GeneratorOptions& options);

// A Mooncake trace as requests: one tenant, prompts expanded from the hash ids and cut to
// `max_prompt_tokens` (0: no cut; a cut keeps the sharing structure), replies of output_length
// (at most `max_reply_tokens`) deterministic tokens.
std::vector<Request> FromTrace(const std::vector<TraceRequest>& trace, int64_t max_prompt_tokens,
                               int64_t max_reply_tokens, int32_t vocab = kDefaultVocab);

}  // namespace kvpool::workload
