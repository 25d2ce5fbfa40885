// What bench/queue_sim.cpp and bench/queue_real.cpp share: the contenders they run over one trace,
// and the table that prints a metric per row with the ratios elastic / fixed and elastic /
// ckpt-restart, and goodput / elastic when the goodput policy ran.
#pragma once

#include <cstdio>
#include <string>
#include <vector>

namespace shoal::bench {

// kGoodput: elastic under PolicyOptions::Kind::kGoodput (src/queue/policy.h); the others under the
// priority policy.
enum class Contender { kElastic, kFixed, kCheckpointRestart, kGoodput };

inline const char* name_of(Contender contender) {
  switch (contender) {
    case Contender::kElastic:
      return "elastic";
    case Contender::kFixed:
      return "fixed";
    case Contender::kCheckpointRestart:
      return "ckpt-restart";
    case Contender::kGoodput:
      return "goodput";
  }
  return "?";
}

inline std::string format(double value, int decimals) {
  char text[64];
  std::snprintf(text, sizeof(text), "%.*f", decimals, value);
  return text;
}

// One metric: its values for elastic, fixed and ckpt-restart, and goodput if it ran, in that
// order.
struct ContenderRow {
  std::string metric;
  int decimals;
  std::vector<double> values;
};

inline void print_contender_table(const std::vector<ContenderRow>& rows) {
  const auto ratio = [](double a, double b) { return b == 0 ? std::string() : format(a / b, 2); };
  const bool goodput = !rows.empty() && rows.front().values.size() > 3;
  std::printf("| metric | elastic | fixed | ckpt-restart |%s elastic / fixed | elastic / ckpt-restart |%s\n"
              "|---|---:|---:|---:|%s---:|---:|%s\n",
              goodput ? " goodput |" : "", goodput ? " goodput / elastic |" : "", goodput ? "---:|" : "",
              goodput ? "---:|" : "");
  for (const auto& row : rows) {
    const auto& v = row.values;
    std::printf("| %s | %s | %s | %s |", row.metric.c_str(), format(v[0], row.decimals).c_str(),
                format(v[1], row.decimals).c_str(), format(v[2], row.decimals).c_str());
    if (goodput) std::printf(" %s |", format(v[3], row.decimals).c_str());
    std::printf(" %s | %s |", ratio(v[0], v[1]).c_str(), ratio(v[0], v[2]).c_str());
    if (goodput) std::printf(" %s |", ratio(v[3], v[0]).c_str());
    std::printf("\n");
  }
}

}  // namespace shoal::bench
