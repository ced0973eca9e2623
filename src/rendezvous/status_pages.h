// The `P status` record in pages (issue #37). The record lists every member and standby (about
// 65 bytes each), and etcd refuses a request over --max-request-bytes (1.5 MiB by default): one
// record would pass that near 24,000 nodes. Up to kStatusPageEntries entries it stays one key,
// as before; above, `P status` keeps the round, the coordinator and the events plus
// {"pages": n, "seq": s}, and `P status/00000` .. hold the members and standbys, each page
// stamped with the same seq. Readers take the pages of the header's seq only (a page of another
// write is skipped); pages beyond n from an earlier, larger write are deleted after the header.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "efdl/etcd.h"
#include "efdl/status.h"
#include "rendezvous/protocol.h"

namespace efdl::rdzv {

inline constexpr size_t kStatusPageEntries = 4096;   // about 270 KB per page

// The key of page `index` of job `keys`' status record.
std::string StatusPageKey(const JobKeys& keys, size_t index);
// The prefix of every page (P status/).
std::string StatusPagePrefix(const JobKeys& keys);

// Writes the status record `st` (an object with "members" and "standbys" arrays), split into
// pages when the two lists hold more than `page_entries` entries together.
// The answer is the header's put.
Result<etcd::PutResult> PutStatusRecord(etcd::Client& client, const JobKeys& keys,
                                        nlohmann::json st,
                                        size_t page_entries = kStatusPageEntries);

// The record as one JSON text (the pages' members and standbys put back in), from the header's
// value and the keys read under StatusPagePrefix. A header without pages is returned as is.
std::string JoinStatusPages(const std::string& header, const std::vector<etcd::KeyValue>& pages);

}  // namespace efdl::rdzv
