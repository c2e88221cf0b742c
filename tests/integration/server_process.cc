#include "tests/integration/server_process.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <future>
#include <regex>
#include <sstream>
#include <thread>

#include <grpcpp/generic/generic_stub.h>

namespace sds::itest {
namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// A fresh file /tmp/sds_itest_XXXXXX_<stem>, created (so the name is ours) and removed by
// the caller. (It used to reserve a base name and append the stem, which left the base
// file behind on every run.)
std::string TempPath(const char* stem) {
  std::string pattern = std::string("/tmp/sds_itest_XXXXXX_") + stem;
  const int suffix = static_cast<int>(std::strlen(stem)) + 1;
  int fd = mkstemps(pattern.data(), suffix);
  if (fd >= 0) close(fd);
  return pattern;
}

}  // namespace

const std::string& TestBackend() {
  static const std::string backend = [] {
    const char* env = std::getenv("SDS_TEST_BACKEND");
    std::string value = env == nullptr || *env == '\0' ? "cpu" : env;
    if (value != "cpu" && value != "cuda") {
      std::fprintf(stderr, "SDS_TEST_BACKEND must be cpu or cuda (got '%s')\n", value.c_str());
      std::abort();
    }
    return value;
  }();
  return backend;
}

const std::string& DecodeServerPath() {
  static const std::string path = [] {
    const char* env = std::getenv("SDS_DECODE_SERVER");
    return std::string(env != nullptr && *env != '\0' ? env : SDS_DECODE_SERVER_PATH);
  }();
  return path;
}

std::string ToolPath(const char* env_var, const std::string& built_in) {
  const char* env = std::getenv(env_var);
  std::string path = env != nullptr ? std::string(env) : built_in;
  // CMake's find_program leaves "<VAR>-NOTFOUND" for a missing tool: no tool, so the
  // tests that need it skip instead of failing to run it.
  if (path.ends_with("-NOTFOUND")) path.clear();
  return path;
}

pid_t SpawnProcess(const std::vector<std::string>& args, const std::string& log_path) {
  pid_t pid = fork();
  if (pid != 0) return pid;
  int fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd >= 0) {
    dup2(fd, 1);
    dup2(fd, 2);
    close(fd);
  }
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  execv(argv[0], argv.data());
  _exit(127);
}

