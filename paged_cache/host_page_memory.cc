// Host PageMemory: 64-byte aligned allocations (one cache line, and the widest SIMD
// load the CPU kernels use), plain memmove/memset.
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "absl/strings/str_cat.h"
#include "paged_cache/page_memory.h"

namespace sds {
namespace {

constexpr size_t kHostAlignment = 64;

class HostPageMemory final : public PageMemory {
 public:
  absl::StatusOr<void*> Allocate(size_t bytes) override {
    if (bytes > std::numeric_limits<size_t>::max() - kHostAlignment) {
      return absl::ResourceExhaustedError(
          absl::StrCat("host allocation of ", bytes, " bytes is larger than the address space"));
    }
    // Round up so the last cache line is ours, and never ask for zero bytes.
    const size_t rounded = (bytes + kHostAlignment - 1) / kHostAlignment * kHostAlignment;
    void* ptr = ::operator new (rounded == 0 ? kHostAlignment : rounded,
                                std::align_val_t{kHostAlignment}, std::nothrow);
    if (ptr == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("host allocation of ", bytes, " bytes failed; lower the cache budget"));
    }
#if defined(MADV_HUGEPAGE)
    // Transparent huge pages for the 2 MiB-aligned interior of a large (fresh, untouched)
    // allocation: the CPU attention reads rows at random pages, and 4 KiB pages cost it
    // a TLB miss per row. Advisory; failure is ignored.
    constexpr uintptr_t kHugePage = uintptr_t{2} << 20;
    const uintptr_t begin = (reinterpret_cast<uintptr_t>(ptr) + kHugePage - 1) & ~(kHugePage - 1);
    const uintptr_t end = (reinterpret_cast<uintptr_t>(ptr) + rounded) & ~(kHugePage - 1);
    // NOLINTNEXTLINE(performance-no-int-to-ptr): the address was rounded to a huge page.
    if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#endif
    return ptr;
  }

  void Free(void* ptr) override {
    if (ptr != nullptr) ::operator delete (ptr, std::align_val_t{kHostAlignment});
  }

  absl::Status Copy(void* dst, const void* src, size_t bytes) override {
    // memmove: a caller copying a page onto itself must not hit memcpy's overlap UB.
    if (bytes != 0) std::memmove(dst, src, bytes);
    return absl::OkStatus();
  }

  absl::Status Zero(void* dst, size_t bytes) override {
    if (bytes != 0) std::memset(dst, 0, bytes);
    return absl::OkStatus();
  }

  absl::Status WaitForCopies() override { return absl::OkStatus(); }  // done on return

  bool host_accessible() const override { return true; }
};

}  // namespace

std::unique_ptr<PageMemory> MakeHostPageMemory() { return std::make_unique<HostPageMemory>(); }

}  // namespace sds
