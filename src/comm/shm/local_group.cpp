#include "comm/shm/local_group.h"

#include <sched.h>
#include <unistd.h>

#include <cstdlib>

#include <algorithm>
#include <cstring>

#include "shoal/core/error.h"

namespace shoal::comm::shm {
namespace {

using Bytes = unsigned char;

// Note [Taking chunks]: a chunk is at least kChunkBytes (a taking, one compare-and-swap on a line
// the members share, costs well under a microsecond; reducing 64 KiB of two members' tensors took
// about 10 us in bench/ddp's CNN), and a call has at most kMaxChunks (so a large buffer's takings
// stay few, and the members still end within one chunk of each other).
constexpr size_t kChunkBytes = 64 * 1024;
constexpr size_t kMaxChunks = 64;

size_t max_of(const std::vector<size_t>& v) {
  return v.empty() ? 0 : *std::max_element(v.begin(), v.end());
}

size_t ceil_div(size_t a, size_t b) {
  return (a + b - 1) / b;
}

// Elements of a part of n elements that piece t carries, at most l per piece.
size_t in_piece(size_t n, size_t t, size_t l) {
  return n > t * l ? std::min(l, n - t * l) : 0;
}

std::vector<size_t> offsets_of(const std::vector<size_t>& counts) {
  std::vector<size_t> offsets(counts.size(), 0);
  for (size_t m = 1; m < counts.size(); ++m) offsets[m] = offsets[m - 1] + counts[m - 1];
  return offsets;
}

// comm::split_sizes's rule: the first n % k parts one element more.
std::vector<size_t> even_split(size_t n, int k) {
  std::vector<size_t> counts(k, n / k);
  for (size_t m = 0; m < n % k; ++m) ++counts[m];
  return counts;
}

// Note [Spinning]: a member waiting for another that runs on another core sees it arrive within
// microseconds, sooner than a futex sleep and wake take (~10-50 us); but when the members
// outnumber the cores this process may run on, the awaited member is likely waiting for this
// one's core, and spinning only delays it: then a wait sleeps almost at once. The counts are
// checks with a pause between them (tens of ns each); SHOAL_SHM_SPINS overrides them.
int spins_for(int members) {
  if (const char* env = std::getenv("SHOAL_SHM_SPINS"); env != nullptr && *env != '\0') {
    return std::atoi(env);
  }
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  const int cores = sched_getaffinity(0, sizeof(cpus), &cpus) == 0 ? CPU_COUNT(&cpus) : 1;
  return members <= cores ? 4000 : 50;
}

}  // namespace

LocalGroup::LocalGroup(Segment segment, int rank, Duration timeout)
    : segment_(std::move(segment)), rank_(rank), size_(segment_.size()), timeout_(timeout) {
  if (rank < 0 || rank >= size_) {
    throw UsageError("shared memory: member " + std::to_string(rank) + " of a group of " +
                     std::to_string(size_) + ", expected 0.." + std::to_string(size_ - 1));
  }
  MemberBlock* me = segment_.member(rank_);
  uint32_t free = 0;
  if (!me->attached.compare_exchange_strong(free, 1)) {
    throw CommError("shared memory: member " + std::to_string(rank_) +
                    " has joined the segment already (pid " + std::to_string(me->pid) +
                    "): two processes were given the same member index");
  }
  spins_ = spins_for(size_);
  me->pid = ::getpid();
  me->start_time = process_start_time(me->pid);
  run("join", [&] {
    arrive();  // publishes pid and start time: readers wait for the counter, then read them
    const WaitScope s = scope("join", timeout_);
    for (int m = 0; m < size_; ++m) {
      if (m == rank_) continue;
      wait_member(m, seq_, s);
      liveness_.watch(m, segment_.member(m)->pid, segment_.member(m)->start_time);
    }
  });
}

WaitScope LocalGroup::scope(const char* operation, Duration timeout, int watch) const {
  return {&segment_, &liveness_, rank_,  operation, Deadline(timeout.count() >= 0 ? timeout : timeout_),
          watch,     spins_,     &cancelled_};
}

template <typename Body>
void LocalGroup::run(const char* operation, Body&& body) {
  if (!broken_.empty()) {
    throw CommError(std::string("shared-memory ") + operation +
                    ": the group is broken by an earlier error: " + broken_);
  }
  try {
    body();
  } catch (const CommError& e) {
    broken_ = e.what();
    // Tell the others at once, unless one did first: -1 holds the place while the text is written.
    // What failed first elsewhere is not this member's to tell again.
    auto* wait = dynamic_cast<const WaitFailed*>(&e);
    SegmentHeader* h = segment_.header();
    int32_t none = 0;
    if ((wait == nullptr || wait->first < 0) && h->failed.compare_exchange_strong(none, -1)) {
      h->failure_kind = static_cast<int32_t>(wait ? wait->kind : FailureKind::kOther);
      h->failure_member = wait ? wait->member : -1;
      std::snprintf(h->failure, sizeof(h->failure), "%s", e.what());
      h->failed.store(rank_ + 1, std::memory_order_release);
    }
    throw;
  }
}

void LocalGroup::arrive() {
  advance(segment_.member(rank_)->seq, ++seq_);
}

void LocalGroup::wait_member(int m, uint32_t target, const WaitScope& s) {
  wait_for(segment_.member(m)->seq, target, m, s);
}

void LocalGroup::wait_all(uint32_t target, const WaitScope& s) {
  for (int m = 0; m < size_; ++m) {
    if (m != rank_) wait_member(m, target, s);
  }
}

// Note [Phases], continued: a member's arrivals are in program order, so its next arrival after
// its last phase on a piece (in the next piece, the next operation, or a barrier) tells that it
// has also finished what it did after that phase: the copies out of the piece's buffer. No phase
// is spent on saying "done copying"; the buffer is free once every member has arrived once more.
void LocalGroup::free_after(int b) {
  free_at_[b] = seq_ + 1;
}

int LocalGroup::next_buffer(const WaitScope& s) {
  const int b = buffer_;
  wait_all(free_at_[b], s);
  buffer_ ^= 1;
  return b;
}

// Note [All-reduce]: the buffer is cut into k blocks (comm::split_sizes), member r owning block r.
// Piece t carries elements [t*l, (t+1)*l) of every block, where l fills a slot with k ranges.
// Phase 1: each member copies its ranges of the blocks of others into its slot (not its own block,
// which only it reads: that is read straight from its buffer). Phase 2: member r reduces range r
// over the k members (Note [Fixed summation order]) and writes the result once into its buffer
// and once into the unused range r of its own slot. Phase 3: each member copies the other blocks'
// results out of their owners' slots. A member thus moves 2(k-1)/k of the buffer through shared
// memory, reads the k inputs of 1/k of it once and writes results once, the least a copy-based
// scheme can do, with two synchronisations per piece. The next piece uses the other buffer, so that
// a member starts publishing it while slower ones still copy results out of this one; a buffer is
// reused only once every member is past its last use of it (free_after). reduce_scatter is
// phases 1 and 2 with the caller's blocks, with one synchronisation per piece.
void LocalGroup::reduce_blocks(const char* operation, const void* in,
                               const std::vector<size_t>& counts, DType dtype, ReduceOp op,
                               void* out, bool gather, Duration timeout, Check* check) {
  const size_t e = dtype_size(dtype);
  const int k = size_;
  const std::vector<size_t> offsets = offsets_of(counts);
  const size_t l = segment_.slot_bytes() / (k * e);
  const size_t rounds = ceil_div(max_of(counts), l);
  const Bytes* input = static_cast<const Bytes*>(in);
  Bytes* output = static_cast<Bytes*>(out);
  const WaitScope s = scope(operation, timeout);
  std::vector<const void*> inputs(k);
  for (size_t t = 0; t < rounds; ++t) {
    const int b = next_buffer(s);
    Bytes* mine = segment_.slot(b, rank_);
    for (int m = 0; m < k; ++m) {
      if (m == rank_) continue;
      std::memcpy(mine + m * l * e, input + (offsets[m] + t * l) * e,
                  in_piece(counts[m], t, l) * e);
    }
    arrive();
    wait_all(seq_, s);
    if (check != nullptr && t == 0) {
      check->mismatch = compare_calls(check->half);
      if (!check->mismatch.empty()) return;
    }
    for (int j = 0; j < k; ++j) {
      inputs[j] =
          j == rank_ ? input + (offsets[rank_] + t * l) * e : segment_.slot(b, j) + rank_ * l * e;
    }
    void* results[2] = {gather ? output + (offsets[rank_] + t * l) * e : output + t * l * e,
                        mine + rank_ * l * e};
    reduce(dtype, op, inputs.data(), k, in_piece(counts[rank_], t, l), results, gather ? 2 : 1);
    if (gather) {
      arrive();
      const uint32_t reduced = seq_;
      for (int j = 0; j < k; ++j) {
        if (j == rank_) continue;
        wait_member(j, reduced, s);
        std::memcpy(output + (offsets[j] + t * l) * e, segment_.slot(b, j) + j * l * e,
                    in_piece(counts[j], t, l) * e);
      }
    }
    free_after(b);
  }
}

// Note [Checking a call]: an all_reduce publishes in the table, before its first synchronisation,
// what it was given: the shared buffer it lies in (-1: none) and where, the count, dtype and op.
// After that synchronisation every member compares every row with member 0's, so members that
// disagree all raise the same UsageError with their counters level (the group stays usable), where
// they would otherwise wait for a number of pieces that never comes, or reduce in place over
// memory that is not the others' tensor. Five values in the table cost no synchronisation.
void LocalGroup::all_reduce(void* data, size_t count, DType dtype, ReduceOp op, Duration timeout) {
  if (size_ == 1 || count == 0) return;
  const SharedBuffer* buffer = find_shared(data, count * dtype_size(dtype));
  const size_t offset =
      buffer ? static_cast<size_t>(static_cast<Bytes*>(data) - buffer->bases[rank_]) : 0;
  Check check{0, {}};
  run("all_reduce", [&] {
    check.half = publish({buffer ? buffer->id : -1, static_cast<int64_t>(offset),
                          static_cast<int64_t>(count), static_cast<int64_t>(dtype),
                          static_cast<int64_t>(op)});
    if (buffer == nullptr) {
      reduce_blocks("all_reduce", data, even_split(count, size_), dtype, op, data, true, timeout,
                    &check);
      return;
    }
    const WaitScope s = scope("all_reduce", timeout);
    arrive();
    wait_all(seq_, s);
    check.mismatch = compare_calls(check.half);
    if (check.mismatch.empty()) reduce_in_place(*buffer, offset, count, dtype, op, s);
  });
  if (!check.mismatch.empty()) throw UsageError("shared-memory all_reduce: " + check.mismatch);
}

// Note [All-reduce in shared buffers]: when every member's tensor lies at the same offset of its
// shared buffer (Note [Shared buffers] in segment.h), each element is read where it lies in every
// member's tensor, reduced, and written into all of them: nothing passes through the slots, and
// against Note [All-reduce]'s copies a member moves half the bytes, in one piece with two
// synchronisations. The first (in all_reduce) says every input is complete, the second that every
// result is written everywhere, so no member touches another's memory once it has returned. Which
// member reduces an element changes nothing in its result (Note [Fixed summation order]): the
// results are those of the copying path, bit for bit.
//
// Note [Taking chunks]: the elements are cut into chunks (kChunkBytes, kMaxChunks), and after the
// first synchronisation every member takes chunks from a counter in the segment's header until none
// is left. The members awake share the work; one still asleep (the earlier arrivers sleep on the
// futex once their spin ends: Note [Spinning]) finds it done when it wakes, instead of making the
// last arriver wait for its wake-up (tens of microseconds) and for its share. For a small buffer,
// such as a bucket of a small model, the last arriver so reduces it alone and returns as soon as
// it has, as from a barrier. The counter's high half names the call (the phase of its first
// synchronisation, the same on every member), so a call starts at chunk 0 without being reset;
// no member takes a chunk of the next call before every member is past this one's second
// synchronisation.
void LocalGroup::reduce_in_place(const SharedBuffer& buffer, size_t offset, size_t count,
                                 DType dtype, ReduceOp op, const WaitScope& s) {
  const size_t e = dtype_size(dtype);
  const size_t per_chunk = std::max(kChunkBytes / e, ceil_div(count, kMaxChunks));
  const uint64_t chunks = ceil_div(count, per_chunk);
  const uint64_t call = static_cast<uint64_t>(seq_) << 32;
  std::atomic<uint64_t>& next = segment_.header()->next_chunk;
  std::vector<void*> chunk_at(size_);  // every member's chunk: read, then written with the result
  for (;;) {
    uint64_t seen = next.load(std::memory_order_relaxed);
    uint64_t chunk = 0;
    do {
      chunk = (seen >> 32) == (call >> 32) ? (seen & 0xffffffffu) : 0;
    } while (chunk < chunks &&
             !next.compare_exchange_weak(seen, call | (chunk + 1), std::memory_order_relaxed));
    if (chunk >= chunks) break;
    const size_t first = chunk * per_chunk;
    for (int m = 0; m < size_; ++m) chunk_at[m] = buffer.bases[m] + offset + first * e;
    reduce(dtype, op, chunk_at.data(), size_, std::min(per_chunk, count - first), chunk_at.data(),
           size_);
  }
  arrive();
  wait_all(seq_, s);
}

const LocalGroup::SharedBuffer* LocalGroup::find_shared(const void* data, size_t bytes) const {
  const auto* start = static_cast<const Bytes*>(data);
  for (const SharedBuffer& buffer : shared_) {
    const Bytes* mine = buffer.bases[rank_];
    if (start >= mine && start + bytes <= mine + buffer.bytes && !buffer.mine.expired())
      return &buffer;
  }
  return nullptr;
}

int64_t* LocalGroup::next_row(size_t& half) {
  half = table_half_;
  table_half_ ^= 1;
  return segment_.published(rank_) + half * (2 * size_ + 2);
}

size_t LocalGroup::publish(std::initializer_list<int64_t> values) {
  size_t half = 0;
  std::copy(values.begin(), values.end(), next_row(half));
  return half;
}

const int64_t* LocalGroup::published(int m, size_t half) const {
  return segment_.published(m) + half * (2 * size_ + 2);
}

std::string LocalGroup::compare_calls(size_t half) const {
  auto describe = [](const int64_t* call) {
    std::string text = std::to_string(call[2]) + " " + dtype_name(static_cast<DType>(call[3])) +
                       " to " + op_name(static_cast<ReduceOp>(call[4]));
    if (call[0] < 0) return text + " in memory of its own";
    return text + " at byte " + std::to_string(call[1]) + " of shared buffer " +
           std::to_string(call[0]);
  };
  const int64_t* first = published(0, half);
  for (int m = 1; m < size_; ++m) {
    const int64_t* call = published(m, half);
    if (!std::equal(call, call + 5, first)) {
      return "member " + std::to_string(m) + " passed " + describe(call) + ", member 0 " +
             describe(first) +
             "; every member must pass the same count, dtype and op, in memory of its own or at "
             "the same place of the same shared buffer";
    }
  }
  return {};
}

// Note [Shared buffers], continued: each member makes its memfd and publishes its fd; once all have
// (first synchronisation) each maps the others' through /proc and says whether it could; once all
// have said so (second), each closes its fd, the mappings keeping the memory. A buffer that some
// member could not make or map is dropped by all, who then agree on null. Buffers whose owner here
// has let go are forgotten (their others unmapped) at the next allocation: an all_reduce on them
// can no longer agree (Note [Checking a call]).
std::shared_ptr<unsigned char> LocalGroup::allocate(size_t bytes, Duration timeout) {
  if (bytes == 0) throw UsageError("shared-memory allocate: 0 bytes, expected at least 1");
  if (size_ == 1) return nullptr;
  shared_.erase(std::remove_if(shared_.begin(), shared_.end(),
                               [](const SharedBuffer& b) { return b.mine.expired(); }),
                shared_.end());
  std::shared_ptr<unsigned char> result;
  std::string mismatch;
  run("allocate", [&] {
    const WaitScope s = scope("allocate", timeout);
    const int64_t id = next_shared_id_++;
    const std::string name = segment_.buffer_name(id);
    Mapping mine;
    try {
      mine = Mapping::create(name, bytes);
    } catch (const CommError&) {
      // Not this group's failure: the members agree below to go without.
    }
    size_t half = publish({static_cast<int64_t>(bytes), mine.fd()});
    arrive();
    wait_all(seq_, s);
    bool usable = true;
    for (int m = 0; m < size_; ++m) {
      const int64_t* row = published(m, half);
      if (row[0] != published(0, half)[0]) {
        mismatch = "member " + std::to_string(m) + " asked for " + std::to_string(row[0]) +
                   " bytes, member 0 for " + std::to_string(published(0, half)[0]);
        return;
      }
      usable = usable && row[1] >= 0;
    }
    SharedBuffer buffer;
    buffer.id = id;
    buffer.bytes = bytes;
    buffer.bases.assign(size_, nullptr);
    for (int m = 0; m < size_ && usable; ++m) {
      if (m == rank_) continue;
      try {
        buffer.others.push_back(Mapping::open(
            segment_.member(m)->pid, static_cast<int>(published(m, half)[1]), name, bytes));
        buffer.bases[m] = buffer.others.back().data();
      } catch (const CommError&) {
        usable = false;
      }
    }
    half = publish({usable ? 1 : 0});
    arrive();
    wait_all(seq_, s);
    for (int m = 0; m < size_; ++m) usable = usable && published(m, half)[0] == 1;
    if (!usable) return;
    mine.close_fd();
    auto owner = std::make_shared<Mapping>(std::move(mine));
    result = std::shared_ptr<unsigned char>(owner, owner->data());
    buffer.bases[rank_] = owner->data();
    buffer.mine = result;
    shared_.push_back(std::move(buffer));
  });
  if (!mismatch.empty()) throw UsageError("shared-memory allocate: " + mismatch);
  return result;
}

void LocalGroup::reduce_scatter(const void* in, void* out, const std::vector<size_t>& counts,
                                DType dtype, ReduceOp op, Duration timeout) {
  if (counts.size() != static_cast<size_t>(size_)) {
    throw UsageError("shared-memory reduce_scatter: " + std::to_string(counts.size()) +
                     " counts for a group of " + std::to_string(size_));
  }
  if (size_ == 1) {
    if (in != out) std::memmove(out, in, counts[0] * dtype_size(dtype));
    return;
  }
  run("reduce_scatter",
      [&] { reduce_blocks("reduce_scatter", in, counts, dtype, op, out, false, timeout); });
}

// The root copies each piece into the whole of a buffer (all k slots), the others copy it out.
void LocalGroup::broadcast(void* data, size_t count, DType dtype, int root, Duration timeout) {
  if (root < 0 || root >= size_) {
    throw UsageError("shared-memory broadcast: root " + std::to_string(root) + ", expected 0.." +
                     std::to_string(size_ - 1));
  }
  if (size_ == 1 || count == 0) return;
  run("broadcast", [&] {
    const WaitScope s = scope("broadcast", timeout);
    const size_t bytes = count * dtype_size(dtype);
    const size_t piece = size_ * segment_.slot_bytes();
    Bytes* buffer = static_cast<Bytes*>(data);
    for (size_t t = 0; t * piece < bytes; ++t) {
      const int b = next_buffer(s);
      Bytes* area = segment_.slot(b, 0);
      const size_t n = std::min(piece, bytes - t * piece);
      if (rank_ == root) std::memcpy(area, buffer + t * piece, n);
      arrive();
      if (rank_ != root) {
        wait_member(root, seq_, s);
        std::memcpy(buffer + t * piece, area, n);
      }
      free_after(b);
    }
  });
}

void LocalGroup::all_gather(const void* in, void* out, const std::vector<size_t>& counts,
                            DType dtype, Duration timeout) {
  if (counts.size() != static_cast<size_t>(size_)) {
    throw UsageError("shared-memory all_gather: " + std::to_string(counts.size()) +
                     " counts for a group of " + std::to_string(size_));
  }
  const size_t e = dtype_size(dtype);
  const std::vector<size_t> offsets = offsets_of(counts);
  const Bytes* input = static_cast<const Bytes*>(in);
  Bytes* output = static_cast<Bytes*>(out);
  if (output + offsets[rank_] * e != input) {
    std::memcpy(output + offsets[rank_] * e, input, counts[rank_] * e);
  }
  if (size_ == 1) return;
  run("all_gather", [&] {
    const WaitScope s = scope("all_gather", timeout);
    const size_t p = segment_.slot_bytes();
    const size_t rounds = ceil_div(max_of(counts) * e, p);
    for (size_t t = 0; t < rounds; ++t) {
      const int b = next_buffer(s);
      std::memcpy(segment_.slot(b, rank_), input + t * p, in_piece(counts[rank_] * e, t, p));
      arrive();
      const uint32_t published = seq_;
      for (int j = 0; j < size_; ++j) {
        if (j == rank_) continue;
        wait_member(j, published, s);
        std::memcpy(output + offsets[j] * e + t * p, segment_.slot(b, j),
                    in_piece(counts[j] * e, t, p));
      }
      free_after(b);
    }
  });
}

// Every member first publishes its send and receive counts (and dtype) in the small table, so
// that all check the same matrix and agree on the number of pieces; then each piece carries up to
// l elements of every (sender, receiver) part, in the sender's slot at the receiver's range.
void LocalGroup::all_to_all(const void* in, const std::vector<size_t>& send_counts, void* out,
                            const std::vector<size_t>& recv_counts, DType dtype, Duration timeout) {
  const size_t k = size_;
  if (send_counts.size() != k || recv_counts.size() != k) {
    throw UsageError("shared-memory all_to_all: " + std::to_string(send_counts.size()) +
                     " send and " + std::to_string(recv_counts.size()) +
                     " receive counts for a group of " + std::to_string(k));
  }
  const size_t e = dtype_size(dtype);
  const std::vector<size_t> send_offsets = offsets_of(send_counts);
  const std::vector<size_t> recv_offsets = offsets_of(recv_counts);
  const Bytes* input = static_cast<const Bytes*>(in);
  Bytes* output = static_cast<Bytes*>(out);
  if (k == 1) {
    if (send_counts[0] != recv_counts[0]) {
      throw UsageError("shared-memory all_to_all: member 0 sends " +
                       std::to_string(send_counts[0]) + " elements to itself and expects " +
                       std::to_string(recv_counts[0]));
    }
    std::memcpy(output, input, send_counts[0] * e);
    return;
  }
  std::string mismatch;
  run("all_to_all", [&] {
    const WaitScope s = scope("all_to_all", timeout);
    size_t half = 0;
    int64_t* row = next_row(half);
    for (size_t m = 0; m < k; ++m) {
      row[m] = static_cast<int64_t>(send_counts[m]);
      row[k + m] = static_cast<int64_t>(recv_counts[m]);
    }
    row[2 * k] = static_cast<int64_t>(dtype);
    arrive();
    wait_all(seq_, s);
    size_t largest = 0;
    for (size_t j = 0; j < k && mismatch.empty(); ++j) {
      const int64_t* sender = published(static_cast<int>(j), half);
      if (sender[2 * k] != static_cast<int64_t>(dtype)) {
        mismatch = "member " + std::to_string(j) + " passed dtype " +
                   dtype_name(static_cast<DType>(sender[2 * k])) + ", member " +
                   std::to_string(rank_) + " " + dtype_name(dtype);
      }
      for (size_t m = 0; m < k && mismatch.empty(); ++m) {
        const int64_t* receiver = published(static_cast<int>(m), half);
        if (sender[m] != receiver[k + j]) {
          mismatch = "member " + std::to_string(j) + " sends " + std::to_string(sender[m]) +
                     " elements to member " + std::to_string(m) + ", which expects " +
                     std::to_string(receiver[k + j]);
        }
        if (j != m) largest = std::max(largest, static_cast<size_t>(sender[m]));
      }
    }
    // Every member saw the same table, so all raise the same error here with their counters
    // level: the group stays usable.
    if (!mismatch.empty()) return;
    std::memcpy(output + recv_offsets[rank_] * e, input + send_offsets[rank_] * e,
                send_counts[rank_] * e);
    const size_t l = segment_.slot_bytes() / (k * e);
    for (size_t t = 0; t < ceil_div(largest, l); ++t) {
      const int b = next_buffer(s);
      Bytes* mine = segment_.slot(b, rank_);
      for (size_t m = 0; m < k; ++m) {
        if (m == static_cast<size_t>(rank_)) continue;
        std::memcpy(mine + m * l * e, input + (send_offsets[m] + t * l) * e,
                    in_piece(send_counts[m], t, l) * e);
      }
      arrive();
      const uint32_t published = seq_;
      for (size_t j = 0; j < k; ++j) {
        if (j == static_cast<size_t>(rank_)) continue;
        wait_member(static_cast<int>(j), published, s);
        std::memcpy(output + (recv_offsets[j] + t * l) * e, segment_.slot(b, j) + rank_ * l * e,
                    in_piece(recv_counts[j], t, l) * e);
      }
      free_after(b);
    }
  });
  if (!mismatch.empty()) throw UsageError("shared-memory all_to_all: " + mismatch);
}

void LocalGroup::barrier(Duration timeout) {
  if (size_ == 1) return;
  run("barrier", [&] {
    arrive();
    wait_all(seq_, scope("barrier", timeout));
  });
}

// Note [Channels], continued: the ring of (src, dst) holds a stream of messages, each a 16-byte
// header (tag, bytes) and the payload padded to 16 bytes, so headers never wrap around the ring's
// end. The sender alone moves head and the receiver alone tail, each after copying a chunk, so
// the receiver drains a large message while the sender still fills it. Only the sender's thread
// touches a ring's head and only the receiver's its tail, so the channels of different pairs (and
// the two directions of one pair) may be used from different threads at once.
namespace {

static_assert(sizeof(LocalGroup::MessageHeader) == 16, "headers keep the stream 16-byte aligned");

size_t padded(size_t bytes) {
  return (bytes + 15) / 16 * 16;
}

}  // namespace

void LocalGroup::check_peer(const char* operation, int peer) const {
  if (peer < 0 || peer >= size_ || peer == rank_) {
    throw UsageError(std::string("shared-memory ") + operation + ": member " +
                     std::to_string(peer) + " at member " + std::to_string(rank_) +
                     ", expected another member of 0.." + std::to_string(size_ - 1));
  }
}

void LocalGroup::write_ring(int to, const Bytes* src, size_t n, const WaitScope& s) {
  ChannelBlock* ch = segment_.channel(rank_, to);
  Bytes* ring = segment_.ring(rank_, to);
  const uint32_t capacity = static_cast<uint32_t>(segment_.channel_bytes());
  uint32_t head = ch->head.value.load(std::memory_order_relaxed);
  while (n > 0) {
    const uint32_t room = capacity - (head - ch->tail.value.load(std::memory_order_acquire));
    if (room == 0) {
      const uint32_t want = static_cast<uint32_t>(std::min<size_t>(n, capacity / 2));
      wait_for(ch->tail, head + want - capacity, to, s);
      continue;
    }
    const uint32_t at = head % capacity;
    const size_t chunk = std::min<size_t>({room, n, capacity - at});
    if (src != nullptr) {
      std::memcpy(ring + at, src, chunk);
      src += chunk;
    }
    head += static_cast<uint32_t>(chunk);
    n -= chunk;
    advance(ch->head, head);
  }
}

void LocalGroup::read_ring(int from, Bytes* dst, size_t n, const WaitScope& s) {
  ChannelBlock* ch = segment_.channel(from, rank_);
  const Bytes* ring = segment_.ring(from, rank_);
  const uint32_t capacity = static_cast<uint32_t>(segment_.channel_bytes());
  uint32_t tail = ch->tail.value.load(std::memory_order_relaxed);
  while (n > 0) {
    const uint32_t ready = ch->head.value.load(std::memory_order_acquire) - tail;
    if (ready == 0) {
      const uint32_t want = static_cast<uint32_t>(std::min<size_t>(n, capacity / 2));
      wait_for(ch->head, tail + want, from, s);
      continue;
    }
    const uint32_t at = tail % capacity;
    const size_t chunk = std::min<size_t>({ready, n, capacity - at});
    if (dst != nullptr) {
      std::memcpy(dst, ring + at, chunk);
      dst += chunk;
    }
    tail += static_cast<uint32_t>(chunk);
    n -= chunk;
    advance(ch->tail, tail);
  }
}

void LocalGroup::write_message(int dst, uint32_t tag, const void* data, size_t bytes,
                               Duration timeout) {
  check_peer("send", dst);
  const WaitScope s = scope("send", timeout, dst);
  const MessageHeader header{tag, 0, bytes};
  write_ring(dst, reinterpret_cast<const Bytes*>(&header), sizeof(header), s);
  write_ring(dst, static_cast<const Bytes*>(data), bytes, s);
  write_ring(dst, nullptr, padded(bytes) - bytes, s);
}

LocalGroup::MessageHeader LocalGroup::read_header(int src, Duration timeout) {
  check_peer("recv", src);
  MessageHeader header{};
  read_ring(src, reinterpret_cast<Bytes*>(&header), sizeof(header), scope("recv", timeout, src));
  return header;
}

void LocalGroup::read_payload(int src, void* data, size_t bytes, Duration timeout) {
  const WaitScope s = scope("recv", timeout, src);
  read_ring(src, static_cast<Bytes*>(data), bytes, s);
  read_ring(src, nullptr, padded(bytes) - bytes, s);
}

void LocalGroup::send(const void* data, size_t bytes, int dst, uint32_t tag, Duration timeout) {
  check_peer("send", dst);
  run("send", [&] { write_message(dst, tag, data, bytes, timeout); });
}

void LocalGroup::recv(void* data, size_t bytes, int src, uint32_t tag, Duration timeout) {
  check_peer("recv", src);
  std::string wrong;
  run("recv", [&] {
    const MessageHeader header = read_header(src, timeout);
    if (header.tag != tag || header.bytes != bytes) {
      wrong = "member " + std::to_string(rank_) + " expected tag " + std::to_string(tag) + " of " +
              std::to_string(bytes) + " bytes from member " + std::to_string(src) +
              ", the next message has tag " + std::to_string(header.tag) + " of " +
              std::to_string(header.bytes) + " bytes";
      return;
    }
    read_payload(src, data, bytes, timeout);
  });
  if (!wrong.empty()) {
    // The message's header is consumed and its payload is not: the stream can't be trusted.
    broken_ = "shared-memory recv: " + wrong;
    throw UsageError(broken_);
  }
}

}  // namespace shoal::comm::shm
