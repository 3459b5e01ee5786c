#include "daemon/engine/generation_table.h"

#include <fcntl.h>
#include <sys/mman.h>

#include <cerrno>
#include <cstring>

#include "fmt/format.h"

namespace kvpool::daemon {
namespace {

absl::Status Errno(std::string_view what) {
  return absl::InternalError(fmt::format("generation table: {}: {}", what, std::strerror(errno)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<GenerationTable>> GenerationTable::Create(int32_t num_blocks) {
  if (num_blocks <= 0) {
    return absl::InvalidArgumentError(fmt::format("generation table of {} blocks", num_blocks));
  }
  const size_t bytes = static_cast<size_t>(num_blocks) * sizeof(uint32_t);
  UniqueFd fd(memfd_create("kvpool-generations", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd.valid()) return Errno("memfd_create");
  if (ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0) return Errno("ftruncate");
  void* table = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (table == MAP_FAILED) return Errno("mmap");
  // From here on nobody (a client holding the descriptor included) can map it writable or write
  // it; the daemon's own mapping, made before, stays writable.
  if (fcntl(fd.get(), F_ADD_SEALS,
            F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL) != 0) {
    const absl::Status s = Errno("seal");
    munmap(table, bytes);
    return s;
  }
  return std::unique_ptr<GenerationTable>(
      new GenerationTable(std::move(fd), static_cast<uint32_t*>(table), num_blocks));
}

GenerationTable::~GenerationTable() {
  munmap(table_, static_cast<size_t>(num_blocks_) * sizeof(uint32_t));
}

absl::StatusOr<UniqueFd> GenerationTable::Export() const {
  UniqueFd dup(fcntl(fd_.get(), F_DUPFD_CLOEXEC, 0));
  if (!dup.valid()) return Errno("dup");
  return dup;
}

}  // namespace kvpool::daemon
