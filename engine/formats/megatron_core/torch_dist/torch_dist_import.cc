#include "formats/megatron_core/torch_dist/torch_dist_import.h"

#include <sys/stat.h>

#include <algorithm>
#include <map>
#include <set>
#include <tuple>

#include "container/dcp_metadata.h"
#include "container/torch_file.h"
#include "formats/megatron_core/common/megatron_layout.h"
#include "formats/megatron_core/common/optimizer_layouts.h"
#include "formats/megatron_core/common/torch_dist_family.h"
#include "formats/megatron_core/common/torch_dist_rules.h"
#include "formats/megatron_core/torch_dist/saved_layout.h"
#include "formats/megatron_core/torch_dist/torch_dist_optimizer.h"
#include "util/human.h"
#include "util/strings.h"

namespace reshard {
namespace {

// Megatron-Core before 0.19 writes the common state beside the data files;
// 0.19 writes it as a bytes item.
constexpr char kCommonFile[] = "common.pt";
constexpr char kCommonItemPrefix[] = "common_state/";
// Keys of Transformer Engine's per-module state.
constexpr char kExtraState[] = "._extra_state";

// Whether `path` names anything: a FIFO or a link to a device there is a
// broken common.pt, which reading refuses by name, not a missing one.
bool Exists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

// The common state dict, which every Megatron-Core save writes: common.pt
// before 0.19, the common_state item (its object wrapped in a list of one)
// from 0.19. Refused when neither is there or it is not a dict with its
// args a Namespace: the args and iteration would be lost silently.
Result<Value> CommonState(const DcpContent& c) {
  const std::string file = c.folder + "/" + kCommonFile;
  std::string where = file;
  Result<Value> common = Status::InvalidInput(c.folder + " has neither " + kCommonFile + " (Megatron-Core up to 0.18) "
                                              "nor a common_state item (0.19): every Megatron-Core save writes its "
                                              "common state, the args and iteration (restore it from the saved "
                                              "checkpoint)");
  if (Exists(file)) {
    PickleReadOptions options;
    options.inert_packages = MegatronPackages();  // plain data is read out of it
    common = ReadTorchFile(file, options);
  } else {
    for (const std::string& fqn : c.bytes_items) {
      if (fqn.rfind(kCommonItemPrefix, 0) != 0) continue;
      where = c.folder + "'s item " + fqn;
      common = c.ReadBytes(fqn);
      if (!common.ok()) {
        common = Status::InvalidInput(common.status().message() + " (Megatron-Core's common state, item " + fqn + ")");
      }
      if (common.ok() && common->is(Value::Kind::kList) && common->as_list().items.size() == 1) {
        common = Value(common->as_list().items[0]);
      }
      break;
    }
  }
  // Not Unsupported: a common state reshard cannot read is no reason to read the folder without rules.
  if (!common.ok()) return Status::InvalidInput(common.status().message());
  RESHARD_RETURN_IF_ERROR(CheckRunState(*common, where));
  return common;
}

// The Megatron-Core version whose form the folder has: 0.19's where its
// optimizer layout is one only 0.19 writes, else 0.14's where it has a
// common.pt (which versions up to 0.18 write; 0.14 is the one whose form
// reshard writes), else 0.19's.
std::string MegatronCoreVersion(const DcpContent& c, const std::optional<ImportedOptimizer>& optimizer) {
  if (optimizer && (optimizer->layout == kFullyReshardable || optimizer->layout == kDpReshardable)) return "0.19";
  return Exists(c.folder + "/" + kCommonFile) ? "0.14" : "0.19";
}

// Reads the checkpoint as the model of one rule set.
class FamilyReader {
 public:
  FamilyReader(const DcpContent& content, const RuleSet& rules, const Value& common, const CommonOptions& options)
      : c_(content),
        family_(rules, ImportedRunMetadata(common, IterationOfFolder(content.folder)),
                options, "torch_dist"),
        layout_(*rules.section<TorchDistLayout>()),
        common_(common) {}

