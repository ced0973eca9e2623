// Fuzzes the decoders of the values under /efdl/<job>/ in etcd, which anything with access to
// the prefix may have written. Properties: no decoder crashes, throws or trips a sanitizer, and
// a decoded record re-encodes to a value that decodes to the same encoding (Encode is a fixed
// point after one round trip).
#include <cstdint>
#include <cstdlib>
#include <string>

#include "rendezvous/protocol.h"

namespace {

template <class Record>
void CheckRoundTrip(const std::string& text) {
  auto decoded = Record::Decode(text);
  if (!decoded.ok()) return;
  std::string once = decoded->Encode();
  auto again = Record::Decode(once);
  if (!again.ok() || again->Encode() != once) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  using namespace efdl::rdzv;
  CheckRoundTrip<RoundRecord>(text);
  CheckRoundTrip<NodeRecord>(text);
  CheckRoundTrip<AssignRecord>(text);
  CheckRoundTrip<AckRecord>(text);
  CheckRoundTrip<ComputeRecord>(text);
  CheckRoundTrip<StragglerRecord>(text);
  auto status = StatusRecord::Decode(text);
  (void)status;
  return 0;
}
