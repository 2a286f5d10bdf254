// The parallel layout a torch_dist save was made at, read from the save
// itself where its args do not record it: only what the save shows for
// certain, whatever the family.
//
//   TP     every tensor the family splits over TP is written as one chunk per
//          TP rank and part along its TP dimension (replicas are written
//          once; a rank's rows of a tensor of several parts, SwiGLU's
//          [gate; up], lie in one piece per part): the number of distinct
//          chunk offsets along it over its parts, the same for all.
//   world  the number of ranks that wrote (dcp_content.h's WritingRanks).
//   PP     a rank writes only layers of its own pipeline stage, whatever
//          rank of its data-parallel group writes which: a rank that wrote
//          a chunk of every layer makes PP 1. A save whose ranks each wrote
//          some layers leaves PP (and DP) open: a PP 2 save and a PP 1, DP 2
//          save whose DP ranks shared the writing look the same.
//   DP     world / (TP x PP) once those are known.
//   EP     a rank that wrote a chunk of every expert of a layer makes EP 1;
//          else EP is open: which DP replica writes which expert chunk is
//          Megatron-Core's choice, so an EP 2 save and an EP 1, DP 2 save
//          may look the same.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "container/dcp_metadata.h"

namespace reshard {

// Sizes 0 where the save does not show them.
struct SavedLayout {
  int tp = 0, pp = 0, dp = 0, ep = 0;
};

// How the family splits a key over TP: its TP dimension in the key's own
// shape, and the parts stacked along it.
struct TpSplit {
  int dim = 0;
  int parts = 1;
};

// What the save's tensor keys are to the family: how it splits each key
// split over TP; the keys that stack the layers on their first axis, and how
// many layers they stack; those that stack the experts too.
struct SavedKeys {
  std::map<std::string, TpSplit> tp_splits;
  std::vector<std::string> stacked;
  int64_t layers = 0;
  // The keys that stack each layer's experts on their second axis, and how
  // many experts a layer has (0: none).
  std::vector<std::string> expert_stacked;
  int64_t experts = 0;
};

// `world`: the ranks that wrote the save (0: not known).
SavedLayout DeriveSavedLayout(const DcpMetadata& meta, int world, const SavedKeys& keys);

}  // namespace reshard
