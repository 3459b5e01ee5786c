#pragma once

// The wire contract shared by kvpoold and its clients beyond the .proto files: where the sockets
// are, the metadata keys, and the framing of the attach socket (attach.proto). Depends on
// protobuf only, so the client library can use it without any daemon code.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "google/protobuf/message_lite.h"

namespace kvpool::wire {

inline constexpr char kGrpcSocket[] = "kvpoold.sock";
inline constexpr char kAttachSocket[] = "attach.sock";
inline constexpr char kSessionTokenKey[] = "kvpool-session-token";
inline constexpr char kShortfallKey[] = "kvpool-shortfall";  // "<resource>:<blocks>"
inline constexpr uint32_t kProtocolVersion = 1;
inline constexpr uint32_t kMaxFrameBytes = 1 << 20;
inline constexpr int kMaxFds = 4;

// $XDG_RUNTIME_DIR/kvpool when XDG_RUNTIME_DIR is set, else /tmp/kvpool-<uid>.
std::string DefaultRuntimeDir();

// Writes `message` as one frame (4-byte little-endian length, then the bytes), with `fds` as
// SCM_RIGHTS on the first byte. Errors: UNAVAILABLE (the peer hung up: EPIPE, ECONNRESET),
// INTERNAL (other I/O), INVALID_ARGUMENT (too big).
absl::Status SendFrame(int socket, const google::protobuf::MessageLite& message,
                       const std::vector<int>& fds = {});

// Assembles one frame from bytes as they arrive, for readers that do not block. Reading at most
// wanted() bytes at a time consumes nothing past the frame.
class FrameReader {
 public:
  explicit FrameReader(uint32_t max_bytes = kMaxFrameBytes) : max_bytes_(max_bytes) {}

  // Appends up to wanted() bytes. Errors: INVALID_ARGUMENT (more bytes than wanted(), or a
  // frame announcing more than max_bytes), after which the reader stays failed.
  absl::Status Append(std::string_view bytes);
  // Bytes still missing; 0 once the frame is complete.
  size_t wanted() const { return want_ - buffer_.size(); }
  bool complete() const { return have_length_ && buffer_.size() == want_; }
  size_t size() const { return buffer_.size(); }
  // Parses the complete frame. Errors: FAILED_PRECONDITION (incomplete), INVALID_ARGUMENT
  // (unparsable).
  absl::Status Parse(google::protobuf::MessageLite* message) const;

 private:
  uint32_t max_bytes_;
  std::string buffer_;
  size_t want_ = 4;
  bool have_length_ = false;
  bool failed_ = false;
};

// Reads one frame into `message`, collecting any descriptors sent with it into `fds` (the caller
// owns and must close them). Waits at most `timeout`. Errors: DEADLINE_EXCEEDED, UNAVAILABLE
// (the peer closed or reset), INVALID_ARGUMENT (oversized or unparsable frame), INTERNAL (I/O).
absl::Status ReceiveFrame(int socket, google::protobuf::MessageLite* message, std::vector<int>* fds,
                          absl::Duration timeout);

}  // namespace kvpool::wire
