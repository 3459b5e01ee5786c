#include "daemon/metrics/rpc_counters.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/descriptor.h"
#include "kvpool/v1/kvpool.grpc.pb.h"

namespace kvpool::daemon {
namespace {

// Counts its call's status when the call sends it.
class CountingInterceptor final : public grpc::experimental::Interceptor {
 public:
  CountingInterceptor(RpcCounters* counters, int method) : counters_(counters), method_(method) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      counters_->Count(method_, static_cast<int>(methods->GetSendStatus().error_code()));
    }
    methods->Proceed();
  }

 private:
  RpcCounters* const counters_;
  const int method_;
};

class CountingFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit CountingFactory(RpcCounters* counters) : counters_(counters) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    const int method = counters_->MethodIndex(info->method());
    return method < 0 ? nullptr : new CountingInterceptor(counters_, method);  // gRPC owns it
  }

 private:
  RpcCounters* const counters_;
};

}  // namespace

RpcCounters::RpcCounters() {
  const google::protobuf::ServiceDescriptor* service =
      google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(
          v1::KvPool::service_full_name());
  for (int i = 0; service != nullptr && i < service->method_count(); ++i) {
    names_.push_back(service->method(i)->name());
    index_[absl::StrCat("/", v1::KvPool::service_full_name(), "/", names_.back())] = i;
  }
  counts_ = std::vector<std::array<std::atomic<uint64_t>, kNumCodes>>(names_.size());
}

int RpcCounters::MethodIndex(std::string_view method) const {
  auto it = index_.find(absl::string_view(method.data(), method.size()));
  return it == index_.end() ? -1 : it->second;
}

std::vector<RpcCounters::Entry> RpcCounters::Snapshot() const {
  // The canonical names, as absl::StatusCodeToString spells them, kept for the views returned.
  static const std::array<std::string, kNumCodes>* const kCodeNames = [] {
    auto* names = new std::array<std::string, kNumCodes>;
    for (int c = 0; c < kNumCodes; ++c) {
      (*names)[static_cast<size_t>(c)] = absl::StatusCodeToString(static_cast<absl::StatusCode>(c));
    }
    return names;
  }();
  std::vector<Entry> out;
  for (size_t m = 0; m < counts_.size(); ++m) {
    for (size_t c = 0; c < kNumCodes; ++c) {
      const uint64_t calls = counts_[m][c].load(std::memory_order_relaxed);
      if (calls > 0) out.push_back({names_[m], (*kCodeNames)[c], calls});
    }
  }
  return out;
}

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> RpcCounters::Interceptor(
    RpcCounters* counters) {
  return std::make_unique<CountingFactory>(counters);
}

}  // namespace kvpool::daemon
