// The queue's dashboard (docs/queue.md, "Dashboard") in a real browser: Debian's chromium,
// headless, on the page that the real `shoal queue serve` serves while a high-priority job
// shrinks a low one (test 1 of docs/queue.md). The test reads the DOM the page rendered and
// compares it with what the scheduler reports; it also takes a screenshot a person can look at
// (SHOAL_DASHBOARD_SCREENSHOT=PATH keeps it; docs/queue-dashboard.png is one).
#include <algorithm>
#include <cstdlib>
#include <regex>

#include "queue_support.h"

namespace shoal::testing {
namespace {

bool chromium_installed() {
  return std::system("command -v chromium >/dev/null 2>&1") == 0;
}

// Runs headless chromium on `url` with `mode` (--dump-dom, or --screenshot=...), its stdout to
// `out` and its noise (D-Bus complaints, which are harmless) to `log`; its exit code.
//
// --virtual-time-budget: chromium runs the page on a virtual clock that jumps over the page's
// timers, and dumps or shoots once that much virtual time has passed; a fetch in flight holds
// the clock, however long it takes. 2000 ms is two of the dashboard's polls, so the DOM holds
// a full poll (without the flag chromium dumps the page as it loads, before any poll answered).
// --no-sandbox: chromium's sandbox refuses to run as root, and the page is our own.
// --ignore-certificate-errors: the queue on the namespaced hosts speaks TLS with the certificate
// it made, which no authority chromium knows signed (tests/queue_security_test.cpp checks that
// clients verify it).
// Its profile, crash reports and caches go to `home` (even with --user-data-dir it writes its
// crash reports under XDG_CONFIG_HOME), not into the user's.
// `timeout` bounds it: it kills chromium's whole process group, renderers included.
int run_chromium(const std::string& home, const std::string& mode, const std::string& url,
                 const std::string& out, const std::string& log) {
  const std::string command =
      "env XDG_CONFIG_HOME='" + home + "' XDG_CACHE_HOME='" + home + "' timeout -k 5 90 " +
      "chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --no-first-run " +
      "--ignore-certificate-errors " +
      "--user-data-dir='" + home + "/profile' --virtual-time-budget=2000 " + mode + " '" + url +
      "' >'" + out + "' 2>'" + log + "'";
  const int status = std::system(command.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// The text of an HTML fragment: its tags dropped and the entities that serialization makes
// (&amp; &lt; &gt; &quot;) put back.
std::string text_of(const std::string& html) {
  std::string text;
  bool in_tag = false;
  for (char c : html) {
    if (c == '<') in_tag = true;
    if (!in_tag) text += c;
    if (c == '>') in_tag = false;
  }
  for (const auto& [entity, plain] : std::vector<std::pair<std::string, std::string>>{
           {"&lt;", "<"}, {"&gt;", ">"}, {"&quot;", "\""}, {"&amp;", "&"}}) {
    for (auto at = text.find(entity); at != std::string::npos; at = text.find(entity, at + 1)) {
      text.replace(at, entity.size(), plain);
    }
  }
  return text;
}

// The element of `dom` whose id is `id`, from its start tag to its matching end tag ("" when
// there is none). Enough for the DOM chromium serializes: quoted attributes, no comments.
std::string element(const std::string& dom, const std::string& id) {
  const auto attribute = dom.find(" id=\"" + id + "\"");
  if (attribute == std::string::npos) return "";
  const auto start = dom.rfind('<', attribute);
  const std::string tag = dom.substr(start + 1, dom.find_first_of(" >", start) - start - 1);
  int depth = 0;
  for (auto at = start; at < dom.size(); ++at) {
    if (dom.compare(at, tag.size() + 2, "</" + tag) == 0) {
      if (--depth == 0) return dom.substr(start, dom.find('>', at) + 1 - start);
    } else if (dom.compare(at, tag.size() + 1, "<" + tag) == 0 &&
               (dom[at + tag.size() + 1] == ' ' || dom[at + tag.size() + 1] == '>')) {
      ++depth;
    }
  }
  return "";
}

// The text of the first cell of `row` whose class list starts with `cls`.
std::string cell(const std::string& row, const std::string& cls) {
  const auto at = row.find("<td class=\"" + cls);
  if (at == std::string::npos) return "";
  return text_of(row.substr(at, row.find("</td>", at) - at));
}

// The labels of a host's lanes, top to bottom.
std::vector<std::string> lane_labels(const std::string& host) {
  const std::string start = "class=\"lane-label\">";
  std::vector<std::string> labels;
  for (auto at = host.find(start); at != std::string::npos; at = host.find(start, at + 1)) {
    const auto from = at + start.size();
    labels.push_back(text_of(host.substr(from, host.find('<', from) - from)));
  }
  return labels;
}

struct Png {
  bool signature = false;
  uint32_t width = 0, height = 0;
};

// A PNG starts with its 8-byte signature and then the IHDR chunk: length, "IHDR", width and
// height as big-endian 32-bit integers.
Png read_png(const std::string& path) {
  const std::string bytes = read_text(path);
  Png png;
  png.signature = bytes.compare(0, 8, "\x89PNG\r\n\x1a\n") == 0 && bytes.size() > 24 &&
                  bytes.compare(12, 4, "IHDR") == 0;
  if (!png.signature) return png;
  auto be32 = [&](size_t at) {
    uint32_t value = 0;
    for (size_t i = 0; i < 4; ++i) value = value << 8 | static_cast<unsigned char>(bytes[at + i]);
    return value;
  };
  png.width = be32(16);
  png.height = be32(20);
  return png;
}

// Test 7 on the hosts of tests 1 and 2 (QueueMultiHost): two network namespaces of 2 slots, an
// agent on each, chromium on host A where the scheduler listens.
class QueueDashboard : public QueueOnTwoHosts {};

TEST_F(QueueDashboard, ShowsTheJobsTheirWorkersAndTheDecisionsOfAShrink) {
  if (!chromium_installed()) {
    GTEST_SKIP() << "chromium is not installed (scripts/setup.sh installs Debian's chromium)";
  }
  Queue& queue = start("dashboard", {"--cooldown", "8", "--grow-idle", "2"});
  ASSERT_FALSE(HasFailure());
  const int64_t low =
      queue.submit("--min 2 --max 4 --name low " + kWorker + " " + queue.dir() + "/low.out 16 80");
  ASSERT_TRUE(eventually([&] { return queue.staying(low).size() == 4; }, 60s))
      << queue.job(low).dump(1);
  const int64_t high = queue.submit("--priority 10 --min 2 --max 2 --name high " + kWorker + " " +
                                    queue.dir() + "/high.out 2 50");
  ASSERT_TRUE(eventually([&] { return queue.staying(low).size() == 2; }, 30s))
      << queue.job(low).dump(1);

  // What the scheduler decided: the shrink, in its own words.
  json shrink;
  for (const auto& e : json(queue.client().get("/events?since=0").at("events"))) {
    if (e.at("kind") == "shrink" && e.at("job") == low) shrink = e;
  }
  ASSERT_FALSE(shrink.is_null()) << queue.client().get("/events?since=0").dump(1);
  const std::string decision = shrink.at("message");
  EXPECT_NE(decision.find("job " + std::to_string(low) + " shrinks from 4 to 2 workers to make " +
                          "room for job " + std::to_string(high)),
            std::string::npos)
      << decision;

  // The page changes with the queue while chromium reads it: a job's state in the DOM must lie
  // between the states the scheduler reported just before and just after, on the way a job
  // goes here (nothing is preempted or fails).
  const std::vector<std::string> lifecycle = {"waiting", "running", "done"};
  auto step = [&](const std::string& state) {
    const auto at = std::find(lifecycle.begin(), lifecycle.end(), state);
    return static_cast<int>(at - lifecycle.begin());
  };
  std::map<int64_t, std::pair<std::string, std::string>> states;
  for (int64_t id : {low, high}) states[id].first = queue.state(id);
  const json nodes = queue.client().get("/nodes").at("nodes");
  std::vector<json> workers;
  for (int64_t id : {low, high}) {
    for (const auto& w : json(queue.job(id).at("worker_list"))) workers.push_back(w);
  }
  // The page opens as a user opens it (Note [Tokens out of URLs], src/queue/access.h): through
  // a one-time login code, which sets the session cookie that its requests carry.
  const auto login_url = [&] {
    return std::string(queue.tls() ? "https://" : "http://") + TwoHosts::kAddressA + ":" +
           std::to_string(queue.port()) +
           queue.client().post("/login/code", json::object()).at("path").get<std::string>();
  };
  const std::string url = login_url();
  const std::string home = queue.dir() + "/chromium";
  const auto started = Clock::now();
  const int dumped = run_chromium(home, "--dump-dom", url, queue.dir() + "/dom.html",
                                  queue.dir() + "/chromium-dom.log");
  const double dump_seconds = seconds_since(started);
  ASSERT_EQ(dumped, 0) << read_text(queue.dir() + "/chromium-dom.log");
  for (int64_t id : {low, high}) states[id].second = queue.state(id);
  const std::string dom = read_text(queue.dir() + "/dom.html");
  std::cout << "chromium read the page in " << dump_seconds << " s" << std::endl;

  ASSERT_NE(dom.find("<body data-polls=\""), std::string::npos)
      << "the page never drew a poll: " << dom;
  EXPECT_EQ(text_of(element(dom, "error")), "");

  const std::map<int64_t, std::string> names = {{low, "low"}, {high, "high"}};
  for (const auto& [id, name] : names) {
    const std::string row = element(dom, "job-" + std::to_string(id));
    ASSERT_FALSE(row.empty()) << "no row for job " << id << " in " << dom;
    EXPECT_EQ(cell(row, "id"), std::to_string(id));
    EXPECT_EQ(cell(row, "name"), name);
    // Its measured throughput beside the worker count it was measured at, once there is one.
    const std::string throughput = cell(row, "throughput");
    EXPECT_TRUE(std::regex_match(throughput, std::regex("-|[0-9]+ samples/s at [0-9]+ workers?")))
        << throughput;
    const auto& [before, after] = states[id];
    const std::string shown = cell(row, "state");
    EXPECT_TRUE(step(before) <= step(shown) && step(shown) <= step(after) &&
                step(after) < static_cast<int>(lifecycle.size()))
        << "job " << id << " shows as '" << shown << "'; the scheduler said '" << before
        << "' before and '" << after << "' after";
  }

  // Each host's section names its slots and has a bar for every worker the two jobs had there.
  ASSERT_EQ(nodes.size(), 2u) << nodes.dump(1);
  std::set<std::string> hosts_with_workers;
  for (const auto& node : nodes) {
    const std::string host_name = node.at("name");
    const std::string host = element(dom, "host-" + host_name);
    ASSERT_FALSE(host.empty()) << "no section for host " << host_name << " in " << dom;
    const std::string host_text = text_of(host);
    EXPECT_NE(host_text.find(host_name), std::string::npos) << host_text;
    EXPECT_EQ(node.at("capacity"), 2);
    // A lane per slot and no more: the high job's workers, which started on the slots of the low
    // job's leavers before these had gone (Note [Starting on leaving slots] in
    // src/queue/policy.cpp), take over their lanes rather than lanes "(over)" the capacity.
    const auto lanes = lane_labels(host);
    ASSERT_EQ(lanes.size(), 2u) << host;
    for (size_t k = 0; k < lanes.size(); ++k) EXPECT_EQ(lanes[k], "slot " + std::to_string(k + 1));
    for (const auto& w : workers) {
      if (w.at("host") != host_name) continue;
      hosts_with_workers.insert(host_name);
      const std::string bar = element(host, "worker-" + std::to_string(w.at("id").get<int64_t>()));
      EXPECT_NE(bar.find("data-job=\"" + std::to_string(w.at("job").get<int64_t>()) + "\""),
                std::string::npos)
          << "worker " << w.dump() << " has no bar of its job on " << host_name << ": " << bar;
    }
    // The shrink is marked on each host's timeline where it was decided.
    EXPECT_NE(host_text.find("shrink low"), std::string::npos) << host_text;
  }
  EXPECT_EQ(hosts_with_workers.size(), 2u) << "the low job's workers should span both hosts";

  // The decision, with its reason, as the scheduler wrote it.
  const std::string row = element(dom, "event-" + std::to_string(shrink.at("id").get<int64_t>()));
  ASSERT_FALSE(row.empty()) << "the shrink is not among the decisions: " << dom;
  EXPECT_NE(row.find("class=\"kind-shrink decision\""), std::string::npos) << row;
  EXPECT_EQ(cell(row, "message"), decision);
  EXPECT_EQ(cell(row, "kind"), "shrink");

  // The screenshot shows the whole story of test 1: taken once the high job is done and the low
  // one has grown back to 4 workers.
  EXPECT_TRUE(eventually([&] { return queue.state(high) == "done"; }, 60s))
      << queue.job(high).dump(1);
  EXPECT_TRUE(eventually([&] { return queue.staying(low).size() == 4; }, 60s))
      << queue.job(low).dump(1);
  const char* keep = std::getenv("SHOAL_DASHBOARD_SCREENSHOT");
  const std::string png = keep != nullptr && *keep != '\0' ? keep : queue.dir() + "/dashboard.png";
  ::unlink(png.c_str());
  const int shot =
      run_chromium(home, "--window-size=1280,900 --screenshot='" + png + "'", login_url(),
                   queue.dir() + "/chromium-shot.out", queue.dir() + "/chromium-shot.log");
  ASSERT_EQ(shot, 0) << read_text(queue.dir() + "/chromium-shot.log");
  const Png image = read_png(png);
  EXPECT_TRUE(image.signature) << png << " is not a PNG";
  EXPECT_EQ(image.width, 1280u);
  EXPECT_EQ(image.height, 900u);

  std::string out;
  EXPECT_EQ(queue.cli("cancel " + std::to_string(low), &out), 0) << out;
}

}  // namespace
}  // namespace shoal::testing
