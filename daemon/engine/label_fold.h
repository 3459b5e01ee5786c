#pragma once

// LabelFold: bounds the distinct values of a metric label (a tenant name) to `max`. The first
// `max` distinct values keep their own label, in the order they were first seen, and keep it for
// the fold's lifetime (a series never changes its label); every later one folds into kOther.
// A pure policy object: no clock, no lock (the owner's guards it). Memory: at most `max` names.

#include <cstddef>
#include <string>
#include <string_view>

#include "absl/container/node_hash_set.h"
#include "absl/strings/string_view.h"

namespace kvpool::daemon {

class LabelFold final {
 public:
  static constexpr std::string_view kOther = "other";

  // `max` 0 folds every value into kOther.
  explicit LabelFold(size_t max) : max_(max) {}

  // The label `value` is counted under: itself when it already has one or a slot is left (then
  // it takes the slot), kOther otherwise. A value spelled "other" shares kOther's series.
  std::string_view Label(std::string_view value) {
    if (value == kOther) return kOther;
    if (auto it = labels_.find(absl::string_view(value.data(), value.size()));
        it != labels_.end()) {
      return *it;
    }
    if (labels_.size() >= max_) return kOther;
    return *labels_.emplace(value).first;
  }

  size_t size() const { return labels_.size(); }  // values holding a label of their own
  size_t max() const { return max_; }

 private:
  size_t max_;
  absl::node_hash_set<std::string> labels_;  // nodes: the views Label returns stay valid
};

}  // namespace kvpool::daemon
