#pragma once

// DeploymentSecret: the key every identity and MAC that must agree across daemons is derived
// under (DESIGN.md §7, §9): namespace ids, the tiers' block keys and value MACs. Whoever lacks it
// can neither aim at another tenant's namespace nor forge, read by key or replay a stored block.
//
// It is read from a file only the daemon may read (FromFile checks that), or, when none is
// configured, drawn at random at start (Random): identities then agree within this process only,
// which is right for a daemon that shares nothing below its host tier.
//
// Every MAC is HMAC-SHA256 (OpenSSL) over an unambiguous encoding: a domain string that says what
// the MAC is for, then each part as its length (u64, little-endian) and its bytes. No two
// different (domain, parts) lists encode alike, so no choice of client strings makes two
// identities collide short of a collision of HMAC-SHA256 itself.
//
// Immutable after construction: thread-safe (any number of threads may call Mac at once).
// Copyable (the key is 32-4096 bytes); a moved-from secret may only be destroyed or assigned to.

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

struct evp_mac_ctx_st;  // OpenSSL's EVP_MAC_CTX

namespace kvpool::tier {

class DeploymentSecret final {
 public:
  static constexpr size_t kMinBytes = 32;
  static constexpr size_t kMaxBytes = 4096;
  using Digest = std::array<uint8_t, 32>;

  // The secret in `path`: a regular file (not a symlink) owned by this process's effective uid,
  // with no permission for group or others, of kMinBytes to kMaxBytes bytes (taken as they are,
  // trailing newline included). Errors: NOT_FOUND (no such file), PERMISSION_DENIED (a symlink,
  // another owner, readable or writable by group or others, unreadable), INVALID_ARGUMENT (not
  // a regular file, too short or too long); each names the path and the fix.
  static absl::StatusOr<DeploymentSecret> FromFile(const std::string& path);
  // kMinBytes fresh random bytes (getrandom(2)).
  static DeploymentSecret Random();
  // A secret of exactly `bytes` (tests, benchmarks). REQUIRES: kMinBytes <= size <= kMaxBytes.
  static DeploymentSecret FromBytes(std::string_view bytes);

  DeploymentSecret(const DeploymentSecret& other);
  DeploymentSecret& operator=(const DeploymentSecret& other);
  DeploymentSecret(DeploymentSecret&& other) noexcept = default;
  DeploymentSecret& operator=(DeploymentSecret&& other) noexcept = default;
  ~DeploymentSecret() = default;

  // HMAC-SHA256 of the encoding of (`domain`, `parts`...) described above.
  Digest Mac(std::string_view domain, std::initializer_list<std::string_view> parts) const;
  // The first 8 bytes of Mac as a little-endian integer.
  uint64_t Mac64(std::string_view domain, std::initializer_list<std::string_view> parts) const;
  // Names the secret without revealing it (Mac64 of a fixed domain): equal for equal secrets.
  uint64_t fingerprint() const { return fingerprint_; }
  // Drawn by Random(): nothing outside this process shares it.
  bool ephemeral() const { return ephemeral_; }

 private:
  struct MacCtxFree {
    void operator()(evp_mac_ctx_st* ctx) const;
  };
  using MacCtx = std::unique_ptr<evp_mac_ctx_st, MacCtxFree>;

  DeploymentSecret(std::string key, bool ephemeral);
  // A fresh HMAC-SHA256 context keyed with key_.
  static MacCtx NewKeyedCtx(const std::string& key);

  std::string key_;
  // HMAC-SHA256 keyed with key_ and never fed: each Mac() continues a copy of it
  // (EVP_MAC_CTX_dup only reads it, so concurrent Mac() calls are safe), which saves the
  // algorithm fetch and the key schedule, about half the cost of a short MAC.
  MacCtx keyed_;
  bool ephemeral_ = false;
  uint64_t fingerprint_ = 0;
};

// `value` as 8 little-endian bytes: a part of a MAC's encoding for an integer.
std::string LittleEndian64(uint64_t value);

// The bytes of a credential file only this process may read: `path` must be a regular file
// (not a symlink) owned by the effective uid, with no permission for group or others, of
// `min_bytes` to `max_bytes` bytes. `what` names it in messages ("secret file"), `how_to_make`
// (may be empty) says how to make a good one. Errors: NOT_FOUND (no such file),
// PERMISSION_DENIED (a symlink, another owner, open to group or others, unreadable),
// INVALID_ARGUMENT (not a regular file, too short or too long); each a single line naming the
// path and the fix. DeploymentSecret::FromFile and the Redis tier's password_file use it.
absl::StatusOr<std::string> ReadPrivateFile(const std::string& path, std::string_view what,
                                            size_t min_bytes, size_t max_bytes,
                                            std::string_view how_to_make);

}  // namespace kvpool::tier
