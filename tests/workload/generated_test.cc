#include "workload/generated.h"

#include <algorithm>

#include "gtest/gtest.h"

namespace kvpool::workload {
namespace {

TEST(GeneratedTest, DeterministicTurnsExtendTheirConversation) {
  const GeneratorOptions o{.seed = 3, .tenants = 2, .conversations = 4, .turns = 3};
  const std::vector<Request> a = GenerateConversations(o);
  const std::vector<Request> b = GenerateConversations(o);
  ASSERT_EQ(a.size(), 12u);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i].prompt, b[i].prompt);
  // Turn 1 of conversation 0 starts with turn 0's prompt and reply.
  const Request& t0 = a[0];
  const Request& t1 = a[4];
  ASSERT_EQ(t1.conversation, 0);
  ASSERT_EQ(t1.turn, 1);
  std::vector<int32_t> expected = t0.prompt;
  expected.insert(expected.end(), t0.reply.begin(), t0.reply.end());
  EXPECT_TRUE(std::equal(expected.begin(), expected.end(), t1.prompt.begin()));
  // Conversations of one tenant share its system prompt; other tenants do not.
  EXPECT_TRUE(std::equal(a[0].prompt.begin(), a[0].prompt.begin() + 512, a[2].prompt.begin()));
  EXPECT_FALSE(std::equal(a[0].prompt.begin(), a[0].prompt.begin() + 512, a[1].prompt.begin()));
  const std::vector<Request> other = GenerateConversations({.seed = 4});
  EXPECT_NE(other[0].prompt, a[0].prompt);
}

TEST(GeneratedTest, TracePromptsAreCutKeepingTheirPrefixes) {
  const std::vector<TraceRequest> trace = {{0, 600, 10, {1, 2}}, {0, 1000, 5, {1, 3}}};
  const std::vector<Request> r = FromTrace(trace, 550, 4);
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[0].prompt.size(), 550u);
  EXPECT_TRUE(std::equal(r[0].prompt.begin(), r[0].prompt.begin() + 512, r[1].prompt.begin()));
  EXPECT_EQ(r[0].reply.size(), 4u);
}

}  // namespace
}  // namespace kvpool::workload
