// PendingWrites and PendingHold (server/pending_writes.h): queued tokens extend the
// position a request may start at, and a hold gives its tokens back unless a queued
// work item took them over, on an early return and on an exception alike.
#include "server/pending_writes.h"

#include <memory>
#include <stdexcept>
#include <utility>

#include "gtest/gtest.h"
#include "paged_cache/page_memory.h"
#include "paged_cache/paged_kv_cache.h"

namespace sds::server {
namespace {

class PendingWritesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    CacheConfig config;
    config.num_layers = 2;
    config.num_kv_heads = 1;
    config.head_dim = 64;
    config.num_pages = 4;
    auto cache = PagedKvCache::Create(config, MakeHostPageMemory());
    ASSERT_TRUE(cache.ok()) << cache.status();
    cache_ = *std::move(cache);
    ASSERT_TRUE(cache_->CreateSequence("s", 0).ok());
  }
  // Whether position `start` of layer 0 of "s" may be queued now.
  bool MayStartAt(int64_t start) const {
    const absl::Status s = pending_.CheckStart(*cache_, "s", 0, start, "s");
    EXPECT_TRUE(s.ok() || s.code() == absl::StatusCode::kFailedPrecondition) << s;
    return s.ok();
  }

  std::unique_ptr<PagedKvCache> cache_;
  PendingWrites pending_;
};

TEST_F(PendingWritesTest, QueuedTokensExtendTheStartUntilRemoved) {
  EXPECT_TRUE(MayStartAt(0));
  EXPECT_FALSE(MayStartAt(3));
  pending_.Add("s", 0, 3);
  EXPECT_TRUE(MayStartAt(3));
  EXPECT_FALSE(MayStartAt(4));
  EXPECT_EQ(pending_.CheckStart(*cache_, "s", 1, 3, "s").code(),
            absl::StatusCode::kFailedPrecondition);  // per layer
  pending_.Remove("s", 0, 3);
  EXPECT_FALSE(MayStartAt(3));
}

TEST_F(PendingWritesTest, HoldGivesItsTokensBackUnlessReleased) {
  {
    PendingHold hold(&pending_, "s", 0, 2);
    EXPECT_TRUE(MayStartAt(2));
  }
  EXPECT_FALSE(MayStartAt(2)) << "a hold left its tokens behind";
  // An exception between the Add and the submit (bad_alloc in the server).
  try {
    PendingHold hold(&pending_, "s", 0, 2);
    throw std::runtime_error("injected");
  } catch (const std::runtime_error&) {
  }
  EXPECT_FALSE(MayStartAt(2)) << "an exception left the tokens behind";
  pending_.Add("s", 0, 1);  // another request's token, queued
  {
    PendingHold hold(&pending_, "s", 0, 2);
    hold.Undo();  // explicit, before answering an error
    EXPECT_FALSE(MayStartAt(2));
  }
  EXPECT_TRUE(MayStartAt(1)) << "the hold removed its tokens twice";
  pending_.Remove("s", 0, 1);
  {
    PendingHold moved;
    {
      PendingHold hold(&pending_, "s", 0, 2);
      moved = std::move(hold);
    }
    EXPECT_TRUE(MayStartAt(2)) << "the moved-from hold gave the tokens back";
    moved.Release();  // a queued work item's `done` owns them now
  }
  EXPECT_TRUE(MayStartAt(2));
  pending_.Remove("s", 0, 2);
  EXPECT_FALSE(MayStartAt(2));
}

}  // namespace
}  // namespace sds::server
