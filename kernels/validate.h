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
absl::Status ValidateCopyBlocks(const KvPoolView& pool, const CopyBlocksArgs& args);
absl::Status ValidateFillBlocks(const KvPoolView& pool, const FillBlocksArgs& args);

}  // namespace kvpool::kernels
