// Paged FP8 KV cache: metadata (block tables, reference counts, free list, lengths)
// on the host under one mutex; the bytes in a single PageMemory allocation laid out
// exactly as CacheView describes.
#include "paged_cache/paged_kv_cache.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/node_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace sds {
namespace {

constexpr int64_t kRegionAlignment = 64;

// Overflow-checked a * b for non-negative values; false on overflow.
bool CheckedMul(int64_t a, int64_t b, int64_t* out) { return !__builtin_mul_overflow(a, b, out); }

int64_t AlignUp(int64_t x) {
  return (x + kRegionAlignment - 1) / kRegionAlignment * kRegionAlignment;
}

// Sizes of one page and byte offsets of the four arrays inside the pool allocation:
// [k | v | k_token_scale | v_token_scale], each region 64-byte aligned.
struct Layout {
  int64_t page_kv_bytes = 0;     // one layer of one page, K or V: page_size * Hkv * D
  int64_t page_scale_bytes = 0;  // one layer of one page, K or V scales (0 in per_tensor)
  int64_t layer_kv_bytes = 0;    // page_kv_bytes * num_pages
  int64_t layer_scale_bytes = 0;
  int64_t v_offset = 0;
  int64_t k_scale_offset = 0;
  int64_t v_scale_offset = 0;
  int64_t total_bytes = 0;
};

absl::StatusOr<Layout> ComputeLayout(const CacheConfig& c) {
  Layout l;
  const int64_t tokens_heads = int64_t{c.page_size} * c.num_kv_heads;
  int64_t array_kv = 0, array_scale = 0;
  const bool per_token = c.scale_mode == ScaleMode::kPerTokenHead;
  if (!CheckedMul(tokens_heads, c.head_dim, &l.page_kv_bytes) ||
      !CheckedMul(l.page_kv_bytes, c.num_pages, &l.layer_kv_bytes) ||
      !CheckedMul(l.layer_kv_bytes, c.num_layers, &array_kv) ||
      !CheckedMul(per_token ? tokens_heads : 0, int64_t{sizeof(float)}, &l.page_scale_bytes) ||
      !CheckedMul(l.page_scale_bytes, c.num_pages, &l.layer_scale_bytes) ||
      !CheckedMul(l.layer_scale_bytes, c.num_layers, &array_scale) ||
      array_kv > std::numeric_limits<int64_t>::max() / 4 ||
      array_scale > std::numeric_limits<int64_t>::max() / 4) {
    return absl::InvalidArgumentError(
        absl::StrCat("cache of ", c.num_pages, " pages x ", c.num_layers, " layers x ", c.page_size,
                     " tokens x ", c.num_kv_heads, " KV heads x ", c.head_dim,
                     " dims does not fit in 64-bit sizes; lower num_pages"));
  }
  l.v_offset = AlignUp(array_kv);
  l.k_scale_offset = AlignUp(l.v_offset + array_kv);
  l.v_scale_offset = AlignUp(l.k_scale_offset + array_scale);
  l.total_bytes = l.v_scale_offset + array_scale;
  return l;
}

absl::Status ValidateScales(const char* name, const std::vector<float>& scales, int32_t layers) {
  if (!scales.empty() && static_cast<int64_t>(scales.size()) != layers) {
    return absl::InvalidArgumentError(absl::StrCat(name, " has ", scales.size(),
                                                   " entries; it needs one per layer (", layers,
                                                   ") or none for all 1.0"));
  }
  for (size_t i = 0; i < scales.size(); ++i) {
    if (!std::isfinite(scales[i]) || scales[i] <= 0.0f) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, "[", i, "] is ", scales[i], "; scales must be finite and > 0"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateConfig(const CacheConfig& c) {
  auto positive = [](const char* name, int64_t v) {
    return v > 0 ? absl::OkStatus()
                 : absl::InvalidArgumentError(absl::StrCat(name, " is ", v, "; it must be > 0"));
  };
  for (absl::Status s : {positive("num_layers", c.num_layers),
                         positive("num_kv_heads", c.num_kv_heads), positive("head_dim", c.head_dim),
                         positive("page_size", c.page_size), positive("num_pages", c.num_pages)}) {
    if (!s.ok()) return s;
  }
  if (!std::has_single_bit(static_cast<uint32_t>(c.page_size))) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_size is ", c.page_size, "; it must be a power of two"));
  }
  // Page ids travel as int32 in page tables.
  if (c.num_pages > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat("num_pages is ", c.num_pages, "; at most ",
                                                   std::numeric_limits<int32_t>::max()));
  }
  if (c.scale_mode != ScaleMode::kPerTensor && c.scale_mode != ScaleMode::kPerTokenHead) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown scale_mode ", static_cast<int32_t>(c.scale_mode)));
  }
  if (auto s = ValidateScales("layer_k_scales", c.layer_k_scales, c.num_layers); !s.ok()) return s;
  return ValidateScales("layer_v_scales", c.layer_v_scales, c.num_layers);
}

