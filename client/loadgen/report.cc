#include "client/loadgen/report.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace sds::loadgen {
namespace {

std::string JsonEscape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += absl::StrFormat("\\u%04x", c);
    } else {
      out += c;
    }
  }
  return out;
}

std::string JsonPercentiles(const Percentiles& p) {
  return absl::StrFormat(
      R"({"count": %d, "mean": %.1f, "p50": %d, "p90": %d, "p99": %d, "p999": %d, "max": %d})",
      p.count, p.mean, p.p50, p.p90, p.p99, p.p999, p.max);
}

void Row(const char* name, const Percentiles& p) {
  std::printf("  %-18s %9lld %9lld %9lld %9lld %9lld %11.1f\n", name, (long long)p.p50,
              (long long)p.p90, (long long)p.p99, (long long)p.p999, (long long)p.max, p.mean);
}

}  // namespace

Summary Summarize(RunResult& r, int32_t num_layers) {
  Summary s;
  std::vector<int64_t> lat;
  lat.reserve(r.stats.calls.size() + r.not_sent_charged.size());
  for (const Sample& c : r.stats.calls) lat.push_back(c.latency_us);
  // Lower bounds, but there: left out, the longest waits of an overloaded run would be
  // the ones missing from its percentiles.
  for (const Sample& c : r.not_sent_charged) lat.push_back(c.latency_us);
  s.latency = loadgen::Summarize(lat);
  s.queue = loadgen::Summarize(r.stats.queue_us);
  s.compute = loadgen::Summarize(r.stats.compute_us);
  if (r.measured_s > 0) {
    s.calls_per_s = static_cast<double>(r.stats.calls.size()) / r.measured_s;
    s.token_layers_per_s = static_cast<double>(r.stats.token_layers) / r.measured_s;
  }
  if (num_layers > 0) s.tokens_per_s = s.token_layers_per_s / num_layers;
  if (r.client_cpu_cores >= 0 && s.token_layers_per_s > 0) {
    s.client_cpu_us_per_token_layer = r.client_cpu_cores * 1e6 / s.token_layers_per_s;
  }
  for (const auto& [code, n] : r.stats.errors) s.errors_total += n;
  return s;
}

void PrintTable(const Config& c, const client::v1::ModelInfo& info, const RunResult& r,
                const Summary& s) {
  std::printf(
      "decode_loadgen  target=%s backend=%s  mode=%s  %s  concurrency=%d channels=%d",
      c.target.c_str(), info.backend().c_str(), c.mode_name.c_str(),
      c.rate > 0 ? absl::StrFormat("open loop %.0f calls/s", c.rate).c_str() : "closed loop",
      c.concurrency, c.channels);
  if (c.mode == Mode::kBatch) std::printf(" batch_size=%d", c.batch_size);
  if (c.mode == Mode::kStream) std::printf(" stream_api=%s", StreamApiName(c.stream_api));
  std::printf("\n  model: %d layers, %d/%d heads, D=%d; top-K %d, prefill %d, measured %.2f s\n",
              info.num_layers(), info.num_q_heads(), info.num_kv_heads(), info.head_dim(), c.topk,
              c.prefill_len, r.measured_s);
  std::printf(
      "  calls/s %.1f   token-layers/s %.1f   tokens/s %.1f   calls %zu   token-layers %lld\n",
      s.calls_per_s, s.token_layers_per_s, s.tokens_per_s, r.stats.calls.size(),
      (long long)r.stats.token_layers);
  std::printf("  %-18s %9s %9s %9s %9s %9s %11s\n", "(microseconds)", "p50", "p90", "p99", "p99.9",
              "max", "mean");
  Row("client latency", s.latency);
  Row("server queue_us", s.queue);
  Row("server compute_us", s.compute);
  if (s.client_cpu_us_per_token_layer >= 0) {
    std::printf(
        "  load generator CPU  %.2f cores, %.1f us per token-layer (all its threads; on a "
        "host it shares with the server, taken from both)\n",
        r.client_cpu_cores, s.client_cpu_us_per_token_layer);
  }
  if (r.not_sent > 0) {
    std::printf(
        "  OVERLOAD: not sent before the end: %lld arrivals, charged their wait so far\n"
        "    (the %zu due in the measured window are in the client latency row as lower "
        "bounds: %zu of its %lld samples)\n",
        (long long)r.not_sent, r.not_sent_charged.size(), r.not_sent_charged.size(),
        (long long)s.latency.count);
  }
  if (s.errors_total == 0) {
    std::printf("  errors (failed requests, i.e. token-layers): none\n");
  } else {
    std::printf("  errors (failed requests, i.e. token-layers): %lld\n", (long long)s.errors_total);
    for (const auto& [code, n] : r.stats.errors) {
      std::printf("    %-20s %8lld  e.g. %s\n", code.c_str(), (long long)n,
                  r.stats.error_examples.at(code).c_str());
    }
  }
  if (r.stats.warmup_errors > 0) {
    std::printf("  warm-up (not counted above): %lld failed requests\n",
                (long long)r.stats.warmup_errors);
  }
  if (r.aborted) std::printf("  ABORTED: %s\n", r.abort_reason.c_str());
  if (r.interrupted) std::printf("  INTERRUPTED (SIGINT/SIGTERM): a partial run\n");
  std::fflush(stdout);
}

