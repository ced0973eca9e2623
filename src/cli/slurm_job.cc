#include "cli/slurm_job.h"

#include <cstdlib>

namespace efdl::cli {

std::string SlurmJobId(std::string_view id) {
  if (id.empty() || id.size() > 64) return "";
  std::string out = "slurm-";
  bool digit_seen = false;
  bool underscore_seen = false;
  for (char c : id) {
    if (c >= '0' && c <= '9') {
      out += c;
      digit_seen = true;
    } else if (c == '_' && digit_seen && !underscore_seen) {
      out += '-';
      underscore_seen = true;
      digit_seen = false;
    } else {
      return "";
    }
  }
  return digit_seen ? out : "";
}

std::string SlurmJobIdFromEnv() {
  const char* id = std::getenv("SLURM_JOB_ID");
  return id == nullptr ? std::string() : SlurmJobId(id);
}

}  // namespace efdl::cli
