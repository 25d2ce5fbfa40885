#include "access.h"

#include <grp.h>
#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <climits>
#include <cstdlib>
#include <fstream>

#include <openssl/crypto.h>
#include <openssl/evp.h>

#include "../core/hash.h"
#include "core/token.h"
#include "shoal/core/error.h"

namespace shoal::queue {

using nlohmann::json;

namespace {

std::string sha256_hex(const std::string& text) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  EVP_Digest(text.data(), text.size(), digest, &length, EVP_sha256(), nullptr);
  return shoal::detail::hex(digest, length);
}

bool same(const std::string& a, const std::string& b) {
  return !a.empty() && a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

// The token in `path`, made (mode 600) when the file does not exist yet.
std::string token_at(const std::string& path, const std::string& described_as) {
  if (::access(path.c_str(), F_OK) == 0) return read_token_file(path, described_as);
  const std::string token = make_token();
  write_token_file(path, token);
  return token;
}

std::string real_path(const std::string& path) {
  char resolved[PATH_MAX];
  return ::realpath(path.c_str(), resolved) != nullptr ? std::string(resolved) : std::string();
}

}  // namespace

UnixUser unix_user(const std::string& name) {
  passwd entry {};
  passwd* found = nullptr;
  std::vector<char> buffer(16384);
  const bool numeric = !name.empty() && name.find_first_not_of("0123456789") == std::string::npos;
  if (numeric) {
    ::getpwuid_r(static_cast<uid_t>(std::stoul(name)), &entry, buffer.data(), buffer.size(),
                 &found);
  } else if (!name.empty()) {
    ::getpwnam_r(name.c_str(), &entry, buffer.data(), buffer.size(), &found);
  }
  if (found == nullptr) {
    throw UsageError("no user '" + name + "' on this host; expected a Unix user to run jobs as");
  }
  UnixUser user;
  user.name = entry.pw_name;
  user.uid = entry.pw_uid;
  user.gid = entry.pw_gid;
  int count = 64;
  std::vector<gid_t> groups(count);
  if (::getgrouplist(entry.pw_name, entry.pw_gid, groups.data(), &count) < 0) {
    groups.resize(count);
    ::getgrouplist(entry.pw_name, entry.pw_gid, groups.data(), &count);
  }
  for (int i = 0; i < count; ++i) user.groups.push_back(groups[i]);
  return user;
}

std::string current_user() {
  return unix_user(std::to_string(::geteuid())).name;
}

Access::Access(AccessOptions options) : options_(std::move(options)) {
  const std::string dir = options_.state_dir;
  admin_token_ = token_at(options_.token_file.empty() ? dir + "/token" : options_.token_file,
                          "the queue's token file");
  agent_token_file_ = dir + "/agent-token";
  agent_token_ = token_at(agent_token_file_, "the agents' token file");
  if (options_.run_as.empty()) options_.run_as = current_user();
  options_.run_as = unix_user(options_.run_as).name;
  for (auto& program_dir : options_.allowed_programs) {
    const std::string resolved = real_path(program_dir);
    if (resolved.empty()) {
      throw UsageError("--allow-programs " + program_dir + " is not a directory of this host");
    }
    program_dir = resolved;
  }
  users_file_ = dir + "/users.json";
  std::ifstream in(users_file_);
  if (in) {
    const json doc = json::parse(in);
    for (const auto& [name, user] : doc.at("users").items()) {
      users_[name] = User{user.at("token_sha256"), user.at("run_as"), user.value("allow_root", false)};
    }
  }
}

std::optional<Principal> Access::identify(const std::string& token) const {
  if (same(token, admin_token_)) {
    return Principal{Principal::kAdmin, "admin", options_.run_as, options_.allow_root_jobs};
  }
  if (same(token, agent_token_)) return Principal{Principal::kAgent, "agent", "", false};
  const std::string hash = sha256_hex(token);
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& [name, user] : users_) {
    if (same(hash, user.token_sha256))
      return Principal{Principal::kUser, name, user.run_as, user.allow_root};
  }
  return std::nullopt;
}

