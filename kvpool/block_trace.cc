#include "kvpool/block_trace.h"

#include <algorithm>
#include <cstring>

#include "fmt/format.h"

namespace kvpool {

std::string_view BlockOpName(BlockOp op) {
  switch (op) {
    case BlockOp::kAllocate:
      return "alloc";
    case BlockOp::kRetain:
      return "retain";
    case BlockOp::kRelease:
      return "release";
    case BlockOp::kFree:
      return "free";
    case BlockOp::kRetire:
      return "retire";
    case BlockOp::kReclaim:
      return "reclaim";
    case BlockOp::kInFlight:
      return "in_flight";
    case BlockOp::kCacheRef:
      return "cache_ref";
    case BlockOp::kCacheDrop:
      return "cache_drop";
    case BlockOp::kOverRelease:
      return "OVER_RELEASE";
  }
  return "?";
}

std::string FormatTraceEntry(const BlockTraceEntry& e) {
  std::string_view file = e.site.file_name();
  if (size_t slash = file.rfind('/'); slash != std::string_view::npos)
    file.remove_prefix(slash + 1);
  return fmt::format("#{} t={}ns block={} {} refs={} gen={} session={} seq={} at {}:{} ({})",
                     e.op_seq, e.time_ns, e.block.value(), BlockOpName(e.op), e.refs_after,
                     e.generation, e.session.value(), e.sequence.value(), file, e.site.line(),
                     e.site.function_name());
}

BlockTrace::BlockTrace(int32_t num_blocks, int32_t depth)
    : depth_(depth),
      mask_(static_cast<uint32_t>(depth > 0 ? depth - 1 : 0)),
      entries_(static_cast<size_t>(num_blocks) * static_cast<size_t>(depth)),
      recorded_(depth > 0 ? static_cast<size_t>(num_blocks) : 0, 0) {}

std::vector<BlockTraceEntry> BlockTrace::History(BlockId block) const {
  std::vector<BlockTraceEntry> out;
  if (depth_ == 0) return out;
  const size_t i = static_cast<size_t>(block.value());
  const uint32_t n = recorded_[i];
  const uint32_t depth = static_cast<uint32_t>(depth_);
  const uint32_t kept = std::min(n, depth);
  out.reserve(kept);
  for (uint32_t k = n - kept; k < n; ++k) {
    const Entry& e = entries_[i * depth + (k & mask_)];
    out.push_back(BlockTraceEntry{.op_seq = e.seq_and_op >> 8,
                                  .time_ns = e.time_ns,
                                  .sequence = e.sequence,
                                  .session = e.session,
                                  .site = e.site,
                                  .refs_after = e.refs_after,
                                  .generation = e.generation,
                                  .block = block,
                                  .op = static_cast<BlockOp>(e.seq_and_op & 0xff)});
  }
  return out;
}

std::vector<BlockTraceEntry> BlockTrace::All() const {
  std::vector<BlockTraceEntry> out;
  for (size_t i = 0; i < recorded_.size(); ++i) {
    std::vector<BlockTraceEntry> h = History(BlockId(static_cast<int32_t>(i)));
    out.insert(out.end(), h.begin(), h.end());
  }
  std::sort(out.begin(), out.end(),
            [](const BlockTraceEntry& a, const BlockTraceEntry& b) { return a.op_seq < b.op_seq; });
  return out;
}

std::string BlockTrace::Format(BlockId block) const {
  std::string out;
  for (const BlockTraceEntry& e : History(block)) {
    out += FormatTraceEntry(e);
    out += '\n';
  }
  return out;
}

bool BlockTrace::operator==(const BlockTrace& other) const {
  if (depth_ != other.depth_ || next_op_seq_ != other.next_op_seq_ ||
      recorded_ != other.recorded_ || entries_.size() != other.entries_.size()) {
    return false;
  }
  for (size_t i = 0; i < entries_.size(); ++i) {
    const Entry& a = entries_[i];
    const Entry& b = other.entries_[i];
    if (a.seq_and_op != b.seq_and_op || a.time_ns != b.time_ns || a.sequence != b.sequence ||
        a.session != b.session || a.refs_after != b.refs_after || a.generation != b.generation ||
        a.site.line() != b.site.line() ||
        std::strcmp(a.site.file_name(), b.site.file_name()) != 0) {
      return false;
    }
  }
  return true;
}

}  // namespace kvpool
