#pragma once

// AdmissionGate: whether the engine takes a call, decided in one place. Pure policy (no threads,
// no clock, no pool): the engine gathers what it knows of the caller under its lock
// (CallerFacts), asks the gate, and counts the refusal the gate names; tests drive the gate call
// by call (tests/daemon/admission_test.cc).
//
// Every call passes the same stages in this order, and the first refusal is the answer, so a
// call wrong in two ways always gets the same code, whichever RPC carries it:
//   1. arguments   the call's own values against fixed bounds, before anything about the caller:
//                  a cache salt over kMaxCacheSaltBytes, a priority class outside
//                  [0, kNumPriorities), a pin ttl outside (0, max_pin_ttl_ns], top_k outside
//                  [0, vocabulary], sampling out of range: INVALID_ARGUMENT; a
//                  prompt longer than the model's context: OUT_OF_RANGE. Not counted.
//   2. serving     the engine stopped after a device failure: UNAVAILABLE. Not counted.
//   3. identity    the session has ended: NOT_FOUND (counted: session_ended); the caller of a
//                  queued compute call gave up: its CANCELLED / DEADLINE_EXCEEDED (gave_up).
//   4. permission  a session without a tenant (admin only) holds nothing; a compute-only session
//                  may not hold blocks to write nor publish KV; a priority above the tenant's
//                  ceiling: PERMISSION_DENIED (not_permitted).
//   5. state       a call that makes sequences while the engine drains: UNAVAILABLE. Not counted.
//   6. limits      ClientLimits: batch_items, sequences_per_session, decode_width,
//                  queued_calls_per_session: RESOURCE_EXHAUSTED (over_limit).
// What needs the pool (an unknown or another session's sequence, free blocks, quotas, a token
// outside the vocabulary) is the KvCacheManager's and the step planner's, after the gate. The
// gRPC edge keeps only what the wire itself bounds (parallel arrays of equal length, which of
// two fields is set, top_k against what a response carries, how many sets of sampling
// parameters), and asks for a Decode's width bound (CheckDecodeWidth, through
// Engine::CheckDecodeWidth) once it knows the caller and before it builds anything per sequence:
// a Decode over limits.decode_width is refused for that even when its sampling values are wrong
// too.
//
// Thread-compatible; const methods only, safe to share.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>

#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "daemon/engine/compute_call.h"
#include "daemon/engine/engine_options.h"
#include "daemon/engine/session.h"

namespace kvpool::daemon {

struct CallCounters;

// What a call asks, as the gate sees it. Spans are not owned and outlive the check.
struct CallAsk {
  // --- Arguments ---
  absl::InlinedVector<size_t, 1> salt_bytes;   // each cache salt's length (items in order)
  absl::InlinedVector<int32_t, 1> priorities;  // each prefix-cache class asked for
  std::optional<int64_t> pin_ttl_ns;           // a pin's time to live
  const ComputeRequest* compute = nullptr;     // a Prefill or Decode (not owned)
  // --- What it needs of the session and the engine ---
  bool creates = false;    // makes sequences: not while draining
  bool kv_access = false;  // hands out blocks to write, or publishes what a client wrote
  size_t items = 0;        // a batch of this many (limits.batch_items)
  size_t sequences = 0;    // makes this many sequences (limits.sequences_per_session)
  bool queues = false;     // a compute call joining the queue (limits.queued_calls_per_session)
};

// What the engine knows of the caller when it asks (under its lock, but for queued_calls, which
// the call's own ComputeCall keeps).
struct CallerFacts {
  const Session* session = nullptr;  // not owned
  absl::Status serving;              // the engine's health
  absl::Status live;                 // EngineState::CheckLive of the session
  absl::Status waiting;              // the caller's CallContext::Check() (queued calls)
  bool draining = false;
  int64_t held_sequences = 0;  // live sequences the session holds in its pool
  int64_t queued_calls = 0;    // its compute calls queued or running, this one included
};

// Which counter a refusal goes to (CallCounters); kNone for a call taken or a refusal that is
// not counted.
enum class Counted : uint8_t { kNone, kSessionEnded, kGaveUp, kNotPermitted, kOverLimit };

struct Verdict {
  absl::Status status;  // OK: admitted
  Counted counted = Counted::kNone;
  bool ok() const { return status.ok(); }
};

// The one place refusals are counted.
void Count(Counted counted, CallCounters& counters);

// Fixed at engine creation.
struct AdmissionBounds {
  int32_t vocab_size = 0;    // the model's; 0: no model (no compute call is admitted)
  int32_t max_position = 0;  // the model's context, in tokens
  int64_t max_pin_ttl_ns = 0;
  ClientLimits limits;
};

class AdmissionGate final {
 public:
  explicit AdmissionGate(const AdmissionBounds& bounds) : bounds_(bounds) {}

  // Stage 1 alone: needs nothing but the call, so the engine asks it before taking its lock.
  Verdict CheckArguments(const CallAsk& ask) const;
  // Stages 2 to 6, against what the engine knows now. REQUIRES: facts.session != nullptr.
  Verdict CheckCaller(const CallAsk& ask, const CallerFacts& facts) const;
  // Every stage in order.
  Verdict Admit(const CallAsk& ask, const CallerFacts& facts) const;
  // Stage 6's bound on a Decode of `sequences` alone (limits.decode_width): RESOURCE_EXHAUSTED
  // (over_limit) above it.
  Verdict CheckDecodeWidth(size_t sequences) const;
  // A Generate's stop tokens (limits.stop_tokens), which its stream keeps for its whole life:
  // RESOURCE_EXHAUSTED (over_limit) above it.
  Verdict CheckStopTokens(size_t tokens) const;

  // The ask of a compute call: `queued` when it joins the queue now (Submit), false when its
  // step plans it (the queue limit was checked on the way in; a prefill between chunks makes no
  // new sequence).
  static CallAsk AskOf(const ComputeCall& call, bool queued);

  const AdmissionBounds& bounds() const { return bounds_; }

 private:
  absl::Status CheckCompute(const ComputeRequest& r) const;
  Verdict CheckPermission(const CallAsk& ask, const Session& s) const;
  Verdict CheckLimits(const CallAsk& ask, const CallerFacts& facts) const;

  const AdmissionBounds bounds_;
};

}  // namespace kvpool::daemon
