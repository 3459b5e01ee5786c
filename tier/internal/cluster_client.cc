#include "tier/internal/cluster_client.h"

#include <hiredis/hiredis.h>

#include <charconv>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "kvpool/util/fmt.h"
#include "kvpool/util/logging.h"

namespace kvpool::tier::internal {
namespace {

const RedisCommand kAsking{.args = {"ASKING"}, .key_index = -1};
const RedisCommand kClusterSlots{.args = {"CLUSTER", "SLOTS"}, .key_index = -1};

bool IsInteger(const redisReply* r) { return r != nullptr && r->type == REDIS_REPLY_INTEGER; }

}  // namespace

ClusterClient::ClusterClient(const RedisTierOptions& options) : options_(options) {
  slot_node_.fill(-1);
  for (const std::string& seed : options_.cluster_seeds) {
    std::string host;
    int port = 0;
    if (ParseHostPort(seed, &host, &port).ok()) NodeIndex(host, port);
  }
}

int ClusterClient::FindNode(const std::string& host, int port) const {
  for (size_t i = 0; i < nodes_.size(); ++i) {
    if (nodes_[i].port == port && nodes_[i].host == host) return static_cast<int>(i);
  }
  return -1;
}

int ClusterClient::NodeIndex(const std::string& host, int port) {
  const int known = FindNode(host, port);
  if (known >= 0) return known;
  nodes_.push_back(Node{.host = host, .port = port});
  return static_cast<int>(nodes_.size() - 1);
}

RedisConnection* ClusterClient::Connect(int node, int64_t deadline) {
  Node& n = nodes_[node];
  if (n.connection != nullptr && !n.connection->broken()) return n.connection.get();
  n.connection.reset();
  absl::StatusOr<std::unique_ptr<RedisConnection>> connection =
      RedisConnection::ConnectTcp(n.host, n.port, options_.connect_timeout, deadline);
  absl::Status status = connection.status();
  if (status.ok()) status = Authenticate(**connection, options_, deadline);
  if (!status.ok()) {
    ++stats_.connect_failures;
    map_stale_ = true;  // a node that went away may have handed its slots over
    Logger("tier").debug("redis cluster: {}", status.message());
    return nullptr;
  }
  ++stats_.connects;
  n.connection = std::move(*connection);
  n.connected_in_call = call_;
  return n.connection.get();
}

bool ClusterClient::AdoptSlotMap(const redisReply& slots, const std::string& asked_host) {
  if (slots.type != REDIS_REPLY_ARRAY || slots.elements == 0) return false;
  std::array<int16_t, kNumClusterSlots> map;
  map.fill(-1);
  for (size_t e = 0; e < slots.elements; ++e) {
    const redisReply* range = slots.element[e];
    if (range->type != REDIS_REPLY_ARRAY || range->elements < 3) return false;
    const redisReply* master = range->element[2];
    if (!IsInteger(range->element[0]) || !IsInteger(range->element[1]) ||
        master->type != REDIS_REPLY_ARRAY || master->elements < 2 ||
        master->element[0]->type != REDIS_REPLY_STRING || !IsInteger(master->element[1])) {
      return false;
    }
    const long long first = range->element[0]->integer;
    const long long last = range->element[1]->integer;
    if (first < 0 || last >= kNumClusterSlots || first > last) return false;
    std::string host(master->element[0]->str, master->element[0]->len);
    if (host.empty() || host == "?") host = asked_host;  // "the node you asked"
    const int node = NodeIndex(host, static_cast<int>(master->element[1]->integer));
    for (long long s = first; s <= last; ++s) map[s] = static_cast<int16_t>(node);
  }
  slot_node_ = map;
  return true;
}

void ClusterClient::RefreshSlotMap(int64_t deadline) {
  // Nodes we hold a connection to first: no connect needed.
  std::vector<int> order;
  for (size_t i = 0; i < nodes_.size(); ++i) {
    if (nodes_[i].connection != nullptr) order.push_back(static_cast<int>(i));
  }
  for (size_t i = 0; i < nodes_.size(); ++i) {
    if (nodes_[i].connection == nullptr) order.push_back(static_cast<int>(i));
  }
  for (int node : order) {
    RedisConnection* connection = Connect(node, deadline);
    if (connection == nullptr) continue;
    absl::StatusOr<RedisReply> reply = connection->Call(kClusterSlots, deadline);
    ++stats_.round_trips;
    if (!reply.ok()) {
      if (connection->broken()) nodes_[node].connection.reset();
      continue;
    }
    if (AdoptSlotMap(**reply, nodes_[node].host)) {
      map_stale_ = false;
      ++stats_.slot_map_refreshes;
      return;
    }
  }
  Logger("tier").warn("redis cluster: no node answered CLUSTER SLOTS; routing stays as it was");
}

int ClusterClient::RouteOf(const RedisCommand& command) {
  if (nodes_.empty()) return -1;
  if (command.key_index < 0 || static_cast<size_t>(command.key_index) >= command.args.size()) {
    return 0;
  }
  const int node = slot_node_[KeySlot(command.args[command.key_index])];
  return node >= 0 ? node : 0;  // unknown slot: any node answers with MOVED
}

bool ClusterClient::HandleRedirect(const redisReply& reply, const Pending& p,
                                   ReplyCallback on_reply, std::vector<Pending>* next) {
  const std::string_view text(reply.str, reply.len);
  const bool moved = text.starts_with("MOVED ");
  if (!moved && !text.starts_with("ASK ")) return false;
  // "MOVED <slot> <host>:<port>" / "ASK <slot> <host>:<port>"
  std::vector<std::string> parts = absl::StrSplit(absl::string_view(text.data(), text.size()), ' ');
  std::string host;
  int port = 0;
  int slot = -1;
  if (parts.size() != 3 || !ParseHostPort(parts[2], &host, &port).ok()) return false;
  std::from_chars(parts[1].data(), parts[1].data() + parts[1].size(), slot);
  const int node = FindNode(host, port);
  if (node < 0) {
    ++stats_.refused_redirects;
    map_stale_ = true;  // a node that joined the cluster is learnt before the next call
    if (warned_refusal_in_call_ != call_) {
      warned_refusal_in_call_ = call_;
      Logger("tier").warn("redis cluster: refused a redirect to {}: no node of the cluster",
                          parts[2]);
    }
    on_reply(p.index, absl::InternalError(absl::StrCat("redis cluster: ", std::string(text),
                                                       ": no node of the cluster; refused")));
    return true;
  }
  if (moved) {
    ++stats_.moved_redirects;
    if (slot >= 0 && slot < kNumClusterSlots) slot_node_[slot] = static_cast<int16_t>(node);
    map_stale_ = true;  // more slots probably moved with this one
  } else {
    ++stats_.ask_redirects;
  }
  next->push_back(Pending{.index = p.index, .node = node, .asking = !moved});
  return true;
}

void ClusterClient::ReadNode(std::span<const RedisCommand> commands,
                             const std::vector<Pending>& sent, int node, ReplyCallback on_reply,
                             std::vector<Pending>* next, int64_t deadline) {
  RedisConnection* connection = nodes_[node].connection.get();
  const bool reused = Reused(node);
  absl::Status io_error;
  size_t answered = 0;
  for (const Pending& p : sent) {
    if (io_error.ok() && p.asking) io_error = connection->Read(deadline).status();  // ASKING's +OK
    absl::StatusOr<RedisReply> reply = io_error.ok()
                                           ? connection->Read(deadline, commands[p.index].sink)
                                           : absl::StatusOr<RedisReply>(io_error);
    if (!reply.ok()) {
      io_error = reply.status();
      if (reused && answered == 0) {
        next->push_back(p);  // a stale connection: send again on a fresh one
      } else {
        on_reply(p.index, io_error);
      }
      continue;
    }
    ++answered;
    if ((*reply)->type == REDIS_REPLY_ERROR && HandleRedirect(**reply, p, on_reply, next)) {
      continue;
    }
    absl::Status status = ReplyStatus(**reply);
    on_reply(p.index, status.ok() ? std::move(reply) : absl::StatusOr<RedisReply>(status));
  }
  if (!io_error.ok()) {
    ++stats_.io_errors;
    nodes_[node].connection.reset();
    map_stale_ = true;
  }
}

void ClusterClient::RunRound(std::span<const RedisCommand> commands,
                             const std::vector<Pending>& pending, ReplyCallback on_reply,
                             std::vector<Pending>* next, int64_t deadline) {
  std::vector<std::vector<Pending>> by_node(nodes_.size());
  for (const Pending& p : pending) {
    if (p.node < 0) {
      on_reply(p.index, absl::UnavailableError("redis cluster: no node known"));
    } else {
      by_node[p.node].push_back(p);
    }
  }
  std::vector<int> flushed;
  for (size_t node = 0; node < by_node.size(); ++node) {
    if (by_node[node].empty()) continue;
    RedisConnection* connection = Connect(static_cast<int>(node), deadline);
    const bool reused = connection != nullptr && Reused(static_cast<int>(node));
    absl::Status status = absl::UnavailableError(
        absl::StrCat("redis ", nodes_[node].host, ":", nodes_[node].port, ": cannot connect"));
    if (connection != nullptr) {
      for (const Pending& p : by_node[node]) {
        if (p.asking) connection->Append(kAsking);
        connection->Append(commands[p.index]);
      }
      status = connection->Flush(deadline);
      if (!status.ok()) {
        ++stats_.io_errors;
        nodes_[node].connection.reset();
        map_stale_ = true;
      }
    }
    if (!status.ok()) {
      for (const Pending& p : by_node[node]) {
        if (reused) {
          next->push_back(p);  // a stale connection: send again on a fresh one
        } else {
          on_reply(p.index, status);
        }
      }
      continue;
    }
    ++stats_.round_trips;
    flushed.push_back(static_cast<int>(node));
  }
  for (int node : flushed) ReadNode(commands, by_node[node], node, on_reply, next, deadline);
}

void ClusterClient::Stream(std::span<const RedisCommand> commands, ReplyCallback on_reply) {
  ++call_;
  const int64_t deadline = CallDeadline(options_.command_timeout);
  if (map_stale_) RefreshSlotMap(deadline);
  std::vector<Pending> pending;
  pending.reserve(commands.size());
  for (size_t i = 0; i < commands.size(); ++i) {
    pending.push_back(Pending{.index = i, .node = RouteOf(commands[i])});
  }
  std::vector<Pending> next;
  for (int hop = 0; !pending.empty() && hop <= options_.max_redirects; ++hop) {
    next.clear();
    RunRound(commands, pending, on_reply, &next, deadline);
    pending.swap(next);
  }
  for (const Pending& p : pending) {
    on_reply(p.index, absl::UnavailableError(absl::StrCat("redis cluster: more than ",
                                                          options_.max_redirects,
                                                          " redirects for one command")));
  }
}

}  // namespace kvpool::tier::internal
