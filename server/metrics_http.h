// Serves GET /metrics over HTTP with civetweb.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

struct mg_context;
struct mg_connection;

namespace sds::server {

// civetweb serves one connection per thread and waits for a request's bytes for as long
// as the timeout allows: with 2 threads and civetweb's 30 s default, two idle sockets
// that sent half a request blocked every scrape.
struct MetricsHttpOptions {
  int32_t threads = 8;                // --metrics_threads
  int32_t request_timeout_ms = 5000;  // --metrics_request_timeout_ms: per read and write
};

class MetricsHttpServer {
 public:
  // `listen` is host:port (civetweb "listening_ports" syntax). `render` produces the
  // exposition text; it runs on civetweb's threads.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const std::string& listen, std::function<std::string()> render,
      const MetricsHttpOptions& options = {});
  ~MetricsHttpServer();
  int port() const { return port_; }  // the bound port (useful with port 0)

 private:
  MetricsHttpServer() = default;
  static int Handle(mg_connection* connection, void* self);

  std::function<std::string()> render_;
  mg_context* context_ = nullptr;
  // Where the destructor connects to wake civetweb's accept thread: the first listener,
  // resolved once at start (numeric only, so stopping never waits on DNS); empty when it
  // could not be resolved (the stop then takes civetweb's own poll, up to 2 s).
  std::vector<unsigned char> wake_address_;  // a sockaddr of wake_family_
  int wake_family_ = 0;
  int port_ = 0;
};

}  // namespace sds::server
