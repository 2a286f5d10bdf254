// RecordCrcs: the CRC-32 of every zip record a run reads whole, checked as
// its bytes are copied out (CopyFromView), so that a damaged byte of a
// tensor never lands in an output. Each copy's CRC is computed from the
// bytes just copied (in cache; CopyFromView hands the same CRC on to the
// writer, for the target's), and the pieces of a record are joined with
// Crc32Combine as they meet, in whatever order and on whatever thread they
// were read: the check costs no second read of the file.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "container/zip_directory.h"
#include "reshard/status.h"

namespace reshard {

// The records of one mapped file whose reads are checked.
class RecordCrcs {
 public:
  // `records` (the storages' records of `path`) must not overlap.
  RecordCrcs(std::string path, std::vector<std::pair<std::string, ZipRecord>> records);
  // Adds the records of another archive in the same file (a Distributed
  // Checkpoint's `.distcp` file holds one per item); before any Note.
  void Add(std::vector<std::pair<std::string, ZipRecord>> records);

  // Notes that the file's bytes [offset, offset + n) were read, and had the
  // CRC-32 `crc`. A read overlapping bytes already noted is not counted again.
  void Note(uint64_t offset, size_t n, uint32_t crc);
  // Notes the file's bytes [offset, offset + n), held in `bytes`, which may
  // run over several records (a file copied whole), and returns their CRC-32,
  // joined from the records' pieces: each byte is CRC'd once.
  uint32_t NoteBytes(uint64_t offset, const uint8_t* bytes, size_t n);

  // A piece of a record read in part: its bytes [begin, end) and their CRC-32.
  struct Piece {
    uint64_t record_offset = 0;  // the record's data_offset in the file
    uint64_t begin = 0, end = 0;
    uint32_t crc = 0;
  };
  // Joins a piece another process read of the record at `piece.record_offset`
  // (none: ignored), as if it was noted here.
  void JoinPiece(const Piece& piece);

  // The first damaged record's error ("" when none); the pieces of the
  // records read in part only (so not checked).
  std::string Damage() const;
  std::vector<Piece> PartlyRead() const;
  const std::string& path() const { return path_; }

 private:
  struct Record {
    std::string name;
    ZipRecord zip;
    std::map<uint64_t, std::pair<uint64_t, uint32_t>> pieces;  // begin -> (end, crc), in the record
    bool checked = false;
  };
  void Join(Record* r, uint64_t begin, uint64_t end, uint32_t crc);

  std::string path_;
  std::vector<Record> records_;  // by data_offset
  mutable std::mutex mu_;
  std::string damage_;
};

// Whether ReadTorchFile registers the records of the files it reads (on by
// default; --no-check-crc turns it off).
void SetRecordCrcChecks(bool on);
bool RecordCrcChecksOn();

// Records `crcs` among those the run checks, for as long as something
// (its MappedFile) keeps it.
void RegisterRecordCrcs(const std::shared_ptr<RecordCrcs>& crcs);

// InvalidInput naming the first record read whole whose bytes do not have
// the CRC-32 its zip directory records; Ok when none.
Status CheckReadRecords();

// The checks of the open file `path` (as MappedFile::Open was given it), or
// null when its records are not checked.
std::shared_ptr<RecordCrcs> RecordCrcsOf(const std::string& path);

// The pieces of the records this process read in part only, as text for the
// other processes of a cluster.
std::string PartlyReadPieces();
// Joins the pieces another process read (its PartlyReadPieces()) into the
// records of the files open here, so that a record the processes read between
// them is checked whole; pieces of files not open here are left to the
// processes that have them. InvalidInput for text PartlyReadPieces does not make.
Status JoinPartlyReadPieces(const std::string& text);
// The records read in part only, each as "<data offset> <path>".
std::vector<std::string> PartlyReadRecords();

// A note when `partly` records were read in part only ("" when none).
std::string PartlyReadRecordsNote(int64_t partly);

}  // namespace reshard