std::string Access::authorize(const Principal& who, const std::string& program) const {
  const UnixUser user = unix_user(who.run_as);
  if (user.uid == 0 && !who.may_run_as_root) {
    throw UsageError(
        who.kind == Principal::kAdmin
            ? "the admin's jobs would run as root, which this queue does not allow; expected "
              "`shoal queue serve --run-as USER` (or --allow-root-jobs)"
            : "user '" + who.name + "' runs jobs as root, which the admin did not allow");
  }
  if (!options_.allowed_programs.empty()) {
    const std::string resolved = real_path(program);
    bool inside = false;
    for (const auto& dir : options_.allowed_programs)
      inside = inside || (!resolved.empty() && resolved.rfind(dir + "/", 0) == 0);
    if (!inside) {
      std::string dirs;
      for (const auto& dir : options_.allowed_programs) dirs += (dirs.empty() ? "" : ", ") + dir;
      throw UsageError("program '" + program +
                       "' is outside the directories this queue runs programs from (" + dirs +
                       ")");
    }
  }
  return user.name;
}

std::string Access::add_user(const std::string& name, const std::string& run_as,
                             bool allow_root) {
  const bool valid = !name.empty() && name.size() <= 32 &&
                     name.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789_-") ==
                         std::string::npos &&
                     name[0] != '-';
  if (!valid || name == "admin" || name == "agent") {
    throw UsageError("user name '" + name +
                     "'; expected up to 32 of a-z, 0-9, _ and -, other than admin and agent");
  }
  const UnixUser user = unix_user(run_as.empty() ? name : run_as);
  if (user.uid == 0 && !allow_root) {
    throw UsageError("user '" + name +
                     "' would run jobs as root; expected --run-as another user, or --allow-root");
  }
  const std::string token = make_token();
  std::lock_guard<std::mutex> lock(mutex_);
  if (users_.count(name) > 0) {
    throw UsageError("user '" + name + "' exists; remove it first to give it a new token");
  }
  users_[name] = User{sha256_hex(token), user.name, allow_root};
  save();
  return token;
}

void Access::remove_user(const std::string& name) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (users_.erase(name) == 0) throw UsageError("no user '" + name + "'");
  save();
}

json Access::users() const {
  std::lock_guard<std::mutex> lock(mutex_);
  json out = json::array();
  for (const auto& [name, user] : users_)
    out.push_back({{"name", name}, {"run_as", user.run_as}, {"allow_root", user.allow_root}});
  return json{{"users", out}};
}

void Access::save() const {
  json doc = json::object();
  for (const auto& [name, user] : users_) {
    doc[name] = {{"token_sha256", user.token_sha256},
                 {"run_as", user.run_as},
                 {"allow_root", user.allow_root}};
  }
  const std::string temporary = users_file_ + ".tmp";
  {
    std::ofstream out(temporary, std::ios::trunc);
    out << json{{"users", doc}}.dump(1) << "\n";
    if (!out.flush()) throw Error("cannot write " + temporary);
  }
  ::chmod(temporary.c_str(), 0600);
  if (::rename(temporary.c_str(), users_file_.c_str()) != 0) {
    throw Error("cannot rename " + temporary + " to " + users_file_);
  }
}

namespace {
constexpr int64_t kCodeMs = 60 * 1000;
constexpr int64_t kSessionMs = 12 * 3600 * 1000;

int64_t session_clock_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}
}  // namespace

void Sessions::forget_expired(std::map<std::string, Entry>& entries, int64_t now) {
  for (auto it = entries.begin(); it != entries.end();)
    it = it->second.expires_ms < now ? entries.erase(it) : std::next(it);
}

std::string Sessions::code_for(const Principal& who) {
  const std::string code = make_token();
  std::lock_guard<std::mutex> lock(mutex_);
  const int64_t now = session_clock_ms();
  forget_expired(codes_, now);
  codes_[code] = Entry{who, now + kCodeMs};
  return code;
}

std::optional<std::string> Sessions::redeem(const std::string& code) {
  std::optional<Principal> who;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = codes_.find(code);
    if (it == codes_.end()) return std::nullopt;
    if (it->second.expires_ms >= session_clock_ms()) who = it->second.who;
    codes_.erase(it);
  }
  if (!who) return std::nullopt;
  return open(*who);
}

std::string Sessions::open(const Principal& who) {
  const std::string session = make_token() + make_token();
  std::lock_guard<std::mutex> lock(mutex_);
  const int64_t now = session_clock_ms();
  forget_expired(sessions_, now);
  sessions_[session] = Entry{who, now + kSessionMs};
  return session;
}

std::optional<Principal> Sessions::find(const std::string& session) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = sessions_.find(session);
  if (it == sessions_.end() || it->second.expires_ms < session_clock_ms()) return std::nullopt;
  return it->second.who;
}

}  // namespace shoal::queue
