// cuda_decode_bench: PagedAttentionDecode on the CUDA backend against the device's memory
// bandwidth. Decode reads every K/V byte of the batch once, so KV bytes per second over peak
// DRAM bandwidth is the figure of merit.
//
// The pool is Llama-3-8B-like (bf16, 32 query heads, 8 KV heads, head_dim 128, block_size 16, 32
// layers; one layer is decoded) with each sequence's blocks scattered over the arena. The backend
// is loaded by kernels::LoadBackendLibrary, as the daemon loads it; this binary links nothing from
// CUDA and reads the peak bandwidth from the driver (itself dlopen'ed) or, failing that, from a
// table.
//
//   cuda_decode_bench [--smoke] [--batch N] [--backend PATH]
//
// Exits 0 with a note when there is no device (so CI may run it anywhere), 1 on failure.

#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "fmt/format.h"
#include "kernels/backend.h"
#include "kernels/device.h"
#include "kvpool/util/mutex_mode.h"
#include "kvpool/util/status_macros.h"

// <cuda.h> types only: the driver is opened at run time, never linked.
#include <cuda.h>
#include <cudaTypedefs.h>

#ifndef KVPOOL_CUDA_BACKEND_PATH
#error "KVPOOL_CUDA_BACKEND_PATH must name libkvpool_cuda.so"
#endif

namespace kvpool::kernels {
namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  bool smoke = false;  // one short context, few iterations: proves the binary still runs
  int32_t batch = 8;
  std::string backend = KVPOOL_CUDA_BACKEND_PATH;
};

// Peak DRAM bandwidth in bytes/s: 2 (double data rate) x memory clock x bus width, from the
// driver; 0 when the driver does not say.
double PeakFromDriver(int ordinal) {
  void* driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (driver == nullptr) return 0;
  auto init = reinterpret_cast<PFN_cuInit_v2000>(dlsym(driver, "cuInit"));
  auto get = reinterpret_cast<PFN_cuDeviceGet_v2000>(dlsym(driver, "cuDeviceGet"));
  auto attribute =
      reinterpret_cast<PFN_cuDeviceGetAttribute_v2000>(dlsym(driver, "cuDeviceGetAttribute"));
  CUdevice device = 0;
  int clock_khz = 0;
  int bus_bits = 0;
  if (init == nullptr || get == nullptr || attribute == nullptr || init(0) != CUDA_SUCCESS ||
      get(&device, ordinal) != CUDA_SUCCESS ||
      attribute(&clock_khz, CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE, device) != CUDA_SUCCESS ||
      attribute(&bus_bits, CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH, device) != CUDA_SUCCESS) {
    return 0;
  }
  return 2.0 * clock_khz * 1e3 * bus_bits / 8.0;
}

// Datasheet figures (SXM parts unless named) for when the driver reports no clock.
double PeakFromName(const std::string& name) {
  struct Entry {
    const char* part;
    double bytes_per_second;
  };
  static constexpr Entry kTable[] = {
      {"H200", 4.8e12},  {"H100 PCIe", 2.0e12}, {"H100 NVL", 3.9e12},
      {"H100", 3.35e12}, {"A100", 2.0e12},      {"L40S", 0.864e12},
  };
  for (const Entry& e : kTable) {
    if (name.find(e.part) != std::string::npos) return e.bytes_per_second;
  }
  return 0;
}

template <typename T>
absl::StatusOr<std::unique_ptr<DeviceBuffer>> Upload(Device& device, const std::vector<T>& v) {
  const auto bytes = static_cast<int64_t>(v.size() * sizeof(T));
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<DeviceBuffer> buffer, device.AllocateBuffer(bytes));
  KVPOOL_ASSIGN_OR_RETURN(
      Fence fence, device.CopyToDevice(StreamId::kTransfer, buffer->data(), v.data(), bytes));
  KVPOOL_RETURN_IF_ERROR(device.Synchronize(fence));
  return buffer;
}

