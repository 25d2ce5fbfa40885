// shoal's two kinds of failure (see docs/errors.md):
//  - shoal::Error subclasses, for what a caller can act on: CommError (a lost peer or an expired
//    deadline; elastic recovery catches it) and UsageError (bad arguments, environment or files).
//  - SHOAL_CHECK(cond) << ..., for broken invariants; it throws shoal::InternalError, which is
//    a bug in shoal, not something to recover from.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace shoal {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A peer was lost or a wait passed its deadline. The group it came from is no longer usable.
class CommError : public Error {
 public:
  using Error::Error;
};

// The caller passed something wrong: an argument, the environment, a file.
class UsageError : public Error {
 public:
  using Error::Error;
};

class InternalError : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

namespace detail {

// Collects the message of a failed check; SHOAL_CHECK throws it once the message is complete.
class CheckMessage {
 public:
  CheckMessage(const char* file, int line, const char* condition) {
    stream_ << "shoal internal check failed: " << condition << " at " << file << ":" << line;
  }
  template <typename T>
  CheckMessage& operator<<(const T& value) {
    if (!has_detail_) {
      stream_ << ": ";
      has_detail_ = true;
    }
    stream_ << value;
    return *this;
  }
  std::string str() const { return stream_.str(); }

 private:
  std::ostringstream stream_;
  bool has_detail_ = false;
};

struct CheckThrower {
  [[noreturn]] void operator&(const CheckMessage& message) const {
    throw InternalError(message.str());
  }
};

}  // namespace detail
}  // namespace shoal

#define SHOAL_CHECK(cond) \
  if (cond) {             \
  } else                  \
    ::shoal::detail::CheckThrower() & ::shoal::detail::CheckMessage(__FILE__, __LINE__, #cond)

#define SHOAL_CHECK_EQ(a, b) SHOAL_CHECK((a) == (b)) << #a " = " << (a) << ", " #b " = " << (b) << " "
#define SHOAL_CHECK_LT(a, b) SHOAL_CHECK((a) < (b)) << #a " = " << (a) << ", " #b " = " << (b) << " "
#define SHOAL_CHECK_LE(a, b) SHOAL_CHECK((a) <= (b)) << #a " = " << (a) << ", " #b " = " << (b) << " "
