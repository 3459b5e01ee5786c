#include "workload/generated.h"

#include <algorithm>
#include <random>

namespace kvpool::workload {
namespace {

void AppendRandom(std::mt19937_64* rng, int32_t n, int32_t vocab, std::vector<int32_t>* out) {
  for (int32_t i = 0; i < n; ++i) out->push_back(static_cast<int32_t>((*rng)() % vocab));
}

int32_t Between(std::mt19937_64* rng, int32_t lo, int32_t hi) {
  return lo + static_cast<int32_t>((*rng)() % static_cast<uint64_t>(std::max(1, hi - lo + 1)));
}

}  // namespace

std::vector<Request> GenerateConversations(const GeneratorOptions& o) {
  std::mt19937_64 rng(o.seed);
  std::vector<std::vector<int32_t>> system(static_cast<size_t>(o.tenants));
  for (auto& prompt : system) AppendRandom(&rng, o.system_prompt_tokens, o.vocab, &prompt);
  // history[c]: conversation c so far (system prompt, earlier turns).
  std::vector<std::vector<int32_t>> history(static_cast<size_t>(o.conversations));
  for (int32_t c = 0; c < o.conversations; ++c) history[c] = system[c % o.tenants];
  std::vector<Request> out;
  for (int32_t turn = 0; turn < o.turns; ++turn) {
    for (int32_t c = 0; c < o.conversations; ++c) {
      Request r{.tenant = c % o.tenants, .conversation = c, .turn = turn};
      AppendRandom(&rng, Between(&rng, o.user_tokens_min, o.user_tokens_max), o.vocab, &history[c]);
      r.prompt = history[c];
      AppendRandom(&rng, Between(&rng, o.reply_tokens_min, o.reply_tokens_max), o.vocab, &r.reply);
      history[c].insert(history[c].end(), r.reply.begin(), r.reply.end());
      out.push_back(std::move(r));
    }
  }
  return out;
}

std::vector<Request> FromTrace(const std::vector<TraceRequest>& trace, int64_t max_prompt_tokens,
                               int64_t max_reply_tokens, int32_t vocab) {
  std::vector<Request> out;
  std::mt19937_64 rng(7);
  for (size_t i = 0; i < trace.size(); ++i) {
    Request r{.conversation = static_cast<int32_t>(i)};
    r.prompt = ExpandTokens(trace[i], vocab);
    if (max_prompt_tokens > 0 && static_cast<int64_t>(r.prompt.size()) > max_prompt_tokens) {
      r.prompt.resize(static_cast<size_t>(max_prompt_tokens));
    }
    int64_t reply = trace[i].output_length;
    if (max_reply_tokens > 0) reply = std::min(reply, max_reply_tokens);
    AppendRandom(&rng, static_cast<int32_t>(std::max<int64_t>(1, reply)), vocab, &r.reply);
    out.push_back(std::move(r));
  }
  return out;
}

}  // namespace kvpool::workload
