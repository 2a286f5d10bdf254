#include "container/record_crc.h"

#include <algorithm>
#include <atomic>
#include <set>
#include <sstream>

#include "util/crc32.h"

namespace reshard {
namespace {

std::atomic<bool> checks_on{true};
std::mutex registry_mu;
// The checks of the files open now: each lives as long as its MappedFile.
std::vector<std::weak_ptr<RecordCrcs>>& Registry() {
  static auto* registry = new std::vector<std::weak_ptr<RecordCrcs>>();
  return *registry;
}

// The checks of the files still open.
std::vector<std::shared_ptr<RecordCrcs>> Live() {
  std::lock_guard<std::mutex> lock(registry_mu);
  std::vector<std::shared_ptr<RecordCrcs>> live;
  auto& registry = Registry();
  registry.erase(std::remove_if(registry.begin(), registry.end(),
                                [](const std::weak_ptr<RecordCrcs>& w) { return w.expired(); }),
                 registry.end());
  for (const auto& w : registry) {
    if (auto crcs = w.lock()) live.push_back(std::move(crcs));
  }
  return live;
}

}  // namespace

RecordCrcs::RecordCrcs(std::string path, std::vector<std::pair<std::string, ZipRecord>> records)
    : path_(std::move(path)) {
  Add(std::move(records));
}

void RecordCrcs::Add(std::vector<std::pair<std::string, ZipRecord>> records) {
  std::lock_guard<std::mutex> lock(mu_);
  auto by_offset = [](const Record& a, const Record& b) { return a.zip.data_offset < b.zip.data_offset; };
  const size_t known = records_.size();
  for (auto& [name, zip] : records) {
    Record r{std::move(name), zip, {}, false};
    // An archive read again (an item read twice) adds nothing.
    if (!std::binary_search(records_.begin(), records_.begin() + known, r, by_offset)) records_.push_back(std::move(r));
  }
  std::sort(records_.begin(), records_.end(), by_offset);
}

void RecordCrcs::Note(uint64_t offset, size_t n, uint32_t crc) {
  auto after = std::upper_bound(records_.begin(), records_.end(), offset,
                                [](uint64_t at, const Record& r) { return at < r.zip.data_offset; });
  if (after == records_.begin() || n == 0) return;
  Record& r = *(after - 1);
  const uint64_t begin = offset - r.zip.data_offset, end = begin + n;
  if (end > r.zip.size) return;  // not inside one record: not a storage's bytes
  std::lock_guard<std::mutex> lock(mu_);
  if (!r.checked) Join(&r, begin, end, crc);
}

uint32_t RecordCrcs::NoteBytes(uint64_t offset, const uint8_t* bytes, size_t n) {
  const uint64_t end = offset + n;
  uint32_t crc = 0;
  uint64_t at = offset;  // the bytes before it are in `crc`
  auto add = [&](uint64_t to) {
    const uint32_t piece = Crc32(0, bytes + (at - offset), to - at);
    crc = Crc32Combine(crc, piece, static_cast<int64_t>(to - at));
    at = to;
    return piece;
  };
  auto r = std::upper_bound(records_.begin(), records_.end(), offset,
                            [](uint64_t at, const Record& rec) { return at < rec.zip.data_offset; });
  if (r != records_.begin()) --r;  // the record `offset` may lie in
  for (; r != records_.end() && r->zip.data_offset < end; ++r) {
    const uint64_t lo = std::max(offset, r->zip.data_offset), hi = std::min(end, r->zip.data_offset + r->zip.size);
    if (lo >= hi) continue;
    if (at < lo) add(lo);  // bytes between records
    Note(lo, hi - lo, add(hi));
  }
  if (at < end) add(end);
  return crc;
}

// Adds the piece [begin, end) and joins it with the pieces it meets; the
// record is checked once one piece covers it.
void RecordCrcs::Join(Record* r, uint64_t begin, uint64_t end, uint32_t crc) {
  auto next = r->pieces.lower_bound(begin);
  if (next != r->pieces.end() && next->first < end) return;  // overlaps a later piece
  if (next != r->pieces.begin()) {
    auto prev = std::prev(next);
    if (prev->second.first > begin) return;  // overlaps an earlier piece
    if (prev->second.first == begin) {
      crc = Crc32Combine(prev->second.second, crc, static_cast<int64_t>(end - begin));
      begin = prev->first;
      r->pieces.erase(prev);
    }
  }
  if (next != r->pieces.end() && next->first == end) {
    crc = Crc32Combine(crc, next->second.second, static_cast<int64_t>(next->second.first - end));
    end = next->second.first;
    r->pieces.erase(next);
  }
  if (begin > 0 || end < r->zip.size) {
    r->pieces.emplace(begin, std::make_pair(end, crc));
    return;
  }
  r->checked = true;
  r->pieces.clear();
  if (crc != r->zip.crc && damage_.empty()) {
    damage_ = path_ + ": record " + r->name + " does not have the CRC-32 its zip directory records; its "
              "bytes are damaged";
  }
}

std::string RecordCrcs::Damage() const {
  std::lock_guard<std::mutex> lock(mu_);
  return damage_;
}

void RecordCrcs::JoinPiece(const Piece& piece) {
  auto r = std::lower_bound(records_.begin(), records_.end(), piece.record_offset,
                            [](const Record& rec, uint64_t at) { return rec.zip.data_offset < at; });
  if (r == records_.end() || r->zip.data_offset != piece.record_offset || piece.end > r->zip.size ||
      piece.begin >= piece.end) {
    return;
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (!r->checked) Join(&*r, piece.begin, piece.end, piece.crc);
}

std::vector<RecordCrcs::Piece> RecordCrcs::PartlyRead() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Piece> out;
  for (const Record& r : records_) {
    for (const auto& [begin, end_crc] : r.pieces) {
      out.push_back({r.zip.data_offset, begin, end_crc.first, end_crc.second});
    }
  }
  return out;
}

void SetRecordCrcChecks(bool on) { checks_on = on; }
bool RecordCrcChecksOn() { return checks_on; }

void RegisterRecordCrcs(const std::shared_ptr<RecordCrcs>& crcs) {
  std::lock_guard<std::mutex> lock(registry_mu);
  Registry().push_back(crcs);
}

Status CheckReadRecords() {
  for (const auto& crcs : Live()) {
    const std::string damage = crcs->Damage();
    if (!damage.empty()) {
      return Status::InvalidInput(damage + "; nothing was published (restore the file from a good copy; "
                                  "--no-check-crc skips this check)");
    }
  }
  return Status::Ok();
}

std::shared_ptr<RecordCrcs> RecordCrcsOf(const std::string& path) {
  for (auto& crcs : Live()) {
    if (crcs->path() == path) return crcs;
  }
  return nullptr;
}

// PartlyReadPieces' text: per file "<path length> <path> <pieces>\n", then
// "<record offset> <begin> <end> <crc>\n" per piece.
std::string PartlyReadPieces() {
  std::ostringstream out;
  for (const auto& crcs : Live()) {
    const std::vector<RecordCrcs::Piece> pieces = crcs->PartlyRead();
    if (pieces.empty()) continue;
    out << crcs->path().size() << ' ' << crcs->path() << ' ' << pieces.size() << '\n';
    for (const RecordCrcs::Piece& p : pieces) out << p.record_offset << ' ' << p.begin << ' ' << p.end << ' ' << p.crc << '\n';
  }
  return out.str();
}

Status JoinPartlyReadPieces(const std::string& text) {
  std::istringstream in(text);
  size_t length = 0;
  while (in >> length) {
    std::string path(length, '\0');
    size_t pieces = 0;
    if (in.get() != ' ' || !in.read(path.data(), static_cast<std::streamsize>(length)) || !(in >> pieces)) {
      return Status::InvalidInput("malformed record pieces");
    }
    const std::shared_ptr<RecordCrcs> crcs = RecordCrcsOf(path);
    for (size_t i = 0; i < pieces; ++i) {
      RecordCrcs::Piece p;
      if (!(in >> p.record_offset >> p.begin >> p.end >> p.crc)) return Status::InvalidInput("malformed record pieces");
      if (crcs) crcs->JoinPiece(p);
    }
  }
  return in.eof() ? Status::Ok() : Status::InvalidInput("malformed record pieces");
}

std::vector<std::string> PartlyReadRecords() {
  std::set<std::string> records;
  for (const auto& crcs : Live()) {
    for (const RecordCrcs::Piece& p : crcs->PartlyRead()) records.insert(std::to_string(p.record_offset) + " " + crcs->path());
  }
  return {records.begin(), records.end()};
}

std::string PartlyReadRecordsNote(int64_t partly) {
  if (partly == 0) return "";
  return std::to_string(partly) + " zip record(s) were read only in part, so their CRC-32 was not checked "
         "(`lint --deep` checks every record)";
}

}  // namespace reshard
