#pragma once

// Shared by the engine's tests: a device whose enqueues can be made to fail, the engine options
// of a small pool of the tiny model's shape, and prompts.

#include <sys/mman.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <span>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "daemon/engine/engine.h"
#include "gtest/gtest.h"
#include "kernels/cpu_device.h"
#include "model/model.h"
#include "model/weights.h"

namespace kvpool::daemon::testing {

// A CpuDevice whose FillBlocks / CopyBlocks fail (enqueue nothing) while `fail` is set.
class FailingDevice final : public kernels::Device {
 public:
  std::atomic<bool> fail{false};
  std::atomic<bool> fail_copy_to_device{false};  // CopyToDevice fails too (tier promotions)
  std::atomic<bool> fail_stream_wait{false};     // StreamWait fails (a stream ordering error)

  std::string name() const override { return "failing-cpu"; }
  bool host_visible() const override { return true; }
  absl::StatusOr<std::unique_ptr<kernels::Arena>> CreateArena(int64_t bytes) override {
    return cpu_.CreateArena(bytes);
  }
  absl::StatusOr<std::unique_ptr<kernels::DeviceBuffer>> AllocateBuffer(int64_t bytes) override {
    return cpu_.AllocateBuffer(bytes);
  }
  absl::StatusOr<std::unique_ptr<kernels::DeviceBuffer>> AllocateHostBuffer(
      int64_t bytes) override {
    absl::StatusOr<std::unique_ptr<kernels::DeviceBuffer>> made = cpu_.AllocateHostBuffer(bytes);
    if (made.ok()) {
      absl::MutexLock lock(&mu_);
      host_buffers_.push_back({static_cast<const std::byte*>((*made)->data()), bytes});
    }
    return made;
  }
  absl::StatusOr<Fence> CopyToDevice(kernels::StreamId s, void* dst, const void* src,
                                     int64_t bytes) override {
    if (fail_copy_to_device) return absl::InternalError("injected: copy to device not queued");
    {
      absl::MutexLock lock(&mu_);
      copies_to_device_.push_back({static_cast<const std::byte*>(src), bytes});
    }
    return cpu_.CopyToDevice(s, dst, src, bytes);
  }
  // Host memory handed out by AllocateHostBuffer, and the sources of CopyToDevice, in order
  // (tier tests: where a promotion copies from). Freed buffers stay listed.
  struct Range {
    const std::byte* begin = nullptr;
    int64_t bytes = 0;
    bool Contains(const Range& r) const {
      return r.begin >= begin && r.begin + r.bytes <= begin + bytes;
    }
  };
  std::vector<Range> host_buffers() const {
    absl::MutexLock lock(&mu_);
    return host_buffers_;
  }
  std::vector<Range> copies_to_device() const {
    absl::MutexLock lock(&mu_);
    return copies_to_device_;
  }
  absl::StatusOr<Fence> CopyToHost(kernels::StreamId s, void* dst, const void* src,
                                   int64_t bytes) override {
    return cpu_.CopyToHost(s, dst, src, bytes);
  }
  absl::StatusOr<Fence> CopyBlocks(kernels::StreamId s, const kernels::KvPoolView& pool,
                                   const kernels::CopyBlocksArgs& args) override {
    if (fail) return absl::InternalError("injected: copy not queued");
    return cpu_.CopyBlocks(s, pool, args);
  }
  absl::StatusOr<Fence> FillBlocks(kernels::StreamId s, const kernels::KvPoolView& pool,
                                   const kernels::FillBlocksArgs& args) override {
    if (fail) return absl::InternalError("injected: fill not queued");
    return cpu_.FillBlocks(s, pool, args);
  }
  absl::StatusOr<Fence> WriteKv(kernels::StreamId s, const kernels::KvPoolView& pool,
                                const kernels::WriteKvArgs& args) override {
    return cpu_.WriteKv(s, pool, args);
  }
  absl::StatusOr<Fence> PagedAttentionDecode(kernels::StreamId s, const kernels::KvPoolView& pool,
                                             const kernels::DecodeArgs& args) override {
    return cpu_.PagedAttentionDecode(s, pool, args);
  }
  absl::StatusOr<Fence> PagedAttentionPrefill(kernels::StreamId s, const kernels::KvPoolView& pool,
                                              const kernels::PrefillArgs& args) override {
    return cpu_.PagedAttentionPrefill(s, pool, args);
  }
  int64_t PrefillWorkspaceBytes(const kernels::PoolLayout& layout) const override {
    return cpu_.PrefillWorkspaceBytes(layout);
  }
  absl::StatusOr<Fence> EnqueueHostTask(kernels::StreamId s, std::function<void()> task) override {
    return cpu_.EnqueueHostTask(s, std::move(task));
  }
  int64_t DecodeWorkspaceBytes(const kernels::PoolLayout& layout, int32_t num_seqs,
                               int32_t num_q_heads, int32_t max_seq_len) const override {
    return cpu_.DecodeWorkspaceBytes(layout, num_seqs, num_q_heads, max_seq_len);
  }
  absl::Status StreamWait(kernels::StreamId waiter, Fence fence) override {
    if (fail_stream_wait) return absl::InternalError("injected: stream wait not queued");
    return cpu_.StreamWait(waiter, fence);
  }
  absl::Status Synchronize(Fence fence) override { return cpu_.Synchronize(fence); }
  absl::Status SynchronizeAll() override { return cpu_.SynchronizeAll(); }
  absl::Status status() const override { return cpu_.status(); }
  Fence LastFence(kernels::StreamId s) const override { return cpu_.LastFence(s); }
  bool HasPassed(Fence fence) const override { return cpu_.HasPassed(fence); }

