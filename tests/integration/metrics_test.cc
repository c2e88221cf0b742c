// /metrics after known traffic: the text is valid (promtool check metrics), the
// counters say what happened, and a real Prometheus scraping the server sees it.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <memory>
#include <regex>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/integration/harness.h"

namespace sds::itest {
namespace {

class MetricsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    harness_ = std::make_unique<Harness>(model_);
    ASSERT_TRUE(harness_->ok()) << harness_->error();
    Harness& h = *harness_;
    InputGen gen(41);
    h.CreateAndPrefill(gen, "m", 10);  // 3 layers x 10 tokens appended
    for (int i = 0; i < kDecodes; ++i) {
      ASSERT_TRUE(
          h.DecodeAndCheck(RandomDecode(gen, model_, "m", 0, 10 + i, 4, false, i + 1)).ok());
    }
    for (int i = 0; i < kBad; ++i) {
      v1::DecodeRequest bad = RandomDecode(gen, model_, "m", 5, 0, 4, false, 99);  // bad layer
      v1::DecodeResponse response;
      EXPECT_EQ(h.stub().Decode(Context().get(), bad, &response).error_code(),
                grpc::StatusCode::INVALID_ARGUMENT);
    }
    v1::DecodeBatchRequest batch;
    for (int32_t layer = 0; layer < 3; ++layer) {
      *batch.add_requests() = RandomDecode(gen, model_, "m", layer, layer == 0 ? 10 + kDecodes : 10,
                                           4, false, 50 + layer);
    }
    v1::DecodeBatchResponse batch_response;
    ASSERT_TRUE(h.stub().DecodeBatch(Context().get(), batch, &batch_response).ok());
    for (const auto& r : batch_response.responses())
      ASSERT_EQ(r.error_code(), 0) << r.error_message();
  }

  std::string Scrape() {
    int status = 0;
    std::string body = HttpGet(harness_->server().metrics_port(), "/metrics", &status);
    EXPECT_EQ(status, 200);
    return body;
  }

  static constexpr int kDecodes = 5;
  static constexpr int kBad = 2;
  TestModel model_;
  std::unique_ptr<Harness> harness_;
};

TEST_F(MetricsTest, ExpositionReflectsTraffic) {
  const std::string text = Scrape();
  auto has = [&](const std::string& line) {
    EXPECT_NE(text.find(line + "\n"), std::string::npos) << "missing: " << line << "\n" << text;
  };
  has(absl::StrCat("sds_requests_total{rpc=\"Decode\",code=\"OK\"} ", kDecodes));
  has(absl::StrCat("sds_requests_total{rpc=\"Decode\",code=\"INVALID_ARGUMENT\"} ", kBad));
  has("sds_requests_total{rpc=\"DecodeBatch\",code=\"OK\"} 3");
  has("sds_requests_total{rpc=\"AppendKV\",code=\"OK\"} 3");
  has("sds_requests_total{rpc=\"CreateSequence\",code=\"OK\"} 1");
  // The start-up self-test wrote 19 tokens in each of 2 layers (page_size + 3).
  has(absl::StrCat("sds_tokens_appended_total ", 2 * 19 + 30 + kDecodes + 3));
  // Capacity is its own gauge; sds_cache_pages holds used and free only, so that
  // sum(sds_cache_pages) is the pool size.
  has("sds_cache_pages_capacity 512");
  EXPECT_EQ(text.find("state=\"total\""), std::string::npos) << text;
  std::smatch used, free;
  ASSERT_TRUE(
      std::regex_search(text, used, std::regex(R"(\nsds_cache_pages\{state="used"\} (\d+)\n)")));
  ASSERT_TRUE(
      std::regex_search(text, free, std::regex(R"(\nsds_cache_pages\{state="free"\} (\d+)\n)")));
  EXPECT_EQ(std::stoi(used[1]) + std::stoi(free[1]), 512);
  EXPECT_GT(std::stoi(used[1]), 0);
  has("sds_sequences 1");
  has("sds_queue_depth 0");
  has("sds_active_streams 0");
  has("sds_build_info{backend=\"" + TestBackend() +
      "\",num_q_heads=\"8\",num_kv_heads=\"2\",head_dim=\"64\","
      "scale_mode=\"per_tensor\",scales_default=\"false\",version=\"0.1.0\"} 1");
  for (const char* family : {"sds_batch_size", "sds_batch_queue_seconds",
                             "sds_batch_compute_seconds", "sds_batch_total_seconds"}) {
    has(absl::StrCat("# TYPE ", family, " histogram"));
    EXPECT_NE(text.find(absl::StrCat(family, "_bucket{le=\"+Inf\"}")), std::string::npos);
  }
  has("sds_request_latency_seconds_count{rpc=\"Decode\"} " + std::to_string(kDecodes + kBad));
  // Batches: the self-test's 2 plus ours (at least one per decode, fewer for the batch).
  std::smatch match;
  ASSERT_TRUE(std::regex_search(text, match, std::regex(R"(\nsds_batches_total (\d+)\n)")));
  EXPECT_GE(std::stoi(match[1]), 2 + kDecodes + 1);
}

