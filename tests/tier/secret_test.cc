// DeploymentSecret (tier/secret.h): its MACs are HMAC-SHA256 over an unambiguous encoding, and a
// secret file that others could read, replace or point elsewhere is refused.

#include "tier/secret.h"

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace kvpool::tier {
namespace {

std::string Hex(const DeploymentSecret::Digest& d) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  for (uint8_t b : d) {
    out.push_back(kDigits[b >> 4]);
    out.push_back(kDigits[b & 15]);
  }
  return out;
}

std::string Bytes0To31() {
  std::string key;
  for (int i = 0; i < 32; ++i) key.push_back(static_cast<char>(i));
  return key;
}

// Expected values from Python's hmac module over the same encoding (u64 LE length, then bytes,
// for the domain and each part).
TEST(DeploymentSecretTest, MacIsHmacSha256OfTheLengthPrefixedParts) {
  const DeploymentSecret secret = DeploymentSecret::FromBytes(Bytes0To31());
  EXPECT_EQ(Hex(secret.Mac("kvpool test", {"tenant", "model"})),
            "34328ca3958396f07444b7c8619e19a134eeecceba5ef5f7273002fe4c2fdcad");
  EXPECT_EQ(Hex(secret.Mac("kvpool secret fingerprint", {})),
            "cf91fe61ee09b403b74cfd08285ed1e239f92e3c1c8bb3fee8be92474a6e5c7b");
}

TEST(DeploymentSecretTest, MovingABoundaryBetweenPartsChangesTheMac) {
  const DeploymentSecret secret = DeploymentSecret::FromBytes(Bytes0To31());
  EXPECT_EQ(Hex(secret.Mac("kvpool test", {"tenantm", "odel"})),
            "092c7c612fe04ef21d8598f9e5c712778252f158f23ce256cf3b9d6640c4d982");
  EXPECT_NE(secret.Mac("kvpool test", {"tenant", "model"}),
            secret.Mac("kvpool test", {"tenantm", "odel"}));
  EXPECT_NE(secret.Mac("a", {"b"}), secret.Mac("ab", {}));
}

TEST(DeploymentSecretTest, OtherSecretsGiveOtherMacsAndFingerprints) {
  const DeploymentSecret a = DeploymentSecret::Random();
  const DeploymentSecret b = DeploymentSecret::Random();
  EXPECT_TRUE(a.ephemeral());
  EXPECT_NE(a.Mac64("d", {"x"}), b.Mac64("d", {"x"}));
  EXPECT_NE(a.fingerprint(), b.fingerprint());
  EXPECT_EQ(a.fingerprint(), DeploymentSecret(a).fingerprint());
}

TEST(DeploymentSecretTest, CopiesAndMovesMacAlike) {
  const DeploymentSecret original = DeploymentSecret::FromBytes(Bytes0To31());
  const DeploymentSecret::Digest expected = original.Mac("kvpool test", {"tenant", "model"});
  DeploymentSecret copy = original;
  EXPECT_EQ(copy.Mac("kvpool test", {"tenant", "model"}), expected);
  DeploymentSecret moved = std::move(copy);
  EXPECT_EQ(moved.Mac("kvpool test", {"tenant", "model"}), expected);
  DeploymentSecret assigned = DeploymentSecret::Random();
  assigned = moved;
  EXPECT_EQ(assigned.Mac("kvpool test", {"tenant", "model"}), expected);
  EXPECT_EQ(assigned.fingerprint(), original.fingerprint());
  EXPECT_FALSE(assigned.ephemeral());
  copy = std::move(assigned);  // a moved-from secret takes a new value
  EXPECT_EQ(copy.Mac("kvpool test", {"tenant", "model"}), expected);
}

// Every Mac starts from a copy of one keyed context the secret holds: threads that MAC at once
// (the Redis tier's lookups and writer) must each get the right digest.
TEST(DeploymentSecretTest, ConcurrentMacsAreEachRight) {
  const DeploymentSecret secret = DeploymentSecret::FromBytes(Bytes0To31());
  const DeploymentSecret::Digest expected = secret.Mac("kvpool test", {"tenant", "model"});
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 2000; ++i) {
        if (secret.Mac("kvpool test", {"tenant", "model"}) != expected) ++wrong;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(wrong.load(), 0);
}

class SecretFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ =
        std::filesystem::temp_directory_path() / ("kvpool-secret-test-" + std::to_string(getpid()));
    std::filesystem::create_directories(dir_);
    path_ = (dir_ / "secret").string();
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  void Write(const std::string& bytes, mode_t mode) {
    std::ofstream(path_, std::ios::binary | std::ios::trunc) << bytes;
    ASSERT_EQ(chmod(path_.c_str(), mode), 0);
  }

  std::filesystem::path dir_;
  std::string path_;
};

TEST_F(SecretFileTest, AnOwnerOnlyFileIsRead) {
  Write(Bytes0To31(), 0600);
  absl::StatusOr<DeploymentSecret> secret = DeploymentSecret::FromFile(path_);
  ASSERT_TRUE(secret.ok()) << secret.status();
  EXPECT_FALSE(secret->ephemeral());
  EXPECT_EQ(secret->Mac("kvpool test", {"tenant", "model"}),
            DeploymentSecret::FromBytes(Bytes0To31()).Mac("kvpool test", {"tenant", "model"}));
}

TEST_F(SecretFileTest, AMissingFileIsNotFound) {
  EXPECT_TRUE(absl::IsNotFound(DeploymentSecret::FromFile(path_).status()));
}

TEST_F(SecretFileTest, AFileOthersMayReadIsRefused) {
  Write(Bytes0To31(), 0644);
  const absl::Status s = DeploymentSecret::FromFile(path_).status();
  EXPECT_TRUE(absl::IsPermissionDenied(s)) << s;
  EXPECT_NE(s.message().find("chmod 0600"), std::string_view::npos) << s;
}

TEST_F(SecretFileTest, ASymlinkIsRefused) {
  Write(Bytes0To31(), 0600);
  const std::string link = (dir_ / "link").string();
  ASSERT_EQ(symlink(path_.c_str(), link.c_str()), 0);
  EXPECT_TRUE(absl::IsPermissionDenied(DeploymentSecret::FromFile(link).status()));
}

TEST_F(SecretFileTest, AShortFileIsRefused) {
  Write("too short", 0600);
  EXPECT_TRUE(absl::IsInvalidArgument(DeploymentSecret::FromFile(path_).status()));
}

TEST_F(SecretFileTest, AnotherUsersFileIsRefused) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to give the file away";
  Write(Bytes0To31(), 0600);
  ASSERT_EQ(chown(path_.c_str(), 65534, 65534), 0);
  EXPECT_TRUE(absl::IsPermissionDenied(DeploymentSecret::FromFile(path_).status()));
}

}  // namespace
}  // namespace kvpool::tier
