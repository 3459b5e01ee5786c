// The daemon's pieces that need no sockets: configuration, and DaemonPool on a real CPU device.

#include <sys/mman.h>
#include <unistd.h>

#include <fstream>

#include "daemon/config.h"
#include "daemon/pool.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu_device.h"

namespace kvpool::daemon {
namespace {

using ::testing::HasSubstr;

TEST(ConfigTest, EmbeddedDefaultsNeedNoFile) {
  const absl::StatusOr<v1::DaemonConfig> c = LoadConfig("");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->backend(), "cpu");
  EXPECT_EQ(c->pool_bytes(), 256ll << 20);
  EXPECT_EQ(c->shape().dtype(), "bf16");
  EXPECT_THAT(c->allowed_uids(), ::testing::ElementsAre(getuid()));
  EXPECT_FALSE(c->runtime_dir().empty());
  EXPECT_EQ(c->socket_mode(), 0660u);
}

TEST(ConfigTest, EveryProblemIsOneLineNamingTheField) {
  const std::string path = ::testing::TempDir() + "/bad.textproto";
  std::ofstream(path)
      << "pool_bytes: -1\nbackend: \"tpu\"\ntrace_depth: 3\nshape { head_dim: 12 }\n";
  const absl::StatusOr<v1::DaemonConfig> c = LoadConfig(path);
  ASSERT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  const std::string message(c.status().message());
  EXPECT_EQ(std::count(message.begin(), message.end(), '\n'), 3);  // four lines
  EXPECT_THAT(message, HasSubstr("backend: 'tpu'"));
  EXPECT_THAT(message, HasSubstr("pool_bytes: must be > 0"));
  EXPECT_THAT(message, HasSubstr("trace_depth"));
  EXPECT_THAT(message, HasSubstr("head_dim must be a multiple of 8"));
  std::ofstream(path) << "pool_bytes: 12 12\n";
  EXPECT_THAT(std::string(LoadConfig(path).status().message()), HasSubstr("bad.textproto:1:"));
  EXPECT_EQ(LoadConfig("/nonexistent.textproto").status().code(), absl::StatusCode::kNotFound);
}

class DaemonPoolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    v1::DaemonConfig config = DefaultConfig();
    config.set_pool_bytes(64ll * config.shape().block_size() * 4 * 64 * 2 * 2 * 4);  // 64 blocks
    pool_ = std::move(*DaemonPool::Create(config, &device_, 7));
    alice_ = MakeSession(1, "tenant-a");
    bob_ = MakeSession(2, "tenant-a");
  }

  Session MakeSession(uint64_t id, const std::string& tenant) {
    Session s{.id = SessionId(id), .tenant = tenant, .model = "m"};
    s.ns = pool_->NamespaceOf(tenant, "m");
    return s;
  }

  kernels::CpuDevice device_{1};
  std::unique_ptr<DaemonPool> pool_;
  Session alice_, bob_;
};

TEST_F(DaemonPoolTest, AttachSharesTheArenaAndAGenerationTable) {
  absl::StatusOr<AttachGrant> grant = pool_->Attach(alice_);
  ASSERT_TRUE(grant.ok()) << grant.status();
  EXPECT_EQ(grant->response.layout().num_blocks(), 64);
  ASSERT_EQ(grant->fds.size(), 2u);
  EXPECT_EQ(grant->response.fds(0), v1::FD_ROLE_ARENA);
  EXPECT_EQ(grant->response.fds(1), v1::FD_ROLE_GENERATION_TABLE);
  const auto* generations = static_cast<const uint32_t*>(
      mmap(nullptr, 64 * sizeof(uint32_t), PROT_READ, MAP_SHARED, grant->fds[1], 0));
  ASSERT_NE(generations, MAP_FAILED);
  v1::AllocateRequest request;
  request.add_items()->set_num_tokens(40);
  v1::AllocateResponse response;
  ASSERT_TRUE(pool_->Allocate(alice_, request, &response).ok());
  const v1::SequenceInfo& seq = response.sequences(0);
  ASSERT_EQ(seq.block_ids_size(), 3);
  for (int i = 0; i < 3; ++i) {  // what the client sees equals what the daemon handed out
    EXPECT_EQ(generations[seq.block_ids(i)], seq.generations(i));
    EXPECT_EQ(seq.generations(i), 1u);
  }
  for (int fd : grant->fds) close(fd);
  EXPECT_TRUE(pool_->CheckInvariants().ok());
}

