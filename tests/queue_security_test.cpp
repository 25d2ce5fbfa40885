// The queue's security model (docs/queue.md, "Security"): three kinds of credential and what
// each may do, jobs run as the Unix user the admin gave their submitter (root only where
// allowed), programs limited to allowed directories, and a dashboard opened without a token in
// its URL. Each refusal is checked with its status and its line.
#include <sys/stat.h>

#include <httplib.h>

#include "queue_support.h"

namespace shoal::testing {
namespace {

std::string first_line(const std::string& path) {
  std::string text = read_text(path);
  return text.substr(0, text.find('\n'));
}

// The real uid of process `pid`.
int64_t uid_of(int64_t pid) {
  std::istringstream status(read_text("/proc/" + std::to_string(pid) + "/status"));
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("Uid:", 0) == 0) return std::atoll(line.c_str() + 4);
  }
  return -1;
}

void expect_error(const httplib::Result& result, int status, const std::string& error,
                  const std::string& what) {
  ASSERT_TRUE(result) << what;
  EXPECT_EQ(result->status, status) << what << ": " << result->body;
  EXPECT_EQ(result->body, json({{"error", error}}).dump()) << what;
}

const std::string kNoToken =
    "the queue's token is missing or wrong: pass --token-file or set SHOAL_QUEUE_TOKEN";
const std::string kNoAgentToken =
    "the agents' token is missing or wrong: pass shoal agent --token-file with a copy of the "
    "scheduler's STATE_DIR/agent-token";

// Users and agents each have a credential of their own, and neither opens the other's door; a
// token is taken from a header or a session cookie, never from the URL.
TEST(QueueSecurity, EachCredentialOpensOnlyItsOwnDoor) {
  Queue queue("credentials", {"--slots", "1"});
  const std::string admin = first_line(queue.dir() + "/token");
  const std::string agent = first_line(queue.dir() + "/agent-token");
  ASSERT_NE(admin, agent);
  httplib::Client api("127.0.0.1", queue.port());
  httplib::Client agents("127.0.0.1", queue.agent_port());
  const auto bearer = [](const std::string& token) {
    return httplib::Headers{{"Authorization", "Bearer " + token}};
  };
  expect_error(api.Get("/jobs"), 401, kNoToken, "no token");
  expect_error(api.Get("/jobs", bearer("0123456789abcdef0123456789abcdef")), 401, kNoToken,
               "a wrong token");
  expect_error(api.Get(("/jobs?token=" + admin).c_str()), 401, kNoToken, "the token in the URL");
  expect_error(api.Get("/jobs", bearer(agent)), 401, kNoToken, "the agents' token on the API");
  expect_error(api.Post("/agent/heartbeat", bearer(admin), "{}", "application/json"), 404,
               "no such request: POST /agent/heartbeat; the REST API is in docs/queue.md",
               "a heartbeat on the users' port");
  expect_error(agents.Post("/agent/heartbeat", bearer(admin), "{\"host\": \"x\"}",
                           "application/json"),
               401, kNoAgentToken, "the admin's token on the agents' port");
  expect_error(agents.Get("/jobs", bearer(agent)), 404,
               "no such request: GET /jobs; the REST API is in docs/queue.md",
               "the API on the agents' port");
  const auto answer = api.Get("/jobs", bearer(admin));
  ASSERT_TRUE(answer);
  EXPECT_EQ(answer->status, 200);
  // The local agent beats with its own token: its host is known.
  EXPECT_TRUE(eventually(
      [&] { return queue.client().get("/nodes").at("nodes").size() == 1; }, 15s));
  // The files that hold credentials are the scheduler's user's alone.
  for (const std::string file : {"/token", "/agent-token", "/queue.db"}) {
    struct stat info {};
    ASSERT_EQ(::stat((queue.dir() + file).c_str(), &info), 0) << file;
    EXPECT_EQ(info.st_mode & 0077, 0u) << file << " is readable by others";
  }
}

// A queue whose scheduler runs as root and was not allowed root jobs refuses the admin's job
// with one line, and keeps nothing of it; the command line says the same and exits 2.
TEST(QueueSecurity, AJobThatWouldRunAsRootIsRefusedWhereTheAdminDidNotAllowIt) {
  if (::geteuid() != 0) GTEST_SKIP() << "the scheduler must run as root for this case";
  Queue queue("no-root", {"--slots", "1", "--run-as", "root"});
  const std::string line =
      "the admin's jobs would run as root, which this queue does not allow; expected `shoal "
      "queue serve --run-as USER` (or --allow-root-jobs)";
  try {
    queue.client().post("/jobs", {{"argv", {kWorker}}});
    ADD_FAILURE() << "a root job was accepted";
  } catch (const UsageError& e) {
    EXPECT_EQ(std::string(e.what()), line);
  }
  std::string out;
  EXPECT_EQ(queue.cli("submit " + kWorker + " " + queue.dir() + "/out", &out), 2);
  EXPECT_EQ(out, "shoal queue submit: " + line + "\n");
  EXPECT_TRUE(json(queue.client().get("/jobs").at("jobs")).empty());
  for (const auto& e : json(queue.client().get("/events").at("events")))
    EXPECT_NE(e.at("kind"), "submit") << e.dump();
}

