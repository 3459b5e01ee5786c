// WriteKv on the CPU: f32 rows converted to each side's dtype; an 8-bit side quantized against
// its blocks' per-head scales (the rules are in cpu_kernels.h). The row conversions are
// vectorized per instruction set (internal/convert_rows.h).

#include <algorithm>
#include <cmath>

#include "fmt/format.h"
#include "kernels/cpu_isa.h"
#include "kernels/cpu_kernels.h"
#include "kernels/internal/convert_rows.h"
#include "kernels/validate.h"

namespace kvpool::kernels::cpu {
namespace {

const internal::ConvertFns& Convert() {
  static const internal::ConvertFns portable = internal::ConvertPortable();
  static const internal::ConvertFns avx2 = internal::ConvertAvx2();
  return KernelIsa() >= Isa::kAvx2 ? avx2 : portable;
}

// The tokens [begin, end) of a call whose slots (padding aside) are all in `block`.
struct Run {
  int32_t begin, end;
  int64_t block;
  bool restarts;  // the run writes slot 0: the block starts afresh
};

// One side (K or V) of a run: f32 rows `src` into the side's chunk of the run's block.
struct SideOfRun {
  DType dtype;
  char* chunk;        // the block's chunk of this side
  float* scales;      // its [num_kv_heads] scales (8-bit only)
  int64_t row_bytes;  // one token's [num_kv_heads][head_dim] in dtype
  const float* src;   // [num_tokens][num_kv_heads][head_dim]
};

// The scale a head gets from its old one and what the run needs (cpu_kernels.h: WriteKv).
float NewScale(float old, float need, bool restarts) {
  if (restarts || std::isnan(need)) return need;
  if (std::isnan(old)) return old;  // stays NaN until the block starts afresh
  return std::max(old, need);
}

void WriteSide(const LayerLayout& l, const Run& run, const int64_t* slots, const SideOfRun& s,
               const internal::ConvertFns& fns) {
  const int64_t row_values = static_cast<int64_t>(l.num_kv_heads) * l.head_dim;
  auto slot_of = [&](int32_t i) { return slots[i] % l.block_size; };
  if (!DTypeHasScales(s.dtype)) {
    for (int32_t i = run.begin; i < run.end; ++i) {
      if (slots[i] < 0) continue;
      fns.narrow[static_cast<int>(s.dtype)](s.src + i * row_values, static_cast<int>(row_values),
                                            1.0f, s.chunk + slot_of(i) * s.row_bytes);
    }
    return;
  }
  const int64_t head_bytes = l.head_dim;  // one byte a code
  for (int32_t h = 0; h < l.num_kv_heads; ++h) {
    float absmax = 0;
    for (int32_t i = run.begin; i < run.end; ++i) {
      if (slots[i] < 0) continue;
      const float m = fns.absmax(s.src + i * row_values + h * l.head_dim, l.head_dim);
      absmax = std::isnan(m) ? m : std::max(absmax, m);
      if (std::isnan(absmax)) break;
    }
    const float old = s.scales[h];
    const float scale = NewScale(old, ScaleFor(s.dtype, absmax), run.restarts);
    if (!run.restarts && std::isfinite(old) && std::isfinite(scale) && scale != old) {
      // Every slot's codes re-encoded under the grown scale (the run's own are rewritten below).
      for (int32_t slot = 0; slot < l.block_size; ++slot) {
        fns.rescale[static_cast<int>(s.dtype)](s.chunk + slot * s.row_bytes + h * head_bytes,
                                               l.head_dim, old / scale);
      }
    }
    s.scales[h] = scale;
    const float inv = scale > 0 && std::isfinite(scale) ? 1.0f / scale : 0.0f;
    for (int32_t i = run.begin; i < run.end; ++i) {
      if (slots[i] < 0) continue;
      fns.narrow[static_cast<int>(s.dtype)](s.src + i * row_values + h * l.head_dim, l.head_dim,
                                            inv,
                                            s.chunk + slot_of(i) * s.row_bytes + h * head_bytes);
    }
  }
}

}  // namespace

absl::Status WriteKv(const KvPoolView& pool, const WriteKvArgs& a) {
  if (absl::Status s = ValidateWriteKv(pool, a); !s.ok()) return s;
  const LayerLayout layout = pool.layout.Layer(a.layer);  // a window layer's: its region's
  const int64_t capacity = static_cast<int64_t>(layout.num_blocks) * layout.block_size;
  for (int32_t i = 0; i < a.num_tokens; ++i) {  // check every slot before writing any
    if (a.slots[i] >= capacity) {
      return absl::InvalidArgumentError(fmt::format(
          "WriteKv: block {} outside [0, {})", a.slots[i] / layout.block_size, layout.num_blocks));
    }
  }
  const KvLayerView view = pool.Layer(a.layer);
  const LayerLayout& l = view.l;
  const internal::ConvertFns& fns = Convert();
  int32_t i = 0;
  while (i < a.num_tokens) {
    if (a.slots[i] < 0) {  // padding
      ++i;
      continue;
    }
    Run run{i, i, a.slots[i] / l.block_size, false};
    while (run.end < a.num_tokens &&
           (a.slots[run.end] < 0 || a.slots[run.end] / l.block_size == run.block)) {
      run.restarts |= a.slots[run.end] >= 0 && a.slots[run.end] % l.block_size == 0;
      ++run.end;
    }
    WriteSide(l, run, a.slots,
              {l.k_dtype, view.k(run.block), view.k_scales(run.block), l.k_row_bytes, a.k}, fns);
    WriteSide(l, run, a.slots,
              {l.v_dtype, view.v(run.block), view.v_scales(run.block), l.v_row_bytes, a.v}, fns);
    i = run.end;
  }
  return absl::OkStatus();
}

}  // namespace kvpool::kernels::cpu
