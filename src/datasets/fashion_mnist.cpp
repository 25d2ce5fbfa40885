#include "shoal/datasets/fashion_mnist.h"

#include <zlib.h>

#include <memory>

#include "shoal/core/error.h"

namespace shoal::datasets {
namespace {

// IDX magic: two zero bytes, the element type (0x08: unsigned byte), the number of dimensions.
constexpr int kUnsignedByte = 0x08;

struct GzFile {
  explicit GzFile(const std::string& path) : handle(gzopen(path.c_str(), "rb")) {}
  ~GzFile() {
    if (handle != nullptr) gzclose(handle);
  }
  gzFile handle;
};

void read_exactly(GzFile& file, void* into, size_t bytes, const std::string& path, const char* what) {
  size_t done = 0;
  while (done < bytes) {
    int n = gzread(file.handle, static_cast<char*>(into) + done,
                   static_cast<unsigned>(std::min<size_t>(bytes - done, 1 << 30)));
    if (n <= 0) {
      int code = 0;
      const char* message = gzerror(file.handle, &code);
      throw UsageError(path + ": truncated or corrupt IDX file: expected " + std::to_string(bytes) + " bytes of " +
                       what + ", read " + std::to_string(done) + (code < 0 ? std::string(" (") + message + ")" : ""));
    }
    done += static_cast<size_t>(n);
  }
}

}  // namespace

torch::Tensor read_idx_gz(const std::string& path, int dims) {
  GzFile file(path);
  if (file.handle == nullptr) {
    throw UsageError(path + ": cannot open (" + std::strerror(errno) +
                     "); expected a gzip-compressed IDX file (Debian package dataset-fashion-mnist)");
  }
  unsigned char magic[4];
  read_exactly(file, magic, 4, path, "header");
  if (magic[0] != 0 || magic[1] != 0 || magic[2] != kUnsignedByte || magic[3] != dims) {
    char got[16];
    std::snprintf(got, sizeof(got), "%02x%02x%02x%02x", magic[0], magic[1], magic[2], magic[3]);
    char want[16];
    std::snprintf(want, sizeof(want), "0000%02x%02x", kUnsignedByte, dims);
    throw UsageError(path + ": not an IDX file of unsigned bytes with " + std::to_string(dims) +
                     " dimensions: magic " + got + ", expected " + want);
  }
  std::vector<int64_t> shape(dims);
  int64_t count = 1;
  for (int d = 0; d < dims; ++d) {
    unsigned char b[4];
    read_exactly(file, b, 4, path, "header");
    shape[d] = (int64_t{b[0]} << 24) | (int64_t{b[1]} << 16) | (int64_t{b[2]} << 8) | int64_t{b[3]};
    count *= shape[d];
  }
  auto tensor = torch::empty(shape, torch::kUInt8);
  read_exactly(file, tensor.data_ptr<uint8_t>(), static_cast<size_t>(count), path, "data");
  return tensor;
}

FashionMnist::FashionMnist(const std::string& root, Split split) {
  const std::string prefix = root + (split == Split::kTrain ? "/train" : "/t10k");
  images_ = read_idx_gz(prefix + "-images-idx3-ubyte.gz", 3).unsqueeze(1).to(torch::kFloat32).div_(255.0);
  labels_ = read_idx_gz(prefix + "-labels-idx1-ubyte.gz", 1).to(torch::kInt64);
  if (images_.size(0) != labels_.size(0)) {
    throw UsageError(prefix + "-images-idx3-ubyte.gz has " + std::to_string(images_.size(0)) + " images but " +
                     prefix + "-labels-idx1-ubyte.gz has " + std::to_string(labels_.size(0)) +
                     " labels; expected one label per image");
  }
}

FashionMnist FashionMnist::head(int64_t count) const {
  const int64_t n = std::min(count, images_.size(0));
  return FashionMnist(images_.narrow(0, 0, n), labels_.narrow(0, 0, n));
}

torch::data::Example<> FashionMnist::get(size_t index) {
  return {images_[static_cast<int64_t>(index)], labels_[static_cast<int64_t>(index)]};
}

torch::optional<size_t> FashionMnist::size() const { return static_cast<size_t>(images_.size(0)); }

}  // namespace shoal::datasets
