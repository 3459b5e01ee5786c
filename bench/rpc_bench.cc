// kvpoold over its Unix socket, against a real daemon process started for the run.
//
//   build/release/bench/rpc_bench --benchmark_repetitions=3
//
// - Allocate, Free (one sequence) and Grow (1 token x 256 sequences, one batch) beside an empty
//   call (Ping) on the same socket in the same run: what the pool adds to a gRPC round trip.
// - Ping beside the same empty call answered by a minimal synchronous gRPC server
//   (bare_grpc_server, a process of its own, a Unix socket too): what kvpoold adds to gRPC.
// - Allocate, Free and Grow interleaved call by call with Pings (BM_VersusPing), so that both
//   sides of those ratios see the same load. Grow holds the 256 tables and applies each reply to
//   them in place (Client::Grow's held form); BM_GrowHeldVsMessages puts it beside the per-item
//   SequenceInfo form.
// - The same four calls against this build's daemon and a baseline daemon, interleaved call by
//   call (BM_VersusBaseline; the baseline is another build's kvpoold when $KVPOOL_BASELINE_DAEMON
//   names one, else a second daemon of this build): what a change did to each call.
// - A block read through the client's mapping of the pool beside a local memcpy of the same size.
// - Reclaim: from kill -9 of a client holding sequences until the daemon reports its blocks
//   back (the daemon learns of the death from the attach socket closing).
// - The same four calls against a daemon serving /metrics, scraped every 100 ms (ten times a
//   1 s Prometheus), and one without, interleaved (BM_MetricsOnVsOff); and one scrape of
//   /metrics with 1,000 tenants' series (BM_ScrapeTenants/1000).

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "bench/ratio_reporter.h"
#include "benchmark/benchmark.h"
#include "client/client.h"
#include "grpcpp/grpcpp.h"
#include "kvpool/util/check.h"
#include "kvpool/util/mutex_mode.h"
#include "kvpool/v1/kvpool.grpc.pb.h"
#include "tests/integration/harness.h"

namespace kvpool {
namespace {

constexpr char kConfig[] = "pool_bytes: 268435456\nmax_blocks_per_seq: 4096\n";

struct Fixture {
  // `binary`: the kvpoold to start; empty for this build's. `extra_config`: appended to kConfig.
  explicit Fixture(const std::string& binary = "", const std::string& extra_config = "") {
    absl::StatusOr<std::unique_ptr<testing::DaemonProcess>> d =
        testing::DaemonProcess::Start(kConfig + extra_config, "", binary);
    KVPOOL_CHECK_OK(d.status());
    daemon = *std::move(d);
    absl::StatusOr<std::unique_ptr<client::Client>> c = client::Client::Connect(
        {.runtime_dir = daemon->dir(), .client_name = "rpc_bench", .kv_access = true});
    if (!c.ok() && !binary.empty()) {
      std::fprintf(stderr,
                   "rpc_bench: this build's client cannot attach to %s: %s\n(a baseline daemon "
                   "must speak this build's attach protocol)\n",
                   binary.c_str(), c.status().ToString().c_str());
      daemon.reset();  // stopped: exit() leaves a half-built fixture's members alone
      std::exit(2);
    }
    KVPOOL_CHECK_OK(c.status());
    client = *std::move(c);
  }
  std::unique_ptr<testing::DaemonProcess> daemon;
  std::unique_ptr<client::Client> client;
};

std::unique_ptr<Fixture>& Instance() {
  static std::unique_ptr<Fixture> fixture;
  return fixture;
}

Fixture& Get() {
  if (Instance() == nullptr) Instance() = std::make_unique<Fixture>();
  return *Instance();
}

// The daemon BM_VersusBaseline compares this build's with: $KVPOOL_BASELINE_DAEMON (another
// build's kvpoold, e.g. an older main's), else a second daemon of this build.
std::unique_ptr<Fixture>& BaselineInstance() {
  static std::unique_ptr<Fixture> fixture;
  return fixture;
}

Fixture& Baseline() {
  if (BaselineInstance() == nullptr) {
    const char* other = std::getenv("KVPOOL_BASELINE_DAEMON");
    BaselineInstance() = std::make_unique<Fixture>(other == nullptr ? "" : other);
  }
  return *BaselineInstance();
}

// A control call against one daemon: Call() is what is timed; when due(), Prepare() does the
// untimed housekeeping that keeps the next calls within the pool.
class Op {
 public:
  explicit Op(const client::Client* c) : c_(*c) {}
  virtual ~Op() = default;
  virtual bool due() const { return false; }
  virtual void Prepare() {}
  virtual void Call() = 0;

