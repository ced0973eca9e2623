// Status and Result<T>: the error values of EFDL's C++ core.
//
// Failures inside the core are returned, never thrown; exceptions appear only at the Python
// boundary. A Status message is one line a user can act on: what went wrong and what to do.
#pragma once

#include <cassert>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace efdl {

class [[nodiscard]] Status {
 public:
  // A handful of generic codes, like leveldb's; subsystems say the rest in the message.
  enum class Code {
    kOk = 0,
    kInvalidArgument,    // the caller's input is wrong; retrying will not help
    kNotFound,           // the thing asked for does not exist
    kAlreadyExists,      // a create-only operation found the thing there
    kFailedPrecondition, // a compare/txn failed, or the system is in the wrong state
    kUnavailable,        // a peer or service cannot be reached; retrying may help
    kDeadlineExceeded,   // the call ran out of time
    kCancelled,          // stopped on request
    kIOError,            // local storage failed
    kCorruption,         // data failed a checksum or format check
    kInternal,           // a bug or an unexpected answer
  };

  Status() = default;  // OK

  static Status OK() { return Status(); }
  static Status InvalidArgument(std::string msg) { return {Code::kInvalidArgument, std::move(msg)}; }
  static Status NotFound(std::string msg) { return {Code::kNotFound, std::move(msg)}; }
  static Status AlreadyExists(std::string msg) { return {Code::kAlreadyExists, std::move(msg)}; }
  static Status FailedPrecondition(std::string msg) {
    return {Code::kFailedPrecondition, std::move(msg)};
  }
  static Status Unavailable(std::string msg) { return {Code::kUnavailable, std::move(msg)}; }
  static Status DeadlineExceeded(std::string msg) {
    return {Code::kDeadlineExceeded, std::move(msg)};
  }
  static Status Cancelled(std::string msg) { return {Code::kCancelled, std::move(msg)}; }
  static Status IOError(std::string msg) { return {Code::kIOError, std::move(msg)}; }
  static Status Corruption(std::string msg) { return {Code::kCorruption, std::move(msg)}; }
  static Status Internal(std::string msg) { return {Code::kInternal, std::move(msg)}; }

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }

  bool IsNotFound() const { return code_ == Code::kNotFound; }
  bool IsUnavailable() const { return code_ == Code::kUnavailable; }
  bool IsDeadlineExceeded() const { return code_ == Code::kDeadlineExceeded; }
  bool IsFailedPrecondition() const { return code_ == Code::kFailedPrecondition; }
  bool IsCancelled() const { return code_ == Code::kCancelled; }

  // "InvalidArgument: <message>", or "OK".
  std::string ToString() const;
  // The same code with "<context>: " put before the message.
  Status WithContext(std::string_view context) const;

  static std::string_view CodeName(Code code);

 private:
  Status(Code code, std::string msg) : code_(code), message_(std::move(msg)) {}
  Code code_ = Code::kOk;
  std::string message_;
};

// A value or the Status that explains why there is none.
template <class T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}                     // NOLINT(implicit)
  Result(Status status) : v_(std::move(status)) {               // NOLINT(implicit)
    assert(!std::get<Status>(v_).ok() && "Result built from an OK status has no value");
  }

  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T value_or(T fallback) const { return ok() ? value() : std::move(fallback); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace efdl

#define EFDL_CONCAT_INNER_(a, b) a##b
#define EFDL_CONCAT_(a, b) EFDL_CONCAT_INNER_(a, b)

#define EFDL_RETURN_IF_ERROR(expr)                    \
  do {                                                \
    ::efdl::Status efdl_status_ = (expr);             \
    if (!efdl_status_.ok()) return efdl_status_;      \
  } while (0)

#define EFDL_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                \
  if (!tmp.ok()) return tmp.status();               \
  lhs = std::move(tmp).value()

// EFDL_ASSIGN_OR_RETURN(auto x, Foo()); returns Foo()'s Status from the enclosing function on error.
#define EFDL_ASSIGN_OR_RETURN(lhs, expr) \
  EFDL_ASSIGN_OR_RETURN_IMPL_(EFDL_CONCAT_(efdl_result_, __LINE__), lhs, expr)
