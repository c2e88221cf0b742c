#include <cstdint>
#include <cstring>

#include "gtest/gtest.h"
#include "paged_cache/page_memory.h"

namespace sds {
namespace {

TEST(HostPageMemory, AllocationsAre64ByteAligned) {
  auto memory = MakeHostPageMemory();
  EXPECT_TRUE(memory->host_accessible());
  for (size_t bytes :
       {size_t{0}, size_t{1}, size_t{63}, size_t{64}, size_t{1000}, size_t{1} << 20}) {
    auto ptr = memory->Allocate(bytes);
    ASSERT_TRUE(ptr.ok()) << ptr.status();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(*ptr) % 64, 0u) << bytes << " bytes";
    memory->Free(*ptr);
  }
}

TEST(HostPageMemory, CopyAndZero) {
  auto memory = MakeHostPageMemory();
  auto ptr = memory->Allocate(256);
  ASSERT_TRUE(ptr.ok());
  auto* bytes = static_cast<uint8_t*>(*ptr);
  for (int i = 0; i < 128; ++i) bytes[i] = static_cast<uint8_t>(i + 1);
  ASSERT_TRUE(memory->Copy(bytes + 128, bytes, 128).ok());
  EXPECT_EQ(std::memcmp(bytes, bytes + 128, 128), 0);
  ASSERT_TRUE(memory->Zero(bytes, 64).ok());
  for (int i = 0; i < 64; ++i) ASSERT_EQ(bytes[i], 0) << i;
  EXPECT_EQ(bytes[64], 65);
  memory->Free(*ptr);
}

TEST(HostPageMemory, AbsurdSizeIsResourceExhausted) {
  auto memory = MakeHostPageMemory();
  auto ptr = memory->Allocate(SIZE_MAX - 8);
  EXPECT_EQ(ptr.status().code(), absl::StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace sds