 protected:
  const client::Client& c_;
};

class PingOp final : public Op {
 public:
  using Op::Op;
  void Call() override { KVPOOL_CHECK_OK(c_.Ping()); }
};

// One sequence of one block; freed 256 at a time.
class AllocateOp final : public Op {
 public:
  using Op::Op;
  ~AllocateOp() override {
    if (!made_.empty()) KVPOOL_CHECK_OK(c_.Free(made_));
  }
  bool due() const override { return made_.size() == 256; }
  void Prepare() override {
    KVPOOL_CHECK_OK(c_.Free(made_));
    made_.clear();
  }
  void Call() override {
    absl::StatusOr<v1::SequenceInfo> s = c_.Allocate({}, 16);
    KVPOOL_CHECK_OK(s.status());
    made_.push_back(s->sequence_id());
  }

 private:
  std::vector<uint64_t> made_;
};

// One sequence of one block, allocated 256 at a time.
class FreeOp final : public Op {
 public:
  using Op::Op;
  ~FreeOp() override {
    if (!ready_.empty()) KVPOOL_CHECK_OK(c_.Free(ready_));
  }
  bool due() const override { return ready_.empty(); }
  void Prepare() override {
    std::vector<client::AllocateItem> items(256, client::AllocateItem{.num_tokens = 16});
    absl::StatusOr<std::vector<v1::SequenceInfo>> made = c_.Allocate(items);
    KVPOOL_CHECK_OK(made.status());
    for (const v1::SequenceInfo& s : *made) ready_.push_back(s.sequence_id());
  }
  void Call() override {
    KVPOOL_CHECK_OK(c_.Free({ready_.back()}));
    ready_.pop_back();
  }

 private:
  std::vector<uint64_t> ready_;
};

// One token more for each of 256 sequences, in one batch; rewound every `rewind` tokens. The client
// holds the tables and the reply is applied to them in place, as a decode loop does
// (Client::Grow's held form).
class Grow256Op final : public Op {
 public:
  explicit Grow256Op(const client::Client* c, int64_t rewind = 256) : Op(c), rewind_(rewind) {
    std::vector<client::AllocateItem> items(256, client::AllocateItem{.num_tokens = 1});
    absl::StatusOr<std::vector<v1::SequenceInfo>> made = c_.Allocate(items);
    KVPOOL_CHECK_OK(made.status());
    for (const v1::SequenceInfo& s : *made) held_.push_back(client::ToHeld(s));
    lengths_.resize(held_.size());
  }
  ~Grow256Op() override {
    std::vector<uint64_t> ids;
    for (const client::HeldSequence& h : held_) ids.push_back(h.sequence_id);
    KVPOOL_CHECK_OK(c_.Free(ids));
  }
  bool due() const override { return held_.front().num_tokens == rewind_; }
  void Prepare() override {
    for (client::HeldSequence& h : held_) {
      KVPOOL_CHECK_OK(c_.Truncate(h.sequence_id, 1));
      h.num_tokens = 1;
      h.table.resize(1);
    }
  }
  void Call() override {
    for (size_t i = 0; i < held_.size(); ++i) lengths_[i] = held_[i].num_tokens + 1;
    KVPOOL_CHECK_OK(c_.Grow(std::span(held_), lengths_));
  }

