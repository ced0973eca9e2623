#include "cli/etcd_flags.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "cli/commands.h"
#include "common/log.h"

namespace efdl::cli {

namespace {

Result<std::string> ReadPasswordFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return Status::InvalidArgument(fmt::format(
        "--etcd-password-file '{}': cannot read it ({}); give a readable file holding the "
        "etcd password", path, std::strerror(errno)));
  }
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && (st.st_mode & (S_IRWXG | S_IRWXO)) != 0) {
    EFDL_LOG_WARN("--etcd-password-file '{}' is readable by other users (mode {:o}); "
                  "chmod 600 it", path, st.st_mode & 0777);
  }
  std::ostringstream text;
  text << in.rdbuf();
  std::string password = text.str();
  // Files written with echo end in a newline that is not part of the password.
  while (!password.empty() && (password.back() == '\n' || password.back() == '\r')) {
    password.pop_back();
  }
  if (password.empty()) {
    return Status::InvalidArgument(fmt::format(
        "--etcd-password-file '{}' is empty; put the etcd user's password in it", path));
  }
  return password;
}

}  // namespace

void AddEtcdSecurityFlags(CLI::App* cmd, EtcdSecurityFlags& flags) {
  OptionWithEnv(cmd, "--etcd-cacert", flags.cacert,
                "PEM file of the CA that signed etcd's server certificate (turns on TLS)",
                "EFDL_ETCD_CACERT");
  OptionWithEnv(cmd, "--etcd-cert", flags.cert,
                "PEM client certificate for an etcd with --client-cert-auth (with --etcd-key)",
                "EFDL_ETCD_CERT");
  OptionWithEnv(cmd, "--etcd-key", flags.key, "PEM private key of --etcd-cert", "EFDL_ETCD_KEY");
  OptionWithEnv(cmd, "--etcd-user", flags.user, "etcd user name (etcd auth enabled)",
                "EFDL_ETCD_USER");
  OptionWithEnv(cmd, "--etcd-password-file", flags.password_file,
                "file holding the etcd user's password (or set EFDL_ETCD_PASSWORD)",
                "EFDL_ETCD_PASSWORD_FILE");
}

Status ApplyEtcdSecurityFlags(const EtcdSecurityFlags& flags, etcd::ClientOptions* options) {
  options->tls.ca_file = flags.cacert;
  options->tls.cert_file = flags.cert;
  options->tls.key_file = flags.key;
  options->user = flags.user;
  options->password.clear();
  if (!flags.password_file.empty()) {
    EFDL_ASSIGN_OR_RETURN(options->password, ReadPasswordFile(flags.password_file));
  } else if (const char* env = std::getenv("EFDL_ETCD_PASSWORD"); env != nullptr) {
    options->password = env;
  }
  if (options->user.empty() && !options->password.empty()) {
    return Status::InvalidArgument(
        "an etcd password was given (--etcd-password-file or EFDL_ETCD_PASSWORD) without a "
        "user: give --etcd-user (or EFDL_ETCD_USER) too");
  }
  if (!options->user.empty() && options->password.empty()) {
    return Status::InvalidArgument(fmt::format(
        "--etcd-user '{}' needs a password: give --etcd-password-file (or "
        "EFDL_ETCD_PASSWORD_FILE / EFDL_ETCD_PASSWORD)", options->user));
  }
  return Status::OK();
}

}  // namespace efdl::cli
