#include "daemon/engine/admission.h"

#include "daemon/engine/engine_state.h"
#include "fmt/format.h"
#include "kvpool/eviction_policy.h"
#include "kvpool/util/fmt.h"

namespace kvpool::daemon {
namespace {

Verdict Refuse(absl::Status status, Counted counted = Counted::kNone) {
  return {.status = std::move(status), .counted = counted};
}

// "item 3: " in a batch of several, nothing for one.
std::string ItemPrefix(size_t i, size_t n) { return n > 1 ? fmt::format("item {}: ", i) : ""; }

}  // namespace

void Count(Counted counted, CallCounters& counters) {
  switch (counted) {
    case Counted::kNone:
      return;
    case Counted::kSessionEnded:
      ++counters.session_ended;
      return;
    case Counted::kGaveUp:
      ++counters.gave_up;
      return;
    case Counted::kNotPermitted:
      ++counters.not_permitted;
      return;
    case Counted::kOverLimit:
      ++counters.over_limit;
      return;
  }
}

CallAsk AdmissionGate::AskOf(const ComputeCall& call, bool queued) {
  const ComputeRequest& r = call.request();
  const bool creates = r.creates() && call.progress() == nullptr;
  CallAsk ask{.compute = &r, .creates = creates, .sequences = creates ? 1u : 0u, .queues = queued};
  if (r.creates()) {
    ask.salt_bytes.push_back(r.cache_salt.size());
    ask.priorities.push_back(r.priority);
  }
  return ask;
}

Verdict AdmissionGate::Admit(const CallAsk& ask, const CallerFacts& facts) const {
  if (Verdict v = CheckArguments(ask); !v.ok()) return v;
  return CheckCaller(ask, facts);
}

Verdict AdmissionGate::CheckArguments(const CallAsk& ask) const {
  for (size_t i = 0; i < ask.salt_bytes.size(); ++i) {
    if (ask.salt_bytes[i] > kMaxCacheSaltBytes) {
      return Refuse(absl::InvalidArgumentError(fmt::format("{}a cache salt of {} bytes: at most {}",
                                                           ItemPrefix(i, ask.salt_bytes.size()),
                                                           ask.salt_bytes[i], kMaxCacheSaltBytes)));
    }
  }
  for (int32_t priority : ask.priorities) {
    if (priority < 0 || priority >= kNumPriorities) {
      return Refuse(absl::InvalidArgumentError(
          fmt::format("priority {} outside [0, {})", priority, kNumPriorities)));
    }
  }
  if (ask.pin_ttl_ns.has_value() &&
      (*ask.pin_ttl_ns <= 0 || *ask.pin_ttl_ns > bounds_.max_pin_ttl_ns)) {
    return Refuse(
        absl::InvalidArgumentError(fmt::format("pin ttl {} ns outside (0, {}] (max_pin_ttl_ns)",
                                               *ask.pin_ttl_ns, bounds_.max_pin_ttl_ns)));
  }
  if (ask.compute != nullptr) return Refuse(CheckCompute(*ask.compute));
  return {};
}

absl::Status AdmissionGate::CheckCompute(const ComputeRequest& r) const {
  // Per call: a top_k no step can serve fails this call alone, not the step it would join.
  if (r.top_k < 0 || r.top_k > bounds_.vocab_size) {
    return absl::InvalidArgumentError(
        fmt::format("top_k {} outside [0, {}] (the vocabulary)", r.top_k, bounds_.vocab_size));
  }
  if (absl::Status s = CheckSamplingOf(r, bounds_.vocab_size); !s.ok()) return s;
  if (r.prefill() && static_cast<int64_t>(r.tokens.size()) > bounds_.max_position) {
    return absl::OutOfRangeError(
        fmt::format("a prompt of {} tokens: the model's context is {} positions", r.tokens.size(),
                    bounds_.max_position));
  }
  return absl::OkStatus();
}

Verdict AdmissionGate::CheckCaller(const CallAsk& ask, const CallerFacts& facts) const {
  if (!facts.serving.ok()) {
    return Refuse(absl::UnavailableError(
        fmt::format("kvpoold stopped serving: {}", facts.serving.message())));
  }
  if (!facts.live.ok()) return Refuse(facts.live, Counted::kSessionEnded);
  if (!facts.waiting.ok()) return Refuse(facts.waiting, Counted::kGaveUp);
  if (Verdict v = CheckPermission(ask, *facts.session); !v.ok()) return v;
  if (ask.creates && facts.draining) {
    return Refuse(absl::UnavailableError("kvpoold is draining: no new sequences"));
  }
  return CheckLimits(ask, facts);
}

Verdict AdmissionGate::CheckPermission(const CallAsk& ask, const Session& s) const {
  if (s.spec.tenant.empty()) {
    return Refuse(
        absl::PermissionDeniedError("an admin session without a tenant holds no sequences"),
        Counted::kNotPermitted);
  }
  if (ask.kv_access && !s.spec.kv_access) {
    return Refuse(absl::PermissionDeniedError(
                      "a compute-only session may not hold blocks to write or publish KV it "
                      "wrote (attach with KV access, if its tenant grants it)"),
                  Counted::kNotPermitted);
  }
  for (int32_t priority : ask.priorities) {
    if (priority > s.max_priority) {
      return Refuse(
          absl::PermissionDeniedError(fmt::format("priority {} is above tenant {}'s ceiling {}",
                                                  priority, s.spec.tenant, s.max_priority)),
          Counted::kNotPermitted);
    }
  }
  return {};
}

Verdict AdmissionGate::CheckDecodeWidth(size_t sequences) const {
  const int32_t width = bounds_.limits.decode_width;
  if (sequences > static_cast<size_t>(width)) {
    return Refuse(
        absl::ResourceExhaustedError(fmt::format(
            "a decode of {} sequences: at most {} (limits.decode_width)", sequences, width)),
        Counted::kOverLimit);
  }
  return {};
}

Verdict AdmissionGate::CheckStopTokens(size_t tokens) const {
  const int32_t most = bounds_.limits.stop_tokens;
  if (tokens > static_cast<size_t>(most)) {
    return Refuse(absl::ResourceExhaustedError(fmt::format(
                      "generate: {} stop tokens, at most {} (limits.stop_tokens)", tokens, most)),
                  Counted::kOverLimit);
  }
  return {};
}

Verdict AdmissionGate::CheckLimits(const CallAsk& ask, const CallerFacts& facts) const {
  const ClientLimits& limits = bounds_.limits;
  if (ask.items > static_cast<size_t>(limits.batch_items)) {
    return Refuse(absl::ResourceExhaustedError(
                      fmt::format("{} items in one call: at most {} (limits.batch_items)",
                                  ask.items, limits.batch_items)),
                  Counted::kOverLimit);
  }
  // The pool's manager enforces this bound too; checked here first so that it is counted.
  if (ask.sequences > 0 &&
      facts.held_sequences + static_cast<int64_t>(ask.sequences) > limits.sequences_per_session) {
    return Refuse(
        absl::ResourceExhaustedError(fmt::format(
            "session {} holds {} sequences: at most {} (limits.sequences_per_session)",
            facts.session->id.value(), facts.held_sequences, limits.sequences_per_session)),
        Counted::kOverLimit);
  }
  const ComputeRequest* r = ask.compute;
  if (r != nullptr && !r->prefill()) {
    if (Verdict v = CheckDecodeWidth(r->decode.size()); !v.ok()) return v;
  }
  if (ask.queues && facts.queued_calls > limits.queued_calls_per_session) {
    return Refuse(absl::ResourceExhaustedError(
                      fmt::format("session {} has {} compute calls queued or running already "
                                  "(limits.queued_calls_per_session)",
                                  facts.session->id.value(), limits.queued_calls_per_session)),
                  Counted::kOverLimit);
  }
  return {};
}

}  // namespace kvpool::daemon
