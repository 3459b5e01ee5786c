#include "tier/internal/redis_connection.h"

// hiredis 0.14's sds.h (which hiredis.h includes) declares sdsrange without C linkage.
extern "C" {
#include <hiredis/sds.h>
}
#include <hiredis/hiredis.h>
#include <signal.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <mutex>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "kvpool/util/check.h"
#include "kvpool/util/clock.h"

namespace kvpool::tier {

void RedisReplyDeleter::operator()(redisReply* reply) const { freeReplyObject(reply); }

namespace internal {
namespace {

// The time left before `deadline`, clamped to [1 ms, cap]: hiredis takes a zero timeval as no
// timeout at all.
timeval TimeLeft(int64_t deadline, int64_t now, absl::Duration cap) {
  const absl::Duration left = absl::Nanoseconds(deadline - now);
  return absl::ToTimeval(std::clamp(left, absl::Milliseconds(1), cap));
}

absl::Status DeadlinePassed(std::string_view address, std::string_view what) {
  return absl::UnavailableError(absl::StrCat("redis ", std::string(address), ": ",
                                             std::string(what), ": the call's deadline passed"));
}

// hiredis's own reply functions, but for a top-level bulk string, which goes to the ReplySink the
// reader's privdata names (Read sets it per reply; hiredis hands it to every task of the reply).
// hiredis 0.14 and 1.x share createString's signature; the rest of the table is copied as is.
const redisReplyObjectFunctions* g_hiredis_functions = nullptr;

void* CreateString(const redisReadTask* task, char* str, size_t len) {
  if (task->parent == nullptr && task->type == REDIS_REPLY_STRING && task->privdata != nullptr &&
      static_cast<ReplySink*>(task->privdata)->Take(std::string_view(str, len))) {
    return g_hiredis_functions->createString(task, str, 0);
  }
  return g_hiredis_functions->createString(task, str, len);
}

// The table every connection's reader uses, made once from hiredis's default one.
redisReplyObjectFunctions* SinkFunctions(const redisReplyObjectFunctions* hiredis) {
  static redisReplyObjectFunctions table = [hiredis] {
    g_hiredis_functions = hiredis;
    redisReplyObjectFunctions t = *hiredis;
    t.createString = &CreateString;
    return t;
  }();
  return &table;
}

}  // namespace

int64_t CallDeadline(absl::Duration timeout) {
  return Clock::Real()->NowNanos() + absl::ToInt64Nanoseconds(timeout);
}

absl::StatusOr<std::unique_ptr<RedisConnection>> RedisConnection::Adopt(redisContext* c,
                                                                        std::string address) {
  if (c == nullptr) return absl::UnavailableError(absl::StrCat("redis ", address, ": no memory"));
  if (c->err != 0) {
    std::string message = absl::StrCat("redis ", address, ": connect: ", c->errstr);
    redisFree(c);
    return absl::UnavailableError(message);
  }
  c->reader->fn = SinkFunctions(c->reader->fn);
  return absl::WrapUnique(new RedisConnection(c, std::move(address)));
}

void IgnoreSigpipeOnce() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction current {};
    if (sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
      signal(SIGPIPE, SIG_IGN);
    }
  });
}

absl::StatusOr<std::unique_ptr<RedisConnection>> RedisConnection::ConnectTcp(
    const std::string& host, int port, absl::Duration connect_timeout, int64_t deadline) {
  IgnoreSigpipeOnce();
  std::string address = absl::StrCat(host, ":", port);
  const int64_t now = Clock::Real()->NowNanos();
  if (now >= deadline) return DeadlinePassed(address, "connect");
  redisContext* c =
      redisConnectWithTimeout(host.c_str(), port, TimeLeft(deadline, now, connect_timeout));
  return Adopt(c, std::move(address));
}

absl::StatusOr<std::unique_ptr<RedisConnection>> RedisConnection::ConnectUnix(
    const std::string& path, absl::Duration connect_timeout, int64_t deadline) {
  IgnoreSigpipeOnce();
  const int64_t now = Clock::Real()->NowNanos();
  if (now >= deadline) return DeadlinePassed(path, "connect");
  redisContext* c =
      redisConnectUnixWithTimeout(path.c_str(), TimeLeft(deadline, now, connect_timeout));
  return Adopt(c, path);
}

RedisConnection::~RedisConnection() { redisFree(context_); }

bool RedisConnection::broken() const { return context_->err != 0 || timed_out_ || failed_; }

