#include "daemon/engine/compute_call.h"

#include "fmt/format.h"
#include "kvpool/util/fmt.h"

namespace kvpool::daemon {

absl::Status CheckSamplingOf(const ComputeRequest& request, int32_t vocab) {
  const size_t n = request.sampling.size();
  const size_t items = request.prefill() ? 1 : request.decode.size();
  if (n > 1 && n != items) {
    return absl::InvalidArgumentError(
        request.prefill()
            ? fmt::format("a prefill takes one set of sampling parameters, not {}", n)
            : fmt::format("{} sets of sampling parameters for {} sequences: give none, one "
                          "for all, or one per sequence",
                          n, items));
  }
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
