// Deterministic tests of the paged KV cache: validation, allocation at page
// boundaries, fork and copy-on-write through the CacheView bytes, exhaustion.
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "cache_test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "paged_cache/paged_kv_cache.h"

namespace sds {
namespace {

using ::sds::cache_test::MakeCache;
using ::sds::cache_test::SlotHolds;
using ::sds::cache_test::StatsTuple;
using ::sds::cache_test::Table;
using ::sds::cache_test::WriteSlot;
using ::testing::HasSubstr;

CacheConfig SmallConfig(int64_t pages = 16, ScaleMode mode = ScaleMode::kPerTensor) {
  CacheConfig c;
  c.num_layers = 3;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.page_size = 4;
  c.num_pages = pages;
  c.scale_mode = mode;
  return c;
}

// PrepareWrite + write tag bytes in every layer + CommitWrite, for tokens [start, start+n).
void Append(PagedKvCache& cache, const std::string& id, int64_t start, int64_t n, uint8_t tag) {
  for (int32_t layer = 0; layer < cache.config().num_layers; ++layer) {
    std::vector<int64_t> slots;
    ASSERT_TRUE(cache.PrepareWrite(id, layer, start, n, &slots).ok());
    for (int64_t i = 0; i < n; ++i) WriteSlot(cache.view(), layer, slots[i], tag + i + layer);
    ASSERT_TRUE(cache.CommitWrite(id, layer, start, n).ok());
  }
}

int64_t SlotOf(PagedKvCache& cache, const std::string& id, int64_t pos) {
  std::vector<int32_t> t = Table(cache, id);
  const int64_t s = cache.config().page_size;
  return t.at(pos / s) * s + pos % s;
}

TEST(PagedKvCache, CreateRejectsBadConfigs) {
  auto bad = [](auto mutate) {
    CacheConfig c = SmallConfig();
    mutate(c);
    return PagedKvCache::Create(c, MakeHostPageMemory()).status();
  };
  EXPECT_THAT(bad([](CacheConfig& c) { c.page_size = 6; }).message(), HasSubstr("power of two"));
  EXPECT_EQ(bad([](CacheConfig& c) { c.num_pages = 0; }).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad([](CacheConfig& c) { c.num_layers = 0; }).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad([](CacheConfig& c) { c.num_pages = int64_t{1} << 40; }).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad([](CacheConfig& c) {
              c.layer_k_scales = {1.0f, 2.0f};
            }).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad([](CacheConfig& c) {
              c.layer_v_scales = {1.0f, -1.0f, 1.0f};
            }).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PagedKvCache::Create(SmallConfig(), nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(PagedKvCache, ViewLayoutAndSizes) {
  for (ScaleMode mode : {ScaleMode::kPerTensor, ScaleMode::kPerTokenHead}) {
    CacheConfig c = SmallConfig(16, mode);
    c.layer_k_scales = {0.5f, 1.0f, 2.0f};
    auto cache = MakeCache(c);
    const CacheView v = cache->view();
    const int64_t per_layer_page = int64_t{c.page_size} * c.num_kv_heads * c.head_dim;
    const bool per_token = mode == ScaleMode::kPerTokenHead;
    EXPECT_EQ(PagedKvCache::BytesPerPage(c),
              c.num_layers * (2 * per_layer_page + (per_token ? 2 * 4 * 4 * 2 : 0)));
    EXPECT_EQ(v.geo.num_pages, 16);
    EXPECT_EQ(v.geo.scale_mode, mode);
    EXPECT_GE(v.v - v.k, c.num_layers * v.geo.LayerElements());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(v.k) % 64, 0u);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(v.v) % 64, 0u);
    EXPECT_EQ(v.k_token_scale != nullptr, per_token);
    EXPECT_EQ(v.v_token_scale != nullptr, per_token);
    EXPECT_EQ(v.layer_k_scale != nullptr, !per_token);
    if (!per_token) {
      EXPECT_EQ(v.layer_k_scale[2], 2.0f);
      EXPECT_EQ(v.layer_v_scale[1], 1.0f);  // empty list defaults to 1.0
    }
    ASSERT_EQ(cache->config().layer_v_scales.size(), 3u);
    // The whole pool is writable and zero-initialised (ASan would flag an overrun).
    const CacheView& cv = v;
    EXPECT_EQ(cv.k[c.num_layers * v.geo.LayerElements() - 1], 0);
    EXPECT_EQ(cv.v[c.num_layers * v.geo.LayerElements() - 1], 0);
    if (per_token) {
      EXPECT_EQ(cv.v_token_scale[c.num_layers * v.geo.LayerScales() - 1], 0.0f);
    }
  }
}

TEST(PagedKvCache, CreateReservesPagesUpFront) {
  auto cache = MakeCache(SmallConfig());
  ASSERT_TRUE(cache->CreateSequence("a", 9).ok());  // 9 tokens / 4 per page -> 3 pages
  EXPECT_EQ(Table(*cache, "a").size(), 3u);
  EXPECT_EQ(StatsTuple(cache->Stats()), std::make_tuple(16, 3, 13, 1, 0));
  ASSERT_TRUE(cache->CreateSequence("b", 0).ok());
  EXPECT_TRUE(Table(*cache, "b").empty());
  EXPECT_EQ(cache->CreateSequence("a", 0).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(cache->CreateSequence("c", -1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache->CreateSequence("", 0).code(), absl::StatusCode::kInvalidArgument);
  absl::Status full = cache->CreateSequence("c", 14 * 4);
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(full.message(), HasSubstr("needs 14 pages, 13 free of 16"));
  EXPECT_FALSE(cache->Contains("c"));
  EXPECT_TRUE(cache->CreateSequence("c", 13 * 4).ok());
  EXPECT_EQ(cache->Stats().pages_free, 0);
}

TEST(PagedKvCache, UnknownSequenceIsNotFound) {
  auto cache = MakeCache(SmallConfig());
  std::vector<int64_t> slots;
  std::vector<int32_t> pages;
  auto nf = absl::StatusCode::kNotFound;
  EXPECT_EQ(cache->PrepareWrite("x", 0, 0, 1, &slots).code(), nf);
  EXPECT_EQ(cache->CommitWrite("x", 0, 0, 1).code(), nf);
  EXPECT_EQ(cache->ForkSequence("x", "y").code(), nf);
  EXPECT_EQ(cache->ReleaseSequence("x").status().code(), nf);
  EXPECT_EQ(cache->AppendPageTable("x", &pages).code(), nf);
  EXPECT_EQ(cache->Length("x", 0).status().code(), nf);
  EXPECT_THAT(cache->Length("x", 0).status().message(), HasSubstr("\"x\""));
  EXPECT_FALSE(cache->Contains("x"));
}

TEST(PagedKvCache, IncarnationSeparatesASequenceFromItsSuccessor) {
  auto cache = MakeCache(SmallConfig());
  ASSERT_TRUE(cache->CreateSequence("s", 0).ok());
  const absl::StatusOr<uint64_t> first = cache->Incarnation("s");
  ASSERT_TRUE(first.ok());
  EXPECT_NE(*first, 0u);
  std::vector<int64_t> slots;
  ASSERT_TRUE(cache->PrepareWrite("s", 0, 0, 1, &slots, *first).ok());
  ASSERT_TRUE(cache->CommitWrite("s", 0, 0, 1, *first).ok());
  ASSERT_TRUE(cache->ForkSequence("s", "f").ok());
  EXPECT_NE(*cache->Incarnation("f"), *first);
  ASSERT_TRUE(cache->ReleaseSequence("s").ok());
  ASSERT_TRUE(cache->CreateSequence("s", 0).ok());
  const uint64_t second = *cache->Incarnation("s");
  EXPECT_NE(second, *first);
  // Work accepted for the first "s" finds no sequence; the successor is untouched.
  EXPECT_EQ(cache->PrepareWrite("s", 0, 0, 1, &slots, *first).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(cache->CommitWrite("s", 0, 0, 1, *first).code(), absl::StatusCode::kNotFound);
  std::vector<int32_t> pages;
  EXPECT_EQ(cache->AppendPageTable("s", &pages, *first).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(*cache->Length("s", 0), 0);
  EXPECT_TRUE(pages.empty());
  // 0 and the current incarnation both reach the successor.
  EXPECT_TRUE(cache->PrepareWrite("s", 0, 0, 1, &slots, second).ok());
  EXPECT_TRUE(cache->PrepareWrite("s", 0, 0, 1, &slots).ok());
  EXPECT_EQ(cache->Incarnation("gone").status().code(), absl::StatusCode::kNotFound);
}

TEST(PagedKvCache, BadArgumentsAreInvalid) {
  auto cache = MakeCache(SmallConfig());
  ASSERT_TRUE(cache->CreateSequence("a", 0).ok());
  std::vector<int64_t> slots;
  auto inv = absl::StatusCode::kInvalidArgument;
  EXPECT_EQ(cache->PrepareWrite("a", -1, 0, 1, &slots).code(), inv);
  EXPECT_EQ(cache->PrepareWrite("a", 3, 0, 1, &slots).code(), inv);
  EXPECT_THAT(cache->PrepareWrite("a", 3, 0, 1, &slots).message(), HasSubstr("3 layers"));
  EXPECT_EQ(cache->PrepareWrite("a", 0, -1, 1, &slots).code(), inv);
  EXPECT_EQ(cache->PrepareWrite("a", 0, 0, -1, &slots).code(), inv);
  EXPECT_EQ(cache->PrepareWrite("a", 0, 0, 1, nullptr).code(), inv);
  EXPECT_EQ(cache->CommitWrite("a", 7, 0, 1).code(), inv);
  EXPECT_EQ(cache->CommitWrite("a", 0, 0, -2).code(), inv);
  EXPECT_EQ(cache->Length("a", 3).status().code(), inv);
  EXPECT_EQ(cache->ForkSequence("a", "").code(), inv);
  EXPECT_EQ(cache->Stats().pages_used, 0);
}

TEST(PagedKvCache, GapIsFailedPreconditionPerLayer) {
  auto cache = MakeCache(SmallConfig());
  ASSERT_TRUE(cache->CreateSequence("a", 0).ok());
  std::vector<int64_t> slots;
  ASSERT_TRUE(cache->PrepareWrite("a", 2, 0, 3, &slots).ok());
  ASSERT_TRUE(cache->CommitWrite("a", 2, 0, 3).ok());
  absl::Status gap = cache->PrepareWrite("a", 2, 7, 1, &slots);
  EXPECT_EQ(gap.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(gap.message(),
              HasSubstr("position 7 of layer 2 needs positions 0..6 written; layer 2 has 3"));
  // Layer 0 has nothing yet: its own length counts, not layer 2's.
  EXPECT_EQ(cache->PrepareWrite("a", 0, 1, 1, &slots).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(cache->CommitWrite("a", 0, 1, 1).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(cache->PrepareWrite("a", 2, 3, 1, &slots).ok());  // exactly at the end
  EXPECT_EQ(Table(*cache, "a").size(), 1u);
}

TEST(PagedKvCache, AllocatesAtPageBoundaries) {
  auto cache = MakeCache(SmallConfig());
  ASSERT_TRUE(cache->CreateSequence("a", 0).ok());
  std::vector<int64_t> slots;
  ASSERT_TRUE(cache->PrepareWrite("a", 0, 0, 0, &slots).ok());  // empty write: no page
  EXPECT_EQ(cache->Stats().pages_used, 0);
  EXPECT_TRUE(slots.empty());
  ASSERT_TRUE(cache->PrepareWrite("a", 0, 0, 4, &slots).ok());  // exactly one page
  EXPECT_EQ(cache->Stats().pages_used, 1);
  ASSERT_TRUE(cache->CommitWrite("a", 0, 0, 4).ok());
  ASSERT_TRUE(cache->PrepareWrite("a", 0, 4, 0, &slots).ok());  // at the boundary, empty
  EXPECT_EQ(cache->Stats().pages_used, 1);
  ASSERT_TRUE(cache->PrepareWrite("a", 0, 3, 2, &slots).ok());  // crosses into page 2
  std::vector<int32_t> t = Table(*cache, "a");
  ASSERT_EQ(t.size(), 2u);
  EXPECT_EQ(slots, (std::vector<int64_t>{t[0] * 4 + 3, t[1] * 4 + 0}));
  ASSERT_TRUE(cache->CommitWrite("a", 0, 3, 2).ok());
  EXPECT_EQ(*cache->Length("a", 0), 5);
  ASSERT_TRUE(cache->PrepareWrite("a", 0, 5, 7, &slots).ok());  // 5..11: pages 2 (have), 3
  EXPECT_EQ(Table(*cache, "a").size(), 3u);
  ASSERT_TRUE(cache->PrepareWrite("a", 1, 0, 12, &slots).ok());  // other layer: same table
  EXPECT_EQ(cache->Stats().pages_used, 3);
  EXPECT_EQ(*cache->Length("a", 1), 0);  // nothing committed yet
}

TEST(PagedKvCache, CommitTracksLengthAndTokens) {
  auto cache = MakeCache(SmallConfig());
  ASSERT_TRUE(cache->CreateSequence("a", 0).ok());
  std::vector<int64_t> slots;
  EXPECT_EQ(cache->CommitWrite("a", 0, 0, 1).code(), absl::StatusCode::kFailedPrecondition)
      << "commit without PrepareWrite has no page";
  ASSERT_TRUE(cache->PrepareWrite("a", 0, 0, 6, &slots).ok());
  ASSERT_TRUE(cache->CommitWrite("a", 0, 0, 6).ok());
  ASSERT_TRUE(cache->PrepareWrite("a", 1, 0, 2, &slots).ok());
  ASSERT_TRUE(cache->CommitWrite("a", 1, 0, 2).ok());
  ASSERT_TRUE(cache->CommitWrite("a", 0, 2, 1).ok());  // rewrite: length stays 6
  EXPECT_EQ(*cache->Length("a", 0), 6);
  EXPECT_EQ(*cache->Length("a", 1), 2);
  EXPECT_EQ(cache->Stats().tokens, 6);  // longest layer
  ASSERT_TRUE(cache->CreateSequence("b", 0).ok());
  ASSERT_TRUE(cache->PrepareWrite("b", 2, 0, 1, &slots).ok());
  ASSERT_TRUE(cache->CommitWrite("b", 2, 0, 1).ok());
  EXPECT_EQ(cache->Stats().tokens, 7);
  ASSERT_TRUE(cache->ReleaseSequence("a").ok());
  EXPECT_EQ(cache->Stats().tokens, 1);
}

TEST(PagedKvCache, ForkSharesPagesAndLengths) {
  auto cache = MakeCache(SmallConfig());
  ASSERT_TRUE(cache->CreateSequence("p", 16).ok());  // 4 reserved pages
  Append(*cache, "p", 0, 6, 10);
  ASSERT_TRUE(cache->ForkSequence("p", "c").ok());
  EXPECT_EQ(Table(*cache, "c"), Table(*cache, "p"));
  for (int32_t layer = 0; layer < 3; ++layer) EXPECT_EQ(*cache->Length("c", layer), 6);
  EXPECT_EQ(StatsTuple(cache->Stats()), std::make_tuple(16, 4, 12, 2, 12));
  EXPECT_EQ(cache->ForkSequence("p", "c").code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(cache->ForkSequence("p", "p").code(), absl::StatusCode::kAlreadyExists);
  // Shared pages survive the parent; they free with the last owner.
  EXPECT_EQ(*cache->ReleaseSequence("p"), 0);
  EXPECT_EQ(cache->Stats().pages_used, 4);
  for (int64_t pos = 0; pos < 6; ++pos) {
    EXPECT_TRUE(SlotHolds(cache->view(), 1, SlotOf(*cache, "c", pos), 10 + pos + 1));
  }
  EXPECT_EQ(*cache->ReleaseSequence("c"), 4);
  EXPECT_EQ(StatsTuple(cache->Stats()), std::make_tuple(16, 0, 16, 0, 0));
}

class CopyOnWrite : public ::testing::TestWithParam<ScaleMode> {};

TEST_P(CopyOnWrite, WriterGetsPrivatePageOtherOwnerKeepsBytes) {
  auto cache = MakeCache(SmallConfig(16, GetParam()));
  ASSERT_TRUE(cache->CreateSequence("p", 0).ok());
  Append(*cache, "p", 0, 6, 10);  // page 0 full, page 1 holds positions 4, 5
  ASSERT_TRUE(cache->ForkSequence("p", "c").ok());
  const std::vector<int32_t> parent_table = Table(*cache, "p");
  const int64_t used = cache->Stats().pages_used;

  // The child appends position 6 of layer 1 (into shared page 1) and rewrites 5.
  std::vector<int64_t> slots;
  ASSERT_TRUE(cache->PrepareWrite("c", 1, 5, 2, &slots).ok());
  EXPECT_EQ(cache->Stats().pages_used, used + 1);
  EXPECT_EQ(Table(*cache, "p"), parent_table);
  std::vector<int32_t> child_table = Table(*cache, "c");
  EXPECT_EQ(child_table[0], parent_table[0]);  // untouched page stays shared
  EXPECT_NE(child_table[1], parent_table[1]);
  // Write new bytes into the child's slots in every layer, as a kernel would.
  for (int32_t layer = 0; layer < 3; ++layer) {
    for (int64_t pos = 4; pos < 7; ++pos) {
      WriteSlot(cache->view(), layer, child_table[1] * 4 + pos % 4, 200 + pos + layer);
    }
  }
  ASSERT_TRUE(cache->CommitWrite("c", 1, 5, 2).ok());
  // Parent: old bytes in every layer. Child: the copy was complete before its write.
  for (int32_t layer = 0; layer < 3; ++layer) {
    for (int64_t pos = 0; pos < 6; ++pos) {
      EXPECT_TRUE(SlotHolds(cache->view(), layer, SlotOf(*cache, "p", pos), 10 + pos + layer))
          << "parent layer " << layer << " pos " << pos;
    }
    for (int64_t pos = 0; pos < 4; ++pos) {
      EXPECT_TRUE(SlotHolds(cache->view(), layer, SlotOf(*cache, "c", pos), 10 + pos + layer));
    }
  }
  // The copy itself carried every layer (checked before the child overwrote it).
  ASSERT_TRUE(cache->ForkSequence("c", "c2").ok());
  ASSERT_TRUE(cache->PrepareWrite("c2", 1, 7, 1, &slots).ok());  // c's layer 1 has 7
  const int64_t c2_page = Table(*cache, "c2")[1];
  EXPECT_NE(c2_page, child_table[1]);
  for (int32_t layer = 0; layer < 3; ++layer) {
    for (int64_t pos = 4; pos < 7; ++pos) {
      EXPECT_TRUE(SlotHolds(cache->view(), layer, c2_page * 4 + pos % 4, 200 + pos + layer))
          << "copied page, layer " << layer << " pos " << pos;
    }
  }
  // Now unshared: a second write to the child's page copies nothing.
  const int64_t before = cache->Stats().pages_used;
  ASSERT_TRUE(cache->PrepareWrite("c", 2, 4, 1, &slots).ok());
  EXPECT_EQ(cache->Stats().pages_used, before);
  EXPECT_EQ(slots[0], child_table[1] * 4);
  // The parent's page 0 is still shared with c and c2: writing there copies.
  ASSERT_TRUE(cache->PrepareWrite("p", 0, 2, 1, &slots).ok());
  EXPECT_EQ(cache->Stats().pages_used, before + 1);
  EXPECT_NE(Table(*cache, "p")[0], parent_table[0]);
  EXPECT_EQ(Table(*cache, "c")[0], parent_table[0]);
}

INSTANTIATE_TEST_SUITE_P(ScaleModes, CopyOnWrite,
                         ::testing::Values(ScaleMode::kPerTensor, ScaleMode::kPerTokenHead),
                         [](const auto& info) {
                           return info.param == ScaleMode::kPerTensor ? "PerTensor"
                                                                      : "PerTokenHead";
                         });

// Host memory whose Copy and Zero take effect only at WaitForCopies, as a device's
// stream would run them; allocations start filled with 0xA5 so that a missing zeroing
// shows.
class DeferredPageMemory final : public PageMemory {
 public:
  absl::StatusOr<void*> Allocate(size_t bytes) override {
    absl::StatusOr<void*> ptr = host_->Allocate(bytes);
    if (ptr.ok()) std::memset(*ptr, 0xA5, bytes);
    return ptr;
  }
  void Free(void* ptr) override { host_->Free(ptr); }
  absl::Status Copy(void* dst, const void* src, size_t bytes) override {
    pending_.push_back([dst, src, bytes] { std::memmove(dst, src, bytes); });
    return absl::OkStatus();
  }
  absl::Status Zero(void* dst, size_t bytes) override {
    pending_.push_back([dst, bytes] { std::memset(dst, 0, bytes); });
    return absl::OkStatus();
  }
  absl::Status WaitForCopies() override {
    for (auto& op : pending_) op();
    pending_.clear();
    return absl::OkStatus();
  }
  bool host_accessible() const override { return true; }
  size_t pending() const { return pending_.size(); }

 private:
  std::unique_ptr<PageMemory> host_ = MakeHostPageMemory();
  std::vector<std::function<void()>> pending_;
};

TEST(PagedKvCache, CopiesAndZeroingAreDoneWhenTheCallReturns) {
  auto owned = std::make_unique<DeferredPageMemory>();
  DeferredPageMemory* memory = owned.get();
  auto created = PagedKvCache::Create(SmallConfig(16, ScaleMode::kPerTokenHead), std::move(owned));
  ASSERT_TRUE(created.ok()) << created.status();
  PagedKvCache& cache = **created;
  EXPECT_EQ(memory->pending(), 0u);
  const CacheView& view = cache.view();
  const int64_t pool_bytes = int64_t{view.geo.num_layers} * view.geo.num_pages *
                             view.geo.page_size * view.geo.num_kv_heads * view.geo.head_dim;
  for (int64_t i = 0; i < pool_bytes; ++i) {
    ASSERT_EQ(view.k[i], 0) << "K byte " << i << " not zeroed";
    ASSERT_EQ(view.v[i], 0) << "V byte " << i << " not zeroed";
  }

  ASSERT_TRUE(cache.CreateSequence("p", 0).ok());
  Append(cache, "p", 0, 6, 10);  // page 1 holds positions 4, 5
  ASSERT_TRUE(cache.ForkSequence("p", "c").ok());
  std::vector<int64_t> slots;
  ASSERT_TRUE(cache.PrepareWrite("c", 1, 6, 1, &slots).ok());  // copies shared page 1
  EXPECT_EQ(memory->pending(), 0u);
  const int64_t copy = Table(cache, "c")[1];
  ASSERT_NE(copy, Table(cache, "p")[1]);
  for (int32_t layer = 0; layer < 3; ++layer) {
    for (int64_t pos = 4; pos < 6; ++pos) {
      EXPECT_TRUE(SlotHolds(view, layer, copy * 4 + pos % 4, 10 + pos + layer))
          << "copied page, layer " << layer << " pos " << pos;
    }
  }
}

struct Snapshot {
  std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t> stats;
  std::map<std::string, std::vector<int32_t>> tables;
  std::map<std::string, std::vector<int64_t>> lengths;
  bool operator==(const Snapshot&) const = default;
};

Snapshot Take(PagedKvCache& cache, const std::vector<std::string>& ids) {
  Snapshot s;
  s.stats = StatsTuple(cache.Stats());
  for (const std::string& id : ids) {
    s.tables[id] = Table(cache, id);
    for (int32_t l = 0; l < cache.config().num_layers; ++l) {
      s.lengths[id].push_back(*cache.Length(id, l));
    }
  }
  return s;
}

TEST(PagedKvCache, ExhaustionChangesNothing) {
  auto cache = MakeCache(SmallConfig(8));
  ASSERT_TRUE(cache->CreateSequence("a", 0).ok());
  Append(*cache, "a", 0, 10, 1);  // 3 pages: 0..3, 4..7, 8..9
  ASSERT_TRUE(cache->ForkSequence("a", "b").ok());
  ASSERT_TRUE(cache->CreateSequence("c", 16).ok());  // 4 more pages: 1 free of 8
  const std::vector<std::string> ids = {"a", "b", "c"};
  const Snapshot before = Take(*cache, ids);
  ASSERT_EQ(cache->Stats().pages_free, 1);

  std::vector<int64_t> slots = {42};
  // Rewrite 3..9 of b: pages 0, 1, 2 are shared -> 3 copies needed, 1 free.
  absl::Status s = cache->PrepareWrite("b", 1, 3, 7, &slots);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(s.message(), HasSubstr("needs 3 pages, 1 free of 8"));
  EXPECT_EQ(Take(*cache, ids), before);
  EXPECT_EQ(slots, std::vector<int64_t>{42}) << "slots untouched on error";
  // Append 10..17 to a: page 2 shared (1 copy) + pages 3, 4 new = 3 needed.
  s = cache->PrepareWrite("a", 0, 10, 8, &slots);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(s.message(), HasSubstr("needs 3 pages, 1 free of 8"));
  EXPECT_EQ(Take(*cache, ids), before);
  EXPECT_EQ(cache->CreateSequence("d", 5).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(Take(*cache, ids), before);
  // Data of both owners is intact, and what fits still works.
  for (int64_t pos = 0; pos < 10; ++pos) {
    EXPECT_TRUE(SlotHolds(cache->view(), 2, SlotOf(*cache, "b", pos), 1 + pos + 2));
  }
  EXPECT_TRUE(cache->PrepareWrite("a", 0, 10, 2, &slots).ok());  // one copy of page 2
  EXPECT_EQ(cache->Stats().pages_free, 0);
}

TEST(PagedKvCache, ConcurrentSequencesDoNotLeak) {
  auto cache = MakeCache(SmallConfig(256));
  auto worker = [&](int t) {
    for (int round = 0; round < 200; ++round) {
      const std::string id = "t" + std::to_string(t) + "-" + std::to_string(round);
      ASSERT_TRUE(cache->CreateSequence(id, round % 7).ok());
      std::vector<int64_t> slots;
      for (int64_t pos = 0; pos < 9; ++pos) {
        ASSERT_TRUE(cache->PrepareWrite(id, pos % 3, pos / 3, 1, &slots).ok());
        ASSERT_TRUE(cache->CommitWrite(id, pos % 3, pos / 3, 1).ok());
      }
      ASSERT_TRUE(cache->ForkSequence(id, id + "f").ok());
      ASSERT_TRUE(cache->PrepareWrite(id + "f", 0, 3, 1, &slots).ok());
      (void)cache->Stats();
      ASSERT_TRUE(cache->ReleaseSequence(id).ok());
      ASSERT_TRUE(cache->ReleaseSequence(id + "f").ok());
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) threads.emplace_back(worker, t);
  for (auto& th : threads) th.join();
  EXPECT_EQ(StatsTuple(cache->Stats()), std::make_tuple(256, 0, 256, 0, 0));
}

// Per-tenant limits: a tenant's pages (shared ones once) and sequences are counted and
// capped on their own; another tenant is not affected; releases give the room back.
TEST(PagedKvCache, TenantLimitsCountEachTenantAlone) {
  CacheConfig c = SmallConfig(16);
  c.max_pages_per_tenant = 4;
  c.max_sequences_per_tenant = 3;
  auto cache = MakeCache(c);
  ASSERT_TRUE(cache->CreateSequence("a1", 8, "A").ok());  // 2 pages
  ASSERT_TRUE(cache->ForkSequence("a1", "a2").ok());      // shares them: still 2
  EXPECT_EQ(cache->TenantStats("A").pages_used, 2);
  EXPECT_EQ(cache->TenantStats("A").sequences, 2);
  EXPECT_EQ(cache->TenantStats("A").pages_free, 2);
  EXPECT_EQ(cache->TenantStats("A").pages_total, 4);
  // Writing into a shared page copies it: one more page for A (3), then 2 more do not fit.
  std::vector<int64_t> slots;
  ASSERT_TRUE(cache->PrepareWrite("a2", 0, 0, 1, &slots).ok());
  EXPECT_EQ(cache->TenantStats("A").pages_used, 3);
  absl::Status over = cache->CreateSequence("a3", 8, "A");
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(over.message(), HasSubstr("max_pages_per_tenant"));
  EXPECT_FALSE(cache->Contains("a3"));
  absl::Status write = cache->PrepareWrite("a1", 0, 0, 12, &slots);  // 3 pages, 1 missing
  EXPECT_EQ(write.code(), absl::StatusCode::kResourceExhausted) << write;
  EXPECT_THAT(write.message(), HasSubstr("max_pages_per_tenant"));
  ASSERT_TRUE(cache->CreateSequence("a3", 0, "A").ok());
  absl::Status many = cache->CreateSequence("a4", 0, "A");
  EXPECT_EQ(many.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(many.message(), HasSubstr("max_sequences_per_tenant"));
  EXPECT_EQ(cache->ForkSequence("a1", "a4").code(), absl::StatusCode::kResourceExhausted);
  // B is not limited by A's use.
  ASSERT_TRUE(cache->CreateSequence("b1", 16, "B").ok());
  EXPECT_EQ(cache->TenantStats("B").pages_used, 4);
  EXPECT_EQ(cache->TenantStats("B").sequences, 1);
  // Releases give A's room back; an unknown tenant has nothing.
  ASSERT_TRUE(cache->ReleaseSequence("a1").ok());
  ASSERT_TRUE(cache->ReleaseSequence("a2").ok());
  ASSERT_TRUE(cache->ReleaseSequence("a3").ok());
  EXPECT_EQ(cache->TenantStats("A").pages_used, 0);
  EXPECT_EQ(cache->TenantStats("A").sequences, 0);
  EXPECT_TRUE(cache->CreateSequence("a5", 16, "A").ok());
  EXPECT_EQ(cache->TenantStats("nobody").pages_used, 0);
  EXPECT_EQ(cache->Stats().pages_used, 8);
}

}  // namespace
}  // namespace sds
