// The attach handshake (DESIGN.md §7) as the daemon runs it, from the socket up: arbitrary bytes
// (and, now and then, descriptors) arrive on a Unix stream socket; wire::ReceiveFrame reads the
// AttachRequest and any frames after it; the request's claims go to AttachPolicy::Decide for a
// peer whose credentials the input picks, under one of two configurations (zero-configuration,
// and tenants); an accepted session is opened in an Engine, granted, and its AttachResponse sent
// back over the socket with the grant's descriptors and read by the client side.
//
// Checked on every input: ReceiveFrame leaks no descriptor the peer sent (when the caller takes
// none, they are closed); a frame it accepts parsed completely; Decide accepts only an allowed
// peer and a session that follows the rules of attach_policy.h; the response arrives intact with
// the descriptors it names; after the session ends the engine's invariants hold and it holds no
// sequence.
//
// Input: byte 0 = flags (bit 0: tenants configuration, bit 1: draining, bit 2: the receiver
// collects descriptors, bits 3-5: descriptors sent with the first byte), byte 1 = peer uid
// (index), byte 2 = peer gid (index), the rest = what the peer writes, then it shuts down.

#include <dirent.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "daemon/edge/attach_policy.h"
#include "daemon/edge/config.h"
#include "daemon/edge/convert.h"
#include "daemon/engine/engine.h"
#include "fuzz/fuzz_util.h"
#include "google/protobuf/text_format.h"
#include "google/protobuf/util/message_differencer.h"
#include "kernels/cpu_device.h"
#include "kvpool/v1/attach.pb.h"
#include "kvpool/v1/wire.h"

namespace kvpool::fuzz {
namespace {

using daemon::AttachPolicy;
using daemon::PeerCredentials;

constexpr size_t kMaxWrite = 64 << 10;  // below the socket buffer: the writer never blocks
constexpr uid_t kUids[] = {0, 1000, 1001, 2000, 65534};
constexpr gid_t kGids[] = {0, 100, 1000, 2000, 65534};

constexpr char kOpenConfig[] = R"pb(
  pool_bytes: 8192
  shape { block_size: 4 num_layers: 1 num_kv_heads: 1 head_dim: 16 dtype: "f32" }
  model { name: "none" }
  allowed_uids: 1000
  allowed_gids: 100
  admin_uids: 1000
  tenant_quota_blocks { key: "q" value: 4 }
)pb";

constexpr char kTenantsConfig[] = R"pb(
  pool_bytes: 8192
  shape { block_size: 4 num_layers: 1 num_kv_heads: 1 head_dim: 16 dtype: "f32" }
  model { name: "none" }
  allowed_uids: [ 1000, 1001 ]
  allowed_gids: 100
  admin_uids: [ 0, 1001 ]
  tenants { name: "a" uids: 1000 kv_access: true quota_blocks: 8 }
  tenants { name: "b" gids: 100 max_sessions: 1 }
)pb";

// A validated config from `text`, as the daemon loads one.
v1::DaemonConfig Config(const char* text) {
  v1::DaemonConfig config;
  Require(google::protobuf::TextFormat::ParseFromString(text, &config), "fuzzer config parses");
  daemon::ApplyDefaults(&config);
  Require(daemon::ValidateConfig(config).empty(), "fuzzer config validates");
  return config;
}

// As the daemon makes them (daemon.cc: PolicyOptions, and its attach callback's claims).
AttachPolicy::Options PolicyOptions(const v1::DaemonConfig& c) {
  AttachPolicy::Options o{.allowed_uids = {c.allowed_uids().begin(), c.allowed_uids().end()},
                          .allowed_gids = {c.allowed_gids().begin(), c.allowed_gids().end()},
                          .admin_uids = {c.admin_uids().begin(), c.admin_uids().end()},
                          .protocol_version = wire::kProtocolVersion};
  for (const v1::TenantSpec& t : c.tenants()) {
    o.tenants[t.name()] = {.uids = {t.uids().begin(), t.uids().end()},
                           .gids = {t.gids().begin(), t.gids().end()},
                           .kv_access = t.kv_access()};
  }
  return o;
}

daemon::AttachClaims ClaimsOf(const v1::AttachRequest& request) {
  return {.protocol_version = request.protocol_version(),
          .client_name = request.client_name(),
          .tenant = request.tenant(),
          .model = request.model(),
          .kv_access = request.kv_access()};
}

