#include "output.h"

#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace shoal::launch {

void Sink::write(const std::string& text) {
  size_t done = 0;
  while (!broken_ && done < text.size()) {
    ssize_t wrote = ::write(fd_, text.data() + done, text.size() - done);
    if (wrote > 0) {
      done += static_cast<size_t>(wrote);
    } else if (wrote < 0 && errno == EINTR) {
      continue;
    } else if (wrote < 0 && errno == EAGAIN) {
      // Someone made our stdout non-blocking (a shared terminal). Wait for room, but not forever:
      // a reader that stops reading for a minute loses output rather than stalling the job.
      pollfd entry{fd_, POLLOUT, 0};
      if (::poll(&entry, 1, 60 * 1000) <= 0) broken_ = true;
    } else {
      broken_ = true;
    }
  }
}

void LineForwarder::append_line(const char* begin, size_t size) {
  batch_ += prefix_;
  batch_.append(begin, size);
  batch_ += '\n';
}

void LineForwarder::feed(const char* data, size_t size) {
  batch_.clear();
  const char* end = data + size;
  const char* cursor = data;
  while (cursor < end) {
    const char* newline = static_cast<const char*>(std::memchr(cursor, '\n', end - cursor));
    if (newline == nullptr) {
      partial_.append(cursor, end - cursor);
      break;
    }
    if (partial_.empty()) {
      append_line(cursor, newline - cursor);
    } else {
      partial_.append(cursor, newline - cursor);
      append_line(partial_.data(), partial_.size());
      partial_.clear();
    }
    cursor = newline + 1;
  }
  while (partial_.size() >= kMaxLine) {
    append_line(partial_.data(), kMaxLine);
    partial_.erase(0, kMaxLine);
  }
  if (!batch_.empty()) sink_->write(batch_);
}

void LineForwarder::finish() {
  if (partial_.empty()) return;
  batch_.clear();
  append_line(partial_.data(), partial_.size());
  partial_.clear();
  sink_->write(batch_);
}

bool pump(const proc::Fd& pipe, LineForwarder& forwarder, int max_reads) {
  char buffer[64 * 1024];
  for (int i = 0; i < max_reads; ++i) {
    ssize_t got = ::read(pipe.get(), buffer, sizeof(buffer));
    if (got > 0) {
      forwarder.feed(buffer, static_cast<size_t>(got));
      continue;
    }
    if (got < 0 && errno == EINTR) continue;
    if (got < 0 && errno == EAGAIN) return true;
    return false;  // EOF, or an error that will not go away
  }
  return true;
}

}  // namespace shoal::launch
