// reshard::Inspect: a readable description of a checkpoint.
#include "api/common.h"
#include "util/human.h"
#include "formats/deepspeed/zero3_checkpoint.h"

namespace reshard {
namespace {

std::string MetadataLines(const LogicalCheckpoint& ckpt) {
  std::string out = "metadata (mp_rank_00):\n";
  for (const auto& [k, v] : *DictItems(ckpt.metadata[0])) {
    const std::string key = k.is(Value::Kind::kString) ? k.as_string() : k.DebugString();
    if (key == "args") continue;
    out += "  " + key + ": " + v.DebugString(100) + "\n";
  }
  const Items* args = DictItems(ckpt.args());
  if (args == nullptr) return out;
  out += "args (" + std::to_string(args->size()) + " fields):";
  static const char* kLayoutFields[] = {
      "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
      "num_key_value_heads", "kv_channels", "max_position_embeddings", "padded_vocab_size",
      "make_vocab_size_divisible_by", "tensor_model_parallel_size",
      "pipeline_model_parallel_size", "data_parallel_size", "world_size"};
  for (const char* field : kLayoutFields) {
    if (const Value* v = Find(ckpt.args(), field)) out += std::string(" ") + field + "=" + v->DebugString(20);
  }
  return out + "\n";
}

std::string LayerLines(const LogicalCheckpoint& ckpt) {
  std::string out = "layer files (full logical shapes):\n";
  for (const LogicalLayer& layer : ckpt.layers) {
    out += "  " + LayerName(layer.id) + " " + layer.role + " (" +
           ckpt.specs[layer.id].class_name + ")\n";
    for (const LogicalTensor& t : layer.tensors) {
      out += "    " + t.key + "  " + DTypeName(t.dtype) + ShapeString(t.full_shape) + "  " +
             t.rule->Describe() + "\n";
    }
  }
  return out;
}

}  // namespace

Result<std::string> Inspect(const std::string& checkpoint, const InspectOptions& options) {
  RESHARD_ASSIGN_OR_RETURN(CheckpointFiles files, ScanCheckpoint(checkpoint));
  if (files.IsZero3()) {
    RESHARD_ASSIGN_OR_RETURN(std::unique_ptr<Zero3Checkpoint> zero3,
                             Zero3Checkpoint::Load(files, options.allowed_classes));
    std::string out = "checkpoint: " + files.tag_dir + "\n" + zero3->Summary() + "\n";
    for (size_t sg = 0; sg < zero3->ranks()[0].sub_groups.size(); ++sg) {
      out += "  sub-group " + std::to_string(sg) + ":";
      for (const Zero3Param& p : zero3->ranks()[0].sub_groups[sg]) out += " " + p.name + ShapeString(p.shape);
      out += "\n";
    }
    return out;
  }
  RESHARD_ASSIGN_OR_RETURN(std::unique_ptr<LogicalCheckpoint> ckpt,
                           LoadForCommand(std::move(files), options));
  std::string out = "checkpoint: " + ckpt->files.tag_dir + "\n" + LayoutSummary(*ckpt) + "\n";
  out += MetadataLines(*ckpt);
  out += LayerLines(*ckpt);
  for (const Finding& f : ckpt->findings) out += "problem: " + f.message + "\n";
  return out;
}

}  // namespace reshard
