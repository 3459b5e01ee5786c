#pragma once

// A consumer's view of a pool's cache built from its event log alone (kvpool/kv_events.h), as a
// router or a remote index keeps one: the (medium, namespace, group, hash) of every block it was
// told is stored. Follow() applies the events appended since its last call and fails on one a
// consumer could not apply: a block stored twice, a removal of a block it does not hold, a
// device component (group > 0) stored before or outliving its main block (a tier's may: each
// tier store tells on its own, docs/events.md), or group fields missing or present against the
// pool's kind. AllBlocksCleared forgets every medium. Matches() compares the view with a snapshot
// (SnapshotEvents), which is what a consumer that fell behind would rebuild from: the two must
// agree after every call, and the snapshot must name each block after its parent.

#include <cstdint>
#include <set>
#include <span>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "kvpool/kv_events.h"

namespace kvpool {

class EventMirror {
 public:
  // `grouped`: the pool has more than one layer group, so every Stored and Removed event must
  // carry KvEvent::group.
  explicit EventMirror(bool grouped) : grouped_(grouped) {}

  ::testing::AssertionResult Follow(const EventLog& log) {
    std::vector<KvEvent> events;
    if (!log.ReadFrom(next_, SIZE_MAX, &events)) {
      return ::testing::AssertionFailure() << "events from " << next_ << " were dropped";
    }
    for (const KvEvent& e : events) {
      if (e.seq != next_)
        return ::testing::AssertionFailure() << "seq " << e.seq << " != " << next_;
      ++next_;
      if (::testing::AssertionResult r = Apply(e, &blocks_, stored_); !r) {
        return r << " (event " << e.seq << ")";
      }
    }
    return ::testing::AssertionSuccess();
  }

  ::testing::AssertionResult Matches(std::span<const KvEvent> snapshot) const {
    Blocks rebuilt;
    for (const KvEvent& e : snapshot) {
      // A block after its parent, where the snapshot names that too (in the same medium and
      // group): a router that grows a tree from Stored events drops a block whose parent it
      // does not know yet.
      if (e.parent_hash) {
        const Key parent{e.medium, e.ns.value(), e.group ? e.group->index : 0, e.parent_hash->hi,
                         e.parent_hash->lo};
        if (blocks_.contains(parent) && !rebuilt.contains(parent)) {
          return ::testing::AssertionFailure() << "a snapshot's block before its parent";
        }
      }
      if (::testing::AssertionResult r = Apply(e, &rebuilt, nullptr); !r) return r << " (snapshot)";
    }
    if (rebuilt != blocks_) {
      return ::testing::AssertionFailure()
             << "the events' view holds " << blocks_.size() << " blocks (" << Count(blocks_, 1)
             << " in group 1, " << Count(blocks_, 2) << " in group 2 on the device), the snapshot "
             << rebuilt.size() << " (" << Count(rebuilt, 1) << ", " << Count(rebuilt, 2) << ")";
    }
    return ::testing::AssertionSuccess();
  }

  // Blocks held in `group`, on the device or in `medium`.
  size_t held(int32_t group, KvMedium medium = KvMedium::kDevice) const {
    return Count(blocks_, group, medium);
  }
  // How many blocks of each group were ever stored through Follow().
  uint64_t stored(int32_t group) const { return group < 3 ? stored_[group] : 0; }

 private:
  using Key = std::tuple<KvMedium, uint64_t, int32_t, uint64_t,
                         uint64_t>;  // medium, ns, group, hash hi, lo
  using Blocks = std::set<Key>;

  static size_t Count(const Blocks& blocks, int32_t group, KvMedium medium = KvMedium::kDevice) {
    size_t n = 0;
    for (const Key& k : blocks) n += std::get<0>(k) == medium && std::get<2>(k) == group ? 1 : 0;
    return n;
  }

  // Applies `e` to `blocks`, counting stored blocks by group into `stored` (when not null).
  ::testing::AssertionResult Apply(const KvEvent& e, Blocks* blocks, uint64_t* stored) const {
    if (e.type == KvEventType::kAllBlocksCleared) {
      if (e.group) return ::testing::AssertionFailure() << "AllBlocksCleared with a group";
      blocks->clear();
      return ::testing::AssertionSuccess();
    }
    if (e.group.has_value() != grouped_) {
      return ::testing::AssertionFailure() << (grouped_ ? "no group on an event of a hybrid pool"
                                                        : "a group on an event of a plain pool");
    }
    const int32_t group = e.group ? e.group->index : 0;
    if (group < 0 || group > 2 ||
        (group == 0) != (!e.group || e.group->kind == KvGroupKind::kFullAttention)) {
      return ::testing::AssertionFailure() << "group " << group << " of the wrong kind";
    }
    const bool device = e.medium == KvMedium::kDevice;
    for (const BlockHash& h : e.block_hashes) {
      const Key key{e.medium, e.ns.value(), group, h.hi, h.lo};
      const Key main{e.medium, e.ns.value(), 0, h.hi, h.lo};
      if (e.type == KvEventType::kBlockStored) {
        if (device && group > 0 && !blocks->contains(main)) {
          return ::testing::AssertionFailure() << "group " << group << " stored before its block";
        }
        if (!blocks->insert(key).second) {
          return ::testing::AssertionFailure() << "group " << group << " block stored twice";
        }
        if (stored != nullptr) ++stored[group];
      } else {
        if (blocks->erase(key) != 1) {
          return ::testing::AssertionFailure() << "group " << group << " block removed unheld";
        }
        if (device && group == 0) {
          for (int32_t g = 1; g <= 2; ++g) {
            if (blocks->contains({e.medium, e.ns.value(), g, h.hi, h.lo})) {
              return ::testing::AssertionFailure() << "block removed before its group " << g;
            }
          }
        }
      }
    }
    return ::testing::AssertionSuccess();
  }

  const bool grouped_;
  uint64_t next_ = 1;
  Blocks blocks_;
  uint64_t stored_[3] = {0, 0, 0};
};

}  // namespace kvpool
