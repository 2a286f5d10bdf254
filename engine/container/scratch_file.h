// Scratch files: bytes a job must set aside that are too many to hold in
// memory (the transpose of a big matrix), kept in the folder the run writes
// into. They never have a name there, so nothing of them is left once they
// are closed, however the run ends; closing one drops its pages.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>

#include "reshard/status.h"

namespace reshard {

class ScratchFile {
 public:
  // A new empty file in `dir`.
  static Result<ScratchFile> Create(const std::string& dir);

  ScratchFile(ScratchFile&& other) noexcept;
  ScratchFile& operator=(ScratchFile&& other) noexcept;
  ScratchFile(const ScratchFile&) = delete;
  ScratchFile& operator=(const ScratchFile&) = delete;
  ~ScratchFile();

  // Bytes [offset, offset + n) of the file. Safe from several threads at once.
  Status Write(int64_t offset, const uint8_t* bytes, int64_t n) const;
  Status Read(int64_t offset, int64_t n, uint8_t* out) const;

 private:
  ScratchFile(int fd, std::string dir) : fd_(fd), dir_(std::move(dir)) {}
  int fd_ = -1;
  std::string dir_;  // for messages
};

// The folder scratch files go in, for producers made before the run knows
// it: each job names it (the output's staging folder) as it starts.
class ScratchFolder {
 public:
  void Use(const std::string& dir);
  // A new scratch file in the folder; refused before a job has named it.
  Result<ScratchFile> NewFile() const;

 private:
  mutable std::mutex mu_;
  std::string dir_;
};

}  // namespace reshard
