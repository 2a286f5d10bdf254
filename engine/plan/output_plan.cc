#include "plan/output_plan.h"

#include <filesystem>

#include "container/torch_file.h"
#include "pickle/dtype.h"
#include "pickle/pickle_writer.h"
#include "util/human.h"
#include "util/strings.h"

namespace reshard {
namespace {

std::string KeyOf(const Value& key) {
  if (key.is(Value::Kind::kString)) return key.as_string();
  return key.DebugString(40);
}

std::string Join(const std::string& path, const std::string& key) {
  return path.empty() ? key : path + "/" + key;
}

// Every tensor of `v` under `path`, depth first in pickle order.
void ListTensors(const Value& v, const std::string& path, std::vector<PlannedTensor>* out) {
  if (v.is(Value::Kind::kTensor)) {
    const Tensor& t = v.as_tensor();
    out->push_back({path, t.storage ? t.storage->dtype : DType::kFloat32, t.sizes, ""});
    return;
  }
  if (const Items* items = DictItems(v)) {
    for (const auto& [key, item] : *items) ListTensors(item, Join(path, KeyOf(key)), out);
    return;
  }
  const std::vector<Value>* list = v.is(Value::Kind::kList)    ? &v.as_list().items
                                   : v.is(Value::Kind::kTuple) ? &v.as_tuple().items
                                                               : nullptr;
  if (list != nullptr) {
    for (size_t i = 0; i < list->size(); ++i) ListTensors((*list)[i], Join(path, std::to_string(i)), out);
    return;
  }
  if (v.is(Value::Kind::kObject)) {  // a Parameter's tensor is an argument of its rebuild
    for (const Value& arg : v.as_object().args) ListTensors(arg, path, out);
  }
}

std::string FileLine(const PlannedFile& f) {
  std::string line = "  " + f.name + "  " + f.what;
  switch (f.container) {
    case PlannedFile::Container::kTorch:
    case PlannedFile::Container::kSafetensors:
    case PlannedFile::Container::kDcp:
      if (f.tensors.empty()) return line + "\n";  // a pickle of values only
      return line + (f.what.empty() ? "" : ", ") + Count(static_cast<int64_t>(f.tensors.size()), "tensor") +
             ", " + HumanBytes(f.bytes) + (f.copy_of.empty() ? "" : ", copied from " + f.copy_of) + "\n";
    case PlannedFile::Container::kText:
      return line + "\n";
    case PlannedFile::Container::kCopy:
      return line + (f.what.empty() ? "" : ", ") + "copy of " + f.copy_of + "\n";
  }
  return line + "\n";
}

// `fqn` alone for a whole tensor, else with its box: `w[0:4, 2:6]`.
std::string ChunkKey(const DcpWriteItem& item) {
  if (item.chunk.sizes == item.size) return item.fqn;
  std::string key = item.fqn + "[";
  for (size_t d = 0; d < item.size.size(); ++d) {
    key += (d ? ", " : "") + std::to_string(item.chunk.offsets[d]) + ":" +
           std::to_string(item.chunk.offsets[d] + item.chunk.sizes[d]);
  }
  return key + "]";
}

std::string InFolder(const std::string& folder, const std::string& name) {
  return folder.empty() ? name : folder + "/" + name;
}

std::string TensorLine(const PlannedTensor& t) {
  return "    " + t.key + " " + DTypeName(t.dtype) + ShapeString(t.shape) + (t.from.empty() ? "" : ": " + t.from) +
         "\n";
}

// Refuses now, while planning, a tree the writer would refuse (CheckWritable).
Status CheckWritableTree(const std::string& name, const Value& tree) {
  return CheckWritable(tree).WithContext(name);
}

}  // namespace

Result<PlannedFile> TorchFile(std::string name, std::string what, Value tree) {
  RESHARD_RETURN_IF_ERROR(CheckWritableTree(name, tree));
  PlannedFile f;
  f.name = std::move(name);
  f.what = std::move(what);
  RESHARD_ASSIGN_OR_RETURN(f.bytes, TensorBytes(tree));
  ListTensors(tree, "", &f.tensors);
  f.tree = [tree = std::make_shared<const Value>(std::move(tree))]() { return Result<Value>(*tree); };
  return f;
}

Result<PlannedFile> TorchFile(std::string name, std::string what, std::function<Result<Value>()> make) {
  RESHARD_ASSIGN_OR_RETURN(Value sized, make());
  RESHARD_RETURN_IF_ERROR(CheckWritableTree(name, sized));
  PlannedFile f;
  f.name = std::move(name);
  f.what = std::move(what);
  RESHARD_ASSIGN_OR_RETURN(f.bytes, TensorBytes(sized));
  ListTensors(sized, "", &f.tensors);
  f.tree = std::move(make);
  return f;
}

PlannedFile TextFile(std::string name, std::string text) {
  PlannedFile f;
  f.name = std::move(name);
  f.container = PlannedFile::Container::kText;
  f.what = "text";
  f.text = std::move(text);
  return f;
}

PlannedFile DcpDataFile(const std::string& folder, std::string what, DcpFileLayout layout,
                        int64_t part_bytes) {
  PlannedFile f;
  f.name = InFolder(folder, layout.name);
  f.container = PlannedFile::Container::kDcp;
  f.what = std::move(what);
  f.bytes = DcpTensorBytes(layout, 0, layout.items.size());
  for (const DcpWriteItem& item : layout.items) {
    if (item.kind == DcpItem::Kind::kTensor) {
      f.tensors.push_back({ChunkKey(item), item.dtype, item.chunk.sizes, item.from});
    } else {
      f.detail.push_back(item.fqn + ": " + item.object.DebugString(60));
    }
  }
  auto content = std::make_shared<DcpFileContent>();
  content->cuts = DcpCuts(layout, part_bytes);
  content->layout = std::move(layout);
  f.dcp = std::move(content);
  return f;
}

Result<PlannedFile> DcpMetadataFile(const std::string& folder, const std::vector<const PlannedFile*>& files,
                                    const DcpMetadataOptions& options) {
  std::vector<const DcpFileLayout*> layouts;
  size_t items = 0;
  for (const PlannedFile* f : files) {
    layouts.push_back(&f->dcp->layout);
    items += f->dcp->layout.items.size();
  }
  RESHARD_ASSIGN_OR_RETURN(std::string pickle, DcpMetadataPickle(layouts, options));
  PlannedFile f = TextFile(InFolder(folder, ".metadata"), std::move(pickle));
  f.what = "Distributed Checkpoint metadata of " + Count(static_cast<int64_t>(items), "item");
  return f;
}

PlannedFile CopiedFile(std::string name, std::string from, bool counted) {
  PlannedFile f;
  f.name = std::move(name);
  f.container = PlannedFile::Container::kCopy;
  if (counted) {
    std::error_code ec;
    const auto size = std::filesystem::file_size(from, ec);
    f.bytes = ec ? 0 : static_cast<int64_t>(size);
  }
  f.copy_of = std::move(from);
  return f;
}

void CopyWhereSame(PlannedFile* f, std::string from, std::function<bool()> holds) {
  f->copy_of = std::move(from);
  f->copy_holds = std::move(holds);
}

void SetFrom(PlannedFile* file, const std::string& key, std::string from) {
  for (PlannedTensor& t : file->tensors) {
    if (t.key == key) {
      t.from = std::move(from);
      return;
    }
  }
}

void SetUnsaidFrom(PlannedFile* file, const std::string& prefix, const std::string& from) {
  for (PlannedTensor& t : file->tensors) {
    if (t.from.empty() && t.key.compare(0, prefix.size(), prefix) == 0) t.from = from;
  }
}

std::string PlanText(const OutputPlan& plan, bool detail) {
  std::string out = plan.summary;
  int64_t bytes = 0;
  for (const PlannedFile& f : plan.files) {
    out += FileLine(f);
    bytes += f.bytes;
    if (!detail) continue;
    for (const PlannedTensor& t : f.tensors) out += TensorLine(t);
    for (const std::string& line : f.detail) out += "    " + line + "\n";
  }
  return out + "total: " + Count(static_cast<int64_t>(plan.files.size()), "file") + ", " + HumanBytes(bytes) +
         " of tensors\n";
}

}  // namespace reshard
