// elastic::GossipAgent (src/elastic/membership.h): a launcher's agent over gossip::Gossip.
#include "../membership.h"

#include "swim.h"

namespace shoal::elastic {

GossipAgent::GossipAgent(const GossipAgentOptions& options) {
  gossip::Options membership;
  membership.seeds = options.seeds;
  if (!options.bind_host.empty()) membership.bind_host = options.bind_host;
  membership.port = options.port;
  membership.advertise_host = options.advertise_host;
  membership.token = options.token;
  membership.meta = options.meta;
  if (options.join_timeout != kUnsetTimeout) membership.join_timeout = options.join_timeout;
  gossip_ = gossip::Gossip::start(membership);
}

GossipAgent::~GossipAgent() {
  gossip_->leave();
}

const std::string& GossipAgent::address() const {
  return gossip_->address();
}

void GossipAgent::set_meta(const std::string& meta) {
  gossip_->set_meta(meta);
}

std::vector<std::string> GossipAgent::others_meta() const {
  std::vector<std::string> metas;
  for (const auto& member : gossip_->members()) {
    if (member.id != gossip_->id()) metas.push_back(member.meta);
  }
  return metas;
}

}  // namespace shoal::elastic
