#include "titan/common/folder_lock.h"

#include "titan/common/error.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace titan {

FolderLock::FolderLock(const std::string& folder, const std::string& what) {
  std::error_code ec;
  std::filesystem::create_directories(folder, ec);
  TITAN_USER_CHECK(!ec, what, " ", folder, " cannot be created: ", ec.message(), "; choose another folder");
  path_ = (std::filesystem::path(folder) / ".titan.lock").string();
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  TITAN_USER_CHECK(fd_ >= 0, what, " ", folder, ": cannot open its lock file ", path_, ": ", std::strerror(errno),
                   "; the folder must be writable");
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    std::ifstream in(path_);
    std::stringstream holder;
    holder << in.rdbuf();
    std::string who = holder.str();
    while (!who.empty() && (who.back() == '\n' || who.back() == ' ')) who.pop_back();
    ::close(fd_);
    fd_ = -1;
    TITAN_USER_CHECK(err != EWOULDBLOCK, what, " ", folder, " is in use by another run (",
                     who.empty() ? std::string("its holder wrote nothing yet") : who,
                     "): two runs in one folder would overwrite each other's checkpoints and metrics. Choose another ",
                     what, ", or stop that run first");
    throw UserError(what + " " + folder + ": cannot lock " + path_ + ": " + std::strerror(err));
  }
  char host[256] = {0};
  ::gethostname(host, sizeof host - 1);
  const std::string me = "host " + std::string(host) + ", process " + std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd_, 0) == 0) {
    const ssize_t written = ::pwrite(fd_, me.data(), me.size(), 0);
    (void)written;  // the lock holds without the text; only the message of a refused run lacks it
  }
}

FolderLock::~FolderLock() {
  if (fd_ >= 0) ::close(fd_);  // closing releases the lock
}

}  // namespace titan
