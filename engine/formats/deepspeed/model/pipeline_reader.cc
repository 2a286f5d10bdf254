#include "formats/deepspeed/model/pipeline_reader.h"

#include <algorithm>

#include "container/torch_file.h"
#include "formats/deepspeed/files/known_classes.h"
#include "logical/settings.h"

namespace reshard {
namespace {

Status ReadMetadataFiles(const std::set<std::string>& allowed, DeepSpeedModel* m) {
  for (const auto& [mp, path] : m->files.mp_rank_files) {
    RESHARD_ASSIGN_OR_RETURN(Value root, ReadDeepSpeedFile(path, allowed));
    if (DictItems(root) == nullptr) {
      return Status::InvalidInput(path + " does not hold a dict; it is not a DeepSpeed model-states file");
    }
    m->logical.metadata.push_back(std::move(root));
  }
  return Status::Ok();
}

int64_t IterationOf(const Value& metadata) {
  return MetadataInt(metadata, "iteration", MetadataInt(metadata, "global_steps", 0));
}

// All mp_rank files of one save carry the same iteration.
void CheckIterations(LogicalCheckpoint* ckpt) {
  const int64_t first = IterationOf(ckpt->metadata[0]);
  ckpt->iteration = first;
  for (size_t i = 1; i < ckpt->metadata.size(); ++i) {
    const int64_t it = IterationOf(ckpt->metadata[i]);
    if (it != first) {
      ckpt->AddError("mixed iterations: mp_rank_00 is iteration " + std::to_string(first) +
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
      ckpt->AddError(what + " is " + std::to_string(recorded) + " in the metadata but the files show " +
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

Status ReadLayerFiles(const std::set<std::string>& allowed, DeepSpeedModel* m) {
  if (m->files.layer_files.empty()) {
    return Status::InvalidInput(m->files.tag_dir +
                                " has no layer_*-model_*-model_states.pt files; reshard needs the "
                                "per-layer weight files of a pipeline checkpoint");
  }
  for (const auto& [id, by_tp] : m->files.layer_files) {
    LogicalLayer layer;
    layer.id = id;
    layer.label = LayerName(id);
    for (const auto& [t, path] : by_tp) {
      RESHARD_ASSIGN_OR_RETURN(Value root, ReadDeepSpeedFile(path, allowed));
      if (DictItems(root) == nullptr) {
        return Status::InvalidInput(path + " does not hold a state dict");
      }
      layer.roots.push_back(std::move(root));
    }
    m->logical.layers.push_back(std::move(layer));
  }
  return Status::Ok();
}

}  // namespace

Status ReadMetadata(const std::set<std::string>& allowed_classes, DeepSpeedModel* m) {
  RESHARD_RETURN_IF_ERROR(ReadMetadataFiles(allowed_classes, m));
  CheckIterations(&m->logical);
  return Status::Ok();
}

Result<Value> ReadDeepSpeedFile(const std::string& path, const std::set<std::string>& allowed_classes) {
  PickleReadOptions read;
  read.known_classes = &DeepSpeedKnownClasses();
  read.allowed_globals = allowed_classes;
  return ReadTorchFile(path, read);
}

Result<std::unique_ptr<DeepSpeedModel>> ReadDeepSpeedModel(CheckpointFiles files,
                                                           const CommonOptions& options) {
  const std::set<std::string>& allowed_classes = options.allowed_classes;
  auto m = std::make_unique<DeepSpeedModel>();
  m->files = std::move(files);
  LogicalCheckpoint& ckpt = m->logical;
  RESHARD_RETURN_IF_ERROR(CheckRankGrid(m->files, &ckpt.tp, &ckpt.pp, &ckpt.dp));
  RESHARD_RETURN_IF_ERROR(ReadMetadataFiles(allowed_classes, m.get()));
  const Value* module = Find(ckpt.metadata[0], "module");
  m->pipeline = !m->files.layer_files.empty() || module == nullptr || module->is_none();
  if (m->pipeline) {
    RESHARD_RETURN_IF_ERROR(ReadLayerFiles(allowed_classes, m.get()));
  } else {
    // The DeepSpeed engine without pipelining numbers mp_rank files by TP rank.
    ckpt.tp = ckpt.pp;
    ckpt.pp = 1;
  }
  CheckIterations(&ckpt);
  CrossCheckDegrees(&ckpt);
  if (!m->files.universal_dir.empty()) m->files.other_files.push_back("zero/");
  if (ckpt.dp == 0) ckpt.dp = std::max<int64_t>(1, MetadataInt(ckpt.metadata[0], "dp_world_size", 1));
  for (const std::string& other : m->files.other_files) {
    ckpt.AddError("unrecognised file '" + other + "' in " + m->files.tag_dir +
                  "; reshard does not know what it holds (move it out of the tag "
                  "folder if it does not belong to the checkpoint)");
  }
  if (!m->pipeline) {  // no layer files to explain: only DP can change
    RESHARD_RETURN_IF_ERROR(RefuseSettings(options.set));
    return m;
  }
  RESHARD_RETURN_IF_ERROR(DescribeCheckpoint(options.rules, options.set, &ckpt));
  return m;
}

}  // namespace reshard
