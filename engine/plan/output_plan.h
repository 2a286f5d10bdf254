// OutputPlan: everything a conversion or export writes, as one data type.
//
// Every target format plans into it: the files of the output, each with its
// container (a torch.save file, a safetensors file, a text file, a copied
// file) and the tensors it holds (key, dtype, shape, where the elements come
// from), and how the finished output is published. exec/plan_writer turns
// any OutputPlan into jobs; `--dry-run` prints any with PlanText.
//
// A plan holds no tensor data: the tensors of a file are produced while it
// is written (ByteProducer), as a Distributed Checkpoint planner resolves a
// write item's data only when it is written. A torch file's pickled tree may
// even be built only then, so that a plan of many files holds the trees of
// the files being written and no others.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "container/dcp_writer.h"
#include "container/safetensors_writer.h"
#include "container/scratch_file.h"
#include "pickle/value.h"

namespace reshard {

// A small file written beside an output once it is in place, such as the
// name of the newest checkpoint that a format's readers follow.
struct PointerFile {
  std::string name;                 // in the folder holding the output
  std::optional<std::string> text;  // what it holds; unset: the output folder's name
};

// How a finished output is announced, as its format declares it: what is
// written into the folder holding it, after it is in place.
struct Publication {
  // When set, the output is the folder of this name inside the output path
  // given, which then holds the copies and pointers: a root given as the
  // input gives a root.
  std::string output_subfolder;
  // Paths of files copied there; one already there of the same name is kept.
  std::vector<std::string> copies;
  // Written after the copies, each atomically, in this order: readers follow
  // the last, so it goes last.
  std::vector<PointerFile> pointers;
  // Files whose presence makes a folder a checkpoint root of the format (a
  // `latest`): beside a tag folder, the copies and pointers go only into such
  // a root or a folder made for the output (exec/output_folder.h's PlaceOutput).
  std::vector<std::string> root_markers;
  // The folder of the input whose pointers these are: an output placed in
  // it would change which checkpoint the input names, which is modifying the
  // input. `protected_hint` says what to do instead.
  std::string protected_folder;
  std::string protected_hint;
};

// One tensor of a planned file.
struct PlannedTensor {
  std::string key;  // its place in the file: dict keys and list indices joined by '/'
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  std::string from;  // where its elements come from ("" when it is not said)
};

// A safetensors file: its tensors, where each lies, and the byte ranges it
// is written as (each a job, so that several workers share a big file).
struct SafetensorsContent {
  std::vector<SafetensorsTensor> tensors;
  SafetensorsLayout layout;
  std::vector<int64_t> cuts;  // from 0 to the file's size
};

// A `.distcp` file of a Distributed Checkpoint: its items placed, and the
// runs of items it is written as (each a job, so that several workers share
// a big file).
struct DcpFileContent {
  DcpFileLayout layout;
  std::vector<size_t> cuts;  // item indices, from 0 to the item count
};

// What a file is to the training run that loads it, where its format says
// (the DeepSpeed layouts do): which rank of the target layout loads it and
// what part of the rank's state it holds. What reads one rank's share of a
// plan without writing it (reshard::Checkpoint) selects files by.
struct FileRole {
  enum class Holds { kWeights, kOptimizer };
  Holds holds = Holds::kWeights;
  int tp = 0, pp = 0;
  int dp = -1;  // kOptimizer: the DP rank; -1 for files every DP rank loads
  // The entry of the file's tree that holds it ("" = the whole tree), and,
  // for kWeights, the prefix its tensors' keys get in the rank's state dict
  // ("layer_02.").
  std::string entry;
  std::string prefix;
  int ep = -1;  // DeepSpeed MoE: the EP rank that loads it; -1 for files every EP rank loads
};

struct PlannedFile {
  enum class Container { kTorch, kSafetensors, kDcp, kText, kCopy };

