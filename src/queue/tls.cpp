#include "tls.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <memory>
#include <random>
#include <set>

#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include "shoal/core/error.h"

namespace shoal::queue {

namespace {

// The names a client may reach this host by: what the certificate's subjectAltName lists.
std::string alt_names() {
  std::set<std::string> names = {"DNS:localhost", "IP:127.0.0.1"};
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) == 0 && host[0] != '\0')
    names.insert(std::string("DNS:") + host);
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) == 0) {
    for (ifaddrs* it = list; it != nullptr; it = it->ifa_next) {
      if (it->ifa_addr == nullptr || it->ifa_addr->sa_family != AF_INET) continue;
      char text[INET_ADDRSTRLEN] = {};
      const auto* address = reinterpret_cast<const sockaddr_in*>(it->ifa_addr);
      if (::inet_ntop(AF_INET, &address->sin_addr, text, sizeof(text)) != nullptr)
        names.insert(std::string("IP:") + text);
    }
    ::freeifaddrs(list);
  }
  std::string out;
  for (const auto& name : names) out += (out.empty() ? "" : ",") + name;
  return out;
}

void fail(const std::string& what) {
  throw Error("cannot make the queue's TLS certificate: " + what);
}

// Writes `write(FILE*)`'s PEM to `path` with `mode`, through a temporary name.
template <typename Write>
void write_pem(const std::string& path, mode_t mode, Write write) {
  const std::string temporary = path + ".tmp";
  const int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode);
  if (fd < 0) fail("cannot create " + temporary);
  std::FILE* file = ::fdopen(fd, "w");
  const bool written = file != nullptr && write(file) == 1;
  if (file != nullptr) std::fclose(file);
  if (!written || ::rename(temporary.c_str(), path.c_str()) != 0) fail("cannot write " + path);
}

}  // namespace

TlsFiles ensure_certificate(const std::string& dir) {
  TlsFiles files{dir + "/cert.pem", dir + "/key.pem"};
  if (::access(files.cert.c_str(), R_OK) == 0 && ::access(files.key.c_str(), R_OK) == 0)
    return files;
  ::mkdir(dir.c_str(), 0755);
  std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> key(EVP_EC_gen("P-256"), EVP_PKEY_free);
  std::unique_ptr<X509, decltype(&X509_free)> cert(X509_new(), X509_free);
  if (!key || !cert) fail("no key");
  std::random_device random;
  X509_set_version(cert.get(), 2);
  ASN1_INTEGER_set_int64(X509_get_serialNumber(cert.get()),
                         static_cast<int64_t>((uint64_t{random()} << 31) ^ random()) & INT64_MAX);
  X509_gmtime_adj(X509_getm_notBefore(cert.get()), -3600);
  X509_gmtime_adj(X509_getm_notAfter(cert.get()), 10L * 365 * 24 * 3600);
  X509_set_pubkey(cert.get(), key.get());
  X509_NAME* name = X509_get_subject_name(cert.get());
  X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC,
                             reinterpret_cast<const unsigned char*>("shoal queue"), -1, -1, 0);
  X509_set_issuer_name(cert.get(), name);
  X509V3_CTX context;
  X509V3_set_ctx_nodb(&context);
  X509V3_set_ctx(&context, cert.get(), cert.get(), nullptr, nullptr, 0);
  const std::string names = alt_names();
  X509_EXTENSION* san =
      X509V3_EXT_conf_nid(nullptr, &context, NID_subject_alt_name, names.c_str());
  if (san == nullptr) fail("bad names " + names);
  X509_add_ext(cert.get(), san, -1);
  X509_EXTENSION_free(san);
  if (X509_sign(cert.get(), key.get(), EVP_sha256()) <= 0) fail("signing failed");
  write_pem(files.key, 0600, [&](std::FILE* f) {
    return PEM_write_PrivateKey(f, key.get(), nullptr, nullptr, 0, nullptr, nullptr);
  });
  write_pem(files.cert, 0644, [&](std::FILE* f) { return PEM_write_X509(f, cert.get()); });
  return files;
}

}  // namespace shoal::queue
