// Conversions from etcd's wire messages to the types of include/efdl/etcd.h, shared by the
// unary client and the watch engine.
#pragma once

#include "efdl/etcd.h"
#include "kv.pb.h"

namespace efdl::etcd {

inline KeyValue ToKeyValue(const mvccpb::KeyValue& kv) {
  KeyValue out;
  out.key = kv.key();
  out.value = kv.value();
  out.create_revision = kv.create_revision();
  out.mod_revision = kv.mod_revision();
  out.version = kv.version();
  out.lease = kv.lease();
  return out;
}

}  // namespace efdl::etcd
