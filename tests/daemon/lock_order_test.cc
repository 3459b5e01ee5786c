// The daemon's lock order (docs/threads-and-locks.md, "Lock order") taken on the real mutexes of
// real objects under Abseil's deadlock detector, set to abort. The detector remembers every
// "acquired while holding" edge of the process: once the documented order is on record, any code
// of this process that takes two of these locks the other way round closes a cycle and aborts
// the test. The test then drives real calls through the engine, its tiers, an event listener,
// a doorbell and the attach server, so that their own nested acquisitions are checked against
// the documented order as well.
//
// Not reachable from here: EventWriter::mu_ (a reactor private to the gRPC service, which exists
// only inside a call), the device's stream locks and the stores' leaf
// locks (no lock of theirs is taken while holding one of them).

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "daemon/edge/attach_server.h"
#include "daemon/edge/decode_doorbell.h"
#include "daemon/edge/service.h"
#include "daemon/engine/engine.h"
#include "daemon/engine/tiers.h"
#include "gtest/gtest.h"
#include "tests/daemon/engine_test_util.h"

namespace kvpool::daemon {

// Friend of each class whose lock is on the documented chain.
struct LockOrderPeer {
  static absl::Mutex& Mu(Engine& e) { return e.mu_; }
  static absl::Mutex& InvalidationMu(Engine& e) { return e.invalidation_mu_; }
  static absl::Mutex& ListenersMu(Engine& e) { return e.listeners_mu_; }
  static absl::Mutex& Mu(TierSet& t) { return t.mu_; }
  static TierSet& Tiers(Engine& e) { return *e.tiers_.at(0); }
  static absl::Mutex& Mu(Doorbells& d) { return d.mu_; }
  static absl::Mutex& Mu(DecodeDoorbell& d) { return d.mu_; }
  static absl::Mutex& WritersMu(KvPoolService& s) { return s.writers_mu_; }
  static absl::Mutex& CallsMu(KvPoolService& s) { return s.calls_mu_; }
  static absl::Mutex& Mu(AttachServer& a) { return a.mu_; }
  static absl::Mutex& CloserMu(AttachServer& a) { return a.closer_->mu_; }
};

namespace {

using testing::FailingDevice;
using testing::Prompt;
using testing::SmallPool;
using testing::Spec;

// One lock of the chain: taken as writer or as reader.
struct Link {
  absl::Mutex* mu;
  bool reader = false;
};

// Takes `chain` in order, outermost first, and releases it innermost first. (Locks chosen at run
// time: clang's static analysis cannot follow them; the deadlock detector does.)
void TakeInOrder(const std::vector<Link>& chain) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  for (const Link& l : chain) l.reader ? l.mu->ReaderLock() : l.mu->Lock();
  for (auto it = chain.rbegin(); it != chain.rend(); ++it) {
    it->reader ? it->mu->ReaderUnlock() : it->mu->Unlock();
  }
}

class LockOrderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kAbort);
    EngineOptions options = SmallPool(8, &clock_);
    options.tiers.host_blocks = 16;
    engine_ = std::move(*Engine::Create(options, &device_, nullptr));
    service_ = std::make_unique<KvPoolService>(engine_.get(), &clock_);
    engine_->AddEventListener(service_.get());
    session_ = *engine_->OpenSession(Spec("tenant-a", "alice"));
    UniqueFd client_fd;
    absl::StatusOr<std::unique_ptr<DecodeDoorbell>> doorbell = DecodeDoorbell::Start(
        session_, [](std::unique_ptr<ComputeCall> call) { call->Complete(); }, {}, &client_fd,
        &clock_);
    ASSERT_TRUE(doorbell.ok()) << doorbell.status();
    doorbell_ = doorbell->get();
    doorbells_.Add(session_->id, *std::move(doorbell));
    dir_ = ::testing::TempDir() + "/lock-order-" + std::to_string(getpid());
    std::filesystem::create_directories(dir_);
    absl::StatusOr<std::unique_ptr<AttachServer>> attach = AttachServer::Start(
        dir_ + "/attach.sock", 0600, {.refuse_peer_fds_in_kernel = false},  // with its closer
        [](const PeerCredentials&) { return absl::PermissionDeniedError("no"); },
        [](const PeerCredentials&, const v1::AttachRequest&) -> absl::StatusOr<AttachReply> {
          return absl::PermissionDeniedError("no");
        },
        [](SessionId, SessionEnd) {}, &counters_, &clock_);
    ASSERT_TRUE(attach.ok()) << attach.status();
    attach_ = *std::move(attach);
  }
  void TearDown() override {
    attach_.reset();
    doorbells_.StopAll();
    engine_->RemoveEventListener(service_.get());
    service_.reset();
    engine_.reset();
    std::filesystem::remove_all(dir_);
  }

  // docs/threads-and-locks.md, "Lock order": the engine's chain, then the listeners' chain.
  // AttachServer::mu_, its FdCloser::mu_ and KvPoolService::calls_mu_ are leaves: last under
  // every other.
  std::vector<Link> EngineChain() {
    return {{&P::Mu(doorbells_)},            // Doorbells::mu_
            {&P::Mu(*doorbell_)},            // DecodeDoorbell::mu_
            {&P::InvalidationMu(*engine_)},  // Engine::invalidation_mu_
            {&P::Mu(*engine_)},              // Engine::mu_
            {&P::Mu(P::Tiers(*engine_))},    // TierSet::mu_
            {&P::CallsMu(*service_)},        // a leaf
            {&P::Mu(*attach_)},              // a leaf
            {&P::CloserMu(*attach_)}};       // a leaf
  }
  std::vector<Link> ListenersChain() {
    return {{&P::ListenersMu(*engine_), /*reader=*/true},
            {&P::WritersMu(*service_)},
            {&P::Mu(*engine_), /*reader=*/true},
            {&P::Mu(P::Tiers(*engine_))},
            {&P::Mu(*attach_)},
            {&P::CloserMu(*attach_)}};
  }

  using P = LockOrderPeer;
  ManualClock clock_;
  FailingDevice device_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<KvPoolService> service_;
  std::shared_ptr<const Session> session_;
  Doorbells doorbells_;
  DecodeDoorbell* doorbell_ = nullptr;  // owned by doorbells_
  std::string dir_;
  AttachCounters counters_;
  std::unique_ptr<AttachServer> attach_;
};

