#include "table.h"

#include <algorithm>
#include <cmath>

#include "wire.h"

namespace shoal::elastic::gossip {
namespace {

// SWIM's lambda: with it each update reaches every member with high probability even when a
// few datagrams are lost (memberlist uses 4 on LANs). Push-pull repairs the rest.
constexpr int kRetransmitMult = 4;

bool final_status(Status s) { return s == Status::kDead || s == Status::kLeft; }

}  // namespace

bool overrides(const Member& current, const Member& update) {
  if (current.status == Status::kLeft) return false;
  if (current.status == Status::kDead) return update.status == Status::kLeft;
  if (final_status(update.status)) return true;
  if (update.status == Status::kSuspect) {
    return current.status == Status::kAlive ? update.incarnation >= current.incarnation
                                            : update.incarnation > current.incarnation;
  }
  return update.incarnation > current.incarnation;
}

Member merged(const Member& current, const Member& update) {
  Member result = current;
  result.status = update.status;
  if (update.incarnation > current.incarnation) {
    result.incarnation = update.incarnation;
    result.meta = update.meta;
  }
  return result;
}

const Member* Table::find(const std::string& id) const {
  auto it = members_.find(id);
  return it == members_.end() ? nullptr : &it->second;
}

std::vector<Member> Table::all() const {
  std::vector<Member> out;
  out.reserve(members_.size());
  for (const auto& [id, member] : members_) out.push_back(member);
  return out;
}

void Table::disseminate(const Member& member) {
  pending_.erase(std::remove_if(pending_.begin(), pending_.end(),
                                [&](const Pending& p) { return p.member.id == member.id; }),
                 pending_.end());
  pending_.push_back({member, 0, ++queued_});
}

std::vector<Member> Table::piggyback(size_t budget) {
  const int limit = kRetransmitMult * static_cast<int>(std::ceil(std::log2(members_.size() + 1.0)));
  std::sort(pending_.begin(), pending_.end(), [](const Pending& a, const Pending& b) {
    return a.transmits != b.transmits ? a.transmits < b.transmits : a.queued > b.queued;
  });
  std::vector<Member> out;
  size_t used = 0;
  for (auto& p : pending_) {
    const size_t size = wire::encoded_size(p.member);
    if (used + size > budget) continue;  // a smaller one further on may still fit
    used += size;
    out.push_back(p.member);
    ++p.transmits;
  }
  pending_.erase(std::remove_if(pending_.begin(), pending_.end(), [&](const Pending& p) { return p.transmits >= limit; }),
                 pending_.end());
  return out;
}

}  // namespace shoal::elastic::gossip
