// ZipDirectory: the records of a torch.save zip file as its central
// directory lists them, each checked against the file before it is used.
//
// data.pkl and the storages are used straight from a memory map of the file
// at their records' offsets (LibTorch's reader only cross-checks files, in
// `lint --deep`: torch_check.h), so nothing about a record may be taken on
// trust: each must be stored uncompressed, as torch.save writes every record
// (the bytes of a compressed one are not the storage); its local header must
// agree with the directory (name, method, sizes); its data must lie inside
// the file, before the directory; and no name may appear twice. Sizes and
// offsets may be ZIP64's, and every sum of them is checked for overflow.
//
// The archive may be a window of a larger file (FileWindow): its offsets are
// then relative to the window's start, and nothing outside it is read.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "container/mapped_file.h"
#include "reshard/status.h"

namespace reshard {

// Read does not check the records' CRC-32s, which would mean reading every
// byte when the file is opened; CheckCrcs does (`lint --deep`).
struct ZipRecord {
  uint64_t data_offset = 0;  // of the record's first byte in the file (not the window)
  uint64_t size = 0;
  uint32_t crc = 0;          // as the directory records it
};

class ZipDirectory {
 public:
  // The archive filling `window` of `file` (which must hold it). Errors are
  // InvalidInput naming the file, the window and the problem.
  static Result<ZipDirectory> Read(const MappedFile& file, const FileWindow& window);
  static Result<ZipDirectory> Read(const MappedFile& file) { return Read(file, file.whole()); }

  // The record `<archive>/<name>`, or null. The archive folder is that of the
  // first record, as PyTorchStreamReader takes it.
  const ZipRecord* Find(const std::string& name) const;
  // Every record, by its full name.
  const std::map<std::string, ZipRecord>& records() const { return records_; }

  // Reads every record of `file` (the file Read was given) and refuses the
  // first whose bytes do not have the CRC-32 the directory records, naming
  // the file and the archive's window; the pages read are released as it goes.
  Status CheckCrcs(const MappedFile& file) const;

 private:
  FileWindow window_;                         // of the file Read was given
  std::string archive_;                       // with its trailing '/'
  std::map<std::string, ZipRecord> records_;  // by full name
};

}  // namespace reshard
