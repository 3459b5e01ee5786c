// DecodeDoorbell and Doorbells (daemon/edge/decode_doorbell.h) with the engine replaced by a queue
// of submitted calls the test completes by hand, and the client's side played by writing the
// page directly, the way any process holding the descriptor could.

#include "daemon/edge/decode_doorbell.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace kvpool::daemon {
namespace {

// The calls the doorbell submitted, held until the test completes them.
class FakeEngine {
 public:
  DecodeDoorbell::SubmitFn Submit() {
    return [this](std::unique_ptr<ComputeCall> call) {
      absl::MutexLock lock(&mu_);
      calls_.push_back(std::move(call));
    };
  }
  // Waits for the next submitted call (null after 5 s).
  std::unique_ptr<ComputeCall> Next() {
    absl::MutexLock lock(&mu_);
    if (!mu_.AwaitWithTimeout(absl::Condition(this, &FakeEngine::HasCalls), absl::Seconds(5))) {
      return nullptr;
    }
    std::unique_ptr<ComputeCall> c = std::move(calls_.front());
    calls_.pop_front();
    return c;
  }
  size_t queued() {
    absl::MutexLock lock(&mu_);
    return calls_.size();
  }

 private:
  bool HasCalls() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !calls_.empty(); }

  absl::Mutex mu_;
  std::deque<std::unique_ptr<ComputeCall>> calls_ ABSL_GUARDED_BY(mu_);
};

// The client's end: the page mapped from the descriptor the client receives.
class Page {
 public:
  explicit Page(UniqueFd fd) : fd_(std::move(fd)) {
    void* p = mmap(nullptr, wire::kDoorbellBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_.get(), 0);
    EXPECT_NE(p, MAP_FAILED);
    page_ = static_cast<wire::DoorbellPage*>(p);
  }
  ~Page() { munmap(page_, wire::kDoorbellBytes); }
  wire::DoorbellPage* operator->() { return page_; }
  int fd() const { return fd_.get(); }

  uint32_t Ring(std::initializer_list<wire::DoorbellItem> items) {
    uint32_t i = 0;
    for (const wire::DoorbellItem& item : items) page_->items[i++] = item;
    page_->num_items = i;
    page_->timeout_ns = timeout_ns;
    return RingRaw();
  }
  uint32_t RingRaw() {
    const uint32_t r = page_->ring.load() + 1;
    page_->ring.store(r, std::memory_order_release);
    wire::FutexWakeAll(&page_->ring);
    return r;
  }
  // Waits until `ring` is answered (false after 5 s).
  bool Answered(uint32_t ring) {
    const absl::Time until = absl::Now() + absl::Seconds(5);
    while (page_->answered.load(std::memory_order_acquire) != ring) {
      if (absl::Now() > until) return false;
      absl::SleepFor(absl::Microseconds(100));
    }
    return true;
  }
  std::string message() const { return std::string(page_->message, page_->message_bytes); }

  int64_t timeout_ns = 10'000'000'000;  // what Ring() writes

 private:
  UniqueFd fd_;
  wire::DoorbellPage* page_ = nullptr;
};

std::shared_ptr<const Session> MakeSession() {
  auto s = std::make_shared<Session>();
  s->id = SessionId(7);
  return s;
}

