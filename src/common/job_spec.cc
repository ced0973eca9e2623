#include "common/job_spec.h"

#include <fmt/format.h>

namespace efdl {

Status ValidateId(std::string_view what, std::string_view id) {
  auto allowed = [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
           c == '.' || c == '_' || c == '-';
  };
  bool ok = !id.empty() && id.size() <= 128 && id[0] != '.' && id[0] != '-';
  for (char c : id) ok = ok && allowed(c);
  if (!ok) {
    return Status::InvalidArgument(fmt::format(
        "{} '{}' is not valid: use 1-128 letters, digits, '.', '_' or '-', not starting with "
        "'.' or '-'", what, id));
  }
  return Status::OK();
}

std::string JobKeyPrefix(std::string_view job_id) { return fmt::format("/efdl/{}/", job_id); }

}  // namespace efdl
