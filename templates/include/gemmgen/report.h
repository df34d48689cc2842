// How the C ABI entry points fail: a status code returned, and a message written into the
// caller's buffer (printf-style, truncated to err_len).
#pragma once
#include <cstdarg>
#include <cstdio>

namespace gemmgen {

inline int report(char* err, int err_len, int status, const char* fmt, ...) {
  if (err != nullptr && err_len > 0) {
    va_list args;
    va_start(args, fmt);
    vsnprintf(err, static_cast<size_t>(err_len), fmt, args);
    va_end(args);
  }
  return status;
}

}  // namespace gemmgen
