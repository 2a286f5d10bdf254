// RegularFile: opening a file reshard reads, refusing anything but a regular
// file before a byte is read. A FIFO blocks a reader forever (in open() or
// in read()), and a device such as /dev/zero never ends; either can sit
// where a checkpoint, a manifest or a tokenizer file is expected (a tar
// archive carries FIFOs, a link can point at a device).
#pragma once

#include <sys/stat.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "reshard/status.h"
#include "util/crc32.h"

namespace reshard {

// An open descriptor of a regular file and its fstat at opening.
struct OpenedFile {
  int fd = -1;
  struct stat st = {};
};

// Opens `path` read-only without blocking (O_NONBLOCK, so a FIFO with no
// writer does not hang open()), then refuses it unless fstat says it is a
// regular file. InvalidInput names the path and what it is instead; a file
// that cannot be opened is an IoError. The caller closes the descriptor.
Result<OpenedFile> OpenRegularFile(const std::string& path);

// The whole content of the regular file `path`, at most `max_bytes` of it
// (a larger file is refused, naming the limit): for the small text files
// reshard parses whole (JSON, YAML, `latest`).
Result<std::string> ReadRegularFile(const std::string& path, int64_t max_bytes = int64_t{1} << 30);

// Copies the regular file `from` to `to` (created or truncated) through
// `buffer`, exactly the size it had when opened; `digest` learns the copy's
// size and CRC-32, `copied` (may be empty) each piece's byte count. `seen`
// (may be empty) is handed each piece as read, at its offset, and returns
// its CRC-32, which the digest takes instead of computing it again. Errors
// name the file that could not be read or written.
using SeenBytes = std::function<uint32_t(int64_t offset, const uint8_t* bytes, size_t n)>;
Status CopyRegularFile(const std::string& from, const std::string& to, std::vector<uint8_t>& buffer,
                       FileDigest* digest, const std::function<void(int64_t)>& copied = {},
                       const SeenBytes& seen = {});

}  // namespace reshard
