// A client process that probes kvpoold's trust boundaries (docs/trust-model.md) for
// trust_integration_test, which runs it under other uids (setpriv). Modes:
//
//   trust_client attach <dir> <tenant> <kv 0|1>
//       attaches by hand and prints "ok pool=<pool> kv=<0|1> fds=<n>" and, for each descriptor
//       received, "fd <role> bytes=<size> write-map=<ok|refused>"; or "refused <CODE>".
//   trust_client plant <dir> <tenant> <seed> <tokens>
//       (KV access) allocates a prompt of <tokens> tokens, fills every byte of its blocks with a
//       pattern made from <seed>, commits it and prints "planted".
//   trust_client scan <dir> <tenant> <seed>
//       (KV access) searches every byte of the arena this session maps for that pattern and
//       prints "found" or "absent <bytes scanned>".
//   trust_client match <dir> <tenant> <seed> <tokens>
//       (compute-only) prints "matched <n>": how much of the planted prompt is cached for it.
//   trust_client quota <dir> <tenant> <blocks>
//       (KV access) attaches twice, under two model strings (two namespaces of one tenant), and
//       has each session allocate one-block sequences until <blocks> or a refusal; prints
//       "held <first> <second>".
//   trust_client hold <dir> <tenant> 0
//       (compute-only) attaches, prints "holding" and waits to be killed.
//   trust_client listen <dir> - <uid>
//       (as root) binds <dir>/attach.sock, becomes <uid>, listens as an impostor daemon, prints
//       "listening", then "received <bytes>": what the first client sent within a second.

#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "client/client.h"
#include "client/internal/attach.h"
#include "kvpool/v1/wire.h"

namespace {

using kvpool::client::Client;

// 16 bytes that the arena never holds by chance.
std::string Pattern(uint64_t seed) {
  std::string p = "kvpool-trust";
  p.append(reinterpret_cast<const char*>(&seed), 4);
  return p;
}

std::vector<int32_t> Prompt(int64_t n, uint64_t seed) {
  std::vector<int32_t> out;
  for (int64_t i = 0; i < n; ++i) out.push_back(static_cast<int32_t>((seed * 7919 + i) % 4096));
  return out;
}

int Fail(const absl::Status& s) {
  std::printf("refused %s\n", absl::StatusCodeToString(s.code()).c_str());
  std::fprintf(stderr, "trust_client: %s\n", s.ToString().c_str());
  return 1;
}

int Attach(const std::string& dir, const std::string& tenant, bool kv) {
  kvpool::v1::AttachRequest request;
  request.set_protocol_version(kvpool::wire::kProtocolVersion);
  request.set_client_name("trust-client");
  request.set_tenant(tenant);
  request.set_kv_access(kv);
  absl::StatusOr<kvpool::client::internal::Attachment> a =
      kvpool::client::internal::Attach(dir, request, absl::Seconds(10));
  if (!a.ok()) return Fail(a.status());
  std::printf("ok pool=%s kv=%d fds=%zu\n", a->response.pool().c_str(), a->response.kv_access(),
              a->fds.size());
  for (size_t i = 0; i < a->fds.size(); ++i) {
    struct stat st {};
    fstat(a->fds[i].get(), &st);
    void* map = mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED,
                     a->fds[i].get(), 0);
    const bool writable = map != MAP_FAILED;
    if (writable) munmap(map, static_cast<size_t>(st.st_size));
    std::printf("fd %s bytes=%lld write-map=%s\n",
                kvpool::v1::FdRole_Name(a->response.fds(static_cast<int>(i))).c_str(),
                static_cast<long long>(st.st_size), writable ? "ok" : "refused");
  }
  return 0;
}

absl::StatusOr<std::unique_ptr<Client>> Connect(const std::string& dir, const std::string& tenant,
                                                bool kv) {
  return Client::Connect(
      {.runtime_dir = dir, .client_name = "trust-client", .tenant = tenant, .kv_access = kv});
}

