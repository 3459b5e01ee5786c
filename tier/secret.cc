#include "tier/secret.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "fmt/format.h"
#include "kvpool/util/check.h"
#include "kvpool/util/unique_fd.h"

namespace kvpool::tier {
namespace {

constexpr std::string_view kHowToMake =
    "make one with `install -m 0600 /dev/null F && head -c 32 /dev/urandom > F` as the daemon's "
    "user, the same file on every host that shares a tier";

std::string RandomBytes(size_t n) {
  std::string out(n, '\0');
  size_t got = 0;
  while (got < n) {
    const ssize_t r = getrandom(out.data() + got, n - got, 0);
    KVPOOL_CHECK_MSG(r > 0 || errno == EINTR, "getrandom failed");
    if (r > 0) got += static_cast<size_t>(r);
  }
  return out;
}

void AppendPart(EVP_MAC_CTX* ctx, std::string_view part) {
  const std::string length = LittleEndian64(part.size());
  KVPOOL_CHECK(EVP_MAC_update(ctx, reinterpret_cast<const unsigned char*>(length.data()),
                              length.size()) == 1);
  KVPOOL_CHECK(
      EVP_MAC_update(ctx, reinterpret_cast<const unsigned char*>(part.data()), part.size()) == 1);
}

}  // namespace

std::string LittleEndian64(uint64_t value) {
  std::string out(8, '\0');
  for (size_t i = 0; i < 8; ++i) out[i] = static_cast<char>((value >> (8 * i)) & 0xff);
  return out;
}

void DeploymentSecret::MacCtxFree::operator()(evp_mac_ctx_st* ctx) const { EVP_MAC_CTX_free(ctx); }

DeploymentSecret::MacCtx DeploymentSecret::NewKeyedCtx(const std::string& key) {
  // EVP_MAC (OpenSSL 3): the one-shot HMAC() has no way to feed several parts.
  EVP_MAC* mac = EVP_MAC_fetch(nullptr, "HMAC", nullptr);
  KVPOOL_CHECK_MSG(mac != nullptr, "OpenSSL has no HMAC");
  MacCtx ctx(EVP_MAC_CTX_new(mac));
  EVP_MAC_free(mac);  // the context holds its own reference
  KVPOOL_CHECK(ctx != nullptr);
  char digest_name[] = "SHA256";
  const OSSL_PARAM params[] = {
      OSSL_PARAM_construct_utf8_string("digest", digest_name, 0),
      OSSL_PARAM_construct_end(),
  };
  KVPOOL_CHECK(EVP_MAC_init(ctx.get(), reinterpret_cast<const unsigned char*>(key.data()),
                            key.size(), params) == 1);
  return ctx;
}

DeploymentSecret::DeploymentSecret(std::string key, bool ephemeral)
    : key_(std::move(key)), keyed_(NewKeyedCtx(key_)), ephemeral_(ephemeral) {
  fingerprint_ = Mac64("kvpool secret fingerprint", {});
}

DeploymentSecret::DeploymentSecret(const DeploymentSecret& other)
    : key_(other.key_),
      keyed_(NewKeyedCtx(key_)),
      ephemeral_(other.ephemeral_),
      fingerprint_(other.fingerprint_) {}

DeploymentSecret& DeploymentSecret::operator=(const DeploymentSecret& other) {
  if (this != &other) *this = DeploymentSecret(other);
  return *this;
}

absl::StatusOr<std::string> ReadPrivateFile(const std::string& path, std::string_view what,
                                            size_t min_bytes, size_t max_bytes,
                                            std::string_view how_to_make) {
  const std::string hint = how_to_make.empty() ? "" : fmt::format("; {}", how_to_make);
  UniqueFd fd(open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK));
  if (!fd.valid()) {
    const int err = errno;
    if (err == ENOENT) {
      return absl::NotFoundError(fmt::format("{} {}: no such file{}", what, path, hint));
    }
    if (err == ELOOP) {
      return absl::PermissionDeniedError(
          fmt::format("{} {} is a symbolic link: name the file itself", what, path));
    }
    return absl::PermissionDeniedError(fmt::format("{} {}: {}", what, path, std::strerror(err)));
  }
  struct stat st {};
  if (fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(fmt::format("{} {} is not a regular file", what, path));
  }
  if (st.st_uid != geteuid()) {
    return absl::PermissionDeniedError(fmt::format(
        "{} {} belongs to uid {}, not to the daemon's uid {}", what, path, st.st_uid, geteuid()));
  }
  if ((st.st_mode & 077) != 0) {
    return absl::PermissionDeniedError(
        fmt::format("{} {} has mode {:o}: group and others must have no access (chmod 0600)", what,
                    path, st.st_mode & 07777));
  }
  if (st.st_size < static_cast<off_t>(min_bytes) || st.st_size > static_cast<off_t>(max_bytes)) {
    return absl::InvalidArgumentError(fmt::format("{} {} holds {} bytes: it needs {} to {}{}", what,
                                                  path, st.st_size, min_bytes, max_bytes, hint));
  }
  std::string bytes(static_cast<size_t>(st.st_size), '\0');
  size_t got = 0;
  while (got < bytes.size()) {
    const ssize_t r = read(fd.get(), bytes.data() + got, bytes.size() - got);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return absl::PermissionDeniedError(fmt::format("{} {}: short read", what, path));
    got += static_cast<size_t>(r);
  }
  return bytes;
}

absl::StatusOr<DeploymentSecret> DeploymentSecret::FromFile(const std::string& path) {
  absl::StatusOr<std::string> key =
      ReadPrivateFile(path, "secret file", kMinBytes, kMaxBytes, kHowToMake);
  if (!key.ok()) return key.status();
  return DeploymentSecret(*std::move(key), /*ephemeral=*/false);
}

DeploymentSecret DeploymentSecret::Random() {
  return DeploymentSecret(RandomBytes(kMinBytes), /*ephemeral=*/true);
}

DeploymentSecret DeploymentSecret::FromBytes(std::string_view bytes) {
  KVPOOL_CHECK(bytes.size() >= kMinBytes && bytes.size() <= kMaxBytes);
  return DeploymentSecret(std::string(bytes), /*ephemeral=*/false);
}

DeploymentSecret::Digest DeploymentSecret::Mac(
    std::string_view domain, std::initializer_list<std::string_view> parts) const {
  KVPOOL_CHECK(keyed_ != nullptr);  // not a moved-from secret
  MacCtx ctx(EVP_MAC_CTX_dup(keyed_.get()));
  KVPOOL_CHECK(ctx != nullptr);
  AppendPart(ctx.get(), domain);
  for (std::string_view part : parts) AppendPart(ctx.get(), part);
  Digest out{};
  size_t written = 0;
  KVPOOL_CHECK(EVP_MAC_final(ctx.get(), out.data(), &written, out.size()) == 1 &&
               written == out.size());
  return out;
}

uint64_t DeploymentSecret::Mac64(std::string_view domain,
                                 std::initializer_list<std::string_view> parts) const {
  const Digest d = Mac(domain, parts);
  uint64_t v = 0;
  for (size_t i = 0; i < 8; ++i) v |= static_cast<uint64_t>(d[i]) << (8 * i);
  return v;
}

}  // namespace kvpool::tier