int OpenDescriptors() {
  int n = 0;
  DIR* dir = opendir("/proc/self/fd");
  Require(dir != nullptr, "opendir /proc/self/fd");
  while (readdir(dir) != nullptr) ++n;
  closedir(dir);
  return n;
}

struct Setup {
  v1::DaemonConfig config;
  AttachPolicy policy;
};

const Setup& SetupFor(bool tenants) {
  static const Setup* const kSetups[2] = {
      new Setup{Config(kOpenConfig), AttachPolicy(PolicyOptions(Config(kOpenConfig)))},
      new Setup{Config(kTenantsConfig), AttachPolicy(PolicyOptions(Config(kTenantsConfig)))}};
  return *kSetups[tenants ? 1 : 0];
}

// The peer writes `bytes` (with `num_fds` descriptors on the first byte) and shuts down.
void Write(int socket, std::string_view bytes, int num_fds) {
  std::vector<UniqueFd> owned;
  std::vector<int> fds;
  for (int i = 0; i < num_fds && !bytes.empty(); ++i) {
    owned.emplace_back(dup(STDERR_FILENO));
    fds.push_back(owned.back().get());
  }
  size_t sent = 0;
  while (sent < bytes.size()) {
    iovec iov{const_cast<char*>(bytes.data()) + sent, bytes.size() - sent};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 8)] = {};
    if (sent == 0 && !fds.empty()) {
      msg.msg_control = control;
      msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
      std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
    }
    const ssize_t n = sendmsg(socket, &msg, MSG_NOSIGNAL);
    Require(n > 0, "sendmsg on the peer side");
    sent += static_cast<size_t>(n);
  }
  shutdown(socket, SHUT_WR);
}

// Reads the request and the frames after it (the daemon expects at most a Detach); returns the
// request when the first frame was one.
std::optional<v1::AttachRequest> Receive(int socket, bool collect, int num_fds_sent) {
  std::vector<int> fds;
  v1::AttachRequest request;
  const absl::Status s =
      wire::ReceiveFrame(socket, &request, collect ? &fds : nullptr, absl::Seconds(5));
  Require(s.code() != absl::StatusCode::kDeadlineExceeded, "ReceiveFrame waited past EOF");
  Require(static_cast<int>(fds.size()) <= num_fds_sent, "ReceiveFrame invented descriptors");
  for (int fd : fds) close(fd);
  if (!s.ok()) return std::nullopt;
  for (int frame = 0; frame < 3; ++frame) {
    v1::Detach detach;
    if (!wire::ReceiveFrame(socket, &detach, nullptr, absl::Seconds(5)).ok()) break;
  }
  return request;
}

// What Decide promised about an accepted session (attach_policy.h).
void CheckSpec(const Setup& setup, const PeerCredentials& peer, const v1::AttachRequest& request,
               bool draining, const daemon::SessionSpec& spec) {
  Require(setup.policy.allowed(peer), "accepted a peer that is not allowed");
  Require(request.protocol_version() == wire::kProtocolVersion, "accepted another protocol");
  Require(!draining || spec.admin, "accepted a non-admin while draining");
  Require(spec.admin == setup.policy.admin(peer), "admin role differs from admin_uids");
  Require(spec.uid == peer.uid && spec.gid == peer.gid, "spec credentials differ from the peer");
  Require(!spec.model.empty(), "empty model in an accepted spec");
  for (const std::string* name : {&spec.client_name, &spec.tenant, &spec.model}) {
    Require(name->size() <= AttachPolicy::kMaxNameBytes, "accepted an over-long name");
    for (unsigned char c : *name) Require(c >= 0x20 && c < 0x7f, "accepted an unprintable name");
  }
  if (spec.tenant.empty()) {
    Require(spec.admin && !spec.kv_access && setup.config.tenants_size() > 0,
            "admin-only session for a non-admin, with KV access, or without tenants");
  }
  for (const v1::TenantSpec& t : setup.config.tenants()) {
    if (t.name() != spec.tenant) continue;
    const bool granted = std::find(t.uids().begin(), t.uids().end(), peer.uid) != t.uids().end() ||
                         std::find(t.gids().begin(), t.gids().end(), peer.gid) != t.gids().end();
    Require(granted, "accepted a tenant that does not grant the peer");
    Require(t.kv_access() || !spec.kv_access, "KV access beyond the tenant's grant");
  }
}

