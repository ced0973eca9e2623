// The optional HMAC-SHA256 of a stored snapshot, keyed with the job's secret (EFDL_JOB_SECRET,
// enabled by EFDL_SNAPSHOT_HMAC=1): the checksums catch accidents (bit rot, truncation), the
// HMAC catches a file that someone without the job's secret wrote or altered, including one
// whose checksums were recomputed. It covers the manifest (in a canonical form, so its JSON
// spelling does not matter) and every byte of the data region; it is stored in the manifest's
// "hmac" field. Snapshots in shared memory are not covered (they never leave the node and are
// 0600).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "efdl/snapshot.h"
#include "snapshot/env.h"
#include "snapshot/snapshot_file.h"

namespace efdl::snapshot {

// Hex HMAC-SHA256 of `manifest` (its hmac field ignored) and `data` (manifest.data_bytes long).
Result<std::string> ComputeSnapshotHmac(const std::string& key, const Manifest& manifest,
                                        const uint8_t* data);

// Hex HMAC-SHA256 of `message` keyed with `key` (the job's secret): the challenge answers of
// the peer copy's connections (src/agent/peer_copy.h).
Result<std::string> HmacSha256Hex(const std::string& key, std::string_view message);

// Recomputes the HMAC of a stored snapshot (reading its data region) and compares it with the
// manifest's. Corruption with a line naming the file when it is missing or does not match.
Status VerifySnapshotHmac(const std::string& key, const RandomAccessFile& file,
                          const SnapshotFileInfo& info, const std::string& path);

}  // namespace efdl::snapshot
