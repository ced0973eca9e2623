#include <algorithm>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "efdl/snapshot.h"
#include "snapshot/layout.h"

namespace efdl::snapshot {

namespace {
constexpr const char* kFormat = "efdl-snapshot/1";
}

std::string TensorsJson(const std::vector<TensorEntry>& tensors) {
  nlohmann::json tensors_json = nlohmann::json::array();
  for (const auto& t : tensors) {
    tensors_json.push_back({{"name", t.name}, {"dtype", t.dtype}, {"shape", t.shape},
                            {"offset", t.offset}, {"nbytes", t.nbytes}});
  }
  return "\"tensors\":" + tensors_json.dump();
}

std::string Manifest::Serialize() const {
  nlohmann::json j = {{"format", kFormat}, {"job", job},           {"seq", seq},
                      {"step", step},     {"wall_time", wall_time}, {"scope", scope},
                      {"data_bytes", data_bytes}};
  // meta_json is embedded as a JSON value, not as a string; it was produced as JSON by the caller.
  std::string out = j.dump();
  out.pop_back();
  out += ',';
  out += TensorsJson(tensors);
  out += ",\"meta\":";
  out += meta_json.empty() ? "{}" : meta_json;
  out += '}';
  return out;
}

Result<Manifest> Manifest::Parse(std::string_view text) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return Status::Corruption("snapshot manifest is not valid JSON");
  }
  if (j.value("format", "") != kFormat) {
    return Status::Corruption(fmt::format("snapshot manifest has format '{}', expected '{}'",
                                          j.value("format", ""), kFormat));
  }
  Manifest m;
  try {
    m.job = j.at("job").get<std::string>();
    m.seq = j.at("seq").get<uint64_t>();
    m.step = j.at("step").get<int64_t>();
    m.wall_time = j.at("wall_time").get<double>();
    m.scope = j.value("scope", "node");
    m.data_bytes = j.at("data_bytes").get<uint64_t>();
    for (const auto& t : j.at("tensors")) {
      TensorEntry e;
      e.name = t.at("name").get<std::string>();
      e.dtype = t.at("dtype").get<std::string>();
      e.shape = t.at("shape").get<std::vector<int64_t>>();
      e.offset = t.at("offset").get<uint64_t>();
      e.nbytes = t.at("nbytes").get<uint64_t>();
      m.tensors.push_back(std::move(e));
    }
    m.meta_json = j.contains("meta") ? j["meta"].dump() : "{}";
  } catch (const nlohmann::json::exception& e) {
    return Status::Corruption(fmt::format("snapshot manifest is incomplete: {}", e.what()));
  }
  return m;
}

Status Manifest::Validate() const {
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const auto& t : tensors) {
    if (t.offset > data_bytes || t.nbytes > data_bytes - t.offset) {
      return Status::Corruption(
          fmt::format("tensor '{}' lies outside the snapshot's data region", t.name));
    }
    if (t.nbytes > 0) ranges.emplace_back(t.offset, t.nbytes);
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i - 1].first + ranges[i - 1].second > ranges[i].first) {
      return Status::Corruption("snapshot manifest has overlapping tensors");
    }
  }
  return Status::OK();
}

}  // namespace efdl::snapshot