struct Fixture {
  // The doorbell's clock: deadlines and back-offs move only when the test says so.
  ManualClock clock{1'000'000'000};
  FakeEngine engine;
  // Answers as the hook saw them. The hook may take its time, as on a loaded daemon: it must
  // still run before the client sees the answer.
  std::atomic<int> counted{0};
  UniqueFd client_fd;
  std::unique_ptr<DecodeDoorbell> doorbell;

  explicit Fixture(absl::Duration counted_delay = absl::ZeroDuration()) {
    absl::StatusOr<std::unique_ptr<DecodeDoorbell>> d =
        DecodeDoorbell::Start(MakeSession(), engine.Submit(),
                              {.counted =
                                   [this, counted_delay] {
                                     absl::SleepFor(counted_delay);
                                     counted.fetch_add(1);
                                   }},
                              &client_fd, &clock);
    EXPECT_TRUE(d.ok()) << d.status();
    doorbell = *std::move(d);
  }
};

TEST(DecodeDoorbellTest, ARingBecomesOneDecodeCallOfTheSessionAndItsAnswer) {
  Fixture f(/*counted_delay=*/absl::Milliseconds(50));
  Page page(std::move(f.client_fd));
  const uint32_t ring =
      page.Ring({{.sequence_id = 11, .token = 5}, {.sequence_id = 12, .token = 6}});
  std::unique_ptr<ComputeCall> call = f.engine.Next();
  ASSERT_NE(call, nullptr);
  EXPECT_EQ(call->session().id, SessionId(7));
  ASSERT_EQ(call->request().kind, ComputeRequest::Kind::kDecode);
  ASSERT_EQ(call->request().decode.size(), 2u);
  EXPECT_EQ(call->request().decode[0].sequence, SequenceId(11));
  EXPECT_EQ(call->request().decode[0].token, 5);
  EXPECT_EQ(call->request().decode[1].sequence, SequenceId(12));
  EXPECT_TRUE(call->context().Check().ok());
  EXPECT_NE(page->answered.load(), ring);  // not before the step

  call->result().status = absl::OkStatus();
  call->result().results.resize(2);
  call->result().results[0].next_token = 100;
  call->result().results[1].next_token = 200;
  call->result().lengths = {65, 66};
  call->result().step_sequences = 3;
  // The engine completes calls on its own thread; the client watches from this one.
  std::thread engine_thread([&call] {
    call->Complete();
    call.reset();
  });
  const bool answered = page.Answered(ring);
  // Counted before the client could see it.
  EXPECT_EQ(f.counted.load(), 1);
  engine_thread.join();
  ASSERT_TRUE(answered);
  EXPECT_EQ(page->code, 0);
  EXPECT_EQ(page->step_sequences, 3);
  EXPECT_EQ(page->results[0].next_token, 100);
  EXPECT_EQ(page->results[0].num_tokens, 65);
  EXPECT_EQ(page->results[1].next_token, 200);
  EXPECT_EQ(page->results[1].num_tokens, 66);
  EXPECT_EQ(f.doorbell->calls(), 1u);

  // An error comes back with its code, message and shortfall-free.
  const uint32_t second = page.Ring({{.sequence_id = 99, .token = 1}});
  call = f.engine.Next();
  ASSERT_NE(call, nullptr);
  call->result().status = absl::NotFoundError("no sequence 99 in this session");
  call->Complete();
  call.reset();
  ASSERT_TRUE(page.Answered(second));
  EXPECT_EQ(page->code, static_cast<int32_t>(absl::StatusCode::kNotFound));
  EXPECT_EQ(page.message(), "no sequence 99 in this session");
  EXPECT_EQ(page->shortfall_bytes, 0u);
}

TEST(DecodeDoorbellTest, AnOversizedCountIsRefusedWithoutACall) {
  Fixture f;
  Page page(std::move(f.client_fd));
  page->num_items = 0xFFFFFFFFu;
  const uint32_t ring = page.RingRaw();
  ASSERT_TRUE(page.Answered(ring));
  EXPECT_EQ(page->code, static_cast<int32_t>(absl::StatusCode::kInvalidArgument));
  EXPECT_NE(page.message().find("at most 256"), std::string::npos) << page.message();
  EXPECT_EQ(f.engine.queued(), 0u);
  // The doorbell still serves the next request, once the back-off after an error has passed.
  f.clock.Advance(DecodeDoorbell::kFirstBackoffNs);
  const uint32_t next = page.Ring({{.sequence_id = 1, .token = 1}});
  std::unique_ptr<ComputeCall> call = f.engine.Next();
  ASSERT_NE(call, nullptr);
  call->Complete();
  call.reset();
  EXPECT_TRUE(page.Answered(next));
}

TEST(DecodeDoorbellTest, ARingDuringACallIsServedAfterIt) {
  Fixture f;
  Page page(std::move(f.client_fd));
  const uint32_t first = page.Ring({{.sequence_id = 1, .token = 1}});
  std::unique_ptr<ComputeCall> call = f.engine.Next();
  ASSERT_NE(call, nullptr);
  const uint32_t second = page.Ring({{.sequence_id = 2, .token = 2}});
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_EQ(f.engine.queued(), 0u);  // one call at a time
  call->Complete();
  call.reset();
  ASSERT_TRUE(page.Answered(first));
  call = f.engine.Next();
  ASSERT_NE(call, nullptr);
  EXPECT_EQ(call->request().decode[0].sequence, SequenceId(2));
  call->Complete();
  call.reset();
  EXPECT_TRUE(page.Answered(second));
}

TEST(DecodeDoorbellTest, StopCancelsTheCallInFlightAndNeverWaitsForIt) {
  Fixture f;
  Page page(std::move(f.client_fd));
  page.Ring({{.sequence_id = 1, .token = 1}});
  std::unique_ptr<ComputeCall> call = f.engine.Next();
  ASSERT_NE(call, nullptr);
  f.doorbell->Stop();  // returns at once, with the call still out
  EXPECT_EQ(call->context().Check().code(), absl::StatusCode::kCancelled);
  EXPECT_FALSE(f.doorbell->exited());
  call->result().status = call->context().Check();
  call->Complete();
  call.reset();
  const absl::Time until = absl::Now() + absl::Seconds(5);
  while (!f.doorbell->exited() && absl::Now() < until) absl::SleepFor(absl::Milliseconds(1));
  EXPECT_TRUE(f.doorbell->exited());
  // Rings after the stop are not served.
  page.Ring({{.sequence_id = 1, .token = 1}});
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_EQ(f.engine.queued(), 0u);
}

TEST(DecodeDoorbellTest, AnIdleDoorbellStopsWhateverTheClientWrites) {
  Fixture f;
  Page page(std::move(f.client_fd));
  // The client keeps the ring word where the thread last saw it and scribbles everywhere else.
  std::memset(page->items, 0xAB, sizeof(page->items));
  page->answered.store(12345);
  absl::SleepFor(absl::Milliseconds(5));
  const absl::Time start = absl::Now();
  f.doorbell.reset();  // Stop + join
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
}

// Issue 31: the daemon runs an idle model's step on the doorbell's thread (Engine::SubmitOrRun),
// which then polls the ring for a while before it sleeps. Rings right after an answer, rings after
// the poll gave up, and a Stop() during the poll are all served or honoured.
TEST(DecodeDoorbellTest, AfterAnAnswerWrittenOnItsOwnThreadItServesTheNextRingsAndStops) {
  ManualClock clock{1'000'000'000};
  UniqueFd client_fd;
  // Completes each call before submit returns, as SubmitOrRun does with an idle model.
  auto run_here = [](std::unique_ptr<ComputeCall> call) {
    const std::vector<model::DecodeInput>& in = call->request().decode;
    call->result().status = absl::OkStatus();
    call->result().results.resize(in.size());
    for (size_t i = 0; i < in.size(); ++i) call->result().results[i].next_token = in[i].token + 1;
    call->result().lengths.assign(in.size(), 1);
    call->result().step_sequences = 1;
    call->Complete();
  };
  absl::StatusOr<std::unique_ptr<DecodeDoorbell>> d =
      DecodeDoorbell::Start(MakeSession(), run_here, {}, &client_fd, &clock);
  ASSERT_TRUE(d.ok()) << d.status();
  Page page(std::move(client_fd));
  for (int32_t i = 0; i < 40; ++i) {
    const uint32_t ring = page.Ring({{.sequence_id = 1, .token = i}});
    ASSERT_TRUE(page.Answered(ring)) << i;
    EXPECT_EQ(page->code, 0);
    EXPECT_EQ(page->results[0].next_token, i + 1);
    // Every fourth ring comes after the poll has given up and the thread sleeps on the futex.
    if (i % 4 == 3) absl::SleepFor(absl::Milliseconds(2));
  }
  EXPECT_EQ((*d)->calls(), 40u);
  // Stopped while it polls after an answer: it exits at once.
  ASSERT_TRUE(page.Answered(page.Ring({{.sequence_id = 1, .token = 0}})));
  const absl::Time start = absl::Now();
  d->reset();  // Stop + join
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
}

TEST(DecodeDoorbellTest, TheClientCannotResizeThePage) {
  Fixture f;
  EXPECT_NE(ftruncate(f.client_fd.get(), 0), 0);
  EXPECT_EQ(errno, EPERM);
  EXPECT_NE(ftruncate(f.client_fd.get(), 1 << 20), 0);
  struct stat st {};
  ASSERT_EQ(fstat(f.client_fd.get(), &st), 0);
  EXPECT_EQ(static_cast<size_t>(st.st_size), wire::kDoorbellBytes);
}

TEST(DecodeDoorbellTest, EachCallCarriesTheClientsDeadline) {
  Fixture f;
  Page page(std::move(f.client_fd));
  const auto context_of = [&](int64_t timeout_ns) {
    page.timeout_ns = timeout_ns;
    const uint32_t ring = page.Ring({{.sequence_id = 1, .token = 1}});
    std::unique_ptr<ComputeCall> call = f.engine.Next();
    EXPECT_NE(call, nullptr);
    if (call == nullptr) return absl::InternalError("no call");
    const absl::Status s = call->context().Check();
    call->result().status = s;
    call->Complete();
    EXPECT_TRUE(page.Answered(ring));
    if (!s.ok()) f.clock.Advance(DecodeDoorbell::kMaxBackoffNs);  // past the back-off
    return s;
  };
  EXPECT_TRUE(context_of(10'000'000'000).ok());
  EXPECT_TRUE(context_of(INT64_MAX).ok());  // clamped: no overflow into the past
  EXPECT_EQ(context_of(0).code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(context_of(INT64_MIN).code(), absl::StatusCode::kDeadlineExceeded);
  // A deadline that passes while the call waits in the queue: on the doorbell's clock, so the
  // test advances it instead of sleeping past it.
  page.timeout_ns = 1'000'000'000;
  const uint32_t ring = page.Ring({{.sequence_id = 1, .token = 1}});
  std::unique_ptr<ComputeCall> call = f.engine.Next();
  ASSERT_NE(call, nullptr);
  EXPECT_TRUE(call->context().Check().ok());
  f.clock.Advance(page.timeout_ns - 1);
  EXPECT_TRUE(call->context().Check().ok());
  f.clock.Advance(1);
  EXPECT_EQ(call->context().Check().code(), absl::StatusCode::kDeadlineExceeded);
  call->result().status = call->context().Check();
  call->Complete();
  call.reset();
  ASSERT_TRUE(page.Answered(ring));
  EXPECT_EQ(page->code, static_cast<int32_t>(absl::StatusCode::kDeadlineExceeded));
}

TEST(DoorbellsTest, RemoveDoesNotWaitForACallInFlightAndAddReapsLater) {
  ManualClock clock;
  FakeEngine engine;
  Doorbells doorbells;
  UniqueFd fd;
  absl::StatusOr<std::unique_ptr<DecodeDoorbell>> d =
      DecodeDoorbell::Start(MakeSession(), engine.Submit(), {}, &fd, &clock);
  ASSERT_TRUE(d.ok());
  doorbells.Add(SessionId(7), *std::move(d));
  Page page(std::move(fd));
  page.Ring({{.sequence_id = 1, .token = 1}});
  std::unique_ptr<ComputeCall> call = engine.Next();
  ASSERT_NE(call, nullptr);
  doorbells.Remove(SessionId(7));  // would deadlock here if it joined
  EXPECT_EQ(doorbells.size(), 1u);
  call->Complete();
  call.reset();
  // The next Add joins the stopped one once its thread has exited.
  const absl::Time until = absl::Now() + absl::Seconds(5);
  UniqueFd other_fd;
  while (absl::Now() < until) {
    absl::StatusOr<std::unique_ptr<DecodeDoorbell>> other =
        DecodeDoorbell::Start(MakeSession(), engine.Submit(), {}, &other_fd, &clock);
    ASSERT_TRUE(other.ok());
    doorbells.Add(SessionId(8), *std::move(other));
    if (doorbells.size() == 1) break;
    absl::SleepFor(absl::Milliseconds(2));
  }
  EXPECT_EQ(doorbells.size(), 1u);
  doorbells.StopAll();
  EXPECT_EQ(doorbells.size(), 0u);
}

}  // namespace
}  // namespace kvpool::daemon

namespace kvpool::daemon {
namespace {

// Issue 27: a client ringing refused request after refused request kept its doorbell's thread
// spinning. After an error the next ring waits out a back-off on the doorbell's clock.
TEST(DecodeDoorbellTest, AfterAnErrorTheNextRingWaitsOutABackOff) {
  ManualClock clock(1'000'000'000);
  FakeEngine engine;
  UniqueFd fd;
  absl::StatusOr<std::unique_ptr<DecodeDoorbell>> d =
      DecodeDoorbell::Start(MakeSession(), engine.Submit(), {}, &fd, &clock);
  ASSERT_TRUE(d.ok()) << d.status();
  Page page(std::move(fd));
  page->num_items = 0xFFFFFFFFu;  // refused at once, without a call
  const uint32_t first = page.RingRaw();
  ASSERT_TRUE(page.Answered(first));
  const uint32_t second = page.RingRaw();
  absl::SleepFor(absl::Milliseconds(20));  // real time passes; the doorbell's clock does not
  EXPECT_NE(page->answered.load(), second);
  clock.Advance(DecodeDoorbell::kFirstBackoffNs);
  ASSERT_TRUE(page.Answered(second));
  // Errors in a row double it; a success resets it.
  const uint32_t third = page.RingRaw();
  clock.Advance(DecodeDoorbell::kFirstBackoffNs);
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_NE(page->answered.load(), third);
  clock.Advance(DecodeDoorbell::kFirstBackoffNs);
  ASSERT_TRUE(page.Answered(third));
  clock.Advance(4 * DecodeDoorbell::kFirstBackoffNs);
  const uint32_t good = page.Ring({{.sequence_id = 1, .token = 1}});
  std::unique_ptr<ComputeCall> call = engine.Next();
  ASSERT_NE(call, nullptr);
  call->Complete();  // OK
  call.reset();
  ASSERT_TRUE(page.Answered(good));
  const uint32_t after = page.Ring({{.sequence_id = 1, .token = 1}});
  call = engine.Next();  // served at once: no back-off after a success
  ASSERT_NE(call, nullptr);
  call->Complete();
  call.reset();
  EXPECT_TRUE(page.Answered(after));
  (*d)->Stop();
}

TEST(DoorbellsTest, LiveDoorbellsAreCountedByUid) {
  ManualClock clock;
  FakeEngine engine;
  Doorbells doorbells;
  auto session = [](uint64_t id, uid_t uid) {
    auto s = std::make_shared<Session>();
    s->id = SessionId(id);
    s->spec.uid = uid;
    return s;
  };
  for (uint64_t id : {1, 2, 3}) {
    UniqueFd fd;
    doorbells.Add(SessionId(id), *DecodeDoorbell::Start(session(id, id < 3 ? 1000 : 1001),
                                                        engine.Submit(), {}, &fd, &clock));
  }
  EXPECT_EQ(doorbells.live_for_uid(1000), 2);
  EXPECT_EQ(doorbells.live_for_uid(1001), 1);
  doorbells.Remove(SessionId(1));
  EXPECT_EQ(doorbells.live_for_uid(1000), 1);
  doorbells.StopAll();
}

}  // namespace
}  // namespace kvpool::daemon
