#include "kvpool/prefix_cache.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <limits>
#include <string>
#include <utility>

#include "fmt/format.h"
#include "kvpool/internal/tokens.h"
#include "kvpool/util/check.h"
#include "xxhash.h"

namespace kvpool {
using internal::CommonPrefix;
using internal::HashTokens;
using internal::StartsWith;

BlockHash PrefixChainHash(const BlockHash& parent, NamespaceId ns,
                          std::span<const int32_t> tokens) {
  // (parent hash, namespace, tokens) in one buffer: the one-shot hash beats streaming. Blocks up
  // to 1,024 tokens use the stack (no allocation per stored block).
  constexpr size_t kHeader = sizeof(BlockHash) + sizeof(uint64_t);
  constexpr size_t kInline = kHeader + 1024 * sizeof(int32_t);
  std::array<char, kInline> stack;
  std::string heap;
  const size_t size = kHeader + tokens.size_bytes();
  std::span<char> buffer(stack.data(), size);
  if (size > kInline) {
    heap.resize(size);
    buffer = std::span<char>(heap.data(), size);
  }
  const uint64_t ns_value = ns.value();
  std::memcpy(buffer.data(), &parent, sizeof(BlockHash));
  std::memcpy(buffer.data() + sizeof(BlockHash), &ns_value, sizeof(ns_value));
  std::memcpy(buffer.data() + sizeof(BlockHash) + sizeof(ns_value), tokens.data(),
              tokens.size_bytes());
  const XXH128_hash_t h = XXH3_128bits(buffer.data(), buffer.size());
  return BlockHash{h.low64, h.high64};
}

std::string MatchExplanation::ToString() const {
  std::string out = fmt::format("matched {} tokens; ", matched_tokens);
  switch (stop) {
    case MatchStop::kPromptEnd:
      out += "the whole prompt is cached";
      break;
    case MatchStop::kUnknownNamespace:
      out += "nothing was ever cached in this namespace";
      break;
    case MatchStop::kNoChild:
      out += fmt::format("block {}: nothing cached after the matched prefix", block_index);
      break;
    case MatchStop::kDiverged:
      out += fmt::format(
          "block {}: the closest cached block shares {} of the {} tokens needed (first "
          "difference at token {} of the block)",
          block_index, best_common, tokens_needed, best_common);
      break;
    case MatchStop::kInsufficientCoverage:
      out += fmt::format(
          "block {}: a cached block agrees but covers only {} of the {} tokens needed (a rewind "
          "endpoint); its {} tokens were reused",
          block_index, best_coverage, tokens_needed, best_common);
      break;
    case MatchStop::kEvicted:
      out += fmt::format("block {}: it was cached and has been evicted{}", block_index,
                         below_admission_bar ? " (below the admission bar: never admitted)" : "");
      break;
  }
  for (const auto& [ns, tokens] : other_namespaces) {
    out += fmt::format(
        "; namespace {} would match {} tokens (prefixes are never shared across "
        "namespaces)",
        ns.value(), tokens);
  }
  return out;
}

absl::StatusOr<std::unique_ptr<PrefixCache>> PrefixCache::Create(const PrefixCacheOptions& options,
                                                                 BlockPool* pool) {
  if (options.block_size <= 0) {
    return absl::InvalidArgumentError(
        fmt::format("block_size must be > 0 (got {})", options.block_size));
  }
  if (options.event_capacity == 0 || options.event_capacity_bytes == 0) {
    return absl::InvalidArgumentError("event_capacity and event_capacity_bytes must be > 0");
  }
  absl::StatusOr<EvictionOptions> spec = ParseEvictionSpec(options.policy);
  if (!spec.ok()) return spec.status();
  spec->history_blocks = options.history_blocks;
  std::unique_ptr<EvictionPolicy> policy;
  if (options.policy_factory) {
    policy = options.policy_factory();
    if (policy == nullptr) return absl::InvalidArgumentError("policy_factory returned null");
  } else {
    absl::StatusOr<std::unique_ptr<EvictionPolicy>> made =
        MakeEvictionPolicy(*spec, pool->num_blocks());
    if (!made.ok()) return made.status();
    policy = std::move(*made);
  }
  return std::unique_ptr<PrefixCache>(
      new PrefixCache(options, pool, std::move(policy), spec->retain_partial_tails));
}

PrefixCache::PrefixCache(const PrefixCacheOptions& options, BlockPool* pool,
                         std::unique_ptr<EvictionPolicy> policy, bool retain_partial_tails)
    : block_size_(options.block_size),
      evicted_memory_(options.evicted_memory),
      retain_partial_tails_(retain_partial_tails),
      events_on_(options.events),
      journal_on_(options.journal),
      hashes_on_(options.events || options.journal || options.evicted_memory > 0 ||
                 policy->uses_fingerprints()),
      pool_(pool),
      policy_(std::move(policy)),
      ranks_by_release_(policy_->ranks_by_release()),
      hears_accesses_(policy_->hears_accesses()),
      lean_evictions_(!options.events && options.evicted_memory == 0 && !hears_accesses_),
      events_(options.epoch, options.event_capacity, options.event_capacity_bytes),
      node_of_block_(static_cast<size_t>(pool->num_blocks()), kNoNode),
      evicted_ring_(options.evicted_memory) {}

NodeIndex PrefixCache::GrowNodes() {
  const auto node = static_cast<NodeIndex>(nodes_.size());
  nodes_.emplace_back();
  chain_prev_.push_back(kNoNode);
  chain_next_.push_back(kNoNode);
  tail_prev_.push_back(kNoNode);
  tail_next_.push_back(kNoNode);
  state_.emplace_back();
  ns_.push_back(kNoNamespace);
  hash_.push_back(BlockHash{});
  tokens_.resize(tokens_.size() + static_cast<size_t>(block_size_));
  if (static_cast<size_t>(node) % 1024 == 0) policy_->Reserve(node + 1024);
  return node;
}

NodeIndex PrefixCache::Root(NamespaceId ns) const {
  auto it = roots_.find(ns);
  return it == roots_.end() ? kNoNode : it->second;
}

NodeIndex PrefixCache::RootOrCreate(NamespaceId ns) {
  if (NodeIndex root = Root(ns); root != kNoNode) return root;
  const NodeIndex root = NewNode();
  ns_[root] = ns;
  roots_.emplace(ns, root);
  return root;
}

bool PrefixCache::Agrees(BlockId block, std::span<const int32_t> tokens) const {
  const NodeIndex node = node_of_block_[static_cast<size_t>(block.value())];
  if (node == kNoNode) return true;
  const std::span<const int32_t> published = Tokens(node);
  return StartsWith(tokens, published) || StartsWith(published, tokens);
}

NodeIndex PrefixCache::FindFull(NodeIndex parent, std::span<const int32_t> tokens) const {
  if (nodes_[parent].wide != 0) {
    auto it = children_.find(ChildKey{parent, HashTokens(tokens)});
    if (it == children_.end()) return kNoNode;
    return std::ranges::equal(Tokens(it->second), tokens) ? it->second : kNoNode;
  }
  // At most kWideFanout siblings: comparing their tokens beats a hash-map probe (a cache miss per
  // lookup, and another per removal, in a map as large as the tree) and hashing the block (as
  // costly as comparing it, and most blocks a prompt publishes follow a parent with no child).
  // The first token turns most siblings away.
  for (NodeIndex c = nodes_[parent].first_child; c != kNoNode; c = nodes_[c].next_sibling) {
    if (nodes_[c].coverage == block_size_ && std::ranges::equal(Tokens(c), tokens)) return c;
  }
  return kNoNode;
}

NodeIndex PrefixCache::BestChild(NodeIndex parent, std::span<const int32_t> tokens,
                                 int32_t* common) const {
  NodeIndex best = kNoNode;
  *common = 0;
  if (tokens.empty()) return best;
  for (NodeIndex c = FirstCandidate(parent, tokens[0]); c != kNoNode; c = NextCandidate(c)) {
    ++child_scans_;
    const int32_t shared = CommonPrefix(Tokens(c), tokens);
    if (shared > *common ||
        (shared == *common && shared > 0 && nodes_[c].coverage > nodes_[best].coverage)) {
      best = c;
      *common = shared;
    }
  }
  return best;
}

NodeIndex PrefixCache::Covering(NodeIndex parent, std::span<const int32_t> tokens,
                                NodeIndex except) const {
  if (tokens.size() == static_cast<size_t>(block_size_)) return FindFull(parent, tokens);
  if (tokens.empty()) {
    for (NodeIndex c = nodes_[parent].first_child; c != kNoNode; c = nodes_[c].next_sibling) {
      if (c != except) return c;
    }
    return kNoNode;
  }
  for (NodeIndex c = FirstCandidate(parent, tokens[0]); c != kNoNode; c = NextCandidate(c)) {
    ++child_scans_;
    if (c != except && StartsWith(Tokens(c), tokens)) return c;
  }
  return kNoNode;
}

void PrefixCache::LinkChild(NodeIndex parent, NodeIndex node) {
  nodes_[node].prev_sibling = kNoNode;
  nodes_[node].next_sibling = nodes_[parent].first_child;
  if (nodes_[parent].first_child != kNoNode) nodes_[nodes_[parent].first_child].prev_sibling = node;
  nodes_[parent].first_child = node;
  ++nodes_[parent].num_children;
  if (nodes_[parent].wide != 0) {
    ChainPush(node);
    return;
  }
  if (nodes_[parent].num_children <= kWideFanout) return;
  // Becomes wide: chain the children oldest first, so each chain lists them newest first, in
  // sibling-list order (the scans pick the same child either way).
  nodes_[parent].wide = 1;
  std::vector<NodeIndex> children;
  for (NodeIndex c = nodes_[parent].first_child; c != kNoNode; c = nodes_[c].next_sibling)
    children.push_back(c);
  for (auto it = children.rbegin(); it != children.rend(); ++it) {
    ChainPush(*it);
    // `node` itself is not full yet (MakeFull indexes it).
    if (*it != node && nodes_[*it].coverage == block_size_) {
      nodes_[*it].token_hash = HashTokens(Tokens(*it));
      children_.try_emplace(ChildKey{parent, nodes_[*it].token_hash}, *it);
    }
  }
}

void PrefixCache::UnlinkChild(NodeIndex node) {
  const NodeIndex parent = nodes_[node].parent;
  if (nodes_[node].prev_sibling != kNoNode) {
    nodes_[nodes_[node].prev_sibling].next_sibling = nodes_[node].next_sibling;
  } else {
    nodes_[parent].first_child = nodes_[node].next_sibling;
  }
  if (nodes_[node].next_sibling != kNoNode)
    nodes_[nodes_[node].next_sibling].prev_sibling = nodes_[node].prev_sibling;
  nodes_[node].next_sibling = nodes_[node].prev_sibling = kNoNode;
  --nodes_[parent].num_children;
  if (nodes_[parent].wide != 0) {
    ChainRemove(node);
    if (nodes_[parent].num_children == 0) nodes_[parent].wide = 0;
  }
}

void PrefixCache::ChainPush(NodeIndex node) {
  const FirstTokenKey key{nodes_[node].parent, Tokens(node)[0]};
  auto [it, inserted] = chains_.try_emplace(key, node);
  chain_prev_[node] = kNoNode;
  chain_next_[node] = inserted ? kNoNode : it->second;
  if (!inserted) {
    chain_prev_[it->second] = node;
    it->second = node;
  }
}

void PrefixCache::ChainRemove(NodeIndex node) {
  const NodeIndex prev = chain_prev_[node];
  const NodeIndex next = chain_next_[node];
  if (prev != kNoNode) {
    chain_next_[prev] = next;
  } else {
    auto it = chains_.find(FirstTokenKey{nodes_[node].parent, Tokens(node)[0]});
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

NodeIndex PrefixCache::FirstCandidate(NodeIndex parent, int32_t token) const {
  if (nodes_[parent].wide == 0) return nodes_[parent].first_child;
  auto it = chains_.find(FirstTokenKey{parent, token});
  return it == chains_.end() ? kNoNode : it->second;
}

PrefixMatch PrefixCache::Match(NamespaceId ns, std::span<const int32_t> tokens) const {
  PrefixMatch m;
  NodeIndex node = Root(ns);
  if (node == kNoNode) return m;
  const size_t bs = static_cast<size_t>(block_size_);
  for (size_t pos = 0; pos < tokens.size();) {
    const std::span<const int32_t> block = tokens.subspan(pos, std::min(bs, tokens.size() - pos));
    if (block.size() == bs) {
      if (NodeIndex child = FindFull(node, block); child != kNoNode) {
        m.full.push_back(child);
        node = child;
        pos += bs;
        continue;
      }
    }
    int32_t common = 0;
    const NodeIndex best = BestChild(node, block, &common);
    if (best == kNoNode) break;
    if (common == block_size_) {  // a full block the index missed (hash collision)
      m.full.push_back(best);
      node = best;
      pos += bs;
      continue;
    }
    m.partial = best;
    m.partial_tokens = common;
    break;
  }
  m.matched_tokens = static_cast<int64_t>(m.full.size()) * block_size_ + m.partial_tokens;
  return m;
}

void PrefixCache::ExplainStop(NamespaceId ns, std::span<const int32_t> tokens, const PrefixMatch& m,
                              MatchExplanation* e) const {
  e->matched_tokens = m.matched_tokens;
  e->block_index = static_cast<int64_t>(m.full.size());
  const size_t pos = m.full.size() * static_cast<size_t>(block_size_);
  const NodeIndex root = Root(ns);
  // A stop at the first block for want of anything cached: does another namespace hold it?
  auto note_elsewhere = [&] {
    if (pos == 0 && tokens.size() >= static_cast<size_t>(block_size_)) {
      e->first_block_elsewhere =
          FirstBlockElsewhere(ns, tokens.first(static_cast<size_t>(block_size_)));
    }
  };
  if (root == kNoNode) {
    e->stop = MatchStop::kUnknownNamespace;
    note_elsewhere();
    return;
  }
  if (pos >= tokens.size() || m.matched_tokens == static_cast<int64_t>(tokens.size())) {
    e->stop = MatchStop::kPromptEnd;
    return;
  }
  const NodeIndex parent = m.full.empty() ? root : m.full.back();
  const std::span<const int32_t> block =
      tokens.subspan(pos, std::min(static_cast<size_t>(block_size_), tokens.size() - pos));
  e->tokens_needed = static_cast<int32_t>(block.size());
  const NodeIndex best = BestChild(parent, block, &e->best_common);
  if (best != kNoNode) e->best_coverage = nodes_[best].coverage;
  // Nothing remembered as evicted (none yet, or no memory): no hash to compute.
  const auto evicted = block.size() == static_cast<size_t>(block_size_) && !evicted_set_.empty()
                           ? evicted_set_.find(PrefixChainHash(hash_[parent], ns, block))
                           : evicted_set_.end();
  if (evicted != evicted_set_.end()) {
    e->stop = MatchStop::kEvicted;
    e->below_admission_bar = evicted->second;
  } else if (best == kNoNode && nodes_[parent].num_children == 0) {
    e->stop = MatchStop::kNoChild;
    note_elsewhere();
  } else if (best != kNoNode && e->best_common == e->best_coverage &&
             e->best_coverage < e->tokens_needed) {
    e->stop = MatchStop::kInsufficientCoverage;
  } else {
    e->stop = MatchStop::kDiverged;
    note_elsewhere();
  }
}

bool PrefixCache::FirstBlockElsewhere(NamespaceId ns, std::span<const int32_t> block) const {
  if (first_blocks_.empty()) return false;
  const uint64_t h = HashTokens(block);
  for (auto it = first_blocks_.lower_bound({h, std::numeric_limits<NodeIndex>::min()});
       it != first_blocks_.end() && it->first == h; ++it) {
    if (ns_[it->second] != ns && std::ranges::equal(Tokens(it->second), block)) return true;
  }
  return false;
}

MatchExplanation PrefixCache::Explain(NamespaceId ns, std::span<const int32_t> tokens) const {
  MatchExplanation e;
  ExplainStop(ns, tokens, Match(ns, tokens), &e);
  for (const auto& [other, other_root] : roots_) {
    if (other == ns) continue;
    const int64_t matched = Match(other, tokens).matched_tokens;
    if (matched > e.matched_tokens) e.other_namespaces.emplace_back(other, matched);
  }
  std::sort(e.other_namespaces.begin(), e.other_namespaces.end());
  return e;
}

inline void PrefixCache::UpdateEvictable(NodeIndex node) {
  const bool want = ShouldBeEvictable(node);
  if (want != (state_[node].evictable != 0)) {
    state_[node].evictable = want ? 1 : 0;
    num_evictable_ += want ? 1 : -1;
    if (want) {  // released: the moment LRU and the reuse model age it from
      state_[node].released_ns = now_ns_;
      state_[node].release_seq = ++release_counter_;
    }
    // Candidates are leaves (a parent leaves them when it gains a child), so a node with
    // children is none before or after: most released nodes, all but a chain's last.
    if (nodes_[node].num_children == 0) UpdateCandidate(node);
  }
  // Only a pinned node (or one just unpinned) has a charge to change.
  if (state_[node].pins != 0 || state_[node].pin_charged != 0) UpdatePinCharge(node);
}

void PrefixCache::Lock(NodeIndex node) {
  if (nodes_[node].lock++ == 0) UpdateEvictable(node);
}

void PrefixCache::LockHit(NodeIndex node) {
  Lock(node);  // first: the policy hears of hits on nodes that are not candidates
  ++state_[node].hits;
  ++counters_.hits;
  if (hears_accesses_) policy_->OnHit(node, Facts(node), now_ns_);
}

void PrefixCache::Unlock(NodeIndex node) {
  KVPOOL_CHECK_MSG(nodes_[node].lock > 0, "unlock of an unlocked prefix-cache node");
  if (--nodes_[node].lock == 0) UpdateEvictable(node);
}

void PrefixCache::ReleasePath(CachePath* path, std::span<const BlockId> table, size_t keep,
                              const TraceContext& ctx, std::source_location site) {
  KVPOOL_DCHECK(table.size() >= path->full.size());
  // One loop, the pool's Release and the node's re-evaluation inlined: a finished prompt
  // releases every block it published here.
  for (size_t k = path->full.size(); k > keep;) {
    --k;
    const NodeIndex node = path->full[k];
    const BlockId block = table[k];
    KVPOOL_CHECK_OK(pool_->Release(block, ctx, site));
    KVPOOL_CHECK_MSG(nodes_[node].lock > 0, "unlock of an unlocked prefix-cache node");
    --nodes_[node].lock;
    if (nodes_[node].block == block) {
      UpdateEvictable(node);  // its lock and its block's references both changed
      continue;
    }
    OnBlockRefsChanged(block);  // the block's own node, if it has one, is another
    if (nodes_[node].lock == 0) UpdateEvictable(node);
  }
  if (path->full.size() > keep) path->full.resize(keep);
}

CachePath PrefixCache::Adopt(const PrefixMatch& match) {
  CachePath path{.full = match.full, .partial = match.partial};
  for (NodeIndex node : path.full) LockHit(node);
  if (path.partial != kNoNode) LockHit(path.partial);
  return path;
}

CachePath PrefixCache::Clone(const CachePath& path) {
  for (NodeIndex node : path.full) Lock(node);
  if (path.partial != kNoNode) Lock(path.partial);
  return path;
}

void PrefixCache::Truncate(CachePath* path, size_t keep_full) {
  if (path->partial != kNoNode) {
    Unlock(path->partial);
    path->partial = kNoNode;
  }
  while (path->full.size() > keep_full) {
    Unlock(path->full.back());
    path->full.pop_back();
  }
}

void PrefixCache::OnBlockRefsChanged(BlockId block) {
  const NodeIndex node = node_of_block_[static_cast<size_t>(block.value())];
  if (node != kNoNode) UpdateEvictable(node);
}

}  // namespace kvpool
