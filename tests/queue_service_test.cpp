// The scheduler as a service on a shared machine (docs/queue.md, "Running the queue"): an agent
// that is stopped loses its workers as a failure and never ends a job; one scheduler per state
// directory and per port; flags and REST errors as documented; a malformed heartbeat refused whole;
// clients that send half a request stall neither the API nor the agents' heartbeats.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <atomic>

#include <httplib.h>

#include "queue_support.h"

namespace shoal::testing {
namespace {

// The job's events of `kind`.
std::vector<std::string> events_of(const json& job, const std::string& kind) {
  std::vector<std::string> out;
  for (const auto& e : job.at("events")) {
    if (e.value("kind", "") == kind) out.push_back(e.at("message"));
  }
  return out;
}

// The scheduler's events of `kind` (jobs' and its own).
std::vector<std::string> queue_events(const Queue& queue, const std::string& kind) {
  std::vector<std::string> out;
  for (const auto& e : json(queue.client().get("/events?since=0&limit=100000").at("events"))) {
    if (e.at("kind") == kind) out.push_back(e.at("message"));
  }
  return out;
}

int64_t agent_pid(const Queue& queue) {
  return std::atoll(read_text(queue.dir() + "/agent.pid").c_str());
}

// docs/queue.md, "When a job is done": SIGTERM to a host's agent drains it. Its workers leave at
// a commit and the job loses them as it loses a host: two failures, never `done`. The scheduler
// starts its local agent again, the replacements resume from the commit the leavers kept, and the
// job ends done with every sample trained on once.
TEST(QueueService, AnAgentStoppedWithSigtermIsAFailureAndTheJobTrainsOn) {
  Queue queue("agent-stop", {"--slots", "2"});
  const int64_t id =
      queue.submit("--min 2 --max 2 " + kWorker + " " + queue.dir() + "/out 3 30");
  ASSERT_TRUE(eventually([&] { return queue.staying(id).size() == 2 && queue.steps(id) >= 5; },
                         60s))
      << queue.job(id).dump(1);
  const int64_t first_agent = agent_pid(queue);
  ASSERT_TRUE(alive(first_agent));
  const auto stopped = Clock::now();
  ASSERT_EQ(::kill(static_cast<pid_t>(first_agent), SIGTERM), 0);

  // Both workers are failures of the job, recorded within the agent's stop (10 s) and a beat.
  ASSERT_TRUE(eventually([&] { return queue.job(id).at("failures") == 2; }, 20s))
      << queue.job(id).dump(1);
  std::cout << "[ measured ] the agent's SIGTERM to both failures recorded: "
            << seconds_since(stopped) << " s" << std::endl;
  EXPECT_EQ(queue.state(id), "running") << queue.job(id).dump(1);
  for (const auto& w : json(queue.job(id).at("worker_list"))) {
    if (w.at("state") != "exited") continue;
    EXPECT_NE(w.at("exit").get<std::string>().find(
                  "left when its agent was stopped (SIGTERM to the agent): exited with code 0"),
              std::string::npos)
        << w.dump();
  }
  const auto lost = queue_events(queue, "host-lost");
  ASSERT_EQ(lost.size(), 1u);
  EXPECT_NE(lost[0].find("its agent (pid " + std::to_string(first_agent) + ") stopped"),
            std::string::npos)
      << lost[0];

  // The scheduler's own agent comes back; the job trains again and finishes.
  ASSERT_TRUE(eventually(
      [&] { return agent_pid(queue) != first_agent && alive(agent_pid(queue)); }, 15s))
      << read_text(queue.dir() + "/serve.log");
  ASSERT_TRUE(eventually([&] { return finished(queue, id); }, 120s)) << queue.job(id).dump(1);
  const json job = queue.job(id);
  EXPECT_EQ(job.at("failures"), 2);
  EXPECT_TRUE(events_of(job, "failed").empty()) << job.dump(1);
  EXPECT_NE(job.at("reason").get<std::string>().find("training finished"), std::string::npos);
  expect_every_sample_once(queue.dir() + "/out", 3);
  EXPECT_EQ(queue.logs(id).size(), 4u) << "two workers, then their two replacements";
}

// Note [A leave is not the end]: a SIGTERM that the agent did not send (someone's `kill -TERM`
// of a worker) makes the worker leave at a commit and exit 0; the job counts a failure, replaces
// it, and is done only when its training ends.
TEST(QueueService, AWorkerThatLeavesOnSomeonesSigtermIsReplacedNotTheEndOfTheJob) {
  Queue queue("stray-term", {"--slots", "2"});
  const int64_t id =
      queue.submit("--min 1 --max 2 " + kWorker + " " + queue.dir() + "/out 3 30");
  ASSERT_TRUE(eventually([&] { return queue.staying(id).size() == 2 && queue.steps(id) >= 5; },
                         60s))
      << queue.job(id).dump(1);
  const auto workers = queue.staying(id);
  ASSERT_EQ(::kill(static_cast<pid_t>(workers.rbegin()->second), SIGTERM), 0);
  ASSERT_TRUE(eventually([&] { return queue.job(id).at("failures") == 1; }, 30s))
      << queue.job(id).dump(1);
  EXPECT_EQ(queue.state(id), "running");
  bool named = false;
  for (const auto& w : json(queue.job(id).at("worker_list"))) {
    named = named || w.at("exit").get<std::string>().find(
                         "left the job after a SIGTERM that its agent did not send: exited with "
                         "code 0") != std::string::npos;
  }
  EXPECT_TRUE(named) << queue.job(id).dump(1);
  ASSERT_TRUE(eventually([&] { return finished(queue, id); }, 120s)) << queue.job(id).dump(1);
  EXPECT_EQ(queue.job(id).at("failures"), 1);
  expect_every_sample_once(queue.dir() + "/out", 3);
}

// Note [One scheduler per state]: a second scheduler on the same state is refused with one line
// naming the first, and changes nothing of it; one on another state but the same port is refused
// too, rather than sharing the port.
TEST(QueueService, ASecondSchedulerOnTheSameStateOrPortIsRefused) {
  Queue queue("one-per-state", {"--slots", "2"});
  ASSERT_TRUE(eventually([&] { return !queue.client().get("/nodes").at("nodes").empty(); }, 15s));
  const std::string address = read_text(queue.dir() + "/address");
  const int64_t agent = agent_pid(queue);

  std::string out;
  auto started = Clock::now();
  EXPECT_EQ(shell(shoal_bin() + " queue serve --state-dir " + queue.dir() +
                      " --port 0 2>&1",
                  &out),
            2);
  EXPECT_LT(seconds_since(started), 10);
  EXPECT_EQ(out, "shoal queue serve: another scheduler (pid " + std::to_string(queue.pid()) +
                     ", serving on 127.0.0.1:" + std::to_string(queue.port()) +
                     ") serves the state in " + queue.dir() +
                     "; stop it first, or pass another --state-dir\n");
  EXPECT_EQ(read_text(queue.dir() + "/address"), address);
  EXPECT_EQ(agent_pid(queue), agent);
  EXPECT_TRUE(alive(agent));

  const std::string other = queue.dir() + "-other";
  shell("rm -rf " + other);
  started = Clock::now();
  EXPECT_EQ(shell(shoal_bin() + " queue serve --no-local-agent --state-dir " + other +
                      " --port " + std::to_string(queue.port()) + " 2>&1",
                  &out),
            2);
  EXPECT_LT(seconds_since(started), 10);
  EXPECT_EQ(out, "shoal queue serve: cannot listen on 127.0.0.1:" + std::to_string(queue.port()) +
                     ": the port is in use or the address is not this host's; pass another "
                     "--port or --host\n");
  EXPECT_EQ(read_text(other + "/address"), "");
  shell("rm -rf " + other);

  // The first one's lock goes with it, even by SIGKILL: a scheduler started after takes over.
  queue.kill9();
  queue.start(queue.port(), queue.agent_port());
  EXPECT_TRUE(eventually(
      [&] { return queue.client().get("/nodes").at("nodes").at(0).at("alive") == true; }, 15s));
}

// docs/queue.md, "Throughput": a job's samples per second, from its first worker's progress,
// at its worker count. Each step of elastic_worker sleeps STEP_MS (100 here) and trains the global
// batch of 10, so it cannot exceed 100 samples/s.
// Note [Outages]: a scheduler down for 4 s leaves an outage of about 4 s in /metrics and an event.
TEST(QueueService, ThroughputAndSchedulerOutagesAreRecorded) {
  Queue queue("throughput", {"--slots", "2"});
  const int64_t id =
      queue.submit("--min 2 --max 2 " + kWorker + " " + queue.dir() + "/out 4 100");
  ASSERT_TRUE(eventually(
      [&] { return !queue.job(id).at("throughput").at("samples_per_s").is_null(); }, 60s))
      << queue.job(id).dump(1);
  const json throughput = queue.job(id).at("throughput");
  const double rate = throughput.at("samples_per_s");
  std::cout << "[ measured ] " << rate << " samples/s at " << throughput.at("world")
            << " workers (at most 100)" << std::endl;
  EXPECT_EQ(throughput.at("world"), 2);
  EXPECT_GT(rate, 10.0);
  EXPECT_LE(rate, 100.0 * 1.02);
  EXPECT_DOUBLE_EQ(throughput.at("by_world").at("2").get<double>(), rate);

  const auto wall_ms = [] {
    return std::chrono::duration_cast<std::chrono::milliseconds>(
               std::chrono::system_clock::now().time_since_epoch())
        .count();
  };
  EXPECT_TRUE(json(queue.client().get("/metrics").at("outages")).empty());
  const int64_t killed = wall_ms();
  queue.kill9();
  std::this_thread::sleep_for(4s);
  queue.start(queue.port(), queue.agent_port());
  const int64_t started = wall_ms();
  const json outages = queue.client().get("/metrics").at("outages");
  ASSERT_EQ(outages.size(), 1u) << outages.dump();
  const int64_t from = outages[0].at("from_ms"), to = outages[0].at("to_ms");
  EXPECT_GE(from, killed - 1100);  // the last second it was known alive
  EXPECT_LE(from, killed);
  EXPECT_GE(to, killed + 4000);
  EXPECT_LE(to, started);
  const auto noted = queue_events(queue, "outage");
  ASSERT_EQ(noted.size(), 1u);
  EXPECT_EQ(noted[0].rfind("no scheduler ran for ", 0), 0u) << noted[0];
  // The measured rates survive the restart (kept on disk when they move by more than a tenth).
  EXPECT_NEAR(queue.job(id).at("throughput").at("by_world").at("2").get<double>(), rate,
              0.1 * rate);
  ASSERT_TRUE(eventually([&] { return finished(queue, id); }, 120s)) << queue.job(id).dump(1);
  expect_every_sample_once(queue.dir() + "/out", 4);
}

TEST(QueueService, FlagsAreCheckedAsDocumented) {
  const std::string dir = std::string(::testing::TempDir()) + "shoal-queue-flags-" +
                          std::to_string(::getpid());
  const std::string serve =
      shoal_bin() + " queue serve --no-local-agent --state-dir " + dir + " ";
  std::string out;
  EXPECT_EQ(shell(serve + "--port 99999 2>&1", &out), 2);
  EXPECT_EQ(out,
            "shoal queue serve: --port expects a port from 0 (any free one) to 65535, not 99999\n");
  EXPECT_EQ(shell(serve + "--port 0 --slots -1 2>&1", &out), 2);
  EXPECT_EQ(out,
            "shoal queue serve: --slots expects a count of workers, 0 or more (0: cores x "
            "--oversubscribe), not -1\n");
  EXPECT_EQ(read_text(dir + "/address"), "");
  shell("rm -rf " + dir);

  // Each command's --help lists its flags.
  const std::map<std::string, std::vector<std::string>> flags = {
      {"serve", {"--state-dir", "--port", "--slots", "--cooldown", "--no-local-agent"}},
      {"submit", {"--min", "--max", "--priority", "--preemptible", "--max-restarts", "--name"}},
      {"ls", {"--queue", "--token-file"}},
      {"show", {"--queue", "job"}},
      {"cancel", {"--queue", "job"}},
      {"top", {"--interval", "--iterations"}},
  };
  for (const auto& [command, names] : flags) {
    EXPECT_EQ(shell(shoal_bin() + " queue " + command + " --help 2>&1", &out), 0)
        << command;
    for (const std::string& name : names)
      EXPECT_NE(out.find(name), std::string::npos) << command << " --help lacks " << name << ":\n"
                                                   << out;
  }
  EXPECT_EQ(shell(shoal_bin() + " agent --help 2>&1", &out), 0);
  for (const std::string name : {"--queue", "--slots", "--engine", "--dir"})
    EXPECT_NE(out.find(name), std::string::npos) << out;
}

// Every refused request answers with its status and the API's one-line JSON error.
TEST(QueueService, RestErrorsAreOneLineJson) {
  Queue queue("rest", {"--slots", "1"});
  std::string token = read_text(queue.dir() + "/token");
  while (!token.empty() && token.back() == '\n') token.pop_back();
  httplib::Client http("127.0.0.1", queue.port());
  http.set_read_timeout(10, 0);
  const httplib::Headers auth = {{"Authorization", "Bearer " + token}};
  const auto expect_error = [&](const httplib::Result& result, int status,
                                const std::string& error, const std::string& what) {
    ASSERT_TRUE(result) << what;
    EXPECT_EQ(result->status, status) << what << ": " << result->body;
    EXPECT_EQ(result->get_header_value("Content-Type"), "application/json") << what;
    json body;
    ASSERT_NO_THROW(body = json::parse(result->body)) << what << ": " << result->body;
    EXPECT_EQ(body, json({{"error", error}})) << what;
  };
  expect_error(http.Get("/events?since=abc", auth), 400,
               "since expects an integer from 0 to 9223372036854775807, not 'abc'", "since=abc");
  expect_error(http.Get("/events?limit=0", auth), 400,
               "limit expects an integer from 1 to 100000, not '0'", "limit=0");
  expect_error(http.Get("/jobs/abc", auth), 404,
               "no job 'abc': a job's id is a positive integer", "/jobs/abc");
  expect_error(http.Get("/jobs/7", auth), 404, "no job 7", "/jobs/7");
  expect_error(http.Get("/nothing", auth), 404,
               "no such request: GET /nothing; the REST API is in docs/queue.md", "/nothing");
  expect_error(http.Put("/jobs", auth, "{}", "application/json"), 404,
               "no such request: PUT /jobs; the REST API is in docs/queue.md", "PUT /jobs");
  expect_error(http.Get("/jobs"), 401,
               "the queue's token is missing or wrong: pass --token-file or set SHOAL_QUEUE_TOKEN",
               "no token");
  const json job = {{"argv", {kWorker}}, {"name", std::string(300, 'n')}};
  expect_error(http.Post("/jobs", auth, job.dump(), "application/json"), 400,
               "the name has 300 bytes; at most 200 are accepted", "a long name");
  const json huge = {{"argv", {kWorker}}, {"name", std::string(8 << 20, 'n')}};
  expect_error(http.Post("/jobs", auth, huge.dump(), "application/json"), 413,
               "the request's body is over 1048576 bytes", "an 8 MiB name");
  EXPECT_TRUE(json(queue.client().get("/jobs").at("jobs")).empty()) << "a refused job was kept";
}

// Note [A heartbeat is read whole] (src/queue/heartbeat.h): a report with a field missing or of the
// wrong type is refused whole, with 400 and one line naming the field, and nothing of it is
// applied. Each report below also changes the host's cores and its agent's pid, which a report
// applied in part took before it reached the bad field; the scheduler's views stay as they were.
TEST(QueueService, AMalformedHeartbeatIsRefusedWholeWithOneLine) {
  Queue queue("bad-beat", {"--no-local-agent", "--host-timeout", "60"});
  std::string token = read_text(queue.dir() + "/agent-token");
  while (!token.empty() && token.back() == '\n') token.pop_back();
  httplib::Client agents("127.0.0.1", queue.agent_port());
  agents.set_read_timeout(10, 0);
  const httplib::Headers auth = {{"Authorization", "Bearer " + token}};
  const json beat = {{"host", "ghost"}, {"cores", 2}, {"slots", 0}, {"pid", 4242},
                     {"nudge_port", 0}, {"workers", json::array()}, {"members", json::object()}};
  const auto accepted = agents.Post("/agent/heartbeat", auth, beat.dump(), "application/json");
  ASSERT_TRUE(accepted);
  ASSERT_EQ(accepted->status, 200) << accepted->body;
  const auto views = [&] {
    return json{{"nodes", queue.client().get("/nodes")},
                {"jobs", queue.client().get("/jobs")},
                {"events", queue.client().get("/events?since=0&limit=100000")}};
  };
  const json before = views();
  ASSERT_EQ(before.at("nodes").at("nodes").size(), 1u) << before.dump();

  json changed = beat;
  changed["cores"] = 8;
  changed["pid"] = 4343;
  json mistyped = changed;
  mistyped["workers"] = json::array({{{"id", 1},
                                      {"job", 1},
                                      {"pid", 99},
                                      {"running", "yes"},
                                      {"started_ms", 0},
                                      {"exit", ""},
                                      {"success", false}}});
  json noisy = changed;
  noisy["workers"] = json::array({{{"id", 1},
                                   {"job", 1},
                                   {"pid", 99},
                                   {"running", true},
                                   {"started_ms", 0},
                                   {"exit", ""},
                                   {"success", false},
                                   {"progress",
                                    {{"time_ms", 1}, {"samples", 2}, {"world", 1}, {"noise_scale", "large"}}}}});
  json bad_step = noisy;
  bad_step["workers"][0]["progress"] = {
      {"time_ms", 1},
      {"samples", 2},
      {"world", 1},
      {"batch",
       {{"base", 32}, {"max", 64}, {"min_local", 8}, {"max_local", 32}, {"max_accumulation", 1}}},
      {"steps", json::array({json::array({1, 32, 0.5, 1}), json::array({2, 16, -1, 1})})}};
  json bad_limits = bad_step;
  bad_limits["workers"][0]["progress"]["batch"]["max"] = 16;
  json missing = changed;
  missing.erase("slots");
  json not_a_job = changed;
  not_a_job["members"] = {{"first", "127.0.0.1:7000"}};
  const std::vector<std::pair<json, std::string>> refused = {
      {mistyped, "heartbeat: field 'workers[0].running' is a string; expected true or false"},
      {noisy,
       "heartbeat: field 'workers[0].progress.noise_scale' is a string; expected a noise scale in "
       "samples, a number >= 0"},
      {bad_step,
       "heartbeat: field 'workers[0].progress.steps[1]' is [2,16,-1,1]; expected [workers >= 1, "
       "batch per backward > 0, seconds > 0, backward passes >= 1]"},
      {bad_limits,
       "heartbeat: field 'workers[0].progress.batch': max_batch is 16; expected at least "
       "base_batch (32)"},
      {missing,
       "heartbeat: field 'slots' is missing; expected the host's slots, an integer (0: from its "
       "cores)"},
      {not_a_job,
       "heartbeat: field 'members' has the key 'first'; expected job ids (positive integers) as "
       "keys"},
  };
  for (const auto& [report, error] : refused) {
    const auto answer = agents.Post("/agent/heartbeat", auth, report.dump(), "application/json");
    ASSERT_TRUE(answer) << error;
    EXPECT_EQ(answer->status, 400) << answer->body;
    EXPECT_EQ(answer->body, json({{"error", error}}).dump());
  }
  EXPECT_EQ(views(), before);
}

// Note [Clients cannot stall the scheduler]: forty connections that each send a request line and
// a Host header and never finish, opened again as the scheduler drops them, for longer than the
// host timeout: the API answers within a second throughout, no heartbeat is late enough to lose
// the host, the job keeps its workers, and it ends with every sample once.
TEST(QueueService, HalfOpenConnectionsStallNeitherTheApiNorTheHeartbeats) {
  Queue queue("slow-clients", {"--slots", "2"});
  const int64_t id =
      queue.submit("--min 2 --max 2 " + kWorker + " " + queue.dir() + "/out 6 150");
  ASSERT_TRUE(eventually([&] { return queue.staying(id).size() == 2 && queue.steps(id) >= 3; },
                         60s))
      << queue.job(id).dump(1);
  const auto workers = queue.staying(id);

  constexpr int kConnections = 40;
  std::atomic<bool> stop{false};
  std::atomic<int> held{0};
  std::thread attacker([&] {
    std::vector<int> fds(kConnections, -1);
    const std::string half = "GET /jobs HTTP/1.1\r\nHost: queue\r\n";
    while (!stop) {
      int open = 0;
      for (int& fd : fds) {
        // A connection the scheduler closed (its read timed out) is opened again.
        if (fd >= 0) {
          char byte;
          const ssize_t got = ::recv(fd, &byte, 1, MSG_DONTWAIT);
          if (got == 0 || (got < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) {
            ::close(fd);
            fd = -1;
          }
        }
        if (fd < 0) {
          fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
          sockaddr_in to{};
          to.sin_family = AF_INET;
          to.sin_port = htons(static_cast<uint16_t>(queue.port()));
          ::inet_pton(AF_INET, "127.0.0.1", &to.sin_addr);
          if (::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof(to)) != 0 ||
              ::send(fd, half.data(), half.size(), MSG_NOSIGNAL) < 0) {
            ::close(fd);
            fd = -1;
          }
        }
        open += fd >= 0 ? 1 : 0;
      }
      held = open;
      std::this_thread::sleep_for(50ms);
    }
    for (int fd : fds) {
      if (fd >= 0) ::close(fd);
    }
  });

  // Once all are open (a connection past the listen backlog waits for a SYN to be resent, 1 s),
  // for 12 s (the host timeout is 5 s): the API's answer time, and how stale the scheduler's last
  // heartbeat from the host ever was.
  if (!eventually([&] { return held == kConnections; }, 10s)) {
    stop = true;
    attacker.join();
    FAIL() << "the attacker opened only " << held << " connections in 10 s";
  }
  const auto start = Clock::now();
  double slowest_answer = 0;
  int64_t stalest_beat_ms = 0;
  int min_held = kConnections;
  std::string unanswered;
  while (seconds_since(start) < 12) {
    const auto asked = Clock::now();
    json nodes = json{{"nodes", json::array()}};
    try {
      nodes = queue.client().get("/nodes");
    } catch (const Error& e) {
      unanswered = e.what();
    }
    slowest_answer = std::max(slowest_answer, seconds_since(asked));
    const int64_t now_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                               std::chrono::system_clock::now().time_since_epoch())
                               .count();
    for (const auto& node : nodes.at("nodes"))
      stalest_beat_ms = std::max(stalest_beat_ms, now_ms - node.at("last_seen_ms").get<int64_t>());
    min_held = std::min(min_held, held.load());
    std::this_thread::sleep_for(200ms);
  }
  stop = true;
  attacker.join();
  std::cout << "[ measured ] " << min_held << "+ half-open connections held for 12 s: slowest API "
            << "answer " << slowest_answer << " s, stalest heartbeat " << stalest_beat_ms
            << " ms, hosts lost " << queue_events(queue, "host-lost").size() << ", failures "
            << queue.job(id).at("failures") << std::endl;
  EXPECT_GE(min_held, kConnections) << "the attacker could not hold its connections";
  EXPECT_LT(slowest_answer, 1.0);
  EXPECT_EQ(unanswered, "");
  EXPECT_LT(stalest_beat_ms, 5000);
  EXPECT_TRUE(queue_events(queue, "host-lost").empty());
  EXPECT_EQ(queue.job(id).at("failures"), 0);
  EXPECT_EQ(queue.staying(id), workers);

  const auto dropped = Clock::now();
  queue.client().get("/jobs");
  EXPECT_LT(seconds_since(dropped), 1.0);
  ASSERT_TRUE(eventually([&] { return finished(queue, id); }, 120s)) << queue.job(id).dump(1);
  EXPECT_EQ(queue.job(id).at("failures"), 0);
  expect_every_sample_once(queue.dir() + "/out", 6);
}

}  // namespace
}  // namespace shoal::testing
