#include "horovod/http.h"

#include <algorithm>
#include <cctype>

#include <fmt/format.h>

namespace efdl::horovod {

namespace {

bool IsTokenChar(char c) {
  if (std::isalnum(static_cast<unsigned char>(c))) return true;
  switch (c) {
    case '!': case '#': case '$': case '%': case '&': case '\'': case '*': case '+': case '-':
    case '.': case '^': case '_': case '`': case '|': case '~':
      return true;
    default:
      return false;
  }
}

std::string_view TrimSpaces(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

std::string Lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return out;
}

// Where the head ends (index just past the blank line), accepting CRLF or bare LF line ends.
std::optional<size_t> FindHeadEnd(std::string_view buf) {
  size_t pos = 0;
  while (true) {
    size_t nl = buf.find('\n', pos);
    if (nl == std::string_view::npos) return std::nullopt;
    std::string_view line = buf.substr(pos, nl - pos);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty() && pos > 0) return nl + 1;
    pos = nl + 1;
  }
}

}  // namespace

std::optional<std::string_view> HttpRequest::Header(std::string_view lower_name) const {
  for (const auto& [name, value] : headers) {
    if (name == lower_name) return std::string_view(value);
  }
  return std::nullopt;
}

std::string_view ReasonPhrase(int status) {
  switch (status) {
    case 100: return "Continue";
    case 200: return "OK";
    case 400: return "Bad Request";
    case 403: return "Forbidden";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 411: return "Length Required";
    case 413: return "Content Too Large";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 503: return "Service Unavailable";
    case 505: return "HTTP Version Not Supported";
    default: return "Unknown";
  }
}

std::string HttpResponse::Serialize() const {
  std::string out = fmt::format("HTTP/1.1 {} {}\r\nContent-Length: {}\r\nConnection: close\r\n",
                                status, ReasonPhrase(status), body.size());
  for (const auto& [name, value] : extra_headers) out += fmt::format("{}: {}\r\n", name, value);
  out += "\r\n";
  out += body;
  return out;
}

HttpRequestParser::State HttpRequestParser::Fail(int status, std::string message) {
  state_ = State::kError;
  error_status_ = status;
  error_message_ = std::move(message);
  buffer_.clear();
  return state_;
}

HttpRequestParser::State HttpRequestParser::Feed(std::string_view data) {
  if (state_ != State::kIncomplete) return state_;
  if (!head_done_) {
    buffer_.append(data);
    // Tolerate (like most servers) empty lines before the request line.
    size_t lead = 0;
    while (lead < buffer_.size() && (buffer_[lead] == '\r' || buffer_[lead] == '\n')) ++lead;
    if (lead > 0) buffer_.erase(0, lead);
    auto end = FindHeadEnd(buffer_);
    if (!end) {
      if (buffer_.size() > max_header_bytes_) {
        return Fail(431, fmt::format("request head is longer than {} bytes", max_header_bytes_));
      }
      return state_;
    }
    if (*end > max_header_bytes_) {
      return Fail(431, fmt::format("request head is longer than {} bytes", max_header_bytes_));
    }
    std::string rest = buffer_.substr(*end);
    std::string head = buffer_.substr(0, *end);
    buffer_.clear();
    if (ParseHead(head) == State::kError) return state_;
    head_done_ = true;
    data = {};
    request_.body = std::move(rest);
  }
  size_t want = body_length_ - std::min(body_length_, request_.body.size());
  request_.body.append(data.substr(0, std::min(want, data.size())));
  if (request_.body.size() >= body_length_) {
    request_.body.resize(body_length_);  // drop anything sent after the body
    continue_pending_ = false;
    state_ = State::kComplete;
  }
  return state_;
}

