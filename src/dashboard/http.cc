#include "dashboard/http.h"

#include <civetweb.h>
#include <fmt/format.h>

#include <charconv>
#include <cstring>
#include <vector>

namespace efdl::dashboard {

namespace {

// civetweb's global set-up (reference-counted by the library itself), paired per server/client.
class LibraryUse {
 public:
  LibraryUse() { mg_init_library(0); }
  ~LibraryUse() { mg_exit_library(); }
  LibraryUse(const LibraryUse&) = delete;
  LibraryUse& operator=(const LibraryUse&) = delete;
};

void Reply(mg_connection* conn, const HttpResponse& r, bool head) {
  // Everything the page needs is inline; the policy tells the browser to fetch nothing else
  // (no CDN, nothing outside: a training cluster often cannot reach one).
  std::string headers = fmt::format(
      "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nCache-Control: no-store\r\n"
      "X-Content-Type-Options: nosniff\r\nContent-Security-Policy: default-src 'none'; "
      "script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; img-src "
      "data:\r\nConnection: close\r\n\r\n",
      r.status, mg_get_response_code_text(conn, r.status), r.content_type, r.body.size());
  mg_write(conn, headers.data(), headers.size());
  if (!head && !r.body.empty()) mg_write(conn, r.body.data(), r.body.size());
}

}  // namespace

bool HttpServerSupportsIpv6() {
  LibraryUse library;
  return mg_check_feature(8) != 0;   // 8: IPv6 (civetweb.h, mg_check_feature)
}

int HttpServer::Serve(mg_connection* conn, void* self) {
  const mg_request_info* info = mg_get_request_info(conn);
  const bool head = std::strcmp(info->request_method, "HEAD") == 0;
  if (!head && std::strcmp(info->request_method, "GET") != 0) {
    Reply(conn, {405, "text/plain; charset=utf-8", "only GET\n"}, false);
    return 405;
  }
  HttpResponse r = static_cast<HttpServer*>(self)->handler_(info->local_uri ? info->local_uri : "/");
  Reply(conn, r, head);
  return r.status;
}

Result<std::unique_ptr<HttpServer>> HttpServer::Start(const std::string& bind, int port,
                                                      Handler handler) {
  static_cast<void>(mg_init_library(0));
  std::unique_ptr<HttpServer> server(new HttpServer(std::move(handler)));
  const bool v6 = bind.find(':') != std::string::npos;
  std::string listen = v6 ? fmt::format("[{}]:{}", bind, port) : fmt::format("{}:{}", bind, port);
  // No document root: civetweb serves no files, only the handler below.
  const char* options[] = {"listening_ports", listen.c_str(), "num_threads", "4",
                           "request_timeout_ms", "10000", "enable_keep_alive", "no",
                           nullptr};
  mg_callbacks callbacks{};
  // civetweb's own error lines would go to stderr; the error below says it once.
  callbacks.log_message = [](const mg_connection*, const char*) { return 1; };
  mg_init_data init{&callbacks, server.get(), options};
  char text[256] = {0};
  unsigned code = 0;
  mg_error_data error{&code, text, sizeof(text)};
  server->ctx_ = mg_start2(&init, &error);
  if (server->ctx_ == nullptr) {
    mg_exit_library();
    return Status::Unavailable(fmt::format(
        "cannot listen on {}: {} (the port is taken, or the address is not one of this host's)",
        listen, text[0] ? text : "civetweb could not start"));
  }
  mg_set_request_handler(server->ctx_, "/", &HttpServer::Serve, server.get());
  mg_server_port ports[4];
  int n = mg_get_server_ports(server->ctx_, 4, ports);
  if (n < 1) return Status::Internal("civetweb reports no listening port");
  server->port_ = ports[0].port;
  return server;
}

HttpServer::~HttpServer() {
  if (ctx_ != nullptr) {
    mg_stop(ctx_);
    mg_exit_library();
  }
}

Result<std::string> HttpGet(const std::string& host_port, const std::string& path,
                            int timeout_ms, size_t max_bytes) {
  size_t colon = host_port.rfind(':');
  int port = 0;
  if (colon == std::string::npos || colon + 1 == host_port.size() ||
      std::from_chars(host_port.data() + colon + 1, host_port.data() + host_port.size(), port)
              .ptr != host_port.data() + host_port.size() ||
      port <= 0 || port > 65535) {
    return Status::InvalidArgument(fmt::format("'{}' is not HOST:PORT", host_port));
  }
  std::string host = host_port.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  LibraryUse library;
  char ebuf[256] = {0};
  mg_connection* conn = mg_connect_client(host.c_str(), port, 0, ebuf, sizeof(ebuf));
  if (conn == nullptr) {
    // civetweb's text names the address again: "connect(HOST:PORT): error Connection refused".
    std::string why = ebuf[0] ? ebuf : "connection failed";
    if (why.rfind("connect(", 0) == 0 && why.find("): ") != std::string::npos) {
      why = why.substr(why.find("): ") + 3);
    }
    if (why.rfind("error ", 0) == 0) why = why.substr(6);
    return Status::Unavailable(fmt::format("cannot connect to {}: {}", host_port, why));
  }
  struct Closer {
    mg_connection* c;
    ~Closer() { mg_close_connection(c); }
  } closer{conn};
  std::string request = fmt::format("GET {} HTTP/1.0\r\nHost: {}\r\nAccept: text/plain\r\n\r\n",
                                    path, host_port);
  if (mg_write(conn, request.data(), request.size()) != static_cast<int>(request.size())) {
    return Status::Unavailable(fmt::format("cannot send the request to {}", host_port));
  }
  ebuf[0] = 0;
  if (mg_get_response(conn, ebuf, sizeof(ebuf), timeout_ms) < 0) {
    return Status::Unavailable(fmt::format("no answer from http://{}{} within {} ms{}{}",
                                           host_port, path, timeout_ms, ebuf[0] ? ": " : "",
                                           ebuf));
  }
  const mg_response_info* info = mg_get_response_info(conn);
  if (info == nullptr || info->status_code != 200) {
    return Status::Unavailable(fmt::format("http://{}{} answered {}", host_port, path,
                                           info ? info->status_code : 0));
  }
  std::string body;
  std::vector<char> buf(16384);
  while (true) {
    int n = mg_read(conn, buf.data(), buf.size());
    if (n <= 0) break;
    body.append(buf.data(), static_cast<size_t>(n));
    if (body.size() > max_bytes) {
      return Status::Unavailable(fmt::format("http://{}{} answered more than {} bytes",
                                             host_port, path, max_bytes));
    }
  }
  return body;
}

}  // namespace efdl::dashboard