absl::Status RedisConnection::IoError(std::string_view what, int64_t deadline) {
  // The socket timeout armed for the deadline fired (EAGAIN), or it passed during the syscall.
  if (deadline - Clock::Real()->NowNanos() < absl::ToInt64Nanoseconds(absl::Milliseconds(1))) {
    timed_out_ = true;
  }
  if (timed_out_) return DeadlinePassed(address_, what);
  return absl::UnavailableError(absl::StrCat("redis ", address_, ": ", std::string(what), ": ",
                                             context_->err != 0 ? context_->errstr : "error"));
}

absl::Status RedisConnection::Arm(int64_t deadline) {
  const int64_t now = Clock::Real()->NowNanos();
  if (timed_out_ || now >= deadline) {
    timed_out_ = true;
    return DeadlinePassed(address_, "I/O");
  }
  if (deadline == armed_for_ && now - armed_at_ <= absl::ToInt64Nanoseconds(kDeadlineSlack)) {
    return absl::OkStatus();  // a syscall started now ends by deadline + kDeadlineSlack
  }
  if (redisSetTimeout(context_, TimeLeft(deadline, now, absl::InfiniteDuration())) != REDIS_OK) {
    return IoError("set timeout", deadline);
  }
  armed_for_ = deadline;
  armed_at_ = now;
  return absl::OkStatus();
}

void RedisConnection::Append(const RedisCommand& command) {
  std::vector<const char*> argv;
  std::vector<size_t> lens;
  argv.reserve(command.args.size());
  lens.reserve(command.args.size());
  for (std::string_view arg : command.args) {
    argv.push_back(arg.data());
    lens.push_back(arg.size());
  }
  redisAppendCommandArgv(context_, static_cast<int>(argv.size()), argv.data(), lens.data());
}

absl::Status RedisConnection::Flush(int64_t deadline) {
  int done = 0;
  while (done == 0) {
    if (absl::Status armed = Arm(deadline); !armed.ok()) return armed;
    if (redisBufferWrite(context_, &done) != REDIS_OK) return IoError("write", deadline);
  }
  return absl::OkStatus();
}

absl::Status RedisConnection::Buffer(size_t n, int64_t deadline) {
  const redisReader* r = context_->reader;
  while (r->len - r->pos < n) {
    if (absl::Status armed = Arm(deadline); !armed.ok()) return armed;
    if (redisBufferRead(context_) != REDIS_OK) return IoError("read", deadline);
  }
  return absl::OkStatus();
}

