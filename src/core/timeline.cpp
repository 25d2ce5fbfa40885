#include "shoal/core/timeline.h"

#include "core/timeline_start.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/file.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <thread>

#include "shoal/core/error.h"
#include "core/log.h"

namespace shoal::timeline {
namespace detail {
std::atomic<bool> recording{false};
}

namespace {

// Note [One timeline file for the whole job]
// Every worker of the job writes the same file. Each one appends its events in chunks (when
// kChunk events wait, from the recording thread; every kFlushPeriod, from a thread of its own;
// and at its end) under an exclusive flock, each event on a line of its own that starts with
// ",", so the file is always a JSON array missing only its closing "]" (which the trace-event
// format allows). Its second line is a header naming the job: a worker that finds another job's
// header (an earlier run) or none truncates the file and writes its own, one that finds its own
// job's appends. Chunks, rather than one write at exit, keep memory bounded, and a worker that is
// killed (a launcher stopping the job with SIGTERM, which no handler of ours could safely write
// from) loses only its last period: the moments before a failure are what a trace is read for.
constexpr size_t kChunk = 4096;
constexpr auto kFlushPeriod = std::chrono::milliseconds(250);
constexpr int64_t kDefaultMaxEvents = 200000;
constexpr auto kLockTimeout = std::chrono::seconds(10);
// Async slices are drawn on pseudo-threads with these ids, above any Linux thread id (pid_max is
// at most 2^22).
constexpr int kLaneTid = 100000000;

int64_t now_ns() {
  // CLOCK_MONOTONIC is one clock for every process of a host, so workers' slices line up.
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return int64_t{t.tv_sec} * 1000000000 + t.tv_nsec;
}

struct Event {
  std::string name;
  const char* category;
  char phase;  // 'X' complete, 'i' instant
  int tid;
  int64_t start_ns;
  int64_t duration_ns;
  std::vector<std::pair<const char*, int64_t>> args;
};

void append_escaped(std::string& out, const std::string& text) {
  for (char c : text) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char code[8];
          std::snprintf(code, sizeof(code), "\\u%04x", c);
          out += code;
        } else {
          out += c;
        }
    }
  }
}

void append_us(std::string& out, int64_t ns) {
  char text[32];
  std::snprintf(text, sizeof(text), "%lld.%03lld", static_cast<long long>(ns / 1000),
                static_cast<long long>(ns % 1000));
  out += text;
}

std::string quoted(const std::string& text) {
  std::string out = "\"";
  append_escaped(out, text);
  return out + "\"";
}

// The header is the writing worker's own metadata event (an unknown one, which viewers ignore;
// a pid of its own would make them draw an empty process). Only its job is compared.
constexpr const char* kHeaderStart = "[\n{\"name\":\"shoal_timeline\",\"ph\":\"M\",\"pid\":";

std::string header_job_part(const std::string& job) {
  return ",\"args\":{\"job\":" + quoted(job) + "}}\n";
}

std::string header(const std::string& job, int pid) {
  return kHeaderStart + std::to_string(pid) + ",\"tid\":" + std::to_string(pid) +
         header_job_part(job);
}

// Whether `start` (the file's first bytes) begins with the header of `job`.
bool has_header(const std::string& start, const std::string& job) {
  if (start.rfind(kHeaderStart, 0) != 0) return false;
  const auto line_end = start.find('\n', 2);
  if (line_end == std::string::npos) return false;
  const std::string line = start.substr(0, line_end + 1);
  const std::string ending = header_job_part(job);
  return line.size() >= ending.size() &&
         line.compare(line.size() - ending.size(), ending.size(), ending) == 0;
}

std::string host_name() {
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  return host;
}

struct ThreadId {
  int tid = 0;
  bool known = false;
};
thread_local ThreadId this_thread;
thread_local bool in_flush = false;

class Recorder {
 public:
  static Recorder& get() {
    static Recorder* recorder = new Recorder;  // never destroyed: flushed at exit
    return *recorder;
  }

