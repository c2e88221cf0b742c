// ForkSequence shares pages copy-on-write; ReleaseSequence frees them at once and
// requests of a released sequence fail NOT_FOUND cleanly, also while queued.
#include <atomic>
#include <map>
#include <thread>

#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "tests/integration/harness.h"

namespace sds::itest {
namespace {

v1::ModelInfo Info(Harness& h) {
  v1::ModelInfo info;
  EXPECT_TRUE(h.stub().GetModelInfo(Context().get(), v1::GetModelInfoRequest(), &info).ok());
  return info;
}

grpc::Status Fork(Harness& h, const std::string& src, const std::string& dst) {
  v1::ForkSequenceRequest request;
  request.set_sequence_id(src);
  request.set_new_sequence_id(dst);
  v1::ForkSequenceResponse response;
  grpc::Status s = h.stub().ForkSequence(Context().get(), request, &response);
  if (s.ok()) h.mirror().Fork(src, dst);
  return s;
}

absl::StatusOr<int64_t> Release(Harness& h, const std::string& sequence) {
  v1::ReleaseSequenceRequest request;
  request.set_sequence_id(sequence);
  v1::ReleaseSequenceResponse response;
  grpc::Status s = h.stub().ReleaseSequence(Context().get(), request, &response);
  if (!s.ok())
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
  h.mirror().Release(sequence);
  return response.freed_pages();
}

TEST(ForkRelease, ForkSharesPagesAndCopiesOnWrite) {
  TestModel model;
  Harness h(model);
  ASSERT_TRUE(h.ok()) << h.error();
  InputGen gen(21);
  h.CreateAndPrefill(gen, "parent", 20);  // pages 0 and 1 (page_size 16), page 1 half full
  const int64_t used_before = Info(h).total_pages() - Info(h).free_pages();
  ASSERT_TRUE(Fork(h, "parent", "child").ok());
  EXPECT_EQ(Info(h).total_pages() - Info(h).free_pages(), used_before) << "fork copied pages";
  // Both write position 20 (inside the shared page) with different data, in every layer.
  uint64_t id = 1;
  for (int32_t layer = 0; layer < model.num_layers; ++layer) {
    ASSERT_TRUE(
        h.DecodeAndCheck(RandomDecode(gen, model, "parent", layer, 20, 21, false, id++)).ok());
    ASSERT_TRUE(
        h.DecodeAndCheck(RandomDecode(gen, model, "child", layer, 20, 21, true, id++)).ok());
  }
  EXPECT_GT(Info(h).total_pages() - Info(h).free_pages(), used_before) << "no copy-on-write";
  // The child rewrites old positions; the parent still reads its own tokens.
  v1::AppendKVRequest rewrite = RandomAppend(gen, model, "child", 1, 2, 10);
  v1::AppendKVResponse appended;
  ASSERT_TRUE(h.stub().AppendKV(Context().get(), rewrite, &appended).ok());
  h.mirror().Append(rewrite);
  EXPECT_EQ(appended.length(), 21);
  for (int step = 0; step < 3; ++step) {
    for (const char* seq : {"parent", "child"}) {
      v1::DecodeRequest r = RandomDecode(gen, model, seq, 1, 21 + step, 40, step % 2, id++);
      ASSERT_TRUE(h.DecodeAndCheck(r).ok()) << seq;
    }
  }
  // Releasing the parent keeps the child's (shared) pages alive.
  auto freed = Release(h, "parent");
  ASSERT_TRUE(freed.ok()) << freed.status();
  ASSERT_TRUE(h.DecodeAndCheck(RandomDecode(gen, model, "child", 0, 21, 21, false, id++)).ok());
  freed = Release(h, "child");
  ASSERT_TRUE(freed.ok());
  EXPECT_GT(*freed, 0);
  EXPECT_EQ(Info(h).free_pages(), Info(h).total_pages()) << "pages leaked";
}

TEST(ForkRelease, ReleasedSequenceIsNotFoundAndItsPagesAreFree) {
  TestModel model;
  Harness h(model);
  ASSERT_TRUE(h.ok()) << h.error();
  InputGen gen(22);
  h.CreateAndPrefill(gen, "gone", 40);
  auto freed = Release(h, "gone");
  ASSERT_TRUE(freed.ok());
  EXPECT_EQ(*freed, 3);  // 40 tokens in pages of 16
  EXPECT_EQ(Info(h).free_pages(), model.cache_pages);
  v1::DecodeRequest r = RandomDecode(gen, model, "gone", 0, 40, 4, false, 1);
  v1::DecodeResponse response;
  EXPECT_EQ(h.stub().Decode(Context().get(), r, &response).error_code(),
            grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(Release(h, "gone").status().code(), absl::StatusCode::kNotFound);
  // The id can be used again, from scratch.
  h.CreateAndPrefill(gen, "gone", 3);
  ASSERT_TRUE(h.DecodeAndCheck(RandomDecode(gen, model, "gone", 2, 3, 4, false, 2)).ok());
}

TEST(ForkRelease, ReleaseWhileRequestsAreQueued) {
  TestModel model;
  // A slow batcher so that requests are still queued when the release arrives.
  Harness h(model, {"--max_queue_delay_us=100000", "--max_batch_size=64"});
  ASSERT_TRUE(h.ok()) << h.error();
  InputGen gen(23);
  h.CreateAndPrefill(gen, "busy", 8);
  h.CreateAndPrefill(gen, "bystander", 8);
  grpc::ClientContext context;
  auto stream = h.stub().DecodeStream(&context);
  std::map<uint64_t, v1::DecodeRequest> sent;
  for (int i = 0; i < 12; ++i) {
    // Same (sequence, layer): one per batch, so most are still queued at the release.
    v1::DecodeRequest r = RandomDecode(gen, model, "busy", 0, 8 + i, 6, false, i + 1);
    sent[r.request_id()] = r;
    ASSERT_TRUE(stream->Write(r));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(30));  // < the queue delay
  auto freed = Release(h, "busy");
  ASSERT_TRUE(freed.ok()) << freed.status();
  stream->WritesDone();
  v1::DecodeResponse response;
  int ok = 0, not_found = 0;
  while (stream->Read(&response)) {
    if (response.error_code() == 0) ++ok;
    if (response.error_code() == grpc::StatusCode::NOT_FOUND) {
      ++not_found;
      EXPECT_NE(response.error_message().find("'busy'"), std::string::npos)
          << response.error_message();
    }
  }
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_EQ(ok + not_found, 12) << "other codes came back";
  EXPECT_GT(not_found, 0) << "the release did not overtake any queued request";
  EXPECT_EQ(Info(h).free_pages(), model.cache_pages - 1) << "pages of 'busy' leaked";
  // The server is healthy and other sequences are untouched.
  ASSERT_TRUE(h.DecodeAndCheck(RandomDecode(gen, model, "bystander", 0, 8, 9, false, 99)).ok());
}

// Queued work belongs to the sequence it was accepted for, not to its name: after a
// release, a sequence created again under the same id gets none of the old one's queued
// decodes (they fail NOT_FOUND), and its cache holds only what was written to it.
TEST(ForkRelease, QueuedWorkOfAReleasedSequenceNeverRunsOnItsSuccessor) {
  TestModel model;
  Harness h(model, {"--max_queue_delay_us=100000", "--max_batch_size=64"});
  ASSERT_TRUE(h.ok()) << h.error();
  InputGen gen(29);
  h.CreateAndPrefill(gen, "reused", 8);
  grpc::ClientContext context;
  auto stream = h.stub().DecodeStream(&context);
  for (int i = 0; i < 10; ++i) {
    // One per batch (same sequence and layer): most are queued at the release.
    ASSERT_TRUE(stream->Write(RandomDecode(gen, model, "reused", 0, 8 + i, 6, false, i + 1)));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(30));  // < the queue delay
  ASSERT_TRUE(Release(h, "reused").ok());
  // The successor has the same id and 8 tokens in every layer, so a stale decode at
  // position 8 would find it writable and answer OK.
  h.CreateAndPrefill(gen, "reused", 8);
  stream->WritesDone();
  v1::DecodeResponse response;
  int ok = 0, not_found = 0, other = 0;
  while (stream->Read(&response)) {
    if (response.error_code() == 0) {
      ++ok;
    } else if (response.error_code() == grpc::StatusCode::NOT_FOUND) {
      ++not_found;
    } else {
      ++other;
      ADD_FAILURE() << "stale request " << response.request_id() << " answered "
                    << response.error_code() << ": " << response.error_message();
    }
  }
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_EQ(ok + not_found + other, 10);
  EXPECT_GT(not_found, 0) << "the release did not overtake any queued request";
  EXPECT_LE(ok, 2) << "requests ran after the release";
  // Layer 0 of the successor holds its 8 prefilled tokens and nothing else: one more
  // token at position 8 makes 9.
  v1::AppendKVRequest append = RandomAppend(gen, model, "reused", 0, 8, 1);
  v1::AppendKVResponse appended;
  const grpc::Status s = h.stub().AppendKV(Context().get(), append, &appended);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(appended.length(), 9) << "a stale decode wrote into the new sequence";
}

}  // namespace
}  // namespace sds::itest
