#pragma once

// Host-side checks of kernel arguments, shared by every backend: what can be checked without
// reading device memory (sizes, layer, head grouping, null pointers). Each returns
// INVALID_ARGUMENT naming the problem, or OK.

#include "absl/status/status.h"
#include "kernels/kernel_args.h"
#include "kernels/pool_layout.h"

namespace kvpool::kernels {

absl::Status ValidateWriteKv(const KvPoolView& pool, const WriteKvArgs& args);
absl::Status ValidateDecode(const KvPoolView& pool, const DecodeArgs& args);
// Also checks the workspace against `workspace_needed` (the backend's PrefillWorkspaceBytes).
absl::Status ValidatePrefill(const KvPoolView& pool, const PrefillArgs& args,
                             int64_t workspace_needed);
// Every block holding a key that some query at a position in [first_pos, len - 1] sees (under
// `window`) is inside the layer's region (`layer`: PoolLayout::Layer, whose num_blocks is the
// window region's for a window layer); the blocks no query sees are not looked at (a window's
// released blocks may be < 0). `kernel` and `seq` name the call and sequence in the error.
absl::Status CheckVisibleBlocks(std::string_view kernel, int32_t seq, const int32_t* table,
                                const LayerLayout& layer, const AttentionWindow& window,
                                int64_t first_pos, int64_t len);
absl::Status ValidateCopyBlocks(const KvPoolView& pool, const CopyBlocksArgs& args);
absl::Status ValidateFillBlocks(const KvPoolView& pool, const FillBlocksArgs& args);

}  // namespace kvpool::kernels
