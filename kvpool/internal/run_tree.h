#pragma once

// RunTree: the shape of the prefix tree (DESIGN.md §5), with radix nodes that hold runs of blocks.
//
// Every cached block has one place in its namespace's tree: below its parent block (or the root),
// at depth = its parent's + 1 (a root's children are at depth 1). A node holds a run of full
// blocks, each the only child of the one before it; a partial block (coverage < block_size, a
// rewind endpoint) is a node of its own and always a leaf. The runs are maximal: a run splits
// where a block gains a second child (prompts diverge) and two nodes merge back as soon as one is
// left with a single child that is full, so the same cached blocks make the same runs whatever
// order they came in (CheckInvariants checks it).
//
// The tree keeps per block only what its shape needs: its node, depth, coverage, tokens and
// whether it is a leaf (no child block). Everything else a cache records per block (locks, pins,
// eviction facts) belongs to the caller, indexed by the same BlockId, so a split or a merge moves
// block ids between nodes and nothing else: its cost is the shorter side's length.
//
// A position is where a path ends: the root of a namespace (`at` == kInvalidBlock) or a full
// block. Its children are the block after it in its run, or, at a run's last block, the first
// blocks of its node's children.
//
// Thread-compatible; owned by the PrefixCache. Spans it returns are valid until the next
// mutation.

#include <cstdint>
#include <memory>
#include <new>
#include <span>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "kvpool/eviction_policy.h"
#include "kvpool/internal/tokens.h"
#include "kvpool/util/check.h"
#include "kvpool/util/strong_id.h"

namespace kvpool::internal {

struct RunTreeStats {
  int64_t runs = 0;          // nodes holding blocks (roots excluded)
  uint64_t splits = 0;       // runs split to hang a second child (or a partial one) mid-run
  uint64_t merges = 0;       // nodes merged back into a run
  uint64_t child_scans = 0;  // children compared by partial-block lookups
};

class RunTree final {
 public:
  // REQUIRES: block_size > 0, num_blocks > 0. A tree whose working set (TokenWorkingSet: its
  // token array, and small blocks' bookkeeping) is larger than `stream_over_bytes` publishes runs
  // with non-temporal stores (StreamBlockTokens).
  RunTree(int32_t block_size, int32_t num_blocks,
          int64_t stream_over_bytes = TokenStreamThreshold());

  int32_t block_size() const { return block_size_; }
  bool streams_tokens() const { return stream_tokens_; }
  NodeIndex Root(NamespaceId ns) const;
  NodeIndex RootOrCreate(NamespaceId ns);
  const absl::flat_hash_map<NamespaceId, NodeIndex>& roots() const { return roots_; }

  // Per block. REQUIRES for all but Holds() and coverage(): Holds(b).
  bool Holds(BlockId b) const { return place(b).node != kNoNode; }
  // Tokens of `b` the tree holds; 0 when it holds none.
  int32_t coverage(BlockId b) const { return place(b).coverage; }
  std::span<const int32_t> Tokens(BlockId b) const {
    return {tokens_.get() + static_cast<size_t>(b.value()) * block_size_,
            static_cast<size_t>(place(b).coverage)};
  }
  int32_t depth(BlockId b) const { return place(b).depth; }
  NamespaceId ns_of(BlockId b) const { return nodes_[place(b).node].ns; }
  // Whether no block hangs below `b`.
  bool IsLeaf(BlockId b) const { return place(b).leaf != 0; }
  // HashTokens(Tokens(b)) for a full `b`, read from the child index (not recomputed) when `b`
  // starts a full child of a wide parent, as a root's first blocks do in a busy namespace.
  uint64_t TokenHash(BlockId b) const {
    const Place& p = place(b);
    const Node& n = nodes_[p.node];
    if (p.depth == n.depth0 && nodes_[n.parent].wide != 0 && p.coverage == block_size_) {
      return n.token_hash;
    }
    return HashTokens(Tokens(b));
  }
  // Whether `b` is the first block of its node (a run, or a partial block).
  bool StartsRun(BlockId b) const { return place(b).depth == nodes_[place(b).node].depth0; }
  // The block `b` hangs below (kInvalidBlock at a root) and, in `siblings`, how many children
  // that position has (`b` included).
  BlockId Parent(BlockId b, int32_t* siblings = nullptr) const {
    const Place& p = place(b);
    const int32_t offset = p.depth - nodes_[p.node].depth0;
    if (offset > 0) {
      if (siblings != nullptr) *siblings = 1;
      return runs_[p.node][static_cast<size_t>(offset) - 1];
    }
    const NodeIndex parent = nodes_[p.node].parent;
    if (siblings != nullptr) *siblings = nodes_[parent].num_children;
    return runs_[parent].empty() ? kInvalidBlock : runs_[parent].back();
  }
  // The blocks of `b`'s run, from its first up to `b`.
  std::span<const BlockId> RunUpTo(BlockId b) const {
    const Place& p = place(b);
    return {runs_[p.node].data(), static_cast<size_t>(p.depth - nodes_[p.node].depth0) + 1};
  }
  // Whether `b` hangs at position (`root`, `at`).
  bool HangsBelow(BlockId b, NodeIndex root, BlockId at) const;

