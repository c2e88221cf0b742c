#include "server/metrics_http.h"

#include <civetweb.h>

#include <cstring>
#include <exception>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace sds::server {

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& listen, std::function<std::string()> render) {
  std::unique_ptr<MetricsHttpServer> server(new MetricsHttpServer());
  server->render_ = std::move(render);
  mg_init_library(0);
  const char* options[] = {"listening_ports", listen.c_str(), "num_threads", "2", nullptr};
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
  return server;
}

MetricsHttpServer::~MetricsHttpServer() {
  if (context_) mg_stop(context_);
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
