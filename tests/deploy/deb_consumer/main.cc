// Attaches to the kvpoold whose sockets are in argv[1] through the installed client library and
// prints the version the daemon reports, then its pool's name and block count.
#include <cstdio>
#include <string>

#include "client/client.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: deb_consumer RUNTIME_DIR\n");
    return 2;
  }
  kvpool::client::ConnectOptions options;
  options.runtime_dir = argv[1];
  options.client_name = "deb_consumer";
  options.decode_doorbell = false;
  auto client = kvpool::client::Client::Connect(options);
  if (!client.ok()) {
    std::fprintf(stderr, "deb_consumer: %s\n", client.status().ToString().c_str());
    return 1;
  }
  std::printf("%s\n", (*client)->daemon_version().c_str());
  std::printf("pool %s: %d blocks\n", (*client)->pool().c_str(),
              static_cast<int>((*client)->layout().num_blocks()));
  return 0;
}
