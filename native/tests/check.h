// The C++ tests' own harness: TEST registers a function, CHECK* fail it with
// the file, line and values, main (check.cc) runs every test of the
// executable, or those named on its command line, and exits non-zero if one
// failed. Self-written so that CI needs nothing beyond a compiler and CMake.
//
// A failed CHECK throws (the test stops there; the next one runs); so does
// anything the code under test throws that the test did not expect.
#pragma once

#include <cmath>
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace distore_test {

struct Failure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Test {
  const char* name;
  void (*run)();
};
std::vector<Test>& registry();
struct Register {
  Register(const char* name, void (*run)()) { registry().push_back({name, run}); }
};

[[noreturn]] void fail(const char* file, int line, const std::string& what);

template <typename T, typename = void>
struct is_range : std::false_type {};
template <typename T>
struct is_range<T, std::void_t<decltype(std::declval<const T&>().begin())>> : std::true_type {};

// A value as a failure message shows it (bytes as numbers, containers whole).
template <typename T>
std::string show(const T& v) {
  std::ostringstream out;
  if constexpr (is_range<T>::value && !std::is_same_v<T, std::string>) {
    out << "[";
    bool first = true;
    for (const auto& x : v) {
      out << (first ? "" : ", ") << show(x);
      first = false;
    }
    out << "]";
  } else if constexpr (std::is_integral_v<T> && std::is_signed_v<T>) {
    out << static_cast<long long>(v);
  } else if constexpr (std::is_integral_v<T>) {
    out << static_cast<unsigned long long>(v);
  } else {
    out.precision(17);
    out << v;
  }
  return out.str();
}

// Upper 0.1% point of chi-square with `df` degrees of freedom
// (Wilson-Hilferty), as the Python tests use.
inline double chi2_critical(double df, double z = 3.09) {
  const double a = 2.0 / (9.0 * df);
  return df * std::pow(1.0 - a + z * std::sqrt(a), 3);
}
// Pearson's statistic of `counts` against probabilities `p` (same length).
inline double chi2(const std::vector<double>& counts, const std::vector<double>& p) {
  double total = 0.0, stat = 0.0;
  for (double c : counts) total += c;
  for (size_t i = 0; i < counts.size(); ++i) {
    const double expected = p[i] * total;
    stat += (counts[i] - expected) * (counts[i] - expected) / expected;
  }
  return stat;
}

}  // namespace distore_test

#define TEST(name)                                                        \
  static void name();                                                     \
  static const ::distore_test::Register name##_registered(#name, &name); \
  static void name()

#define CHECK(cond)                                                         \
  do {                                                                      \
    if (!(cond)) ::distore_test::fail(__FILE__, __LINE__, "CHECK(" #cond ")"); \
  } while (0)

#define CHECK_EQ(a, b)                                                                  \
  do {                                                                                  \
    const auto va_ = (a);  /* copies: (a) may refer to a temporary */                  \
    const auto vb_ = (b);                                                               \
    if (!(va_ == vb_)) {                                                                \
      ::distore_test::fail(__FILE__, __LINE__,                                          \
                           "CHECK_EQ(" #a ", " #b "): " + ::distore_test::show(va_) +   \
                               " != " + ::distore_test::show(vb_));                     \
    }                                                                                   \
  } while (0)

// |a - b| <= rel * max(|a|, |b|)
#define CHECK_NEAR(a, b, rel)                                                            \
  do {                                                                                   \
    const double va_ = (a), vb_ = (b);                                                   \
    if (!(std::fabs(va_ - vb_) <= (rel) * std::fmax(std::fabs(va_), std::fabs(vb_)))) { \
      ::distore_test::fail(__FILE__, __LINE__,                                           \
                           "CHECK_NEAR(" #a ", " #b "): " + ::distore_test::show(va_) +  \
                               " vs " + ::distore_test::show(vb_));                      \
    }                                                                                    \
  } while (0)

// `stmt` throws `Type` whose what() contains `text`.
#define CHECK_THROWS(stmt, Type, text)                                                  \
  do {                                                                                  \
    bool thrown_ = false;                                                               \
    try {                                                                               \
      stmt;                                                                             \
    } catch (const Type& e_) {                                                          \
      thrown_ = true;                                                                   \
      if (std::string(e_.what()).find(text) == std::string::npos) {                     \
        ::distore_test::fail(__FILE__, __LINE__, "CHECK_THROWS(" #stmt "): message \"" + \
                                                     std::string(e_.what()) +           \
                                                     "\" lacks \"" + (text) + "\"");    \
      }                                                                                 \
    }                                                                                   \
    if (!thrown_) {                                                                     \
      ::distore_test::fail(__FILE__, __LINE__, "CHECK_THROWS(" #stmt "): nothing thrown"); \
    }                                                                                   \
  } while (0)
