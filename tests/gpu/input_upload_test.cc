// The CUDA backend's input upload: every input arrives at the device address Stage gave
// it, whether it went into the pinned pack (<= 16 KB while the pack has room) or was
// copied from its own staging memory; 256-byte alignment; zero-byte inputs; reuse.
#include "server/cuda/input_upload.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "tests/gpu/gpu_test_util.h"

namespace sds::gputest {
namespace {

using cudabackend::InputUpload;

TEST(InputUpload, EveryInputArrivesWhereStageSaid) {
  if (!HaveGpu()) GTEST_SKIP() << "no sm_90 CUDA device";
  // Sizes: empty, tiny, exactly the piece limit, one byte over it, large, then enough
  // 16 KB pieces to overflow the 256 KB pack (the rest take their own copies).
  std::vector<size_t> sizes = {
      0, 1, 100, 4096, InputUpload::kPackPieceBytes, InputUpload::kPackPieceBytes + 1, 40000};
  for (int i = 0; i < 20; ++i) sizes.push_back(InputUpload::kPackPieceBytes);
  const size_t n = sizes.size();

  cudaStream_t stream = nullptr;
  Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  InputUpload upload;
  ASSERT_TRUE(upload.Init().ok());
  std::vector<std::unique_ptr<cudabackend::DeviceBuffer>> own(n);
  std::vector<uint8_t*> host(n, nullptr);
  for (size_t i = 0; i < n; ++i) {
    own[i] = std::make_unique<cudabackend::DeviceBuffer>();
    Check(cudaHostAlloc(reinterpret_cast<void**>(&host[i]), sizes[i] + 1, cudaHostAllocDefault),
          "pinned input");
  }
  std::mt19937 rng(1234);
  for (int round = 0; round < 2; ++round) {  // the second round reuses pack and buffers
    std::vector<InputUpload::Input> inputs;
    for (size_t i = 0; i < n; ++i) {
      for (size_t j = 0; j < sizes[i]; ++j) host[i][j] = static_cast<uint8_t>(rng());
      inputs.push_back({own[i].get(), host[i], sizes[i], "test input"});
    }
    std::vector<void*> dev;
    ASSERT_TRUE(upload.Stage(inputs, &dev).ok());
    ASSERT_EQ(dev.size(), n);
    size_t packed = 0, direct = 0;
    for (size_t i = 0; i < n; ++i) {
      ASSERT_NE(dev[i], nullptr) << i;
      EXPECT_EQ(reinterpret_cast<uintptr_t>(dev[i]) % 256, 0u) << i;
      if (dev[i] == own[i]->get()) {
        ++direct;
      } else {
        ++packed;
        EXPECT_LE(sizes[i], InputUpload::kPackPieceBytes) << i;
      }
      // Poison the destination so that a missing copy cannot pass.
      if (sizes[i] > 0) Check(cudaMemsetAsync(dev[i], 0xA5, sizes[i], stream), "poison");
    }
    EXPECT_GE(direct, 3u);  // 16 KB + 1, 40000 and the pieces beyond the pack
    EXPECT_GE(packed, 6u);
    ASSERT_TRUE(upload.Send(stream).ok());
    Check(cudaStreamSynchronize(stream), "sync");
    for (size_t i = 0; i < n; ++i) {
      std::vector<uint8_t> back(sizes[i]);
      if (sizes[i] > 0)
        Check(cudaMemcpy(back.data(), dev[i], sizes[i], cudaMemcpyDeviceToHost), "download");
      EXPECT_TRUE(std::equal(back.begin(), back.end(), host[i])) << "input " << i;
    }
  }
  for (uint8_t* h : host) cudaFreeHost(h);
  cudaStreamDestroy(stream);
}

// An input without host memory (the device fills it: a batch gathered from CUDA regions)
// gets room in its own buffer, whatever its size, and nothing is copied into it; the
// inputs beside it still arrive.
TEST(InputUpload, AnInputWithoutHostMemoryGetsRoomAndNoCopy) {
  if (!HaveGpu()) GTEST_SKIP() << "no sm_90 CUDA device";
  cudaStream_t stream = nullptr;
  Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  InputUpload upload;
  ASSERT_TRUE(upload.Init().ok());
  const std::vector<size_t> sizes = {100, 100, 40000, 40000};  // small and large, each both ways
  std::vector<std::unique_ptr<cudabackend::DeviceBuffer>> own;
  std::vector<uint8_t*> pinned;
  std::vector<InputUpload::Input> inputs;
  for (size_t i = 0; i < sizes.size(); ++i) {
    own.push_back(std::make_unique<cudabackend::DeviceBuffer>());
    uint8_t* p = nullptr;
    Check(cudaHostAlloc(reinterpret_cast<void**>(&p), sizes[i], cudaHostAllocDefault), "pinned");
    for (size_t j = 0; j < sizes[i]; ++j) p[j] = static_cast<uint8_t>(j * 7 + i);
    pinned.push_back(p);
    const bool device_filled = i % 2 == 1;
    inputs.push_back({own[i].get(), device_filled ? nullptr : p, sizes[i], "test input"});
  }
  std::vector<void*> dev;
  ASSERT_TRUE(upload.Stage(inputs, &dev).ok());
  for (size_t i = 0; i < sizes.size(); ++i) {
    Check(cudaMemsetAsync(dev[i], 0xA5, sizes[i], stream), "poison");
    if (i % 2 == 1) {
      EXPECT_EQ(dev[i], own[i]->get()) << i;
    }
  }
  ASSERT_TRUE(upload.Send(stream).ok());
  Check(cudaStreamSynchronize(stream), "sync");
  for (size_t i = 0; i < sizes.size(); ++i) {
    std::vector<uint8_t> back(sizes[i]);
    Check(cudaMemcpy(back.data(), dev[i], sizes[i], cudaMemcpyDeviceToHost), "download");
    if (i % 2 == 1) {
      EXPECT_TRUE(std::all_of(back.begin(), back.end(), [](uint8_t b) { return b == 0xA5; }))
          << "input " << i << " was copied over";
    } else {
      EXPECT_TRUE(std::equal(back.begin(), back.end(), pinned[i])) << "input " << i;
    }
  }
  for (uint8_t* p : pinned) cudaFreeHost(p);
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace sds::gputest
