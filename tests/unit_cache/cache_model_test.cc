// Randomised model-based test: thousands of random operations run against the cache
// and against a deliberately simple reference model (sequences -> lists of abstract
// page ids with reference counts, per-layer lengths, expected bytes per position).
// After every operation the status codes must agree; periodically the stats, the
// sharing structure of the page tables and every written byte are compared.
// Seeds are fresh each run; reproduce a failure with SDS_TEST_SEED=<seed>.
#include <cstdlib>
#include <map>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "cache_test_util.h"
#include "gtest/gtest.h"
#include "paged_cache/paged_kv_cache.h"

namespace sds {
namespace {

using ::sds::cache_test::MakeCache;
using ::sds::cache_test::SlotHolds;
using ::sds::cache_test::StatsTuple;
using ::sds::cache_test::Table;
using ::sds::cache_test::WriteSlot;
using Code = absl::StatusCode;

// The reference: page ids are never reused, so sharing is explicit and simple.
class Model {
 public:
  struct Seq {
    std::vector<int64_t> pages;
    std::vector<int64_t> lengths;
    std::vector<std::vector<int>> tags;  // [layer][pos]; -1 = contents unknown
  };

  Model(int64_t total, int32_t layers, int64_t page_size)
      : total_(total), layers_(layers), page_size_(page_size) {}

  int64_t free() const { return total_ - static_cast<int64_t>(refs_.size()); }

  Code Create(const std::string& id, int64_t reserve) {
    if (id.empty() || reserve < 0) return Code::kInvalidArgument;
    if (seqs_.contains(id)) return Code::kAlreadyExists;
    const int64_t pages = (reserve + page_size_ - 1) / page_size_;
    if (pages > free()) return Code::kResourceExhausted;
    Seq& s = seqs_[id];
    s.lengths.assign(layers_, 0);
    s.tags.assign(layers_, {});
    for (int64_t i = 0; i < pages; ++i) s.pages.push_back(NewPage());
    return Code::kOk;
  }

  Code Fork(const std::string& src, const std::string& dst) {
    if (dst.empty()) return Code::kInvalidArgument;
    if (!seqs_.contains(src)) return Code::kNotFound;
    if (seqs_.contains(dst)) return Code::kAlreadyExists;
    seqs_[dst] = seqs_[src];
    for (int64_t p : seqs_[dst].pages) ++refs_[p];
    return Code::kOk;
  }

  Code Release(const std::string& id, int64_t* freed) {
    auto it = seqs_.find(id);
    if (it == seqs_.end()) return Code::kNotFound;
    *freed = 0;
    for (int64_t p : it->second.pages) {
      if (--refs_[p] == 0) {
        refs_.erase(p);
        ++*freed;
      }
    }
    seqs_.erase(it);
    return Code::kOk;
  }

  Code Prepare(const std::string& id, int32_t layer, int64_t start, int64_t n) {
    if (layer < 0 || layer >= layers_ || start < 0 || n < 0) return Code::kInvalidArgument;
    auto it = seqs_.find(id);
    if (it == seqs_.end()) return Code::kNotFound;
    Seq& s = it->second;
    if (start > s.lengths[layer]) return Code::kFailedPrecondition;
    if (n == 0) return Code::kOk;
    const int64_t first = start / page_size_, end = (start + n - 1) / page_size_ + 1;
    int64_t needed = 0;
    for (int64_t j = first; j < end; ++j) {
      needed += (j >= static_cast<int64_t>(s.pages.size()) || refs_[s.pages[j]] > 1) ? 1 : 0;
    }
    if (needed > free()) return Code::kResourceExhausted;
    for (int64_t j = first; j < end; ++j) {
      if (j >= static_cast<int64_t>(s.pages.size())) {
        s.pages.push_back(NewPage());
      } else if (refs_[s.pages[j]] > 1) {
        ++copies_;
        --refs_[s.pages[j]];
        s.pages[j] = NewPage();
      }
    }
    return Code::kOk;
  }

  Code Commit(const std::string& id, int32_t layer, int64_t start, int64_t n) {
    if (layer < 0 || layer >= layers_ || start < 0 || n < 0) return Code::kInvalidArgument;
    auto it = seqs_.find(id);
    if (it == seqs_.end()) return Code::kNotFound;
    Seq& s = it->second;
    if (start > s.lengths[layer]) return Code::kFailedPrecondition;
    if (start + n > static_cast<int64_t>(s.pages.size()) * page_size_) {
      return Code::kFailedPrecondition;
    }
    s.lengths[layer] = std::max(s.lengths[layer], start + n);
    s.tags[layer].resize(s.lengths[layer], -1);  // committed without a write: unknown
    return Code::kOk;
  }

  int64_t Tokens() const {
    int64_t t = 0;
    for (const auto& [id, s] : seqs_) t += *std::max_element(s.lengths.begin(), s.lengths.end());
    return t;
  }

  std::map<std::string, Seq>& seqs() { return seqs_; }
  int64_t used() const { return static_cast<int64_t>(refs_.size()); }
  int64_t copies() const { return copies_; }