  Result<TorchDistImport> Read() {
    RESHARD_RETURN_IF_ERROR(family_.Start());
    RESHARD_RETURN_IF_ERROR(MapTensors());
    RESHARD_RETURN_IF_ERROR(family_.RecordExperts(std::max<int64_t>(experts_, 0), c_.folder));
    RESHARD_RETURN_IF_ERROR(CheckUnmapped());
    RESHARD_RETURN_IF_ERROR(family_.RecordBlocks(blocks_, c_.folder));
    RESHARD_RETURN_IF_ERROR(family_.Satisfy());
    ReadOptimizer();  // before the args say TP 1, PP 1: a dp_reshardable layout is read with the save's
    // A tensor is named by the key it was read from, else by the keys it may be read from.
    auto keys_of = [this](const std::string& name) {
      for (const Mapped& m : mapped_) {
        if (m.name == name) return m.key;
      }
      return family_.KeysOf(name);
    };
    RESHARD_ASSIGN_OR_RETURN(LogicalCheckpoint logical, family_.Finish(tensors_, keys_of, c_.folder));
    return Finish(std::move(logical));
  }

 private:
  Status MapTensors() {
    for (const TorchDistTensor& entry : layout_.tensors) {
      const DcpTensor* t = FindAny(entry.keys);
      if (t == nullptr) continue;  // LayOutImported refuses it when the rules need it
      used_.insert(t->fqn);
      if (entry.name.find("{block}") == std::string::npos) {
        RESHARD_RETURN_IF_ERROR(family_.CheckShape(entry, t->fqn, t->size));
        Add(entry.name, *t, {});
        continue;
      }
      const bool experts = StacksExperts(entry);
      if (t->size.size() < (experts ? 2u : 1u)) {
        return family_.Refuse(t->fqn + " has no layer " + (experts ? "and expert axes" : "axis") + " to stack " +
                              entry.name + " on");
      }
      RESHARD_RETURN_IF_ERROR(Agree(*t, "layers", t->size[0], &blocks_));
      if (experts) RESHARD_RETURN_IF_ERROR(Agree(*t, "experts", t->size[1], &experts_));
      const size_t lead = experts ? 2 : 1;
      RESHARD_RETURN_IF_ERROR(family_.CheckShape(entry, t->fqn, {t->size.begin() + lead, t->size.end()}));
      for (int64_t l = 0; l < blocks_; ++l) {
        if (!experts) {
          Add(WithBlock(entry.name, l), *t, {l});
          continue;
        }
        for (int64_t e = 0; e < experts_; ++e) Add(WithExpert(WithBlock(entry.name, l), e), *t, {l, e});
      }
    }
    return Status::Ok();
  }

  // Records the number of layers (or experts) `t` stacks, `n`, in `*seen`
  // (-1: none yet); refused when the keys before it stack another.
  Status Agree(const DcpTensor& t, const char* what, int64_t n, int64_t* seen) const {
    if (*seen >= 0 && n != *seen) {
      return family_.Refuse(t.fqn + " stacks " + std::to_string(n) + " " + what + ", and the keys before it " +
                            std::to_string(*seen));
    }
    *seen = n;
    return Status::Ok();
  }

  const DcpTensor* FindAny(const std::vector<std::string>& keys) const {
    for (const std::string& key : keys) {
      if (const DcpTensor* t = c_.FindTensor(key)) return t;
    }
    return nullptr;
  }

  // Maps canonical tensor `name` to the slice of `t` at indices `lead` of
  // its first axes ({layer} or {layer, expert}; {}: all of it).
  void Add(const std::string& name, const DcpTensor& t, std::vector<int64_t> lead) {
    SourceShard runs = SliceRuns(t, lead);
    mapped_.push_back({name, t.fqn, std::move(lead)});
    auto unread = [name](int64_t, int64_t, uint8_t*) {
      return Status::Internal(name + " is read through its runs, not its placeholder tensor");
    };
    tensors_[name] = ImportedTensor{MakeProducedTensor(t.dtype, runs.shape, unread), std::move(runs)};
  }