absl::Status RedisConnection::ReadInto(std::span<char> to, int64_t deadline) {
  redisReader* r = context_->reader;
  const size_t buffered = std::min(to.size(), r->len - r->pos);
  std::memcpy(to.data(), r->buf + r->pos, buffered);
  r->pos += buffered;
  for (size_t done = buffered; done < to.size();) {
    if (absl::Status armed = Arm(deadline); !armed.ok()) return armed;
    const ssize_t n = ::read(context_->fd, to.data() + done, to.size() - done);
    if (n > 0) {
      done += static_cast<size_t>(n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      const int read_errno = errno;
      failed_ = true;  // the reply is half read: the stream cannot be resumed
      const absl::Status error = IoError("read", deadline);
      if (timed_out_) return error;
      return absl::UnavailableError(absl::StrCat(
          "redis ", address_,
          ": read: ", n == 0 ? "server closed the connection" : std::strerror(read_errno)));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<RedisReply> RedisConnection::ReadPlaced(int64_t deadline, ReplySink& sink) {
  redisReader* r = context_->reader;
  // The "$<len>\r\n" line: at most 1 + 19 digits + 2 bytes for a length hiredis accepts.
  constexpr size_t kMaxLine = 22;
  size_t line_end = std::string_view::npos;
  while (line_end == std::string_view::npos) {
    const std::string_view buffered(r->buf + r->pos, r->len - r->pos);
    if (!buffered.empty() && buffered[0] != '$') return RedisReply();
    line_end = buffered.substr(0, kMaxLine).find("\r\n");
    if (line_end == std::string_view::npos && buffered.size() >= kMaxLine) return RedisReply();
    if (line_end == std::string_view::npos) {
      if (absl::Status read = Buffer(buffered.size() + 1, deadline); !read.ok()) return read;
    }
  }
  size_t len = 0;
  const char* digits = r->buf + r->pos + 1;
  const char* digits_end = r->buf + r->pos + line_end;
  if (const auto [end, error] = std::from_chars(digits, digits_end, len);
      digits == digits_end || error != std::errc() || end != digits_end) {
    return RedisReply();  // nil ($-1) or not a length: hiredis's to answer
  }
  ReplySink::Placement where;
  if (!sink.Place(len, &where)) return RedisReply();
  KVPOOL_CHECK(where.head.size() + where.tail.size() == len);
  r->pos += line_end + 2;
  for (std::span<char> part : {where.head, where.tail}) {
    if (absl::Status read = ReadInto(part, deadline); !read.ok()) return read;
  }
  if (absl::Status read = Buffer(2, deadline); !read.ok()) return read;
  if (r->buf[r->pos] != '\r' || r->buf[r->pos + 1] != '\n') {
    failed_ = true;
    return absl::UnavailableError(
        absl::StrCat("redis ", address_, ": protocol error: no CRLF after a bulk string"));
  }
  r->pos += 2;
  if (r->pos >= 1024) {  // as hiredis's own reader discards what it consumed
    sdsrange(r->buf, static_cast<int>(r->pos), -1);
    r->pos = 0;
    r->len = sdslen(r->buf);
  }
  sink.Placed();
  redisReadTask task{};
  task.type = REDIS_REPLY_STRING;
  char empty[] = "";
  return RedisReply(static_cast<redisReply*>(g_hiredis_functions->createString(&task, empty, 0)));
}

absl::StatusOr<RedisReply> RedisConnection::Read(int64_t deadline, ReplySink* sink) {
  // A value the sink places is read from the socket straight into place. Only from a reply's
  // start: hiredis's reader holds no part of a reply between Reads (each Read ends with one whole).
  if (sink != nullptr && !broken() && context_->reader->ridx == -1) {
    absl::StatusOr<RedisReply> placed = ReadPlaced(deadline, *sink);
    if (!placed.ok() || *placed != nullptr) return placed;
  }
  void* reply = nullptr;
  // hiredis copies the reader's privdata into a reply's tasks when it starts parsing it: set for
  // this reply, cleared again however the read ends.
  context_->reader->privdata = sink;
  const absl::Cleanup no_sink = [this] { context_->reader->privdata = nullptr; };
  if (broken() || redisGetReplyFromReader(context_, &reply) != REDIS_OK) {
    return IoError("read", deadline);
  }
  // One read(2) at a time, each bounded by what is left of the deadline: a reply that arrives a
  // byte at a time still ends the call on time.
  while (reply == nullptr) {
    if (absl::Status armed = Arm(deadline); !armed.ok()) return armed;
    if (redisBufferRead(context_) != REDIS_OK ||
        redisGetReplyFromReader(context_, &reply) != REDIS_OK) {
      return IoError("read", deadline);
    }
  }
  return RedisReply(static_cast<redisReply*>(reply));
}

absl::StatusOr<RedisReply> RedisConnection::Call(const RedisCommand& command, int64_t deadline) {
  Append(command);
  if (absl::Status flushed = Flush(deadline); !flushed.ok()) return flushed;
  absl::StatusOr<RedisReply> reply = Read(deadline);
  if (reply.ok()) {
    absl::Status status = ReplyStatus(**reply);
    if (!status.ok()) return status;
  }
  return reply;
}

absl::Status Authenticate(RedisConnection& connection, const RedisTierOptions& options,
                          int64_t deadline) {
  if (options.password.empty()) return absl::OkStatus();
  RedisCommand auth{.args = {"AUTH"}, .key_index = -1};
  if (!options.username.empty()) auth.args.push_back(options.username);
  auth.args.push_back(options.password);
  absl::StatusOr<RedisReply> reply = connection.Call(auth, deadline);
  if (reply.ok()) return absl::OkStatus();
  return absl::UnavailableError(
      absl::StrCat("redis ", connection.address(), ": AUTH failed: ", reply.status().message()));
}

absl::Status ReplyStatus(const redisReply& reply) {
  if (reply.type != REDIS_REPLY_ERROR) return absl::OkStatus();
  const std::string_view text(reply.str, reply.len);
  for (std::string_view transient : {"CLUSTERDOWN", "TRYAGAIN", "LOADING", "MASTERDOWN"}) {
    if (text.starts_with(transient))
      return absl::UnavailableError(absl::StrCat("redis: ", std::string(text)));
  }
  return absl::InternalError(absl::StrCat("redis: ", std::string(text)));
}

}  // namespace internal
}  // namespace kvpool::tier
