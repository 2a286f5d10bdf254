// MappedFile: a read-only memory map of a whole file. Tensor storages read
// from checkpoints point into it, so data is paged in only when touched.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "reshard/status.h"

namespace reshard {

class MappedFile {
 public:
  static Result<std::shared_ptr<const MappedFile>> Open(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  MappedFile(std::string path, const uint8_t* data, size_t size)
      : path_(std::move(path)), data_(data), size_(size) {}
  std::string path_;
  const uint8_t* data_;
  size_t size_;
};

}  // namespace reshard
