// The parts of etcd.h that every Client shares, real or fake.
#include <fmt/format.h>

#include "efdl/etcd.h"

namespace efdl::etcd {

Result<std::optional<KeyValue>> Client::Get(const std::string& key) {
  EFDL_ASSIGN_OR_RETURN(RangeResult range, Range(key));
  if (range.kvs.empty()) return std::optional<KeyValue>();
  return std::optional<KeyValue>(std::move(range.kvs.front()));
}

Status Client::Compact(int64_t /*revision*/) {
  return Status::Internal("this etcd client does not implement Compact");
}

Result<int64_t> Client::CurrentRevision() {
  RangeOptions options;
  options.count_only = true;
  // Any key will do: the answer's header carries the store's revision.
  EFDL_ASSIGN_OR_RETURN(RangeResult range, Range(std::string(1, '\0'), options));
  return range.revision;
}

std::string PrefixRangeEnd(const std::string& prefix) {
  std::string end = prefix;
  while (!end.empty()) {
    auto last = static_cast<unsigned char>(end.back());
    if (last < 0xff) {
      end.back() = static_cast<char>(last + 1);
      return end;
    }
    end.pop_back();  // 0xff cannot be incremented: carry into the byte before
  }
  return std::string(1, '\0');  // every key >= prefix (etcd's convention)
}

}  // namespace efdl::etcd
