// reshard::Checkpoint: a source opened once; tensors made when asked for,
// and a rank's files planned as Convert plans them but never written.
#include "reshard/checkpoint.h"

#include <atomic>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "api/common.h"
#include "api/tensor_bytes.h"
#include "formats/registry.h"

namespace reshard {

struct Checkpoint::Rep {
  OpenOptions options;
  std::unique_ptr<SourceCheckpoint> src;
  std::vector<FullTensor> full;
  std::vector<TensorMeta> metas;
  std::map<std::string, size_t> by_name;
  std::atomic<int64_t> read{0};
};

namespace {

Status FirstError(const std::vector<Finding>& findings) {
  for (const Finding& f : findings) {
    if (f.severity == Finding::Severity::kError) return Status::InvalidInput(f.message);
  }
  return Status::Ok();
}

// How the rule set cuts each weight, by canonical name (none without rules).
std::map<std::string, std::string> RulesByName(const SourceCheckpoint& src, ReplicatedPolicy replicated,
                                               std::atomic<int64_t>* read) {
  std::map<std::string, std::string> rules;
  std::vector<std::string> notes;
  Result<TpWeights> weights = src.WeightsForTp(TpCut{1, replicated, std::nullopt, ""}, &notes, read);
  if (!weights.ok()) return rules;
  for (const RankTensor& t : weights->ranks[0]) {
    if (t.rule != nullptr) rules[t.name] = t.rule->Describe();
  }
  return rules;
}

TensorMeta MetaOf(const FullTensor& t, const SourceInfo& info, const std::map<std::string, std::string>& rules) {
  auto rule = rules.find(t.param);
  return TensorMeta{t.name, t.section, t.param, t.state, DTypeName(t.dtype), t.shape,
                    t.state.empty() && rule != rules.end() ? rule->second : "", t.vocab,
                    t.vocab ? info.vocab_size.value_or(0) : 0};
}

std::string RankText(const RankSpec& r) {
  std::string text = "rank (tp_rank " + std::to_string(r.tp_rank) + ", pp_rank " + std::to_string(r.pp_rank) +
                     ", dp_rank " + std::to_string(r.dp_rank);
  if (r.ep != 1) text += ", ep_rank " + std::to_string(r.ep_rank);
  return text + ")";
}

std::string LayoutText(const RankSpec& r) {
  std::string text = "TP " + std::to_string(r.tp) + " x PP " + std::to_string(r.pp) + " x DP " + std::to_string(r.dp);
  return r.ep != 1 ? text + " (EP " + std::to_string(r.ep) + ")" : text;
}

Status CheckRank(const SourceCheckpoint& src, const RankSpec& r) {
  if (r.tp < 1 || r.pp < 1 || r.dp < 1 || r.ep < 1) {
    return Status::InvalidInput("tp, pp, dp and ep must each be at least 1");
  }
  if (r.ep != 1 && !src.info().has_experts) {
    return Status::InvalidInput("this checkpoint has no experts; leave ep at 1");
  }
  if (r.tp_rank < 0 || r.tp_rank >= r.tp || r.pp_rank < 0 || r.pp_rank >= r.pp || r.dp_rank < 0 ||
      r.dp_rank >= r.dp || r.ep_rank < 0 || r.ep_rank >= r.ep) {
    return Status::InvalidInput(RankText(r) + " is outside the layout " + LayoutText(r) + "; ranks count from 0");
  }
  return Status::Ok();
}

bool RoleOf(const FileRole& role, FileRole::Holds holds, const RankSpec& r) {
  return role.holds == holds && role.tp == r.tp_rank && role.pp == r.pp_rank &&
         (role.dp < 0 || role.dp == r.dp_rank) && (role.ep < 0 || role.ep == r.ep_rank);
}

// The file's tree, or its entry `entry`.
Result<Value> EntryOf(const PlannedFile& file, const std::string& entry) {
  if (!file.tree) return Status::Internal(file.name + " is planned without a tree");
  RESHARD_ASSIGN_OR_RETURN(Value tree, file.tree());
  if (entry.empty()) return tree;
  const Value* found = Find(tree, entry);
  if (found == nullptr) return Status::Internal(file.name + " has no entry " + entry);
  return *found;
}

// Every tensor of a (nested) dict-like `tree`, keyed by `prefix` and its
// keys joined with '.'.
Status AddTensors(const Value& tree, const std::string& prefix,
                  std::vector<std::pair<std::string, TensorBytes>>* out) {
  const Items* items = DictItems(tree);
  if (items == nullptr) return Status::Ok();
  for (const auto& [key, value] : *items) {
    if (!key.is(Value::Kind::kString)) continue;
    const std::string name = prefix + key.as_string();
    if (value.is(Value::Kind::kTensor)) {
      RESHARD_ASSIGN_OR_RETURN(TreeValue t, MakeTreeValue(value));
      out->emplace_back(name, std::move(t.tensor));
    } else {
      RESHARD_RETURN_IF_ERROR(AddTensors(value, name + ".", out));
    }
  }
  return Status::Ok();
}

}  // namespace

Checkpoint::Checkpoint(std::unique_ptr<Rep> rep) : rep_(std::move(rep)) {}
Checkpoint::~Checkpoint() = default;

Result<std::unique_ptr<Checkpoint>> Checkpoint::Open(const std::string& path, const OpenOptions& options) {
  auto rep = std::make_unique<Rep>();
  rep->options = options;
  RESHARD_ASSIGN_OR_RETURN(rep->src, OpenCheckpoint(path, options));
  RESHARD_RETURN_IF_ERROR(FirstError(rep->src->info().findings));
  RESHARD_RETURN_IF_ERROR(CheckVocabSize(*rep->src, options.vocab_size));
  std::vector<std::string> notes;
  RESHARD_RETURN_IF_ERROR(rep->src->CheckReplicas(options.replicated, &notes));
  const ReplicatedPolicy merge =
      options.replicated == ReplicatedPolicy::kCheck ? ReplicatedPolicy::kFirst : options.replicated;
  RESHARD_ASSIGN_OR_RETURN(rep->full, rep->src->FullTensors(merge, &rep->read));
  const std::map<std::string, std::string> rules = RulesByName(*rep->src, merge, &rep->read);
  for (const FullTensor& t : rep->full) {
    rep->by_name.emplace(t.name, rep->metas.size());
    rep->metas.push_back(MetaOf(t, rep->src->info(), rules));
  }
  return std::unique_ptr<Checkpoint>(new Checkpoint(std::move(rep)));
}

const std::string& Checkpoint::summary() const { return rep_->src->info().summary; }

const std::vector<TensorMeta>& Checkpoint::tensors() const { return rep_->metas; }

Result<TensorBytes> Checkpoint::Tensor(const std::string& name) const {
  auto it = rep_->by_name.find(name);
  if (it == rep_->by_name.end()) {
    return Status::InvalidInput("no tensor " + name + " in the checkpoint; keys() lists the canonical names");
  }
  const FullTensor& t = rep_->full[it->second];
  return MakeTensorBytes(t.dtype, t.shape, t.produce);
}

namespace {

// The plan Convert would make for the layout of `r`.
Result<OutputPlan> PlanLayout(const SourceCheckpoint& src, const OpenOptions& options, const RankSpec& r,
                              bool weights_only) {
  RESHARD_RETURN_IF_ERROR(CheckPipelineComputes(src));
  DeepSpeedPlanOptions convert;
  static_cast<PreflightOptions&>(convert) = options;
  convert.target_tp = r.tp;
  convert.target_pp = r.pp;
  convert.target_dp = r.dp;
  if (src.info().has_experts) convert.target_ep = r.ep;
  convert.weights_only = weights_only || options.weights_only;
  std::vector<std::string> notes;
  return src.Plan(convert, &notes);
}

Status NoFileFor(const SourceCheckpoint& src, const std::string& what, const RankSpec& r, const std::string& hint) {
  return Status::Unsupported("this " + src.info().kind + " checkpoint at " + LayoutText(r) + " has no " + what +
                             " for " + RankText(r) + "; " + hint);
}

}  // namespace

Result<std::vector<std::pair<std::string, TensorBytes>>> Checkpoint::StateDict(const RankSpec& rank) const {
  RESHARD_RETURN_IF_ERROR(CheckRank(*rep_->src, rank));
  if (rep_->src->info().kind == "ZeRO-3") {  // its weights too are partitioned over DP
    return NoFileFor(*rep_->src, "layer files", rank, "its ranks hold their weights as partitions in the optimizer "
                     "state; read them whole by name with tensor()");
  }
  RankSpec layout = rank;  // weights are the same at every DP size EP divides
  layout.dp = rank.ep;
  layout.dp_rank = 0;
  RESHARD_ASSIGN_OR_RETURN(OutputPlan plan, PlanLayout(*rep_->src, rep_->options, layout, true));
  std::vector<std::pair<std::string, TensorBytes>> out;
  bool found = false;
  for (const PlannedFile& file : plan.files) {
    for (const FileRole& role : file.roles) {
      if (!RoleOf(role, FileRole::Holds::kWeights, rank)) continue;
      found = true;
      RESHARD_ASSIGN_OR_RETURN(Value tree, EntryOf(file, role.entry));
      RESHARD_RETURN_IF_ERROR(AddTensors(tree, role.prefix, &out));
    }
  }
  if (!found) return NoFileFor(*rep_->src, "layer files", rank, "read its tensors by name with tensor()");
  return out;
}

Result<TreeValue> Checkpoint::OptimizerState(const RankSpec& rank) const {
  if (rep_->options.weights_only) return Status::InvalidInput("the checkpoint was opened weights_only");
  RESHARD_RETURN_IF_ERROR(CheckRank(*rep_->src, rank));
  if (rank.ep > 1 && rank.dp_rank % rank.ep != rank.ep_rank) {
    return Status::InvalidInput("DP rank " + std::to_string(rank.dp_rank) + " holds the experts of EP rank " +
                                std::to_string(rank.dp_rank % rank.ep) + " at EP " + std::to_string(rank.ep) +
                                " (DeepSpeed gives DP rank d EP rank d % ep); ask for ep_rank " +
                                std::to_string(rank.dp_rank % rank.ep));
  }
  RESHARD_ASSIGN_OR_RETURN(OutputPlan plan, PlanLayout(*rep_->src, rep_->options, rank, false));
  for (const PlannedFile& file : plan.files) {
    for (const FileRole& role : file.roles) {
      if (!RoleOf(role, FileRole::Holds::kOptimizer, rank)) continue;
      RESHARD_ASSIGN_OR_RETURN(Value tree, EntryOf(file, role.entry));
      return MakeTreeValue(tree);
    }
  }
  return NoFileFor(*rep_->src, "optimizer state", rank,
                   "its optimizer states are tensors of the \"optimizer\" section, by name");
}

namespace {

Result<std::string> FileBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream bytes;
  bytes << in.rdbuf();
  if (!in.good() && !in.eof()) return Status::IoError("cannot read " + path);
  return bytes.str();
}

// The tensors of one planned file of an export.
Status AddFileTensors(const PlannedFile& file, std::vector<std::pair<std::string, TensorBytes>>* out) {
  if (file.container == PlannedFile::Container::kTorch) {
    RESHARD_ASSIGN_OR_RETURN(Value tree, EntryOf(file, ""));
    return AddTensors(tree, "", out);
  }
  for (const SafetensorsTensor& t : file.safetensors->tensors) {
    RESHARD_ASSIGN_OR_RETURN(TensorBytes bytes, MakeTensorBytes(t.dtype, t.shape, t.produce));
    out->emplace_back(t.name, std::move(bytes));
  }
  return Status::Ok();
}

Status CheckKeysUnique(const std::string& to, const std::vector<std::pair<std::string, TensorBytes>>& tensors) {
  std::set<std::string> seen;
  for (const auto& [key, t] : tensors) {
    if (!seen.insert(key).second) {
      return Status::Unsupported("export --to " + to + " writes " + key + " in more than one file (a file per "
                                 "rank); write it with export, or read a rank with state_dict()");
    }
  }
  return Status::Ok();
}

}  // namespace

