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
  if (resumable_tokens >= 0 && resumable_tokens < matched_tokens - window_evicted_tokens) {
    out += fmt::format(
        "; the state group resumes only {} of them (the deepest state checkpoint at or below; "
        "the other {} are computed again)",
        resumable_tokens, matched_tokens - resumable_tokens - window_evicted_tokens);
  }
  if (window_evicted_tokens > 0) {
    out += fmt::format(
        "; the window group cuts {} of them (a window block the resumed window needs was evicted "
        "or never kept; they are computed again)",
        window_evicted_tokens);
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
  if (options.max_shares < 0 || options.max_shares >= 0xffff || options.block_bytes <= 0) {
    return absl::InvalidArgumentError(
        fmt::format("max_shares must be in [0, 65534] and block_bytes > 0 (got {} and {})",
                    options.max_shares, options.block_bytes));
  }
  absl::StatusOr<EvictionOptions> spec = ParseEvictionSpec(options.policy);
  if (!spec.ok()) return spec.status();
  spec->history_blocks = options.history_blocks;
  std::function<std::unique_ptr<EvictionPolicy>()> make = options.policy_factory;
  if (!make) {
    // Checked once here: every later share's policy is made from the same valid options.
    absl::StatusOr<std::unique_ptr<EvictionPolicy>> made =
        MakeEvictionPolicy(*spec, pool->num_blocks());
    if (!made.ok()) return made.status();
    make = [spec = *spec, n = pool->num_blocks()] {
      absl::StatusOr<std::unique_ptr<EvictionPolicy>> p = MakeEvictionPolicy(spec, n);
      KVPOOL_CHECK_OK(p.status());
      return std::move(*p);
    };
  }
  std::unique_ptr<EvictionPolicy> first = make();
  if (first == nullptr) return absl::InvalidArgumentError("policy_factory returned null");
  return std::unique_ptr<PrefixCache>(new PrefixCache(options, pool, std::move(first),
                                                      std::move(make), spec->retain_partial_tails));
}

std::vector<PrefixCache::ShareSlot> PrefixCache::FirstShare(
    std::unique_ptr<EvictionPolicy> policy) {
  std::vector<ShareSlot> shares(1);
  shares[0].policy = std::move(policy);
  return shares;
}

PrefixCache::PrefixCache(const PrefixCacheOptions& options, BlockPool* pool,
                         std::unique_ptr<EvictionPolicy> policy,
                         std::function<std::unique_ptr<EvictionPolicy>()> make_policy,
                         bool retain_partial_tails)
    : block_size_(options.block_size),
      evicted_memory_(options.evicted_memory),
      retain_partial_tails_(retain_partial_tails),
      events_on_(options.events),
      event_group_(options.event_group),
      journal_on_(options.journal),
      hashes_on_(options.events || options.journal || options.evicted_memory > 0 ||
                 policy->uses_fingerprints()),
      pool_(pool),
      make_policy_(std::move(make_policy)),
      max_shares_(options.max_shares),
      shares_on_(options.max_shares > 0),
      share_block_bytes_(options.block_bytes),
      shares_(FirstShare(std::move(policy))),
      policy_(shares_[0].policy.get()),
      ranks_by_release_(policy_->ranks_by_release()),
      hears_accesses_(policy_->hears_accesses()),
      lean_evictions_(!options.events && options.evicted_memory == 0 && !hears_accesses_),
      events_(options.epoch, options.event_capacity, options.event_capacity_bytes),
      tree_(options.block_size, pool->num_blocks()),
      entries_(static_cast<size_t>(pool->num_blocks())),
      tail_prev_(static_cast<size_t>(pool->num_blocks()), kInvalidBlock),
      tail_next_(static_cast<size_t>(pool->num_blocks()), kInvalidBlock),
      evicted_ring_(options.evicted_memory) {
  if (hashes_on_) hash_.resize(static_cast<size_t>(pool->num_blocks()));
  policy_->Reserve(pool->num_blocks());  // the policy knows blocks by their ids
}

