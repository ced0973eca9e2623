#!/usr/bin/env bash
# Test fixtures for etcd over TLS with auth, made at test time (nothing secret is checked in).
#   secure_etcd_setup.sh certs DIR
#       DIR/ca.pem, server.pem + server-key.pem (for 127.0.0.1 and localhost), client.pem +
#       client-key.pem signed by that CA, and other-ca.pem + other-client.pem/-key.pem signed
#       by an unrelated CA (the "wrong CA" cases). EC P-256 keys: fast to make.
#   secure_etcd_setup.sh auth ENDPOINT DIR
#       With etcdctl over TLS (certs from DIR): users root (password rootpw) and job (password
#       jobpw), role efdl-job with readwrite on the /efdl/ prefix granted to job; enables auth.
#   secure_etcd_setup.sh job-roles ENDPOINT DIR JOB...
#       After `auth` (as root): for each JOB a user user-JOB (password pw-JOB) holding a role
#       efdl-job-JOB with readwrite on the key range /efdl/JOB/ only (every key a job uses:
#       src/rendezvous/protocol.h, src/security/job_secret.h). The trailing slash keeps job
#       "a" off the keys of job "ab".
set -euo pipefail

certs() {
  local d=$1
  mkdir -p "$d"
  cd "$d"
  local subj_prefix="/O=efdl-test"
  for ca in ca other-ca; do
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 \
      -subj "$subj_prefix/CN=$ca" -keyout "$ca-key.pem" -out "$ca.pem" 2>/dev/null
  done
  issue() {  # name ca cn extensions
    openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
      -subj "$subj_prefix/CN=$3" -keyout "$1-key.pem" -out "$1.csr" 2>/dev/null
    printf '%s\n' "$4" > "$1.ext"
    openssl x509 -req -in "$1.csr" -CA "$2.pem" -CAkey "$2-key.pem" -CAcreateserial -days 2 \
      -extfile "$1.ext" -out "$1.pem" 2>/dev/null
    rm -f "$1.csr" "$1.ext"
  }
  issue server ca server "subjectAltName=IP:127.0.0.1,DNS:localhost
extendedKeyUsage=serverAuth,clientAuth"
  issue client ca efdl-client "extendedKeyUsage=clientAuth"
  issue other-client other-ca efdl-client "extendedKeyUsage=clientAuth"
  chmod 600 ./*-key.pem
}

auth() {
  local endpoint=$1 d=$2
  local ctl=(etcdctl --endpoints "https://$endpoint" --cacert "$d/ca.pem" --cert "$d/client.pem"
             --key "$d/client-key.pem" --dial-timeout 5s --command-timeout 10s)
  export ETCDCTL_API=3
  "${ctl[@]}" user add root:rootpw >/dev/null
  "${ctl[@]}" user grant-role root root >/dev/null
  "${ctl[@]}" user add job:jobpw >/dev/null
  "${ctl[@]}" role add efdl-job >/dev/null
  "${ctl[@]}" role grant-permission efdl-job --prefix=true readwrite /efdl/ >/dev/null
  "${ctl[@]}" user grant-role job efdl-job >/dev/null
  "${ctl[@]}" auth enable >/dev/null
}

job_roles() {
  local endpoint=$1 d=$2
  shift 2
  local ctl=(etcdctl --endpoints "https://$endpoint" --cacert "$d/ca.pem" --cert "$d/client.pem"
             --key "$d/client-key.pem" --dial-timeout 5s --command-timeout 10s --user root:rootpw)
  export ETCDCTL_API=3
  local job
  for job in "$@"; do
    if [[ ! $job =~ ^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$ ]]; then  # ValidateId's rule (common/job_spec.h)
      echo "$0: job id '$job' is not a valid EFDL job id" >&2
      exit 2
    fi
    "${ctl[@]}" user add "user-$job:pw-$job" >/dev/null
    "${ctl[@]}" role add "efdl-job-$job" >/dev/null
    "${ctl[@]}" role grant-permission "efdl-job-$job" --prefix=true readwrite "/efdl/$job/" \
      >/dev/null
    "${ctl[@]}" user grant-role "user-$job" "efdl-job-$job" >/dev/null
  done
}

case "${1:-}" in
  certs) certs "$2" ;;
  auth) auth "$2" "$3" ;;
  job-roles) [[ $# -ge 4 ]] || { echo "usage: $0 job-roles ENDPOINT DIR JOB..." >&2; exit 2; }
             job_roles "${@:2}" ;;
  *) echo "usage: $0 certs DIR | auth ENDPOINT DIR | job-roles ENDPOINT DIR JOB..." >&2; exit 2 ;;
esac
