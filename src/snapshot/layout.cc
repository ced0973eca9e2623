#include "snapshot/layout.h"

#include <algorithm>

namespace efdl::snapshot {

uint64_t AssignOffsets(std::vector<TensorEntry>& tensors) {
  uint64_t off = 0;
  for (auto& t : tensors) {
    t.offset = off;
    off = AlignUp(off + t.nbytes, kTensorAlign);
  }
  return off;
}

std::vector<Piece> PiecesOf(const std::vector<TensorEntry>& tensors) {
  std::vector<Piece> pieces;
  for (uint32_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    uint32_t index = 0;
    uint64_t done = 0;
    do {  // an empty tensor still has one (empty) piece, so it is covered by the checksum
      uint64_t len = std::min(kPieceBytes, t.nbytes - done);
      pieces.push_back(Piece{i, index++, t.offset + done, len});
      done += len;
    } while (done < t.nbytes);
  }
  return pieces;
}

}  // namespace efdl::snapshot
