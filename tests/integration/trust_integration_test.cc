// Trust boundaries with real processes and real uids (docs/trust-model.md): the probes run as
// other users (setpriv), against a kvpoold that names its tenants and pools. Label
// `integration`; needs root (to switch uids), as CI and the README's test command run.

#include <sys/stat.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "client/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/harness.h"

namespace kvpool::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr uid_t kAlice = 4242;    // tenant "a": KV access, pool p1
constexpr uid_t kBob = 4243;      // tenant "b": KV access, pool p2
constexpr uid_t kCarol = 4244;    // tenant "c": compute-only, pool p1
constexpr uid_t kMallory = 4245;  // allowed to attach, granted no tenant

std::string Config() {
  return R"pb(
    socket_mode: 438  # 0666: other uids reach the sockets; the daemon checks who they are
    allowed_uids: [ 0, 4242, 4243, 4244, 4245 ]
    admin_uids: [ 0 ]
    pools { name: "p1" pool_bytes: 8388608 }
    pools { name: "p2" pool_bytes: 8388608 }
    tenants { name: "a" uids: 4242 kv_access: true pool: "p1" quota_blocks: 40 }
    tenants { name: "b" uids: 4243 kv_access: true pool: "p2" }
    tenants { name: "c" uids: 4244 pool: "p1" max_sessions: 1 }
    tenants { name: "root" uids: 0 kv_access: true pool: "p1" }
  )pb";
}

class TrustIntegrationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (geteuid() != 0) GTEST_SKIP() << "needs root to run probes under other uids";
    absl::StatusOr<std::unique_ptr<DaemonProcess>> d = DaemonProcess::Start(Config());
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
    chmod(daemon_->dir().c_str(), 0755);  // the probes (other uids) must reach the sockets
  }

  // Runs trust_client as `uid`; returns what it printed.
  std::string As(uid_t uid, const std::vector<std::string>& args) {
    std::vector<std::string> argv = {"/usr/bin/setpriv", "--reuid=" + std::to_string(uid),
                                     "--regid=" + std::to_string(uid), "--clear-groups",
                                     TrustClientBinary()};
    argv.insert(argv.end(), args.begin(), args.end());
    return RunToEnd(argv).second;
  }
  std::string Attach(uid_t uid, const std::string& tenant, bool kv) {
    return As(uid, {"attach", daemon_->dir(), tenant, kv ? "1" : "0"});
  }
  // The daemon still serves and its pools are consistent (kvpoolctl, as root: an admin).
  void ExpectServingAndConsistent() {
    const auto [rc, out] = RunToEnd({KvpoolctlBinary(), "--socket_dir=" + daemon_->dir(), "check"});
    EXPECT_EQ(rc, 0) << out;
  }

  std::unique_ptr<DaemonProcess> daemon_;
};

TEST_F(TrustIntegrationTest, APeerMayClaimOnlyTheTenantsItIsGranted) {
  EXPECT_THAT(Attach(kAlice, "a", false), StartsWith("ok pool=p1"));
  EXPECT_EQ(Attach(kAlice, "b", false), "refused PERMISSION_DENIED\n");
  EXPECT_EQ(Attach(kBob, "a", true), "refused PERMISSION_DENIED\n");
  EXPECT_EQ(Attach(kMallory, "a", false), "refused PERMISSION_DENIED\n");
  EXPECT_EQ(Attach(kMallory, "default", false), "refused PERMISSION_DENIED\n");
  EXPECT_THAT(Attach(kBob, "b", false), StartsWith("ok pool=p2"));
  ExpectServingAndConsistent();
}

TEST_F(TrustIntegrationTest, AComputeOnlySessionReceivesNoDescriptor) {
  EXPECT_EQ(Attach(kCarol, "c", false), "ok pool=p1 kv=0 fds=0\n");
  EXPECT_EQ(Attach(kAlice, "a", false), "ok pool=p1 kv=0 fds=0\n");     // did not ask
  EXPECT_EQ(Attach(kCarol, "c", true), "refused PERMISSION_DENIED\n");  // not granted
  ExpectServingAndConsistent();
}

TEST_F(TrustIntegrationTest, TheGenerationTableCannotBeMappedWritable) {
  const std::string out = Attach(kAlice, "a", true);
  EXPECT_THAT(out, StartsWith("ok pool=p1 kv=1 fds=2\n"));
  EXPECT_THAT(out, HasSubstr("fd FD_ROLE_ARENA bytes=8388608 write-map=ok"));
  EXPECT_THAT(out, HasSubstr("fd FD_ROLE_GENERATION_TABLE bytes=512 write-map=refused"));
}

TEST_F(TrustIntegrationTest, TwoPoolsShareNoBytesAndNoPrefixes) {
  ASSERT_EQ(As(kAlice, {"plant", daemon_->dir(), "a", "77", "64"}), "planted\n");
  // A KV-access session of the same pool can read it (what the scan is for)...
  EXPECT_EQ(As(0, {"scan", daemon_->dir(), "root", "77"}), "found\n");
  // ...one of the other pool never finds it, in any byte it can map.
  EXPECT_EQ(As(kBob, {"scan", daemon_->dir(), "b", "77"}), "absent 8388608\n");
  // The prompt is cached for its tenant only.
  EXPECT_EQ(As(kAlice, {"match", daemon_->dir(), "a", "77", "64"}), "matched 64\n");
  EXPECT_EQ(As(kBob, {"match", daemon_->dir(), "b", "77", "64"}), "matched 0\n");
  EXPECT_EQ(As(kCarol, {"match", daemon_->dir(), "c", "77", "64"}), "matched 0\n");
  ExpectServingAndConsistent();
}

TEST_F(TrustIntegrationTest, ATenantQuotaHoldsAcrossItsModelStrings) {
  // Tenant a's quota is 40 blocks over all its namespaces: a second model string is no fresh 40.
  EXPECT_EQ(As(kAlice, {"quota", daemon_->dir(), "a", "30"}), "held 30 10\n");
  ExpectServingAndConsistent();
}

TEST_F(TrustIntegrationTest, TenantLimitsHold) {
  // Carol may have one session at once: a second one is refused while the first lives.
  absl::StatusOr<Child> first =
      Spawn({"/usr/bin/setpriv", "--reuid=4244", "--regid=4244", "--clear-groups",
             TrustClientBinary(), "hold", daemon_->dir(), "c", "0"});
  ASSERT_TRUE(first.ok());
  ASSERT_EQ(ReadLine(*first, absl::Seconds(10)).value_or("?"), "holding");
  EXPECT_EQ(Attach(kCarol, "c", false), "refused RESOURCE_EXHAUSTED\n");
  kill(first->pid, SIGKILL);
  Wait(&*first);
  ExpectServingAndConsistent();
}

}  // namespace
}  // namespace kvpool::testing
