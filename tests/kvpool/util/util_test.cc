#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvpool/util/check.h"
#include "kvpool/util/clock.h"
#include "kvpool/util/errors.h"
#include "kvpool/util/logging.h"
#include "kvpool/util/parents_first.h"
#include "kvpool/util/status_macros.h"
#include "kvpool/util/strong_id.h"
#include "kvpool/util/unique_fd.h"

namespace kvpool {
namespace {

absl::StatusOr<int> Half(int x) {
  if (x % 2 != 0) return absl::InvalidArgumentError("odd");
  return x / 2;
}

absl::StatusOr<int> Quarter(int x) {
  KVPOOL_ASSIGN_OR_RETURN(int half, Half(x));
  KVPOOL_ASSIGN_OR_RETURN(int quarter, Half(half));
  return quarter;
}

absl::Status CheckEven(int x, int* calls) {
  ++*calls;
  KVPOOL_RETURN_IF_ERROR(Half(x).status());
  return absl::OkStatus();
}

TEST(StatusMacrosTest, AssignOrReturnPropagatesTheFirstError) {
  EXPECT_EQ(*Quarter(8), 2);
  EXPECT_EQ(Quarter(6).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Quarter(3).status().message(), "odd");
}

TEST(StatusMacrosTest, ReturnIfErrorEvaluatesOnce) {
  int calls = 0;
  EXPECT_TRUE(CheckEven(4, &calls).ok());
  EXPECT_EQ(CheckEven(5, &calls).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(calls, 2);
}

TEST(StrongIdTest, ComparesHashesAndPrints) {
  const BlockId a(3), b(4);
  EXPECT_LT(a, b);
  EXPECT_NE(a, b);
  EXPECT_EQ(a, BlockId(3));
  absl::flat_hash_set<BlockId> set = {a, b, BlockId(3)};
  EXPECT_EQ(set.size(), 2u);
  std::ostringstream os;
  os << SequenceId(42);
  EXPECT_EQ(os.str(), "42");
  static_assert(!std::is_convertible_v<int32_t, BlockId>, "ids must not convert implicitly");
  static_assert(!std::is_convertible_v<BlockId, SequenceId>);
}

TEST(ErrorsTest, ShortfallRoundTrips) {
  const absl::Status status = ResourceExhausted(Resource::kNamespaceQuota, 7, "grow");
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(status.message()), testing::HasSubstr("namespace quota short by 7"));
  const std::optional<Shortfall> shortfall = GetShortfall(status);
  ASSERT_TRUE(shortfall.has_value());
  EXPECT_EQ(shortfall->resource, Resource::kNamespaceQuota);
  EXPECT_EQ(shortfall->blocks, 7);
  EXPECT_FALSE(GetShortfall(absl::ResourceExhaustedError("plain")).has_value());
  EXPECT_FALSE(GetShortfall(absl::OkStatus()).has_value());
}

TEST(ClockTest, ManualClockMovesOnlyWhenTold) {
  ManualClock clock(100);
  EXPECT_EQ(clock.NowNanos(), 100);
  clock.Advance(5);
  EXPECT_EQ(clock.NowNanos(), 105);
  clock.Set(7);
  EXPECT_EQ(clock.NowNanos(), 7);
}

TEST(ClockTest, ManualClockWaitEndsWhenTheConditionHoldsOrTheClockPassesTheDeadline) {
  ManualClock clock(100);
  absl::Mutex mu;
  bool ready = false;
  std::atomic<int> result{-1};
  auto wait = [&] {
    absl::MutexLock lock(&mu);
    result = clock.AwaitUntil(mu, absl::Condition(&ready), 1000) ? 1 : 0;
  };
  std::thread timeout(wait);
  clock.Set(1000);  // the deadline, however much real time it took
  timeout.join();
  EXPECT_EQ(result, 0);
  clock.Set(0);
  std::thread condition(wait);
  {
    absl::MutexLock lock(&mu);
    ready = true;
  }
  condition.join();
  EXPECT_EQ(result, 1);
  absl::MutexLock lock(&mu);
  const bool never = false;
  EXPECT_FALSE(Clock::Real()->AwaitUntil(mu, absl::Condition(&never), 0));  // deadline passed
}

// Entries listed before their parents: 0's parent is 3 and 1's is 2; 4 is not wanted; 5 is a
// root.
TEST(ParentsFirstTest, EachEntryComesAfterItsParentOtherwiseInIndexOrder) {
  const std::vector<int> parent_of{3, 2, -1, -1, -1, -1};
  const std::vector<bool> wanted{true, true, true, true, false, true};
  std::vector<size_t> order;
  VisitParentsFirst(
      parent_of.size(), [&](size_t i) { return wanted[i]; },
      [&](size_t i) -> std::optional<size_t> {
        if (parent_of[i] < 0) return std::nullopt;
        return static_cast<size_t>(parent_of[i]);
      },
      [&](size_t i) { order.push_back(i); });
  EXPECT_THAT(order, testing::ElementsAre(3, 0, 2, 1, 5));
}

TEST(ParentsFirstTest, AParentCycleStillEnds) {
  std::vector<size_t> order;
  VisitParentsFirst(
      3, [](size_t) { return true; }, [](size_t i) -> std::optional<size_t> { return (i + 1) % 3; },
      [&](size_t i) { order.push_back(i); });
  EXPECT_THAT(order, testing::ElementsAre(2, 1, 0));
}

TEST(UniqueFdTest, ClosesWhatItOwns) {
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  {
    UniqueFd read_end(fds[0]);
    UniqueFd moved = std::move(read_end);
    EXPECT_FALSE(read_end.valid());
    EXPECT_EQ(moved.get(), fds[0]);
  }
  EXPECT_EQ(fcntl(fds[0], F_GETFD), -1);  // closed once, by the owner it was moved to
  EXPECT_EQ(close(fds[1]), 0);
}

TEST(ClockTest, RealClockIsMonotonic) {
  const int64_t a = Clock::Real()->NowNanos();
  const int64_t b = Clock::Real()->NowNanos();
  EXPECT_LE(a, b);
}

TEST(LoggingTest, NamedLoggersAndLevels) {
  spdlog::logger& core = Logger("core");
  EXPECT_EQ(core.name(), "kvpool.core");
  EXPECT_EQ(&core, &Logger("core"));
  ASSERT_TRUE(SetLogLevel("debug").ok());
  EXPECT_EQ(core.level(), spdlog::level::debug);
  EXPECT_EQ(Logger("later").level(), spdlog::level::debug);
  EXPECT_EQ(SetLogLevel("loud").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(core.level(), spdlog::level::debug);
  ASSERT_TRUE(SetLogLevel("off").ok());
  EXPECT_EQ(core.level(), spdlog::level::off);
  ASSERT_TRUE(SetLogLevel("info").ok());
}

TEST(CheckDeathTest, FailedCheckAbortsWithTheCondition) {
  const int x = 1;
  EXPECT_DEATH(KVPOOL_CHECK_MSG(x == 2, "x was wrong"), "KVPOOL_CHECK failed: x == 2: x was wrong");
  EXPECT_DEATH(KVPOOL_CHECK_OK(absl::InternalError("boom")), "boom");
}

}  // namespace
}  // namespace kvpool