absl::Status Run(Device& device, const Options& options) {
  const std::vector<int32_t> contexts =
      options.smoke ? std::vector<int32_t>{1024} : std::vector<int32_t>{1024, 4096, 16384};
  const int32_t batch = options.batch;
  const int32_t num_q_heads = 32;
  const int32_t max_context = *std::max_element(contexts.begin(), contexts.end());
  PoolLayout layout{.block_size = 16,
                    .num_layers = 32,
                    .num_kv_heads = 8,
                    .head_dim = 128,
                    .dtype = DType::kBF16};
  layout.num_blocks = batch * (max_context / layout.block_size);
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<Arena> arena, device.CreateArena(layout.arena_bytes()));
  const KvPoolView pool{arena->base(), layout};

  std::vector<int32_t> ids(static_cast<size_t>(layout.num_blocks));
  std::iota(ids.begin(), ids.end(), 0);
  KVPOOL_ASSIGN_OR_RETURN(auto all_ids, Upload(device, ids));
  KVPOOL_ASSIGN_OR_RETURN(
      Fence zeroed, device.FillBlocks(StreamId::kTransfer, pool,
                                      {.num_blocks = layout.num_blocks,
                                       .blocks = static_cast<const int32_t*>(all_ids->data())}));
  KVPOOL_RETURN_IF_ERROR(device.Synchronize(zeroed));

  std::mt19937 rng(42);
  std::vector<float> q(static_cast<size_t>(batch) * num_q_heads * layout.head_dim);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (float& x : q) x = dist(rng);
  KVPOOL_ASSIGN_OR_RETURN(auto q_buffer, Upload(device, q));
  KVPOOL_ASSIGN_OR_RETURN(auto out_buffer,
                          device.AllocateBuffer(static_cast<int64_t>(q.size() * sizeof(float))));

  const std::string name = device.name();
  double peak = PeakFromDriver(0);
  const char* peak_source = "driver";
  if (peak <= 0) {
    peak = PeakFromName(name);
    peak_source = "datasheet";
  }
  fmt::print("device: {}  peak DRAM bandwidth: {}\n", name,
             peak > 0 ? fmt::format("{:.2f} TB/s ({})", peak / 1e12, peak_source) : "unknown");
  fmt::print(
      "pool: bf16, {} q heads / {} kv heads, head_dim {}, block_size {}, {} layers, "
      "{} blocks ({:.1f} GiB); batch {}\n",
      num_q_heads, layout.num_kv_heads, layout.head_dim, layout.block_size, layout.num_layers,
      layout.num_blocks, layout.arena_bytes() / 1073741824.0, batch);
  fmt::print("{:>8} {:>8} {:>12} {:>12} {:>10} {:>10}\n", "context", "iters", "us/decode", "KV MiB",
             "GB/s", "of peak");

  for (int32_t context : contexts) {
    // Each sequence's blocks scattered over the arena, as after hours of allocation churn.
    const int32_t stride = context / layout.block_size;
    std::shuffle(ids.begin(), ids.end(), rng);
    std::vector<int32_t> tables(ids.begin(), ids.begin() + static_cast<int64_t>(batch) * stride);
    const std::vector<int32_t> lens(static_cast<size_t>(batch), context);
    KVPOOL_ASSIGN_OR_RETURN(auto table_buffer, Upload(device, tables));
    KVPOOL_ASSIGN_OR_RETURN(auto len_buffer, Upload(device, lens));
    const int64_t workspace_bytes =
        device.DecodeWorkspaceBytes(layout, batch, num_q_heads, context);
    std::unique_ptr<DeviceBuffer> workspace;
    if (workspace_bytes > 0) {
      KVPOOL_ASSIGN_OR_RETURN(workspace, device.AllocateBuffer(workspace_bytes));
    }
    const DecodeArgs args{.layer = layout.num_layers / 2,
                          .num_seqs = batch,
                          .num_q_heads = num_q_heads,
                          .scale = 1.0f / std::sqrt(static_cast<float>(layout.head_dim)),
                          .q = static_cast<const float*>(q_buffer->data()),
                          .out = static_cast<float*>(out_buffer->data()),
                          .block_tables = static_cast<const int32_t*>(table_buffer->data()),
                          .table_stride = stride,
                          .seq_lens = static_cast<const int32_t*>(len_buffer->data()),
                          .max_seq_len = context,
                          .workspace = workspace ? workspace->data() : nullptr,
                          .workspace_bytes = workspace_bytes};

    // Times `iters` back-to-back decodes from first enqueue to the last one's fence.
    auto time = [&](int iters) -> absl::StatusOr<double> {
      const Clock::time_point start = Clock::now();
      Fence last;
      for (int i = 0; i < iters; ++i) {
        KVPOOL_ASSIGN_OR_RETURN(last, device.PagedAttentionDecode(StreamId::kCompute, pool, args));
      }
      KVPOOL_RETURN_IF_ERROR(device.Synchronize(last));
      return std::chrono::duration<double>(Clock::now() - start).count();
    };
    KVPOOL_ASSIGN_OR_RETURN(const double warmup, time(options.smoke ? 2 : 20));
    const double per_call = warmup / (options.smoke ? 2 : 20);
    // About half a second of work per context (bounded both ways).
    const int iters = options.smoke ? 5 : std::clamp(static_cast<int>(0.5 / per_call), 50, 5000);
    KVPOOL_ASSIGN_OR_RETURN(const double seconds, time(iters));
    const double kv_bytes = static_cast<double>(batch) * context *
                            (layout.row_bytes(0, KvSide::kK) + layout.row_bytes(0, KvSide::kV));
    const double bytes_per_second = kv_bytes * iters / seconds;
    fmt::print("{:>8} {:>8} {:>12.2f} {:>12.1f} {:>10.1f} {:>10}\n", context, iters,
               seconds / iters * 1e6, kv_bytes / 1048576.0, bytes_per_second / 1e9,
               peak > 0 ? fmt::format("{:.1f}%", 100.0 * bytes_per_second / peak) : "-");
  }

  // A NaN-free result on zeroed KV is the mean of zero vectors: exactly 0.
  std::vector<float> out(q.size(), 1.0f);
  KVPOOL_ASSIGN_OR_RETURN(Fence copied,
                          device.CopyToHost(StreamId::kCompute, out.data(), out_buffer->data(),
                                            static_cast<int64_t>(out.size() * sizeof(float))));
  KVPOOL_RETURN_IF_ERROR(device.Synchronize(copied));
  for (float x : out) {
    if (x != 0.0f) return absl::InternalError(fmt::format("decode output {} on zero KV", x));
  }
  return device.status();
}