// A tenant's use of the pool; kept while it has sequences or pages (node map: stable).
struct TenantUse {
  std::string name;
  int64_t pages = 0;
  int64_t sequences = 0;
};

struct Sequence {
  TenantUse* tenant = nullptr;   // the tenant it was created for
  std::vector<int32_t> pages;    // logical page j -> page id; one table for every layer
  std::vector<int64_t> lengths;  // [num_layers] written length of each layer
  int64_t longest = 0;           // max of lengths; kept for CacheStats::tokens
  uint64_t incarnation = 0;      // unique over the cache's life (PagedKvCache::Incarnation)
};

}  // namespace

struct PagedKvCache::Impl {
  CacheConfig config;
  Layout layout;
  int page_shift = 0;  // log2(page_size)
  std::unique_ptr<PageMemory> memory;
  uint8_t* base = nullptr;
  CacheView view;

  mutable absl::Mutex mu;
  absl::flat_hash_map<std::string, Sequence> sequences ABSL_GUARDED_BY(mu);
  std::vector<int32_t> refcount ABSL_GUARDED_BY(mu);   // [num_pages]; 0 = free
  std::vector<int32_t> free_list ABSL_GUARDED_BY(mu);  // stack; back() is handed out next
  int64_t tokens ABSL_GUARDED_BY(mu) = 0;              // sum of Sequence::longest
  uint64_t next_incarnation ABSL_GUARDED_BY(mu) = 1;
  absl::node_hash_map<std::string, TenantUse> tenants ABSL_GUARDED_BY(mu);
  std::vector<TenantUse*> page_tenant ABSL_GUARDED_BY(mu);  // [num_pages]: who allocated it