// The finite `le` bounds of one histogram series, in exposition order.
std::vector<double> Bounds(const std::string& text, const std::string& series_prefix) {
  std::vector<double> bounds;
  const std::regex line("\n" + series_prefix + R"re(le="([^"]+)"\} \d+)re");
  for (auto it = std::sregex_iterator(text.begin(), text.end(), line); it != std::sregex_iterator();
       ++it) {
    if ((*it)[1] != "+Inf") bounds.push_back(std::stod((*it)[1]));
  }
  return bounds;
}

// GPU batches queue and compute for 15-35 us: the batch histograms must resolve
// microseconds (5 us .. 1 s), and request latency must reach 10 s.
TEST_F(MetricsTest, LatencyBucketsResolveMicroseconds) {
  const std::string text = Scrape();
  const std::vector<double> batch = {5e-6,   10e-6,  20e-6,  30e-6,  50e-6,  75e-6,  100e-6,
                                     150e-6, 200e-6, 300e-6, 500e-6, 1e-3,   2e-3,   5e-3,
                                     10e-3,  20e-3,  50e-3,  100e-3, 200e-3, 500e-3, 1};
  for (const char* family :
       {"sds_batch_queue_seconds", "sds_batch_compute_seconds", "sds_batch_total_seconds"}) {
    EXPECT_EQ(Bounds(text, absl::StrCat(family, "_bucket\\{")), batch) << family;
  }
  const std::vector<double> request =
      Bounds(text, R"(sds_request_latency_seconds_bucket\{rpc="Decode",)");
  ASSERT_FALSE(request.empty()) << text;
  EXPECT_LE(request.front(), 10e-6);
  EXPECT_EQ(request.back(), 10);
  EXPECT_TRUE(std::is_sorted(request.begin(), request.end()));
  // The buckets add up: the +Inf bucket of each batch family is its _count.
  std::smatch inf, count;
  ASSERT_TRUE(std::regex_search(
      text, inf, std::regex(R"(\nsds_batch_queue_seconds_bucket\{le="\+Inf"\} (\d+)\n)")));
  ASSERT_TRUE(
      std::regex_search(text, count, std::regex(R"(\nsds_batch_queue_seconds_count (\d+)\n)")));
  EXPECT_EQ(inf[1], count[1]);
}

// HELP says what each counter counts where the name alone would mislead.
TEST_F(MetricsTest, HelpTextSaysWhatIsCounted) {
  const std::string text = Scrape();
  auto help = [&](const std::string& name) {
    const std::string start = "# HELP " + name + " ";
    const size_t at = text.find(start);
    EXPECT_NE(at, std::string::npos) << name;
    if (at == std::string::npos) return std::string();
    return text.substr(at + start.size(), text.find('\n', at) - at - start.size());
  };
  EXPECT_NE(help("sds_tokens_appended_total").find("per token per layer"), std::string::npos);
  EXPECT_NE(help("sds_requests_total").find("counts items"), std::string::npos);
  EXPECT_NE(help("sds_request_latency_seconds").find("per DecodeBatch call"), std::string::npos);
  EXPECT_NE(help("sds_batch_total_seconds").find("queue wait excluded"), std::string::npos);
  // One DecodeBatch call of 3 items: 3 counted requests, 1 latency observation.
  EXPECT_NE(text.find("\nsds_request_latency_seconds_count{rpc=\"DecodeBatch\"} 1\n"),
            std::string::npos)
      << text;
}

// Each DecodeStream answer taken by gRPC is one observation of the send time (from its
// batch's end), and none of the unary traffic of SetUp is.
TEST_F(MetricsTest, StreamAnswerSendIsObservedOncePerAnswer) {
  Harness& h = *harness_;
  EXPECT_NE(Scrape().find("\nsds_stream_answer_send_seconds_count 0\n"), std::string::npos);
  InputGen gen(43);
  h.CreateAndPrefill(gen, "s", 10);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto stream = h.stub().DecodeStream(&context);
  for (int32_t layer = 0; layer < 3; ++layer)  // one new token per layer
    ASSERT_TRUE(stream->Write(RandomDecode(gen, model_, "s", layer, 10, 4, false, 70 + layer)));
  stream->WritesDone();
  v1::DecodeResponse response;
  int answered = 0;
  while (stream->Read(&response)) {
    EXPECT_EQ(response.error_code(), 0) << response.error_message();
    ++answered;
  }
  ASSERT_TRUE(stream->Finish().ok());
  ASSERT_EQ(answered, 3);
  const std::string text = Scrape();
  EXPECT_NE(text.find("# TYPE sds_stream_answer_send_seconds histogram\n"), std::string::npos);
  EXPECT_NE(text.find("\nsds_stream_answer_send_seconds_count 3\n"), std::string::npos) << text;
  EXPECT_NE(text.find("\nsds_stream_answer_send_seconds_bucket{le=\"+Inf\"} 3\n"),
            std::string::npos);
}

TEST_F(MetricsTest, PromtoolAcceptsTheExposition) {
  const std::string promtool = ToolPath("SDS_PROMTOOL", SDS_PROMTOOL_PATH);
  if (promtool.empty()) GTEST_SKIP() << "promtool not installed (or SDS_PROMTOOL empty)";
  const std::string path = TempDir() + "/metrics.txt";
  std::ofstream(path) << Scrape();
  std::string output;
  EXPECT_EQ(RunCommand(promtool + " check metrics < " + path, &output), 0) << output;
}

TEST_F(MetricsTest, PrometheusScrapesTheServer) {
  const std::string prometheus = ToolPath("SDS_PROMETHEUS", SDS_PROMETHEUS_PATH);
  if (prometheus.empty()) GTEST_SKIP() << "prometheus not installed (or SDS_PROMETHEUS empty)";
  const std::string dir = TempDir();
  const int port = FreePort();
  std::ofstream(dir + "/prometheus.yml")
      << "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
      << "scrape_configs:\n  - job_name: sds\n    static_configs:\n"
      << "      - targets: ['127.0.0.1:" << harness_->server().metrics_port() << "']\n";
  const pid_t pid = SpawnProcess({prometheus, "--config.file=" + dir + "/prometheus.yml",
                                  "--storage.tsdb.path=" + dir + "/data",
                                  "--web.listen-address=127.0.0.1:" + std::to_string(port)},
                                 dir + "/prometheus.log");
  ASSERT_GT(pid, 0);
  // sds_requests_total{rpc="Decode",code="OK"}
  const std::string query =
      "/api/v1/query?query=sds_requests_total%7Brpc%3D%22Decode%22%2Ccode%3D%22OK%22%7D";
  const std::regex value(R"re("value":\[[0-9.e+]+,"([0-9.]+)"\])re");
  std::string last;
  bool seen = false;
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(90);
  while (!seen && std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    int status = 0;
    last = HttpGet(port, query, &status);
    std::smatch match;
    if (status == 200 && std::regex_search(last, match, value)) {
      seen = std::stod(match[1]) == kDecodes;
    }
  }
  StopProcess(pid, std::chrono::seconds(5));
  EXPECT_TRUE(seen) << "Prometheus never reported " << kDecodes << "; last answer: " << last;
}

// An open socket to the metrics port that sent half a request and then nothing.
class HalfSentRequest {
 public:
  explicit HalfSentRequest(int port) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    const char half[] = "GET /metrics HTTP/1.1\r\n";
    ok_ = fd_ >= 0 && connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
          write(fd_, half, sizeof half - 1) == static_cast<ssize_t>(sizeof half - 1);
  }
  ~HalfSentRequest() {
    if (fd_ >= 0) close(fd_);
  }
  bool ok() const { return ok_; }

 private:
  int fd_ = -1;
  bool ok_ = false;
};

