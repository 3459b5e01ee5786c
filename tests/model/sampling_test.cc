// Choosing the next token (model/sampling.h): greedy at temperature 0, deterministic per
// (seed, position), distributed as the softmax of the processed logits, never outside the top_k /
// top_p set, penalties as documented, parameters checked.

#include "model/sampling.h"

#include <cmath>
#include <set>
#include <vector>

#include "gtest/gtest.h"

namespace kvpool::model {
namespace {

const std::vector<float> kLogits = {0.0f, 0.5f, 1.0f, 1.5f, -1.0f, 2.0f, 0.2f, -0.5f};

int32_t Draw(const SamplingParams& p, uint64_t position, std::span<const int32_t> history = {}) {
  std::vector<float> scratch;
  return SampleToken(kLogits, p, history, position, &scratch);
}

std::vector<double> Softmax(const std::vector<float>& logits, double temperature) {
  double total = 0;
  std::vector<double> p(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) total += p[i] = std::exp(logits[i] / temperature);
  for (double& x : p) x /= total;
  return p;
}

TEST(SamplingTest, TemperatureZeroIsTheArgmax) {
  for (uint64_t pos = 0; pos < 100; ++pos) EXPECT_EQ(Draw({.seed = pos}, pos), 5);
}

TEST(SamplingTest, TheSameSeedAndPositionGiveTheSameToken) {
  const SamplingParams p{.temperature = 1, .seed = 42};
  std::set<int32_t> seen;
  for (uint64_t pos = 0; pos < 200; ++pos) {
    EXPECT_EQ(Draw(p, pos), Draw(p, pos));
    seen.insert(Draw(p, pos));
  }
  EXPECT_GT(seen.size(), 4u);  // positions draw independently
  SamplingParams other = p;
  other.seed = 43;
  int differ = 0;
  for (uint64_t pos = 0; pos < 200; ++pos) differ += Draw(p, pos) != Draw(other, pos);
  EXPECT_GT(differ, 50);
}

// Pearson's chi-square of 200,000 draws against the softmax: below 24.32, the 0.999 quantile of
// chi-square with 7 degrees of freedom. Deterministic: the draws are a function of the seed.
TEST(SamplingTest, DrawsFollowTheSoftmaxOfTheLogits) {
  for (float temperature : {1.0f, 0.5f}) {
    const SamplingParams p{.temperature = temperature, .seed = 7};
    const int n = 200000;
    std::vector<int> counts(kLogits.size());
    for (uint64_t pos = 0; pos < static_cast<uint64_t>(n); ++pos) ++counts[Draw(p, pos)];
    const std::vector<double> expected = Softmax(kLogits, temperature);
    double chi2 = 0;
    for (size_t i = 0; i < counts.size(); ++i) {
      const double e = expected[i] * n;
      chi2 += (counts[i] - e) * (counts[i] - e) / e;
    }
    EXPECT_LT(chi2, 24.32) << "temperature " << temperature;
  }
}

TEST(SamplingTest, TopKAndTopPNeverSampleOutsideTheirSet) {
  // Likeliest first: 5 (2.0), 3 (1.5), 2 (1.0), 1 (0.5), 6 (0.2), 0, 7, 4.
  const std::set<int32_t> top3 = {5, 3, 2};
  for (uint64_t pos = 0; pos < 5000; ++pos) {
    EXPECT_TRUE(top3.contains(Draw({.temperature = 1, .top_k = 3, .seed = 1}, pos)));
  }
  // The softmax's mass: 5 holds 0.38, 5 and 3 hold 0.61, with 2 0.75. top_p 0.7 keeps 5, 3, 2.
  const std::vector<double> p = Softmax(kLogits, 1);
  ASSERT_LT(p[5] + p[3], 0.7);
  ASSERT_GE(p[5] + p[3] + p[2], 0.7);
  std::set<int32_t> seen;
  for (uint64_t pos = 0; pos < 5000; ++pos) {
    const int32_t t = Draw({.temperature = 1, .top_p = 0.7f, .seed = 2}, pos);
    EXPECT_TRUE(top3.contains(t)) << t;
    seen.insert(t);
  }
  EXPECT_EQ(seen, top3);
  // top_k = 1 at any temperature is greedy.
  for (uint64_t pos = 0; pos < 100; ++pos) EXPECT_EQ(Draw({.temperature = 2, .top_k = 1}, pos), 5);
}

TEST(SamplingTest, PenaltiesLowerTheTokensAlreadySeen) {
  // Greedy over penalized logits: 5 seen twice, frequency 0.6 takes it to 0.8, below 3 (1.5).
  const int32_t twice[] = {5, 5};
  EXPECT_EQ(Draw({.frequency_penalty = 0.6f}, 0, twice), 3);
  // Presence counts once: 2.0 - 0.4 = 1.6 stays above 1.5.
  EXPECT_EQ(Draw({.presence_penalty = 0.4f}, 0, twice), 5);
  EXPECT_EQ(Draw({.presence_penalty = 0.6f}, 0, twice), 3);
  // Negative penalties favour what was seen.
  const int32_t once[] = {4};
  EXPECT_EQ(Draw({.presence_penalty = -2.0f, .frequency_penalty = -2.0f}, 0, once), 4);
  // Tokens outside the vocabulary in the history are ignored.
  const int32_t odd[] = {-1, 99};
  EXPECT_EQ(Draw({.presence_penalty = 1.0f}, 0, odd), 5);
}

TEST(SamplingTest, ParametersOutsideTheirRangeAreArgumentErrors) {
  EXPECT_TRUE(CheckSampling({}, 8).ok());
  EXPECT_TRUE(CheckSampling({.temperature = 2, .top_p = 1, .top_k = 8}, 8).ok());
  for (const SamplingParams& bad :
       {SamplingParams{.temperature = -0.1f}, SamplingParams{.temperature = 2.5f},
        SamplingParams{.temperature = NAN}, SamplingParams{.top_p = 0},
        SamplingParams{.top_p = 1.1f}, SamplingParams{.top_k = -1}, SamplingParams{.top_k = 9},
        SamplingParams{.presence_penalty = 3}, SamplingParams{.frequency_penalty = -2.5f}}) {
    EXPECT_TRUE(absl::IsInvalidArgument(CheckSampling(bad, 8)));
  }
}

}  // namespace
}  // namespace kvpool::model