Result<ExportedFiles> Checkpoint::Export(const ExportOptions& export_options) const {
  ExportOptions options = export_options;
  static_cast<PreflightOptions&>(options) = rep_->options;  // the checkpoint is open with these
  std::vector<std::string> notes;
  RESHARD_RETURN_IF_ERROR(rep_->src->CheckReplicas(options.replicated, &notes));
  RESHARD_ASSIGN_OR_RETURN(OutputPlan plan, PlanExport(*rep_->src, options, &notes));
  ExportedFiles out;
  for (const PlannedFile& file : plan.files) {
    switch (file.container) {
      case PlannedFile::Container::kDcp:
        return Status::Unsupported("export --to " + options.to + " writes a Distributed Checkpoint, whose "
                                   "chunks are not whole tensors; write it with export");
      case PlannedFile::Container::kText: out.texts.emplace_back(file.name, file.text); break;
      case PlannedFile::Container::kCopy: {
        RESHARD_ASSIGN_OR_RETURN(std::string bytes, FileBytes(file.copy_of));
        out.copies.emplace_back(file.name, std::move(bytes));
        break;
      }
      default: RESHARD_RETURN_IF_ERROR(AddFileTensors(file, &out.tensors));
    }
  }
  RESHARD_RETURN_IF_ERROR(CheckKeysUnique(options.to, out.tensors));
  return out;
}

}  // namespace reshard
