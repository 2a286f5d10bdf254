// CheckpointFiles: the files of one DeepSpeed checkpoint tag folder, sorted
// into their families by parsing the integers out of their names.
//
// Nothing here opens a file; it only lists and classifies, and refuses paths
// that cannot be a checkpoint with one line naming the problem and the fix.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "formats/deepspeed/files/file_names.h"
#include "reshard/status.h"

namespace reshard {

struct OptimizerShardFile {
  int dp_rank = 0;
  int mp_rank = 0;
  bool bf16 = false;  // bf16_zero_pp_rank_* (vs zero_pp_rank_*)
  std::string path;
};

struct CheckpointFiles {
  std::string root_dir;  // the folder holding `latest` (the tag folder's parent)
  std::string tag_dir;   // the folder holding the files
  std::string tag;       // basename of tag_dir
  bool via_root = false; // opened through the root's `latest`, not as the tag folder
  // layer id -> TP rank -> path of layer_{id}-model_{tp}-model_states.pt
  std::map<int, std::map<int, std::string>> layer_files;
  // mp index -> path of mp_rank_{mp}_model_states.pt
  std::map<int, std::string> mp_rank_files;
  std::vector<OptimizerShardFile> optimizer_files;
  // ZeRO-3: mp index -> DP rank -> path of zero_pp_rank_{d}_mp_rank_{mp}_model_states.pt
  std::map<int, std::map<int, std::string>> zero3_model_files;
  // MoE: mp index -> MoE layer of the stage (-1: the old form without one)
  // -> global expert id -> path of layer_{m}_expert_{e}_mp_rank_{mp}_model_states.pt
  std::map<int, std::map<int, std::map<int, std::string>>> expert_files;
  // MoE: mp index -> EP rank -> path of expp_rank_{ep}_mp_rank_{mp}_optim_states.pt
  std::map<int, std::map<int, std::string>> expert_optimizer_files;
  // A universal checkpoint's zero/ folder ("" for other checkpoints), and
  // the files in it (listed by universal_reader.h).
  std::string universal_dir;
  std::vector<std::string> universal_files;
  std::string manifest;  // reshard-manifest.json of a checkpoint reshard wrote ("" when none)
  std::vector<std::string> other_files;  // names reshard does not recognise
  std::vector<std::string> root_scripts;  // kRootScripts present in root_dir

  // Every file above, as paths.
  std::vector<std::string> Paths() const;

  // ZeRO-3 writes per-DP-rank model states instead of mp_rank files.
  bool IsZero3() const { return !zero3_model_files.empty(); }
  // DeepSpeed's MoE save: expert files (and expp_rank files) beside mp_rank
  // files that hold the rest of the model, no layer files.
  bool IsMoe() const { return !expert_files.empty() || !expert_optimizer_files.empty(); }
  // DeepSpeed's universal checkpoint: per-parameter files under zero/ beside
  // the mp_rank files, no layer or optimizer shard files.
  bool IsUniversal() const { return !universal_dir.empty() && layer_files.empty() && optimizer_files.empty(); }

  // Number of distinct TP ranks among the layer files (0 without layer files).
  int LayerTpSize() const;
};

// `path` is a tag folder (holding mp_rank_* files) or a checkpoint root whose
// `latest` file names the tag. Errors are InvalidInput.
Result<CheckpointFiles> ScanCheckpoint(const std::string& path);

// The tag folder the `latest` file of the root `path` names, or `path` itself
// when it holds no `latest` naming one folder inside it.
std::string FollowLatest(const std::string& path);

// The subfolders of `dir` that look like tag folders (holding
// mp_rank_00_model_states.pt), sorted by name.
std::vector<std::string> TagFoldersIn(const std::string& dir);

// Checks that the files form a complete grid: every layer id has TP ranks
// 0..TP-1 (the same TP for all), mp_rank files 0..TP*PP-1, and optimizer files
// for every (dp, mp). Fills *tp, *pp, *dp (dp = 0 without optimizer files).
Status CheckRankGrid(const CheckpointFiles& files, int* tp, int* pp, int* dp);

}  // namespace reshard
