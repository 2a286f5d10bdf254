#include "logical/logical_checkpoint.h"

#include <algorithm>
#include <cstdio>
#include <map>

#include "format/torch_file.h"
#include "formats/deepspeed/known_classes.h"
#include "logical/rule_selection.h"
#include "util/human.h"

namespace reshard {
namespace {

void AddFinding(LogicalCheckpoint* ckpt, Finding::Severity severity, std::string message) {
  ckpt->findings.push_back({severity, std::move(message)});
}
void AddError(LogicalCheckpoint* ckpt, std::string message) {
  AddFinding(ckpt, Finding::Severity::kError, std::move(message));
}

// "rules/megatron-gpt2.yaml:40", to point at the rule behind a finding.
std::string RuleWhere(const RuleSet& rules, const ParamRule& rule) {
  return rules.origin() + ":" + std::to_string(rule.line);
}

PickleReadOptions ReadOptions(const LoadOptions& options) {
  PickleReadOptions read;
  read.known_classes = &DeepSpeedKnownClasses();
  read.allowed_globals = options.allowed_classes;
  return read;
}

int64_t MetadataInt(const Value& root, const char* key, int64_t fallback) {
  int64_t v = fallback;
  if (const Value* f = Find(root, key)) ReadInt(*f, &v);
  return v;
}

// ---- mp_rank files ---------------------------------------------------------

Status ReadMetadata(const LoadOptions& options, LogicalCheckpoint* ckpt) {
  for (const auto& [mp, path] : ckpt->files.mp_rank_files) {
    RESHARD_ASSIGN_OR_RETURN(Value root, ReadTorchFile(path, ReadOptions(options)));
    if (DictItems(root) == nullptr) {
      return Status::InvalidInput(path + " does not hold a dict; it is not a DeepSpeed model-states file");
    }
    ckpt->metadata.push_back(std::move(root));
  }
  return Status::Ok();
}

// All mp_rank files of one save carry the same iteration.
void CheckIterations(LogicalCheckpoint* ckpt) {
  const int64_t first = MetadataInt(ckpt->metadata[0], "iteration",
                                    MetadataInt(ckpt->metadata[0], "global_steps", 0));
  ckpt->iteration = first;
  for (size_t i = 1; i < ckpt->metadata.size(); ++i) {
    const int64_t it = MetadataInt(ckpt->metadata[i], "iteration",
                                   MetadataInt(ckpt->metadata[i], "global_steps", 0));
    if (it != first) {
      AddError(ckpt, "mixed iterations: mp_rank_00 is iteration " + std::to_string(first) +
                         " but " + ModelStatesName(static_cast<int>(i)) + " is iteration " +
                         std::to_string(it) + "; the folder mixes files of different saves");
      return;
    }
  }
}

// Degrees from the file names must agree with what the metadata records.
void CrossCheckDegrees(LogicalCheckpoint* ckpt) {
  const Value& root = ckpt->metadata[0];
  const Value& args = ckpt->args();
  auto check = [&](const std::string& what, int64_t recorded, int64_t from_files,
                   const std::string& files_desc) {
    if (recorded >= 0 && recorded != from_files) {
      AddError(ckpt, what + " is " + std::to_string(recorded) + " in the metadata but the files show " +
                         std::to_string(from_files) + " (" + files_desc +
                         "); the folder is incomplete or mixes checkpoints");
    }
  };
  check("mp_world_size", MetadataInt(root, "mp_world_size", -1), ckpt->tp * ckpt->pp,
        std::to_string(ckpt->metadata.size()) + " mp_rank files");
  check("args.tensor_model_parallel_size", MetadataInt(args, "tensor_model_parallel_size", -1),
        ckpt->tp, "TP ranks of the layer files");
  check("args.pipeline_model_parallel_size",
        MetadataInt(args, "pipeline_model_parallel_size", -1), ckpt->pp,
        "mp_rank files / TP ranks");
  if (ckpt->dp > 0) {
    check("dp_world_size", MetadataInt(root, "dp_world_size", -1), ckpt->dp,
          "DP ranks of the optimizer shards");
  }
}

// ---- layer files -------------------------------------------------------------

Status ReadLayerFiles(const LoadOptions& options, LogicalCheckpoint* ckpt) {
  if (ckpt->files.layer_files.empty()) {
    return Status::InvalidInput(ckpt->files.tag_dir +
                                " has no layer_*-model_*-model_states.pt files; reshard needs the "
                                "per-layer weight files of a pipeline checkpoint");
  }
  for (const auto& [id, by_tp] : ckpt->files.layer_files) {
    LogicalLayer layer;
    layer.id = id;
    for (const auto& [t, path] : by_tp) {
      RESHARD_ASSIGN_OR_RETURN(Value root, ReadTorchFile(path, ReadOptions(options)));
      if (DictItems(root) == nullptr) {
        return Status::InvalidInput(path + " does not hold a state dict");
      }
      layer.roots.push_back(std::move(root));
    }
    ckpt->layers.push_back(std::move(layer));
  }
  return Status::Ok();
}

// Keys of TP rank `t`'s file, in order.
std::vector<std::string> KeysOf(const Value& root) {
  std::vector<std::string> keys;
  for (const auto& [k, v] : *DictItems(root)) {
    keys.push_back(k.is(Value::Kind::kString) ? k.as_string() : k.DebugString());
  }
  return keys;
}

// Checks one tensor of one layer across ranks and fills its full shape.
// Returns false (after adding findings) when it cannot be reshaped.
bool DescribeTensor(const LogicalLayer& layer, LogicalCheckpoint* ckpt, LogicalTensor* lt) {
  const std::string label = TensorLabel(layer.id, lt->key);
  for (size_t t = 0; t < layer.roots.size(); ++t) {
    const Value* v = Find(layer.roots[t], lt->key);
    if (v == nullptr || !v->is(Value::Kind::kTensor)) {
      AddError(ckpt, label + " is missing or not a tensor on TP rank " + std::to_string(t));
      return false;
    }
    const Tensor& tensor = v->as_tensor();
    if (!tensor.IsContiguous() || tensor.storage == nullptr ||
        tensor.storage_offset + tensor.numel() > tensor.storage->numel) {
      AddError(ckpt, label + " on TP rank " + std::to_string(t) +
                         " is not a contiguous view of its storage; reshard cannot read it");
      return false;
    }
    if (t == 0) {
      lt->dtype = tensor.storage->dtype;
      lt->local_shape = tensor.sizes;
    } else if (tensor.storage->dtype != lt->dtype || tensor.sizes != lt->local_shape) {
      AddError(ckpt, "inconsistent shapes across TP ranks: " + label + " is " +
                         DTypeName(lt->dtype) + ShapeString(lt->local_shape) + " on rank 0 but " +
                         DTypeName(tensor.storage->dtype) + ShapeString(tensor.sizes) +
                         " on rank " + std::to_string(t));
      return false;
    }
    lt->shards.push_back(&tensor);
  }
  const ParamRule& rule = *lt->rule;
  lt->full_shape = lt->local_shape;
  if (rule.policy == ParamRule::Policy::kReplicated) return true;
  const int dim = rule.dim;
  if (dim >= static_cast<int>(lt->local_shape.size())) {
    AddError(ckpt, label + " has " + std::to_string(lt->local_shape.size()) +
                       " dimension(s) but its rule (" + RuleWhere(*ckpt->rules, rule) + ") splits dim " +
                       std::to_string(dim));
    return false;
  }
  lt->full_shape[dim] *= ckpt->tp;
  if (lt->local_shape[dim] % rule.parts != 0) {
    AddError(ckpt, label + ": dim " + std::to_string(dim) + " of size " +
                       std::to_string(lt->local_shape[dim]) + " does not hold " +
                       std::to_string(rule.parts) + " equal parts (" + RuleWhere(*ckpt->rules, rule) + ")");
    return false;
  }
  if (!rule.blocks.empty()) {
    std::optional<int64_t> blocks = rule.blocks.Resolve(ckpt->metadata[0]);
    if (!blocks || *blocks <= 0) {
      AddError(ckpt, label + ": the rule's block count " + rule.blocks.ToString() +
                         " is not recorded in the checkpoint metadata");
      return false;
    }
    lt->blocks = *blocks;
    const int64_t part = lt->full_shape[dim] / rule.parts;
    if (part % lt->blocks != 0 || lt->blocks % ckpt->tp != 0) {
      AddError(ckpt, label + ": " + std::to_string(part) + " rows per part do not form " +
                         std::to_string(lt->blocks) + " blocks (" + rule.blocks.ToString() +
                         ") spread evenly over " + std::to_string(ckpt->tp) + " TP ranks");
      return false;
    }
  }
  return true;
}

// Matches every key of a layer against the rule set; reports unknown keys and
// required rules no key matched.
void DescribeLayer(LogicalLayer* layer, LogicalCheckpoint* ckpt) {
  const RuleSet& rules = *ckpt->rules;
  const std::vector<std::string> keys = KeysOf(layer->roots[0]);
  for (size_t t = 1; t < layer->roots.size(); ++t) {
    if (KeysOf(layer->roots[t]) != keys) {
      AddError(ckpt, LayerName(layer->id) + " files hold different keys on TP rank 0 and TP rank " +
                         std::to_string(t) + "; the checkpoint is inconsistent");
      return;
    }
  }
  std::set<const ParamRule*> used;
  for (const std::string& key : keys) {
    Result<const ParamRule*> rule = rules.Match(layer->role, key);
    if (!rule.ok()) {
      AddError(ckpt, TensorLabel(layer->id, key) + ": " + rule.status().message());
      continue;
    }
    if (*rule == nullptr) {
      AddError(ckpt, "unknown key " + TensorLabel(layer->id, key) + " (a " + layer->role +
                         " file): no rule of '" + rules.name() +
                         "' matches it; add one under layers." + layer->role + " in " +
                         rules.origin() + ", e.g. `- key: '" + key + "'` with split or replicated");
      continue;
    }
    used.insert(*rule);
    LogicalTensor lt;
    lt.key = key;
    lt.rule = *rule;
    if (DescribeTensor(*layer, ckpt, &lt)) layer->tensors.push_back(std::move(lt));
  }
  auto it = rules.layers().find(layer->role);
  if (it == rules.layers().end()) return;
  for (const ParamRule& rule : it->second) {
    if (!rule.optional && !used.count(&rule)) {
      AddError(ckpt, "missing key: " + LayerName(layer->id) + " (a " + layer->role +
                         " file) has no key matching '" + rule.key_pattern + "', which " +
                         RuleWhere(*ckpt->rules, rule) + " requires; mark the rule optional if the model "
                         "may lack it");
    }
  }
}

// The first key of `a` that `b` lacks; empty when there is none.
std::string FirstMissing(const std::vector<std::string>& a, const std::vector<std::string>& b) {
  for (const std::string& k : a) {
    if (std::find(b.begin(), b.end(), k) == b.end()) return k;
  }
  return "";
}

// Files of one role (every block, say) hold the same keys: a key missing from
// one of them means a damaged file, even where the rule is optional or also
// matches another key. `clean` are the layers whose keys the rules explain
// (the others have findings already).
void CheckSameKeysPerRole(const std::set<int>& clean, LogicalCheckpoint* ckpt) {
  std::map<std::string, const LogicalLayer*> first_of_role;
  for (const LogicalLayer& layer : ckpt->layers) {
    if (!clean.count(layer.id)) continue;
    auto [first, inserted] = first_of_role.emplace(layer.role, &layer);
    if (inserted) continue;
    const std::vector<std::string> want = KeysOf(first->second->roots[0]);
    const std::vector<std::string> have = KeysOf(layer.roots[0]);
    if (want == have) continue;
    const std::string here = LayerName(layer.id) + " (a " + layer.role + " file)";
    const std::string there = LayerName(first->second->id);
    if (std::string k = FirstMissing(want, have); !k.empty()) {
      AddError(ckpt, here + " lacks " + k + ", which " + there + " has; the file is damaged");
    } else if (std::string k = FirstMissing(have, want); !k.empty()) {
      AddError(ckpt, here + " has " + k + ", which " + there + " lacks; the checkpoint mixes models");
    } else {
      AddError(ckpt, here + " holds the keys of " + there + " in another order");
    }
  }
}

// ---- vocabulary ----------------------------------------------------------------

void DescribeVocab(LogicalCheckpoint* ckpt) {
  const RuleSet& rules = *ckpt->rules;
  const Value& meta = ckpt->metadata[0];
  for (const LogicalLayer& layer : ckpt->layers) {
    for (const LogicalTensor& t : layer.tensors) {
      if (t.rule->policy != ParamRule::Policy::kVocab) continue;
      if (ckpt->vocab.padded_rows == 0) {
        ckpt->vocab.padded_rows = t.full_shape[0];
      } else if (ckpt->vocab.padded_rows != t.full_shape[0]) {
        AddError(ckpt, "vocabulary tensors disagree: " + TensorLabel(layer.id, t.key) + " has " +
                           std::to_string(t.full_shape[0]) + " rows, others " +
                           std::to_string(ckpt->vocab.padded_rows));
      }
    }
  }
  ckpt->vocab.original_size = rules.vocab_original_size().Resolve(meta);
  ckpt->vocab.divisible_by = rules.vocab_divisible_by().Resolve(meta);
  ckpt->vocab.pad_to = rules.vocab_pad_to().Resolve(meta);
  if (ckpt->vocab.padded_rows == 0) return;
  const int64_t recorded = MetadataInt(ckpt->args(), "padded_vocab_size", -1);
  if (recorded >= 0 && recorded != ckpt->vocab.padded_rows) {
    AddError(ckpt, "args.padded_vocab_size is " + std::to_string(recorded) +
                       " but the vocabulary tensors have " +
                       std::to_string(ckpt->vocab.padded_rows) + " rows");
  }
  if (ckpt->vocab.original_size && *ckpt->vocab.original_size > ckpt->vocab.padded_rows) {
    AddError(ckpt, "the recorded vocabulary size " + std::to_string(*ckpt->vocab.original_size) +
                       " exceeds the " + std::to_string(ckpt->vocab.padded_rows) +
                       " rows of the vocabulary tensors");
  }
}

void CheckBlockCount(LogicalCheckpoint* ckpt) {
  const int64_t blocks = std::count_if(ckpt->specs.begin(), ckpt->specs.end(),
                                       [](const SpecEntry& s) { return s.role == "block"; });
  const int64_t recorded = MetadataInt(ckpt->args(), "num_layers", -1);
  if (recorded >= 0 && recorded != blocks) {
    AddError(ckpt, "args.num_layers is " + std::to_string(recorded) + " but the checkpoint has " +
                       std::to_string(blocks) + " transformer-block files");
  }
}

}  // namespace

bool LogicalCheckpoint::HasErrors() const { return !FirstError().ok(); }

Status LogicalCheckpoint::FirstError() const {
  for (const Finding& f : findings) {
    if (f.severity == Finding::Severity::kError) return Status::InvalidInput(f.message);
  }
  return Status::Ok();
}

const Value& LogicalCheckpoint::args() const {
  static const Value kNone;
  const Value* a = metadata.empty() ? nullptr : Find(metadata[0], "args");
  return a != nullptr ? *a : kNone;
}

const uint8_t* TensorData(const Tensor& t) {
  return t.storage->bytes.data + t.storage_offset * ElementSize(t.storage->dtype);
}

std::string TensorLabel(int layer_id, const std::string& key) {
  return LayerName(layer_id) + "/" + key;
}

Result<std::unique_ptr<LogicalCheckpoint>> LoadLogicalCheckpoint(const std::string& path,
                                                                 const LoadOptions& options) {
  RESHARD_ASSIGN_OR_RETURN(CheckpointFiles files, ScanCheckpoint(path));
  return LoadLogicalCheckpoint(std::move(files), options);
}

Result<std::unique_ptr<LogicalCheckpoint>> LoadLogicalCheckpoint(CheckpointFiles files,
                                                                 const LoadOptions& options) {
  auto ckpt = std::make_unique<LogicalCheckpoint>();
  ckpt->files = std::move(files);
  if (ckpt->files.IsZero3()) {
    return Status::Unsupported(ckpt->files.tag_dir +
                               " is a ZeRO-3 checkpoint (zero_pp_rank_*_model_states.pt), which "
                               "reshard does not read yet");
  }
  RESHARD_RETURN_IF_ERROR(CheckRankGrid(ckpt->files, &ckpt->tp, &ckpt->pp, &ckpt->dp));
  RESHARD_RETURN_IF_ERROR(ReadMetadata(options, ckpt.get()));
  const Value* module = Find(ckpt->metadata[0], "module");
  ckpt->pipeline = !ckpt->files.layer_files.empty() || module == nullptr || module->is_none();
  if (ckpt->pipeline) {
    RESHARD_RETURN_IF_ERROR(ReadLayerFiles(options, ckpt.get()));
  } else {
    // The DeepSpeed engine without pipelining numbers mp_rank files by TP rank.
    ckpt->tp = ckpt->pp;
    ckpt->pp = 1;
  }
  CheckIterations(ckpt.get());
  CrossCheckDegrees(ckpt.get());
  if (ckpt->dp == 0) ckpt->dp = std::max<int64_t>(1, MetadataInt(ckpt->metadata[0], "dp_world_size", 1));
  for (const std::string& other : ckpt->files.other_files) {
    AddError(ckpt.get(), "unrecognised file '" + other + "' in " + ckpt->files.tag_dir +
                             "; reshard does not know what it holds (move it out of the tag "
                             "folder if it does not belong to the checkpoint)");
  }
  if (!ckpt->pipeline) return ckpt;  // no layer files to explain: only DP can change

  RESHARD_ASSIGN_OR_RETURN(RuleChoice choice, ChooseRuleSet(*ckpt, options.rules));
  ckpt->rules = choice.rules;
  ckpt->numbering = choice.numbering;
  ckpt->specs = choice.specs;
  for (LogicalLayer& layer : ckpt->layers) layer.role = ckpt->specs[layer.id].role;
  CheckBlockCount(ckpt.get());
  std::set<int> clean;
  for (LogicalLayer& layer : ckpt->layers) {
    const size_t findings_before = ckpt->findings.size();
    DescribeLayer(&layer, ckpt.get());
    if (ckpt->findings.size() == findings_before) clean.insert(layer.id);
  }
  CheckSameKeysPerRole(clean, ckpt.get());
  DescribeVocab(ckpt.get());
  return ckpt;
}

}  // namespace reshard
