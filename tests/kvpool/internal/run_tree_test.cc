// The prefix tree's shape on its own: runs split where a block gains a second child, merge back
// when a split is no longer needed, shrink from the tail; partial blocks are lone leaves; and a
// seeded random sequence of every change, checked after each step against a reference model of
// which block hangs below which (CheckInvariants checks that the runs are maximal).

#include "kvpool/internal/run_tree.h"

#include <map>
#include <numeric>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvpool::internal {
namespace {

using ::testing::ElementsAre;

constexpr int32_t kBs = 4;
constexpr NamespaceId kNs(7);

// A block's tokens, starting with `tag` (siblings get different tags).
std::vector<int32_t> Block(int32_t tag) { return {tag, tag + 1, tag + 2, tag + 3}; }

std::vector<int32_t> Concat(std::initializer_list<std::vector<int32_t>> parts) {
  std::vector<int32_t> out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

std::vector<BlockId> Ids(std::initializer_list<int32_t> ids) {
  std::vector<BlockId> out;
  for (int32_t id : ids) out.emplace_back(id);
  return out;
}

class RunTreeTest : public ::testing::Test {
 protected:
  void ExpectInvariants() {
    const absl::Status status = tree_.CheckInvariants();
    ASSERT_TRUE(status.ok()) << status;
  }

  // The full blocks Match() finds for `tokens`.
  std::vector<BlockId> Matched(std::span<const int32_t> tokens) {
    std::vector<BlockId> full;
    BlockId partial;
    int32_t partial_tokens = 0;
    tree_.Match(root_, tokens, &full, &partial, &partial_tokens);
    return full;
  }

  // Blocks 0..3 as one run below the root, holding Block(100), Block(200), ...
  void AddFour() {
    tree_.AddRun(root_, kInvalidBlock, Ids({0, 1, 2, 3}),
                 Concat({Block(100), Block(200), Block(300), Block(400)}));
  }

  RunTree tree_{kBs, 64};
  NodeIndex root_ = tree_.RootOrCreate(kNs);
};

TEST_F(RunTreeTest, AFreshChainIsOneRun) {
  AddFour();
  ExpectInvariants();
  EXPECT_EQ(tree_.stats().runs, 1);
  EXPECT_EQ(tree_.Parent(BlockId(0)), kInvalidBlock);
  EXPECT_EQ(tree_.Parent(BlockId(3)), BlockId(2));
  EXPECT_EQ(tree_.depth(BlockId(3)), 4);
  EXPECT_FALSE(tree_.IsLeaf(BlockId(2)));
  EXPECT_TRUE(tree_.IsLeaf(BlockId(3)));
  EXPECT_THAT(tree_.RunUpTo(BlockId(2)), ElementsAre(BlockId(0), BlockId(1), BlockId(2)));
  const std::vector<int32_t> all = Concat({Block(100), Block(200), Block(300), Block(400)});
  EXPECT_EQ(Matched(all), Ids({0, 1, 2, 3}));
  // A prompt ending two tokens into block 2 matches blocks 0-1 whole and block 2 in part.
  std::vector<BlockId> full;
  BlockId partial;
  int32_t partial_tokens = 0;
  tree_.Match(root_, std::span(all).first(10), &full, &partial, &partial_tokens);
  EXPECT_EQ(full, Ids({0, 1}));
  EXPECT_EQ(partial, BlockId(2));
  EXPECT_EQ(partial_tokens, 2);
}

TEST_F(RunTreeTest, ASecondChildSplitsTheRunWhereItHangsAndItsRemovalMergesItBack) {
  AddFour();
  tree_.Add(root_, BlockId(1), BlockId(9), Block(900));  // a prompt diverging after block 1
  ExpectInvariants();
  EXPECT_EQ(tree_.stats().splits, 1u);
  EXPECT_EQ(tree_.stats().runs, 3);  // blocks 0-1, then 2-3 and 9 below them
  EXPECT_EQ(tree_.NumChildren(root_, BlockId(1)), 2);
  EXPECT_TRUE(tree_.StartsRun(BlockId(2)));
  EXPECT_EQ(Matched(Concat({Block(100), Block(200), Block(900)})), Ids({0, 1, 9}));
  EXPECT_EQ(Matched(Concat({Block(100), Block(200), Block(300), Block(400)})), Ids({0, 1, 2, 3}));

  EXPECT_EQ(tree_.Remove(BlockId(9)), BlockId(1));
  ExpectInvariants();
  EXPECT_EQ(tree_.stats().merges, 1u);
  EXPECT_EQ(tree_.stats().runs, 1);
  EXPECT_FALSE(tree_.StartsRun(BlockId(2)));
}

TEST_F(RunTreeTest, ARunShrinksFromItsTail) {
  AddFour();
  EXPECT_EQ(tree_.Remove(BlockId(3)), BlockId(2));
  EXPECT_TRUE(tree_.IsLeaf(BlockId(2)));
  tree_.Trim(BlockId(2), 2);  // blocks 2 and 1
  ExpectInvariants();
  EXPECT_TRUE(tree_.IsLeaf(BlockId(0)));
  EXPECT_FALSE(tree_.Holds(BlockId(1)));
  EXPECT_EQ(tree_.coverage(BlockId(1)), 0);
  EXPECT_EQ(tree_.stats().runs, 1);
  EXPECT_EQ(tree_.Remove(BlockId(0)), kInvalidBlock);
  ExpectInvariants();
  EXPECT_EQ(tree_.stats().runs, 0);
}

TEST_F(RunTreeTest, APartialBlockIsALoneLeafUntilWidenedIntoItsParentsRun) {
  tree_.AddRun(root_, kInvalidBlock, Ids({0, 1}), Concat({Block(100), Block(200)}));
  tree_.Add(root_, BlockId(1), BlockId(5), std::vector<int32_t>{500, 501});
  ExpectInvariants();
  EXPECT_EQ(tree_.stats().runs, 2);
  EXPECT_EQ(tree_.coverage(BlockId(5)), 2);
  tree_.Widen(BlockId(5), std::vector<int32_t>{500, 501, 502});
  EXPECT_EQ(tree_.stats().runs, 2);  // still partial
  tree_.Widen(BlockId(5), Block(500));
  ExpectInvariants();
  EXPECT_EQ(tree_.stats().runs, 1);
  EXPECT_EQ(tree_.stats().merges, 1u);
  EXPECT_EQ(Matched(Concat({Block(100), Block(200), Block(500)})), Ids({0, 1, 5}));
}

// A split moves the shorter side of the run, a merge the shorter run: both directions of each.
TEST_F(RunTreeTest, SplitsAndMergesMoveEitherSide) {
  std::vector<BlockId> blocks;
  std::vector<int32_t> tokens;
  for (int32_t i = 0; i < 10; ++i) {
    blocks.emplace_back(i);
    const std::vector<int32_t> b = Block(100 * (i + 1));
    tokens.insert(tokens.end(), b.begin(), b.end());
  }
  tree_.AddRun(root_, kInvalidBlock, blocks, tokens);
  tree_.Add(root_, BlockId(1), BlockId(20), Block(5000));  // near the start
  ExpectInvariants();
  tree_.Add(root_, BlockId(8), BlockId(21), Block(6000));  // near the end
  ExpectInvariants();
  EXPECT_EQ(tree_.stats().runs, 5);
  EXPECT_EQ(Matched(tokens), blocks);
  EXPECT_EQ(tree_.Remove(BlockId(21)), BlockId(8));
  ExpectInvariants();
  EXPECT_EQ(tree_.Remove(BlockId(20)), BlockId(1));
  ExpectInvariants();
  EXPECT_EQ(tree_.stats().runs, 1);
  EXPECT_EQ(tree_.stats().splits, 2u);
  EXPECT_EQ(tree_.stats().merges, 2u);
  EXPECT_EQ(Matched(tokens), blocks);
}

TEST_F(RunTreeTest, APositionWithManyChildrenTurnsWideAndMergesWhenOneIsLeft) {
  tree_.AddRun(root_, kInvalidBlock, Ids({0, 1}), Concat({Block(100), Block(200)}));
  for (int32_t i = 0; i < 12; ++i) tree_.Add(root_, BlockId(0), BlockId(10 + i), Block(1000 * i));
  ExpectInvariants();
  EXPECT_EQ(tree_.NumChildren(root_, BlockId(0)), 13);
  for (int32_t i = 0; i < 12; ++i) {
    EXPECT_EQ(tree_.FindFull(root_, BlockId(0), Block(1000 * i)), BlockId(10 + i));
  }
  for (int32_t i = 0; i < 12; ++i) {
    tree_.Remove(BlockId(10 + i));
    ExpectInvariants();
  }
  EXPECT_EQ(tree_.stats().runs, 1);
  EXPECT_EQ(Matched(Concat({Block(100), Block(200)})), Ids({0, 1}));
}

// The reference model: which block hangs below which, with what tokens.
struct ModelBlock {
  BlockId parent;
  std::vector<int32_t> tokens;
};

// A tree publishes a run's tokens with non-temporal stores only when its working set (its tokens,
// and small blocks' bookkeeping) outgrows the threshold (about twice the core's L2: below it the
// array stays cached). Both ways store the same tokens, line-sized blocks (which stream) or not.
TEST(RunTreeTokensTest, StreamedAndPlainStoresHoldTheSameTokens) {
  EXPECT_FALSE(RunTree(16, 64).streams_tokens());
  const int64_t threshold = TokenStreamThreshold();
  EXPECT_GT(threshold, 0);
  // 16-token blocks: 64 bytes of tokens and kBlockBookkeepingBytes each.
  const int64_t per_block = 64 + kBlockBookkeepingBytes;
  EXPECT_FALSE(RunTree(16, static_cast<int32_t>(threshold / per_block)).streams_tokens());  // <= it
  EXPECT_TRUE(RunTree(16, static_cast<int32_t>(threshold / per_block) + 1).streams_tokens());
  // 512-token blocks: their tokens alone decide.
  EXPECT_FALSE(RunTree(512, static_cast<int32_t>(threshold / 2048)).streams_tokens());
  EXPECT_TRUE(RunTree(512, static_cast<int32_t>(threshold / 2048) + 1).streams_tokens());
  // The bookkeeping counts: a tree whose tokens alone are under the threshold streams.
  EXPECT_LT(TokenWorkingSet(16, static_cast<int32_t>(threshold / per_block) + 1) -
                (threshold / per_block + 1) * kBlockBookkeepingBytes,
            threshold);
  for (const int32_t bs : {16, 20, 512}) {  // whole lines, not, many lines
    RunTree streamed(bs, 8, /*stream_over_bytes=*/0);
    RunTree plain(bs, 8, /*stream_over_bytes=*/int64_t{1} << 40);
    ASSERT_TRUE(streamed.streams_tokens());
    ASSERT_FALSE(plain.streams_tokens());
    std::vector<int32_t> tokens(static_cast<size_t>(bs) * 3);
    std::iota(tokens.begin(), tokens.end(), 1000);
    for (RunTree* tree : {&streamed, &plain}) {
      const NodeIndex root = tree->RootOrCreate(kNs);
      tree->AddRun(root, kInvalidBlock, Ids({5, 2, 7}), tokens);
      ASSERT_TRUE(tree->CheckInvariants().ok());
      std::vector<BlockId> full;
      BlockId partial;
      int32_t partial_tokens = 0;
      tree->Match(root, tokens, &full, &partial, &partial_tokens);
      EXPECT_THAT(full, ElementsAre(BlockId(5), BlockId(2), BlockId(7))) << bs;
    }
    for (const int32_t b : {5, 2, 7}) {
      EXPECT_THAT(streamed.Tokens(BlockId(b)),
                  ::testing::ElementsAreArray(plain.Tokens(BlockId(b))))
          << bs;
    }
    EXPECT_EQ(streamed.Tokens(BlockId(7)).back(), 1000 + 3 * bs - 1);
  }
}

class RunTreeRandomTest : public RunTreeTest {
 protected:
  static constexpr int32_t kBlocks = 64;

  int32_t Children(BlockId at) const {
    int32_t n = 0;
    for (const auto& [b, m] : model_) n += m.parent == at ? 1 : 0;
    return n;
  }
  std::vector<int32_t> PathTokens(BlockId b) const {
    std::vector<BlockId> path;
    for (BlockId x = b; x != kInvalidBlock; x = model_.at(x.value()).parent) path.push_back(x);
    std::vector<int32_t> out;
    for (auto it = path.rbegin(); it != path.rend(); ++it) {
      const std::vector<int32_t>& t = model_.at(it->value()).tokens;
      out.insert(out.end(), t.begin(), t.end());
    }
    return out;
  }
  BlockId FreeBlock() {
    std::vector<int32_t> free;
    for (int32_t b = 0; b < kBlocks; ++b) {
      if (!model_.contains(b)) free.push_back(b);
    }
    return free.empty() ? kInvalidBlock : BlockId(free[rng_() % free.size()]);
  }
  // Root or a random full block.
  BlockId Position() {
    std::vector<BlockId> full = {kInvalidBlock};
    for (const auto& [b, m] : model_) {
      if (m.tokens.size() == static_cast<size_t>(kBs)) full.emplace_back(b);
    }
    return full[rng_() % full.size()];
  }
  std::vector<int32_t> RandomTokens(int32_t n) {
    std::vector<int32_t> t;
    for (int32_t i = 0; i < n; ++i) t.push_back(static_cast<int32_t>(rng_() % 3));
    return t;
  }
  BlockId RandomLeaf() {
    std::vector<BlockId> leaves;
    for (const auto& [b, m] : model_) {
      if (Children(BlockId(b)) == 0) leaves.emplace_back(b);
    }
    return leaves.empty() ? kInvalidBlock : leaves[rng_() % leaves.size()];
  }

  void StepAdd();
  void StepAddRun();
  void StepWiden();
  void StepRemove();
  void Verify();

  std::map<int32_t, ModelBlock> model_;
  std::mt19937_64 rng_{31};
};

void RunTreeRandomTest::StepAdd() {
  const BlockId at = Position();
  const BlockId b = FreeBlock();
  if (b == kInvalidBlock) return;
  const bool full = rng_() % 3 != 0;
  const std::vector<int32_t> tokens =
      RandomTokens(full ? kBs : 1 + static_cast<int32_t>(rng_() % 3));
  // The cache adds a full block only where none holds its tokens yet.
  if (full && tree_.FindFull(root_, at, tokens) != kInvalidBlock) return;
  tree_.Add(root_, at, b, tokens);
  model_[b.value()] = ModelBlock{at, tokens};
}

void RunTreeRandomTest::StepAddRun() {
  const BlockId at = Position();
  if (Children(at) != 0) return;
  std::vector<BlockId> blocks;
  std::vector<int32_t> tokens;
  const int32_t n = 1 + static_cast<int32_t>(rng_() % 5);
  for (int32_t i = 0; i < n; ++i) {
    const BlockId b = FreeBlock();
    if (b == kInvalidBlock) break;
    const std::vector<int32_t> t = RandomTokens(kBs);
    model_[b.value()] = ModelBlock{blocks.empty() ? at : blocks.back(), t};
    blocks.push_back(b);
    tokens.insert(tokens.end(), t.begin(), t.end());
  }
  if (!blocks.empty()) tree_.AddRun(root_, at, blocks, tokens);
}

void RunTreeRandomTest::StepWiden() {
  std::vector<int32_t> partial;
  for (const auto& [b, m] : model_) {
    if (m.tokens.size() < static_cast<size_t>(kBs)) partial.push_back(b);
  }
  if (partial.empty()) return;
  const BlockId b(partial[rng_() % partial.size()]);
  ModelBlock& w = model_.at(b.value());
  std::vector<int32_t> tokens = w.tokens;
  const std::vector<int32_t> more = RandomTokens(1 + static_cast<int32_t>(rng_() % 3));
  tokens.insert(tokens.end(), more.begin(), more.end());
  tokens.resize(std::min<size_t>(tokens.size(), kBs));
  if (tokens.size() == static_cast<size_t>(kBs) &&
      tree_.FindFull(root_, w.parent, tokens) != kInvalidBlock) {
    return;
  }
  tree_.Widen(b, tokens);
  w.tokens = tokens;
}

void RunTreeRandomTest::StepRemove() {
  const BlockId b = RandomLeaf();
  if (b == kInvalidBlock) return;
  const std::span<const BlockId> run = tree_.RunUpTo(b);
  if (run.size() > 1 && rng_() % 2 == 0) {
    const size_t n = 1 + rng_() % (run.size() - 1);
    for (size_t k = 0; k < n; ++k) model_.erase(run[run.size() - 1 - k].value());
    tree_.Trim(b, n);
    return;
  }
  EXPECT_EQ(tree_.Remove(b), model_.at(b.value()).parent);
  model_.erase(b.value());
}

void RunTreeRandomTest::Verify() {
  ExpectInvariants();
  for (int32_t i = 0; i < kBlocks; ++i) {
    const BlockId b(i);
    auto it = model_.find(i);
    ASSERT_EQ(tree_.Holds(b), it != model_.end()) << "block " << i;
    if (it == model_.end()) continue;
    const ModelBlock& m = it->second;
    ASSERT_EQ(tree_.Parent(b), m.parent) << "block " << i;
    ASSERT_THAT(tree_.Tokens(b), ::testing::ElementsAreArray(m.tokens)) << "block " << i;
    ASSERT_EQ(tree_.IsLeaf(b), Children(b) == 0) << "block " << i;
    if (m.tokens.size() == static_cast<size_t>(kBs)) {
      ASSERT_EQ(tree_.NumChildren(root_, b), Children(b)) << "block " << i;
      const std::vector<int32_t> path = PathTokens(b);
      const std::vector<BlockId> matched = Matched(path);
      ASSERT_FALSE(matched.empty());
      ASSERT_EQ(matched.back(), b) << "block " << i;
      ASSERT_EQ(static_cast<int32_t>(matched.size()), tree_.depth(b));
    }
  }
  ASSERT_EQ(tree_.NumChildren(root_, kInvalidBlock), Children(kInvalidBlock));
}

TEST_F(RunTreeRandomTest, EveryChangeKeepsTheShapeOfTheReferenceModel) {
  for (int step = 0; step < 20000; ++step) {
    const uint64_t dice = rng_() % 10;
    if (dice < 3) {
      StepAdd();
    } else if (dice < 5) {
      StepAddRun();
    } else if (dice < 6) {
      StepWiden();
    } else {
      StepRemove();
    }
    Verify();
    if (HasFatalFailure()) FAIL() << "at step " << step;
  }
  // The run exercised what it claims to.
  EXPECT_GT(tree_.stats().splits, 500u);
  EXPECT_GT(tree_.stats().merges, 500u);
}

}  // namespace
}  // namespace kvpool::internal
