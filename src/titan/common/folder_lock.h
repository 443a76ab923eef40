// One run per output folder: an exclusive lock (flock) on a lock file inside the folder, held for
// the lock's lifetime. The kernel releases it when the process ends, however it ends, so a crash
// never leaves a stale lock (the file stays, unlocked, and the next run takes it). Within one
// process, locks of one folder share the process's lock (released with the last of them): it keeps
// other processes out.
#pragma once

#include <string>

namespace titan {

class FolderLock {
 public:
  // Creates `folder` if needed and locks `folder`/.titan.lock, writing this host and process into
  // it. Throws UserError when another process holds it, naming the folder, `what` it is (e.g.
  // "job.dump_folder") and the host and process written by the holder.
  FolderLock(const std::string& folder, const std::string& what);
  ~FolderLock();
  FolderLock(const FolderLock&) = delete;
  FolderLock& operator=(const FolderLock&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;  // the lock file
};

}  // namespace titan
