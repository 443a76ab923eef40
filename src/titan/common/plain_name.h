// File names read from files (a checkpoint index, a Hugging Face weight_map, a token-shard manifest)
// are joined to the folder that holds them: only a plain name in that folder is accepted, never an
// absolute path or one that climbs out with "..".
#pragma once

#include "titan/common/error.h"

#include <string>

namespace titan {

// Returns `name` when it is a plain file name (not empty, not "." or "..", no '/', '\\' or NUL);
// otherwise throws UserError: "<where> names the file '<name>', which is not a plain file name in
// its folder ...".
inline const std::string& plain_file_name(const std::string& name, const std::string& where) {
  const bool plain = !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
                     name.find('\\') == std::string::npos && name.find('\0') == std::string::npos;
  TITAN_USER_CHECK(plain, where, " names the file '", name,
                   "', which is not a plain file name in its folder (an absolute path or a '..' would reach outside "
                   "it): the file is corrupt or was not written by a tool of this format");
  return name;
}

}  // namespace titan
