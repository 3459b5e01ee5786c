#pragma once

// One order for a forest given as a list: each entry after its parent. The event log's
// consumers grow a tree from Stored events and skip a block whose parent they have not seen
// (Dynamo's radix indexer does), so whatever restates a set of blocks (a snapshot of the tiers,
// the disk records found at start) names each block after its parent.

#include <cstddef>
#include <optional>
#include <vector>

namespace kvpool {

// Calls `visit(i)` once for each i in [0, n) with `wanted(i)`, in index order, except that an
// entry whose parent is not visited yet has that parent visited first (and its parent before it,
// and so on up). `parent(i)` is the index of i's parent among the n, or nullopt where it has
// none there; a parent must be wanted. An entry is marked as soon as it is found, so a cycle (two
// hashes that collide) still ends. O(n) plus the calls of `parent`.
template <typename Wanted, typename Parent, typename Visit>
void VisitParentsFirst(size_t n, Wanted&& wanted, Parent&& parent, Visit&& visit) {
  std::vector<bool> placed(n, false);
  std::vector<size_t> up;  // an entry, then its parents not placed yet
  for (size_t i = 0; i < n; ++i) {
    if (placed[i] || !wanted(i)) continue;
    up.assign(1, i);
    placed[i] = true;
    for (std::optional<size_t> p = parent(i); p && !placed[*p]; p = parent(*p)) {
      placed[*p] = true;
      up.push_back(*p);
    }
    for (auto b = up.rbegin(); b != up.rend(); ++b) visit(*b);
  }
}

}  // namespace kvpool