  // Per position (`root`'s, when `at` is kInvalidBlock; else REQUIRES: `at` is a full block of
  // that tree).
  int32_t NumChildren(NodeIndex root, BlockId at) const;
  // The full child holding exactly `tokens` (a whole block), or kInvalidBlock.
  BlockId FindFull(NodeIndex root, BlockId at, std::span<const int32_t> tokens) const;
  // The child sharing the most leading tokens with `tokens` (capped at its coverage); ties go to
  // the wider one, then to the newer. kInvalidBlock when none shares any.
  BlockId BestChild(NodeIndex root, BlockId at, std::span<const int32_t> tokens,
                    int32_t* common) const;
  // A child other than `except` that covers all of `tokens`, or kInvalidBlock.
  BlockId Covering(NodeIndex root, BlockId at, std::span<const int32_t> tokens,
                   BlockId except) const;
  // Appends to `out` the children a block starting with `token` may share tokens with (every
  // child sharing it is among them), newest first.
  void Candidates(NodeIndex root, BlockId at, int32_t token, std::vector<BlockId>* out) const;

  // The longest cached prefix of `tokens` below `root`: its full blocks, root first, appended to
  // `full`, and the block matched for part of its tokens after them (kInvalidBlock if none) with
  // how many.
  void Match(NodeIndex root, std::span<const int32_t> tokens, std::vector<BlockId>* full,
             BlockId* partial, int32_t* partial_tokens) const;

  // Hangs `b` (not held; `tokens` its published ones, 1..block_size) as a new leaf below the
  // position, splitting the run there when `at` is inside one and extending a childless run when
  // `b` is full.
  void Add(NodeIndex root, BlockId at, BlockId b, std::span<const int32_t> tokens);
  // Add() for a chain of full blocks (`tokens` holds block_size per block) below a position with
  // no child: one run, extended in place when `at` ends one. REQUIRES: NumChildren(root, at) == 0.
  void AddRun(NodeIndex root, BlockId at, std::span<const BlockId> blocks,
              std::span<const int32_t> tokens);
  // Extends partial `b` to `tokens` (of which its tokens are a prefix). A block that becomes full
  // joins its parent's run when it is that run's only child.
  void Widen(BlockId b, std::span<const int32_t> tokens);
  // Removes leaf `b` and returns the block it hung below (kInvalidBlock at a root). A node left
  // with one full child merges with it.
  BlockId Remove(BlockId b) {
    std::vector<BlockId>& run = runs_[place(b).node];
    if (run.size() == 1) return RemoveNode(place(b).node);
    place(b) = Place{};  // a run's last block: the run shrinks
    run.pop_back();
    place(run.back()).leaf = 1;
    return run.back();
  }
  // Removes the last `n` blocks of leaf `b`'s run (`b` the last of them), leaving at least one.
  void Trim(BlockId b, size_t n) {
    std::vector<BlockId>& run = runs_[place(b).node];
    KVPOOL_DCHECK(IsLeaf(b) && n < run.size());
    Place* const places = places_.data();
    for (size_t k = run.size() - n; k < run.size(); ++k) {
      places[static_cast<size_t>(run[k].value())] = Place{};
    }
    run.resize(run.size() - n);
    places[static_cast<size_t>(run.back().value())].leaf = 1;
  }

  // Calls `fn` for every node's run, parents before children, with the block it hangs below.
  void ForEachRun(absl::FunctionRef<void(BlockId parent, std::span<const BlockId> run)> fn) const;

  const RunTreeStats& stats() const { return stats_; }
  // Shape, places, maximal runs, child lists, the wide parents' first-token chains and full-child
  // index. Returns INTERNAL naming the first violation.
  absl::Status CheckInvariants() const;

 private:
  // Where a block is: its node, depth, coverage and whether it is a leaf. 16 bytes.
  struct Place {
    NodeIndex node = kNoNode;
    int32_t depth = 0;
    int32_t coverage = 0;
    uint8_t leaf = 0;
  };
  // A radix node: a run of blocks (none for a root) and its links.
  struct Node {
    NodeIndex parent = kNoNode;
    NodeIndex first_child = kNoNode;
    NodeIndex next_sibling = kNoNode;
    NodeIndex prev_sibling = kNoNode;
    int32_t num_children = 0;
    int32_t depth0 = 0;  // depth of its first block (roots: 0)
    // HashTokens of its first block while it is a full child of a wide parent (its key in
    // children_).
    uint64_t token_hash = 0;
    NamespaceId ns;
    uint8_t wide = 0;  // children chained by first token (> kWideFanout once, until none)
  };
  struct ChildKey {
    NodeIndex parent;
    uint64_t token_hash;
    friend bool operator==(const ChildKey&, const ChildKey&) = default;
    template <typename H>
    friend H AbslHashValue(H h, const ChildKey& k) {
      return H::combine(std::move(h), k.parent, k.token_hash);
    }
  };
  struct FirstTokenKey {
    NodeIndex parent;
    int32_t token;
    friend bool operator==(const FirstTokenKey&, const FirstTokenKey&) = default;
    template <typename H>
    friend H AbslHashValue(H h, const FirstTokenKey& k) {
      return H::combine(std::move(h), k.parent, k.token);
    }
  };
  // A position resolved: its node and the offset of `at` in the node's run (-1 at a root).
  struct Spot {
    NodeIndex node;
    int32_t offset;
  };

