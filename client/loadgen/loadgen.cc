#include "client/loadgen/loadgen.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <type_traits>
#include <vector>

#include "client/client.h"
#include "client/loadgen/internal/model_worker.h"
#include "client/loadgen/internal/record.h"
#include "fmt/format.h"
#include "kvpool/v1/wire.h"
#include "workload/generated.h"

namespace kvpool::loadgen {
namespace {

using Clock = std::chrono::steady_clock;

using internal::kOpNames;
using internal::Op;
using internal::Record;

// The KV a token would have: a function of the namespace and every token up to it (causal
// attention), spread over the row so a misplaced or stale row shows up.
uint64_t Mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
  return h * 0xff51afd7ed558ccdULL;
}

// One worker process: a frontend serving its share of the requests.
class Worker {
 public:
  Worker(const Options& options, int fd) : options_(options), fd_(fd) {}

  void Serve(const workload::Request& request) {
    absl::StatusOr<client::Client*> c = ClientFor(request.tenant);
    if (!c.ok()) return Error(fmt::format("connect: {}", c.status().ToString()));
    client::Client& client = **c;
    const v1::PoolLayout& l = client.layout();
    // Trace prompts are cut to what the pool can hold for every worker at once (every worker
    // derives the same cut from the same layout, so prefixes still line up).
    workload::Request r = request;
    const int64_t cut = options_.max_prompt_tokens > 0
                            ? options_.max_prompt_tokens
                            : static_cast<int64_t>(l.num_blocks()) * l.block_size() / 4 /
                                  std::max(1, options_.workers);
    if (!options_.trace.empty() && static_cast<int64_t>(r.prompt.size()) > cut) {
      r.prompt.resize(static_cast<size_t>(cut));
    }

    // Allocate the prompt with prefix match.
    absl::StatusOr<v1::SequenceInfo> info = Timed(Op::kAllocate, [&] {
      return client.Allocate(r.prompt, static_cast<int64_t>(r.prompt.size()));
    });
    if (!info.ok()) {
      if (absl::IsResourceExhausted(info.status()))
        return Send({Record::Kind::kRequest, Op::kAllocate, true});
      return Error(fmt::format("allocate: {}", info.status().ToString()));
    }
    const uint64_t seq = info->sequence_id();
    std::vector<client::BlockRef> table = client::ToBlockRefs(*info);
    const int64_t matched = info->matched_tokens();
    std::vector<int32_t> tokens(r.prompt);
    std::vector<uint64_t> kv(tokens.size());
    uint64_t h = Mix(0, static_cast<uint64_t>(r.tenant));
    for (size_t p = 0; p < tokens.size(); ++p) kv[p] = h = Mix(h, static_cast<uint64_t>(tokens[p]));

    // Reused KV must be byte-identical to what computing it would give; compute the rest.
    int64_t mismatches = 0;
    for (int64_t p = 0; p < static_cast<int64_t>(tokens.size()); ++p) {
      if (p < matched) {
        mismatches += !Check(client, table, p, kv[p]);
      } else if (!Write(client, table, p, kv[p])) {
        return Abandon(client, seq, "write through the mapping failed");
      }
    }
    absl::Status s = Timed(Op::kCommit, [&] { return client.Commit(seq, tokens.size()); });
    if (!s.ok()) return Abandon(client, seq, fmt::format("commit: {}", s.ToString()));

    // Decode the reply: grow by one token, write its KV.
    int64_t decoded = 0;
    for (int32_t t : r.reply) {
      absl::StatusOr<v1::SequenceInfo> tail = Timed(
          Op::kGrow, [&] { return client.Grow(seq, static_cast<int64_t>(tokens.size()) + 1); });
      if (!tail.ok()) {
        if (absl::IsResourceExhausted(tail.status())) break;  // the pool is full: stop here
        return Abandon(client, seq, fmt::format("grow: {}", tail.status().ToString()));
      }
      if (absl::Status a = client::ApplyGrow(*tail, &table); !a.ok()) {
        return Abandon(client, seq, a.ToString());
      }
      tokens.push_back(t);
      kv.push_back(h = Mix(h, static_cast<uint64_t>(t)));
      if (!Write(client, table, static_cast<int64_t>(tokens.size()) - 1, kv.back())) {
        return Abandon(client, seq, "write through the mapping failed");
      }
      ++decoded;
    }
    // Publish the reply too (the next turn's prompt starts with it), then free.
    const std::span<const int32_t> reply(tokens.data() + r.prompt.size(),
                                         static_cast<size_t>(decoded));
    s = Timed(Op::kCommit, [&] { return client.Commit(seq, tokens.size(), reply); });
    if (!s.ok()) return Abandon(client, seq, fmt::format("commit: {}", s.ToString()));
    s = Timed(Op::kFree, [&] { return client.Free({seq}); });
    if (!s.ok()) return Error(fmt::format("free: {}", s.ToString()));
    Send({.kind = Record::Kind::kRequest,
          .a = static_cast<int64_t>(r.prompt.size()),
          .b = matched,
          .c = decoded,
          .d = mismatches});
  }

