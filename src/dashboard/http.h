// HTTP for `efdl dashboard`, on civetweb (Debian: libcivetweb-dev; prometheus-cpp's exposer
// uses the same library): a small server that hands each GET to one handler, and a client GET
// for the agents' /metrics endpoints.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "efdl/status.h"

struct mg_context;
struct mg_connection;

namespace efdl::dashboard {

struct HttpResponse {
  int status = 200;
  std::string content_type = "text/plain; charset=utf-8";
  std::string body;
};

class HttpServer {
 public:
  // Called on the server's threads with the request path (no query string); must be
  // thread-safe and must not block for long.
  using Handler = std::function<HttpResponse(const std::string& path)>;

  // Listens on bind:port (bind: a numeric address; port 0: any free port). Error (one line)
  // when the address cannot be bound (taken port, address not of this host).
  static Result<std::unique_ptr<HttpServer>> Start(const std::string& bind, int port,
                                                   Handler handler);
  ~HttpServer();   // stops listening and waits for the requests in progress
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  int port() const { return port_; }

 private:
  explicit HttpServer(Handler handler) : handler_(std::move(handler)) {}
  static int Serve(mg_connection* conn, void* self);

  Handler handler_;
  int port_ = 0;
  mg_context* ctx_ = nullptr;
};

// Whether HttpServer can listen on IPv6 addresses (civetweb as Debian 12 builds it cannot).
bool HttpServerSupportsIpv6();

// GET http://host_port/path (host_port: HOST:PORT or [V6]:PORT). The body of a 200 answer, or
// one line saying why not (connection refused, timeout after timeout_ms, another status, a body
// over max_bytes).
Result<std::string> HttpGet(const std::string& host_port, const std::string& path,
                            int timeout_ms, size_t max_bytes);

}  // namespace efdl::dashboard
