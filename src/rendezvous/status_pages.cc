#include "rendezvous/status_pages.h"

#include <fmt/format.h>

#include <chrono>
#include <utility>

namespace efdl::rdzv {

using nlohmann::json;

std::string StatusPagePrefix(const JobKeys& keys) { return keys.status + "/"; }

std::string StatusPageKey(const JobKeys& keys, size_t index) {
  return fmt::format("{}{:05}", StatusPagePrefix(keys), index);
}

Result<etcd::PutResult> PutStatusRecord(etcd::Client& client, const JobKeys& keys, json st,
                                        size_t page_entries) {
  const json no_list = json::array();
  const json& members = st.contains("members") ? st["members"] : no_list;
  const json& standbys = st.contains("standbys") ? st["standbys"] : no_list;
  const size_t entries = members.size() + standbys.size();
  size_t pages = 0;
  if (entries > page_entries && page_entries > 0) {
    // A write's pages and header share a seq no other write of this job uses.
    const int64_t seq = std::chrono::duration_cast<std::chrono::microseconds>(
                            std::chrono::system_clock::now().time_since_epoch())
                            .count();
    size_t m = 0, s = 0;
    while (m < members.size() || s < standbys.size()) {
      json page = {{"seq", seq}, {"members", json::array()}, {"standbys", json::array()}};
      for (size_t k = 0; k < page_entries && (m < members.size() || s < standbys.size()); ++k) {
        if (m < members.size()) {
          page["members"].push_back(members[m++]);
        } else {
          page["standbys"].push_back(standbys[s++]);
        }
      }
      auto put = client.Put(StatusPageKey(keys, pages), page.dump());
      if (!put.ok()) return put.status().WithContext("a page of it");
      ++pages;
    }
    st["members"] = json::array();
    st["standbys"] = json::array();
    st["pages"] = pages;
    st["seq"] = seq;
  }
  auto put = client.Put(keys.status, st.dump());
  if (!put.ok()) return put.status();
  // Pages of an earlier, larger record: gone, one by one until the first that is not there.
  for (size_t k = pages;; ++k) {
    auto del = client.Delete(StatusPageKey(keys, k));
    if (!del.ok() || del->deleted == 0) break;
  }
  return put;
}

std::string JoinStatusPages(const std::string& header, const std::vector<etcd::KeyValue>& pages) {
  json st = json::parse(header, nullptr, /*allow_exceptions=*/false);
  if (!st.is_object() || !st.contains("pages") || !st["seq"].is_number_integer()) return header;
  const int64_t seq = st["seq"].get<int64_t>();
  json members = json::array(), standbys = json::array();
  for (const auto& kv : pages) {   // in key order: page 00000 first
    json page = json::parse(kv.value, nullptr, false);
    if (!page.is_object() || !page.contains("seq") || page["seq"] != seq) continue;
    for (const char* list : {"members", "standbys"}) {
      if (!page.contains(list) || !page[list].is_array()) continue;
      json& into = std::string(list) == "members" ? members : standbys;
      for (auto& e : page[list]) into.push_back(std::move(e));
    }
  }
  st["members"] = std::move(members);
  st["standbys"] = std::move(standbys);
  st.erase("pages");
  st.erase("seq");
  return st.dump();
}

}  // namespace efdl::rdzv