 private:
  int64_t NewPage() {
    refs_[next_page_] = 1;
    return next_page_++;
  }

  int64_t total_;
  int32_t layers_;
  int64_t page_size_;
  int64_t next_page_ = 0;
  int64_t copies_ = 0;  // copy-on-write events, to prove the run exercised them
  std::map<int64_t, int> refs_;
  std::map<std::string, Seq> seqs_;
};

struct Params {
  ScaleMode mode;
  int32_t page_size;
  friend void PrintTo(const Params& p, std::ostream* os) {
    *os << (p.mode == ScaleMode::kPerTensor ? "per_tensor" : "per_token_head") << ", page_size "
        << p.page_size;
  }
};

class ModelTest : public ::testing::TestWithParam<Params> {
 protected:
  static uint64_t Seed() {
    if (const char* env = std::getenv("SDS_TEST_SEED")) return std::strtoull(env, nullptr, 10);
    return (uint64_t{std::random_device{}()} << 32) | std::random_device{}();
  }

  // Stats, sharing structure (a bijection between model and real page ids) and bytes.
  void CheckAll(PagedKvCache& cache, Model& model) {
    const int64_t total = cache.config().num_pages;
    ASSERT_EQ(StatsTuple(cache.Stats()),
              std::make_tuple(total, model.used(), total - model.used(),
                              static_cast<int64_t>(model.seqs().size()), model.Tokens()));
    std::map<int64_t, int32_t> to_real;
    std::map<int32_t, int64_t> to_model;
    const int64_t size = cache.config().page_size;
    for (auto& [id, s] : model.seqs()) {
      const std::vector<int32_t> real = Table(cache, id);
      ASSERT_EQ(real.size(), s.pages.size()) << "table of " << id;
      for (size_t j = 0; j < real.size(); ++j) {
        auto [a, new_a] = to_real.emplace(s.pages[j], real[j]);
        auto [b, new_b] = to_model.emplace(real[j], s.pages[j]);
        ASSERT_EQ(a->second, real[j]) << id << " page " << j << " should share";
        ASSERT_EQ(b->second, s.pages[j]) << id << " page " << j << " must not share";
      }
      for (int32_t layer = 0; layer < cache.config().num_layers; ++layer) {
        ASSERT_EQ(*cache.Length(id, layer), s.lengths[layer]) << id << " layer " << layer;
        for (int64_t pos = 0; pos < s.lengths[layer]; ++pos) {
          const int tag = s.tags[layer][pos];
          if (tag < 0) continue;
          const int64_t slot = real[pos / size] * size + pos % size;
          ASSERT_TRUE(SlotHolds(cache.view(), layer, slot, static_cast<uint8_t>(tag)))
              << id << " layer " << layer << " pos " << pos << " lost its bytes";
        }
      }
    }
  }

  // The runs together must have reached the interesting paths, or they prove little.
  // Counted over all runs of a test: a single random run misses copy-on-write about once
  // in 400 (page size 1), which made a per-run check fail CI at random.
  void ExpectCoverage() {
    EXPECT_GT(copies_, 0) << "no copy-on-write happened";
    for (auto [op, code] : {std::pair{0, Code::kOk},
                            {0, Code::kAlreadyExists},
                            {1, Code::kOk},
                            {2, Code::kOk},
                            {2, Code::kResourceExhausted},
                            {2, Code::kFailedPrecondition},
                            {2, Code::kInvalidArgument},
                            {2, Code::kNotFound}}) {
      EXPECT_GT(seen_[std::pair(op, code)], 0) << "operation " << op << " never returned " << code;
    }
  }

  int64_t copies_ = 0;                        // copy-on-write events over the runs
  std::map<std::pair<int, Code>, int> seen_;  // (operation, code) -> count over the runs