absl::Status PrefixCache::SetShare(NamespaceId ns, uint64_t key, uint32_t weight) {
  if (ns == NamespaceId(0) || weight == 0 || weight > kMaxShareWeight) {
    return absl::InvalidArgumentError(fmt::format(
        "a share needs a namespace other than 0 and a weight in [1, {}] (got namespace {}, "
        "weight {})",
        kMaxShareWeight, ns.value(), weight));
  }
  if (!shares_on_) {
    return absl::ResourceExhaustedError("eviction shares are off (max_shares 0)");
  }
  auto it = std::find_if(shares_.begin(), shares_.end(),
                         [key](const ShareSlot& s) { return s.key == key; });
  if (it == shares_.end()) {
    if (static_cast<int64_t>(shares_.size()) > max_shares_) {
      return absl::ResourceExhaustedError(fmt::format(
          "{} eviction shares exist besides the default one (max_shares)", max_shares_));
    }
    std::unique_ptr<EvictionPolicy> policy = make_policy_();
    KVPOOL_CHECK(policy != nullptr && policy->ranks_by_release() == ranks_by_release_ &&
                 policy->hears_accesses() == hears_accesses_);
    policy->Reserve(pool_->num_blocks());
    shares_.push_back(ShareSlot{.key = key, .policy = std::move(policy)});
    it = shares_.end() - 1;
  }
  it->weight = weight;
  const auto slot = static_cast<uint16_t>(it - shares_.begin());
  if (slot == 0) {
    share_of_ns_.erase(ns);
  } else {
    share_of_ns_[ns] = slot;
  }
  return absl::OkStatus();
}

void PrefixCache::ChargeShare(BlockId block, int64_t bytes) {
  if (!shares_on_) return;
  KVPOOL_CHECK(tree_.Holds(block));
  ShareSlot& s = shares_[entry(block).share];
  s.charged += bytes;
  KVPOOL_CHECK_MSG(s.charged >= 0, "an eviction share's charged bytes went negative");
}

std::vector<ShareUse> PrefixCache::Shares() const {
  std::vector<ShareUse> out;
  out.reserve(shares_.size());
  for (const ShareSlot& s : shares_) out.push_back(UseOf(s));
  return out;
}

bool PrefixCache::Agrees(BlockId block, std::span<const int32_t> tokens) const {
  if (!tree_.Holds(block)) return true;
  const std::span<const int32_t> published = tree_.Tokens(block);
  return StartsWith(tokens, published) || StartsWith(published, tokens);
}

PrefixMatch PrefixCache::Match(NamespaceId ns, std::span<const int32_t> tokens) const {
  PrefixMatch m;
  const NodeIndex root = tree_.Root(ns);
  if (root == kNoNode) return m;
  tree_.Match(root, tokens, &m.full, &m.partial, &m.partial_tokens);
  m.matched_tokens = static_cast<int64_t>(m.full.size()) * block_size_ + m.partial_tokens;
  return m;
}

void PrefixCache::ExplainStop(NamespaceId ns, std::span<const int32_t> tokens, const PrefixMatch& m,
                              MatchExplanation* e) const {
  e->matched_tokens = m.matched_tokens;
  e->block_index = static_cast<int64_t>(m.full.size());
  const size_t pos = m.full.size() * static_cast<size_t>(block_size_);
  const NodeIndex root = tree_.Root(ns);
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
  const BlockId at = m.full.empty() ? kInvalidBlock : m.full.back();
  const std::span<const int32_t> block =
      tokens.subspan(pos, std::min(static_cast<size_t>(block_size_), tokens.size() - pos));
  e->tokens_needed = static_cast<int32_t>(block.size());
  const BlockId best = tree_.BestChild(root, at, block, &e->best_common);
  if (best != kInvalidBlock) e->best_coverage = tree_.coverage(best);
  // Nothing remembered as evicted (none yet, or no memory): no hash to compute.
  const auto evicted = block.size() == static_cast<size_t>(block_size_) && !evicted_set_.empty()
                           ? evicted_set_.find(PrefixChainHash(HashOf(at), ns, block))
                           : evicted_set_.end();
  if (evicted != evicted_set_.end()) {
    e->stop = MatchStop::kEvicted;
    e->below_admission_bar = evicted->second;
  } else if (best == kInvalidBlock && tree_.NumChildren(root, at) == 0) {
    e->stop = MatchStop::kNoChild;
    note_elsewhere();
  } else if (best != kInvalidBlock && e->best_common == e->best_coverage &&
             e->best_coverage < e->tokens_needed) {
    e->stop = MatchStop::kInsufficientCoverage;
  } else {
    e->stop = MatchStop::kDiverged;
    note_elsewhere();
  }
}

