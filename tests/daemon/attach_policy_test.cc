// AttachPolicy: who may attach and what their session is, without sockets.

#include "daemon/edge/attach_policy.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvpool::daemon {
namespace {

const AttachPolicy kPolicy({.allowed_uids = {1000, 1001},
                            .allowed_gids = {50},
                            .admin_uids = {1001},
                            .protocol_version = 1});
constexpr PeerCredentials kUser{.pid = 10, .uid = 1000, .gid = 1000};
constexpr PeerCredentials kAdmin{.pid = 11, .uid = 1001, .gid = 1001};
constexpr PeerCredentials kGroupMember{.pid = 12, .uid = 2000, .gid = 50};
constexpr PeerCredentials kStranger{.pid = 13, .uid = 3000, .gid = 3000};

AttachClaims Claims(std::string tenant = "acme", std::string model = "llama") {
  return {.protocol_version = 1, .client_name = "frontend", .tenant = tenant, .model = model};
}

TEST(AttachPolicyTest, AllowedPeersGetTheSessionTheyClaim) {
  absl::StatusOr<SessionSpec> s = kPolicy.Decide(kUser, Claims(), /*draining=*/false);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->tenant, "acme");
  EXPECT_EQ(s->model, "llama");
  EXPECT_EQ(s->client_name, "frontend");
  EXPECT_EQ(s->pid, 10);
  EXPECT_EQ(s->uid, 1000u);
  EXPECT_FALSE(s->admin);
  EXPECT_TRUE(kPolicy.Decide(kGroupMember, Claims(), false).ok());  // by gid
  EXPECT_TRUE(kPolicy.Decide(kAdmin, Claims(), false)->admin);
}

TEST(AttachPolicyTest, EmptyTenantAndModelAreTheDefaults) {
  absl::StatusOr<SessionSpec> s = kPolicy.Decide(kUser, Claims("", ""), false);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->tenant, "default");
  EXPECT_EQ(s->model, "default");
}

TEST(AttachPolicyTest, StrangersAreRefusedBeforeAnythingElse) {
  AttachClaims bad = Claims();
  bad.protocol_version = 99;
  EXPECT_EQ(kPolicy.Decide(kStranger, bad, true).status().code(),
            absl::StatusCode::kPermissionDenied);
}

TEST(AttachPolicyTest, ProtocolAndNamesAreChecked) {
  AttachClaims old = Claims();
  old.protocol_version = 0;
  EXPECT_EQ(kPolicy.Decide(kUser, old, false).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(kPolicy.Decide(kUser, Claims(std::string(200, 'a')), false).status().code(),
            absl::StatusCode::kInvalidArgument);
  const absl::Status control = kPolicy.Decide(kUser, Claims("a\nb"), false).status();
  EXPECT_EQ(control.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(control.message()), ::testing::HasSubstr("tenant"));
  EXPECT_EQ(kPolicy.Decide(kUser, Claims("acme", std::string("m\0x", 3)), false).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Issue 10: while draining, kvpoolctl could not attach to watch the drain.
TEST(AttachPolicyTest, WhileDrainingOnlyAdminsAttach) {
  EXPECT_EQ(kPolicy.Decide(kUser, Claims(), /*draining=*/true).status().code(),
            absl::StatusCode::kUnavailable);
  absl::StatusOr<SessionSpec> admin = kPolicy.Decide(kAdmin, Claims(), /*draining=*/true);
  ASSERT_TRUE(admin.ok()) << admin.status();
  EXPECT_TRUE(admin->admin);
}

}  // namespace
}  // namespace kvpool::daemon
