// The job's token: a shared secret that a process must hold to take part in an elastic job's
// membership. `shoal run` creates it and hands it to workers in a file of mode 600.
#pragma once

#include <string>

namespace shoal {

// `digits` random hex digits, from the system's random device.
std::string random_hex(int digits);

// 32 random hex digits.
std::string make_token();

// Creates `path` with mode 600 holding the token. UsageError when it exists or can't be made.
void write_token_file(const std::string& path, const std::string& token);

// The token in `path`. UsageError, naming `described_as` and the path, when it can't be read,
// is empty, or can be read by other users (its mode is not 600 or 400).
std::string read_token_file(const std::string& path, const std::string& described_as);

}  // namespace shoal
