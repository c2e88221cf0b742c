#include "server/auth.h"

#include "absl/strings/str_cat.h"

namespace sds::server {
namespace {

constexpr char kSeparator = '\x1f';

}  // namespace

std::string SequenceKey(absl::string_view tenant, absl::string_view sequence_id) {
  return absl::StrCat(tenant, absl::string_view(&kSeparator, 1), sequence_id);
}

}  // namespace sds::server