absl::Status WriteJson(const std::string& path, const Config& c, const client::v1::ModelInfo& info,
                       const RunResult& r, const Summary& s) {
  std::ofstream f(path);
  if (!f) return absl::UnavailableError(absl::StrCat("cannot write ", path));
  std::string errors;
  for (const auto& [code, n] : r.stats.errors) {
    absl::StrAppend(&errors, errors.empty() ? "" : ", ", "\"", code, "\": ", n);
  }
  f << "{\n";
  f << "  \"label\": \"" << JsonEscape(c.label) << "\",\n";
  f << "  \"target\": \"" << JsonEscape(c.target) << "\",\n";
  f << "  \"backend\": \"" << JsonEscape(info.backend()) << "\",\n";
  f << "  \"mode\": \"" << c.mode_name << "\",\n";
  if (c.mode == Mode::kStream)
    f << "  \"stream_api\": \"" << StreamApiName(c.stream_api) << "\",\n";
  f << "  \"loop\": \"" << (c.rate > 0 ? "open" : "closed") << "\",\n";
  f << absl::StrFormat(
      "  \"rate\": %.3f,\n  \"concurrency\": %d,\n  \"channels\": %d,\n  \"batch_size\": %d,\n",
      c.rate, c.concurrency, c.channels, c.batch_size);
  f << absl::StrFormat(
      "  \"model\": {\"num_layers\": %d, \"num_q_heads\": %d, \"num_kv_heads\": %d, "
      "\"head_dim\": %d},\n",
      info.num_layers(), info.num_q_heads(), info.num_kv_heads(), info.head_dim());
  f << absl::StrFormat("  \"topk\": %d,\n  \"prefill_len\": %d,\n  \"sequences\": %d,\n", c.topk,
                       c.prefill_len, c.NumSequences());
  f << absl::StrFormat("  \"warmup_s\": %.3f,\n  \"measured_s\": %.3f,\n", c.warmup_s,
                       r.measured_s);
  f << absl::StrFormat("  \"calls_ok\": %d,\n  \"token_layers_ok\": %d,\n",
                       static_cast<int64_t>(r.stats.calls.size()), r.stats.token_layers);
  f << absl::StrFormat(
      "  \"calls_per_s\": %.3f,\n  \"token_layers_per_s\": %.3f,\n  \"tokens_per_s\": %.3f,\n",
      s.calls_per_s, s.token_layers_per_s, s.tokens_per_s);
  if (s.client_cpu_us_per_token_layer >= 0) {
    f << absl::StrFormat(
        "  \"client_cpu_cores\": %.6f,\n  \"client_cpu_us_per_token_layer\": %.3f,\n",
        r.client_cpu_cores, s.client_cpu_us_per_token_layer);
  } else {
    f << "  \"client_cpu_cores\": null,\n  \"client_cpu_us_per_token_layer\": null,\n";
  }
  f << "  \"latency_us\": " << JsonPercentiles(s.latency) << ",\n";
  f << "  \"server_queue_us\": " << JsonPercentiles(s.queue) << ",\n";
  f << "  \"server_compute_us\": " << JsonPercentiles(s.compute) << ",\n";
  f << "  \"errors_unit\": \"request (token-layer); a failed DecodeBatch RPC counts each of "
       "its requests\",\n";
  f << "  \"errors_total\": " << s.errors_total << ",\n";
  f << "  \"errors\": {" << errors << "},\n";
  f << "  \"warmup_errors\": " << r.stats.warmup_errors << ",\n";
  // not_sent_charged of latency_us's samples are arrivals never sent, at their wait so far.
  f << "  \"not_sent\": " << r.not_sent << ",\n";
  f << "  \"not_sent_charged\": " << r.not_sent_charged.size() << ",\n";
  f << "  \"not_sent_note\": \"not sent before the end, charged their wait so far: those due "
       "in the measured window are in latency_us as lower bounds\",\n";
  f << "  \"aborted\": " << (r.aborted ? "true" : "false") << ",\n";
  f << "  \"interrupted\": " << (r.interrupted ? "true" : "false") << ",\n";
  f << "  \"abort_reason\": \"" << JsonEscape(r.abort_reason) << "\"\n";
  f << "}\n";
  f.close();
  return f.good() ? absl::OkStatus() : absl::DataLossError(absl::StrCat("short write to ", path));
}