 private:
  absl::StatusOr<client::Client*> ClientFor(int32_t tenant) {
    std::unique_ptr<client::Client>& c = clients_[tenant];
    if (c == nullptr) {
      absl::StatusOr<std::unique_ptr<client::Client>> made =
          client::Client::Connect({.runtime_dir = options_.runtime_dir,
                                   .client_name = fmt::format("loadgen-{}", getpid()),
                                   .tenant = fmt::format("tenant-{}", tenant),
                                   .model = "loadgen",
                                   .kv_access = true});  // KV mode writes through the mapping
      if (!made.ok()) return made.status();
      c = *std::move(made);
    }
    return c.get();
  }

  template <typename Fn>
  std::invoke_result_t<Fn> Timed(Op op, Fn&& fn) {
    const auto start = Clock::now();
    auto result = fn();
    Send({.kind = Record::Kind::kLatency,
          .op = op,
          .a = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count()});
    return result;
  }

  // The row of token p, layer l, K (kv 0) or V (kv 1).
  char* Row(const client::Client& c, const std::vector<client::BlockRef>& table, int64_t p,
            int32_t layer, int kv) {
    const int32_t bs = c.layout().block_size();
    const client::BlockRef block = table[static_cast<size_t>(p / bs)];
    absl::StatusOr<char*> chunk =
        kv == 0 ? c.mapping()->K(layer, block) : c.mapping()->V(layer, block);
    return chunk.ok() ? *chunk + (p % bs) * c.mapping()->row_bytes(layer, kv) : nullptr;
  }

  bool Write(const client::Client& c, const std::vector<client::BlockRef>& table, int64_t p,
             uint64_t value) {
    for (int32_t layer = 0; layer < c.layout().num_layers(); ++layer) {
      for (int kv = 0; kv < 2; ++kv) {
        char* row = Row(c, table, p, layer, kv);
        if (row == nullptr) return false;
        const uint64_t word = value ^ (static_cast<uint64_t>(layer) << 1 | kv);
        const int64_t bytes = c.mapping()->row_bytes(layer, kv);  // per layer and side (dtypes)
        for (int64_t b = 0; b + 8 <= bytes; b += 8) std::memcpy(row + b, &word, 8);
      }
    }
    return true;
  }

  bool Check(const client::Client& c, const std::vector<client::BlockRef>& table, int64_t p,
             uint64_t value) {
    for (int32_t layer = 0; layer < c.layout().num_layers(); ++layer) {
      for (int kv = 0; kv < 2; ++kv) {
        const char* row = Row(c, table, p, layer, kv);
        if (row == nullptr) return false;
        const uint64_t word = value ^ (static_cast<uint64_t>(layer) << 1 | kv);
        const int64_t bytes = c.mapping()->row_bytes(layer, kv);
        for (int64_t b = 0; b + 8 <= bytes; b += 8) {
          if (std::memcmp(row + b, &word, 8) != 0) return false;
        }
      }
    }
    return true;
  }

  void Abandon(client::Client& c, uint64_t seq, const std::string& why) {
    (void)c.Free({seq});
    Error(why);
  }
  void Error(const std::string& why) {
    std::fprintf(stderr, "\n[loadgen worker %d] %s\n", getpid(), why.c_str());
    Send({.kind = Record::Kind::kError});
  }
  void Send(const Record& r) { (void)write(fd_, &r, sizeof(r)); }

