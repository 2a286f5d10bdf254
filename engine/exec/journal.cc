#include "exec/journal.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <fstream>
#include <sstream>

#include "container/write_fully.h"

namespace reshard {
namespace {

constexpr char kHeader[] = "reshard-journal 1 ";
constexpr char kJob[] = "job";

std::string JournalPath(const std::string& folder) { return folder + "/" + kJournalName; }

// The header line of the journal at `path` ("" when there is none).
std::string HeaderOf(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// Fields of a job line are separated by tabs; a name holding a tab or a
// newline is never recorded (its job is simply written again).
bool Recordable(const std::string& name) { return name.find_first_of("\t\n") == std::string::npos; }

// "job \t name \t part \t (file \t offset \t bytes \t crc)*"
std::string JobLine(const std::string& name, int part,
                    const std::vector<std::pair<std::string, FileDigest>>& pieces) {
  std::string line = std::string(kJob) + "\t" + name + "\t" + std::to_string(part);
  for (const auto& [file, d] : pieces) {
    line += "\t" + file + "\t" + std::to_string(d.offset) + "\t" + std::to_string(d.bytes) + "\t" +
            std::to_string(d.crc32);
  }
  return line + "\n";
}

std::vector<std::string> Fields(const std::string& line) {
  std::vector<std::string> fields;
  std::istringstream in(line);
  for (std::string field; std::getline(in, field, '\t');) fields.push_back(field);
  return fields;
}

// Whether bytes [offset, offset + bytes) of `path` still have the CRC `crc`.
bool ReadsBack(const std::string& path, const FileDigest& d) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  std::vector<uint8_t> buffer(1 << 20);
  uint32_t crc = 0;
  int64_t done = 0;
  while (done < d.bytes) {
    const size_t want = static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(buffer.size()), d.bytes - done));
    const ssize_t n = ::pread(fd, buffer.data(), want, d.offset + done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    crc = Crc32(crc, buffer.data(), static_cast<size_t>(n));
    done += n;
  }
  ::close(fd);
  return done == d.bytes && crc == d.crc32;
}

}  // namespace

std::string Fingerprint(const std::string& text) {
  uint64_t fnv = 14695981039346656037ull;  // FNV-1a, 64 bits
  for (const unsigned char c : text) fnv = (fnv ^ c) * 1099511628211ull;
  char out[32];
  std::snprintf(out, sizeof(out), "%08x%016llx", Crc32(0, reinterpret_cast<const uint8_t*>(text.data()), text.size()),
                static_cast<unsigned long long>(fnv));
  return out;
}

bool HoldsJournalOf(const std::string& folder, const std::string& fingerprint) {
  return HeaderOf(JournalPath(folder)) == kHeader + fingerprint;
}

Status RunJournal::Create(const std::string& folder, const std::string& fingerprint) {
  const std::string path = JournalPath(folder);
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return Status::IoError("cannot create " + path + ": " + std::strerror(errno));
  const std::string header = kHeader + fingerprint + "\n";
  const int err = WriteFully(fd, reinterpret_cast<const uint8_t*>(header.data()), header.size());
  ::close(fd);
  if (err != 0) return Status::IoError("cannot write " + path + ": " + std::strerror(err));
  return Status::Ok();
}

Result<std::unique_ptr<RunJournal>> RunJournal::Open(const std::string& folder) {
  const std::string path = JournalPath(folder);
  const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
  if (fd < 0) return Status::IoError("cannot open " + path + ": " + std::strerror(errno));
  std::unique_ptr<RunJournal> journal(new RunJournal(folder, fd));
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);  // the header
  // A line the kill cut short has no newline: getline then stops at the end
  // of the file, and the line is not used.
  while (std::getline(in, line) && !in.eof()) {
    const std::vector<std::string> f = Fields(line);
    if (f.size() < 3 || f[0] != kJob || (f.size() - 3) % 4 != 0) continue;
    try {
      Pieces pieces;
      for (size_t i = 3; i + 3 < f.size(); i += 4) {
        FileDigest d;
        d.offset = std::stoll(f[i + 1]);
        d.bytes = std::stoll(f[i + 2]);
        d.crc32 = static_cast<uint32_t>(std::stoul(f[i + 3]));
        pieces.emplace_back(f[i], d);
      }
      journal->done_[{f[1], std::stoi(f[2])}] = std::move(pieces);
    } catch (const std::exception&) {
      continue;  // not a line this version wrote: its job is written again
    }
  }
  return journal;
}

RunJournal::~RunJournal() {
  if (fd_ >= 0) ::close(fd_);
}

std::vector<std::pair<std::string, FileDigest>> RunJournal::Reuse(std::vector<Job>* jobs, int64_t* bytes) const {
  Pieces reused;
  std::vector<Job> left;
  for (Job& job : *jobs) {
    auto it = done_.find({job.name, job.part});
    bool intact = it != done_.end();
    for (size_t i = 0; intact && i < it->second.size(); ++i) {
      intact = ReadsBack(folder_ + "/" + it->second[i].first, it->second[i].second);
    }
    if (!intact) {
      left.push_back(std::move(job));
      continue;
    }
    for (const auto& piece : it->second) {
      reused.push_back(piece);
      *bytes += piece.second.bytes;
    }
  }
  *jobs = std::move(left);
  return reused;
}

void RunJournal::RecordWhenDone(std::vector<Job>* jobs) {
  for (Job& job : *jobs) {
    if (!Recordable(job.name)) continue;
    job.run = [this, run = std::move(job.run), name = job.name, part = job.part](JobContext& ctx) -> Status {
      Pieces pieces;
      JobContext recording{ctx.dir, ctx.buffer, ctx.done, [&](const std::string& file, const FileDigest& digest) {
                             pieces.emplace_back(file, digest);
                             if (ctx.wrote) ctx.wrote(file, digest);
                           }};
      RESHARD_RETURN_IF_ERROR(run(recording));
      for (const auto& piece : pieces) {
        if (!Recordable(piece.first)) return Status::Ok();
      }
      Append(JobLine(name, part, pieces));
      return Status::Ok();
    };
  }
}

void RunJournal::Append(const std::string& line) {
  // One write per line, appended (O_APPEND), so the lines of several
  // workers, or processes, never interleave. A journal that cannot be
  // written only costs the reuse.
  std::lock_guard<std::mutex> lock(mu_);
  WriteFully(fd_, reinterpret_cast<const uint8_t*>(line.data()), line.size());
}

Status RunJournal::Remove(const std::string& folder) {
  const std::string path = JournalPath(folder);
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    return Status::IoError("cannot remove " + path + ": " + std::strerror(errno));
  }
  return Status::Ok();
}

}  // namespace reshard