absl::Status WritePlots(const std::string& prefix, const Config& c, const RunResult& r) {
  if (r.stats.calls.empty() && r.not_sent_charged.empty()) {
    return absl::FailedPreconditionError("no samples to plot");
  }
  const std::string time_dat = prefix + "_latency_time.dat";
  const std::string unsent_dat = prefix + "_not_sent_time.dat";
  const std::string dist_dat = prefix + "_latency_dist.dat";
  const auto written = [](std::ofstream& f, const std::string& path) {
    f.close();
    return f.good() ? absl::OkStatus()
                    : absl::UnavailableError(absl::StrCat("cannot write ", path));
  };
  // At most ~100k points per series keep gnuplot quick; thin evenly.
  const auto write_time = [&](const std::vector<Sample>& samples, const std::string& path) {
    std::ofstream t(path);
    const size_t step = std::max<size_t>(1, samples.size() / 100000);
    std::vector<Sample> by_time = samples;
    std::sort(by_time.begin(), by_time.end(),
              [](const Sample& a, const Sample& b) { return a.start_us < b.start_us; });
    for (size_t i = 0; i < by_time.size(); i += step) {
      t << by_time[i].start_us / 1e6 << ' ' << by_time[i].latency_us / 1e3 << '\n';
    }
    return written(t, path);
  };
  if (absl::Status st = write_time(r.stats.calls, time_dat); !st.ok()) return st;
  if (absl::Status st = write_time(r.not_sent_charged, unsent_dat); !st.ok()) return st;
  {
    // The distribution is the latency row's: calls and charged arrivals together.
    std::vector<int64_t> lat;
    for (const Sample& s : r.stats.calls) lat.push_back(s.latency_us);
    for (const Sample& s : r.not_sent_charged) lat.push_back(s.latency_us);
    std::sort(lat.begin(), lat.end());
    std::ofstream d(dist_dat);
    const size_t n = lat.size();
    const size_t dstep = std::max<size_t>(1, n / 20000);
    for (size_t i = 0; i < n; i += dstep) {
      const double q = static_cast<double>(i + 1) / static_cast<double>(n);
      d << lat[i] / 1e3 << ' ' << q << ' ' << 1.0 / std::max(1.0 - q, 1e-6) << '\n';
    }
    d << lat.back() / 1e3 << " 1 1e6\n";
    if (absl::Status st = written(d, dist_dat); !st.ok()) return st;
  }
  const std::string title =
      absl::StrFormat("%s %s, concurrency %d%s", c.target, c.mode_name, c.concurrency,
                      c.rate > 0 ? absl::StrFormat(", open loop %.0f/s", c.rate) : "");
  const std::string gp = prefix + "_plots.gp";
  const std::string time_png = prefix + "_latency_time.png";
  const std::string dist_png = prefix + "_latency_dist.png";
  {
    std::ofstream g(gp);
    g << "set terminal pngcairo size 1000,600 noenhanced\n";
    g << "set grid\n";
    g << "set output '" << time_png << "'\n";
    g << "set title 'latency over time: " << title << "'\n";
    g << "set xlabel 'time since warm-up end (s)'\nset ylabel 'latency (ms)'\n";
    // gnuplot fails on an empty file: only the series that have points.
    std::vector<std::string> series;
    if (!r.stats.calls.empty()) {
      series.push_back(
          absl::StrCat("'", time_dat, "' using 1:2 with dots lc rgb '#1f77b4' ", "title 'calls'"));
    }
    if (!r.not_sent_charged.empty()) {
      series.push_back(absl::StrCat("'", unsent_dat, "' using 1:2 with dots lc rgb '#d62728' ",
                                    "title 'not sent (wait so far)'"));
    }
    g << "plot " << absl::StrJoin(series, ", ") << "\n";
    g << "set output '" << dist_png << "'\n";
    g << "set title 'latency distribution: " << title << "'\n";
    g << "set logscale x 10\nset xlabel 'percentile'\nset ylabel 'latency (ms)'\n";
    g << "set xtics ('50' 2, '90' 10, '99' 100, '99.9' 1000, '99.99' 10000)\n";
    g << "set xrange [1:*]\n";
    g << "plot '" << dist_dat << "' using 3:1 with lines lw 2 title 'client latency'\n";
    if (absl::Status st = written(g, gp); !st.ok()) return st;
  }
  if (!c.plot_render) return absl::OkStatus();
  const std::string cmd = absl::StrCat("gnuplot '", gp, "'");
  if (std::system(cmd.c_str()) != 0) {
    return absl::UnavailableError(absl::StrCat("gnuplot failed (is it installed?): ", cmd));
  }
  for (const std::string& png : {time_png, dist_png}) {
    std::error_code ec;
    if (std::filesystem::file_size(png, ec) == 0 || ec) {
      return absl::UnavailableError(absl::StrCat("gnuplot did not write ", png));
    }
  }
  return absl::OkStatus();
}

}  // namespace sds::loadgen
