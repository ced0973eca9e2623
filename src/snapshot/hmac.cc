#include "snapshot/hmac.h"

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/params.h>

#include <algorithm>
#include <memory>
#include <vector>

#include <fmt/format.h>

namespace efdl::snapshot {

namespace {

// One HMAC-SHA256 computation (OpenSSL 3 EVP_MAC). Not thread-safe; one per use.
class Hmac {
 public:
  static Result<Hmac> Start(const std::string& key) {
    if (key.empty()) return Status::InvalidArgument("snapshot HMAC: the key is empty");
    std::unique_ptr<EVP_MAC, decltype(&EVP_MAC_free)> mac(EVP_MAC_fetch(nullptr, "HMAC", nullptr),
                                                          &EVP_MAC_free);
    if (!mac) return Status::Internal("snapshot HMAC: OpenSSL has no HMAC");
    Hmac h(EVP_MAC_CTX_new(mac.get()));
    if (!h.ctx_) return Status::Internal("snapshot HMAC: cannot create a context");
    char digest[] = "SHA256";
    OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0),
                           OSSL_PARAM_construct_end()};
    if (EVP_MAC_init(h.ctx_.get(), reinterpret_cast<const unsigned char*>(key.data()),
                     key.size(), params) != 1) {
      return Status::Internal("snapshot HMAC: cannot initialise HMAC-SHA256");
    }
    return h;
  }
  void Update(const void* data, size_t n) {
    EVP_MAC_update(ctx_.get(), static_cast<const unsigned char*>(data), n);
  }
  std::string FinalHex() {
    unsigned char out[EVP_MAX_MD_SIZE];
    size_t n = 0;
    EVP_MAC_final(ctx_.get(), out, &n, sizeof(out));
    std::string hex;
    for (size_t i = 0; i < n; ++i) hex += fmt::format("{:02x}", out[i]);
    return hex;
  }

 private:
  explicit Hmac(EVP_MAC_CTX* ctx) : ctx_(ctx, &EVP_MAC_CTX_free) {}
  std::unique_ptr<EVP_MAC_CTX, decltype(&EVP_MAC_CTX_free)> ctx_;
};

// The manifest as authenticated: re-parsed and re-serialized without its hmac, so the caller's
// spelling of meta_json (spaces, key order) gives the same bytes on write and on read.
Result<std::string> CanonicalManifest(const Manifest& manifest) {
  Manifest copy = manifest;
  copy.hmac.clear();
  EFDL_ASSIGN_OR_RETURN(Manifest parsed, Manifest::Parse(copy.Serialize()));
  return parsed.Serialize();
}

}  // namespace

Result<std::string> ComputeSnapshotHmac(const std::string& key, const Manifest& manifest,
                                        const uint8_t* data) {
  EFDL_ASSIGN_OR_RETURN(std::string text, CanonicalManifest(manifest));
  EFDL_ASSIGN_OR_RETURN(Hmac h, Hmac::Start(key));
  const uint64_t length = text.size();
  h.Update(&length, sizeof(length));  // where the manifest ends is part of what is signed
  h.Update(text.data(), text.size());
  h.Update(data, manifest.data_bytes);
  return h.FinalHex();
}

Result<std::string> HmacSha256Hex(const std::string& key, std::string_view message) {
  EFDL_ASSIGN_OR_RETURN(Hmac h, Hmac::Start(key));
  h.Update(message.data(), message.size());
  return h.FinalHex();
}

Status VerifySnapshotHmac(const std::string& key, const RandomAccessFile& file,
                          const SnapshotFileInfo& info, const std::string& path) {
  const Manifest& m = info.manifest;
  if (m.hmac.empty()) {
    return Status::Corruption(fmt::format(
        "snapshot seq {} in {} has no HMAC, and EFDL_SNAPSHOT_HMAC is on: it was written "
        "without it or by something else; not restoring it", m.seq, path));
  }
  EFDL_ASSIGN_OR_RETURN(std::string text, CanonicalManifest(m));
  EFDL_ASSIGN_OR_RETURN(Hmac h, Hmac::Start(key));
  const uint64_t length = text.size();
  h.Update(&length, sizeof(length));
  h.Update(text.data(), text.size());
  std::vector<uint8_t> buffer(4u << 20);
  for (uint64_t done = 0; done < m.data_bytes;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(buffer.size(), m.data_bytes - done));
    EFDL_RETURN_IF_ERROR(file.Read(info.data_offset + done, n, buffer.data()));
    h.Update(buffer.data(), n);
    done += n;
  }
  const std::string actual = h.FinalHex();
  if (actual.size() != m.hmac.size() ||
      CRYPTO_memcmp(actual.data(), m.hmac.data(), actual.size()) != 0) {
    return Status::Corruption(fmt::format(
        "snapshot seq {} in {} failed its HMAC check: it was not written by this job (another "
        "job's secret) or was altered; not restoring it", m.seq, path));
  }
  return Status::OK();
}

}  // namespace efdl::snapshot