  // The distributed optimizer's state, each state of each model key sliced
  // into canonical tensors as the key's weights are. A layout that cannot be
  // read leaves the reason for the commands that need the state.
  void ReadOptimizer() {
    auto args = [this](const std::string& path) { return MetaRef{{path}}.Resolve(family_.inputs()); };
    Result<std::optional<TorchDistOptimizer>> read = ReadTorchDistOptimizer(c_, common_, layout_, args);
    if (!read.ok()) {
      optimizer_status_ = read.status().WithContext("torch_dist");
      return;
    }
    if (!*read) return;
    TorchDistOptimizer& states = **read;
    ImportedOptimizer opt;
    opt.moments = {kTorchDistStates[1], kTorchDistStates[2]};
    for (const Mapped& m : mapped_) {
      ImportedOptimizer::Param& p = opt.params[m.name];
      p.master = SliceRuns(states.states[kTorchDistStates[0]].at(m.key), m.lead);
      for (const std::string& moment : opt.moments) p.moments.push_back(SliceRuns(states.states[moment].at(m.key), m.lead));
    }
    // Megatron-Core marks the groups without weight decay by wd_mult 0.
    std::stable_partition(states.param_groups.begin(), states.param_groups.end(), [](const Value& g) {
      const Value* wd_mult = Find(g, "wd_mult");
      return wd_mult == nullptr || !wd_mult->is(Value::Kind::kFloat) || wd_mult->as_float() != 0.0;
    });
    opt.param_groups = std::move(states.param_groups);
    opt.step = std::move(states.step);
    opt.what = "Megatron-Core's distributed optimizer (" + states.layout + ")";
    opt.layout = states.layout;
    family_.notes().push_back("torch_dist: " + opt.what + ": fp32 masters, exp_avg and exp_avg_sq of " +
                              Count(static_cast<int64_t>(opt.params.size()), "tensor") + ", " +
                              Count(static_cast<int64_t>(opt.param_groups.size()), "param group") +
                              (opt.step ? ", step " + opt.step->DebugString(20) : std::string()));
    optimizer_ = std::move(opt);
  }

  // Every model key must be the family's; the optimizer's keys are read by
  // ReadOptimizer, Transformer Engine's state is noted.
  Status CheckUnmapped() {
    for (const DcpTensor& t : c_.tensors) {
      if (used_.count(t.fqn)) continue;
      if (IsOptimizerKey(t.fqn)) continue;  // ReadOptimizer's
      return family_.Refuse(t.fqn + " is not a tensor of the model as its torch_dist section maps it");
    }
    for (const std::string& fqn : c_.bytes_items) {
      if (fqn.find(kExtraState) != std::string::npos) extra_states_++;
    }
    return Status::Ok();
  }

  Result<TorchDistImport> Finish(LogicalCheckpoint logical) {
    std::vector<std::string>& notes = family_.notes();
    if (!optimizer_status_.ok()) {
      notes.push_back(optimizer_status_.message());  // "torch_dist: <why it is not read>; <fix>"
    }
    if (extra_states_ > 0) {
      notes.push_back("torch_dist: Transformer Engine's _extra_state (" + Count(extra_states_, "item") +
                    ") is not carried: reshard does not carry Transformer Engine's state yet");
    }
    TorchDistImport out;
    out.logical = std::move(logical);
    out.files = c_.Paths();
    const int64_t iteration = out.logical.iteration;
    out.what = "Megatron-Core torch_dist checkpoint" +
               (iteration > 0 ? "; iteration " + std::to_string(iteration) : std::string()) + " (" +
               Count(static_cast<int64_t>(c_.files.size()), ".distcp file") + ")";
    out.notes = std::move(notes);
    out.megatron_core_version = MegatronCoreVersion(c_, optimizer_);
    const std::string layout = SetSavedLayout(&out);
    out.logical.vocab.padded_for_tp = out.tp;  // the save's padding, made for its TP (0: not known)
    out.facts = Facts(out, layout);
    out.optimizer = std::move(optimizer_);
    out.optimizer_status = optimizer_status_;
    return out;
  }

  // What the save records, in Megatron-Core's terms.
  // The layout the save was made at (out->tp, pp, dp): each size as its
  // args record it, else as the save itself shows it (saved_layout.h).
  // Returns it as inspect says it, with where each size comes from.
  std::string SetSavedLayout(TorchDistImport* out) const {
    const Value* args = Find(common_, "args");
    auto recorded = [args](const char* field) {
      return args == nullptr ? 0 : static_cast<int>(MetadataInt(*args, field, 0));
    };
    const int world = WritingRanks(c_.folder);
    const SavedLayout shown = DeriveSavedLayout(c_.meta, world, SavedKeysOf());
    std::string text;
    for (const auto& [name, field, derived, size] :
         {std::tuple<const char*, const char*, int, int*>{"TP", "tensor_model_parallel_size", shown.tp, &out->tp},
          {"PP", "pipeline_model_parallel_size", shown.pp, &out->pp},
          {"DP", "data_parallel_size", shown.dp, &out->dp},
          {"EP", "expert_model_parallel_size", shown.ep, &out->ep}}) {
      if (size == &out->ep && experts_ <= 0) continue;  // a model without experts has no EP
      *size = recorded(field) > 0 ? recorded(field) : derived;
      const char* from = recorded(field) > 0 ? "args" : "the save";
      text += (text.empty() ? "" : ", ") + std::string(name) + " " +
              (*size > 0 ? std::to_string(*size) + " (" + from + ")" : "not recorded");
    }
    // The virtual pipeline leaves the keys global: only the args know it.
    if (const int vpp = args != nullptr ? VppOfArgs(*args) : 1; vpp > 1) text += ", VPP " + std::to_string(vpp) + " (args)";
    if (const PipelineSplit split = args != nullptr ? SplitOfArgs(*args) : PipelineSplit(); !split.Even()) {
      text += ", stages " + split.Describe() + " (args)";
    }
    if (world > 0) text += "; " + Count(world, "rank") + " wrote it";
    return text;
  }