  const Options& options_;
  const int fd_;
  std::map<int32_t, std::unique_ptr<client::Client>> clients_;
};

double Percentile(std::vector<int64_t>* v, double q) {
  if (v->empty()) return 0;
  const size_t k = std::min(v->size() - 1, static_cast<size_t>(q * static_cast<double>(v->size())));
  std::nth_element(v->begin(), v->begin() + static_cast<ptrdiff_t>(k), v->end());
  return static_cast<double>((*v)[k]) / 1e3;  // microseconds
}

// The requests of the run: generated conversations, or a Mooncake trace; at most max_requests.
// Errors: ReadMooncakeTrace's.
absl::StatusOr<std::vector<workload::Request>> LoadRequests(const Options& options) {
  std::vector<workload::Request> requests;
  if (options.trace.empty()) {
    requests = workload::GenerateConversations({.seed = options.seed,
                                                .tenants = options.tenants,
                                                .conversations = options.conversations,
                                                .turns = options.turns});
  } else {
    absl::StatusOr<std::vector<workload::TraceRequest>> trace =
        workload::ReadMooncakeTrace(options.trace);
    if (!trace.ok()) return trace.status();
    requests = workload::FromTrace(*trace, /*max_prompt_tokens=*/0, options.max_reply_tokens);
  }
  if (options.max_requests > 0 && static_cast<int64_t>(requests.size()) > options.max_requests) {
    requests.resize(static_cast<size_t>(options.max_requests));
  }
  return requests;
}

// One worker process as the parent sees it: its pid and the read end of its record pipe.
struct Child {
  pid_t pid = -1;
  int fd = -1;
};

// The body of worker `w` (in the child): conversation c is served by worker c % workers, so a
// conversation's turns stay in order. Never returns.
[[noreturn]] void RunWorker(const Options& options, const std::vector<workload::Request>& requests,
                            int32_t w, int fd) {
  if (options.mode == Mode::kModel) {
    internal::ModelWorker worker(options, fd);
    for (const workload::Request& r : requests) {
      if (r.conversation % options.workers == w) worker.Serve(r);
    }
  } else {
    Worker worker(options, fd);
    for (const workload::Request& r : requests) {
      if (r.conversation % options.workers == w) worker.Serve(r);
    }
  }  // detach every session before exiting
  _exit(0);
}

// Forks options.workers workers. Errors: INTERNAL when a pipe or fork fails.
absl::StatusOr<std::vector<Child>> ForkWorkers(const Options& options,
                                               const std::vector<workload::Request>& requests) {
  std::vector<Child> children;
  for (int32_t w = 0; w < options.workers; ++w) {
    int fds[2];
    if (pipe2(fds, O_CLOEXEC) != 0) return absl::InternalError("pipe failed");
    const pid_t pid = fork();
    if (pid < 0) return absl::InternalError("fork failed");
    if (pid == 0) {
      close(fds[0]);
      RunWorker(options, requests, w, fds[1]);
    }
    close(fds[1]);
    children.push_back({.pid = pid, .fd = fds[0]});
  }
  return children;
}

// What the workers reported, summed as it arrives.
struct Tally {
  Summary summary;
  std::vector<int64_t> latencies[static_cast<int>(Op::kCount)];  // nanoseconds, per op