int Main(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--smoke") {
      options.smoke = true;
    } else if (arg == "--batch" && i + 1 < argc) {
      options.batch = std::atoi(argv[++i]);
    } else if (arg == "--backend" && i + 1 < argc) {
      options.backend = argv[++i];
    } else {
      std::fprintf(stderr, "usage: %s [--smoke] [--batch N] [--backend PATH]\n", argv[0]);
      return 1;
    }
  }
  if (options.batch <= 0) {
    std::fprintf(stderr, "--batch must be > 0\n");
    return 1;
  }
  absl::StatusOr<const BackendReg*> backend = LoadBackendLibrary(options.backend);
  if (!backend.ok()) {
    std::fprintf(stderr, "%s\n", backend.status().ToString().c_str());
    return 1;
  }
  if ((*backend)->device_count() <= 0) {
    std::printf("no CUDA device (no driver or no GPU): nothing to measure\n");
    return 0;
  }
  const DeviceParams params{.ordinal = 0};
  BackendError error;
  std::unique_ptr<Device> device((*backend)->create_device(&params, &error));
  if (device == nullptr) {
    std::fprintf(stderr, "CUDA device 0: %s\n", error.message);
    return 1;
  }
  const absl::Status status = Run(*device, options);
  if (!status.ok()) {
    std::fprintf(stderr, "cuda_decode_bench: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace kvpool::kernels

int main(int argc, char** argv) {
  kvpool::SetProgramDeadlockDetection();
  return kvpool::kernels::Main(argc, argv);
}
