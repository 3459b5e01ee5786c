#include "client/status.h"

#include <map>

#include "gtest/gtest.h"

namespace kvpool::client {
namespace {

using Metadata = std::multimap<grpc::string_ref, grpc::string_ref>;

TEST(StatusTest, OkStaysOk) { EXPECT_TRUE(FromGrpcStatus(grpc::Status::OK).ok()); }

TEST(StatusTest, KeepsEveryCanonicalCodeAndTheMessage) {
  for (int code = 1; code <= 16; ++code) {
    const absl::Status s =
        FromGrpcStatus(grpc::Status(static_cast<grpc::StatusCode>(code), "what went wrong"));
    EXPECT_EQ(static_cast<int>(s.code()), code);
    EXPECT_EQ(s.message(), "what went wrong");
  }
}

TEST(StatusTest, UnknownCodesBecomeUnknown) {
  const absl::Status s = FromGrpcStatus(grpc::Status(static_cast<grpc::StatusCode>(20), "odd"));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnknown);
  EXPECT_EQ(s.message(), "odd");
}

TEST(StatusTest, KeepsTheShortfallOfResourceExhausted) {
  const std::string key = "kvpool-shortfall";
  const std::string value = "session quota:12";
  Metadata trailing = {{grpc::string_ref(key), grpc::string_ref(value)}};
  const absl::Status s = FromGrpcStatus(
      grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "Allocate: session quota short by 12"),
      trailing);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(s.message(), "Allocate: session quota short by 12");
  const std::optional<Shortfall> shortfall = GetShortfall(s);
  ASSERT_TRUE(shortfall.has_value());
  EXPECT_EQ(shortfall->resource, "session quota");
  EXPECT_EQ(shortfall->blocks, 12);
}

TEST(StatusTest, NoShortfallOnOtherCodesOrWithoutMetadata) {
  const std::string key = "kvpool-shortfall";
  const std::string value = "pool:3";
  Metadata trailing = {{grpc::string_ref(key), grpc::string_ref(value)}};
  EXPECT_FALSE(
      GetShortfall(FromGrpcStatus(grpc::Status(grpc::StatusCode::NOT_FOUND, "x"), trailing))
          .has_value());
  EXPECT_FALSE(GetShortfall(FromGrpcStatus(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "x")))
                   .has_value());
}

TEST(StatusTest, MalformedShortfallIsIgnored) {
  for (const char* bad : {"pool", "pool:", ":3", "pool:3x", "pool:x"}) {
    absl::Status s = absl::ResourceExhaustedError("x");
    s.SetPayload(kShortfallPayloadUrl, absl::Cord(bad));
    EXPECT_FALSE(GetShortfall(s).has_value()) << bad;
  }
}

}  // namespace
}  // namespace kvpool::client