// Opens the session in a fresh engine, sends the grant as the daemon does and reads it back as a
// client does; then ends the session and checks the engine.
void Grant(const Setup& setup, const daemon::SessionSpec& spec) {
  static kernels::CpuDevice device(1);
  auto options = daemon::MakeEngineOptions(setup.config, /*epoch=*/1);
  RequireOk(options.status(), "MakeEngineOptions of the fuzzer's config");
  auto engine = daemon::Engine::Create(*options, &device, /*model=*/nullptr);
  RequireOk(engine.status(), "Engine::Create");
  auto session = (*engine)->OpenSession(spec);
  if (!session.ok()) {  // a tenant's limits (max_sessions, namespace table): refused cleanly
    RequireOk((*engine)->CheckInvariants(), "invariants after a refused session");
    return;
  }
  auto grant = (*engine)->Grant(*session);
  RequireOk(grant.status(), "Grant");
  Require(grant->arena.has_value() == spec.kv_access, "arena granted iff KV access");
  v1::AttachResponse response;
  daemon::ToProto(*grant, &response);
  std::vector<int> fds;
  if (grant->arena && grant->arena->fd.valid()) fds.push_back(grant->arena->fd.get());
  if (grant->generation_table.valid()) fds.push_back(grant->generation_table.get());
  Require(static_cast<int>(fds.size()) == response.fds_size(), "fds listed == fds sent");

  int pair[2];
  Require(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) == 0, "socketpair");
  UniqueFd daemon_side(pair[0]), client_side(pair[1]);
  RequireOk(wire::SendFrame(daemon_side.get(), response, fds), "SendFrame of the response");
  v1::AttachResponse received;
  std::vector<int> received_fds;
  RequireOk(wire::ReceiveFrame(client_side.get(), &received, &received_fds, absl::Seconds(5)),
            "ReceiveFrame of the response");
  Require(google::protobuf::util::MessageDifferencer::Equals(response, received),
          "the response arrived changed");
  Require(received_fds.size() == fds.size(), "the descriptors did not all arrive");
  for (int fd : received_fds) close(fd);

  (*engine)->EndSession((*session)->id, daemon::SessionEnd::kConnectionLost);
  RequireOk((*engine)->CheckInvariants(), "invariants after the session ended");
  Require((*engine)->Stats().cache.sequences == 0, "an ended session left sequences");
}

}  // namespace
}  // namespace kvpool::fuzz

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  kvpool::fuzz::QuietLogs();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvpool::fuzz;
  if (size < 3 || size - 3 > kMaxWrite) return -1;  // -1: not worth keeping in the corpus
  const uint8_t flags = data[0];
  const Setup& setup = SetupFor(flags & 1);
  const bool draining = (flags & 2) != 0;
  const bool collect = (flags & 4) != 0;
  const int num_fds = (flags >> 3) & 7;  // up to 7: past wire::kMaxFds (4), which the kernel cuts
  const PeerCredentials peer{.pid = 4242,
                             .uid = kUids[data[1] % std::size(kUids)],
                             .gid = kGids[data[2] % std::size(kGids)]};

  const int fds_before = OpenDescriptors();
  std::optional<kvpool::v1::AttachRequest> request;
  {
    int pair[2];
    Require(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) == 0, "socketpair");
    kvpool::UniqueFd daemon_side(pair[0]), peer_side(pair[1]);
    Write(peer_side.get(), {reinterpret_cast<const char*>(data) + 3, size - 3}, num_fds);
    request = Receive(daemon_side.get(), collect, num_fds);
  }
  Require(OpenDescriptors() == fds_before, "the handshake leaked descriptors");
  if (!request) return 0;

  absl::StatusOr<kvpool::daemon::SessionSpec> spec =
      setup.policy.Decide(peer, ClaimsOf(*request), draining);
  if (!spec.ok()) {
    const absl::StatusCode code = spec.status().code();
    Require(code == absl::StatusCode::kPermissionDenied ||
                code == absl::StatusCode::kInvalidArgument ||
                code == absl::StatusCode::kUnavailable,
            "Decide refused with a code attach_policy.h does not name");
    return 0;
  }
  CheckSpec(setup, peer, *request, draining, *spec);
  Grant(setup, *spec);
  Require(OpenDescriptors() == fds_before, "the grant leaked descriptors");
  return 0;
}