 private:
  int64_t rewind_;
  std::vector<client::HeldSequence> held_;
  std::vector<int64_t> lengths_;
};

// The same grow answered as one SequenceInfo message per item (Client::Grow's item form), tables
// not applied: what the held form saves.
class Grow256MessagesOp final : public Op {
 public:
  Grow256MessagesOp(const client::Client* c, int64_t rewind) : Op(c), rewind_(rewind) {
    std::vector<client::AllocateItem> items(256, client::AllocateItem{.num_tokens = 1});
    absl::StatusOr<std::vector<v1::SequenceInfo>> made = c_.Allocate(items);
    KVPOOL_CHECK_OK(made.status());
    for (const v1::SequenceInfo& s : *made) step_.push_back({s.sequence_id(), 1});
  }
  ~Grow256MessagesOp() override {
    std::vector<uint64_t> ids;
    for (const client::GrowItem& g : step_) ids.push_back(g.sequence_id);
    KVPOOL_CHECK_OK(c_.Free(ids));
  }
  bool due() const override { return length_ == rewind_; }
  void Prepare() override {
    for (const client::GrowItem& g : step_) KVPOOL_CHECK_OK(c_.Truncate(g.sequence_id, 1));
    length_ = 1;
  }
  void Call() override {
    ++length_;
    for (client::GrowItem& g : step_) g.num_tokens = length_;
    KVPOOL_CHECK_OK(c_.Grow(step_).status());
  }

 private:
  int64_t rewind_;
  std::vector<client::GrowItem> step_;
  int64_t length_ = 1;
};

template <typename T>
void RunOp(benchmark::State& state) {
  T op(Get().client.get());
  for (auto _ : state) {
    if (op.due()) {
      state.PauseTiming();
      op.Prepare();
      state.ResumeTiming();
    }
    op.Call();
  }
}

void BM_Ping(benchmark::State& state) { RunOp<PingOp>(state); }
BENCHMARK(BM_Ping)->UseRealTime();

// The floor: a bare synchronous gRPC server, called the way the client calls kvpoold (a fresh
// context with a deadline per call, one channel over a Unix socket).
struct BareServer {
  explicit BareServer(bool callback) {
    char dir[] = "/tmp/kvpool-bare-XXXXXX";
    KVPOOL_CHECK(mkdtemp(dir) != nullptr);
    path = std::string(dir) + "/grpc.sock";
    std::vector<std::string> argv = {KVPOOL_BARE_GRPC_SERVER_BINARY, path};
    if (callback) argv.push_back("callback");
    absl::StatusOr<testing::Child> c = testing::Spawn(argv);
    KVPOOL_CHECK_OK(c.status());
    child = *c;
    KVPOOL_CHECK(testing::ReadLine(child, absl::Seconds(10)).value_or("") == "ready");
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);  // as the client's channel
    stub = v1::KvPool::NewStub(
        grpc::CreateCustomChannel("unix:" + path, grpc::InsecureChannelCredentials(), args));
  }
  ~BareServer() {
    stub.reset();
    kill(child.pid, SIGTERM);
    testing::Wait(&child);
    unlink(path.c_str());
    rmdir(path.substr(0, path.rfind('/')).c_str());
  }
  std::string path;
  testing::Child child;
  std::unique_ptr<v1::KvPool::Stub> stub;
};

// [0]: the sync API, [1]: the callback API (kvpoold's).
std::unique_ptr<BareServer>& Bare(int api) {
  static std::unique_ptr<BareServer> bare[2];
  return bare[api];
}

void BM_BareGrpcPing(benchmark::State& state) {
  const int api = static_cast<int>(state.range(0));
  if (Bare(api) == nullptr) Bare(api) = std::make_unique<BareServer>(api == 1);
  v1::KvPool::Stub& stub = *Bare(api)->stub;
  const v1::PingRequest request;
  v1::PingResponse response;
  for (auto _ : state) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    KVPOOL_CHECK(stub.Ping(&context, request, &response).ok());
  }
}
BENCHMARK(BM_BareGrpcPing)->Arg(0)->Arg(1)->UseRealTime();

void BM_Allocate(benchmark::State& state) { RunOp<AllocateOp>(state); }
BENCHMARK(BM_Allocate)->UseRealTime();

void BM_Free(benchmark::State& state) { RunOp<FreeOp>(state); }
BENCHMARK(BM_Free)->UseRealTime();

void BM_Grow256(benchmark::State& state) { RunOp<Grow256Op>(state); }
BENCHMARK(BM_Grow256)->UseRealTime();

// `a` and `b` alternately, call by call (bench::Interleave), each one's housekeeping untimed.
void Interleave(benchmark::State& state, Op& a, Op& b, const char* a_counter,
                const char* b_counter) {
  bench::Interleave(
      state, [&] { a.Call(); }, a_counter, [&] { b.Call(); }, b_counter,
      [&] {
        if (a.due()) a.Prepare();
        if (b.due()) b.Prepare();
      });
}

