// main() of every C++ test executable (check.h).
#include "check.h"

#include <chrono>
#include <cstdio>
#include <cstring>

namespace distore_test {

std::vector<Test>& registry() {
  static std::vector<Test> tests;
  return tests;
}

void fail(const char* file, int line, const std::string& what) {
  const char* base = std::strrchr(file, '/');
  throw Failure(std::string(base ? base + 1 : file) + ":" + std::to_string(line) + ": " + what);
}

}  // namespace distore_test

int main(int argc, char** argv) {
  using distore_test::registry;
  int failed = 0, ran = 0;
  for (const auto& t : registry()) {
    bool wanted = argc < 2;
    for (int i = 1; i < argc; ++i) wanted = wanted || std::strcmp(argv[i], t.name) == 0;
    if (!wanted) continue;
    ++ran;
    const auto start = std::chrono::steady_clock::now();
    std::string error;
    try {
      t.run();
    } catch (const distore_test::Failure& e) {
      error = e.what();
    } catch (const std::exception& e) {
      error = std::string("unexpected exception: ") + e.what();
    }
    const double ms = std::chrono::duration<double, std::milli>(
                          std::chrono::steady_clock::now() - start).count();
    if (error.empty()) {
      std::printf("ok      %s (%.0f ms)\n", t.name, ms);
    } else {
      ++failed;
      std::printf("FAILED  %s: %s\n", t.name, error.c_str());
    }
    std::fflush(stdout);
  }
  if (ran == 0) {
    std::printf("no test of this executable is named so\n");
    return 1;
  }
  std::printf("%d of %d tests failed\n", failed, ran);
  return failed == 0 ? 0 : 1;
}