  absl::Status CheckLayer(int32_t layer) const {
    if (layer >= 0 && layer < config.num_layers) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " is out of range; the cache has ", config.num_layers,
                     " layers (0..", config.num_layers - 1, ")"));
  }

  // Argument checks shared by PrepareWrite and CommitWrite; they need no lock.
  absl::Status CheckRange(int32_t layer, int64_t start, int64_t n) const {
    if (auto s = CheckLayer(layer); !s.ok()) return s;
    if (start < 0) {
      return absl::InvalidArgumentError(absl::StrCat("start position ", start, " is negative"));
    }
    if (n < 0) {
      return absl::InvalidArgumentError(absl::StrCat("token count ", n, " is negative"));
    }
    if (n > std::numeric_limits<int64_t>::max() - start) {
      return absl::InvalidArgumentError(
          absl::StrCat("positions ", start, " + ", n, " overflow a 64-bit position"));
    }
    return absl::OkStatus();
  }

  // `incarnation` 0 accepts any; another value must be the one the sequence was
  // created with, or the sequence is NOT_FOUND: work queued for a released sequence must
  // not run against a new one of the same name.
  absl::StatusOr<Sequence*> Find(const std::string& id, uint64_t incarnation = 0)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto it = sequences.find(id);
    if (it == sequences.end()) {
      return absl::NotFoundError(absl::StrCat("sequence \"", id, "\" not found"));
    }
    if (incarnation != 0 && it->second.incarnation != incarnation) {
      return absl::NotFoundError(absl::StrCat(
          "sequence \"", id,
          "\" not found: it was released after the request was accepted (a sequence created "
          "since under the same id is another sequence)"));
    }
    return &it->second;
  }

  absl::Status Exhausted(int64_t needed, const std::string& what) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return absl::ResourceExhaustedError(
        absl::StrCat("KV cache full: ", what, " needs ", needed, " pages, ", free_list.size(),
                     " free of ", config.num_pages, "; release sequences or retry later"));
  }

  // A page for `owner`, counted as its own.
  int32_t PopFree(TenantUse* owner) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    const int32_t page = free_list.back();
    free_list.pop_back();
    refcount[page] = 1;
    page_tenant[page] = owner;
    ++owner->pages;
    return page;
  }

  // Drops one reference; returns true when the page went back to the free list.
  bool Unref(int32_t page) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (--refcount[page] != 0) return false;
    free_list.push_back(page);
    TenantUse* owner = std::exchange(page_tenant[page], nullptr);
    --owner->pages;
    ForgetIfUnused(owner);
    return true;
  }

  // The entry of `tenant`, made on first use.
  TenantUse* TenantOf(const std::string& tenant) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    TenantUse& use = tenants[tenant];
    if (use.name.empty()) use.name = tenant;
    return &use;
  }
  // An entry without sequences or pages is dropped: tenant names come from callers.
  void ForgetIfUnused(TenantUse* owner) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (owner->pages != 0 || owner->sequences != 0) return;
    tenants.erase(std::string(owner->name));  // a copy: the key dies with the entry
  }
  // RESOURCE_EXHAUSTED when `owner` may not take `pages` more pages (its limit).
  absl::Status CheckTenantPages(const TenantUse* owner, int64_t pages,
                                const std::string& what) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    const int64_t limit = config.max_pages_per_tenant;
    if (limit <= 0 || pages <= 0 || owner->name.empty() || owner->pages + pages <= limit) {
      return absl::OkStatus();
    }
    return absl::ResourceExhaustedError(absl::StrCat(
        "tenant page limit: ", what, " needs ", pages, " more pages and the tenant holds ",
        owner->pages, " of its ", limit, " (max_pages_per_tenant); release sequences"));
  }
  absl::Status CheckTenantSequences(const TenantUse* owner) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    const int64_t limit = config.max_sequences_per_tenant;
    if (limit <= 0 || owner->name.empty() || owner->sequences < limit) return absl::OkStatus();
    return absl::ResourceExhaustedError(
        absl::StrCat("tenant sequence limit: the tenant has ", owner->sequences, " of its ", limit,
                     " sequences (max_sequences_per_tenant); release one first"));
  }

  // Copies every layer's K, V (and scales) of page `src` into page `dst`.
  absl::Status CopyPage(int32_t dst, int32_t src) {
    const Layout& l = layout;
    for (int32_t layer = 0; layer < config.num_layers; ++layer) {
      const int64_t kv = layer * l.layer_kv_bytes;
      const int64_t sc = layer * l.layer_scale_bytes;
      struct Region {
        int64_t offset, page_bytes;
      };
      for (const Region& r : {Region{kv, l.page_kv_bytes}, Region{l.v_offset + kv, l.page_kv_bytes},
                              Region{l.k_scale_offset + sc, l.page_scale_bytes},
                              Region{l.v_scale_offset + sc, l.page_scale_bytes}}) {
        if (r.page_bytes == 0) continue;
        uint8_t* region = base + r.offset;
        if (auto s = memory->Copy(region + dst * r.page_bytes, region + src * r.page_bytes,
                                  static_cast<size_t>(r.page_bytes));
            !s.ok()) {
          return s;
        }
      }
    }
    return absl::OkStatus();
  }

  void SetLength(Sequence& seq, int32_t layer, int64_t length) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    seq.lengths[layer] = std::max(seq.lengths[layer], length);
    if (seq.lengths[layer] > seq.longest) {
      tokens += seq.lengths[layer] - seq.longest;
      seq.longest = seq.lengths[layer];
    }
  }
};

int64_t PagedKvCache::BytesPerPage(const CacheConfig& config) {
  const int64_t tokens_heads = int64_t{config.page_size} * config.num_kv_heads;
  int64_t per_layer = 2 * tokens_heads * config.head_dim;
  if (config.scale_mode == ScaleMode::kPerTokenHead) {
    per_layer += 2 * tokens_heads * static_cast<int64_t>(sizeof(float));
  }
  return per_layer * config.num_layers;
}