  // The save's keys as the family splits and stacks them.
  SavedKeys SavedKeysOf() const {
    SavedKeys keys;
    keys.layers = std::max<int64_t>(blocks_, 0);
    keys.experts = std::max<int64_t>(experts_, 0);
    std::set<std::string> seen;
    for (const Mapped& m : mapped_) {
      if (!seen.insert(m.key).second) continue;
      if (!m.lead.empty()) keys.stacked.push_back(m.key);
      if (m.lead.size() == 2) keys.expert_stacked.push_back(m.key);
      Result<const ParamRule*> rule = family_.RuleOf(m.name, keys.layers);
      if (!rule.ok() || (*rule)->policy == ParamRule::Policy::kReplicated) continue;
      keys.tp_splits[m.key] = TpSplit{(*rule)->dim + static_cast<int>(m.lead.size()), (*rule)->parts};
    }
    return keys;
  }

  RecordedFacts Facts(const TorchDistImport& out, const std::string& layout) const {
    RecordedFacts facts;
    facts.emplace_back("form", "Megatron-Core " + out.megatron_core_version + "'s, its common state in " +
                                   (Exists(c_.folder + "/" + kCommonFile) ? kCommonFile : "the common_state item"));
    std::string optimizer = "none";
    if (optimizer_) {
      optimizer = "the distributed optimizer's, layout " + optimizer_->layout +
                  (optimizer_->step ? ", step " + optimizer_->step->DebugString(20) : std::string());
    } else if (!optimizer_status_.ok()) {
      optimizer = "not read (" + optimizer_status_.message() + ")";
    }
    facts.emplace_back("optimizer state", optimizer);
    if (experts_ > 0) facts.emplace_back("experts", Count(experts_, "expert") + " per MoE layer, in every layer");
    facts.emplace_back("iteration", std::to_string(out.logical.iteration));
    facts.emplace_back("saved at", layout);
    facts.emplace_back("files", Count(static_cast<int64_t>(c_.files.size()), ".distcp file") + ", " +
                                    Count(static_cast<int64_t>(c_.meta.items.size()), "item"));
    return facts;
  }

  const DcpContent& c_;
  TorchDistFamily family_;
  const TorchDistLayout& layout_;
  const Value& common_;
  // Which key (and layer of it) each canonical tensor is read from.
  struct Mapped {
    std::string name, key;
    std::vector<int64_t> lead;  // its indices of the key's first axes: {layer} or {layer, expert}
  };
  std::vector<Mapped> mapped_;
  std::optional<ImportedOptimizer> optimizer_;
  Status optimizer_status_;
  std::map<std::string, ImportedTensor> tensors_;
  std::set<std::string> used_;
  int64_t blocks_ = -1;
  int64_t experts_ = -1;  // of each MoE layer; -1: no key stacks experts
  int64_t extra_states_ = 0;
};

}  // namespace

Result<TorchDistImport> ReadTorchDistImport(const DcpContent& content, const CommonOptions& options) {
  RESHARD_ASSIGN_OR_RETURN(Value common, CommonState(content));
  RESHARD_ASSIGN_OR_RETURN(std::vector<RuleSet> candidates,
                           TorchDistCandidates(options.rules, "a Megatron-Core torch_dist checkpoint"));
  std::vector<std::string> reasons;
  for (const RuleSet& rules : candidates) {
    Result<TorchDistImport> imported = FamilyReader(content, rules, common, options).Read();
    if (imported.ok() || !options.rules.empty()) return imported;
    reasons.push_back(imported.status().message());
  }
  return Status::Unsupported("no built-in rule set reads this torch_dist checkpoint (" + Join(reasons, "; ") +
                             "); write a rule file with a torch_dist section (docs/rules.md) and pass --rules FILE");
}

}  // namespace reshard
