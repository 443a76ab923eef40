#include "titan/common/folder_lock.h"

#include "titan/common/error.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>

namespace titan {
namespace {

// The locks this process holds, by lock file: (descriptor, holders). Trainers built one after another
// or side by side in one process (tests, a library user) share the process's lock.
std::mutex held_mutex;
std::map<std::string, std::pair<int, int>>& held() {
  static std::map<std::string, std::pair<int, int>> locks;
  return locks;
}

}  // namespace

FolderLock::FolderLock(const std::string& folder, const std::string& what) {
  std::error_code ec;
  std::filesystem::create_directories(folder, ec);
  TITAN_USER_CHECK(!ec, what, " ", folder, " cannot be created: ", ec.message(), "; choose another folder");
  path_ = std::filesystem::weakly_canonical(std::filesystem::path(folder) / ".titan.lock").string();
  std::lock_guard<std::mutex> guard(held_mutex);
  if (auto it = held().find(path_); it != held().end()) {
    ++it->second.second;
    return;
  }
  const int fd = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  TITAN_USER_CHECK(fd >= 0, what, " ", folder, ": cannot open its lock file ", path_, ": ", std::strerror(errno),
                   "; the folder must be writable");
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    ::close(fd);
    std::ifstream in(path_);
    std::stringstream holder;
    holder << in.rdbuf();
    std::string who = holder.str();
    while (!who.empty() && (who.back() == '\n' || who.back() == ' ')) who.pop_back();
    TITAN_USER_CHECK(err != EWOULDBLOCK, what, " ", folder, " is in use by another run (",
                     who.empty() ? std::string("its holder wrote nothing yet") : who,
                     "): two runs in one folder would overwrite each other's checkpoints and metrics. Choose another ",
                     what, ", or stop that run first");
    throw UserError(what + " " + folder + ": cannot lock " + path_ + ": " + std::strerror(err));
  }
  char host[256] = {0};
  ::gethostname(host, sizeof host - 1);
  const std::string me = "host " + std::string(host) + ", process " + std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd, 0) == 0) {
    const ssize_t written = ::pwrite(fd, me.data(), me.size(), 0);
    (void)written;  // the lock holds without the text; only the message of a refused run lacks it
  }
  held()[path_] = {fd, 1};
}

FolderLock::~FolderLock() {
  std::lock_guard<std::mutex> guard(held_mutex);
  auto it = held().find(path_);
  if (it == held().end() || --it->second.second > 0) return;
  ::close(it->second.first);  // closing releases the lock
  held().erase(it);
}

}  // namespace titan