absl::StatusOr<std::unique_ptr<PagedKvCache>> PagedKvCache::Create(
    const CacheConfig& config, std::unique_ptr<PageMemory> memory) {
  if (memory == nullptr) return absl::InvalidArgumentError("PagedKvCache needs a PageMemory");
  if (auto s = ValidateConfig(config); !s.ok()) return s;
  absl::StatusOr<Layout> layout = ComputeLayout(config);
  if (!layout.ok()) return layout.status();

  auto impl = std::make_unique<Impl>();
  impl->config = config;
  // Normalise: an empty scale list means 1.0 for every layer.
  if (impl->config.layer_k_scales.empty())
    impl->config.layer_k_scales.assign(config.num_layers, 1.0f);
  if (impl->config.layer_v_scales.empty())
    impl->config.layer_v_scales.assign(config.num_layers, 1.0f);
  impl->layout = *layout;
  impl->page_shift = std::countr_zero(static_cast<uint32_t>(config.page_size));

  absl::StatusOr<void*> bytes = memory->Allocate(static_cast<size_t>(layout->total_bytes));
  if (!bytes.ok()) return bytes.status();
  impl->base = static_cast<uint8_t*>(*bytes);
  impl->memory = std::move(memory);
  // Zeroed once so a stray read of an unwritten slot sees 0, not stale bytes or NaN scales.
  absl::Status zeroed = impl->memory->Zero(impl->base, static_cast<size_t>(layout->total_bytes));
  if (zeroed.ok()) zeroed = impl->memory->WaitForCopies();
  if (!zeroed.ok()) {
    impl->memory->Free(impl->base);
    return zeroed;
  }

  CacheView& v = impl->view;
  v.geo = CacheGeometry{config.num_layers, config.num_kv_heads, config.head_dim,
                        config.page_size,  config.num_pages,    config.scale_mode};
  v.k = impl->base;
  v.v = impl->base + layout->v_offset;
  if (config.scale_mode == ScaleMode::kPerTokenHead) {
    v.k_token_scale = reinterpret_cast<float*>(impl->base + layout->k_scale_offset);
    v.v_token_scale = reinterpret_cast<float*>(impl->base + layout->v_scale_offset);
  } else {
    v.layer_k_scale = impl->config.layer_k_scales.data();
    v.layer_v_scale = impl->config.layer_v_scales.data();
  }

  {
    absl::MutexLock lock(&impl->mu);
    impl->refcount.assign(config.num_pages, 0);
    impl->page_tenant.assign(config.num_pages, nullptr);
    impl->free_list.reserve(config.num_pages);
    // Reverse order so pages are handed out 0, 1, 2, ... (easier to read in dumps).
    for (int64_t p = config.num_pages - 1; p >= 0; --p) {
      impl->free_list.push_back(static_cast<int32_t>(p));
    }
  }
  std::unique_ptr<PagedKvCache> cache(new PagedKvCache());
  cache->impl_ = std::move(impl);
  return cache;
}

PagedKvCache::~PagedKvCache() {
  if (impl_ != nullptr && impl_->base != nullptr) impl_->memory->Free(impl_->base);
}

absl::Status PagedKvCache::CreateSequence(const std::string& id, int64_t reserve_tokens,
                                          const std::string& tenant) {
  if (id.empty()) return absl::InvalidArgumentError("sequence id must not be empty");
  if (reserve_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("reserve_tokens is ", reserve_tokens, "; it must be >= 0"));
  }
  const int64_t size = impl_->config.page_size;
  const int64_t pages = reserve_tokens / size + (reserve_tokens % size != 0 ? 1 : 0);
  absl::MutexLock lock(&impl_->mu);
  if (impl_->sequences.contains(id)) {
    return absl::AlreadyExistsError(absl::StrCat("sequence \"", id, "\" already exists"));
  }
  if (pages > static_cast<int64_t>(impl_->free_list.size())) {
    return impl_->Exhausted(pages, absl::StrCat("reserving ", reserve_tokens, " tokens"));
  }
  TenantUse* owner = impl_->TenantOf(tenant);
  absl::Status allowed = impl_->CheckTenantSequences(owner);
  if (allowed.ok()) {
    allowed = impl_->CheckTenantPages(owner, pages,
                                      absl::StrCat("reserving ", reserve_tokens, " tokens"));
  }
  if (!allowed.ok()) {
    impl_->ForgetIfUnused(owner);
    return allowed;
  }
  Sequence seq;
  seq.tenant = owner;
  seq.lengths.assign(impl_->config.num_layers, 0);
  seq.pages.reserve(pages);
  for (int64_t i = 0; i < pages; ++i) seq.pages.push_back(impl_->PopFree(owner));
  seq.incarnation = impl_->next_incarnation++;
  ++owner->sequences;
  impl_->sequences.emplace(id, std::move(seq));
  return absl::OkStatus();
}

