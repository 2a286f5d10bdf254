// WriteFully: the whole of a byte range to a file descriptor, through short
// writes and EINTR.
#pragma once

#include <cstddef>
#include <cstdint>

namespace reshard {

// Writes all of [data, data + n) at the file position (at < 0) or at `at`.
// Returns 0 or the errno of the failure.
int WriteFully(int fd, const uint8_t* data, size_t n, int64_t at = -1);

}  // namespace reshard
