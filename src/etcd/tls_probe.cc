#include "etcd/tls_probe.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <sys/socket.h>
#include <unistd.h>

#include <memory>

#include <fmt/format.h>

namespace efdl::etcd {

namespace {

struct SslCtxFree {
  void operator()(SSL_CTX* c) const { SSL_CTX_free(c); }
};
struct SslFree {
  void operator()(SSL* s) const { SSL_free(s); }
};

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

// A blocking TCP connection whose reads and writes time out after `timeout`; -1 on failure.
int ConnectTcp(const std::string& host, const std::string& port, Duration timeout) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), port.c_str(), &hints, &found) != 0) return -1;
  int fd = -1;
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(timeout.count() / 1000);
  tv.tv_usec = static_cast<suseconds_t>((timeout.count() % 1000) * 1000);
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    if (::connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
      ::close(fd);
      fd = -1;
    }
  }
  ::freeaddrinfo(found);
  return fd;
}

bool ReasonIsOneOf(unsigned long err, std::initializer_list<int> reasons) {
  if (err == 0) return false;
  const int reason = ERR_GET_REASON(err);
  for (int r : reasons) {
    if (reason == r) return true;
  }
  return false;
}

bool IsClientCertAlert(unsigned long err) {
  return ReasonIsOneOf(err, {SSL_R_SSLV3_ALERT_BAD_CERTIFICATE, SSL_R_TLSV1_ALERT_UNKNOWN_CA,
                             SSL_R_TLSV13_ALERT_CERTIFICATE_REQUIRED,
                             SSL_R_SSLV3_ALERT_HANDSHAKE_FAILURE,
                             SSL_R_SSLV3_ALERT_CERTIFICATE_UNKNOWN,
                             SSL_R_TLSV1_ALERT_DECRYPT_ERROR});
}

bool IsNotTls(unsigned long err) {
  return ReasonIsOneOf(err, {SSL_R_WRONG_VERSION_NUMBER, SSL_R_PACKET_LENGTH_TOO_LONG,
                             SSL_R_HTTP_REQUEST,
                             SSL_R_UNEXPECTED_EOF_WHILE_READING});
}

const char* const kClientCertRefused =
    "etcd refused our client certificate (it runs with --client-cert-auth): give a "
    "certificate signed by etcd's --trusted-ca-file with --etcd-cert and --etcd-key";

}  // namespace

std::string DiagnoseTlsEndpoint(const std::string& address, const TlsOptions& tls,
                                Duration timeout) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return {};
  std::string host = address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  Fd fd(ConnectTcp(host, address.substr(colon + 1), timeout));
  if (fd.get() < 0) return {};  // not reachable at all: not a TLS problem

  std::unique_ptr<SSL_CTX, SslCtxFree> ctx(SSL_CTX_new(TLS_client_method()));
  if (!ctx) return {};
  const bool want_tls = tls.enabled();
  if (want_tls) {
    SSL_CTX_set_verify(ctx.get(), SSL_VERIFY_PEER, nullptr);
    const bool loaded = tls.ca_file.empty()
                            ? SSL_CTX_set_default_verify_paths(ctx.get()) == 1
                            : SSL_CTX_load_verify_locations(ctx.get(), tls.ca_file.c_str(),
                                                            nullptr) == 1;
    if (!loaded) return {};  // the file was readable for gRPC; nothing better to say here
    if (!tls.cert_file.empty() &&
        (SSL_CTX_use_certificate_chain_file(ctx.get(), tls.cert_file.c_str()) != 1 ||
         SSL_CTX_use_PrivateKey_file(ctx.get(), tls.key_file.c_str(), SSL_FILETYPE_PEM) != 1)) {
      return fmt::format("--etcd-cert '{}' and --etcd-key '{}' are not a usable certificate "
                         "and matching private key", tls.cert_file, tls.key_file);
    }
  } else {
    SSL_CTX_set_verify(ctx.get(), SSL_VERIFY_NONE, nullptr);
  }
  std::unique_ptr<SSL, SslFree> ssl(SSL_new(ctx.get()));
  if (!ssl) return {};
  SSL_set_fd(ssl.get(), fd.get());
  if (want_tls) {
    // Check the name the way gRPC does: the certificate must name the host we dial.
    in6_addr ip{};
    const bool is_ip = ::inet_pton(AF_INET, host.c_str(), &ip) == 1 ||
                       ::inet_pton(AF_INET6, host.c_str(), &ip) == 1;
    X509_VERIFY_PARAM* param = SSL_get0_param(ssl.get());
    if (is_ip) {
      X509_VERIFY_PARAM_set1_ip_asc(param, host.c_str());
    } else {
      SSL_set1_host(ssl.get(), host.c_str());
      // SSL_set_tlsext_host_name is a macro with a C cast; this is what it expands to.
      SSL_ctrl(ssl.get(), SSL_CTRL_SET_TLSEXT_HOSTNAME, TLSEXT_NAMETYPE_host_name,
               const_cast<char*>(host.c_str()));
    }
  }
  ERR_clear_error();
  if (SSL_connect(ssl.get()) != 1) {
    const unsigned long err = ERR_peek_last_error();
    if (!want_tls) return {};  // it does not speak TLS either: not a TLS mix-up
    const long verify = SSL_get_verify_result(ssl.get());
    if (verify != X509_V_OK) {
      return fmt::format(
          "the server's certificate is not trusted ({}): it is not signed by the CA in "
          "--etcd-cacert{} or does not name '{}'; give the CA that signed etcd's --cert-file",
          X509_verify_cert_error_string(verify),
          tls.ca_file.empty() ? " (none given: the system's CAs)" : " '" + tls.ca_file + "'",
          host);
    }
    if (IsClientCertAlert(err)) return kClientCertRefused;
    // A plaintext server answers a ClientHello with HTTP (or closes the connection).
    if (IsNotTls(err) || err == 0) {
      return "the endpoint does not speak TLS: it is a plaintext (http) etcd; drop "
             "--etcd-cacert/--etcd-cert/--etcd-key or point --etcd at the https endpoint";
    }
    return fmt::format("the TLS handshake failed ({})", ERR_reason_error_string(err));
  }
  if (!want_tls) {
    return "this etcd serves TLS (https): give the CA that signed its certificate with "
           "--etcd-cacert (and a client certificate with --etcd-cert/--etcd-key when it runs "
           "with --client-cert-auth)";
  }
  // With TLS 1.3 the server judges our certificate after the handshake completed on our side:
  // a refusal arrives as an alert on the first read (an HTTP/2 SETTINGS frame or a timeout
  // mean it was accepted).
  char byte = 0;
  ERR_clear_error();
  if (SSL_read(ssl.get(), &byte, 1) <= 0 && IsClientCertAlert(ERR_peek_last_error())) {
    return kClientCertRefused;
  }
  return {};
}

}  // namespace efdl::etcd