  std::string name;  // its path in the output folder
  Container container = Container::kTorch;
  std::string what;   // for people: what it is ("stage 0, TP rank 1 optimizer, DP rank 0")
  int64_t bytes = 0;  // the tensor bytes it streams: its job's size and progress
  std::vector<PlannedTensor> tensors;  // in file order
  // Lines the detailed dry run prints under the tensors, for what a list of
  // tensors cannot say (how a flat optimizer group is partitioned).
  std::vector<std::string> detail;
  std::vector<FileRole> roles;  // empty where the format does not say

  // kTorch: builds the pickled tree, its tensors produced while written.
  std::function<Result<Value>()> tree;
  // kSafetensors.
  std::shared_ptr<const SafetensorsContent> safetensors;
  std::shared_ptr<const DcpFileContent> dcp;
  std::string text;     // kText: what it holds (text, or a DCP `.metadata` pickle)
  // kCopy: the path of the file copied. kTorch: a file that may hold the
  // same content, which the file is then a copy of (where `copy_holds`).
  std::string copy_of;
  std::function<bool()> copy_holds;
};

struct OutputPlan {
  // The plan's first lines: the target and what a file list cannot say
  // (stage bounds, vocabulary padding, ...).
  std::string summary;
  std::vector<PlannedFile> files;  // written in this order (ties of the executor's size order)
  Publication publication;
  // Bytes a job may hold beyond its worker's buffer (the pieces of a
  // transpose), which --max-memory must leave room for in every worker; and
  // the folder those pieces spill to, named when the writing starts.
  int64_t scratch_bytes = 0;
  std::shared_ptr<ScratchFolder> scratch;
  // Source bytes the producers have read; they add to it while they run.
  std::shared_ptr<std::atomic<int64_t>> read = std::make_shared<std::atomic<int64_t>>(0);
};

// A torch.save file of `tree`, listed and sized now.
Result<PlannedFile> TorchFile(std::string name, std::string what, Value tree);

// The same for the tree `make` builds, which is built again when the file is
// written (here once, to list and size it), so that a plan of many files
// holds only the trees of the files being written.
Result<PlannedFile> TorchFile(std::string name, std::string what, std::function<Result<Value>()> make);

PlannedFile TextFile(std::string name, std::string text);

// The `.distcp` file `layout` in `folder` of the output ("" for its top),
// written as runs of items of about `part_bytes`. Its tensors are the
// chunks, each named by its key and, when it is not the whole tensor, its
// box (`w[0:4, 0:6]`); the detail lists its bytes items.
PlannedFile DcpDataFile(const std::string& folder, std::string what, DcpFileLayout layout,
                        int64_t part_bytes);

// The `.metadata` in `folder` of the checkpoint whose data files are
// `files` (DcpDataFile's): the pickle that indexes every item.
Result<PlannedFile> DcpMetadataFile(const std::string& folder, const std::vector<const PlannedFile*>& files,
                                    const DcpMetadataOptions& options = {});

// A copy of the file at `from`. `counted`: its bytes are tensor bytes (a
// checkpoint file copied whole), which the progress counts.
PlannedFile CopiedFile(std::string name, std::string from, bool counted);

// Has the torch file `f` written as a copy of the file `from` where `holds`
// (asked as the file is written) says that the copy holds its content, and
// from its tree where not; it keeps its listing (what, tensors, sources).
void CopyWhereSame(PlannedFile* f, std::string from, std::function<bool()> holds);

// Sets where the tensor `key` of `file` comes from, for the dry run.
void SetFrom(PlannedFile* file, const std::string& key, std::string from);
// Sets `from` of every tensor of `file` that has none yet whose key starts
// with `prefix`.
void SetUnsaidFrom(PlannedFile* file, const std::string& prefix, const std::string& from);


// The plan for people: its summary, each file with what it is, its tensor
// count and bytes, with `detail` every tensor and where it comes from, then
// the total.
std::string PlanText(const OutputPlan& plan, bool detail);

}  // namespace reshard