namespace {

int DecodeWaitStatus(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

}  // namespace

std::unique_ptr<ServerProcess> ServerProcess::Start(
    const std::vector<std::string>& flags, std::string* error,
    std::shared_ptr<grpc::ChannelCredentials> credentials, const std::string& ssl_target) {
  std::unique_ptr<ServerProcess> server(new ServerProcess());
  server->credentials_ = std::move(credentials);
  server->ssl_target_ = ssl_target;
  server->log_path_ = TempPath("server.log");
  std::vector<std::string> args = {DecodeServerPath(), "--backend=" + TestBackend(),
                                   "--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0",
                                   "--cpu_threads=2"};
  args.insert(args.end(), flags.begin(), flags.end());
  server->pid_ = SpawnProcess(args, server->log_path_);
  const std::regex ready(R"(serving on .*\(port (\d+)\).* metrics .*\(port (\d+)\))");
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::chrono::steady_clock::now() < give_up) {
    std::smatch match;
    const std::string log = server->Log();
    if (std::regex_search(log, match, ready)) {
      server->grpc_port_ = std::stoi(match[1]);
      server->metrics_port_ = std::stoi(match[2]);
      break;
    }
    int status;
    if (waitpid(server->pid_, &status, WNOHANG) == server->pid_) {
      server->exit_status_ = DecodeWaitStatus(status);
      server->pid_ = -1;
      *error = "decode_server exited with " + std::to_string(server->exit_status_) + ":\n" + log;
      return nullptr;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (server->grpc_port_ == 0) {
    *error = "decode_server did not report its ports:\n" + server->Log();
    return nullptr;
  }
  auto channel = server->NewChannel();
  while (std::chrono::steady_clock::now() < give_up) {
    if (HealthStatus(channel, "") == 1) return server;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  *error = "decode_server never reported SERVING:\n" + server->Log();
  return nullptr;
}

ServerProcess::~ServerProcess() {
  if (pid_ > 0) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  if (!log_path_.empty()) std::remove(log_path_.c_str());
}

std::shared_ptr<grpc::Channel> ServerProcess::NewChannel() const {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  args.SetInt("grpc.use_local_subchannel_pool", 1);  // its own connection
  if (!ssl_target_.empty()) args.SetSslTargetNameOverride(ssl_target_);
  return grpc::CreateCustomChannel(
      address(), credentials_ != nullptr ? credentials_ : grpc::InsecureChannelCredentials(), args);
}

void ServerProcess::Signal(int signal_number) const {
  if (pid_ > 0) kill(pid_, signal_number);
}

int ServerProcess::WaitExit(std::chrono::milliseconds timeout) {
  if (pid_ <= 0) return exit_status_;
  const auto give_up = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < give_up) {
    int status;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      exit_status_ = DecodeWaitStatus(status);
      return exit_status_;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return -1;
}

std::string ServerProcess::Log() const { return ReadFile(log_path_); }

int RunServerToExit(const std::vector<std::string>& flags, std::string* output) {
  const std::string log = TempPath("server.log");
  std::vector<std::string> args = {DecodeServerPath(), "--listen=127.0.0.1:0", "--metrics_listen="};
  args.insert(args.end(), flags.begin(), flags.end());
  pid_t pid = SpawnProcess(args, log);
  int status = 0;
  // A server that starts fine (it should not here) is stopped once it serves.
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (waitpid(pid, &status, WNOHANG) != pid) {
    if (std::chrono::steady_clock::now() > give_up ||
        ReadFile(log).find("serving on") != std::string::npos) {
      kill(pid, SIGTERM);
      waitpid(pid, &status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  *output = ReadFile(log);
  std::remove(log.c_str());
  return DecodeWaitStatus(status);
}

int HealthStatus(const std::shared_ptr<grpc::Channel>& channel, const std::string& service) {
  // HealthCheckRequest { string service = 1; } / HealthCheckResponse { enum status = 1; }
  std::string request;
  if (!service.empty()) {
    request.push_back(0x0A);
    request.push_back(static_cast<char>(service.size()));
    request += service;
  }
  grpc::Slice slice(request);
  grpc::ByteBuffer request_buffer(&slice, 1);
  grpc::ByteBuffer response_buffer;
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  std::promise<grpc::Status> done;
  stub.UnaryCall(&context, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request_buffer,
                 &response_buffer, [&](const grpc::Status& s) { done.set_value(s); });
  if (!done.get_future().get().ok()) return -1;
  std::vector<grpc::Slice> slices;
  response_buffer.Dump(&slices);
  std::string bytes;
  for (const grpc::Slice& s : slices)
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  if (bytes.empty()) return 0;  // UNKNOWN (default value is not encoded)
  if (bytes.size() >= 2 && bytes[0] == 0x08) return bytes[1];
  return -1;
}

std::string HttpGet(int port, const std::string& path, int* status) {
  *status = 0;
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  // A server that never answers fails the call (status 0) instead of hanging the test.
  const timeval timeout{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    close(fd);
    return "";
  }
  const std::string request = "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
  if (write(fd, request.data(), request.size()) != static_cast<ssize_t>(request.size())) {
    close(fd);
    return "";
  }
  std::string response;
  char buffer[65536];
  ssize_t n;
  while ((n = read(fd, buffer, sizeof buffer)) > 0) response.append(buffer, n);
  close(fd);
  std::sscanf(response.c_str(), "HTTP/%*s %d", status);
  const size_t body = response.find("\r\n\r\n");
  return body == std::string::npos ? "" : response.substr(body + 4);
}

int FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof addr;
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
                  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  close(fd);
  return ok ? ntohs(addr.sin_port) : 0;
}

void StopProcess(pid_t pid, std::chrono::milliseconds grace) {
  if (pid <= 0) return;
  kill(pid, SIGTERM);
  const auto give_up = std::chrono::steady_clock::now() + grace;
  while (std::chrono::steady_clock::now() < give_up) {
    if (waitpid(pid, nullptr, WNOHANG) == pid) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
}

std::string TempDir() {
  char path[] = "/tmp/sds_itest_dir_XXXXXX";
  return mkdtemp(path) ? std::string(path) : std::string("/tmp");
}

int RunCommand(const std::string& command, std::string* output) {
  output->clear();
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return -1;
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof buffer, pipe)) > 0) output->append(buffer, n);
  const int status = pclose(pipe);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

}  // namespace sds::itest
