#pragma once

// StampedLru: the least-recently-used order of a set of dense ids (a group's blocks or slots),
// each with the stamp (a counter reading) of its last use, as an intrusive doubly linked list
// over arrays indexed by id: insert (of the newest), erase and a touch (erase, insert) are O(1),
// where the ordered set of (stamp, id) it replaces was O(log n). Iterating visits (stamp, id)
// pairs, least recently used first, as that set did; so do begin() and the range-for.
//
// Stamps only grow: an insert must carry a stamp above every one held (a touch takes a fresh
// counter reading), which keeps the list in stamp order (CheckOrder).
//
// Thread-compatible.

#include <cstdint>
#include <iterator>
#include <utility>
#include <vector>

#include "kvpool/util/check.h"
#include "kvpool/util/strong_id.h"

namespace kvpool::internal {

template <typename Id>
class StampedLru final {
 public:
  using value_type = std::pair<uint64_t, Id>;

  // Ids [0, capacity); empties the list.
  void Reset(int32_t capacity) {
    links_.assign(static_cast<size_t>(capacity), Link{});
    head_ = tail_ = kNone;
    size_ = 0;
  }

  // REQUIRES: the id is not held, and the stamp is above every one held.
  void insert(const value_type& v) {
    const int32_t i = v.second.value();
    Link& l = links_[static_cast<size_t>(i)];
    KVPOOL_CHECK(!l.held && (tail_ == kNone || links_[static_cast<size_t>(tail_)].stamp < v.first));
    l = {.prev = tail_, .next = kNone, .stamp = v.first, .held = true};
    (tail_ == kNone ? head_ : links_[static_cast<size_t>(tail_)].next) = i;
    tail_ = i;
    ++size_;
  }
  // REQUIRES: the id is held with this stamp.
  void erase(const value_type& v) {
    const int32_t i = v.second.value();
    Link& l = links_[static_cast<size_t>(i)];
    KVPOOL_CHECK(l.held && l.stamp == v.first);
    (l.prev == kNone ? head_ : links_[static_cast<size_t>(l.prev)].next) = l.next;
    (l.next == kNone ? tail_ : links_[static_cast<size_t>(l.next)].prev) = l.prev;
    l = Link{};
    --size_;
  }

  size_t size() const { return static_cast<size_t>(size_); }
  bool empty() const { return size_ == 0; }

  class const_iterator {
   public:
    using iterator_category = std::forward_iterator_tag;
    using value_type = StampedLru::value_type;
    using difference_type = std::ptrdiff_t;
    using pointer = void;
    using reference = value_type;

    value_type operator*() const { return {lru_->links_[static_cast<size_t>(i_)].stamp, Id(i_)}; }
    const_iterator& operator++() {
      i_ = lru_->links_[static_cast<size_t>(i_)].next;
      return *this;
    }
    bool operator==(const const_iterator& o) const { return i_ == o.i_; }

   private:
    friend class StampedLru;
    const_iterator(const StampedLru* lru, int32_t i) : lru_(lru), i_(i) {}
    const StampedLru* lru_;
    int32_t i_;
  };
  const_iterator begin() const { return {this, head_}; }
  const_iterator end() const { return {this, kNone}; }

  // Whether the links agree with each other and with size(), and stamps grow along the list.
  bool CheckOrder() const {
    int64_t n = 0;
    int32_t prev = kNone;
    for (int32_t i = head_; i != kNone; i = links_[static_cast<size_t>(i)].next) {
      const Link& l = links_[static_cast<size_t>(i)];
      if (!l.held || l.prev != prev || ++n > size_ ||
          (prev != kNone && links_[static_cast<size_t>(prev)].stamp >= l.stamp)) {
        return false;
      }
      prev = i;
    }
    return n == size_ && prev == tail_;
  }

 private:
  static constexpr int32_t kNone = -1;
  struct Link {
    int32_t prev = kNone;
    int32_t next = kNone;
    uint64_t stamp = 0;
    bool held = false;
  };
  std::vector<Link> links_;
  int32_t head_ = kNone;  // least recently used
  int32_t tail_ = kNone;  // most recently used
  int64_t size_ = 0;
};

}  // namespace kvpool::internal