int Plant(const Client& c, uint64_t seed, int64_t tokens) {
  const std::vector<int32_t> prompt = Prompt(tokens, seed);
  absl::StatusOr<kvpool::v1::SequenceInfo> seq = c.Allocate(prompt);
  if (!seq.ok()) return Fail(seq.status());
  const std::string pattern = Pattern(seed);
  for (const kvpool::client::BlockRef& block : kvpool::client::ToBlockRefs(*seq)) {
    absl::StatusOr<char*> bytes = c.mapping()->Block(block);
    if (!bytes.ok()) return Fail(bytes.status());
    for (int64_t i = 0; i + 16 <= c.layout().block_bytes(); i += 16) {
      std::memcpy(*bytes + i, pattern.data(), 16);
    }
  }
  if (absl::Status s = c.Commit(seq->sequence_id(), tokens); !s.ok()) return Fail(s);
  std::printf("planted\n");
  return 0;
}

int Scan(const Client& c, uint64_t seed) {
  const std::string pattern = Pattern(seed);
  const int64_t bytes = c.layout().block_bytes() * c.layout().num_blocks();
  absl::StatusOr<char*> base = c.mapping()->Block({0, c.mapping()->generation(0)});
  if (!base.ok()) return Fail(base.status());
  if (memmem(*base, static_cast<size_t>(bytes), pattern.data(), 16) != nullptr) {
    std::printf("found\n");
  } else {
    std::printf("absent %lld\n", static_cast<long long>(bytes));
  }
  return 0;
}

// An impostor: the socket is bound (in a directory the client trusts) by root, which then
// becomes another uid before listen(): SO_PEERCRED reports the listener's credentials at listen().
int Listen(const std::string& dir, uid_t uid) {
  const std::string path = dir + "/" + kvpool::wire::kAttachSocket;
  kvpool::UniqueFd fd(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  unlink(path.c_str());
  if (bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      chmod(path.c_str(), 0666) != 0 || setresgid(uid, uid, uid) != 0 ||
      setresuid(uid, uid, uid) != 0 || listen(fd.get(), 4) != 0) {
    std::perror("listen");
    return 1;
  }
  std::printf("listening\n");
  std::fflush(stdout);
  kvpool::UniqueFd client(accept(fd.get(), nullptr, nullptr));
  size_t received = 0;
  char buffer[256];
  for (;;) {
    pollfd p{client.get(), POLLIN, 0};
    if (poll(&p, 1, 1000) <= 0) break;
    const ssize_t n = recv(client.get(), buffer, sizeof(buffer), 0);
    if (n <= 0) break;
    received += static_cast<size_t>(n);
  }
  std::printf("received %zu\n", received);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: trust_client attach|plant|scan|match <dir> <tenant> <a> [b]\n");
    return 2;
  }
  const std::string mode = argv[1], dir = argv[2], tenant = argv[3];
  const uint64_t a = std::strtoull(argv[4], nullptr, 10);
  const int64_t b = argc > 5 ? std::atoll(argv[5]) : 0;
  if (mode == "attach") return Attach(dir, tenant, a != 0);
  if (mode == "quota") {
    int64_t held[2] = {0, 0};
    std::vector<std::unique_ptr<Client>> clients;
    for (int k = 0; k < 2; ++k) {
      absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect({.runtime_dir = dir,
                                                                   .client_name = "trust-client",
                                                                   .tenant = tenant,
                                                                   .model = k == 0 ? "m1" : "m2",
                                                                   .kv_access = true});
      if (!c.ok()) return Fail(c.status());
      while (held[k] < static_cast<int64_t>(a) && (*c)->Allocate({}, 16).ok()) ++held[k];
      clients.push_back(*std::move(c));
    }
    std::printf("held %lld %lld\n", static_cast<long long>(held[0]),
                static_cast<long long>(held[1]));
    return 0;
  }
  if (mode == "listen") return Listen(dir, static_cast<uid_t>(a));
  absl::StatusOr<std::unique_ptr<Client>> c =
      Connect(dir, tenant, mode == "plant" || mode == "scan");
  if (!c.ok()) return Fail(c.status());
  if (mode == "plant") return Plant(**c, a, b);
  if (mode == "hold") {
    std::printf("holding\n");
    std::fflush(stdout);
    for (;;) pause();
  }
  if (mode == "scan") return Scan(**c, a);
  if (mode == "match") {
    absl::StatusOr<int64_t> matched = (*c)->MatchPrefix(Prompt(b, a));
    if (!matched.ok()) return Fail(matched.status());
    std::printf("matched %lld\n", static_cast<long long>(*matched));
    return 0;
  }
  std::fprintf(stderr, "unknown mode %s\n", mode.c_str());
  return 2;
}