  // A parent with more children than this chains them by first token (partial lookups compare
  // only those sharing the block's first token) and indexes its full ones by token hash.
  static constexpr int32_t kWideFanout = 8;

  const Place& place(BlockId b) const { return places_[static_cast<size_t>(b.value())]; }
  Place& place(BlockId b) { return places_[static_cast<size_t>(b.value())]; }
  Spot Locate(NodeIndex root, BlockId at) const;
  bool AtTail(Spot s) const { return s.offset + 1 == static_cast<int32_t>(runs_[s.node].size()); }
  BlockId First(NodeIndex node) const { return runs_[node].front(); }
  bool IsFull(NodeIndex node) const { return place(First(node)).coverage == block_size_; }
  std::span<const int32_t> FirstTokens(NodeIndex node) const { return Tokens(First(node)); }
  void CopyTokens(BlockId b, std::span<const int32_t> tokens);

  // Node-level lookups among `parent`'s children (FindFull, BestChild for a run's last block).
  NodeIndex FindFullChild(NodeIndex parent, std::span<const int32_t> tokens) const;
  NodeIndex BestChildNode(NodeIndex parent, std::span<const int32_t> tokens, int32_t* common) const;
  NodeIndex FirstCandidate(NodeIndex parent, int32_t token) const;
  NodeIndex NextCandidate(NodeIndex child) const {
    return nodes_[nodes_[child].parent].wide != 0 ? chain_next_[child] : nodes_[child].next_sibling;
  }

  NodeIndex NewNode(NodeIndex parent, int32_t depth0);
  void FreeNode(NodeIndex node);
  // Remove() of a node's only block: unlinks and frees the node, and settles its parent.
  BlockId RemoveNode(NodeIndex node);
  // Child lists. REQUIRES for LinkChild: `node`'s run and tokens are set. `first`: its first
  // block's tokens, the stored ones or equal to them: a publishing caller passes its own copy,
  // still cached where the store streamed around the caches (StreamBlockTokens).
  void LinkChild(NodeIndex parent, NodeIndex node) { LinkChild(parent, node, FirstTokens(node)); }
  void LinkChild(NodeIndex parent, NodeIndex node, std::span<const int32_t> first);
  void UnlinkChild(NodeIndex node);
  // `to` takes `from`'s place among its parent's children (same first token and key).
  void ReplaceChild(NodeIndex from, NodeIndex to);
  void Index(NodeIndex node) { Index(node, FirstTokens(node)); }
  void Index(NodeIndex node, std::span<const int32_t> first);
  void ChainPush(NodeIndex node) { ChainPush(node, FirstTokens(node)[0]); }
  void ChainPush(NodeIndex node, int32_t first_token);
  void ChainRemove(NodeIndex node);
  // Moves `from`'s children (and its fan-out state) to `to`, which has none.
  void AdoptChildren(NodeIndex from, NodeIndex to);
  // Splits `node` after its block at `offset` (not its last): that block ends a run whose only
  // child holds the rest. Returns the node now holding that block.
  NodeIndex Split(NodeIndex node, int32_t offset);
  // Joins `parent`'s run and that of its only child `child` (full) into one node.
  void Merge(NodeIndex parent, NodeIndex child);
  // After `node` lost a child: merges it with a last full child, or marks its tail a leaf.
  void Settle(NodeIndex node);
  void Reassign(std::span<const BlockId> blocks, NodeIndex node);

  absl::Status CheckNode(NodeIndex node, int64_t* held) const;
  absl::Status CheckChildren(NodeIndex node) const;
  absl::Status CheckChains() const;

  const int32_t block_size_;
  const bool stream_tokens_;
  std::vector<Place> places_;  // by BlockId
  LineAlignedTokens tokens_;   // [num_blocks][block_size], by BlockId
  std::vector<Node> nodes_;
  std::vector<std::vector<BlockId>> runs_;  // by node: its blocks, first to last
  std::vector<NodeIndex> chain_prev_;       // children of a wide parent: the first-token chain
  std::vector<NodeIndex> chain_next_;
  std::vector<NodeIndex> free_nodes_;
  absl::flat_hash_map<NamespaceId, NodeIndex> roots_;
  absl::flat_hash_map<ChildKey, NodeIndex> children_;     // full children of wide parents
  absl::flat_hash_map<FirstTokenKey, NodeIndex> chains_;  // wide parents' chain heads
  mutable RunTreeStats stats_;
};

}  // namespace kvpool::internal