TEST_F(LockOrderTest, TheDocumentedOrderAndTheDaemonsOwnCallsAgree) {
  TakeInOrder(EngineChain());
  TakeInOrder(ListenersChain());
  // Real calls, each with its own nested acquisitions: an allocation that publishes (the
  // listeners run), its blocks staged for the host tier, a flush, an eviction and a promotion
  // back from the host tier.
  const std::vector<int32_t> prompt = Prompt(32, 1);
  const AllocateRequest request{.num_tokens = 32, .prompt = prompt};
  for (int round = 0; round < 2; ++round) {
    absl::StatusOr<Tables> t =
        engine_->Allocate(*session_, std::span(&request, 1), CallContext::Uncancellable());
    ASSERT_TRUE(t.ok()) << t.status();
    const SequenceId id = t->slices[0].sequence;
    ASSERT_TRUE(
        engine_->Free(*session_, std::span(&id, 1), OnFree::kCommit, CallContext::Uncancellable())
            .ok());
    ASSERT_TRUE(engine_->FlushTiers(absl::Seconds(10)).ok());
    ASSERT_TRUE(engine_->Evict(0, 0, /*all=*/true).ok());
  }
  EXPECT_GE(engine_->Stats().tiers.promoted_from_host, 1u);
  doorbells_.Remove(session_->id);
  attach_->StopAccepting();
  // And the order once more, after every edge the calls added.
  TakeInOrder(EngineChain());
}

// The detector is on and these are the locks it watches: two of them taken against the
// documented order, after it is on record, abort the process.
TEST_F(LockOrderTest, TakingTwoLocksAgainstTheOrderAborts) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kAbort);
        TakeInOrder(EngineChain());
        TakeInOrder({{&P::Mu(P::Tiers(*engine_))}, {&P::Mu(*engine_)}});
      },
      "potential deadlock");
}

}  // namespace
}  // namespace kvpool::daemon
