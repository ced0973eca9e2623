#include <algorithm>
#include <limits>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "efdl/snapshot.h"
#include "snapshot/layout.h"
#include "snapshot/scope.h"

namespace efdl::snapshot {

namespace {
constexpr const char* kFormat = "efdl-snapshot/1";

// A field that is not an integer in range. nlohmann's get<integer>() would cast a float, which
// is undefined behaviour when it does not fit (1e300), and wrap a negative value into uint64.
struct BadInteger {
  std::string field;
};

uint64_t U64(const nlohmann::json& v, const char* field) {
  if (!v.is_number_unsigned()) throw BadInteger{field};
  return v.get<uint64_t>();
}

int64_t I64(const nlohmann::json& v, const char* field) {
  if (!v.is_number_integer() ||
      (v.is_number_unsigned() &&
       v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))) {
    throw BadInteger{field};
  }
  return v.get<int64_t>();
}
}  // namespace

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
  if (!hmac.empty()) out += ",\"hmac\":" + nlohmann::json(hmac).dump();
  out += '}';
  return out;
}

Result<Manifest> Manifest::Parse(std::string_view text) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return Status::Corruption("snapshot manifest is not valid JSON");
  }
  // value() would throw on a non-string "format": read it only once it is known to be one.
  auto format = j.find("format");
  if (format == j.end() || !format->is_string() || format->get<std::string>() != kFormat) {
    std::string got = format == j.end() ? "" : format->dump().substr(0, 64);
    return Status::Corruption(
        fmt::format("snapshot manifest has format {}, expected '{}'", got, kFormat));
  }
  Manifest m;
  try {
    m.job = j.at("job").get<std::string>();
    m.seq = U64(j.at("seq"), "seq");
    m.step = I64(j.at("step"), "step");
    m.wall_time = j.at("wall_time").get<double>();
    m.scope = j.value("scope", std::string(kNodeScope));
    m.data_bytes = U64(j.at("data_bytes"), "data_bytes");
    for (const auto& t : j.at("tensors")) {
      TensorEntry e;
      e.name = t.at("name").get<std::string>();
      e.dtype = t.at("dtype").get<std::string>();
      for (const auto& d : t.at("shape")) e.shape.push_back(I64(d, "shape"));
      e.offset = U64(t.at("offset"), "offset");
      e.nbytes = U64(t.at("nbytes"), "nbytes");
      m.tensors.push_back(std::move(e));
    }
    m.meta_json = j.contains("meta") ? j["meta"].dump() : "{}";
    m.hmac = j.value("hmac", "");
  } catch (const nlohmann::json::exception& e) {
    return Status::Corruption(fmt::format("snapshot manifest is incomplete: {}", e.what()));
  } catch (const BadInteger& e) {
    return Status::Corruption(fmt::format(
        "snapshot manifest field '{}' is not a whole number in range", e.field));
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
