// The control socket's message types and protocol version (docs/control-protocol.md): the one
// owner for the agent (control_server.cc) and the worker (python/efdl/control.py), issue #31.
//
// Each type is declared once, in EFDL_CONTROL_MESSAGES below, as (C++ constant, Python name,
// value). Python gets the table from the module the build generates from this header
// (python/efdl/_names.py, class Msg: `Msg.HELLO`; generator src/python/gen_names.cc).
#pragma once

// X(cpp_constant, PythonName, "value")
#define EFDL_CONTROL_MESSAGES(X)                                                   \
  /* worker -> agent */                                                            \
  X(kHello, HELLO, "hello")                                                        \
  X(kCommitted, COMMITTED, "committed")                                            \
  X(kStopping, STOPPING, "stopping")                                               \
  X(kPersisted, PERSISTED, "persisted")                                            \
  X(kQuery, QUERY, "query")                                                        \
  X(kInProcess, IN_PROCESS, "in_process") /* also the agent's answer */            \
  X(kFailed, FAILED, "failed")                                                     \
  X(kPaused, PAUSED, "paused")                                                     \
  X(kFlush, FLUSH, "flush")                                                        \
  X(kReturned, RETURNED, "returned")                                               \
  X(kRaised, RAISED, "raised")                                                     \
  /* agent -> worker */                                                            \
  X(kWelcome, WELCOME, "welcome")                                                  \
  X(kStop, STOP, "stop")                                                           \
  X(kPause, PAUSE, "pause")                                                        \
  X(kRound, ROUND, "round")                                                        \
  X(kReply, REPLY, "reply")                                                        \
  X(kError, ERROR, "error")                                                        \
  /* the one thing a "query" asks ("what") */                                      \
  X(kQueryRestore, QUERY_RESTORE, "restore")

namespace efdl::agent::control {

// The version a "hello" and a "welcome" carry.
inline constexpr int kProtocolVersion = 1;

#define EFDL_CONTROL_MESSAGE_CONSTANT(constant, python_name, value) \
  inline constexpr const char* constant = value;
EFDL_CONTROL_MESSAGES(EFDL_CONTROL_MESSAGE_CONSTANT)
#undef EFDL_CONTROL_MESSAGE_CONSTANT

}  // namespace efdl::agent::control
