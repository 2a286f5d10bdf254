// CheckpointFiles: the files of one DeepSpeed checkpoint tag folder, sorted
// into their families by parsing the integers out of their names.
//
// Nothing here opens a file; it only lists and classifies, and refuses paths
// that cannot be a checkpoint with one line naming the problem and the fix.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "reshard/status.h"

namespace reshard {

struct OptimizerFileName {
  int dp_rank = 0;
  int mp_rank = 0;
  bool bf16 = false;  // bf16_zero_pp_rank_* (vs zero_pp_rank_*)
  std::string path;
};

struct CheckpointFiles {
  std::string root_dir;  // the folder holding `latest` (the tag folder's parent)
  std::string tag_dir;   // the folder holding the files
  std::string tag;       // basename of tag_dir
  // layer id -> TP rank -> path of layer_{id}-model_{tp}-model_states.pt
  std::map<int, std::map<int, std::string>> layer_files;
  // mp index -> path of mp_rank_{mp}_model_states.pt
  std::map<int, std::string> mp_rank_files;
  std::vector<OptimizerFileName> optimizer_files;
  // ZeRO-3: mp index -> DP rank -> path of zero_pp_rank_{d}_mp_rank_{mp}_model_states.pt
  std::map<int, std::map<int, std::string>> zero3_model_files;
  std::vector<std::string> other_files;  // names reshard does not recognise

  // ZeRO-3 writes per-DP-rank model states instead of mp_rank files.
  bool IsZero3() const { return !zero3_model_files.empty(); }

  // Number of distinct TP ranks among the layer files (0 without layer files).
  int LayerTpSize() const;
};

// "mp_rank_00_model_states.pt" for ".../global_step20/mp_rank_00_model_states.pt".
std::string BaseName(const std::string& path);

// Names as DeepSpeed spells them (indices zero-padded to two digits).
std::string LayerName(int layer_id);                    // "layer_04"
std::string LayerFileName(int layer_id, int tp_rank);   // "layer_04-model_01-model_states.pt"
std::string ModelStatesName(int mp_rank);               // "mp_rank_02"
std::string ModelStatesFileName(int mp_rank);           // "mp_rank_02_model_states.pt"

// `path` is a tag folder (holding mp_rank_* files) or a checkpoint root whose
// `latest` file names the tag. Errors are InvalidInput.
Result<CheckpointFiles> ScanCheckpoint(const std::string& path);

// Checks that the files form a complete grid: every layer id has TP ranks
// 0..TP-1 (the same TP for all), mp_rank files 0..TP*PP-1, and optimizer files
// for every (dp, mp). Fills *tp, *pp, *dp (dp = 0 without optimizer files).
Status CheckRankGrid(const CheckpointFiles& files, int* tp, int* pp, int* dp);

}  // namespace reshard
