// Writing produced bytes, with the kernel copying the parts that are a
// source file's bytes as they lie there.
//
// A reshape mostly moves contiguous runs of source bytes (a TP merge of
// row-split tensors, a PP or DP change, whole optimizer partitions). The
// producers still read them once (the source's own records are checked as
// they pass, and the CRC computed for that check is the one the target's
// zip records and manifest take: ProducedCrc), but the copy into the target
// is left to copy_file_range: no second trip through the process, and on a
// file system that copies on its side (NFS 4.2, or one that clones extents)
// none through the page cache either.
#pragma once

#include <cstddef>
#include <cstdint>

#include "util/byte_producer.h"

namespace reshard {

// Writes [data, data + n) into `fd` at `at` (at < 0: at the file position,
// which it advances), where `spans` (at relative to data, in any order; none
// are trusted if two overlap) say which bytes are a source file's: those of a span long
// enough to be worth a system call are copied from the file by the kernel,
// the rest written from `data`. Where the kernel refuses to copy between two
// file systems, it is not asked again for them, and the bytes are written
// from `data`, as where a source file ended early. Returns 0 or the errno of
// a failure.
int WriteProduced(int fd, const uint8_t* data, size_t n, int64_t at, const FileSpans& spans);

// The CRC-32 of [data, data + n) continued from `crc` (as Crc32), taking a
// long span's CRC where the producer gave one instead of reading its bytes
// again. The spans must be those the bytes were produced with.
uint32_t ProducedCrc(uint32_t crc, const uint8_t* data, size_t n, const FileSpans& spans);

// Makes the file `to` (open for writing, empty) share the extents of `from`
// (a reflink), where the file system can; false when it cannot.
bool CloneFile(int from, int to);

}  // namespace reshard
