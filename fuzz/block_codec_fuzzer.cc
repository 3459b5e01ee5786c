// Redis tier block values (tier/block_codec.h) from untrusted bytes: whatever a Redis server
// returns must never pass the check unless it is exactly what an encoder holding the secret
// wrote for that key. Two readings of each input: (1) as a raw value, checked against the very
// expectation its own header claims (the most a forged value can aim for): a pass must point
// into the value and be byte for byte the encoding of what it claims; (2) the input as a
// payload, encoded, which must pass, then damaged at one position the input picks (any byte:
// every one is covered by the MAC), which must not.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "fuzz/fuzz_util.h"
#include "tier/block_codec.h"
#include "tier/secret.h"

namespace kvpool::fuzz {
namespace {

using tier::BlockCheck;
using tier::BlockExpectation;
using tier::BlockHeader;
using tier::kBlockHeaderBytes;

const tier::DeploymentSecret& Secret() {
  static const tier::DeploymentSecret* secret = new tier::DeploymentSecret(
      tier::DeploymentSecret::FromBytes("block_codec_fuzzer: the fuzzer's own secret"));
  return *secret;
}
constexpr std::string_view kKey = "kvp2:{0123456789abcdef}:0123456789abcdef0123456789abcdef";

template <typename T>
T Read(std::string_view bytes, size_t offset) {
  T value;
  std::memcpy(&value, bytes.data() + offset, sizeof(T));
  return value;
}

void CheckRaw(std::string_view value) {
  BlockExpectation expect;
  BlockHash parent;
  if (value.size() >= static_cast<size_t>(kBlockHeaderBytes)) {
    expect.layout_fingerprint = Read<uint64_t>(value, 8);
    expect.hash = {.lo = Read<uint64_t>(value, 16), .hi = Read<uint64_t>(value, 24)};
    parent = {.lo = Read<uint64_t>(value, 32), .hi = Read<uint64_t>(value, 40)};
    expect.parent = &parent;
    expect.payload_bytes = static_cast<int64_t>(value.size()) - kBlockHeaderBytes;
  }
  BlockHeader header;
  std::span<const std::byte> payload;
  if (tier::CheckBlockValue(Secret(), kKey, value, expect, &header, &payload) != BlockCheck::kOk) {
    return;
  }
  Require(reinterpret_cast<const char*>(payload.data()) == value.data() + kBlockHeaderBytes,
          "payload outside the value");
  Require(static_cast<int64_t>(payload.size()) == expect.payload_bytes, "payload length");
  tier::ValueNonce nonce;
  std::memcpy(nonce.data(), value.data() + tier::kBlockNonceOffset, nonce.size());
  std::string again;
  tier::EncodeBlockValue(Secret(), kKey, nonce, header, payload, &again);
  Require(again == value, "a value passed that the encoder did not write");
}

void CheckEncodedThenDamaged(const uint8_t* data, size_t size) {
  if (size < 2) return;
  const size_t position = data[0] | (static_cast<size_t>(data[1]) << 8);
  const auto* bytes = reinterpret_cast<const std::byte*>(data + 2);
  const BlockHash hash{.lo = size, .hi = position};
  const BlockHash parent{.lo = ~size, .hi = 7};
  // The nonce comes from the input too: reused across inputs, which the store never does, but
  // harmless for checking what passes.
  tier::ValueNonce nonce{};
  for (size_t i = 0; i < nonce.size() && i + 2 < size; ++i) nonce[i] = data[2 + i];
  std::string value;
  tier::EncodeBlockValue(Secret(), kKey, nonce,
                         {.layout_fingerprint = 42, .hash = hash, .parent = parent, .coverage = 16},
                         std::span(bytes, size - 2), &value);
  const BlockExpectation expect{.layout_fingerprint = 42,
                                .hash = hash,
                                .parent = &parent,
                                .payload_bytes = static_cast<int64_t>(size - 2)};
  BlockHeader header;
  std::span<const std::byte> payload;
  Require(
      tier::CheckBlockValue(Secret(), kKey, value, expect, &header, &payload) == BlockCheck::kOk,
      "an encoded value must pass");
  const size_t at = position % value.size();
  value[at] = static_cast<char>(value[at] ^ 0x01);
  Require(
      tier::CheckBlockValue(Secret(), kKey, value, expect, &header, &payload) != BlockCheck::kOk,
      "a damaged value must not pass");
}

}  // namespace
}  // namespace kvpool::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvpool::fuzz::CheckRaw(std::string_view(reinterpret_cast<const char*>(data), size));
  kvpool::fuzz::CheckEncodedThenDamaged(data, size);
  return 0;
}
