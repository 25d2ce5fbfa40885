// SQLite behind one small class: the queue's durable state (docs/queue.md, "State").
#pragma once

#include <sqlite3.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace shoal::queue {

// A value bound to a statement's `?` or read from a row.
struct Value {
  enum Kind { kNull, kInt, kText } kind = kNull;
  int64_t integer = 0;
  std::string text;
  Value() = default;
  Value(int64_t v) : kind(kInt), integer(v) {}
  Value(int v) : kind(kInt), integer(v) {}
  Value(std::string v) : kind(kText), text(std::move(v)) {}
  Value(const char* v) : kind(kText), text(v) {}
};
using Row = std::vector<Value>;

// One connection, used under the caller's lock. Errors raise UsageError naming the file and the
// statement (a database that cannot be opened or written is the operator's to fix).
class Database {
 public:
  // Opens (creating) `path` in WAL mode, where a crash loses no committed transaction.
  explicit Database(const std::string& path);
  ~Database();
  Database(const Database&) = delete;
  Database& operator=(const Database&) = delete;

  void exec(const std::string& sql, const std::vector<Value>& args = {});
  std::vector<Row> query(const std::string& sql, const std::vector<Value>& args = {});
  int64_t last_insert_id() const;

  // Runs `body` in one transaction: all of its writes land, or none (an exception rolls back).
  void transaction(const std::function<void()>& body);

 private:
  sqlite3* db_ = nullptr;
  std::string path_;
};

}  // namespace shoal::queue
