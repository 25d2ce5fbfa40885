// Whole-file writes that are atomic under crashes, and whole-file reads. Private to
// src/checkpoint.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace shoal::checkpoint {

// The name a write of `path` goes to before its rename: path + ".tmp-" + this process's id.
std::string temporary_path(const std::string& path);

// Replaces the file at `path` with the concatenation of `parts`: writes temporary_path(path),
// fsyncs it, renames it over `path` and fsyncs the directory. So `path` holds either its old
// content or the new one, also after a crash or a power loss; a crash can leave the temporary
// file behind, never a half-written `path`. UsageError naming the path and the OS error, with
// the temporary file removed, when any step before the rename fails.
void write_file_atomically(const std::string& path, const std::vector<std::string_view>& parts);

// The whole content of the file at `path`. UsageError naming the path and the OS error.
std::string read_whole_file(const std::string& path);

}  // namespace shoal::checkpoint