absl::Status PagedKvCache::ForkSequence(const std::string& src, const std::string& dst) {
  if (dst.empty()) return absl::InvalidArgumentError("new sequence id must not be empty");
  absl::MutexLock lock(&impl_->mu);
  absl::StatusOr<Sequence*> parent = impl_->Find(src);
  if (!parent.ok()) return parent.status();
  if (impl_->sequences.contains(dst)) {
    return absl::AlreadyExistsError(absl::StrCat("sequence \"", dst, "\" already exists"));
  }
  if (absl::Status s = impl_->CheckTenantSequences((*parent)->tenant); !s.ok()) return s;
  // Copy before inserting: the insert may rehash and move the parent.
  Sequence child = **parent;
  child.incarnation = impl_->next_incarnation++;
  ++child.tenant->sequences;
  for (int32_t page : child.pages) ++impl_->refcount[page];
  impl_->tokens += child.longest;
  impl_->sequences.emplace(dst, std::move(child));
  return absl::OkStatus();
}

absl::StatusOr<int64_t> PagedKvCache::ReleaseSequence(const std::string& id) {
  absl::MutexLock lock(&impl_->mu);
  auto it = impl_->sequences.find(id);
  if (it == impl_->sequences.end()) {
    return absl::NotFoundError(absl::StrCat("sequence \"", id, "\" not found"));
  }
  int64_t freed = 0;
  TenantUse* owner = it->second.tenant;
  --owner->sequences;  // first: the last page's Unref may then drop the entry
  ++owner->pages;      // held back so that it cannot go before the loop is done
  for (int32_t page : it->second.pages) freed += impl_->Unref(page) ? 1 : 0;
  --owner->pages;
  impl_->ForgetIfUnused(owner);
  impl_->tokens -= it->second.longest;
  impl_->sequences.erase(it);
  return freed;
}

absl::Status PagedKvCache::PrepareWrite(const std::string& id, int32_t layer, int64_t start,
                                        int64_t n, std::vector<int64_t>* slots,
                                        uint64_t incarnation) {
  if (slots == nullptr) return absl::InvalidArgumentError("PrepareWrite needs a slots vector");
  if (auto s = impl_->CheckRange(layer, start, n); !s.ok()) return s;
  const int shift = impl_->page_shift;
  const int64_t mask = impl_->config.page_size - 1;

  absl::MutexLock lock(&impl_->mu);
  absl::StatusOr<Sequence*> found = impl_->Find(id, incarnation);
  if (!found.ok()) return found.status();
  Sequence& seq = **found;
  if (start > seq.lengths[layer]) {
    return absl::FailedPreconditionError(absl::StrCat(
        "position ", start, " of layer ", layer, " needs positions 0..", start - 1,
        " written; layer ", layer, " has ", seq.lengths[layer], " (sequence \"", id, "\")"));
  }

  // Plan first, change nothing until every page is known to be available.
  const int64_t first = start >> shift;
  const int64_t end = n == 0 ? first : ((start + n - 1) >> shift) + 1;  // logical pages
  const int64_t have = static_cast<int64_t>(seq.pages.size());
  std::vector<int64_t> shared;  // logical pages in range whose page another sequence holds
  for (int64_t j = first; j < std::min(end, have); ++j) {
    if (impl_->refcount[seq.pages[j]] > 1) shared.push_back(j);
  }
  const int64_t missing = std::max<int64_t>(0, end - std::max(first, have));
  const int64_t needed = static_cast<int64_t>(shared.size()) + missing;
  if (needed > static_cast<int64_t>(impl_->free_list.size())) {
    return impl_->Exhausted(needed, absl::StrCat("writing positions ", start, "..", start + n - 1,
                                                 " of layer ", layer, " of sequence \"", id, "\""));
  }
  if (absl::Status s =
          impl_->CheckTenantPages(seq.tenant, needed,
                                  absl::StrCat("writing positions ", start, "..", start + n - 1,
                                               " of layer ", layer, " of sequence \"", id, "\""));
      !s.ok()) {
    return s;
  }

  // Copy-on-write. The copy runs under the lock: it happens once per shared page per
  // fork, the host copy is one memmove per layer and region, the CUDA copies are
  // enqueued and waited for once, and copying outside would need pinned pages plus a
  // second validation pass.
  std::vector<int32_t> fresh;
  fresh.reserve(shared.size());
  absl::Status copied;
  for (int64_t j : shared) {
    fresh.push_back(impl_->PopFree(seq.tenant));
    copied = impl_->CopyPage(fresh.back(), seq.pages[j]);
    if (!copied.ok()) break;
  }
  if (!shared.empty()) {
    absl::Status waited = impl_->memory->WaitForCopies();  // also after a failed copy
    if (copied.ok()) copied = waited;
  }
  if (!copied.ok()) {
    for (int32_t page : fresh) impl_->Unref(page);
    return copied;
  }
  for (size_t i = 0; i < shared.size(); ++i) {
    int32_t& entry = seq.pages[shared[i]];
    impl_->Unref(entry);  // refcount was > 1, so the old page stays with its other owners
    entry = fresh[i];
  }
  for (int64_t i = 0; i < missing; ++i) seq.pages.push_back(impl_->PopFree(seq.tenant));

  slots->resize(n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t pos = start + i;
    (*slots)[i] = (int64_t{seq.pages[pos >> shift]} << shift) | (pos & mask);
  }
  return absl::OkStatus();
}

