// What bench/queue_sim.cpp and bench/queue_real.cpp share: the three contenders they run over one
// trace, and the table that prints a metric per row with the ratios elastic / fixed and
// elastic / ckpt-restart.
#pragma once

#include <cstdio>
#include <string>
#include <vector>

namespace shoal::bench {

enum class Contender { kElastic, kFixed, kCheckpointRestart };

inline const char* name_of(Contender contender) {
  switch (contender) {
    case Contender::kElastic:
      return "elastic";
    case Contender::kFixed:
      return "fixed";
    case Contender::kCheckpointRestart:
      return "ckpt-restart";
  }
  return "?";
}

inline std::string format(double value, int decimals) {
  char text[64];
  std::snprintf(text, sizeof(text), "%.*f", decimals, value);
  return text;
}

// One metric: its values for elastic, fixed and ckpt-restart, in that order.
struct ContenderRow {
  std::string metric;
  int decimals;
  double values[3];
};

inline void print_contender_table(const std::vector<ContenderRow>& rows) {
  const auto ratio = [](double a, double b) { return b == 0 ? std::string() : format(a / b, 2); };
  std::printf(
      "| metric | elastic | fixed | ckpt-restart | elastic / fixed | elastic / ckpt-restart |\n"
      "|---|---:|---:|---:|---:|---:|\n");
  for (const auto& row : rows) {
    const double* v = row.values;
    std::printf("| %s | %s | %s | %s | %s | %s |\n", row.metric.c_str(),
                format(v[0], row.decimals).c_str(), format(v[1], row.decimals).c_str(),
                format(v[2], row.decimals).c_str(), ratio(v[0], v[1]).c_str(),
                ratio(v[0], v[2]).c_str());
  }
}

}  // namespace shoal::bench