// docs/queue.md, "Security": the admin adds a user whose jobs run as the Unix user `nobody`; the
// user's job is theirs, its workers run as nobody (the agent drops root before the program
// starts), it trains every sample once, and another user may neither cancel it nor manage users.
TEST(QueueSecurity, AUsersJobRunsAsTheirUnixUserAndIsTheirs) {
  if (::geteuid() != 0) GTEST_SKIP() << "the agent must run as root to start workers as nobody";
  Queue queue("users", {"--slots", "2"});
  std::string token;
  ASSERT_EQ(queue.cli("user add nobody", &token), 0) << token;
  token = token.substr(0, token.find('\n'));
  ASSERT_EQ(token.size(), 32u) << token;
  std::string other;
  ASSERT_EQ(queue.cli("user add other --run-as nobody", &other), 0) << other;
  other = other.substr(0, other.find('\n'));
  std::string out;
  EXPECT_EQ(queue.cli("user add root", &out), 2);
  EXPECT_EQ(out,
            "shoal queue user: user 'root' would run jobs as root; expected --run-as another "
            "user, or --allow-root\n");
  EXPECT_EQ(queue.cli("user ls", &out), 0);
  EXPECT_EQ(out, "nobody runs as nobody\nother runs as nobody\n");

  // A directory the job's user may write its output to.
  const std::string shared = queue.dir() + "-shared";
  shell("rm -rf " + shared);
  ASSERT_EQ(::mkdir(shared.c_str(), 0777), 0);
  ::chmod(shared.c_str(), 01777);
  queue::HttpClient as_user("127.0.0.1", queue.port(), token);
  const int64_t id = as_user
                         .post("/jobs", {{"argv", {kWorker, shared + "/out", "2", "40"}},
                                         {"cwd", shared},
                                         {"min", 2},
                                         {"max", 2}})
                         .at("id");
  ASSERT_TRUE(eventually([&] { return queue.staying(id).size() == 2; }, 60s))
      << queue.job(id).dump(1);
  for (const auto& [worker, pid] : queue.staying(id))
    EXPECT_EQ(uid_of(pid), 65534) << "worker " << worker << " (pid " << pid << ")";
  const json job = queue.job(id);
  EXPECT_EQ(job.at("owner"), "nobody");
  EXPECT_EQ(job.at("run_as"), "nobody");

  queue::HttpClient as_other("127.0.0.1", queue.port(), other);
  try {
    as_other.del("/jobs/" + std::to_string(id));
    ADD_FAILURE() << "another user cancelled the job";
  } catch (const UsageError& e) {
    EXPECT_EQ(std::string(e.what()), "job " + std::to_string(id) +
                                         " is nobody's; only its owner or the admin may cancel it");
  }
  try {
    as_other.get("/users");
    ADD_FAILURE() << "a user listed the users";
  } catch (const UsageError& e) {
    EXPECT_EQ(std::string(e.what()), "only the queue's admin may manage users");
  }
  ASSERT_TRUE(eventually([&] { return finished(queue, id); }, 120s)) << queue.job(id).dump(1);
  EXPECT_EQ(queue.job(id).at("failures"), 0);
  expect_every_sample_once(shared + "/out", 2);
  struct stat info {};
  ASSERT_EQ(::stat((shared + "/out").c_str(), &info), 0);
  EXPECT_EQ(info.st_uid, 65534u) << "the job's output is not its user's";
  shell("rm -rf " + shared);

  // A removed user's token opens nothing.
  EXPECT_EQ(queue.cli("user rm other", &out), 0) << out;
  try {
    as_other.get("/jobs");
    ADD_FAILURE() << "a removed user's token still works";
  } catch (const UsageError& e) {
    EXPECT_EQ(std::string(e.what()), kNoToken);
  }
}

TEST(QueueSecurity, ProgramsOutsideTheAllowedDirectoriesAreRefused) {
  Queue queue("allow-programs", {"--slots", "1", "--allow-programs", "/usr/bin,/usr/sbin"});
  try {
    queue.client().post("/jobs", {{"argv", {kWorker}}});
    ADD_FAILURE() << "a program outside --allow-programs was accepted";
  } catch (const UsageError& e) {
    EXPECT_EQ(std::string(e.what()), "program '" + kWorker +
                                         "' is outside the directories this queue runs programs "
                                         "from (/usr/bin, /usr/sbin)");
  }
  EXPECT_TRUE(json(queue.client().get("/jobs").at("jobs")).empty());
}