absl::Status PagedKvCache::CommitWrite(const std::string& id, int32_t layer, int64_t start,
                                       int64_t n, uint64_t incarnation) {
  if (auto s = impl_->CheckRange(layer, start, n); !s.ok()) return s;
  absl::MutexLock lock(&impl_->mu);
  absl::StatusOr<Sequence*> found = impl_->Find(id, incarnation);
  if (!found.ok()) return found.status();
  Sequence& seq = **found;
  if (start > seq.lengths[layer]) {
    return absl::FailedPreconditionError(
        absl::StrCat("commit at position ", start, " of layer ", layer, " leaves a gap; layer ",
                     layer, " has ", seq.lengths[layer], " (sequence \"", id, "\")"));
  }
  const int64_t capacity = static_cast<int64_t>(seq.pages.size()) << impl_->page_shift;
  if (start + n > capacity) {
    return absl::FailedPreconditionError(
        absl::StrCat("commit of positions up to ", start + n - 1, " of sequence \"", id,
                     "\" exceeds its ", capacity, " allocated positions; call PrepareWrite first"));
  }
  impl_->SetLength(seq, layer, start + n);
  return absl::OkStatus();
}

absl::Status PagedKvCache::AppendPageTable(const std::string& id, std::vector<int32_t>* pages,
                                           uint64_t incarnation) const {
  if (pages == nullptr) return absl::InvalidArgumentError("AppendPageTable needs a vector");
  absl::MutexLock lock(&impl_->mu);
  absl::StatusOr<Sequence*> found = impl_->Find(id, incarnation);
  if (!found.ok()) return found.status();
  pages->insert(pages->end(), (*found)->pages.begin(), (*found)->pages.end());
  return absl::OkStatus();
}

absl::StatusOr<int64_t> PagedKvCache::Length(const std::string& id, int32_t layer,
                                             uint64_t* incarnation) const {
  if (auto s = impl_->CheckLayer(layer); !s.ok()) return s;
  absl::MutexLock lock(&impl_->mu);
  absl::StatusOr<Sequence*> found = impl_->Find(id);
  if (!found.ok()) return found.status();
  if (incarnation != nullptr) *incarnation = (*found)->incarnation;
  return (*found)->lengths[layer];
}

absl::StatusOr<uint64_t> PagedKvCache::Incarnation(const std::string& id) const {
  absl::MutexLock lock(&impl_->mu);
  absl::StatusOr<Sequence*> found = impl_->Find(id);
  if (!found.ok()) return found.status();
  return (*found)->incarnation;
}

bool PagedKvCache::Contains(const std::string& id) const {
  absl::MutexLock lock(&impl_->mu);
  return impl_->sequences.contains(id);
}

CacheStats PagedKvCache::TenantStats(const std::string& tenant) const {
  absl::MutexLock lock(&impl_->mu);
  CacheStats s;
  auto it = impl_->tenants.find(tenant);
  if (it != impl_->tenants.end()) {
    s.pages_used = it->second.pages;
    s.sequences = it->second.sequences;
  }
  const int64_t pool_free = static_cast<int64_t>(impl_->free_list.size());
  s.pages_total = impl_->config.max_pages_per_tenant;
  s.pages_free = s.pages_total > 0 ? std::min(pool_free, s.pages_total - s.pages_used) : pool_free;
  return s;
}

CacheStats PagedKvCache::Stats() const {
  absl::MutexLock lock(&impl_->mu);
  CacheStats s;
  s.pages_total = impl_->config.num_pages;
  s.pages_free = static_cast<int64_t>(impl_->free_list.size());
  s.pages_used = s.pages_total - s.pages_free;
  s.sequences = static_cast<int64_t>(impl_->sequences.size());
  s.tokens = impl_->tokens;
  return s;
}

const CacheConfig& PagedKvCache::config() const { return impl_->config; }

CacheView PagedKvCache::view() const { return impl_->view; }

PageMemory& PagedKvCache::memory() { return *impl_->memory; }

}  // namespace sds
