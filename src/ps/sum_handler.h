// A minimal real Handler: it stores each table as float32 values, adds every pushed gradient to
// them and answers pulls with the sums. No optimizer, no clocks, no consistency: it exists so that
// the transport and the `shoal ps-server` process can be tested and measured before the server's
// core is joined in, and it is not the parameter server (docs/ps.md, "Processes").
#pragma once

#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "handler.h"

namespace shoal::ps::detail {

class SumHandler : public Handler {
 public:
  // Dense tables are cut into chunks of `chunk_elements` values (the last one shorter); chunk c
  // holds elements [c * chunk_elements, (c + 1) * chunk_elements).
  explicit SumHandler(int64_t chunk_elements = 1024);

  // The first registration creates the tables (zeros); later ones must name the same tables.
  void register_tables(const RegisterRequest& request, const Deadline& deadline) override;
  PullReply pull(const PullRequest& request, const Deadline& deadline) override;
  PushReply push(const PushRequest& request, const Deadline& deadline) override;

 private:
  struct Table {
    TableSpec spec;
    std::vector<float> dense;                              // dense tables
    std::unordered_map<int64_t, std::vector<float>> rows;  // sparse tables
    int64_t dim = 0;                                       // sparse tables
  };
  Table& table(int32_t index, bool sparse);
  // [begin, end) of a dense table's chunk; NotFoundError when the table has no such chunk.
  std::pair<int64_t, int64_t> chunk_range(const Table& table, int64_t chunk) const;

  const int64_t chunk_elements_;
  std::mutex mutex_;
  std::vector<Table> tables_;
  int64_t pushes_ = 0;
};

}  // namespace shoal::ps::detail