double SecondsToScrape(int port, int* status) {
  const auto start = std::chrono::steady_clock::now();
  HttpGet(port, "/metrics", status);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// B2: two idle half-sent requests used to hold both of civetweb's threads for its 30 s
// request timeout, and every scrape timed out meanwhile.
TEST(MetricsEndpoint, HalfSentRequestsDoNotBlockScrapes) {
  Harness h(TestModel{});
  ASSERT_TRUE(h.ok()) << h.error();
  const int port = h.server().metrics_port();
  std::vector<std::unique_ptr<HalfSentRequest>> idle;
  for (int i = 0; i < 2; ++i) {
    idle.push_back(std::make_unique<HalfSentRequest>(port));
    ASSERT_TRUE(idle.back()->ok());
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // civetweb takes them
  int status = 0;
  EXPECT_LT(SecondsToScrape(port, &status), 2.0);
  EXPECT_EQ(status, 200);
}

// As many idle sockets as threads: each is closed after --metrics_request_timeout_ms, so
// a scrape waits that long at most.
TEST(MetricsEndpoint, IdleConnectionsAreClosedAfterTheRequestTimeout) {
  Harness h(TestModel{}, {"--metrics_threads=2", "--metrics_request_timeout_ms=500"});
  ASSERT_TRUE(h.ok()) << h.error();
  const int port = h.server().metrics_port();
  HalfSentRequest first(port), second(port);
  ASSERT_TRUE(first.ok() && second.ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  int status = 0;
  EXPECT_LT(SecondsToScrape(port, &status), 3.0);
  EXPECT_EQ(status, 200);
}

}  // namespace
}  // namespace sds::itest
