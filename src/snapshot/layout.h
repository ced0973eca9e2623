// Placement of tensors in a snapshot's data region and their cutting into checksum pieces.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "efdl/snapshot.h"
#include "snapshot/hash.h"

namespace efdl::snapshot {

inline constexpr uint64_t kTensorAlign = 64;  // cache line: threads never share one

// Assigns offsets in order; returns the data region's size.
uint64_t AssignOffsets(std::vector<TensorEntry>& tensors);
// The pieces of every tensor, in tensor order (the order FoldPieceHashes expects).
std::vector<Piece> PiecesOf(const std::vector<TensorEntry>& tensors);

// `"tensors":[...]`, the manifest's tensor list (the per-commit manifest caches it).
std::string TensorsJson(const std::vector<TensorEntry>& tensors);

inline uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

}  // namespace efdl::snapshot
