#include "daemon/engine/compute_call.h"

#include "fmt/format.h"
#include "kvpool/util/fmt.h"
#include "kvpool/util/status_macros.h"

namespace kvpool::daemon {

absl::Status CheckSamplingCount(size_t sets, size_t items, bool prefill) {
  if (sets > 1 && (prefill || sets != items)) {
    return absl::InvalidArgumentError(
        prefill ? fmt::format("a prefill takes one set of sampling parameters, not {}", sets)
                : fmt::format("{} sets of sampling parameters for {} sequences: give none, one "
                              "for all, or one per sequence",
                              sets, items));
  }
  return absl::OkStatus();
}

absl::Status CheckSamplingOf(const ComputeRequest& request, int32_t vocab) {
  const size_t n = request.sampling.size();
  KVPOOL_RETURN_IF_ERROR(
      CheckSamplingCount(n, request.prefill() ? 1 : request.decode.size(), request.prefill()));
  for (size_t i = 0; i < n; ++i) {
    if (absl::Status bad = model::CheckSampling(request.sampling[i], vocab); !bad.ok()) {
      return n == 1 ? bad
                    : absl::InvalidArgumentError(fmt::format("sequence {} (index {}): {}",
                                                             request.decode[i].sequence.value(), i,
                                                             bad.message()));
    }
  }
  return absl::OkStatus();
}

}  // namespace kvpool::daemon
