#include "server/shm_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace sds::server {

const char* RegionKindName(RegionKind kind) {
  return kind == RegionKind::kCuda ? "cuda" : "system";
}

Region::Region(std::string name, RegionKind kind, char* base, uint64_t byte_size,
               std::function<void()> unmap)
    : name_(std::move(name)),
      kind_(kind),
      base_(base),
      byte_size_(byte_size),
      unmap_(std::move(unmap)) {}

Region::~Region() {
  if (unmap_) unmap_();
}

absl::Status Region::Pin() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (revoked_.load(std::memory_order_relaxed)) {
    return absl::FailedPreconditionError(
        absl::StrCat("region '", name_,
                     "' was unregistered while the request was queued or running; nothing "
                     "was written or stored"));
  }
  ++pins_;
  return absl::OkStatus();
}

void Region::Unpin() const {
  bool last;
  {
    std::lock_guard<std::mutex> lock(mu_);
    last = --pins_ == 0;
  }
  if (last) unpinned_.notify_all();
}

absl::Status Region::WriteIfLive(const std::function<void()>& write) const {
  if (absl::Status s = Pin(); !s.ok()) return s;
  write();
  Unpin();
  return absl::OkStatus();
}

void Region::Revoke() {
  std::unique_lock<std::mutex> lock(mu_);
  revoked_.store(true, std::memory_order_release);
  unpinned_.wait(lock, [&] { return pins_ == 0; });
}

absl::StatusOr<std::shared_ptr<Region>> MapSystemRegion(const std::string& name,
                                                        const std::string& shm_name,
                                                        uint64_t offset, uint64_t byte_size) {
  if (shm_name.size() < 2 || shm_name[0] != '/' || shm_name.find('/', 1) != std::string::npos ||
      shm_name.size() > 255 || shm_name.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm_name '", shm_name,
                     "' must be a POSIX shared-memory name: '/' then up to 254 "
                     "characters without '/'"));
  }
  if (byte_size == 0) return absl::InvalidArgumentError("byte_size must be > 0");
  const int fd = shm_open(shm_name.c_str(), O_RDWR, 0);
  if (fd < 0) {
    const int err = errno;
    const std::string why =
        absl::StrCat("cannot open shared memory '", shm_name, "': ", std::strerror(err));
    if (err == ENOENT) return absl::NotFoundError(why);
    if (err == EACCES) return absl::PermissionDeniedError(why);
    return absl::InvalidArgumentError(why);
  }
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    close(fd);
    return absl::InternalError(absl::StrCat("fstat of '", shm_name, "': ", std::strerror(errno)));
  }
  const uint64_t object_size = static_cast<uint64_t>(st.st_size);
  if (offset > object_size || byte_size > object_size - offset) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat("offset ", offset, " + byte_size ", byte_size,
                                                   " is past the end of '", shm_name, "' (",
                                                   object_size, " bytes)"));
  }
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t map_offset = offset - offset % page;
  const size_t map_bytes = static_cast<size_t>(byte_size + (offset - map_offset));
  void* mapped = mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
                      static_cast<off_t>(map_offset));
  const int err = errno;
  close(fd);  // the mapping keeps the object
  if (mapped == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot map '", shm_name, "': ", std::strerror(err)));
  }
  char* base = static_cast<char*>(mapped) + (offset - map_offset);
  return std::make_shared<Region>(name, RegionKind::kSystem, base, byte_size,
                                  [mapped, map_bytes] { munmap(mapped, map_bytes); });
}

absl::Status RegionRegistry::Register(
    const std::string& tenant, const std::string& name, uint64_t byte_size,
    const std::function<absl::StatusOr<std::shared_ptr<Region>>()>& map) {
  if (name.empty() || name.size() > 128) {
    return absl::InvalidArgumentError("region name must be 1 to 128 bytes");
  }
  if (byte_size > limits_.max_region_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("region '", name, "' of ", byte_size, " bytes is larger than ",
                     limits_.max_region_bytes, " (--max_region_bytes)"));
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (regions_.count({tenant, name}) != 0) {
      return absl::AlreadyExistsError(absl::StrCat("region '", name, "' is already registered"));
    }
    int32_t count = 0;
    for (auto it = regions_.lower_bound({tenant, ""});
         it != regions_.end() && it->first.first == tenant; ++it) {
      ++count;
    }
    if (count >= limits_.max_regions_per_tenant) {
      return absl::ResourceExhaustedError(
          absl::StrCat("the tenant has ", count,
                       " regions registered, the most allowed "
                       "(--max_regions_per_tenant); unregister one first"));
    }
  }
  // Mapped outside the lock (a CUDA IPC open takes milliseconds).
  absl::StatusOr<std::shared_ptr<Region>> region = map();
  if (!region.ok()) return region.status();
  std::lock_guard<std::mutex> lock(mu_);
  auto [it, inserted] = regions_.emplace(std::make_pair(tenant, name), *region);
  if (!inserted) {  // a concurrent registration of the same name won
    return absl::AlreadyExistsError(absl::StrCat("region '", name, "' is already registered"));
  }
  return absl::OkStatus();
}

absl::StatusOr<int> RegionRegistry::Unregister(const std::string& tenant, const std::string& name) {
  std::vector<std::shared_ptr<Region>> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (name.empty()) {
      auto it = regions_.lower_bound({tenant, ""});
      while (it != regions_.end() && it->first.first == tenant) {
        dropped.push_back(std::move(it->second));
        it = regions_.erase(it);
      }
    } else {
      auto it = regions_.find({tenant, name});
      if (it == regions_.end()) {
        return absl::NotFoundError(absl::StrCat("region '", name, "' is not registered"));
      }
      dropped.push_back(std::move(it->second));
      regions_.erase(it);
    }
  }
  // Outside the registry's lock: Revoke waits for writes in progress.
  for (const std::shared_ptr<Region>& region : dropped) region->Revoke();
  return static_cast<int>(dropped.size());
}

absl::StatusOr<std::shared_ptr<Region>> RegionRegistry::Find(const std::string& tenant,
                                                             const std::string& name) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = regions_.find({tenant, name});
  if (it == regions_.end()) {
    return absl::NotFoundError(absl::StrCat(
        "region '", name, "' is not registered (RegisterRegion first, with the same tenant)"));
  }
  return it->second;
}

std::vector<std::shared_ptr<Region>> RegionRegistry::List(const std::string& tenant) const {
  std::vector<std::shared_ptr<Region>> out;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = regions_.lower_bound({tenant, ""});
       it != regions_.end() && it->first.first == tenant; ++it) {
    out.push_back(it->second);
  }
  return out;
}

RegionTotals RegionRegistry::Totals() const {
  RegionTotals totals;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [key, region] : regions_) {
    if (region->kind() == RegionKind::kCuda) {
      ++totals.cuda_regions;
      totals.cuda_bytes += region->byte_size();
    } else {
      ++totals.system_regions;
      totals.system_bytes += region->byte_size();
    }
  }
  return totals;
}

}  // namespace sds::server