  void start(const env::Environment& env, int rank, const std::optional<std::string>& job,
             const char* role) {
    const auto path = env::get(env, "SHOAL_TIMELINE");
    if (!path || path->empty()) return;
    const auto cap = env::get_int(env, "SHOAL_TIMELINE_MAX_EVENTS", 1);
    const int fd = ::open(path->c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) {
      throw UsageError("SHOAL_TIMELINE=" + *path + ": cannot write the timeline there (" +
                       std::strerror(errno) + "); expected a path to a writable file");
    }
    ::close(fd);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      path_ = *path;
      rank_ = rank;
      role_ = role;
      metadata_changed_ = true;
      max_events_ = cap.value_or(kDefaultMaxEvents);
      host_ = host_name();
      if (job) set_job_locked(*job);
    }
    static std::once_flag hooks;
    std::call_once(hooks, [] {
      std::thread([] {
        for (;;) {
          std::this_thread::sleep_for(kFlushPeriod);
          timeline::flush();
        }
      }).detach();
      std::atexit([] { timeline::flush(); });
      previous_terminate_ = std::set_terminate([] {
        timeline::flush();
        if (previous_terminate_) previous_terminate_();
        std::abort();
      });
    });
    detail::recording.store(true, std::memory_order_relaxed);
  }

  void set_job(const std::string& job) {
    std::lock_guard<std::mutex> lock(mutex_);
    set_job_locked(job);
  }

  void set_rank(int rank) {
    std::lock_guard<std::mutex> lock(mutex_);
    rank_ = rank;
    metadata_changed_ = true;
  }

  int thread_id() {
    if (!this_thread.known) {
      this_thread.tid = static_cast<int>(::syscall(SYS_gettid));
      this_thread.known = true;
      char name[64] = {};
      std::string label;
      if (this_thread.tid == ::getpid()) {
        label = "main";
      } else if (pthread_getname_np(pthread_self(), name, sizeof(name)) == 0 && name[0]) {
        label = name;
      } else {
        label = "thread " + std::to_string(this_thread.tid);
      }
      std::lock_guard<std::mutex> lock(mutex_);
      threads_[this_thread.tid] = label;
      metadata_changed_ = true;
    }
    return this_thread.tid;
  }

  int take_lane() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (size_t i = 0; i < lanes_.size(); ++i) {
      if (!lanes_[i]) {
        lanes_[i] = true;
        return static_cast<int>(i);
      }
    }
    lanes_.push_back(true);
    metadata_changed_ = true;
    return static_cast<int>(lanes_.size() - 1);
  }

  void record(Event event, int release_lane = -1) {
    bool flush_now = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (release_lane >= 0) lanes_[release_lane] = false;
      if (written_ + static_cast<int64_t>(buffer_.size()) >= max_events_) {
        if (dropped_++ == 0) {
          log::warn("shoal timeline: worker " + std::to_string(rank_) +
                    " reached SHOAL_TIMELINE_MAX_EVENTS=" + std::to_string(max_events_) +
                    "; later events are dropped");
        }
        return;
      }
      buffer_.push_back(std::move(event));
      flush_now = job_known_ && buffer_.size() >= kChunk;
    }
    if (flush_now) flush();
  }

  void flush() {
    if (in_flush) return;  // std::terminate from inside a flush
    in_flush = true;
    std::lock_guard<std::mutex> writing(write_mutex_);
    std::string text;
    std::string job;
    bool check_header = false;
    std::string path;
    int rank = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (path_.empty() || !job_known_ || (buffer_.empty() && dropped_ == written_dropped_)) {
        in_flush = false;
        return;
      }
      path = path_;
      rank = rank_;
      job = job_;
      check_header = !header_checked_;
      // Names and sort order only when they changed (a new thread or comm track, a new rank),
      // and with the first chunk; a failed write sends them again.
      if (metadata_changed_ || check_header) text = metadata_locked();
      metadata_changed_ = false;
      for (const Event& event : buffer_) append_event(text, event);
      written_ += static_cast<int64_t>(buffer_.size());
      buffer_.clear();
      if (dropped_ != written_dropped_) {
        // Each notice counts the events dropped since the previous one.
        const int64_t dropped = dropped_ - written_dropped_;
        Event notice{"timeline full: " + std::to_string(dropped) + " events dropped",
                     "shoal",
                     'i',
                     pid_,
                     now_ns(),
                     0,
                     {{"dropped", dropped}}};
        append_event(text, notice);
        written_dropped_ = dropped_;
      }
    }
    const std::string error = write(path, check_header ? &job : nullptr, text);
    if (error.empty()) {
      std::lock_guard<std::mutex> lock(mutex_);
      header_checked_ = true;
    } else {
      std::lock_guard<std::mutex> lock(mutex_);
      metadata_changed_ = true;
    }
    if (!error.empty() && !warned_write_) {
      warned_write_ = true;
      log::warn("shoal timeline: " + error + "; events of worker " + std::to_string(rank) +
                " are lost");
    }
    in_flush = false;
  }

 private:
  void set_job_locked(const std::string& job) {
    // A run of this process alone: a name no other run has.
    job_ = !job.empty()
               ? job
               : "process " + std::to_string(pid_) + " on " + host_name() + " at " +
                     std::to_string(std::chrono::system_clock::now().time_since_epoch().count());
    job_known_ = true;
  }

  std::string metadata_locked() const {
    std::string text;
    auto meta = [&](const char* name, int tid, const std::string& args) {
      text += ",{\"name\":\"";
      text += name;
      text += "\",\"ph\":\"M\",\"pid\":" + std::to_string(pid_) +
              ",\"tid\":" + std::to_string(tid) + ",\"args\":{" + args + "}}\n";
    };
    meta("process_name", pid_,
         "\"name\":" + quoted(role_ + " " + std::to_string(rank_) + " (pid " +
                              std::to_string(pid_) + " on " + host_ + ")"));
    meta("process_sort_index", pid_,
         "\"sort_index\":" + std::to_string(role_ == "worker" ? rank_ : 1000 + rank_));
    for (const auto& [tid, name] : threads_) {
      meta("thread_name", tid, "\"name\":" + quoted(name));
      meta("thread_sort_index", tid, "\"sort_index\":" + std::to_string(tid == pid_ ? 0 : 1));
    }
    for (size_t lane = 0; lane < lanes_.size(); ++lane) {
      const int tid = kLaneTid + static_cast<int>(lane);
      meta("thread_name", tid, "\"name\":\"comm " + std::to_string(lane) + "\"");
      meta("thread_sort_index", tid, "\"sort_index\":" + std::to_string(2 + lane));
    }
    return text;
  }

  void append_event(std::string& text, const Event& event) const {
    text += ",{\"name\":";
    text += quoted(event.name);
    text += ",\"cat\":\"";
    text += event.category;
    text += "\",\"ph\":\"";
    text += event.phase;
    text += "\",\"ts\":";
    append_us(text, event.start_ns);
    if (event.phase == 'X') {
      text += ",\"dur\":";
      append_us(text, event.duration_ns);
    } else {
      text += ",\"s\":\"t\"";
    }
    text += ",\"pid\":" + std::to_string(pid_) + ",\"tid\":" + std::to_string(event.tid);
    if (!event.args.empty()) {
      text += ",\"args\":{";
      for (size_t i = 0; i < event.args.size(); ++i) {
        text += i ? ",\"" : "\"";
        text += event.args[i].first;
        text += "\":" + std::to_string(event.args[i].second);
      }
      text += "}";
    }
    text += "}\n";
  }

  // Appends `text` under the file's lock; with `job`, first replaces a file that does not start
  // with that job's header. Returns what went wrong, or "".
  static std::string write(const std::string& path, const std::string* job,
                           const std::string& text) {
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) return "cannot open " + path + " (" + std::strerror(errno) + ")";
    std::string error;
    const auto deadline = std::chrono::steady_clock::now() + kLockTimeout;
    while (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      if (errno != EWOULDBLOCK && errno != EINTR) {
        error = "cannot lock " + path + " (" + std::strerror(errno) + ")";
        break;
      }
      if (std::chrono::steady_clock::now() >= deadline) {
        error = "timed out after 10 s waiting for the lock of " + path;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    if (error.empty() && job) {
      std::string start(4096, '\0');
      const ssize_t n = ::pread(fd, start.data(), start.size(), 0);
      start.resize(n > 0 ? static_cast<size_t>(n) : 0);
      if (!has_header(start, *job)) {
        if (::ftruncate(fd, 0) != 0 || !write_all(fd, header(*job, ::getpid()))) {
          error = "cannot write " + path + " (" + std::strerror(errno) + ")";
        }
      }
    }
    if (error.empty()) {
      if (::lseek(fd, 0, SEEK_END) < 0 || !write_all(fd, text)) {
        error = "cannot write " + path + " (" + std::strerror(errno) + ")";
      }
    }
    ::flock(fd, LOCK_UN);
    ::close(fd);
    return error;
  }

  static bool write_all(int fd, const std::string& text) {
    size_t done = 0;
    while (done < text.size()) {
      const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      done += static_cast<size_t>(n);
    }
    return true;
  }

  std::mutex mutex_;  // guards what follows, up to write_mutex_
  std::string path_;
  int rank_ = 0;
  std::string role_ = "worker";
  const int pid_ = ::getpid();
  std::string host_;
  std::string job_;
  bool job_known_ = false;
  bool header_checked_ = false;
  bool metadata_changed_ = false;
  int64_t max_events_ = kDefaultMaxEvents;
  int64_t written_ = 0;
  int64_t dropped_ = 0;
  int64_t written_dropped_ = 0;
  std::vector<Event> buffer_;
  std::map<int, std::string> threads_;
  std::vector<bool> lanes_;  // true while an AsyncSlice is drawn on it
  std::mutex write_mutex_;   // one writer at a time in this process
  bool warned_write_ = false;
  static std::terminate_handler previous_terminate_;
};

