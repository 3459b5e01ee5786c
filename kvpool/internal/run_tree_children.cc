// RunTree: the child lists of its nodes: siblings, and a wide parent's first-token chains and
// full-child index.

#include "kvpool/internal/run_tree.h"
#include "kvpool/internal/tokens.h"
#include "kvpool/util/check.h"

namespace kvpool::internal {

void RunTree::AdoptChildren(NodeIndex from, NodeIndex to) {
  KVPOOL_DCHECK(nodes_[from].wide == 0 && nodes_[to].num_children == 0);
  nodes_[to].first_child = nodes_[from].first_child;
  nodes_[to].num_children = nodes_[from].num_children;
  for (NodeIndex c = nodes_[to].first_child; c != kNoNode; c = nodes_[c].next_sibling) {
    nodes_[c].parent = to;
  }
  nodes_[from].first_child = kNoNode;
  nodes_[from].num_children = 0;
}

void RunTree::LinkChild(NodeIndex parent, NodeIndex node, std::span<const int32_t> first) {
  Node& n = nodes_[node];
  n.parent = parent;
  n.prev_sibling = kNoNode;
  n.next_sibling = nodes_[parent].first_child;
  if (n.next_sibling != kNoNode) nodes_[n.next_sibling].prev_sibling = node;
  nodes_[parent].first_child = node;
  ++nodes_[parent].num_children;
  if (nodes_[parent].wide != 0) {
    ChainPush(node, first[0]);
    Index(node, first);
    return;
  }
  if (nodes_[parent].num_children <= kWideFanout) return;
  // Becomes wide: chain the children oldest first, so each chain lists them newest first, in
  // sibling-list order (the scans pick the same child either way).
  nodes_[parent].wide = 1;
  std::vector<NodeIndex> children;
  for (NodeIndex c = nodes_[parent].first_child; c != kNoNode; c = nodes_[c].next_sibling) {
    children.push_back(c);
  }
  for (auto it = children.rbegin(); it != children.rend(); ++it) {
    ChainPush(*it);
    Index(*it);
  }
}

void RunTree::Index(NodeIndex node, std::span<const int32_t> first) {
  if (!IsFull(node)) return;  // partial children are found through the chains only
  // A 64-bit collision with a sibling leaves this one out of the index; lookups still find it
  // by comparing the children that share its first token.
  nodes_[node].token_hash = HashTokens(first);
  children_.try_emplace(ChildKey{nodes_[node].parent, nodes_[node].token_hash}, node);
}

void RunTree::UnlinkChild(NodeIndex node) {
  Node& n = nodes_[node];
  const NodeIndex parent = n.parent;
  if (nodes_[parent].wide != 0 && IsFull(node)) {
    auto it = children_.find(ChildKey{parent, n.token_hash});
    if (it != children_.end() && it->second == node) children_.erase(it);
  }
  if (n.prev_sibling != kNoNode) {
    nodes_[n.prev_sibling].next_sibling = n.next_sibling;
  } else {
    nodes_[parent].first_child = n.next_sibling;
  }
  if (n.next_sibling != kNoNode) nodes_[n.next_sibling].prev_sibling = n.prev_sibling;
  --nodes_[parent].num_children;
  if (nodes_[parent].wide != 0) {
    ChainRemove(node);
    if (nodes_[parent].num_children == 0) nodes_[parent].wide = 0;
  }
  n.next_sibling = n.prev_sibling = kNoNode;
  n.parent = kNoNode;
  n.token_hash = 0;
}

void RunTree::ReplaceChild(NodeIndex from, NodeIndex to) {
  const NodeIndex parent = nodes_[from].parent;
  Node& t = nodes_[to];
  t.parent = parent;
  t.prev_sibling = nodes_[from].prev_sibling;
  t.next_sibling = nodes_[from].next_sibling;
  if (t.prev_sibling != kNoNode) {
    nodes_[t.prev_sibling].next_sibling = to;
  } else {
    nodes_[parent].first_child = to;
  }
  if (t.next_sibling != kNoNode) nodes_[t.next_sibling].prev_sibling = to;
  if (nodes_[parent].wide != 0) {
    const NodeIndex prev = chain_prev_[from];
    const NodeIndex next = chain_next_[from];
    chain_prev_[to] = prev;
    chain_next_[to] = next;
    if (prev != kNoNode) {
      chain_next_[prev] = to;
    } else {
      chains_[FirstTokenKey{parent, FirstTokens(to)[0]}] = to;
    }
    if (next != kNoNode) chain_prev_[next] = to;
    t.token_hash = nodes_[from].token_hash;
    auto it = children_.find(ChildKey{parent, t.token_hash});
    if (it != children_.end() && it->second == from) it->second = to;
  }
  Node& f = nodes_[from];
  f.parent = f.prev_sibling = f.next_sibling = kNoNode;
  f.token_hash = 0;
  chain_prev_[from] = chain_next_[from] = kNoNode;
}

void RunTree::ChainPush(NodeIndex node, int32_t first_token) {
  const FirstTokenKey key{nodes_[node].parent, first_token};
  auto [it, inserted] = chains_.try_emplace(key, node);
  chain_prev_[node] = kNoNode;
  chain_next_[node] = inserted ? kNoNode : it->second;
  if (!inserted) {
    chain_prev_[it->second] = node;
    it->second = node;
  }
}

void RunTree::ChainRemove(NodeIndex node) {
  const NodeIndex prev = chain_prev_[node];
  const NodeIndex next = chain_next_[node];
  if (prev != kNoNode) {
    chain_next_[prev] = next;
  } else {
    auto it = chains_.find(FirstTokenKey{nodes_[node].parent, FirstTokens(node)[0]});
    KVPOOL_CHECK(it != chains_.end() && it->second == node);
    if (next == kNoNode) {
      chains_.erase(it);
    } else {
      it->second = next;
    }
  }
  if (next != kNoNode) chain_prev_[next] = prev;
  chain_prev_[node] = chain_next_[node] = kNoNode;
}

}  // namespace kvpool::internal
