#include "plan/format.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace efdl::plan {

std::string FormatPlacementText(const Result<Placement>& result) {
  if (!result.ok()) return result.status().message() + "\n";
  const Placement& p = *result;
  std::string out = fmt::format("placement for {} process{} in {} part{}:\n", p.procs,
                                p.procs == 1 ? "" : "es", p.parts.size(),
                                p.parts.size() == 1 ? "" : "s");
  size_t width = 0;
  for (const auto& part : p.parts) width = std::max(width, part.host.size());
  for (const auto& part : p.parts) {
    std::string note = part.procs == part.free
                           ? fmt::format("fills its {} free GPU{}", part.free,
                                         part.free == 1 ? "" : "s")
                           : fmt::format("of {} free GPU{}, {} stay{} free", part.free,
                                         part.free == 1 ? "" : "s",
                                         part.free - part.procs,
                                         part.free - part.procs == 1 ? "s" : "");
    out += fmt::format("  {:<{}}  {} process{}  ({})\n", part.host, width, part.procs,
                       part.procs == 1 ? "" : "es", note);
  }
  std::string left;
  for (const auto& h : p.leftover) {
    left += fmt::format("{}{} {}", left.empty() ? "" : ", ", h.host, h.free);
  }
  out += fmt::format("free GPUs left: {}\n", left);
  if (!p.proven_best) {
    out += "note: the search hit its budget; the placement is valid but may not leave the "
           "least fragmentation\n";
  }
  return out;
}

std::string FormatPlacementJson(int procs, const Result<Placement>& result) {
  nlohmann::json j;
  j["procs"] = procs;
  if (!result.ok()) {
    j["parts"] = nullptr;
    j["reason"] = result.status().message();
    return j.dump() + "\n";
  }
  j["parts"] = nlohmann::json::array();
  for (const auto& part : result->parts) {
    j["parts"].push_back({{"host", part.host}, {"procs", part.procs}, {"free", part.free}});
  }
  // An array keeps the input order of hosts (a JSON object would be sorted by name).
  j["leftover"] = nlohmann::json::array();
  for (const auto& h : result->leftover) {
    j["leftover"].push_back({{"host", h.host}, {"free", h.free}});
  }
  j["proven_best"] = result->proven_best;
  return j.dump() + "\n";
}

}  // namespace efdl::plan