  void Add(const Record& r) {
    switch (r.kind) {
      case Record::Kind::kRequest:
        if (r.rejected) {
          ++summary.rejected;
          break;
        }
        ++summary.completed;
        summary.prompt_tokens += r.a;
        summary.hit_tokens += r.b;
        summary.decoded_tokens += r.c;
        summary.kv_mismatches += r.d;
        break;
      case Record::Kind::kLatency:
        latencies[static_cast<int>(r.op)].push_back(r.a);
        break;
      case Record::Kind::kError:
        ++summary.errors;
        break;
    }
  }
  size_t tokens() const {
    return latencies[static_cast<int>(Op::kDecode)].size() +
           latencies[static_cast<int>(Op::kPrefill)].size();
  }
};

void PrintProgress(const Tally& t, double elapsed) {
  const Summary& s = t.summary;
  std::fprintf(stderr,
               "\r[kvpool-loadgen] %lld/%lld requests  %.0f tokens/s  prefix hit %.1f%%  "
               "errors %lld ",
               static_cast<long long>(s.completed + s.rejected), static_cast<long long>(s.requests),
               static_cast<double>(t.tokens()) / std::max(elapsed, 1e-9),
               s.prompt_tokens ? 100.0 * s.hit_tokens / s.prompt_tokens : 0.0,
               static_cast<long long>(s.errors));
}

// Reads every worker's records until each has closed its pipe, showing progress on a terminal.
void Collect(const std::vector<Child>& children, bool tty, Clock::time_point start, Tally* tally) {
  auto last_print = Clock::now();
  std::vector<pollfd> open;
  for (const Child& c : children) open.push_back({c.fd, POLLIN, 0});
  while (!open.empty()) {
    if (poll(open.data(), open.size(), 200) < 0 && errno != EINTR) break;
    for (size_t i = 0; i < open.size();) {
      Record r;
      if (open[i].revents == 0) {
        ++i;
        continue;
      }
      const ssize_t n = read(open[i].fd, &r, sizeof(r));
      if (n != static_cast<ssize_t>(sizeof(r))) {  // the worker is done
        close(open[i].fd);
        open.erase(open.begin() + static_cast<ptrdiff_t>(i));
        continue;
      }
      tally->Add(r);
    }
    if (tty && Clock::now() - last_print > std::chrono::milliseconds(200)) {
      last_print = Clock::now();
      PrintProgress(*tally, std::chrono::duration<double>(Clock::now() - start).count());
    }
  }
}

// Waits for every worker; true when one did not exit 0.
bool Reap(const std::vector<Child>& children) {
  bool crashed = false;
  for (const Child& c : children) {
    int status = 0;
    waitpid(c.pid, &status, 0);
    crashed |= !WIFEXITED(status) || WEXITSTATUS(status) != 0;
  }
  return crashed;
}

// The daemon's view at the end, as report lines: every worker has detached, so nothing should be
// active. A violated invariant counts as an error.
struct DaemonView {
  std::string pool = "pool: (stats unavailable)";
  std::string check = "invariants: (not checked)";
  std::string model;  // empty unless the daemon's model ran
};

DaemonView AskDaemon(const Options& options, const std::string& runtime_dir, Summary* summary) {
  DaemonView view;
  absl::StatusOr<std::unique_ptr<client::Client>> admin =
      client::Client::Connect({.runtime_dir = runtime_dir, .client_name = "loadgen"});
  if (!admin.ok()) return view;
  if (absl::StatusOr<v1::GetStatsResponse> s = (*admin)->GetStats(); s.ok()) {
    view.pool = fmt::format(
        "blocks in use: {} active, {} cached, {} free, {} retiring of {} ({} cow copies, {} "
        "evictions)",
        s->active_blocks(), s->cached_blocks(), s->free_blocks(), s->retiring_blocks(),
        s->num_blocks(), s->cow_copies(), s->evictions());
    if (options.mode == Mode::kModel && s->model_steps() > 0) {
      view.model = fmt::format(
          "daemon model {}: {} steps, {:.2f} sequences per step, busy {:.1f} s", s->model(),
          s->model_steps(), static_cast<double>(s->model_step_sequences()) / s->model_steps(),
          s->model_busy_us() / 1e6);
    }
  }
  if (absl::StatusOr<v1::CheckInvariantsResponse> c = (*admin)->CheckInvariants(); c.ok()) {
    view.check = c->ok() ? "invariants: ok" : "invariants: VIOLATED: " + c->violation();
    if (!c->ok()) ++summary->errors;
  }
  return view;
}

// The model mode's figures: tokens per second, time to first token, inter-token latency.
void ReportModel(Tally* t, std::string* out) {
  Summary& s = t->summary;
  std::vector<int64_t>& ttft = t->latencies[static_cast<int>(Op::kPrefill)];
  std::vector<int64_t>& itl = t->latencies[static_cast<int>(Op::kDecode)];
  s.tokens_per_second = s.decoded_tokens / std::max(s.seconds, 1e-9);
  s.ttft_p50_ms = Percentile(&ttft, 0.50) / 1e3;
  s.ttft_p99_ms = Percentile(&ttft, 0.99) / 1e3;
  s.itl_p50_ms = Percentile(&itl, 0.50) / 1e3;
  s.itl_p99_ms = Percentile(&itl, 0.99) / 1e3;
  *out += fmt::format("generated tokens: {} ({:.1f} tokens/s over all workers)\n", s.decoded_tokens,
                      s.tokens_per_second);
  *out += fmt::format("time to first token: p50 {:.1f} ms  p99 {:.1f} ms ({} prefills)\n",
                      s.ttft_p50_ms, s.ttft_p99_ms, ttft.size());
  *out += fmt::format("inter-token latency: p50 {:.1f} ms  p99 {:.1f} ms ({} decodes)\n",
                      s.itl_p50_ms, s.itl_p99_ms, itl.size());
}

// Fills summary.report (and the model mode's figures) from the tally and the daemon's view.
void Report(const Options& options, const DaemonView& daemon, Tally* t) {
  Summary& s = t->summary;
  std::string& out = s.report;
  out += fmt::format("kvpool-loadgen: {} workers, {} requests ({}), {}\n", options.workers,
                     s.requests, options.trace.empty() ? "generated conversations" : options.trace,
                     options.mode == Mode::kModel ? "tokens from the daemon's model"
                                                  : "KV written by the clients");
  out += fmt::format(
      "requests: {} completed, {} rejected (pool full), {} errors in {:.2f} s ({:.1f}/s)\n",
      s.completed, s.rejected, s.errors, s.seconds, s.completed / std::max(s.seconds, 1e-9));
  out += fmt::format("prefix hit rate: {:.4f} ({} of {} prompt tokens reused)\n",
                     s.prompt_tokens ? static_cast<double>(s.hit_tokens) / s.prompt_tokens : 0.0,
                     s.hit_tokens, s.prompt_tokens);
  if (options.mode == Mode::kModel) {
    ReportModel(t, &out);
  } else {
    out += fmt::format("decoded tokens: {}\n", s.decoded_tokens);
    out += fmt::format("kv mismatches: {}\n", s.kv_mismatches);
  }
  for (int op = 0; op < static_cast<int>(Op::kCount); ++op) {
    std::vector<int64_t>& v = t->latencies[op];
    if (v.empty()) continue;
    const size_t calls = v.size();
    const double p50 = Percentile(&v, 0.50);
    const double p99 = Percentile(&v, 0.99);
    out += fmt::format("rpc {:<8} {:>7} calls  p50 {:8.1f} us  p99 {:8.1f} us\n", kOpNames[op],
                       calls, p50, p99);
  }
  if (!daemon.model.empty()) out += daemon.model + "\n";
  out += daemon.pool + "\n" + daemon.check + "\n";
}

}  // namespace