std::terminate_handler Recorder::previous_terminate_ = nullptr;

}  // namespace

Slice::Slice(std::string name, const char* category, Args args) {
  if (!enabled()) return;
  name_ = std::move(name);
  category_ = category;
  args_.assign(args.begin(), args.end());
  start_ns_ = now_ns();
}

Slice::~Slice() {
  if (start_ns_ < 0) return;
  Recorder& recorder = Recorder::get();
  const int64_t end = now_ns();
  recorder.record(Event{std::move(name_), category_, 'X', recorder.thread_id(), start_ns_,
                        end - start_ns_, std::move(args_)});
}

AsyncSlice::AsyncSlice(std::string name, const char* category, Args args) {
  if (!enabled()) return;
  name_ = std::move(name);
  category_ = category;
  args_.assign(args.begin(), args.end());
  lane_ = Recorder::get().take_lane();
  start_ns_ = now_ns();
}

AsyncSlice::~AsyncSlice() {
  end();
}

AsyncSlice::AsyncSlice(AsyncSlice&& other) noexcept
    : start_ns_(other.start_ns_),
      lane_(other.lane_),
      name_(std::move(other.name_)),
      category_(other.category_),
      args_(std::move(other.args_)) {
  other.start_ns_ = -1;
}

AsyncSlice& AsyncSlice::operator=(AsyncSlice&& other) noexcept {
  if (this != &other) {
    end();
    start_ns_ = other.start_ns_;
    lane_ = other.lane_;
    name_ = std::move(other.name_);
    category_ = other.category_;
    args_ = std::move(other.args_);
    other.start_ns_ = -1;
  }
  return *this;
}

void AsyncSlice::rename(std::string name) {
  if (start_ns_ >= 0) name_ = std::move(name);
}

void AsyncSlice::end() {
  if (start_ns_ < 0) return;
  const int64_t end = now_ns();
  Recorder::get().record(Event{std::move(name_), category_, 'X', kLaneTid + lane_, start_ns_,
                               end - start_ns_, std::move(args_)},
                         lane_);
  start_ns_ = -1;
}

void start(const env::Environment& env, int rank, const std::optional<std::string>& job,
           const char* role) {
  Recorder::get().start(env, rank, job, role);
}

void set_job(const std::string& job) {
  Recorder::get().set_job(job);
}

void set_rank(int rank) {
  Recorder::get().set_rank(rank);
}

void flush() {
  if (!enabled()) return;
  Recorder::get().flush();
}

}  // namespace shoal::timeline
