#include "formats/deepspeed/pipeline/unchanged_layer_file.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <set>
#include <vector>

#include "container/mapped_file.h"
#include "util/shape.h"

namespace reshard {
namespace {

// The source shard the plan makes the whole target tensor of, as it is, or
// -1: its boxes (one, or one per sub-parameter of a gated or fused weight)
// all come from that shard, each from where it lands. A plan's boxes are
// disjoint, so boxes as large as the tensor make all of it.
int WholeShardCopied(const TensorPlan& plan) {
  if (plan.average || !plan.fills.empty() || plan.copies.empty()) return -1;
  const int shard = plan.copies[0].src_shard;
  int64_t copied = 0;
  for (const BoxCopy& c : plan.copies) {
    if (c.src_shard != shard || c.src_shape != plan.shape || c.src_offsets != c.dst.offsets) return -1;
    copied += ShapeNumel(c.dst.sizes);
  }
  return copied == ShapeNumel(plan.shape) ? shard : -1;
}

// The mapped file the shard lies in, as one run, or null.
const MappedFile* FileOf(const SourceShard& shard) {
  if (shard.runs.size() != 1 || !shard.runs[0].bytes.mapped) return nullptr;
  return static_cast<const MappedFile*>(shard.runs[0].bytes.owner.get());
}

// A state dict of `count` tensors and nothing else, each the whole of a
// storage of its own: its file holds no byte that is not one of theirs.
bool OnlyWholeTensors(const Value& root, size_t count) {
  const Items* items = DictItems(root);
  if (items == nullptr || items->size() != count) return false;
  std::set<const Storage*> storages;
  for (const auto& item : *items) {
    if (!item.first.is(Value::Kind::kString) || !item.second.is(Value::Kind::kTensor)) return false;
    const Tensor& t = item.second.as_tensor();
    if (t.storage == nullptr || t.storage_offset != 0 || !t.IsContiguous() || t.storage->numel != t.numel() ||
        !storages.insert(t.storage.get()).second) {
      return false;
    }
  }
  return true;
}

// Rebuild arguments after the tensor's own that hold nothing: torch.save's
// empty backward hooks (an OrderedDict), or none.
bool NoExtras(const std::vector<Value>& extra_args) {
  return std::all_of(extra_args.begin(), extra_args.end(), [](const Value& v) {
    const Items* items = DictItems(v);
    return items != nullptr && items->empty();
  });
}

// What the writer takes from TP rank 0's tensor (the tree it writes is that
// rank's) is the same in `t`'s.
bool SameAsWritten(const Tensor& like, const Tensor& t) {
  return like.storage->location == t.storage->location && like.requires_grad == t.requires_grad &&
         like.extra_args.size() == t.extra_args.size() && NoExtras(like.extra_args) && NoExtras(t.extra_args);
}

// Whether every pair of views holds the same bytes.
bool SameBytes(const std::vector<std::pair<ByteView, ByteView>>& pairs) {
  for (const auto& [a, b] : pairs) {
    TouchedPages pages;
    pages.Note(a, a.data, a.size);
    pages.Note(b, b.data, b.size);
    if (a.size != b.size || std::memcmp(a.data, b.data, a.size) != 0) return false;
  }
  return true;
}

}  // namespace

std::optional<SourceFileCopy> UnchangedSourceFile(const LogicalCheckpoint& src, const LayerFilePlan& file) {
  const LogicalLayer& layer = src.layers[file.layer_index];
  const int t = file.tp_rank;
  const size_t n = file.tensors.size();
  if (src.weights_from_masters || static_cast<size_t>(t) >= layer.roots.size() || n != layer.tensors.size() ||
      !OnlyWholeTensors(layer.roots[0], n) || !OnlyWholeTensors(layer.roots[t], n)) {
    return std::nullopt;
  }
  const Items& written = *DictItems(layer.roots[0]);
  const Items& source = *DictItems(layer.roots[t]);
  const MappedFile* from = nullptr;
  // (rank 0's, rank t's) to compare: a small part of the file (norms, biases,
  // position embeddings), read again only where the file must be written.
  std::vector<std::pair<ByteView, ByteView>> replicas;
  for (size_t i = 0; i < n; ++i) {
    if (written[i].first.as_string() != source[i].first.as_string()) return std::nullopt;  // the key order
    const TensorPlan& plan = file.tensors[i];
    const LogicalTensor& lt = layer.tensors[plan.tensor_index];
    const Value* like = Find(layer.roots[0], lt.key);
    const Value* own = Find(layer.roots[t], lt.key);
    const int shard = WholeShardCopied(plan);
    if (like == nullptr || own == nullptr || !SameAsWritten(like->as_tensor(), own->as_tensor()) ||
        (shard != t && shard != 0) || src.WeightDType(lt) != lt.dtype || static_cast<size_t>(t) >= lt.shards.size() ||
        lt.shards[shard].shape != lt.shards[t].shape) {
      return std::nullopt;
    }
    const MappedFile* f = FileOf(lt.shards[t]);
    if (f == nullptr || (from != nullptr && f != from)) return std::nullopt;
    from = f;
    if (shard != t) {  // a replica: written from rank 0's
      if (FileOf(lt.shards[shard]) == nullptr) return std::nullopt;
      replicas.emplace_back(lt.shards[shard].runs[0].bytes, lt.shards[t].runs[0].bytes);
    }
  }
  // A file of the same name (this layer's and TP rank's, in a DeepSpeed
  // checkpoint), not some other container that holds the same tensors.
  namespace fs = std::filesystem;
  if (from == nullptr || fs::path(from->path()).filename() != fs::path(file.name).filename()) return std::nullopt;
  return SourceFileCopy{from->path(), [replicas = std::move(replicas)] { return SameBytes(replicas); }};
}

}  // namespace reshard
