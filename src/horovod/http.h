// The small part of HTTP/1.1 the Gloo rendezvous needs: an incremental request parser and a
// response serializer. No I/O here; the server feeds bytes in and writes bytes out.
//
// Accepted: origin-form targets, Content-Length bodies. Refused with a status and one line:
// malformed request or header lines, conflicting or non-numeric Content-Length, any
// Transfer-Encoding (the rendezvous clients never chunk), headers or body over the limits.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace efdl::horovod {

struct HttpRequest {
  std::string method;
  std::string target;
  int minor_version = 1;                                     // HTTP/1.<minor>
  std::vector<std::pair<std::string, std::string>> headers;  // names lower-cased
  std::string body;

  // The first header with this (lower-case) name, if any.
  std::optional<std::string_view> Header(std::string_view lower_name) const;
};

struct HttpResponse {
  int status = 200;
  std::string body;
  std::vector<std::pair<std::string, std::string>> extra_headers;

  // Status line, Content-Length, "Connection: close", extra headers, body.
  std::string Serialize() const;
};

std::string_view ReasonPhrase(int status);

// Not thread-safe; one per connection, one request per parser.
class HttpRequestParser {
 public:
  enum class State { kIncomplete, kComplete, kError };

  HttpRequestParser(size_t max_header_bytes, size_t max_body_bytes)
      : max_header_bytes_(max_header_bytes), max_body_bytes_(max_body_bytes) {}

  // Consumes more bytes of the connection. Bytes after a complete request are ignored (the
  // server closes every connection after one response, as Horovod's own server does).
  State Feed(std::string_view data);

  State state() const { return state_; }
  const HttpRequest& request() const { return request_; }
  HttpRequest& request() { return request_; }
  // After kError: the status to answer with and why.
  int error_status() const { return error_status_; }
  const std::string& error_message() const { return error_message_; }
  // True once, right after the headers of a request sending "Expect: 100-continue" were parsed
  // and its body is still to come; the server should then send "100 Continue".
  bool TakeContinueRequest() { return std::exchange(continue_pending_, false); }

 private:
  State Fail(int status, std::string message);
  State ParseHead(std::string_view head);

  size_t max_header_bytes_;
  size_t max_body_bytes_;
  State state_ = State::kIncomplete;
  bool head_done_ = false;
  bool continue_pending_ = false;
  size_t body_length_ = 0;
  std::string buffer_;
  HttpRequest request_;
  int error_status_ = 0;
  std::string error_message_;
};

}  // namespace efdl::horovod
