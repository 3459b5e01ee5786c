#pragma once

// Test harness for real redis-server processes: private temporary directories, Unix sockets or
// loopback ports chosen at run time, killed (SIGKILL) when the owning object goes away, and by
// the kernel if the test process dies first (PR_SET_PDEATHSIG). Used by tests/tier and
// bench/redis_tier_bench.cc. Not thread-safe.

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tier/redis_client.h"

namespace kvpool::tier::testing {

// Full path of redis-server / redis-cli, or "" when not installed (tests then skip).
std::string RedisServerBinary();
std::string RedisCliBinary();

// A fresh directory under $TMPDIR (or /tmp), removed with its contents on destruction.
class TempDir final {
 public:
  static absl::StatusOr<std::unique_ptr<TempDir>> Create(const std::string& prefix);
  ~TempDir();
  const std::string& path() const { return path_; }

 private:
  explicit TempDir(std::string path) : path_(std::move(path)) {}
  std::string path_;
};

// A loopback TCP port that is free now, and whose cluster bus port (port + 10000) is free too.
absl::StatusOr<int> PickFreePort();

class RedisServer final {
 public:
  struct Options {
    bool unix_socket = false;  // listen on <dir>/redis.sock only (no TCP)
    bool cluster = false;      // --cluster-enabled yes (TCP only)
    std::vector<std::string> extra_args;
  };
  // Starts redis-server in `dir` and waits (≤ 10 s) until it answers PING.
  // Errors: INTERNAL when it does not come up (its log is in <dir>/redis.log).
  static absl::StatusOr<std::unique_ptr<RedisServer>> Start(const std::string& dir,
                                                            const Options& options);
  ~RedisServer();  // SIGKILL

  void Kill();             // SIGKILL and reap; the data is gone (no persistence)
  void Pause();            // SIGSTOP: connections hang instead of failing
  void Resume();           // SIGCONT
  absl::Status Restart();  // Kill if running, then start again on the same socket / port

  // Sends one command on a fresh connection; error replies become statuses.
  absl::StatusOr<RedisReply> Command(const std::vector<std::string>& args) const;
  // Options a RedisTierOptions needs to reach this server (standalone).
  RedisTierOptions TierOptions() const;

  int port() const { return port_; }
  const std::string& socket_path() const { return socket_path_; }
  std::string address() const;  // "127.0.0.1:<port>" (TCP servers)
  const std::string& dir() const { return dir_; }

 private:
  RedisServer(std::string dir, Options options, int port)
      : dir_(std::move(dir)), options_(std::move(options)), port_(port) {}
  absl::Status Launch();

  std::string dir_;
  Options options_;
  int port_ = 0;
  std::string socket_path_;
  pid_t pid_ = -1;
};

// Runs `argv` to completion (stdin /dev/null). Returns its stdout+stderr; INTERNAL when it
// exits non-zero (the output in the message).
absl::StatusOr<std::string> RunProgram(const std::vector<std::string>& argv);

// Three (or `n`) cluster nodes in `dir`/node<i>, joined with `redis-cli --cluster create
// --cluster-replicas 0`, waited on until every node reports cluster_state:ok.
struct RedisCluster {
  std::vector<std::unique_ptr<RedisServer>> nodes;
  std::vector<std::string> Seeds() const;
};
absl::StatusOr<RedisCluster> StartRedisCluster(const std::string& dir, int n = 3);
// Waits (≤ 10 s) until every node answers CLUSTER INFO with cluster_state:ok.
absl::Status WaitClusterOk(const RedisCluster& cluster);

}  // namespace kvpool::tier::testing
