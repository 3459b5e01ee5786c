#include "client/internal/doorbell.h"

#include <poll.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <string>

#include "client/client.h"
#include "client/status.h"
#include "fmt/format.h"
#include "kvpool/v1/wire.h"

namespace kvpool::client::internal {
namespace {

// How long one futex wait lasts before the deadline and the daemon are looked at again.
constexpr absl::Duration kWaitSlice = absl::Milliseconds(20);

// Whether the daemon's end of the attach socket closed (it never writes after the handshake).
bool DaemonGone(int attach_socket) {
  pollfd p{.fd = attach_socket, .events = POLLIN | POLLRDHUP, .revents = 0};
  return poll(&p, 1, 0) != 0;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ClientDoorbell>> ClientDoorbell::Map(UniqueFd fd) {
  struct stat st {};
  if (fstat(fd.get(), &st) != 0) {
    return absl::InternalError(fmt::format("decode doorbell: fstat: {}", std::strerror(errno)));
  }
  if (static_cast<size_t>(st.st_size) != wire::kDoorbellBytes) {
    return absl::InvalidArgumentError(fmt::format(
        "decode doorbell of {} bytes; this client expects {}", st.st_size, wire::kDoorbellBytes));
  }
  void* page = mmap(nullptr, wire::kDoorbellBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (page == MAP_FAILED) {
    return absl::InternalError(fmt::format("decode doorbell: mmap: {}", std::strerror(errno)));
  }
  // The mapping keeps the memfd alive; the descriptor closes here.
  return std::unique_ptr<ClientDoorbell>(
      new ClientDoorbell(static_cast<wire::DoorbellPage*>(page)));
}

ClientDoorbell::~ClientDoorbell() { munmap(page_, wire::kDoorbellBytes); }

void ClientDoorbell::UnmapInForkedChild(std::unique_ptr<ClientDoorbell> doorbell) {
  if (doorbell == nullptr) return;
  munmap(doorbell->page_, wire::kDoorbellBytes);
  (void)doorbell.release();
}

std::optional<absl::StatusOr<v1::DecodeResponse>> ClientDoorbell::Decode(
    std::span<const DecodeItem> items, absl::Time deadline, int attach_socket) {
  if (items.empty() || items.size() > wire::kDoorbellMaxItems) return std::nullopt;
  if (!mu_.TryLock()) return std::nullopt;
  std::optional<absl::StatusOr<v1::DecodeResponse>> r =
      DecodeLocked(items, deadline, attach_socket);
  mu_.Unlock();
  return r;
}

std::optional<absl::StatusOr<v1::DecodeResponse>> ClientDoorbell::DecodeLocked(
    std::span<const DecodeItem> items, absl::Time deadline, int attach_socket) {
  wire::DoorbellPage& p = *page_;
  if (p.answered.load(std::memory_order_acquire) != ring_) return std::nullopt;  // still unanswered
  for (size_t i = 0; i < items.size(); ++i) {
    p.items[i] = {.sequence_id = items[i].sequence_id, .token = items[i].token, .reserved = 0};
  }
  p.num_items = static_cast<uint32_t>(items.size());
  p.timeout_ns = absl::ToInt64Nanoseconds(deadline - absl::Now());
  const uint32_t ring = ++ring_;
  p.ring.store(ring, std::memory_order_release);
  wire::FutexWakeAll(&p.ring);
  for (;;) {
    const uint32_t answered = p.answered.load(std::memory_order_acquire);
    if (answered == ring) break;
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::DeadlineExceededError("Decode: kvpoold did not answer the doorbell in time");
    }
    const timespec slice = absl::ToTimespec(std::min(kWaitSlice, deadline - now));
    wire::FutexWait(&p.answered, answered, &slice);
    if (p.answered.load(std::memory_order_acquire) != ring && DaemonGone(attach_socket)) {
      return absl::UnavailableError("Decode: kvpoold went away");
    }
  }
  const auto code = static_cast<absl::StatusCode>(p.code);
  if (code != absl::StatusCode::kOk) {
    const std::string message(p.message, std::min(p.message_bytes, wire::kDoorbellMessageBytes));
    std::multimap<grpc::string_ref, grpc::string_ref> trailers;
    const std::string shortfall(p.shortfall,
                                std::min(p.shortfall_bytes, wire::kDoorbellShortfallBytes));
    if (!shortfall.empty()) trailers.emplace(wire::kShortfallKey, shortfall);
    return FromGrpcStatus(grpc::Status(static_cast<grpc::StatusCode>(code), message), trailers);
  }
  v1::DecodeResponse response;
  for (size_t i = 0; i < items.size(); ++i) {
    response.add_next_tokens(p.results[i].next_token);
    response.add_num_tokens(p.results[i].num_tokens);
  }
  response.set_step_sequences(p.step_sequences);
  return response;
}

}  // namespace kvpool::client::internal