TEST_F(DaemonPoolTest, GrowReturnsOnlyTheChangedTail) {
  v1::AllocateRequest a;
  a.add_items()->set_num_tokens(20);
  v1::AllocateResponse allocated;
  ASSERT_TRUE(pool_->Allocate(alice_, a, &allocated).ok());
  const uint64_t id = allocated.sequences(0).sequence_id();
  v1::GrowRequest g;
  g.add_sequence_ids(id);
  g.add_num_tokens(70);
  v1::GrowResponse grown;
  ASSERT_TRUE(pool_->Grow(alice_, g, &grown).ok());
  EXPECT_EQ(grown.table_offsets(0), 2);
  EXPECT_EQ(grown.tail_lengths(0), 3);  // blocks 2, 3, 4
  EXPECT_EQ(grown.block_ids_size(), 3);
  EXPECT_EQ(grown.num_tokens(0), 70);
  g.add_num_tokens(1);  // parallel arrays of different lengths
  EXPECT_EQ(pool_->Grow(alice_, g, &grown).code(), absl::StatusCode::kInvalidArgument);
  g.mutable_num_tokens()->RemoveLast();
  // Another session may not grow it, and nothing changes.
  v1::GrowResponse denied;
  EXPECT_EQ(pool_->Grow(bob_, g, &denied).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(pool_->CheckInvariants().ok());
}

TEST_F(DaemonPoolTest, FreeIsAllOrNothingAndSessionReleaseTakesEverything) {
  v1::AllocateRequest a;
  a.add_items()->set_num_tokens(16);
  a.add_items()->set_num_tokens(16);
  v1::AllocateResponse r;
  ASSERT_TRUE(pool_->Allocate(alice_, a, &r).ok());
  v1::FreeRequest f;
  f.add_sequence_ids(r.sequences(0).sequence_id());
  f.add_sequence_ids(12345);
  EXPECT_EQ(pool_->Free(alice_, f).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(pool_->Usage(alice_.id).first, 2);  // neither was freed
  EXPECT_EQ(pool_->ReleaseSession(alice_.id), 2);
  v1::GetStatsResponse stats;
  pool_->Stats(&stats);
  EXPECT_EQ(stats.free_blocks() + stats.cached_blocks(), stats.num_blocks());
  EXPECT_EQ(stats.sessions_reclaimed(), 1u);
  EXPECT_TRUE(pool_->CheckInvariants().ok());
}

TEST_F(DaemonPoolTest, DrainRefusesNewSequences) {
  EXPECT_EQ(pool_->Drain(), 0);
  v1::AllocateRequest a;
  a.add_items()->set_num_tokens(1);
  v1::AllocateResponse r;
  EXPECT_EQ(pool_->Allocate(alice_, a, &r).code(), absl::StatusCode::kUnavailable);
}

TEST_F(DaemonPoolTest, NamespacesSeparateTenantsModelsAndLayouts) {
  EXPECT_EQ(pool_->NamespaceOf("a", "m"), pool_->NamespaceOf("a", "m"));
  EXPECT_NE(pool_->NamespaceOf("a", "m"), pool_->NamespaceOf("b", "m"));
  EXPECT_NE(pool_->NamespaceOf("a", "m"), pool_->NamespaceOf("a", "n"));
  EXPECT_NE(pool_->NamespaceOf("ab", "c"), pool_->NamespaceOf("a", "bc"));
}

}  // namespace
}  // namespace kvpool::daemon
