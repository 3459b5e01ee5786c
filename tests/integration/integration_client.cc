// A client process for the integration tests, driven by its arguments:
//
//   integration_client write <runtime_dir> <tokens> <seed>
//       allocate a prompt of <tokens> tokens, write its KV through the mapping, commit, exit
//       (the session ends; the committed blocks stay cached). Prints "written <checksum>".
//   integration_client read <runtime_dir> <tokens> <seed>
//       allocate the same prompt and read its KV through this process's own mapping. Prints
//       "matched <tokens> checksum <checksum>".
//   integration_client hold <runtime_dir> <sequences> <tokens>
//       allocate <sequences> sequences of <tokens> tokens, print "holding", then wait forever
//       (the test kills it).
//   integration_client decode <runtime_dir> <tokens> <seed>
//       prefill a prompt of <tokens> tokens (in the model's vocabulary) through the daemon's
//       model, then decode one token at a time forever, printing "decoding" after the first (the
//       test kills it). Through the session's decode doorbell; `decode_rpc` does the same over the
//       Decode RPC.
//
// KV of token p is a function of the prompt up to p, so a prefix hit must read back exactly what
// the writer wrote.

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "client/client.h"

namespace {

using kvpool::client::BlockRef;
using kvpool::client::Client;

std::vector<int32_t> Prompt(int64_t n, uint64_t seed) {
  std::vector<int32_t> tokens;
  uint64_t x = seed * 2654435761u + 1;
  for (int64_t i = 0; i < n; ++i) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    tokens.push_back(static_cast<int32_t>(x % 32000));
  }
  return tokens;
}

int Fail(const std::string& what) {
  std::fprintf(stderr, "integration_client: %s\n", what.c_str());
  return 1;
}

// Visits every byte of the prompt's K and V rows (layer, kind, token) through the mapping.
template <typename Fn>
bool ForEachRow(const Client& c, const std::vector<BlockRef>& table, int64_t tokens, Fn&& fn) {
  const auto& l = c.layout();
  for (int64_t p = 0; p < tokens; ++p) {
    const BlockRef block = table[static_cast<size_t>(p / l.block_size())];
    for (int32_t layer = 0; layer < l.num_layers(); ++layer) {
      for (int kind = 0; kind < 2; ++kind) {
        // Each layer and side in its own dtype (layout.proto): 8-bit rows are a byte per value.
        const int64_t row = c.mapping()->row_bytes(layer, kind);
        absl::StatusOr<char*> chunk =
            kind == 0 ? c.mapping()->K(layer, block) : c.mapping()->V(layer, block);
        if (!chunk.ok()) return false;
        fn(*chunk + (p % l.block_size()) * row, row, p, layer, kind);
      }
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) {
    return Fail("usage: integration_client write|read|hold|decode|decode_rpc <dir> <a> <b>");
  }
  const std::string mode = argv[1];
  const std::string dir = argv[2];
  const int64_t a = std::atoll(argv[3]);
  const int64_t b = std::atoll(argv[4]);
  absl::StatusOr<std::unique_ptr<Client>> client =
      Client::Connect({.runtime_dir = dir,
                       .client_name = "integration-" + mode,
                       .kv_access = true,
                       .decode_doorbell = mode != "decode_rpc"});
  if (!client.ok()) return Fail(client.status().ToString());
  const Client& c = **client;

  if (mode == "hold") {
    for (int64_t i = 0; i < a; ++i) {
      const std::vector<int32_t> prompt = Prompt(b, 1000 + static_cast<uint64_t>(i));
      if (absl::StatusOr<kvpool::v1::SequenceInfo> s = c.Allocate(prompt); !s.ok()) {
        return Fail(s.status().ToString());
      }
    }
    std::printf("holding\n");
    std::fflush(stdout);
    for (;;) pause();
  }

  if (mode == "decode" || mode == "decode_rpc") {
    std::vector<int32_t> prompt = Prompt(a, static_cast<uint64_t>(b));
    for (int32_t& t : prompt) t %= 4096;  // inside any model's vocabulary here
    absl::StatusOr<kvpool::v1::PrefillResponse> first = c.Prefill(0, prompt);
    if (!first.ok()) return Fail(first.status().ToString());
    kvpool::client::DecodeItem item{first->sequence_id(), first->next_token()};
    for (int64_t step = 0;; ++step) {
      absl::StatusOr<kvpool::v1::DecodeResponse> next = c.Decode(std::span(&item, 1));
      if (!next.ok()) return Fail(next.status().ToString());
      item.token = next->next_tokens(0);
      if (step == 0) {
        std::printf("decoding\n");
        std::fflush(stdout);
      }
    }
  }

  const std::vector<int32_t> prompt = Prompt(a, static_cast<uint64_t>(b));
  absl::StatusOr<kvpool::v1::SequenceInfo> seq = c.Allocate(prompt);
  if (!seq.ok()) return Fail(seq.status().ToString());
  const std::vector<BlockRef> table = kvpool::client::ToBlockRefs(*seq);
  uint64_t checksum = 1469598103934665603ull;
  auto mix = [&](const char* row, int64_t bytes) {
    for (int64_t i = 0; i < bytes; ++i)
      checksum = (checksum ^ static_cast<uint8_t>(row[i])) * 1099511628211ull;
  };
  if (mode == "write") {
    uint64_t h = static_cast<uint64_t>(b);
    std::vector<uint64_t> kv;
    for (int32_t t : prompt) kv.push_back(h = h * 31 + static_cast<uint64_t>(t));
    const bool ok =
        ForEachRow(c, table, a, [&](char* row, int64_t bytes, int64_t p, int32_t layer, int kind) {
          for (int64_t i = 0; i < bytes; ++i) {
            row[i] = static_cast<char>((kv[p] >> ((i + layer + kind) % 56)) & 0xFF);
          }
          mix(row, bytes);
        });
    if (!ok) return Fail("write through the mapping failed");
    if (absl::Status s = c.Commit(seq->sequence_id(), a); !s.ok()) return Fail(s.ToString());
    std::printf("written %llu\n", static_cast<unsigned long long>(checksum));
    return 0;
  }
  if (mode == "read") {
    const bool ok =
        ForEachRow(c, table, seq->matched_tokens(),
                   [&](char* row, int64_t bytes, int64_t, int32_t, int) { mix(row, bytes); });
    if (!ok) return Fail("read through the mapping failed");
    std::printf("matched %lld checksum %llu\n", static_cast<long long>(seq->matched_tokens()),
                static_cast<unsigned long long>(checksum));
    return 0;
  }
  return Fail("unknown mode " + mode);
}