// Note [Tokens out of URLs]: the dashboard opens through a one-time login code that sets a
// session cookie; the code works once, and a token in the URL opens nothing.
TEST(QueueSecurity, TheDashboardOpensThroughAOneTimeCodeNotATokenInItsUrl) {
  Queue queue("login", {"--slots", "1"});
  httplib::Client browser("127.0.0.1", queue.port());
  const std::string admin = first_line(queue.dir() + "/token");

  auto page = browser.Get(("/?token=" + admin).c_str());
  ASSERT_TRUE(page);
  EXPECT_EQ(page->status, 302);
  EXPECT_EQ(page->get_header_value("Location"), "/login");

  std::string out;
  ASSERT_EQ(queue.cli("dashboard", &out), 0) << out;
  const std::string prefix = "http://127.0.0.1:" + std::to_string(queue.port()) + "/login?code=";
  ASSERT_EQ(out.rfind(prefix, 0), 0u) << out;
  const std::string path = out.substr(out.find("/login?code="), out.find('\n') - out.find("/login"));
  EXPECT_EQ(path.find(admin), std::string::npos) << "the admin's token is in the login URL";

  auto login = browser.Get(path.c_str());
  ASSERT_TRUE(login);
  EXPECT_EQ(login->status, 302);
  EXPECT_EQ(login->get_header_value("Location"), "/");
  const std::string set_cookie = login->get_header_value("Set-Cookie");
  EXPECT_NE(set_cookie.find("HttpOnly"), std::string::npos) << set_cookie;
  EXPECT_NE(set_cookie.find("SameSite=Strict"), std::string::npos) << set_cookie;
  const std::string session = set_cookie.substr(0, set_cookie.find(';'));
  const httplib::Headers with_cookie = {{"Cookie", session}};
  page = browser.Get("/", with_cookie);
  ASSERT_TRUE(page);
  EXPECT_EQ(page->status, 200);
  EXPECT_NE(page->body.find("<title>shoal queue</title>"), std::string::npos);
  const auto jobs = browser.Get("/jobs", with_cookie);
  ASSERT_TRUE(jobs);
  EXPECT_EQ(jobs->status, 200) << jobs->body;

  expect_error(browser.Get(path.c_str()), 401,
               "the login code is unknown, spent or expired; `shoal queue dashboard` prints a "
               "new one",
               "the code used twice");
  expect_error(browser.Get("/jobs", {{"Cookie", "shoal_session=forged"}}), 401, kNoToken,
               "a forged session");
}

// With TLS (on by default beyond loopback; `--tls on` here): both ports speak HTTPS with the
// certificate the scheduler made, clients verify it by its file, and a plain HTTP request gets no
// answer, which the client names with the address to use instead.
TEST(QueueSecurity, TheApiSpeaksTlsAndClientsVerifyTheSchedulersCertificate) {
  Queue queue("tls", {"--slots", "1", "--tls", "on"});
  ASSERT_TRUE(queue.tls()) << read_text(queue.dir() + "/address");
  const std::string https = "https://127.0.0.1:" + std::to_string(queue.port());
  EXPECT_EQ(first_line(queue.dir() + "/address"), https);
  struct stat key {};
  ASSERT_EQ(::stat((queue.dir() + "/tls/key.pem").c_str(), &key), 0);
  EXPECT_EQ(key.st_mode & 0077, 0u) << "the private key is readable by others";
  // The local agent beat over TLS with its own token.
  EXPECT_TRUE(eventually(
      [&] { return queue.client().get("/nodes").at("nodes").size() == 1; }, 15s));

  std::string out;
  EXPECT_EQ(queue.cli("ls --queue 127.0.0.1:" + std::to_string(queue.port()), &out), 1);
  EXPECT_EQ(out, "shoal queue ls: cannot reach the queue at 127.0.0.1:" +
                     std::to_string(queue.port()) +
                     " (GET /jobs): Read; if the queue speaks TLS, its address is " + https + "\n");
  EXPECT_EQ(queue.cli("ls --queue " + https + " --ca-cert /nonexistent", &out), 1);
  EXPECT_NE(out.find("cannot reach the queue at " + https + " (GET /jobs): SSL"),
            std::string::npos)
      << out;
  // Another scheduler's certificate does not vouch for this one.
  Queue other("tls-other", {"--slots", "1", "--tls", "on", "--no-local-agent"});
  EXPECT_EQ(queue.cli("ls --queue " + https + " --ca-cert " + other.ca_file(), &out), 1);
  EXPECT_NE(out.find("SSL server verification failed"), std::string::npos) << out;
  EXPECT_EQ(queue.cli("ls --queue " + https + " --ca-cert " + queue.ca_file(), &out), 0) << out;
  EXPECT_EQ(out.rfind("JOB", 0), 0u) << out;

  EXPECT_EQ(queue.cli("dashboard", &out), 0) << out;
  EXPECT_EQ(out.rfind(https + "/login?code=", 0), 0u) << out;
  httplib::Client browser(https);
  browser.set_ca_cert_path(queue.ca_file().c_str());
  browser.enable_server_certificate_verification(true);
  const auto login = browser.Get(out.substr(https.size(), out.find('\n') - https.size()).c_str());
  ASSERT_TRUE(login) << httplib::to_string(login.error());
  EXPECT_NE(login->get_header_value("Set-Cookie").find("; Secure"), std::string::npos);
}

}  // namespace
}  // namespace shoal::testing
