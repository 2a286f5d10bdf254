// The commands that write a checkpoint: open, check, plan, execute, commit,
// then publish what the target format writes beside the output.
// reshard::Convert plans with the source's own format, reshard::Export with
// another one.
#include <malloc.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>

#include "api/cluster_progress.h"
#include "api/common.h"
#include "reshard/cluster.h"
#include "container/mapped_file.h"
#include "container/record_crc.h"
#include "exec/executor.h"
#include "exec/journal.h"
#include "exec/manifest.h"
#include "exec/memory_budget.h"
#include "exec/output_folder.h"
#include "exec/plan_writer.h"
#include "formats/registry.h"
#include "reshard/reshard.h"
#include "util/human.h"
#include "util/strings.h"

namespace reshard {
namespace {

// Checks the output folder and what the plan publishes beside it, in `place`.
Result<OutputFolder> CheckOutput(const std::string& input, const SourceCheckpoint& src, const OutputPlace& place,
                                 const WriteOptions& options, const Publication& publication) {
  RESHARD_ASSIGN_OR_RETURN(OutputFolder out,
                           OutputFolder::Check(place.folder, {input, src.info().tag_dir}, options.overwrite));
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path parent = fs::path(out.path()).parent_path();
  if (!publication.protected_folder.empty() && fs::equivalent(parent, publication.protected_folder, ec)) {
    return Status::InvalidInput("the output folder " + out.path() + " is beside the input in " +
                                parent.string() + ", " + publication.protected_hint);
  }
  if (!place.root.empty()) {
    RESHARD_RETURN_IF_ERROR(CheckPointers(place.root, PointerTexts(publication, out.path()), options.overwrite));
  }
  return out;
}

// Moves the finished folder into place, then what the plan publishes into
// `root` ("" when nothing may be).
Status Publish(OutputFolder* out, const Publication& publication, const std::string& root,
               std::vector<std::string>* notes) {
  RESHARD_RETURN_IF_ERROR(out->Commit());
  if (!out->kept().empty()) {
    notes->push_back("kept the old output as " + out->kept() + ": something no reshard run wrote was put into it "
                     "during this run");
  }
  if (root.empty()) return Status::Ok();
  for (const std::string& from : publication.copies) {
    const std::string name = std::filesystem::path(from).filename().string();
    RESHARD_ASSIGN_OR_RETURN(bool copied, CopyIntoRoot(from, root));
    notes->push_back(copied ? "copied " + name + " from the source root beside the output"
                            : name + " already exists beside the output; left as it is");
  }
  return WriteFilesInOrder(root, PointerTexts(publication, out->path()));
}

// Times the phases of a conversion.
class PhaseClock {
 public:
  explicit PhaseClock(ConvertReport* report) : report_(report) {}
  // Ends the current phase under `name`.
  void End(const std::string& name) {
    const auto now = std::chrono::steady_clock::now();
    report_->phases.emplace_back(name, std::chrono::duration<double>(now - last_).count());
    last_ = now;
  }
  double Total() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }

 private:
  ConvertReport* report_;
  const std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point last_ = start_;
};

// The bytes of the checkpoint files at `paths`, for the report.
int64_t FilesBytes(const std::vector<std::string>& paths) {
  int64_t total = 0;
  for (const std::string& path : paths) {
    std::error_code ec;
    const auto size = std::filesystem::file_size(path, ec);
    if (!ec) total += static_cast<int64_t>(size);  // only a figure for the report
  }
  return total;
}

// The files `jobs` write, each once (several jobs may write parts of one).
std::vector<std::string> FilesOf(const std::vector<Job>& jobs) {
  std::set<std::string> names;
  for (const Job& job : jobs) names.insert(job.name);
  return {names.begin(), names.end()};
}

// The bytes this process wrote into `dir`: its jobs' pieces, and the manifest when `root`.
int64_t WrittenBytes(const std::string& dir, const std::multimap<std::string, FileDigest>& pieces, bool root) {
  int64_t total = 0;
  for (const auto& entry : pieces) total += entry.second.bytes;
  struct stat st;
  if (root && ::stat((dir + "/" + kManifestName).c_str(), &st) == 0) total += static_cast<int64_t>(st.st_size);
  return total;
}

// Every process of a cluster passes its status and all get the first
// failure; alone, a process keeps its own.
Status AllOk(Cluster* cluster, const Status& mine) {
  return cluster != nullptr ? cluster->AllOk(mine) : mine;
}

bool IsRoot(const Cluster* cluster) { return cluster == nullptr || cluster->rank() == 0; }

// Makes this process's figures of what was written and read the whole job's
// on every process of a cluster: bytes summed, peak memory the largest.
Status AddUpRanks(Cluster* cluster, ConvertReport* report) {
  if (cluster == nullptr || cluster->size() == 1) return Status::Ok();
  RESHARD_ASSIGN_OR_RETURN(std::vector<std::string> all,
                           cluster->AllGather(std::to_string(report->bytes_written) + " " +
                                              std::to_string(report->bytes_read) + " " +
                                              std::to_string(report->peak_memory)));
  report->bytes_written = report->bytes_read = report->peak_memory = 0;
  for (const std::string& figures : all) {
    std::istringstream in(figures);
    int64_t written = 0, read = 0, peak = 0;
    if (!(in >> written >> read >> peak)) return Status::Internal("a rank's figures do not parse: '" + figures + "'");
    report->bytes_written += written;
    report->bytes_read += read;
    report->peak_memory = std::max(report->peak_memory, peak);
  }
  return Status::Ok();
}

// The staging folder: made (or a killed run's of the same fingerprint taken
// over, see RunJournal) by the first process, with a new journal when none
// was taken over, and announced to the others, with whether it was taken over.
Result<std::pair<std::string, bool>> BeginOutput(OutputFolder* out, const std::string& fingerprint,
                                                 Cluster* cluster) {
  Status begun = Status::Ok();
  if (IsRoot(cluster)) {
    begun = out->Begin(fingerprint);
    if (begun.ok() && !fingerprint.empty() && out->resumed().empty()) {
      begun = RunJournal::Create(out->staging_dir(), fingerprint);
    }
  }
  RESHARD_RETURN_IF_ERROR(AllOk(cluster, begun));
  const std::string mine = (out->resumed().empty() ? "0" : "1") + out->staging_dir();
  std::string root = mine;
  if (cluster != nullptr) {
    RESHARD_ASSIGN_OR_RETURN(root, cluster->Broadcast(mine));
  }
  return std::make_pair(root.substr(1), root[0] == '1');
}

// Everything before writing: open, check, plan, size the buffers, make this
// process's jobs. On error, processes of a cluster still meet (see
// Execute), so it returns a status.
struct Prepared {
  std::unique_ptr<SourceCheckpoint> src;
  std::optional<OutputPlan> plan;
  std::vector<std::string> files;  // every job's file, of all processes
  std::vector<Job> jobs;  // this process's share
  std::mutex digests_mu;
  std::multimap<std::string, FileDigest> pieces;  // of this process's files, as its jobs report them
  ExecuteOptions exec;
  std::optional<OutputFolder> out;
  std::string root;  // where the publication goes ("" = nowhere), from PlaceOutput
  std::string fingerprint;              // of this run, for resuming it ("" = never)
  std::unique_ptr<RunJournal> journal;  // in the staging folder, when there is a fingerprint
};

// What makes a rerun the same run, for RunJournal: the command as given
// (from the same folder), the source files as they are now, and the plan.
// "" (no resuming) when the caller gave no command line.
std::string RunFingerprint(const Prepared& p, const WriteOptions& options) {
  if (options.command.empty()) return "";
  std::error_code ec;
  std::string text = std::string("reshard ") + RESHARD_VERSION + "\n" + std::filesystem::current_path(ec).string() +
                     "\n" + options.command + "\n" + p.src->info().tag_dir + "\n" + PlanText(*p.plan, false);
  for (const std::string& file : p.src->info().files) {
    struct stat st;
    if (::stat(file.c_str(), &st) != 0) return "";
    text += file + " " + std::to_string(st.st_size) + " " + std::to_string(st.st_mtim.tv_sec) + "." +
            std::to_string(st.st_mtim.tv_nsec) + "\n";
  }
  return Fingerprint(text);
}

// On a killed run's staging folder (`resumed`, its name; "" when another
// process took it over): takes out of this process's jobs those whose files
// are there intact, and counts their pieces as written.
void ReuseFinishedJobs(Prepared* p, const std::string& resumed, ConvertReport* report) {
  const size_t planned = p->jobs.size();
  int64_t bytes = 0;
  for (auto& [name, digest] : p->journal->Reuse(&p->jobs, &bytes)) p->pieces.emplace(name, digest);
  report->notes.push_back("resumed the killed run's output" + (resumed.empty() ? "" : " (" + resumed + ")") + ": " +
                          std::to_string(planned - p->jobs.size()) + " of " + std::to_string(planned) +
                          " jobs reused (" + HumanBytes(bytes) + ", each file read back and its CRC checked)");
}

// Threads and buffers from the memory budget.
Status SizeBuffers(const WriteOptions& options, int64_t scratch_bytes, ExecuteOptions* exec,
                   ConvertReport* report) {
  RESHARD_ASSIGN_OR_RETURN(MemoryBudget memory, MemoryBudget::Plan(options.max_memory, ThreadCount(options.threads),
                                                                   scratch_bytes, options.buffer_size));
  report->memory_budget = memory.budget;
  report->memory_estimate = memory.Estimate();
  report->buffer_bytes = memory.buffer_bytes;
  report->threads = memory.threads;
  exec->threads = memory.threads;
  exec->buffer_bytes = memory.buffer_bytes;
  return Status::Ok();
}

// How a command plans its output from the opened source.
using PlanMaker = std::function<Result<OutputPlan>(const SourceCheckpoint& src, std::vector<std::string>* notes)>;

Status Prepare(const std::string& input, const std::string& output, const WriteOptions& options,
               const PlanMaker& make_plan, PhaseClock* clock, Prepared* p,
               ConvertReport* report) {
  RESHARD_ASSIGN_OR_RETURN(p->src, OpenCheckpoint(input, options));
  RESHARD_RETURN_IF_ERROR(CheckVocabSize(*p->src, options.vocab_size));
  report->notes = OpenNotes(*p->src, options);
  report->checkpoint_bytes = FilesBytes(p->src->info().files);
  clock->End("load");
  RESHARD_ASSIGN_OR_RETURN(p->plan, make_plan(*p->src, &report->notes));
  report->plan = PlanText(*p->plan, options.dry_run);
  const Publication& publication = p->plan->publication;
  OutputPlace place = PlaceOutput(output, publication);
  RESHARD_ASSIGN_OR_RETURN(OutputFolder folder, CheckOutput(input, *p->src, place, options, publication));
  p->out.emplace(std::move(folder));
  p->root = place.root;
  for (std::string& note : place.notes) report->notes.push_back(std::move(note));
  RESHARD_RETURN_IF_ERROR(SizeBuffers(options, p->plan->scratch_bytes, &p->exec, report));
  std::vector<Job> all = PlanJobs(*p->plan);
  p->files = FilesOf(all);
  report->files = static_cast<int64_t>(p->files.size()) + 1;  // and the manifest
  report->tensor_bytes = JobBytes(all);
  p->exec.wrote = [p](const std::string& name, const FileDigest& digest) {
    std::lock_guard<std::mutex> lock(p->digests_mu);
    p->pieces.emplace(name, digest);
  };
  const Cluster* cluster = options.cluster;
  p->jobs = JobsOfRank(std::move(all), cluster != nullptr ? cluster->rank() : 0,
                       cluster != nullptr ? cluster->size() : 1);
  if (!options.dry_run) p->fingerprint = RunFingerprint(*p, options);
  clock->End("plan");
  return Status::Ok();
}

// The digests of every process's files ("crc bytes offset name" lines between processes).
Result<std::map<std::string, FileDigest>> GatherDigests(const Prepared& p, Cluster* cluster) {
  if (cluster == nullptr) return WholeFiles(p.pieces);
  std::string mine;
  for (const auto& [name, d] : p.pieces) {
    mine += std::to_string(d.crc32) + " " + std::to_string(d.bytes) + " " + std::to_string(d.offset) + " " + name + "\n";
  }
  RESHARD_ASSIGN_OR_RETURN(std::vector<std::string> all, cluster->AllGather(mine));
  std::multimap<std::string, FileDigest> pieces;
  for (const std::string& lines : all) {
    std::istringstream in(lines);
    FileDigest d;
    std::string name;
    while (in >> d.crc32 >> d.bytes >> d.offset && std::getline(in >> std::ws, name)) pieces.emplace(name, d);
  }
  return WholeFiles(pieces);
}

// How many source records were read in part only. Under a cluster each
// process joins the pieces the others read into its own, so that a record
// the processes read between them is checked whole, and a record still read
// in part is counted once however many processes read some of it.
Result<int64_t> JoinRankReads(Cluster* cluster) {
  if (cluster == nullptr || cluster->size() == 1) return static_cast<int64_t>(PartlyReadRecords().size());
  RESHARD_ASSIGN_OR_RETURN(std::vector<std::string> pieces, cluster->AllGather(PartlyReadPieces()));
  Status joined = Status::Ok();
  for (int r = 0; r < cluster->size() && joined.ok(); ++r) {
    if (r != cluster->rank()) joined = JoinPartlyReadPieces(pieces[r]);
  }
  // Every process meets here, whatever it joined.
  RESHARD_ASSIGN_OR_RETURN(std::vector<std::string> lists, cluster->AllGather(Join(PartlyReadRecords(), "\n")));
  RESHARD_RETURN_IF_ERROR(joined);
  std::set<std::string> records;
  for (const std::string& list : lists) {
    std::istringstream in(list);
    for (std::string record; std::getline(in, record);) records.insert(record);
  }
  return static_cast<int64_t>(records.size());
}

// reshard-manifest.json in the staging folder, from every file's digest.
Status WriteManifest(const Prepared& p, const WriteOptions& options,
                     const std::map<std::string, FileDigest>& digests) {
  Manifest manifest{std::string("reshard ") + RESHARD_VERSION, options.command, p.src->info().tag_dir,
                    p.src->info().summary, digests};
  for (const std::string& file : p.files) {
    if (!digests.count(file)) return Status::Internal("the job writing " + file + " reported no digest");
  }
  const std::string path = p.exec.dir + "/" + kManifestName;
  std::ofstream out(path, std::ios::trunc);
  out << ManifestJson(manifest);
  out.close();
  return out.good() ? Status::Ok() : Status::IoError("cannot write " + path);
}

// Writes this process's share of the plan into the staging folder; the first
// process moves the folder into place, and publishes it, once every process is done.
Status Execute(Prepared* p, const WriteOptions& options, PhaseClock* clock,
               ConvertReport* report) {
  Cluster* cluster = options.cluster;
  RESHARD_ASSIGN_OR_RETURN(auto staging, BeginOutput(&*p->out, p->fingerprint, cluster));
  p->exec.dir = staging.first;
  for (const std::string& left : p->out->leftovers()) {
    report->notes.push_back("removed " + left + ", left beside the output by a run that was killed");
  }
  if (!p->fingerprint.empty()) {
    RESHARD_ASSIGN_OR_RETURN(p->journal, RunJournal::Open(p->exec.dir));
    if (staging.second) ReuseFinishedJobs(p, p->out->resumed(), report);  // the name is known to the first process
    p->journal->RecordWhenDone(&p->jobs);
  }
  ReleaseMappedPages();  // what reading the source's structure mapped
  ::malloc_trim(0);      // and the heap that parsing it used and freed
  ClusterProgress progress(cluster, options.progress);
  if (!progress.note().empty()) report->notes.push_back(progress.note());
  Status written = progress.Begin(ProgressBefore(p->jobs, p->exec.unit));
  if (written.ok()) {
    p->exec.progress = progress.Callback();
    written = reshard::Execute(p->jobs, p->exec);
  }
  progress.Finish();
  Result<std::map<std::string, FileDigest>> digests = GatherDigests(*p, cluster);  // all processes meet
  Result<int64_t> partly = JoinRankReads(cluster);                                  // and here
  if (written.ok()) written = digests.status();
  if (written.ok()) written = partly.status();
  if (written.ok() && IsRoot(cluster) && p->journal) written = RunJournal::Remove(p->exec.dir);
  if (written.ok() && IsRoot(cluster)) written = WriteManifest(*p, options, *digests);
  if (written.ok()) written = SyncFiles(p->exec.dir);
  if (written.ok()) written = CheckMappedFilesUnchanged();
  if (written.ok()) written = CheckReadRecords();
  RESHARD_RETURN_IF_ERROR(AllOk(cluster, written));
  clock->End("write");
  report->bytes_written = WrittenBytes(p->exec.dir, p->pieces, IsRoot(cluster));
  report->bytes_read = p->plan->read->load();
  report->peak_memory = PeakResidentBytes();
  RESHARD_RETURN_IF_ERROR(AddUpRanks(cluster, report));
  if (options.check_crc && *partly > 0) report->notes.push_back(PartlyReadRecordsNote(*partly));
  if (!IsRoot(cluster)) return Status::Ok();
  RESHARD_RETURN_IF_ERROR(Publish(&*p->out, p->plan->publication, p->root, &report->notes));
  clock->End("commit");
  return Status::Ok();
}

// Everything a writing command does once its plan is known.
Result<ConvertReport> WriteCheckpoint(const std::string& input, const std::string& output,
                                      const WriteOptions& options, const PlanMaker& make_plan) {
  ConvertReport report;
  PhaseClock clock(&report);
  Prepared p;
  Status ready = Prepare(input, output, options, make_plan, &clock, &p, &report);
  if (options.dry_run) {
    RESHARD_RETURN_IF_ERROR(ready);
  } else {
    RESHARD_RETURN_IF_ERROR(AllOk(options.cluster, ready));
    RESHARD_RETURN_IF_ERROR(Execute(&p, options, &clock, &report));
  }
  report.seconds = clock.Total();
  return report;
}

}  // namespace

Result<ConvertReport> Convert(const std::string& input, const std::string& output,
                              const ConvertOptions& options) {
  return WriteCheckpoint(input, output, options,
                         [&options](const SourceCheckpoint& src, std::vector<std::string>* notes) {
                           return PlanConvert(src, options, notes);
                         });
}

Result<ConvertReport> Export(const std::string& input, const std::string& output,
                             const ExportOptions& options) {
  return WriteCheckpoint(input, output, options,
                         [&options](const SourceCheckpoint& src, std::vector<std::string>* notes) {
                           return PlanExport(src, options, notes);
                         });
}

}  // namespace reshard