absl::StatusOr<Summary> Run(const Options& options) {
  if (options.workers <= 0) return absl::InvalidArgumentError("--workers must be > 0");
  // The parent must not touch gRPC before forking (its threads do not survive fork()): the
  // workers learn about the pool themselves.
  Options resolved = options;
  if (resolved.runtime_dir.empty()) resolved.runtime_dir = wire::DefaultRuntimeDir();
  if (access((resolved.runtime_dir + "/" + wire::kAttachSocket).c_str(), F_OK) != 0) {
    return absl::UnavailableError(
        fmt::format("no kvpoold in {} (start it first)", resolved.runtime_dir));
  }
  absl::StatusOr<std::vector<workload::Request>> requests = LoadRequests(resolved);
  if (!requests.ok()) return requests.status();

  const auto start = Clock::now();
  absl::StatusOr<std::vector<Child>> children = ForkWorkers(resolved, *requests);
  if (!children.ok()) return children.status();
  Tally tally;
  tally.summary.requests = static_cast<int64_t>(requests->size());
  const bool tty = options.progress && isatty(STDERR_FILENO);
  Collect(*children, tty, start, &tally);
  const bool crashed = Reap(*children);
  if (tty) std::fprintf(stderr, "\n");
  tally.summary.seconds = std::chrono::duration<double>(Clock::now() - start).count();

  const DaemonView daemon = AskDaemon(resolved, resolved.runtime_dir, &tally.summary);
  Report(resolved, daemon, &tally);
  std::fputs(tally.summary.report.c_str(), stdout);
  if (crashed) return absl::InternalError("a worker process crashed");
  return std::move(tally.summary);
}

}  // namespace kvpool::loadgen
