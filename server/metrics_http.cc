#include "server/metrics_http.h"

#include <civetweb.h>
#include <netdb.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <exception>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace sds::server {
namespace {

// The host part of the first listener of a civetweb "listening_ports" list ("host:port",
// "[v6]:port" or "port", comma-separated), with the wildcard addresses replaced by
// loopback: where this process can reach its own listener.
std::string WakeHost(const std::string& listen) {
  const std::string first = listen.substr(0, listen.find(','));
  const size_t colon = first.rfind(':');
  std::string host = colon == std::string::npos ? "" : first.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  if (host.empty() || host == "0.0.0.0") return "127.0.0.1";
  if (host == "::") return "::1";
  return host;
}

// Opens and closes one connection to `address` (best effort, at most ~100 ms).
void Knock(const std::vector<unsigned char>& address, int family) {
  const int fd = socket(family, SOCK_STREAM, 0);
  if (fd < 0) return;
  const timeval timeout{0, 100000};
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout);
  // Best effort: when it fails (the listener already closed), mg_stop returns anyway.
  if (connect(fd, reinterpret_cast<const sockaddr*>(address.data()),
              static_cast<socklen_t>(address.size())) != 0) {
    spdlog::trace("/metrics: wake-up connect failed, errno {}", errno);
  }
  close(fd);
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& listen, std::function<std::string()> render,
    const MetricsHttpOptions& http_options) {
  std::unique_ptr<MetricsHttpServer> server(new MetricsHttpServer());
  server->render_ = std::move(render);
  mg_init_library(0);
  const std::string threads = std::to_string(http_options.threads);
  const std::string timeout = std::to_string(http_options.request_timeout_ms);
  const char* options[] = {"listening_ports",    listen.c_str(),  "num_threads", threads.c_str(),
                           "request_timeout_ms", timeout.c_str(), nullptr};
  mg_callbacks callbacks;
  std::memset(&callbacks, 0, sizeof callbacks);
  server->context_ = mg_start(&callbacks, nullptr, options);
  if (server->context_ == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve /metrics on '", listen, "' (address in use or invalid?)"));
  }
  mg_set_request_handler(server->context_, "/metrics", &MetricsHttpServer::Handle, server.get());
  mg_server_port ports[4];
  if (mg_get_server_ports(server->context_, 4, ports) > 0) server->port_ = ports[0].port;
  if (server->port_ > 0) {
    addrinfo hints{};
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;
    addrinfo* address = nullptr;
    const std::string host = WakeHost(listen);
    if (getaddrinfo(host.c_str(), std::to_string(server->port_).c_str(), &hints, &address) == 0 &&
        address != nullptr) {
      const auto* bytes = reinterpret_cast<const unsigned char*>(address->ai_addr);
      server->wake_address_.assign(bytes, bytes + address->ai_addrlen);
      server->wake_family_ = address->ai_family;
      freeaddrinfo(address);
    } else {
      spdlog::debug(
          "/metrics: no numeric address to wake the listener at '{}'; stopping it "
          "will wait for civetweb's poll",
          host);
    }
  }
  return server;
}

MetricsHttpServer::~MetricsHttpServer() {
  if (context_ == nullptr) return;
  // civetweb's accept thread polls its listening socket with a 2 s timeout
  // (SOCKET_TIMEOUT_QUANTUM) and sees mg_stop's flag only when that poll returns, so
  // mg_stop alone takes up to 2 s. A connection to our own port ends the poll; one that
  // lands before the flag is set is taken as an empty request and closed, so knock
  // until mg_stop has returned.
  if (wake_address_.empty()) {
    mg_stop(context_);
    return;
  }
  std::atomic<bool> stopped{false};
  std::thread stopper;
  try {
    stopper = std::thread([this, &stopped] {
      mg_stop(context_);
      stopped.store(true);
    });
  } catch (const std::exception& e) {  // no thread to spare: stop without the knocks
    spdlog::warn("/metrics: stopping without waking the listener: {}", e.what());
    mg_stop(context_);
    return;
  }
  while (!stopped.load()) {
    Knock(wake_address_, wake_family_);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  stopper.join();
}

int MetricsHttpServer::Handle(mg_connection* connection, void* self) {
  const mg_request_info* info = mg_get_request_info(connection);
  if (std::strcmp(info->request_method, "GET") != 0 &&
      std::strcmp(info->request_method, "HEAD") != 0) {
    mg_printf(connection,
              "HTTP/1.1 405 Method Not Allowed\r\nAllow: GET, HEAD\r\nContent-Length: 0\r\n"
              "Connection: close\r\n\r\n");
    return 405;
  }
  std::string body;
  try {
    body = static_cast<MetricsHttpServer*>(self)->render_();
  } catch (const std::exception& e) {
    spdlog::error("/metrics: rendering failed: {}", e.what());
    mg_printf(
        connection,
        "HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
    return 500;
  }
  mg_printf(connection,
            "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
            "Content-Length: %zu\r\nConnection: close\r\n\r\n",
            body.size());
  if (std::strcmp(info->request_method, "GET") == 0) {
    mg_write(connection, body.data(), body.size());
  }
  return 200;
}

}  // namespace sds::server
