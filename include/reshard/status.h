// Status and Result<T>: how every reshard function reports failure.
//
// Errors are values, never exceptions across the API. A failed Status carries
// one line meant for the user: it names the problem and, where there is one,
// the fix ("... ; pass --rules FILE"). The code tells callers how to react and
// the CLI which exit status to use.
#pragma once

#include <optional>
#include <string>
#include <utility>

namespace reshard {

class Status {
 public:
  enum class Code {
    kOk = 0,
    kInvalidInput,  // the checkpoint or an argument is unusable (exit 2)
    kRuleError,     // a rule file is malformed or does not explain the checkpoint
    kUnsupported,   // valid input that reshard cannot handle (yet)
    kIoError,       // the operating system refused a read or a write
    kInternal,      // a bug in reshard
  };

  Status() = default;
  static Status Ok() { return Status(); }
  static Status InvalidInput(std::string msg) { return Status(Code::kInvalidInput, std::move(msg)); }
  static Status RuleError(std::string msg) { return Status(Code::kRuleError, std::move(msg)); }
  static Status Unsupported(std::string msg) { return Status(Code::kUnsupported, std::move(msg)); }
  static Status IoError(std::string msg) { return Status(Code::kIoError, std::move(msg)); }
  static Status Internal(std::string msg) { return Status(Code::kInternal, std::move(msg)); }

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }

  // Returns a copy whose message is prefixed with `context: `.
  Status WithContext(const std::string& context) const {
    if (ok()) return *this;
    return Status(code_, context + ": " + message_);
  }

 private:
  Status(Code code, std::string msg) : code_(code), message_(std::move(msg)) {}
  Code code_ = Code::kOk;
  std::string message_;
};

// A value or the Status explaining why there is none.
template <typename T>
class Result {
 public:
  Result(T value) : value_(std::move(value)) {}                  // NOLINT: implicit by design
  Result(Status status) : status_(std::move(status)) {}          // NOLINT: implicit by design

  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }
  // REQUIRES: ok()
  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }
  T& operator*() { return *value_; }
  const T& operator*() const { return *value_; }

 private:
  Status status_;
  std::optional<T> value_;
};

}  // namespace reshard

// Early-return helpers for functions that return Status or Result<T>.
#define RESHARD_RETURN_IF_ERROR(expr)        \
  do {                                       \
    ::reshard::Status _st = (expr);          \
    if (!_st.ok()) return _st;               \
  } while (0)

#define RESHARD_CONCAT_INNER(a, b) a##b
#define RESHARD_CONCAT(a, b) RESHARD_CONCAT_INNER(a, b)
#define RESHARD_ASSIGN_OR_RETURN(lhs, expr)                              \
  auto RESHARD_CONCAT(_res_, __LINE__) = (expr);                         \
  if (!RESHARD_CONCAT(_res_, __LINE__).ok())                             \
    return RESHARD_CONCAT(_res_, __LINE__).status();                     \
  lhs = std::move(RESHARD_CONCAT(_res_, __LINE__)).value()
