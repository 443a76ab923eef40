// Shared by the fuzz targets (libFuzzer): a scratch folder for the files a parser reads, inputs that
// hold several files, and the rule for which exceptions are a clean rejection of bad input.
//
// Every target's contract: on any input the parser either succeeds or throws titan::UserError with a
// message. Any other exception escaping a target, a crash, a sanitizer report, a hang or an allocation
// beyond libFuzzer's limits is a bug (scripts/fuzz.sh runs the targets, docs/fuzzing.md explains them).
#pragma once

#include "titan/common/error.h"

#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <chrono>
#include <thread>
#include <typeinfo>
#include <vector>

namespace titan::fuzz {

namespace fs = std::filesystem;

// This process's scratch folder (under $TMPDIR or /tmp), emptied by fresh_dir() before each input and
// removed at exit. Parallel fuzzing processes get folders of their own.
inline const std::string& scratch_root() {
  static const std::string root = [] {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp && *tmp ? tmp : "/tmp") + "/titan-fuzz-XXXXXX";
    if (!::mkdtemp(pattern.data())) {
      std::perror("titan fuzz: mkdtemp");
      std::abort();
    }
    static std::string keep = pattern;
    std::atexit([] {
      std::error_code ec;
      fs::remove_all(keep, ec);
    });
    return pattern;
  }();
  return root;
}

// An empty folder `name` in the scratch folder, for one input.
inline std::string fresh_dir(const std::string& name = "in") {
  const fs::path dir = fs::path(scratch_root()) / name;
  std::error_code ec;
  fs::remove_all(dir, ec);
  fs::create_directories(dir);
  return dir.string();
}

inline void write_file(const std::string& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) {
    std::fprintf(stderr, "titan fuzz: cannot write %s: %s\n", path.c_str(), std::strerror(errno));
    std::abort();
  }
}

// Inputs that stand for several files hold them one after another, separated by this line. The seed
// corpus files are written that way (scripts in docs/fuzzing.md), and mutations keep the separators.
inline constexpr std::string_view kFileSeparator = "\n--titan-fuzz-file--\n";

inline std::vector<std::string_view> split_files(const uint8_t* data, size_t size, size_t max_parts) {
  std::string_view rest(reinterpret_cast<const char*>(data), size);
  std::vector<std::string_view> parts;
  while (parts.size() + 1 < max_parts) {
    const size_t at = rest.find(kFileSeparator);
    if (at == std::string_view::npos) break;
    parts.push_back(rest.substr(0, at));
    rest.remove_prefix(at + kFileSeparator.size());
  }
  parts.push_back(rest);
  return parts;
}

// Open file descriptors of this process.
inline int open_fds() {
  int n = 0;
  std::error_code ec;
  for (auto it = fs::directory_iterator("/proc/self/fd", ec); !ec && it != fs::directory_iterator(); it.increment(ec)) ++n;
  return n;
}

// One part of an input read inside run_one's body: a UserError ends that part only (with the message
// checked as run_one does), so the next part is still read; anything else escapes to run_one. For
// readers that hold files open across parts, which run_one alone would count as left open.
template <class Body>
void part(const char* target, Body&& body) {
  try {
    body();
  } catch (const UserError& e) {
    if (std::getenv("TITAN_FUZZ_VERBOSE")) std::fprintf(stderr, "[%s] UserError: %s\n", target, e.what());
    if (std::string_view(e.what()).empty()) {
      std::fprintf(stderr, "[%s] a UserError without a message\n", target);
      std::abort();
    }
  }
}

// Runs `body` on one input: a titan::UserError is the clean rejection of bad input; anything else
// that escapes is reported and aborts, so that libFuzzer keeps the input as a crash. So does a file
// descriptor left open (a parser that throws must close what it opened: a long run would run out).
template <class Body>
int run_one(const char* target, Body&& body) {
  const int fds_before = open_fds();
  try {
    part(target, body);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[%s] unexpected exception %s: %s\n", target, typeid(e).name(), e.what());
    std::abort();
  } catch (...) {
    std::fprintf(stderr, "[%s] unexpected exception of a non-standard type\n", target);
    std::abort();
  }
  // A library's background task may hold a descriptor a moment longer (Arrow's IO threads): a leak is
  // one that is still open after that.
  for (int wait = 0; wait < 10 && open_fds() > fds_before; ++wait) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  if (const int fds = open_fds(); fds > fds_before) {
    std::fprintf(stderr, "[%s] %d file descriptor(s) left open; open now:\n", target, fds - fds_before);
    std::error_code ec;
    for (auto it = fs::directory_iterator("/proc/self/fd", ec); !ec && it != fs::directory_iterator(); it.increment(ec))
      std::fprintf(stderr, "  %s -> %s\n", it->path().filename().c_str(), fs::read_symlink(it->path(), ec).c_str());
    std::abort();
  }
  return 0;
}

// A failed check of a property the target verifies itself (e.g. the config dump parses back).
#define TITAN_FUZZ_CHECK(cond, ...)                                                        \
  do {                                                                                     \
    if (!(cond)) {                                                                         \
      std::fprintf(stderr, "%s:%d: fuzz check failed: %s\n", __FILE__, __LINE__, #cond);  \
      __VA_OPT__(std::fprintf(stderr, "%s\n", ::titan::detail::concat(__VA_ARGS__).c_str());) \
      std::abort();                                                                        \
    }                                                                                      \
  } while (0)

}  // namespace titan::fuzz