 private:
  kernels::CpuDevice cpu_{1};
  mutable absl::Mutex mu_;
  std::vector<Range> host_buffers_ ABSL_GUARDED_BY(mu_);
  std::vector<Range> copies_to_device_ ABSL_GUARDED_BY(mu_);
};

// A model (the tiny one, say) with a hook that runs inside each step, while the engine's lock is
// free.
class HookModel final : public model::StepModel {
 public:
  explicit HookModel(std::unique_ptr<model::Model> inner) : inner_(std::move(inner)) {}
  const model::ModelConfig& config() const override { return inner_->config(); }
  const kernels::PoolLayout& layout() const override { return inner_->layout(); }
  std::string where() const override { return inner_->where(); }
  int64_t weight_bytes() const override { return inner_->weight_bytes(); }
  std::function<void()> during_step;

 protected:
  absl::Status RunStep(const kernels::KvPoolView& pool, std::span<const model::StepItem> items,
                       const model::StepOptions& options,
                       std::vector<model::ItemResult>* results) override {
    if (during_step) during_step();
    return inner_->Step(pool, items, options, results);
  }

 private:
  std::unique_ptr<model::Model> inner_;
};

// The tiny model's KV shape: 16-token blocks of 64 KiB.
inline EngineOptions SmallPool(int32_t num_blocks, const Clock* clock = Clock::Real()) {
  EngineOptions o;
  o.pools = {{.name = "default",
              .layout = {.block_size = 16,
                         .num_layers = 4,
                         .num_kv_heads = 4,
                         .head_dim = 64,
                         .dtype = kernels::DType::kBF16,
                         .num_blocks = num_blocks}}};
  o.clock = clock;
  o.model_name = "tiny";
  o.gather_window_ns = 0;
  return o;
}

inline std::unique_ptr<model::Model> TinyModel(const kernels::PoolLayout& layout) {
  return std::move(*model::Model::Create(model::SyntheticWeights(*model::NamedConfig("tiny"), 1),
                                         layout, {.threads = 1}));
}

// A model small enough that a step costs microseconds (vocabulary kMicroVocab), for tests that run
// thousands of steps.
inline constexpr int32_t kMicroVocab = 61;
inline std::unique_ptr<model::Model> MicroModel(const kernels::PoolLayout& layout) {
  const model::ModelConfig config{.vocab_size = kMicroVocab,
                                  .hidden_size = 32,
                                  .intermediate_size = 48,
                                  .num_layers = 1,
                                  .num_heads = 2,
                                  .num_kv_heads = 1,
                                  .head_dim = 16};
  return std::move(
      *model::Model::Create(model::SyntheticWeights(config, 3), layout, {.threads = 1}));
}

inline std::vector<int32_t> Prompt(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> out(n);
  for (int32_t& t : out) t = static_cast<int32_t>(rng() % 8192);
  return out;
}

// OK for its first `ok_checks` checks, then CANCELLED: a caller who gives up while its call runs
// (the engine checks once before a call changes anything, again before it answers).
class GivesUpAfter final : public CallContext {
 public:
  explicit GivesUpAfter(int ok_checks) : left_(ok_checks) {}
  absl::Status Check() const override {
    return left_-- > 0 ? absl::OkStatus() : absl::CancelledError("gave up");
  }

 private:
  mutable std::atomic<int> left_;
};

// A client's read-write mapping of a session's arena (PoolGrant), with block helpers.
class MappedArena {
 public:
  // REQUIRES: `grant` has an arena (a KV-access session's). Fails the test when it cannot map.
  explicit MappedArena(const PoolGrant& grant)
      : bytes_(grant.layout.arena_bytes()), block_bytes_(grant.layout.block_bytes()) {
    void* p = mmap(nullptr, static_cast<size_t>(bytes_), PROT_READ | PROT_WRITE, MAP_SHARED,
                   grant.arena->fd.get(), 0);
    EXPECT_NE(p, MAP_FAILED);
    base_ = p == MAP_FAILED ? nullptr : static_cast<std::byte*>(p);
  }
  ~MappedArena() {
    if (base_ != nullptr) munmap(base_, static_cast<size_t>(bytes_));
  }
  MappedArena(const MappedArena&) = delete;
  MappedArena& operator=(const MappedArena&) = delete;

  int64_t block_bytes() const { return block_bytes_; }
  std::byte* base() const { return base_; }
  std::byte* Block(BlockId b) const { return base_ + b.value() * block_bytes_; }
  // Block i of `blocks` filled with seed + i (a client computing its KV).
  void Fill(std::span<const BlockId> blocks, uint8_t seed) const {
    for (size_t i = 0; i < blocks.size(); ++i) {
      std::memset(Block(blocks[i]), seed + static_cast<int>(i), static_cast<size_t>(block_bytes_));
    }
  }
  // Whether every byte of `b` is `value`.
  bool Holds(BlockId b, uint8_t value) const {
    const std::byte* p = Block(b);
    for (int64_t i = 0; i < block_bytes_; ++i) {
      if (p[i] != static_cast<std::byte>(value)) return false;
    }
    return true;
  }

 private:
  const int64_t bytes_;
  const int64_t block_bytes_;
  std::byte* base_ = nullptr;
};

// A session of `tenant` with KV access (as the zero-configuration default grants it).
inline SessionSpec Spec(std::string tenant, std::string name = "test") {
  return {
      .client_name = std::move(name), .tenant = std::move(tenant), .model = "m", .kv_access = true};
}

}  // namespace kvpool::daemon::testing
