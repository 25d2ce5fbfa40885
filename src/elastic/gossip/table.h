// One member's view of the job: an entry per member id, SWIM's precedence rules between
// conflicting news about an entry, and the queue of updates waiting to be piggy-backed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "swim.h"

namespace shoal::elastic::gossip {

// Whether `update` replaces what is known in `current` (both about the same id):
//  - Left is final; Dead is final except that Left replaces it (the process said it left, which
//    says more than "it went silent");
//  - Dead or Left replace Alive and Suspect at any incarnation;
//  - Suspect(j) replaces Alive(i) when j >= i, and Suspect(i) when j > i;
//  - Alive(j) replaces Alive(i) or Suspect(i) only when j > i (only the member itself raises its
//    incarnation, so this is its refutation or its new metadata).
bool overrides(const Member& current, const Member& update);

// What `current` becomes after an update that overrides it: the update's status; its
// incarnation and metadata when newer (Dead and Left may come from members that knew an older
// incarnation, which says nothing about the metadata).
Member merged(const Member& current, const Member& update);

class Table {
 public:
  const Member* find(const std::string& id) const;
  // Adds or replaces the entry unconditionally (precedence is the caller's business).
  void put(const Member& member) { members_[member.id] = member; }
  std::vector<Member> all() const;
  size_t size() const { return members_.size(); }

  // Queues `member` (a copy of a changed entry) for piggy-backing, replacing older news about
  // the same id.
  void disseminate(const Member& member);
  // Updates to piggy-back on one message, newest first, at most `budget` encoded bytes. Each is
  // sent about kRetransmitMult * log2(n + 1) times, n the number of members known, then dropped.
  std::vector<Member> piggyback(size_t budget);

 private:
  struct Pending {
    Member member;
    int transmits = 0;
    uint64_t queued = 0;  // order of queueing, for "newest first" among equals
  };
  std::map<std::string, Member> members_;
  std::vector<Pending> pending_;
  uint64_t queued_ = 0;
};

}  // namespace shoal::elastic::gossip