// A call beside a Ping on the same daemon and socket, interleaved: what the pool adds to the
// round trip (issue 16: Allocate within 1.2x a Ping).
template <typename T>
void BM_VersusPing(benchmark::State& state) {
  T call(Get().client.get());
  PingOp ping(Get().client.get());
  Interleave(state, call, ping, "call_ns", "ping_ns");
}
BENCHMARK_TEMPLATE(BM_VersusPing, AllocateOp)->Name("BM_VersusPing/Allocate")->UseRealTime();
BENCHMARK_TEMPLATE(BM_VersusPing, FreeOp)->Name("BM_VersusPing/Free")->UseRealTime();
BENCHMARK_TEMPLATE(BM_VersusPing, Grow256Op)->Name("BM_VersusPing/Grow256")->UseRealTime();

// The held form beside the per-item messages, interleaved: what applying a reply in place saves.
// (Rewound every 128 tokens: both sets of 256 sequences fit the pool at once.)
void BM_GrowHeldVsMessages(benchmark::State& state) {
  Grow256Op held(Get().client.get(), 128);
  Grow256MessagesOp messages(Get().client.get(), 128);
  Interleave(state, held, messages, "held_ns", "messages_ns");
}
BENCHMARK(BM_GrowHeldVsMessages)->UseRealTime();

// The same call against this build's daemon and a baseline daemon (Baseline()), interleaved:
// what a change did to each call.
//   KVPOOL_BASELINE_DAEMON=../old/build/release/daemon/kvpoold build/release/bench/rpc_bench
//     --benchmark_filter=VersusBaseline --benchmark_repetitions=5
template <typename T>
void BM_VersusBaseline(benchmark::State& state) {
  T ours(Get().client.get());
  T base(Baseline().client.get());
  Interleave(state, ours, base, "ours_ns", "base_ns");
}
BENCHMARK_TEMPLATE(BM_VersusBaseline, PingOp)->Name("BM_VersusBaseline/Ping")->UseRealTime();
BENCHMARK_TEMPLATE(BM_VersusBaseline, AllocateOp)
    ->Name("BM_VersusBaseline/Allocate")
    ->UseRealTime();
BENCHMARK_TEMPLATE(BM_VersusBaseline, FreeOp)->Name("BM_VersusBaseline/Free")->UseRealTime();
BENCHMARK_TEMPLATE(BM_VersusBaseline, Grow256Op)->Name("BM_VersusBaseline/Grow256")->UseRealTime();

// A port of 127.0.0.1 nothing listens on now (kvpoold's metrics.listen takes an address).
int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  KVPOOL_CHECK(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);
  KVPOOL_CHECK(getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0);
  close(fd);
  return ntohs(a.sin_port);
}

// GET /metrics from 127.0.0.1:`port` (HTTP/1.0: the server closes when done); the bytes read,
// headers included. A benchmark's load generator, not a client to reuse.
size_t Scrape(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  KVPOOL_CHECK(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);
  const char request[] = "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
  KVPOOL_CHECK(write(fd, request, sizeof(request) - 1) == sizeof(request) - 1);
  size_t total = 0;
  char buffer[65536];
  for (ssize_t n; (n = read(fd, buffer, sizeof(buffer))) > 0;) total += static_cast<size_t>(n);
  close(fd);
  return total;
}

