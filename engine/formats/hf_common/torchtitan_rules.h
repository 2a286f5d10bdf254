// The `torchtitan` section of a rule file (rules/rule_section.h): the
// tensors of the family's hf section under torchtitan's keys, how its TP plan
// places them, and config.json's fields as expressions of their sizes. Read
// by torchtitan and by the other formats that share its layout of a model
// and optimizer in one DCP folder (the DCP recipe, Accelerate).
#pragma once

#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "rules/rule_reader.h"
#include "rules/rule_section.h"
#include "rules/rule_set.h"

namespace reshard {

// One tensor of a torchtitan checkpoint (`torchtitan.tensors`): the HF
// tensor of the family's hf section it is, under torchtitan's key (several:
// alternatives, as torchtitan versions name it; the first is written).
struct TorchtitanTensor {
  int line = 0;
  std::string hf;                 // 'model.layers.{block}.self_attn.q_proj.weight'
  std::vector<std::string> keys;  // 'layers.{block}.attention.wq.weight', ...
  // The heads of a q or k projection whose rows torchtitan keeps as
  // interleaved rotary pairs (row 2i, 2i+1 of a head are HF's rows i and
  // hd/2 + i): a torchtitan.config expression; "" when the rows are HF's.
  std::string interleaved_heads;
  // How torchtitan's TP plan places it on the TP mesh (`tp`): Shard(tp_dim)
  // (a ColwiseParallel Linear's and any Embedding's 0, a RowwiseParallel
  // Linear's 1), each TP rank a run of whole `tp_blocks` (a torchtitan.config
  // expression, the heads; "": single rows or columns); -1: Replicate()
  // (SequenceParallel's norms).
  int tp_dim = -1;
  std::string tp_blocks;
};

// How torchtitan stores the family (`torchtitan`): the HF model under other
// keys. It records no model config: `config` gives config.json's fields as
// expressions of the tensors' sizes (torchtitan_config.h), literals, or
// nothing (then --set must).
struct TorchtitanLayout : RuleSection {
  static constexpr char kName[] = "torchtitan";
  // It reads no metadata path: its config gives expressions of sizes.
  void AddValuePaths(std::set<std::string>* paths) const override {}

  int line = 0;
  std::vector<std::pair<std::string, std::string>> config;  // config.json key -> expression
  std::vector<TorchtitanTensor> tensors;
  // Keys (templates with {block}) of buffers torchtitan recomputes when it
  // loads (freqs_cis): an import skips them.
  std::vector<std::string> ignore;
};

// Parses the section (RuleSectionParser::parse); it needs the hf section.
std::shared_ptr<const RuleSection> ParseTorchtitanSection(const Field& section, const RuleSet& so_far, RuleReader* in);

}  // namespace reshard
