// Helpers for reshard's unit tests.
#pragma once

#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "pickle/dtype.h"
#include "pickle/value.h"
#include "reshard/status.h"
#include "util/box.h"
#include "util/byte_producer.h"

namespace reshard {

// A fresh folder under the system temp dir, removed with its contents.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "reshard-test-XXXXXX").string();
    path_ = ::mkdtemp(pattern.data());
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// Writes a checkpoint with the Python fixture generator (real torch.save):
// `args` are its command-line options, e.g. "--style bs_bloom --tp 2".
inline Status MakeFixture(const std::string& args, const std::filesystem::path& root) {
  const std::string cmd = std::string("PYTHONPATH=") + RESHARD_SOURCE_DIR + "/tests " +
                          RESHARD_PYTHON + " -m fixtures.megatron_fixture " + args + " " +
                          root.string() + " > /dev/null";
  if (std::system(cmd.c_str()) != 0) return Status::Internal("fixture generator failed: " + cmd);
  return Status::Ok();
}

// The bytes of the box `box` of a tensor of `size` whose element i (its
// row-major index in the whole tensor) is i * scale + shift in `dtype`
// (floats rounded to nearest even, integers truncated), produced on demand:
// what torch computes as `torch.arange(numel) * scale + shift`.
inline ByteProducer PatternProducer(DType dtype, std::vector<int64_t> size, Box box, double scale, double shift) {
  return [=](int64_t offset, int64_t length, uint8_t* dst) {
    const int es = ElementSize(dtype);
    for (int64_t e = offset / es; e < (offset + length) / es; ++e) {
      int64_t global = 0, rest = e;
      std::vector<int64_t> index(box.sizes.size());
      for (size_t d = box.sizes.size(); d-- > 0;) {
        index[d] = rest % box.sizes[d];
        rest /= box.sizes[d];
      }
      for (size_t d = 0; d < size.size(); ++d) global = global * size[d] + box.offsets[d] + index[d];
      const double v = static_cast<double>(global) * scale + shift;
      uint8_t* at = dst + (e * es - offset);
      if (IsFloatingPoint(dtype)) {
        StoreFromDouble(dtype, v, at);
      } else {
        const int64_t i = static_cast<int64_t>(v);
        std::memcpy(at, &i, static_cast<size_t>(es));  // little-endian: the low bytes
      }
    }
    return Status::Ok();
  };
}

}  // namespace reshard