  void Run(uint64_t seed, int ops) {
    std::mt19937_64 rng(seed);
    auto uniform = [&](int64_t lo, int64_t hi) {
      return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
    };
    CacheConfig config;
    config.num_layers = static_cast<int32_t>(uniform(1, 3));
    config.num_kv_heads = 2;
    config.head_dim = 4;
    config.page_size = GetParam().page_size;
    config.num_pages = uniform(8, 40);
    config.scale_mode = GetParam().mode;
    auto cache = MakeCache(config);
    ASSERT_NE(cache, nullptr);
    Model model(config.num_pages, config.num_layers, config.page_size);
    const int64_t ps = config.page_size;
    auto pick_id = [&] { return "s" + std::to_string(uniform(0, 11)); };
    std::map<std::pair<int, Code>, int>& seen = seen_;  // (operation, code) -> count

    for (int op = 0; op < ops; ++op) {
      const int64_t kind = uniform(0, 99);
      const std::string id = pick_id();
      if (kind < 10) {
        const int64_t reserve = uniform(0, 20) == 0 ? -1 : uniform(0, 3 * ps);
        const Code want = model.Create(id, reserve);
        ++seen[{0, want}];
        ASSERT_EQ(cache->CreateSequence(id, reserve).code(), want)
            << "op " << op << " create " << id << " reserve " << reserve;
      } else if (kind < 18) {
        const std::string dst = uniform(0, 30) == 0 ? "" : pick_id();
        const Code want = model.Fork(id, dst);
        ++seen[{1, want}];
        ASSERT_EQ(cache->ForkSequence(id, dst).code(), want)
            << "op " << op << " fork " << id << " -> " << dst;
      } else if (kind < 26) {
        int64_t freed = -1;
        const Code want = model.Release(id, &freed);
        absl::StatusOr<int64_t> got = cache->ReleaseSequence(id);
        ASSERT_EQ(got.status().code(), want) << "op " << op << " release " << id;
        if (got.ok()) {
          ASSERT_EQ(*got, freed) << "op " << op << " pages freed by " << id;
        }
      } else {
        int32_t layer = static_cast<int32_t>(uniform(0, config.num_layers - 1));
        if (uniform(0, 40) == 0) layer = uniform(0, 1) ? -1 : config.num_layers;
        const auto seq = model.seqs().find(id);
        const int64_t length = seq == model.seqs().end() || layer < 0 || layer >= config.num_layers
                                   ? 0
                                   : seq->second.lengths[layer];
        int64_t start = length;  // mostly appends
        const int64_t mode = uniform(0, 19);
        if (mode < 4) start = uniform(0, length);            // rewrite
        if (mode == 4) start = length + uniform(1, 2 * ps);  // gap
        if (mode == 5 && uniform(0, 3) == 0) start = -1;     // invalid
        int64_t n = uniform(0, 2 * ps + 1);
        if (uniform(0, 40) == 0) n = -1;
        const bool commit_only = uniform(0, 30) == 0;  // a commit with no PrepareWrite
        if (commit_only) {
          ASSERT_EQ(cache->CommitWrite(id, layer, start, n).code(),
                    model.Commit(id, layer, start, n))
              << "op " << op << " bare commit " << id << " layer " << layer << " at " << start
              << " n " << n;
          continue;
        }
        std::vector<int64_t> slots;
        const Code want = model.Prepare(id, layer, start, n);
        ++seen[{2, want}];
        ASSERT_EQ(cache->PrepareWrite(id, layer, start, n, &slots).code(), want)
            << "op " << op << " prepare " << id << " layer " << layer << " at " << start << " n "
            << n << " (length " << length << ", free " << model.free() << ")";
        if (want != Code::kOk) continue;
        ASSERT_EQ(static_cast<int64_t>(slots.size()), n);
        const std::vector<int32_t> table = Table(*cache, id);
        Model::Seq& s = model.seqs()[id];
        if (s.tags[layer].size() < static_cast<size_t>(start + n)) s.tags[layer].resize(start + n);
        for (int64_t i = 0; i < n; ++i) {
          const int64_t pos = start + i;
          ASSERT_EQ(slots[i], table[pos / ps] * ps + pos % ps) << "slot of position " << pos;
          const int tag = static_cast<int>(uniform(0, 255));
          WriteSlot(cache->view(), layer, slots[i], static_cast<uint8_t>(tag));
          s.tags[layer][pos] = tag;
        }
        ASSERT_EQ(cache->CommitWrite(id, layer, start, n).code(),
                  model.Commit(id, layer, start, n));
      }
      if (op % 64 == 0 || uniform(0, 49) == 0) {
        CheckAll(*cache, model);
        if (HasFatalFailure()) return;
      }
    }
    CheckAll(*cache, model);
    if (HasFatalFailure()) return;
    copies_ += model.copies();
    // Release everything: no page may leak.
    while (!model.seqs().empty()) {
      const std::string id = model.seqs().begin()->first;
      int64_t freed = 0;
      model.Release(id, &freed);
      absl::StatusOr<int64_t> got = cache->ReleaseSequence(id);
      ASSERT_TRUE(got.ok()) << got.status();
      ASSERT_EQ(*got, freed);
    }
    EXPECT_EQ(StatsTuple(cache->Stats()),
              std::make_tuple(config.num_pages, 0, config.num_pages, 0, 0))
        << "pages leaked";
  }
};

TEST_P(ModelTest, RandomOperationsAgreeWithModel) {
  for (int run = 0; run < 4; ++run) {
    const uint64_t seed = Seed();
    SCOPED_TRACE(::testing::Message()
                 << "seed " << seed << "; reproduce with SDS_TEST_SEED=" << seed);
    Run(seed, 3000);
    if (HasFailure()) {
      std::printf("cache_model_test failed with seed %llu\n",
                  static_cast<unsigned long long>(seed));
      return;
    }
  }
  ExpectCoverage();
}

INSTANTIATE_TEST_SUITE_P(
    Geometries, ModelTest,
    ::testing::Values(Params{ScaleMode::kPerTensor, 1}, Params{ScaleMode::kPerTensor, 4},
                      Params{ScaleMode::kPerTokenHead, 2}, Params{ScaleMode::kPerTokenHead, 8}),
    [](const auto& info) {
      return std::string(info.param.mode == ScaleMode::kPerTensor ? "PerTensor" : "PerTokenHead") +
             "Page" + std::to_string(info.param.page_size);
    });

}  // namespace
}  // namespace sds
