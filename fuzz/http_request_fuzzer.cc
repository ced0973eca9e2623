// Fuzzes the Horovod rendezvous server's HTTP request parser. The first input byte picks how the
// rest is split into Feed() calls, so requests cut at every place are covered. Properties: no
// crash or sanitizer report; a completed request's body has exactly its Content-Length; an
// error carries a 4xx/5xx status and a message.
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "horovod/http.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const size_t chunk = 1 + data[0] % 64;
  std::string_view input(reinterpret_cast<const char*>(data) + 1, size - 1);
  efdl::horovod::HttpRequestParser parser(/*max_header_bytes=*/4096, /*max_body_bytes=*/8192);
  using State = efdl::horovod::HttpRequestParser::State;
  State state = State::kIncomplete;
  for (size_t pos = 0; pos < input.size() && state == State::kIncomplete; pos += chunk) {
    state = parser.Feed(input.substr(pos, chunk));
    parser.TakeContinueRequest();
  }
  if (state == State::kComplete) {
    auto length = parser.request().Header("content-length");
    size_t want = 0;
    if (length) {
      for (char c : *length) want = want * 10 + static_cast<size_t>(c - '0');
    }
    if (parser.request().body.size() != want) std::abort();
  } else if (state == State::kError) {
    if (parser.error_status() < 400 || parser.error_status() > 599 ||
        parser.error_message().empty()) {
      std::abort();
    }
  }
  return 0;
}
