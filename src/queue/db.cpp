#include "db.h"

#include "shoal/core/error.h"

namespace shoal::queue {

namespace {

struct Statement {
  sqlite3_stmt* stmt = nullptr;
  ~Statement() { sqlite3_finalize(stmt); }
};

}  // namespace

Database::Database(const std::string& path) : path_(path) {
  if (sqlite3_open(path.c_str(), &db_) != SQLITE_OK) {
    std::string why = db_ != nullptr ? sqlite3_errmsg(db_) : "out of memory";
    sqlite3_close(db_);
    db_ = nullptr;
    throw UsageError("cannot open the queue's database " + path + ": " + why);
  }
  sqlite3_busy_timeout(db_, 5000);
  exec("PRAGMA journal_mode=WAL");
  exec("PRAGMA synchronous=NORMAL");
}

Database::~Database() {
  sqlite3_close(db_);
}

std::vector<Row> Database::query(const std::string& sql, const std::vector<Value>& args) {
  Statement statement;
  if (sqlite3_prepare_v2(db_, sql.c_str(), -1, &statement.stmt, nullptr) != SQLITE_OK) {
    throw UsageError("queue database " + path_ + ": " + sqlite3_errmsg(db_) + " in: " + sql);
  }
  for (size_t i = 0; i < args.size(); ++i) {
    const int index = static_cast<int>(i) + 1;
    const Value& value = args[i];
    if (value.kind == Value::kInt) {
      sqlite3_bind_int64(statement.stmt, index, value.integer);
    } else if (value.kind == Value::kText) {
      sqlite3_bind_text(statement.stmt, index, value.text.data(),
                        static_cast<int>(value.text.size()), SQLITE_TRANSIENT);
    } else {
      sqlite3_bind_null(statement.stmt, index);
    }
  }
  std::vector<Row> rows;
  for (;;) {
    const int step = sqlite3_step(statement.stmt);
    if (step == SQLITE_DONE) break;
    if (step != SQLITE_ROW) {
      throw UsageError("queue database " + path_ + ": " + sqlite3_errmsg(db_) + " in: " + sql);
    }
    Row row;
    const int columns = sqlite3_column_count(statement.stmt);
    for (int c = 0; c < columns; ++c) {
      switch (sqlite3_column_type(statement.stmt, c)) {
        case SQLITE_INTEGER:
          row.emplace_back(static_cast<int64_t>(sqlite3_column_int64(statement.stmt, c)));
          break;
        case SQLITE_NULL:
          row.emplace_back();
          break;
        default: {
          const auto* text = reinterpret_cast<const char*>(sqlite3_column_text(statement.stmt, c));
          row.emplace_back(std::string(text != nullptr ? text : ""));
        }
      }
    }
    rows.push_back(std::move(row));
  }
  return rows;
}

void Database::exec(const std::string& sql, const std::vector<Value>& args) {
  query(sql, args);
}

int64_t Database::last_insert_id() const {
  return sqlite3_last_insert_rowid(db_);
}

void Database::transaction(const std::function<void()>& body) {
  exec("BEGIN IMMEDIATE");
  try {
    body();
  } catch (...) {
    sqlite3_exec(db_, "ROLLBACK", nullptr, nullptr, nullptr);
    throw;
  }
  exec("COMMIT");
}

}  // namespace shoal::queue