bool PrefixCache::FirstBlockElsewhere(NamespaceId ns, std::span<const int32_t> block) const {
  if (first_blocks_.empty()) return false;
  const uint64_t h = internal::HashTokens(block);
  for (auto it = first_blocks_.lower_bound({h, BlockId(std::numeric_limits<int32_t>::min())});
       it != first_blocks_.end() && it->first == h; ++it) {
    if (tree_.ns_of(it->second) != ns && std::ranges::equal(tree_.Tokens(it->second), block)) {
      return true;
    }
  }
  return false;
}

MatchExplanation PrefixCache::Explain(NamespaceId ns, std::span<const int32_t> tokens) const {
  MatchExplanation e;
  ExplainStop(ns, tokens, Match(ns, tokens), &e);
  for (const auto& [other, other_root] : tree_.roots()) {
    if (other == ns) continue;
    const int64_t matched = Match(other, tokens).matched_tokens;
    if (matched > e.matched_tokens) e.other_namespaces.emplace_back(other, matched);
  }
  std::sort(e.other_namespaces.begin(), e.other_namespaces.end());
  return e;
}

inline void PrefixCache::UpdateEvictable(BlockId block) {
  Entry& e = entry(block);
  const bool want = e.lock == 0 && pool_->state(block) == BlockState::kCached;
  if (want != (e.evictable != 0)) {
    e.evictable = want ? 1 : 0;
    num_evictable_ += want ? 1 : -1;
    CountEvictable(block, want ? 1 : -1);
    if (want) {  // released: the moment LRU and the reuse model age it from
      e.released_ns = now_ns_;
      e.release_seq = ++release_counter_;
    }
    // Candidates are leaves (a block leaves them when it gains a child), so a block with
    // children is none before or after: most released blocks, all but a run's last.
    if (tree_.IsLeaf(block)) UpdateCandidate(block);
  }
  // Only a pinned block (or one just unpinned) has a charge to change.
  if (e.pins != 0 || e.pin_charged != 0) UpdatePinCharge(block);
}

void PrefixCache::Lock(BlockId block) {
  if (entry(block).lock++ == 0) UpdateEvictable(block);
}

void PrefixCache::LockHit(BlockId block) {
  Lock(block);  // first: the policy hears of hits on blocks that are not candidates
  ++entry(block).hits;
  ++counters_.hits;
  if (hears_accesses_) PolicyOf(block).OnHit(Key(block), Facts(block), now_ns_);
}

void PrefixCache::Unlock(BlockId block) {
  KVPOOL_CHECK_MSG(entry(block).lock > 0, "unlock of an unlocked prefix-cache block");
  if (--entry(block).lock == 0) UpdateEvictable(block);
}

void PrefixCache::ReleasePath(CachePath* path, std::span<const BlockId> table, size_t keep,
                              const TraceContext& ctx, std::source_location site) {
  KVPOOL_DCHECK(table.size() >= path->full.size());
  // One loop, the pool's Release and the block's re-evaluation inlined: a finished prompt
  // releases every block it published here.
  for (size_t k = path->full.size(); k > keep;) {
    --k;
    const BlockId cached = path->full[k];
    const BlockId block = table[k];
    KVPOOL_CHECK_OK(pool_->Release(block, ctx, site));
    KVPOOL_CHECK_MSG(entry(cached).lock > 0, "unlock of an unlocked prefix-cache block");
    --entry(cached).lock;
    if (cached == block) {
      UpdateEvictable(block);  // its lock and its references both changed
      continue;
    }
    OnBlockRefsChanged(block);  // the sequence's own block, if the tree holds it, is another
    if (entry(cached).lock == 0) UpdateEvictable(cached);
  }
  if (path->full.size() > keep) path->full.resize(keep);
}

CachePath PrefixCache::Adopt(const PrefixMatch& match) {
  CachePath path{.full = match.full, .partial = match.partial};
  for (BlockId block : path.full) LockHit(block);
  if (path.partial != kInvalidBlock) LockHit(path.partial);
  return path;
}

CachePath PrefixCache::Clone(const CachePath& path) {
  for (BlockId block : path.full) Lock(block);
  if (path.partial != kInvalidBlock) Lock(path.partial);
  return path;
}

void PrefixCache::OnBlockRefsChanged(BlockId block) {
  if (tree_.Holds(block)) UpdateEvictable(block);
}

void PrefixCache::Truncate(CachePath* path, size_t keep_full) {
  if (path->partial != kInvalidBlock) {
    Unlock(path->partial);
    path->partial = kInvalidBlock;
  }
  while (path->full.size() > keep_full) {
    Unlock(path->full.back());
    path->full.pop_back();
  }
}

}  // namespace kvpool
