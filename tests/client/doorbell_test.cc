// The client's side of the decode doorbell (client/internal/doorbell.h) against a page and an
// attach socket this test owns, playing the daemon: answers, errors with a shortfall, a daemon
// that does not answer in time (and answers later), and one that goes away mid-call.

#include "client/internal/doorbell.h"

#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/time/clock.h"
#include "client/client.h"
#include "client/status.h"
#include "gtest/gtest.h"

namespace kvpool::client::internal {
namespace {

class DoorbellTest : public ::testing::Test {
 protected:
  void SetUp() override {
    UniqueFd fd(memfd_create("doorbell-test", MFD_CLOEXEC));
    ASSERT_TRUE(fd.valid());
    ASSERT_EQ(ftruncate(fd.get(), static_cast<off_t>(wire::kDoorbellBytes)), 0);
    void* p = mmap(nullptr, wire::kDoorbellBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
    ASSERT_NE(p, MAP_FAILED);
    page_ = static_cast<wire::DoorbellPage*>(p);
    absl::StatusOr<std::unique_ptr<ClientDoorbell>> d = ClientDoorbell::Map(std::move(fd));
    ASSERT_TRUE(d.ok()) << d.status();
    doorbell_ = *std::move(d);
    int pair[2];
    ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair), 0);
    client_end_ = UniqueFd(pair[0]);
    daemon_end_ = UniqueFd(pair[1]);
  }
  void TearDown() override {
    if (daemon_.joinable()) daemon_.join();
    munmap(page_, wire::kDoorbellBytes);
  }

  // The daemon: waits for ring `ring`, then answers after `delay` with `code` (next token =
  // 10 * sequence id when OK).
  void AnswerLater(uint32_t ring, absl::Duration delay,
                   absl::StatusCode code = absl::StatusCode::kOk, std::string shortfall = "") {
    daemon_ = std::thread([this, ring, delay, code, shortfall] {
      while (page_->ring.load(std::memory_order_acquire) != ring) {
        wire::FutexWait(&page_->ring, page_->ring.load());
      }
      absl::SleepFor(delay);
      page_->code = static_cast<int32_t>(code);
      const std::string message = "scripted";
      std::memcpy(page_->message, message.data(), message.size());
      page_->message_bytes = static_cast<uint32_t>(message.size());
      std::memcpy(page_->shortfall, shortfall.data(), shortfall.size());
      page_->shortfall_bytes = static_cast<uint32_t>(shortfall.size());
      page_->step_sequences = 4;
      for (uint32_t i = 0; i < page_->num_items; ++i) {
        page_->results[i].next_token = static_cast<int32_t>(page_->items[i].sequence_id * 10);
        page_->results[i].num_tokens = 100 + i;
      }
      page_->answered.store(ring, std::memory_order_release);
      wire::FutexWakeAll(&page_->answered);
    });
  }

  std::optional<absl::StatusOr<v1::DecodeResponse>> Decode(std::vector<DecodeItem> items,
                                                           absl::Duration wait) {
    return doorbell_->Decode(items, absl::Now() + wait, client_end_.get());
  }

  wire::DoorbellPage* page_ = nullptr;
  std::unique_ptr<ClientDoorbell> doorbell_;
  UniqueFd client_end_, daemon_end_;
  std::thread daemon_;
};

TEST_F(DoorbellTest, AnAnswerBecomesTheDecodeResponse) {
  AnswerLater(1, absl::ZeroDuration());
  std::optional<absl::StatusOr<v1::DecodeResponse>> r =
      Decode({{.sequence_id = 3, .token = 1}, {.sequence_id = 4, .token = 2}}, absl::Seconds(5));
  ASSERT_TRUE(r.has_value());
  ASSERT_TRUE(r->ok()) << r->status();
  ASSERT_EQ((*r)->next_tokens_size(), 2);
  EXPECT_EQ((*r)->next_tokens(0), 30);
  EXPECT_EQ((*r)->next_tokens(1), 40);
  EXPECT_EQ((*r)->num_tokens(1), 101);
  EXPECT_EQ((*r)->step_sequences(), 4);
  EXPECT_EQ(page_->items[1].token, 2);
  // The call's deadline travels with it, as time left.
  EXPECT_GT(page_->timeout_ns, 4'000'000'000);
  EXPECT_LE(page_->timeout_ns, 5'000'000'000);
}

TEST_F(DoorbellTest, AnErrorKeepsItsCodeMessageAndShortfall) {
  AnswerLater(1, absl::ZeroDuration(), absl::StatusCode::kResourceExhausted, "pool:3");
  std::optional<absl::StatusOr<v1::DecodeResponse>> r =
      Decode({{.sequence_id = 3, .token = 1}}, absl::Seconds(5));
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(r->status().message(), "scripted");
  std::optional<Shortfall> s = GetShortfall(r->status());
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->resource, "pool");
  EXPECT_EQ(s->blocks, 3);
}

TEST_F(DoorbellTest, ALateAnswerTimesOutThenTheDoorbellIsBusyUntilItArrives) {
  AnswerLater(1, absl::Seconds(1));  // well after the 50 ms the call waits, even under load
  std::optional<absl::StatusOr<v1::DecodeResponse>> r =
      Decode({{.sequence_id = 3, .token = 1}}, absl::Milliseconds(50));
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->status().code(), absl::StatusCode::kDeadlineExceeded);
  // The page still carries the unanswered call: the next one must go another way.
  EXPECT_FALSE(Decode({{.sequence_id = 5, .token = 1}}, absl::Seconds(1)).has_value());
  daemon_.join();
  // Answered now: the doorbell serves again.
  AnswerLater(2, absl::ZeroDuration());
  r = Decode({{.sequence_id = 6, .token = 1}}, absl::Seconds(5));
  ASSERT_TRUE(r.has_value());
  ASSERT_TRUE(r->ok()) << r->status();
  EXPECT_EQ((*r)->next_tokens(0), 60);
}

TEST_F(DoorbellTest, ADaemonThatGoesAwayMidCallIsNoticed) {
  std::thread closer([this] {
    absl::SleepFor(absl::Milliseconds(50));
    daemon_end_ = UniqueFd();
  });
  const absl::Time start = absl::Now();
  std::optional<absl::StatusOr<v1::DecodeResponse>> r =
      Decode({{.sequence_id = 3, .token = 1}}, absl::Seconds(30));
  closer.join();
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->status().code(), absl::StatusCode::kUnavailable) << r->status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

TEST_F(DoorbellTest, WhatTheDoorbellDoesNotCarryGoesElsewhere) {
  EXPECT_FALSE(Decode({}, absl::Seconds(1)).has_value());
  std::vector<DecodeItem> wide(wire::kDoorbellMaxItems + 1, {.sequence_id = 1, .token = 1});
  EXPECT_FALSE(Decode(wide, absl::Seconds(1)).has_value());
  EXPECT_EQ(page_->ring.load(), 0u);  // nothing was rung
}

TEST(DoorbellMapTest, APageOfTheWrongSizeIsRefused) {
  UniqueFd fd(memfd_create("doorbell-test", MFD_CLOEXEC));
  ASSERT_EQ(ftruncate(fd.get(), 4096), 0);
  absl::StatusOr<std::unique_ptr<ClientDoorbell>> d = ClientDoorbell::Map(std::move(fd));
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvpool::client::internal
