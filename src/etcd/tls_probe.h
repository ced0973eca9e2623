// Diagnoses a failed TLS connection to etcd with a handshake of our own (OpenSSL): gRPC reports
// every handshake failure as "unavailable" with a text such as "Socket closed", so the cause
// (untrusted server certificate, refused client certificate, TLS to a plaintext port or the
// other way round) is found here, only after a connection has failed.
#pragma once

#include <string>

#include "efdl/etcd.h"

namespace efdl::etcd {

// Advice naming the setting to fix, or empty when the endpoint cannot be reached over TCP at
// all or the handshake works. `tls.enabled()` false: checks whether the endpoint wants TLS.
// Blocks up to about 2 * timeout. Thread-safe (no shared state).
std::string DiagnoseTlsEndpoint(const std::string& address, const TlsOptions& tls,
                                Duration timeout);

}  // namespace efdl::etcd
