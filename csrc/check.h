// Error checks whose messages are built without iostreams.
//
// TORCH_CHECK formats its arguments through std::ostringstream. On a host whose compiler pairs its headers with
// another libstdc++ than the one torch loads (the GPU machine's /opt/gcc wrapper), streaming a number crashed the
// process (SIGSEGV) instead of raising; streaming strings did not. QL_CHECK builds the message as a std::string
// first (numbers through std::to_string, shapes and dtypes by hand), so TORCH_CHECK only ever streams a string.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

namespace ql {

inline void put(std::string& s, const char* v) { s += v; }
inline void put(std::string& s, const std::string& v) { s += v; }
inline void put(std::string& s, char v) { s += v; }
inline void put(std::string& s, c10::ScalarType v) { s += c10::toString(v); }
inline void put(std::string& s, const c10::Device& d) {
  s += c10::DeviceTypeName(d.type(), /*lower_case=*/true);
  if (d.has_index()) s += ":" + std::to_string(d.index());
}
inline void put(std::string& s, c10::IntArrayRef v) {
  s += '[';
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  s += ']';
}
inline void put(std::string& s, const std::vector<int64_t>& v) { put(s, c10::IntArrayRef(v)); }
template <typename T, std::enable_if_t<std::is_arithmetic_v<T> && !std::is_same_v<T, char>, int> = 0>
inline void put(std::string& s, T v) { s += std::to_string(v); }

template <typename... Args>
std::string msg(const Args&... args) {
  std::string s;
  (put(s, args), ...);
  return s;
}

}  // namespace ql

// The arguments are evaluated only when the check fails, as TORCH_CHECK's are.
#define QL_CHECK(cond, ...) TORCH_CHECK(cond, ::ql::msg(__VA_ARGS__))
#define QL_CHECK_VALUE(cond, ...) TORCH_CHECK_VALUE(cond, ::ql::msg(__VA_ARGS__))
#define QL_CHECK_TYPE(cond, ...) TORCH_CHECK_TYPE(cond, ::ql::msg(__VA_ARGS__))
