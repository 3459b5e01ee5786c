// RunTree: lookups and the shape's changes (child lists live in run_tree_children.cc, the checks
// in run_tree_check.cc).

#include "kvpool/internal/run_tree.h"

#include <algorithm>
#include <cstring>

#include "kvpool/internal/tokens.h"
#include "kvpool/util/check.h"

namespace kvpool::internal {

RunTree::RunTree(int32_t block_size, int32_t num_blocks, int64_t stream_over_bytes)
    : block_size_(block_size),
      stream_tokens_(TokenWorkingSet(block_size, num_blocks) > stream_over_bytes),
      places_(static_cast<size_t>(num_blocks)),
      // Four bytes per token of the pool, far below its KV bytes per token.
      tokens_(MakeLineAlignedTokens(static_cast<size_t>(num_blocks) *
                                    static_cast<size_t>(block_size))) {}

NodeIndex RunTree::Root(NamespaceId ns) const {
  auto it = roots_.find(ns);
  return it == roots_.end() ? kNoNode : it->second;
}

NodeIndex RunTree::RootOrCreate(NamespaceId ns) {
  if (const NodeIndex root = Root(ns); root != kNoNode) return root;
  const NodeIndex root = NewNode(kNoNode, 0);
  nodes_[root].ns = ns;
  roots_.emplace(ns, root);
  return root;
}

void RunTree::CopyTokens(BlockId b, std::span<const int32_t> tokens) {
  CopyBlockTokens(tokens_.get() + static_cast<size_t>(b.value()) * block_size_, tokens.data(),
                  tokens.size());
}

RunTree::Spot RunTree::Locate(NodeIndex root, BlockId at) const {
  if (at == kInvalidBlock) return Spot{root, -1};
  const NodeIndex node = place(at).node;
  return Spot{node, place(at).depth - nodes_[node].depth0};
}

bool RunTree::HangsBelow(BlockId b, NodeIndex root, BlockId at) const {
  if (!Holds(b)) return false;
  if (at != kInvalidBlock) return Parent(b) == at;
  return StartsRun(b) && nodes_[place(b).node].parent == root;
}

int32_t RunTree::NumChildren(NodeIndex root, BlockId at) const {
  const Spot s = Locate(root, at);
  return AtTail(s) ? nodes_[s.node].num_children : 1;
}

NodeIndex RunTree::FindFullChild(NodeIndex parent, std::span<const int32_t> tokens) const {
  if (nodes_[parent].wide != 0) {
    auto it = children_.find(ChildKey{parent, HashTokens(tokens)});
    if (it == children_.end()) return kNoNode;
    return std::ranges::equal(FirstTokens(it->second), tokens) ? it->second : kNoNode;
  }
  // At most kWideFanout children: comparing their tokens beats hashing the block (most blocks a
  // prompt publishes follow a position with no child). The first token turns most away.
  for (NodeIndex c = nodes_[parent].first_child; c != kNoNode; c = nodes_[c].next_sibling) {
    if (IsFull(c) && std::ranges::equal(FirstTokens(c), tokens)) return c;
  }
  return kNoNode;
}

BlockId RunTree::FindFull(NodeIndex root, BlockId at, std::span<const int32_t> tokens) const {
  const Spot s = Locate(root, at);
  if (!AtTail(s)) {
    const BlockId next = runs_[s.node][static_cast<size_t>(s.offset) + 1];
    return std::ranges::equal(Tokens(next), tokens) ? next : kInvalidBlock;
  }
  const NodeIndex child = FindFullChild(s.node, tokens);
  return child == kNoNode ? kInvalidBlock : First(child);
}

NodeIndex RunTree::FirstCandidate(NodeIndex parent, int32_t token) const {
  if (nodes_[parent].wide == 0) return nodes_[parent].first_child;
  auto it = chains_.find(FirstTokenKey{parent, token});
  return it == chains_.end() ? kNoNode : it->second;
}

NodeIndex RunTree::BestChildNode(NodeIndex parent, std::span<const int32_t> tokens,
                                 int32_t* common) const {
  NodeIndex best = kNoNode;
  *common = 0;
  if (tokens.empty()) return best;
  for (NodeIndex c = FirstCandidate(parent, tokens[0]); c != kNoNode; c = NextCandidate(c)) {
    ++stats_.child_scans;
    const int32_t shared = CommonPrefix(FirstTokens(c), tokens);
    if (shared > *common || (shared == *common && shared > 0 &&
                             place(First(c)).coverage > place(First(best)).coverage)) {
      best = c;
      *common = shared;
    }
  }
  return best;
}

BlockId RunTree::BestChild(NodeIndex root, BlockId at, std::span<const int32_t> tokens,
                           int32_t* common) const {
  *common = 0;
  if (tokens.empty()) return kInvalidBlock;
  const Spot s = Locate(root, at);
  if (!AtTail(s)) {
    const BlockId next = runs_[s.node][static_cast<size_t>(s.offset) + 1];
    ++stats_.child_scans;
    const int32_t shared = CommonPrefix(Tokens(next), tokens);
    if (shared == 0) return kInvalidBlock;
    *common = shared;
    return next;
  }
  const NodeIndex child = BestChildNode(s.node, tokens, common);
  return child == kNoNode ? kInvalidBlock : First(child);
}

BlockId RunTree::Covering(NodeIndex root, BlockId at, std::span<const int32_t> tokens,
                          BlockId except) const {
  if (tokens.size() == static_cast<size_t>(block_size_)) return FindFull(root, at, tokens);
  const Spot s = Locate(root, at);
  if (!AtTail(s)) {
    const BlockId next = runs_[s.node][static_cast<size_t>(s.offset) + 1];
    if (!tokens.empty()) ++stats_.child_scans;
    return next != except && StartsWith(Tokens(next), tokens) ? next : kInvalidBlock;
  }
  if (tokens.empty()) {
    for (NodeIndex c = nodes_[s.node].first_child; c != kNoNode; c = nodes_[c].next_sibling) {
      if (First(c) != except) return First(c);
    }
    return kInvalidBlock;
  }
  for (NodeIndex c = FirstCandidate(s.node, tokens[0]); c != kNoNode; c = NextCandidate(c)) {
    ++stats_.child_scans;
    if (First(c) != except && StartsWith(FirstTokens(c), tokens)) return First(c);
  }
  return kInvalidBlock;
}

void RunTree::Candidates(NodeIndex root, BlockId at, int32_t token,
                         std::vector<BlockId>* out) const {
  const Spot s = Locate(root, at);
  if (!AtTail(s)) {
    ++stats_.child_scans;
    out->push_back(runs_[s.node][static_cast<size_t>(s.offset) + 1]);
    return;
  }
  for (NodeIndex c = FirstCandidate(s.node, token); c != kNoNode; c = NextCandidate(c)) {
    ++stats_.child_scans;
    out->push_back(First(c));
  }
}

void RunTree::Match(NodeIndex root, std::span<const int32_t> tokens, std::vector<BlockId>* full,
                    BlockId* partial, int32_t* partial_tokens) const {
  *partial = kInvalidBlock;
  *partial_tokens = 0;
  const size_t bs = static_cast<size_t>(block_size_);
  size_t pos = 0;
  for (NodeIndex node = root; pos < tokens.size();) {
    const std::span<const int32_t> block = tokens.subspan(pos, std::min(bs, tokens.size() - pos));
    NodeIndex child = block.size() == bs ? FindFullChild(node, block) : kNoNode;
    if (child == kNoNode) {
      int32_t common = 0;
      child = BestChildNode(node, block, &common);
      if (child == kNoNode) return;
      if (common != block_size_) {  // else a full block the index missed (a hash collision)
        *partial = First(child);
        *partial_tokens = common;
        return;
      }
    }
    // The run's first block matched whole: follow the run while the prompt agrees.
    const std::vector<BlockId>& run = runs_[child];
    full->push_back(run[0]);
    pos += bs;
    size_t i = 1;
    for (; i < run.size() && tokens.size() - pos >= bs; ++i, pos += bs) {
      const int32_t* cached = tokens_.get() + static_cast<size_t>(run[i].value()) * bs;
      if (std::memcmp(cached, tokens.data() + pos, bs * sizeof(int32_t)) != 0) break;
      full->push_back(run[i]);
    }
    if (i == run.size()) {
      node = child;
      continue;
    }
    // Inside the run: its next block is the position's only child.
    if (pos < tokens.size()) {
      ++stats_.child_scans;
      const int32_t shared =
          CommonPrefix(Tokens(run[i]), tokens.subspan(pos, std::min(bs, tokens.size() - pos)));
      if (shared > 0) {
        *partial = run[i];
        *partial_tokens = shared;
      }
    }
    return;
  }
}

NodeIndex RunTree::NewNode(NodeIndex parent, int32_t depth0) {
  NodeIndex node;
  if (!free_nodes_.empty()) {
    node = free_nodes_.back();
    free_nodes_.pop_back();
  } else {
    node = static_cast<NodeIndex>(nodes_.size());
    nodes_.emplace_back();
    runs_.emplace_back();
    chain_prev_.push_back(kNoNode);
    chain_next_.push_back(kNoNode);
  }
  nodes_[node].parent = parent;
  nodes_[node].depth0 = depth0;
  if (parent != kNoNode) {
    nodes_[node].ns = nodes_[parent].ns;
    ++stats_.runs;
  }
  return node;
}

void RunTree::FreeNode(NodeIndex node) {
  runs_[node].clear();  // keeps its capacity for the node's next use
  nodes_[node] = Node{};
  chain_prev_[node] = chain_next_[node] = kNoNode;
  free_nodes_.push_back(node);
  --stats_.runs;
}

void RunTree::Reassign(std::span<const BlockId> blocks, NodeIndex node) {
  for (BlockId b : blocks) place(b).node = node;
}

void RunTree::Add(NodeIndex root, BlockId at, BlockId b, std::span<const int32_t> tokens) {
  KVPOOL_DCHECK(!Holds(b) && !tokens.empty() && tokens.size() <= static_cast<size_t>(block_size_));
  Spot s = Locate(root, at);
  if (!AtTail(s)) {  // a second child mid-run: the run splits after `at`
    s.node = Split(s.node, s.offset);
    s.offset = static_cast<int32_t>(runs_[s.node].size()) - 1;
  }
  if (stream_tokens_) {
    StreamBlockTokens(tokens_.get() + static_cast<size_t>(b.value()) * block_size_, tokens.data(),
                      tokens.size());
    StreamFence();
  } else {
    CopyTokens(b, tokens);
  }
  const int32_t depth = at == kInvalidBlock ? 1 : place(at).depth + 1;
  const int32_t coverage = static_cast<int32_t>(tokens.size());
  if (at != kInvalidBlock) place(at).leaf = 0;
  if (at != kInvalidBlock && nodes_[s.node].num_children == 0 && coverage == block_size_) {
    runs_[s.node].push_back(b);  // the only child of a run's last block: the run grows
    place(b) = Place{s.node, depth, coverage, 1};
    return;
  }
  const NodeIndex node = NewNode(s.node, depth);
  runs_[node].push_back(b);
  place(b) = Place{node, depth, coverage, 1};
  LinkChild(s.node, node, tokens);
}

void RunTree::AddRun(NodeIndex root, BlockId at, std::span<const BlockId> blocks,
                     std::span<const int32_t> tokens) {
  KVPOOL_DCHECK(NumChildren(root, at) == 0 && !blocks.empty());
  KVPOOL_DCHECK(tokens.size() == blocks.size() * static_cast<size_t>(block_size_));
  NodeIndex node;
  int32_t depth = 1;
  if (at == kInvalidBlock) {
    node = NewNode(root, 1);
  } else {
    node = place(at).node;
    place(at).leaf = 0;
    depth = place(at).depth + 1;
  }
  std::vector<BlockId>& run = runs_[node];
  run.insert(run.end(), blocks.begin(), blocks.end());
  const size_t bs = static_cast<size_t>(block_size_);
  for (size_t k = 0; k < blocks.size(); ++k) {
    const BlockId b = blocks[k];
    int32_t* const slot = tokens_.get() + static_cast<size_t>(b.value()) * bs;
    if (stream_tokens_) {
      StreamBlockTokens(slot, tokens.data() + k * bs, bs);
    } else {
      CopyBlockTokens(slot, tokens.data() + k * bs, bs);
    }
    place(b) = Place{node, depth + static_cast<int32_t>(k), block_size_, 0};
  }
  if (stream_tokens_) StreamFence();
  place(blocks.back()).leaf = 1;
  if (at == kInvalidBlock) LinkChild(root, node, tokens.first(bs));
}

void RunTree::Widen(BlockId b, std::span<const int32_t> tokens) {
  KVPOOL_DCHECK(StartsWith(tokens, Tokens(b)) && IsLeaf(b) && StartsRun(b));
  CopyTokens(b, tokens);
  place(b).coverage = static_cast<int32_t>(tokens.size());
  if (place(b).coverage != block_size_) return;
  const NodeIndex node = place(b).node;
  const NodeIndex parent = nodes_[node].parent;
  if (nodes_[parent].wide != 0) Index(node);
  if (!runs_[parent].empty() && nodes_[parent].num_children == 1) Merge(parent, node);
}

BlockId RunTree::RemoveNode(NodeIndex node) {
  const BlockId b = runs_[node].front();
  KVPOOL_DCHECK(runs_[node].size() == 1 && IsLeaf(b));
  const NodeIndex parent = nodes_[node].parent;
  UnlinkChild(node);  // reads the block's tokens: before its place is cleared
  place(b) = Place{};
  FreeNode(node);
  if (runs_[parent].empty()) return kInvalidBlock;  // a root
  const BlockId above = runs_[parent].back();
  Settle(parent);
  return above;
}

void RunTree::Settle(NodeIndex node) {
  const Node& n = nodes_[node];
  if (n.num_children == 0) {
    place(runs_[node].back()).leaf = 1;
  } else if (n.num_children == 1 && IsFull(n.first_child)) {
    Merge(node, n.first_child);
  }
}

NodeIndex RunTree::Split(NodeIndex node, int32_t offset) {
  ++stats_.splits;
  const size_t head = static_cast<size_t>(offset) + 1;
  const size_t rest = runs_[node].size() - head;
  KVPOOL_DCHECK(rest > 0);
  // The shorter side moves (its blocks change node). The rest moves only from a narrow node: its
  // children follow it, and a wide one's would all be re-keyed.
  if (rest < head && nodes_[node].wide == 0) {
    const NodeIndex tail = NewNode(node, nodes_[node].depth0 + static_cast<int32_t>(head));
    std::vector<BlockId>& run = runs_[node];
    runs_[tail].assign(run.begin() + static_cast<ptrdiff_t>(head), run.end());
    run.resize(head);
    Reassign(runs_[tail], tail);
    AdoptChildren(node, tail);
    LinkChild(node, tail);
    return node;
  }
  const NodeIndex front = NewNode(nodes_[node].parent, nodes_[node].depth0);
  std::vector<BlockId>& run = runs_[node];
  runs_[front].assign(run.begin(), run.begin() + static_cast<ptrdiff_t>(head));
  run.erase(run.begin(), run.begin() + static_cast<ptrdiff_t>(head));
  nodes_[node].depth0 += static_cast<int32_t>(head);
  Reassign(runs_[front], front);
  ReplaceChild(node, front);
  LinkChild(front, node);
  return front;
}

void RunTree::Merge(NodeIndex parent, NodeIndex child) {
  KVPOOL_DCHECK(nodes_[parent].num_children == 1 && nodes_[parent].first_child == child);
  ++stats_.merges;
  UnlinkChild(child);
  std::vector<BlockId>& above = runs_[parent];
  std::vector<BlockId>& below = runs_[child];
  // As in Split, the shorter run changes node, unless that would re-key a wide node's children.
  if (below.size() < above.size() && nodes_[child].wide == 0) {
    Reassign(below, parent);
    above.insert(above.end(), below.begin(), below.end());
    AdoptChildren(child, parent);
    FreeNode(child);
    return;
  }
  Reassign(above, child);
  below.insert(below.begin(), above.begin(), above.end());
  nodes_[child].depth0 = nodes_[parent].depth0;
  ReplaceChild(parent, child);
  FreeNode(parent);
}

void RunTree::ForEachRun(
    absl::FunctionRef<void(BlockId parent, std::span<const BlockId> run)> fn) const {
  std::vector<NodeIndex> stack;
  for (const auto& [ns, root] : roots_) stack.push_back(root);
  while (!stack.empty()) {  // parents before children
    const NodeIndex node = stack.back();
    stack.pop_back();
    const BlockId above = runs_[node].empty() ? kInvalidBlock : runs_[node].back();
    for (NodeIndex c = nodes_[node].first_child; c != kNoNode; c = nodes_[c].next_sibling) {
      fn(above, runs_[c]);
      stack.push_back(c);
    }
  }
}

}  // namespace kvpool::internal