HttpRequestParser::State HttpRequestParser::ParseHead(std::string_view head) {
  std::vector<std::string_view> lines;
  size_t pos = 0;
  while (pos < head.size()) {
    size_t nl = head.find('\n', pos);
    std::string_view line = head.substr(pos, nl - pos);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (!line.empty()) lines.push_back(line);
    pos = nl + 1;
  }
  if (lines.empty()) return Fail(400, "empty request");

  // Request line: METHOD SP target SP HTTP/1.x
  std::string_view rl = lines[0];
  size_t sp1 = rl.find(' ');
  size_t sp2 = sp1 == std::string_view::npos ? sp1 : rl.find(' ', sp1 + 1);
  if (sp1 == std::string_view::npos || sp2 == std::string_view::npos ||
      rl.find(' ', sp2 + 1) != std::string_view::npos) {
    return Fail(400, "malformed request line: expected 'METHOD /path HTTP/1.1'");
  }
  std::string_view method = rl.substr(0, sp1);
  std::string_view target = rl.substr(sp1 + 1, sp2 - sp1 - 1);
  std::string_view version = rl.substr(sp2 + 1);
  if (method.empty() || !std::all_of(method.begin(), method.end(), IsTokenChar)) {
    return Fail(400, "malformed request method");
  }
  if (target.empty() || target.front() != '/') {
    return Fail(400, "request target must be a path starting with '/'");
  }
  for (char c : target) {
    if (static_cast<unsigned char>(c) <= 0x20 || c == 0x7f) {
      return Fail(400, "request target contains a control character");
    }
  }
  if (version == "HTTP/1.1") {
    request_.minor_version = 1;
  } else if (version == "HTTP/1.0") {
    request_.minor_version = 0;
  } else if (version.substr(0, 5) == "HTTP/") {
    return Fail(505, fmt::format("HTTP version '{}' is not supported: use HTTP/1.1", version));
  } else {
    return Fail(400, "malformed request line: expected 'METHOD /path HTTP/1.1'");
  }
  request_.method = std::string(method);
  request_.target = std::string(target);

  std::optional<size_t> content_length;
  for (size_t i = 1; i < lines.size(); ++i) {
    std::string_view line = lines[i];
    if (line.front() == ' ' || line.front() == '\t') {
      return Fail(400, "folded header lines are not accepted");
    }
    size_t colon = line.find(':');
    if (colon == std::string_view::npos || colon == 0) {
      return Fail(400, fmt::format("malformed header line '{}'", line.substr(0, 64)));
    }
    std::string_view name = line.substr(0, colon);
    if (!std::all_of(name.begin(), name.end(), IsTokenChar)) {
      return Fail(400, fmt::format("malformed header name '{}'", name.substr(0, 64)));
    }
    std::string lname = Lower(name);
    std::string_view value = TrimSpaces(line.substr(colon + 1));
    if (lname == "content-length") {
      if (value.empty() || value.size() > 19 ||
          !std::all_of(value.begin(), value.end(),
                       [](char c) { return c >= '0' && c <= '9'; })) {
        return Fail(400, fmt::format("Content-Length '{}' is not a number", value.substr(0, 32)));
      }
      size_t n = std::stoull(std::string(value));
      if (content_length && *content_length != n) {
        return Fail(400, "conflicting Content-Length headers");
      }
      content_length = n;
    } else if (lname == "transfer-encoding") {
      return Fail(501, "Transfer-Encoding is not supported: send the body with a Content-Length");
    }
    request_.headers.emplace_back(std::move(lname), std::string(value));
  }
  body_length_ = content_length.value_or(0);
  if (body_length_ > max_body_bytes_) {
    return Fail(413, fmt::format("body of {} bytes is over the limit of {} bytes", body_length_,
                                 max_body_bytes_));
  }
  if (request_.method == "PUT" && !content_length) {
    return Fail(411, "PUT needs a Content-Length header");
  }
  if (body_length_ > 0 && request_.minor_version == 1) {
    auto expect = request_.Header("expect");
    if (expect && Lower(*expect) == "100-continue") continue_pending_ = true;
  }
  return state_;
}

}  // namespace efdl::horovod
