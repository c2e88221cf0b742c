// Tenants bound to credentials, per-tenant limits, TLS and connection limits
// (server/README.md, "Tenants"): the real decode_server on loopback.
#include <sys/stat.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/integration/harness.h"
#include "tests/integration/server_process.h"
#include "tests/integration/test_model.h"

namespace sds::itest {
namespace {

constexpr char kTokenA[] = "token-of-tenant-a-0123456789";
constexpr char kTokenB[] = "token-of-tenant-b-9876543210";

// A directory of its own under /tmp, removed with its files.
class TempDir {
 public:
  TempDir() {
    char pattern[] = "/tmp/sds_tenancy_XXXXXX";
    path_ = mkdtemp(pattern) != nullptr ? pattern : "";
  }
  ~TempDir() {
    if (!path_.empty()) std::system(("rm -rf '" + path_ + "'").c_str());
  }
  std::string File(const std::string& name, const std::string& text) const {
    std::string path = absl::StrCat(path_, "/", name);
    std::ofstream(path) << text;
    chmod(path.c_str(), 0600);
    return path;
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

std::string Slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

v1::CreateSequenceRequest Create(const std::string& id, int64_t reserve = 0) {
  v1::CreateSequenceRequest r;
  r.set_sequence_id(id);
  r.set_reserve_tokens(reserve);
  return r;
}

grpc::StatusCode CreateCode(v1::DecodeService::Stub& stub, const std::string& id,
                            const std::string& token, const std::string& tenant = "",
                            int64_t reserve = 0, std::string* message = nullptr) {
  v1::CreateSequenceResponse response;
  grpc::Status s = stub.CreateSequence(Context(tenant, std::chrono::seconds(10), token).get(),
                                       Create(id, reserve), &response);
  if (message != nullptr) *message = s.error_message();
  return s.error_code();
}

// Each token names its tenant: a caller's sequences are its tenant's, whatever
// x-tenant-id says; the header may only repeat the tenant; no token, a wrong one, or
// another tenant's header is refused.
TEST(Tenancy, TheTokenNamesTheTenantNotTheHeader) {
  TempDir dir;
  const std::string tokens =
      dir.File("tokens", std::string("# tenant token\nA ") + kTokenA + "\nB " + kTokenB + "\n");
  Harness h(TestModel(), {"--auth_tokens_file=" + tokens});
  ASSERT_TRUE(h.ok()) << h.error();
  v1::DecodeService::Stub& stub = h.stub();
  EXPECT_EQ(CreateCode(stub, "s", ""), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(CreateCode(stub, "s", "not-a-token-of-anyone-at-all"),
            grpc::StatusCode::UNAUTHENTICATED);
  ASSERT_EQ(CreateCode(stub, "s", kTokenA), grpc::StatusCode::OK);
  // B cannot reach A's "s", not even by naming A in the header.
  std::string message;
  EXPECT_EQ(CreateCode(stub, "s2", kTokenB, "A", 0, &message), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_NE(message.find("x-tenant-id"), std::string::npos) << message;
  v1::ReleaseSequenceRequest release;
  release.set_sequence_id("s");
  v1::ReleaseSequenceResponse released;
  EXPECT_EQ(
      stub.ReleaseSequence(Context("", std::chrono::seconds(10), kTokenB).get(), release, &released)
          .error_code(),
      grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(CreateCode(stub, "s", kTokenB), grpc::StatusCode::OK);  // B's own "s"
  // The header may repeat the token's tenant.
  EXPECT_EQ(CreateCode(stub, "t", kTokenA, "A"), grpc::StatusCode::OK);
  // GetModelInfo shows the caller's own use.
  v1::ModelInfo info;
  ASSERT_TRUE(stub.GetModelInfo(Context("", std::chrono::seconds(10), kTokenA).get(),
                                v1::GetModelInfoRequest(), &info)
                  .ok());
  EXPECT_EQ(info.tenant(), "A");
  EXPECT_EQ(info.tenant_sequences(), 2);
  ASSERT_TRUE(stub.GetModelInfo(Context("", std::chrono::seconds(10), kTokenB).get(),
                                v1::GetModelInfoRequest(), &info)
                  .ok());
  EXPECT_EQ(info.tenant(), "B");
  EXPECT_EQ(info.tenant_sequences(), 1);
}

// Limits per tenant: sequences and pages, RESOURCE_EXHAUSTED naming the limit, and the
// other tenant is not affected.
TEST(Tenancy, PerTenantLimitsNameTheLimit) {
  TempDir dir;
  const std::string tokens =
      dir.File("tokens", std::string("A ") + kTokenA + "\nB " + kTokenB + "\n");
  TestModel model;
  Harness h(model, {"--auth_tokens_file=" + tokens, "--max_sequences_per_tenant=2",
                    "--max_pages_per_tenant=4"});
  ASSERT_TRUE(h.ok()) << h.error();
  v1::DecodeService::Stub& stub = h.stub();
  ASSERT_EQ(CreateCode(stub, "a1", kTokenA, "", 3 * model.page_size), grpc::StatusCode::OK);
  std::string message;
  EXPECT_EQ(CreateCode(stub, "a2", kTokenA, "", 2 * model.page_size, &message),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(message.find("max_pages_per_tenant"), std::string::npos) << message;
  ASSERT_EQ(CreateCode(stub, "a2", kTokenA), grpc::StatusCode::OK);
  EXPECT_EQ(CreateCode(stub, "a3", kTokenA, "", 0, &message), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(message.find("max_sequences_per_tenant"), std::string::npos) << message;
  EXPECT_EQ(CreateCode(stub, "b1", kTokenB, "", 4 * model.page_size), grpc::StatusCode::OK);
  v1::ModelInfo info;
  ASSERT_TRUE(stub.GetModelInfo(Context("", std::chrono::seconds(10), kTokenA).get(),
                                v1::GetModelInfoRequest(), &info)
                  .ok());
  EXPECT_EQ(info.tenant_pages_used(), 3);
  EXPECT_EQ(info.tenant_max_pages(), 4);
  EXPECT_EQ(info.tenant_max_sequences(), 2);
}

// A malformed token list stops the start with one line that names the entry.
TEST(Tenancy, ABadTokenListFailsAtStart) {
  TempDir dir;
  std::string output;
  const std::string shorter = dir.File("short", "A short-token\n");
  EXPECT_EQ(RunServerToExit({"--auth_tokens_file=" + shorter}, &output), 2) << output;
  EXPECT_NE(output.find("entry 1"), std::string::npos) << output;
  EXPECT_NE(output.find("shorter than 16"), std::string::npos) << output;
  const std::string twice =
      dir.File("twice", std::string("A ") + kTokenA + "\nB " + kTokenA + "\n");
  EXPECT_EQ(RunServerToExit({"--auth_tokens_file=" + twice}, &output), 2) << output;
  EXPECT_NE(output.find("given twice"), std::string::npos) << output;
  const std::string good = dir.File("good", std::string("A ") + kTokenA + "\n");
  EXPECT_EQ(RunServerToExit({"--auth_tokens_file=" + good, "--auth_token=" + std::string(kTokenB),
                             "--check_flags"},
                            &output),
            2)
      << output;
  EXPECT_NE(output.find("not both"), std::string::npos) << output;
  setenv("SDS_TENANCY_TEST_TOKENS", (std::string("A ") + kTokenA).c_str(), 1);
  EXPECT_EQ(
      RunServerToExit({"--auth_tokens_env=SDS_TENANCY_TEST_TOKENS", "--check_flags"}, &output), 0)
      << output;
  EXPECT_EQ(
      RunServerToExit({"--auth_tokens_env=SDS_TENANCY_UNSET_VARIABLE", "--check_flags"}, &output),
      2)
      << output;
}

// Listening beyond loopback with neither TLS nor tokens is said loudly at start.
TEST(Tenancy, PlaintextBeyondLoopbackIsWarnedAbout) {
  Harness h(TestModel(), {"--listen=0.0.0.0:0"});
  ASSERT_TRUE(h.ok()) << h.error();
  EXPECT_NE(h.server().Log().find("without TLS and without tokens"), std::string::npos)
      << h.server().Log();
}

// Runs `command` in a shell; true when it exits 0.
bool Shell(const std::string& command) { return std::system(command.c_str()) == 0; }

// Mutual TLS: the server's certificate checked by the client, the client's by the
// server, and the tenant taken from the client certificate's common name; plaintext and
// certificate-less clients are refused.
TEST(Tenancy, MutualTlsTakesTheTenantFromTheClientCertificate) {
  if (!Shell("command -v openssl >/dev/null 2>&1")) GTEST_SKIP() << "no openssl";
  TempDir dir;
  const std::string& d = dir.path();
  const std::string quiet = " >/dev/null 2>&1";
  ASSERT_TRUE(Shell(absl::StrCat("cd ", d,
                                 " && openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "
                                 "/CN=test-ca -keyout ca.key -out ca.pem",
                                 quiet)));
  for (const std::string& who : {std::string("server"), std::string("client")}) {
    const std::string cn = who == "server" ? "localhost" : "tenant-x";
    ASSERT_TRUE(Shell(absl::StrCat("cd ", d, " && openssl req -newkey rsa:2048 -nodes -subj /CN=",
                                   cn, " -keyout ", who, ".key -out ", who, ".csr", quiet)));
    const std::string ext = who == "server" ? " -extfile san.cnf" : "";
    if (who == "server") dir.File("san.cnf", "subjectAltName=DNS:localhost,IP:127.0.0.1\n");
    ASSERT_TRUE(Shell(absl::StrCat("cd ", d, " && openssl x509 -req -in ", who,
                                   ".csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 -out ",
                                   who, ".pem", ext, quiet)));
  }
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = Slurp(d + "/ca.pem");
  ssl.pem_private_key = Slurp(d + "/client.key");
  ssl.pem_cert_chain = Slurp(d + "/client.pem");
  TestModel model;
  std::vector<std::string> flags = model.Flags();
  for (const std::string& f :
       {"--tls_cert_file=" + d + "/server.pem", "--tls_key_file=" + d + "/server.key",
        "--tls_client_ca_file=" + d + "/ca.pem", std::string("--tenant_from_client_cert")})
    flags.push_back(f);
  std::string error;
  std::unique_ptr<ServerProcess> server =
      ServerProcess::Start(flags, &error, grpc::SslCredentials(ssl), "localhost");
  ASSERT_NE(server, nullptr) << error;
  auto stub = v1::DecodeService::NewStub(server->NewChannel());
  v1::ModelInfo info;
  ASSERT_TRUE(stub->GetModelInfo(Context().get(), v1::GetModelInfoRequest(), &info).ok());
  EXPECT_EQ(info.tenant(), "tenant-x");
  EXPECT_EQ(CreateCode(*stub, "s", "", "someone-else"), grpc::StatusCode::PERMISSION_DENIED);
  // Plaintext, and TLS without a client certificate, get nowhere.
  auto plain = v1::DecodeService::NewStub(
      grpc::CreateChannel(server->address(), grpc::InsecureChannelCredentials()));
  EXPECT_NE(plain
                ->GetModelInfo(Context("", std::chrono::seconds(3)).get(),
                               v1::GetModelInfoRequest(), &info)
                .error_code(),
            grpc::StatusCode::OK);
  grpc::SslCredentialsOptions anonymous;
  anonymous.pem_root_certs = ssl.pem_root_certs;
  grpc::ChannelArguments args;
  args.SetSslTargetNameOverride("localhost");
  auto no_cert = v1::DecodeService::NewStub(
      grpc::CreateCustomChannel(server->address(), grpc::SslCredentials(anonymous), args));
  EXPECT_NE(no_cert
                ->GetModelInfo(Context("", std::chrono::seconds(3)).get(),
                               v1::GetModelInfoRequest(), &info)
                .error_code(),
            grpc::StatusCode::OK);
}

// Connection limits: a connection carries at most --max_concurrent_streams calls at once;
// the next one waits for a slot (here past its deadline), and runs once one frees.
TEST(Tenancy, AConnectionCarriesAtMostMaxConcurrentStreamsCalls) {
  Harness h(TestModel(), {"--max_concurrent_streams=2"});
  ASSERT_TRUE(h.ok()) << h.error();
  auto stub = v1::DecodeService::NewStub(h.server().NewChannel());
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::unique_ptr<grpc::ClientReaderWriter<v1::DecodeRequest, v1::DecodeResponse>>>
      streams;
  for (int i = 0; i < 2; ++i) {  // two idle streams take both slots
    contexts.push_back(Context("", std::chrono::seconds(20)));
    streams.push_back(stub->DecodeStream(contexts.back().get()));
  }
  v1::ModelInfo info;
  EXPECT_EQ(stub->GetModelInfo(Context("", std::chrono::milliseconds(700)).get(),
                               v1::GetModelInfoRequest(), &info)
                .error_code(),
            grpc::StatusCode::DEADLINE_EXCEEDED);
  for (auto& stream : streams) {
    stream->WritesDone();
    EXPECT_TRUE(stream->Finish().ok());
  }
  EXPECT_TRUE(stub->GetModelInfo(Context().get(), v1::GetModelInfoRequest(), &info).ok());
  // Another connection was never limited by this one.
  EXPECT_TRUE(h.stub().GetModelInfo(Context().get(), v1::GetModelInfoRequest(), &info).ok());
}

}  // namespace
}  // namespace sds::itest
