// The etcd connection-security flags shared by every subcommand that talks to etcd (run,
// status, suspend/resume, ...): TLS files and user/password auth, each with an EFDL_ETCD_*
// environment variable. A password is never taken from argv (other users see argv in ps): it
// comes from a file (--etcd-password-file / EFDL_ETCD_PASSWORD_FILE) or EFDL_ETCD_PASSWORD.
#pragma once

#include <CLI/CLI.hpp>

#include <string>

#include "efdl/etcd.h"
#include "efdl/status.h"

namespace efdl::cli {

struct EtcdSecurityFlags {
  std::string cacert;
  std::string cert;
  std::string key;
  std::string user;
  std::string password_file;
};

// Adds --etcd-cacert, --etcd-cert, --etcd-key, --etcd-user and --etcd-password-file to `cmd`.
void AddEtcdSecurityFlags(CLI::App* cmd, EtcdSecurityFlags& flags);

// Fills options->tls, user and password from the flags (and EFDL_ETCD_PASSWORD when no file is
// given). Fails with one line naming the flag for an unreadable or empty password file or a
// password without a user.
Status ApplyEtcdSecurityFlags(const EtcdSecurityFlags& flags, etcd::ClientOptions* options);

}  // namespace efdl::cli
