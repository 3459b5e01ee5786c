#pragma once

// The client's side of a decode doorbell (kvpool/v1/doorbell.h): the mapped page and the one
// call it carries at a time. Client::Decode tries it first and goes over gRPC when it is busy
// (another thread's call, or an earlier call that gave up waiting and is still unanswered), for
// top_k, and for batches over kDoorbellMaxItems.
//
// Thread-safe.

#include <cstdint>
#include <memory>
#include <optional>
#include <span>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvpool/util/unique_fd.h"
#include "kvpool/v1/doorbell.h"
#include "kvpool/v1/kvpool.pb.h"

namespace kvpool::client {
struct DecodeItem;
}

namespace kvpool::client::internal {

class ClientDoorbell final {
 public:
  // Maps the page `fd` names. Errors: INVALID_ARGUMENT (not a doorbell's size), INTERNAL (mmap).
  static absl::StatusOr<std::unique_ptr<ClientDoorbell>> Map(UniqueFd fd);
  ~ClientDoorbell();
  // In a forked child (Client's fork handling, client.h): unmaps that process's copy of the page
  // and leaks the object rather than destroy its Mutex, which may have been locked (absl's
  // deadlock detection) by a thread that does not exist there.
  static void UnmapInForkedChild(std::unique_ptr<ClientDoorbell> doorbell);
  ClientDoorbell(const ClientDoorbell&) = delete;
  ClientDoorbell& operator=(const ClientDoorbell&) = delete;

  // One decode step of `items` (1 to kDoorbellMaxItems) through the page, waiting until
  // `deadline`; `attach_socket` is watched meanwhile, so a daemon that went away is noticed.
  // nullopt: the doorbell is busy, use gRPC. Otherwise the daemon's answer, or DEADLINE_EXCEEDED,
  // or UNAVAILABLE when the daemon went away.
  std::optional<absl::StatusOr<v1::DecodeResponse>> Decode(std::span<const DecodeItem> items,
                                                           absl::Time deadline, int attach_socket);

 private:
  explicit ClientDoorbell(wire::DoorbellPage* page) : page_(page) {}
  std::optional<absl::StatusOr<v1::DecodeResponse>> DecodeLocked(std::span<const DecodeItem> items,
                                                                 absl::Time deadline,
                                                                 int attach_socket)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  wire::DoorbellPage* const page_;
  absl::Mutex mu_;
  uint32_t ring_ ABSL_GUARDED_BY(mu_) = 0;  // the last value rung
};

}  // namespace kvpool::client::internal