// A daemon of this build serving /metrics, scraped every 100 ms by a thread of its own.
struct ScrapedFixture {
  ScrapedFixture() : port(FreePort()) {
    fixture = std::make_unique<Fixture>(
        "", "metrics { listen: \"127.0.0.1:" + std::to_string(port) + "\" }\n");
    scraper = std::thread([this] {
      while (!stop.load()) {
        KVPOOL_CHECK(Scrape(port) > 0);
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    });
  }
  ~ScrapedFixture() {
    stop = true;
    scraper.join();
  }
  int port;
  std::unique_ptr<Fixture> fixture;
  std::atomic<bool> stop{false};
  std::thread scraper;
};

std::unique_ptr<ScrapedFixture>& ScrapedInstance() {
  static std::unique_ptr<ScrapedFixture> fixture;
  return fixture;
}

// The same call against a daemon serving /metrics (scraped) and Get() (no endpoint),
// interleaved: what the endpoint costs the calls (issue 30: at most 2 %).
template <typename T>
void BM_MetricsOnVsOff(benchmark::State& state) {
  if (ScrapedInstance() == nullptr) ScrapedInstance() = std::make_unique<ScrapedFixture>();
  T on(ScrapedInstance()->fixture->client.get());
  T off(Get().client.get());
  Interleave(state, on, off, "on_ns", "off_ns");
}
BENCHMARK_TEMPLATE(BM_MetricsOnVsOff, PingOp)->Name("BM_MetricsOnVsOff/Ping")->UseRealTime();
BENCHMARK_TEMPLATE(BM_MetricsOnVsOff, AllocateOp)
    ->Name("BM_MetricsOnVsOff/Allocate")
    ->UseRealTime();
BENCHMARK_TEMPLATE(BM_MetricsOnVsOff, FreeOp)->Name("BM_MetricsOnVsOff/Free")->UseRealTime();
BENCHMARK_TEMPLATE(BM_MetricsOnVsOff, Grow256Op)->Name("BM_MetricsOnVsOff/Grow256")->UseRealTime();

// One scrape of /metrics from a daemon whose pool has state.range(0) tenants' series (each
// tenant attached, allocated a prompt and left); bytes per scrape as a counter.
void BM_ScrapeTenants(benchmark::State& state) {
  const int64_t tenants = state.range(0);
  const int port = FreePort();
  Fixture daemon("", "metrics { listen: \"127.0.0.1:" + std::to_string(port) +
                         "\" max_tenants: " + std::to_string(tenants) + " }\n");
  const std::vector<int32_t> prompt(64, 7);
  for (int64_t t = 0; t < tenants; ++t) {
    absl::StatusOr<std::unique_ptr<client::Client>> c =
        client::Client::Connect({.runtime_dir = daemon.daemon->dir(),
                                 .client_name = "rpc_bench",
                                 .tenant = "tenant-" + std::to_string(t),
                                 .kv_access = true});
    KVPOOL_CHECK_OK(c.status());
    absl::StatusOr<v1::SequenceInfo> s = (*c)->Allocate(prompt, 64);
    KVPOOL_CHECK_OK(s.status());
    KVPOOL_CHECK_OK((*c)->Free({s->sequence_id()}));
  }
  size_t bytes = 0;
  for (auto _ : state) bytes = Scrape(port);
  state.counters["bytes"] = static_cast<double>(bytes);
}
BENCHMARK(BM_ScrapeTenants)->Arg(1000)->UseRealTime()->Unit(benchmark::kMillisecond);

// One whole block (every layer's K and V) through the mapping, beside a local copy of as much.
void BM_MappingRead(benchmark::State& state) {
  const client::Client& c = *Get().client;
  absl::StatusOr<v1::SequenceInfo> s = c.Allocate({}, c.layout().block_size());
  KVPOOL_CHECK_OK(s.status());
  const client::BlockRef block = client::ToBlockRefs(*s)[0];
  std::vector<char> out(static_cast<size_t>(c.layout().block_bytes()));
  for (auto _ : state) {
    absl::StatusOr<char*> src = c.mapping()->Block(block);
    std::memcpy(out.data(), *src, out.size());
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(out.size()));
  KVPOOL_CHECK_OK(c.Free({s->sequence_id()}));
}
BENCHMARK(BM_MappingRead);

// The same copy from this process's own memory: a private, page-aligned mapping like the pool's
// (two malloc'ed buffers would sit a multiple of 4 KiB apart and hit 4K aliasing, which says
// nothing about the pool).
void BM_LocalMemcpy(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(Get().client->layout().block_bytes());
  char* in = static_cast<char*>(
      mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  KVPOOL_CHECK(in != MAP_FAILED);
  std::memset(in, 1, bytes);
  std::vector<char> out(bytes);
  for (auto _ : state) {
    std::memcpy(out.data(), in, bytes);
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(bytes));
  munmap(in, bytes);
}
BENCHMARK(BM_LocalMemcpy);

// Time from kill -9 of a client holding 8 sequences until every block is reported back.
void BM_ReclaimAfterKill(benchmark::State& state) {
  const client::Client& c = *Get().client;
  const std::string dir = Get().daemon->dir();
  for (auto _ : state) {
    const int32_t baseline = c.GetStats()->active_blocks();
    absl::StatusOr<testing::Child> holder =
        testing::Spawn({testing::IntegrationClientBinary(), "hold", dir, "8", "200"});
    KVPOOL_CHECK_OK(holder.status());
    KVPOOL_CHECK(testing::ReadLine(*holder, absl::Seconds(10)).value_or("") == "holding");
    KVPOOL_CHECK(c.GetStats()->active_blocks() > baseline);
    const absl::Time start = absl::Now();
    kill(holder->pid, SIGKILL);
    while (c.GetStats()->active_blocks() != baseline) {
    }
    state.SetIterationTime(absl::ToDoubleSeconds(absl::Now() - start));
    testing::Wait(&*holder);
  }
}
BENCHMARK(BM_ReclaimAfterKill)->UseManualTime()->Iterations(10)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace kvpool

int main(int argc, char** argv) {
  kvpool::SetProgramDeadlockDetection();  // what the client library used to do for the process
  std::vector<kvpool::bench::RatioPair> pairs{
      {"bare sync gRPC Ping / kvpoold Ping", "BM_Ping/real_time", "BM_BareGrpcPing/0/real_time",
       1 / 1.2},
      {"bare callback gRPC Ping / kvpoold Ping", "BM_Ping/real_time", "BM_BareGrpcPing/1/real_time",
       0},
      {"Ping / Allocate (1 sequence)", "BM_Allocate/real_time", "BM_Ping/real_time", 0},
      {"Ping / Free (1 sequence)", "BM_Free/real_time", "BM_Ping/real_time", 0},
      {"Ping / Grow (1 token x 256 sequences)", "BM_Grow256/real_time", "BM_Ping/real_time", 0},
      {"mapping read / local memcpy (one block)", "BM_MappingRead", "BM_LocalMemcpy", 0.9},
  };
  // Their targets sit on the same calls interleaved with Pings: both sides under the same load.
  for (const auto& [call, target] : {std::pair{"Allocate", 1 / 1.2}, std::pair{"Free", 1 / 1.2},
                                     std::pair{"Grow256", 1 / 1.5}}) {
    const std::string bench = std::string("BM_VersusPing/") + call + "/real_time";
    pairs.push_back({.label = std::string("Ping / ") + call + ", interleaved",
                     .ours = bench,
                     .baseline = bench,
                     .target = target,
                     .ours_counter = "call_ns",
                     .baseline_counter = "ping_ns"});
  }
  pairs.push_back({.label = "Grow256: per-item messages / held tables, interleaved",
                   .ours = "BM_GrowHeldVsMessages/real_time",
                   .baseline = "BM_GrowHeldVsMessages/real_time",
                   .target = 0,
                   .ours_counter = "held_ns",
                   .baseline_counter = "messages_ns"});
  // What a change did to each call (issue 10 asks for no call more than 5 % slower). With no
  // $KVPOOL_BASELINE_DAEMON both sides are this build: the spread of that A/A ratio is the
  // method's own noise floor on this machine, so no target is set.
  for (const char* call : {"Ping", "Allocate", "Free", "Grow256"}) {
    const std::string bench = std::string("BM_VersusBaseline/") + call + "/real_time";
    pairs.push_back({.label = std::string(call) + ": this build / baseline daemon, interleaved",
                     .ours = bench,
                     .baseline = bench,
                     .target = 0,
                     .ours_counter = "ours_ns",
                     .baseline_counter = "base_ns"});
  }
  for (const char* call : {"Ping", "Allocate", "Free", "Grow256"}) {
    const std::string bench = std::string("BM_MetricsOnVsOff/") + call + "/real_time";
    pairs.push_back({.label = std::string(call) + ": /metrics off / on (scraped), interleaved",
                     .ours = bench,
                     .baseline = bench,
                     .target = 1 / 1.02,
                     .ours_counter = "on_ns",
                     .baseline_counter = "off_ns"});
  }
  const int rc = kvpool::bench::RunWithRatios(argc, argv, pairs);
  std::printf("(reclaim after kill -9: see BM_ReclaimAfterKill; target < 100 ms)\n");
  kvpool::Instance().reset();  // the client detaches, then the daemon stops
  kvpool::BaselineInstance().reset();
  kvpool::ScrapedInstance().reset();
  kvpool::Bare(0).reset();
  kvpool::Bare(1).reset();
  return rc;
}
