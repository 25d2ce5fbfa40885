// The examples' command lines, parsed with CLI11 as the shoal command's are: --help prints the
// options and exits 0; a bad or unknown flag prints one line on stderr and exits 2.
//
//   CLI::App app{"What the program does", "program"};
//   app.add_option("--steps", steps, "training steps");
//   if (const int code = examples::parse(app, argc, argv); code >= 0) return code;
#pragma once

#include <cstdlib>
#include <iostream>
#include <string>

#include <CLI/CLI.hpp>

namespace examples {

// A number above 0, or from 0 with allow_zero. (CLI11 2.1's PositiveNumber writes out DBL_MAX
// when it refuses a value.)
inline CLI::Validator positive(bool allow_zero = false) {
  return CLI::Validator(
      [allow_zero](std::string& value) -> std::string {
        char* end = nullptr;
        const double number = std::strtod(value.c_str(), &end);
        if (value.empty() || *end != '\0' || number < 0 || (number == 0 && !allow_zero)) {
          return std::string("expected a number ") + (allow_zero ? "from 0" : "above 0") +
                 ", got '" + value + "'";
        }
        return "";
      },
      allow_zero ? "NONNEGATIVE" : "POSITIVE");
}

// -1 when the program should go on; otherwise the exit code to return from main().
inline int parse(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
    return -1;
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    std::string message = e.what();
    for (char& c : message) {
      if (c == '\n') c = ' ';
    }
    std::cerr << app.get_name() << ": " << message << " (see --help)" << std::endl;
    return 2;
  }
}

}  // namespace examples
