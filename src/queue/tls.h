// The scheduler's TLS certificate (docs/queue.md, "Security"): the admin's own (--tls-cert,
// --tls-key), or one made at the first start in STATE_DIR/tls: a self-signed certificate whose
// names are this host's (its host name, localhost, and every IPv4 address of its interfaces, so
// that clients on any route verify it), with an EC P-256 key. Clients trust it by its file
// (cert.pem, public: copy it to the other hosts), not by a public authority.
#pragma once

#include <string>

namespace shoal::queue {

struct TlsFiles {
  std::string cert;  // PEM
  std::string key;   // PEM, mode 600
};

// DIR/cert.pem and DIR/key.pem, made when they do not exist yet. Error when they cannot be made.
TlsFiles ensure_certificate(const std::string& dir);

}  // namespace shoal::queue
