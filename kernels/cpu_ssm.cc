// CPU state-space scan (kernel_args.h: SsmScanArgs). A task is one (sequence, head): its state
// [d_state][head_dim] stays in cache while the sequence's tokens run through it in order. Per
// token the state row n is updated and read in one pass over head_dim (a and dt * b[n] * x are
// per-row scalars times a vector, which the compiler vectorizes).

#include <cmath>
#include <cstdint>
#include <vector>

#include "fmt/format.h"
#include "kernels/cpu_kernels.h"

namespace kvpool::kernels::cpu {
namespace {

absl::Status Bad(std::string_view why) {
  return absl::InvalidArgumentError(fmt::format("SsmScan: {}", why));
}

absl::Status Validate(const SsmScanArgs& a) {
  if (a.num_seqs < 0) return Bad("negative sequence count");
  if (a.num_heads <= 0 || a.head_dim <= 0 || a.d_state <= 0 || a.num_groups <= 0 ||
      a.num_heads % a.num_groups != 0) {
    return Bad(fmt::format("{} heads of {} values, state {}, {} groups (must divide the heads)",
                           a.num_heads, a.head_dim, a.d_state, a.num_groups));
  }
  if (a.num_seqs == 0) return absl::OkStatus();
  if (a.starts == nullptr || a.states == nullptr) return Bad("null starts or states");
  if (a.starts[0] < 0) return Bad("starts[0] is negative");
  for (int32_t s = 0; s < a.num_seqs; ++s) {
    if (a.starts[s + 1] < a.starts[s]) {
      return Bad(fmt::format("starts decrease at sequence {}", s));
    }
    if (a.states[s] == nullptr) return Bad(fmt::format("sequence {} has no state", s));
  }
  if (a.starts[a.num_seqs] > a.starts[0] &&
      (a.x == nullptr || a.dt == nullptr || a.a_log_neg == nullptr || a.b == nullptr ||
       a.c == nullptr || a.y == nullptr)) {
    return Bad("null x, dt, a_log_neg, b, c or y");
  }
  return absl::OkStatus();
}

// Sequence s, head h: every token in order.
void ScanHead(const SsmScanArgs& a, int32_t s, int32_t h) {
  const int32_t dim = a.head_dim, ds = a.d_state;
  const int32_t g = h / (a.num_heads / a.num_groups);
  float* state = a.states[s] + static_cast<int64_t>(h) * ds * dim;
  const float skip = a.d != nullptr ? a.d[h] : 0.0f;
  for (int64_t t = a.starts[s]; t < a.starts[s + 1]; ++t) {
    const float dt = a.dt[t * a.num_heads + h];
    const float decay = std::exp(dt * a.a_log_neg[h]);
    const float* x = a.x + (t * a.num_heads + h) * dim;
    const float* b = a.b + (t * a.num_groups + g) * ds;
    const float* c = a.c + (t * a.num_groups + g) * ds;
    float* y = a.y + (t * a.num_heads + h) * dim;
    for (int32_t p = 0; p < dim; ++p) y[p] = skip * x[p];
    for (int32_t n = 0; n < ds; ++n) {
      float* row = state + static_cast<int64_t>(n) * dim;
      const float in = dt * b[n];
      const float out = c[n];
      for (int32_t p = 0; p < dim; ++p) {
        row[p] = decay * row[p] + in * x[p];
        y[p] += out * row[p];
      }
    }
  }
}

}  // namespace

absl::Status SsmScan(const SsmScanArgs& a, ThreadPool* threads) {
  if (absl::Status s = Validate(a); !s.ok()) return s;
  const int64_t tasks = static_cast<int64_t>(a.num_seqs) * a.num_heads;
  auto run = [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      ScanHead(a, static_cast<int32_t>(i / a.num_heads), static_cast<int32_t>(i % a.num_heads));
    }
  };
  if (threads == nullptr) {
    run(0, tasks);
  } else {
    threads->ParallelFor(tasks, 1, run);
  }
  return absl::OkStatus();
}

void SsmScanReference(const SsmScanArgs& a) {
  const int32_t dim = a.head_dim, ds = a.d_state;
  for (int32_t s = 0; s < a.num_seqs; ++s) {
    for (int32_t h = 0; h < a.num_heads; ++h) {
      const int32_t g = h / (a.num_heads / a.num_groups);
      float* state = a.states[s] + static_cast<int64_t>(h) * ds * dim;
      std::vector<double> st(state, state + static_cast<int64_t>(ds) * dim);
      for (int64_t t = a.starts[s]; t < a.starts[s + 1]; ++t) {
        const double dt = a.dt[t * a.num_heads + h];
        const double decay = std::exp(dt * a.a_log_neg[h]);
        const float* x = a.x + (t * a.num_heads + h) * dim;
        const float* b = a.b + (t * a.num_groups + g) * ds;
        const float* c = a.c + (t * a.num_groups + g) * ds;
        for (int32_t p = 0; p < dim; ++p) {
          double y = (a.d != nullptr ? a.d[h] : 0.0) * x[p];
          for (int32_t n = 0; n < ds; ++n) {
            double& v = st[static_cast<size_t>(n) * dim + p];
            v = decay * v + dt * b[n] * x[p];
            y += c[n] * v;
          }
          a.y[(t * a.num_heads + h) * dim + p] = static_cast<float>(y);
        }
      }
      for (size_t i = 0; i < st.size(); ++i) state[i] = static_cast<float>(st[i]);
    }
  }
}

}  // namespace kvpool::kernels::cpu
