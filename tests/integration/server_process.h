// Runs the real decode_server binary for a test: ephemeral loopback ports (read back
// from its start-up log line), its log in a temp file, signals, exit status.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

namespace sds::itest {

class ServerProcess {
 public:
  // Starts decode_server with TestBackend(), --listen/--metrics_listen on
  // 127.0.0.1:0 plus `flags`, and waits until it reports its ports (self-test passed)
  // and answers health checks with SERVING. nullptr and `error` (with the log) if not.
  // `credentials` (default: plaintext) for every channel to it, the health wait's
  // included; `ssl_target` overrides the name a TLS certificate is checked against.
  static std::unique_ptr<ServerProcess> Start(
      const std::vector<std::string>& flags, std::string* error,
      std::shared_ptr<grpc::ChannelCredentials> credentials = nullptr,
      const std::string& ssl_target = "");
  ~ServerProcess();  // SIGKILL if still running

  int grpc_port() const { return grpc_port_; }
  int metrics_port() const { return metrics_port_; }
  std::string address() const { return "127.0.0.1:" + std::to_string(grpc_port_); }
  std::shared_ptr<grpc::Channel> NewChannel() const;  // a channel of its own

  void Signal(int signal_number) const;
  // Exit status (WEXITSTATUS), 128+signal if killed, or -1 on timeout.
  int WaitExit(std::chrono::milliseconds timeout);
  std::string Log() const;

 private:
  ServerProcess() = default;
  pid_t pid_ = -1;
  int grpc_port_ = 0;
  int metrics_port_ = 0;
  int exit_status_ = -1;
  std::string log_path_;
  std::shared_ptr<grpc::ChannelCredentials> credentials_;
  std::string ssl_target_;
};

// The backend the integration tests run the server with: $SDS_TEST_BACKEND, "cpu"
// (default) or "cuda"; any other value aborts the test binary.
const std::string& TestBackend();

// The decode_server binary: $SDS_DECODE_SERVER, else the one this build made.
const std::string& DecodeServerPath();

// A tool's path: $env_var when set (empty = not available), else `built_in`.
std::string ToolPath(const char* env_var, const std::string& built_in);

// Runs decode_server with `flags` to completion (for start-up failures; one that
// starts serving is sent SIGTERM at once); returns the exit status and the output.
int RunServerToExit(const std::vector<std::string>& flags, std::string* output);

// grpc.health.v1.Health/Check through the generic stub (no health proto needed):
// 1 = SERVING, 2 = NOT_SERVING, -1 on an RPC error.
int HealthStatus(const std::shared_ptr<grpc::Channel>& channel, const std::string& service);

// Minimal HTTP/1.0 GET on 127.0.0.1; returns the body, or "" with `status` != 200.
std::string HttpGet(int port, const std::string& path, int* status);

// A port that was free a moment ago (for tools that cannot bind port 0 themselves).
int FreePort();

// Starts `args` (args[0] an absolute path) with stdout and stderr to `log_path`.
pid_t SpawnProcess(const std::vector<std::string>& args, const std::string& log_path);
// SIGTERM, then SIGKILL after `grace`; reaps the child.
void StopProcess(pid_t pid, std::chrono::milliseconds grace);
// A fresh empty directory under /tmp.
std::string TempDir();

// Runs a shell command, returns its exit status and output.
int RunCommand(const std::string& command, std::string* output);

}  // namespace sds::itest
