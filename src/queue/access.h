// Who may use the queue, and what a job runs as (docs/queue.md, "Security").
//
// Three kinds of credential, each a bearer token of 32 random hex digits:
// - the admin's (STATE_DIR/token, made at the first start): everything, including users;
// - a user's (made by `shoal queue user add NAME`, shown once, kept here only as its SHA-256):
//   submitting, listing and cancelling jobs; the user's jobs are theirs and run as the Unix user
//   the admin gave them;
// - the agents' (STATE_DIR/agent-token): heartbeats only, on the agents' own port.
// A job runs as a Unix user: the submitter's `run_as`, or for the admin's jobs the scheduler's
// --run-as (default: the user the scheduler runs as). As root only where the admin allowed it
// (`serve --allow-root-jobs` for the admin's jobs, `user add --allow-root` for a user's), and
// only programs under --allow-programs when that is given.
#pragma once

#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace shoal::queue {

struct AccessOptions {
  std::string state_dir;
  std::string token_file;                    // the admin's token; default STATE_DIR/token
  std::string run_as;                        // the admin's jobs; default: the scheduler's user
  bool allow_root_jobs = false;              // the admin's jobs may run as root
  std::vector<std::string> allowed_programs;  // directories; empty: any program
};

// Who a request comes from.
struct Principal {
  enum Kind { kAdmin, kUser, kAgent };
  Kind kind = kUser;
  std::string name;  // "admin", a user's name, or "agent"
  std::string run_as;
  bool may_run_as_root = false;
};

class Access {
 public:
  // Reads or makes the admin's and the agents' tokens and reads the users. UsageError when a
  // token file is unsafe (readable by others) or --run-as names no user of this host.
  explicit Access(AccessOptions options);

  const std::string& admin_token() const { return admin_token_; }
  const std::string& agent_token() const { return agent_token_; }
  const std::string& agent_token_file() const { return agent_token_file_; }

  // Whose token this is; nullopt for none of them (compared in constant time).
  std::optional<Principal> identify(const std::string& token) const;

  // The Unix user a job of `who` with program `program` runs as; UsageError with one line when
  // it may not run (root not allowed, a program outside --allow-programs).
  std::string authorize(const Principal& who, const std::string& program) const;

  // Users (the admin's only). add_user returns the new user's token, which is not kept.
  std::string add_user(const std::string& name, const std::string& run_as, bool allow_root);
  void remove_user(const std::string& name);
  nlohmann::json users() const;

 private:
  struct User {
    std::string token_sha256;
    std::string run_as;
    bool allow_root = false;
  };
  void save() const;

  AccessOptions options_;
  std::string admin_token_;
  std::string agent_token_;
  std::string agent_token_file_;
  std::string users_file_;
  mutable std::mutex mutex_;
  std::map<std::string, User> users_;
};

// Note [Tokens out of URLs]
// The dashboard is a page in a browser, whose address bar, history and `ps` line would keep a
// token put in its URL. So the page is opened through a one-time login code instead
// (`shoal queue dashboard` asks for one with the token in a header and prints
// /login?code=CODE, good for 60 s and one use), or by pasting the token into the login form
// (POST /login); either sets a session cookie (HttpOnly, SameSite=Strict, Secure over TLS) that
// the page's requests carry. Sessions live in the scheduler's memory for 12 hours.
class Sessions {
 public:
  // A one-time code that opens a session of `who`.
  std::string code_for(const Principal& who);
  // The session a code opens (the code is then spent); nullopt for an unknown, spent or expired
  // code.
  std::optional<std::string> redeem(const std::string& code);
  std::string open(const Principal& who);
  std::optional<Principal> find(const std::string& session) const;

 private:
  struct Entry {
    Principal who;
    int64_t expires_ms = 0;
  };
  static void forget_expired(std::map<std::string, Entry>& entries, int64_t now);

  mutable std::mutex mutex_;
  std::map<std::string, Entry> codes_;
  std::map<std::string, Entry> sessions_;
};

// The Unix user `name` (a name or a numeric uid): its uid, gid and supplementary groups.
// UsageError naming it when this host has no such user.
struct UnixUser {
  std::string name;
  unsigned uid = 0;
  unsigned gid = 0;
  std::vector<unsigned> groups;
};
UnixUser unix_user(const std::string& name);
// The user this process runs as.
std::string current_user();

}  // namespace shoal::queue
