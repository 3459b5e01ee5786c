#pragma once

// UniqueFd: sole owner of one file descriptor, closed on destruction. Move-only.
//
// Not thread-safe (a value type); the descriptor itself may be used from any thread.

#include <unistd.h>

#include <utility>

namespace kvpool {

class UniqueFd final {
 public:
  UniqueFd() = default;
  // Takes ownership of `fd` (-1: empty).
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) reset(other.release());
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }

  // Gives up ownership without closing.
  int release() { return std::exchange(fd_, -1); }

  // Closes the held descriptor (if any) and takes `fd`.
  void reset(int fd = -1) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_ = -1;
};

}  // namespace kvpool
