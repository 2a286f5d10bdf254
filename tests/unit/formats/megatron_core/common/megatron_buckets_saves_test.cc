// MegatronBucketLayout against real Megatron-Core 0.19 saves: for every
// sample, the `dp_reshardable` folder's flat bucket tensors, cut where the
// derived layout says, must equal bit for bit the per-parameter state of the
// `fully_reshardable` twin (the same state after the same step).
//
// The parameter list is built as a reader of a `dp_reshardable` folder has
// to build it: the model keys, dtypes, global shapes and chunk boxes of its
// own model tensors; TP from the vocabulary cuts of the word embeddings, PP
// from the number of model-parallel groups, layers split evenly over stages;
// and the GPT module registration order (kGptOrder), which the checkpoint
// does not record. The twin only supplies the expected values.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <numeric>
#include <set>
#include <sstream>

#include "container/dcp_item.h"
#include "container/dcp_metadata.h"
#include "container/json_reader.h"
#include "container/mapped_file.h"
#include "formats/megatron_core/common/megatron_buckets.h"

namespace reshard {
namespace {

namespace fs = std::filesystem;

const fs::path kSaves = fs::path(RESHARD_SOURCE_DIR) / "tests/data/megatron-core/0.19";
const char* const kStates[] = {"param", "exp_avg", "exp_avg_sq"};

// GPTModel's parameters (local and TE-free spec) in the order its modules
// register them: what `named_parameters()` yields, under the checkpoint's
// keys. The input norm is registered before the attention (whose
// linear_proj, built by Attention's constructor, precedes linear_qkv).
struct ModelOrder {
  std::vector<std::string> first_stage, layer, last_stage;
};
const ModelOrder kGptOrder = {
    {"embedding.word_embeddings.weight", "embedding.position_embeddings.weight"},
    {"self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.layer_norm_bias",
     "self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
     "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
     "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.layer_norm_bias", "mlp.linear_fc1.weight",
     "mlp.linear_fc1.bias", "mlp.linear_fc2.weight", "mlp.linear_fc2.bias"},
    {"decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight"}};
const std::string kLayers = "decoder.layers.";

// The dtype torch names `torch.<name>` (float32 when none is).
DType DTypeNamed(const std::string& name) {
  for (DType d : {DType::kFloat16, DType::kBFloat16, DType::kFloat64}) {
    if (name == DTypeName(d)) return d;
  }
  return DType::kFloat32;
}

int64_t Volume(const std::vector<int64_t>& dims) {
  return std::accumulate(dims.begin(), dims.end(), int64_t{1}, std::multiplies<int64_t>());
}

// A tensor assembled whole from its chunks.
struct Whole {
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
  int esize = 4;
};

class Folder {
 public:
  explicit Folder(fs::path dir) : dir_(std::move(dir)) {
    Result<DcpMetadata> meta = ReadDcpMetadata((dir_ / ".metadata").string());
    EXPECT_TRUE(meta.ok()) << meta.status().message();
    if (meta.ok()) meta_ = *meta;
  }
  const DcpMetadata& meta() const { return meta_; }
  bool Has(const std::string& fqn) const { return meta_.items.count(fqn) > 0; }

  Result<Value> PlainObject(const std::string& fqn) {
    const DcpStorage* where = meta_.Find(fqn, {});
    if (where == nullptr) return Status::InvalidInput("no bytes item " + fqn);
    RESHARD_ASSIGN_OR_RETURN(std::shared_ptr<const MappedFile> file, File(where->relative_path));
    return ReadDcpItem(file, *where);
  }

  Result<Whole> WholeTensor(const std::string& fqn) {
    const DcpItem& item = meta_.items.at(fqn);
    Whole w{item.size, {}, ElementSize(item.dtype)};
    w.bytes.resize(Volume(item.size) * w.esize);
    for (const Box& c : item.chunks) {
      RESHARD_ASSIGN_OR_RETURN(std::shared_ptr<const MappedFile> file,
                               File(meta_.Find(fqn, c.offsets)->relative_path));
      RESHARD_ASSIGN_OR_RETURN(Value chunk, ReadDcpChunk(file, meta_, fqn, c));
      const Tensor& t = chunk.as_tensor();
      CopyBox(t.storage->bytes.data + t.storage_offset * w.esize, c, &w);
    }
    return w;
  }

 private:
  Result<std::shared_ptr<const MappedFile>> File(const std::string& name) {
    auto it = files_.find(name);
    if (it != files_.end()) return it->second;
    RESHARD_ASSIGN_OR_RETURN(std::shared_ptr<const MappedFile> f,
                             MappedFile::Open((dir_ / name).string()));
    return files_[name] = f;
  }

  static void CopyBox(const uint8_t* src, const Box& c, Whole* w) {
    std::vector<int64_t> index(c.sizes.size(), 0);
    for (int64_t i = 0; i < Volume(c.sizes); ++i) {
      int64_t at = 0;
      for (size_t d = 0; d < index.size(); ++d) at = at * w->shape[d] + c.offsets[d] + index[d];
      std::memcpy(&w->bytes[at * w->esize], src + i * w->esize, w->esize);
      for (size_t d = index.size(); d-- > 0;) {
        if (++index[d] < c.sizes[d]) break;
        index[d] = 0;
      }
    }
  }

  fs::path dir_;
  DcpMetadata meta_;
  std::map<std::string, std::shared_ptr<const MappedFile>> files_;
};

// One TP rank's piece of a model tensor (of one layer, for a stacked key):
// the ranges of the cut axis it holds, concatenated in order. A tensor cut
// into k·TP ranges is k parts each cut by TP (SwiGLU's [gate; up] fc1):
// rank r holds ranges r, TP + r, ... . axis < 0: the rank holds it whole.
struct Piece {
  int axis = -1;
  std::vector<std::pair<int64_t, int64_t>> ranges;
};

Result<Piece> PieceOf(const std::string& key, const DcpItem& item, int first_axis, int tp,
                      int rank) {
  Piece piece;
  for (int d = first_axis; d < static_cast<int>(item.size.size()); ++d) {
    std::set<std::pair<int64_t, int64_t>> ranges;
    for (const Box& c : item.chunks) ranges.insert({c.offsets[d], c.sizes[d]});
    if (ranges.size() == 1) continue;
    if (piece.axis >= 0 || ranges.size() % tp != 0) {
      return Status::InvalidInput(key + ": chunks are no TP " + std::to_string(tp) + " cut");
    }
    const std::vector<std::pair<int64_t, int64_t>> sorted(ranges.begin(), ranges.end());
    piece.axis = d;
    for (size_t j = rank; j < sorted.size(); j += tp) piece.ranges.push_back(sorted[j]);
  }
  return piece;
}

// A parameter of one (TP, PP) rank: its key, layer (-1 if not stacked),
// dtype, local shape and where that lies in the global tensor.
struct ModelParam {
  std::string key;
  int layer = -1;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> local_shape;
  Piece piece;
};

Result<ModelParam> MakeParam(const std::string& key, int layer, const DcpItem& item, int tp,
                             int rank) {
  const int first = layer >= 0 ? 1 : 0;
  RESHARD_ASSIGN_OR_RETURN(Piece piece, PieceOf(key, item, first, tp, rank));
  ModelParam p{key, layer, item.dtype, {item.size.begin() + first, item.size.end()}, piece};
  if (piece.axis >= 0) {
    int64_t n = 0;
    for (const auto& range : piece.ranges) n += range.second;
    p.local_shape[piece.axis - first] = n;
  }
  return p;
}

// The local tensor's elements, row-major, gathered from the global `w`.
std::vector<uint8_t> LocalBytes(const ModelParam& p, const Whole& w) {
  const int first = p.layer >= 0 ? 1 : 0;
  std::vector<uint8_t> out;
  std::vector<int64_t> index(p.local_shape.size(), 0);
  for (int64_t i = 0; i < Volume(p.local_shape); ++i) {
    int64_t at = first ? p.layer : 0;
    for (size_t d = 0; d < index.size(); ++d) {
      int64_t g = index[d];
      if (static_cast<int>(d) + first == p.piece.axis) {
        for (const auto& [offset, size] : p.piece.ranges) {
          if (g < size) {
            g += offset;
            break;
          }
          g -= size;
        }
      }
      at = at * w.shape[d + first] + g;
    }
    out.insert(out.end(), &w.bytes[at * w.esize], &w.bytes[(at + 1) * w.esize]);
    for (size_t d = index.size(); d-- > 0;) {
      if (++index[d] < p.local_shape[d]) break;
      index[d] = 0;
    }
  }
  return out;
}

// The layout of the save, as far as a reader can tell it from the chunks.
struct SaveLayout {
  int tp = 1, pp = 1, dp = 1, layers = 0;
};

Result<SaveLayout> LayoutOf(Folder& folder, const std::string& tag) {
  SaveLayout s;
  const DcpItem& embedding = folder.meta().items.at("embedding.word_embeddings.weight");
  s.tp = static_cast<int>(embedding.chunks.size());  // vocabulary-parallel, never replicated
  int groups = 0;
  while (folder.Has("optimizer.distributed.dp_group_idx_" + std::to_string(groups) +
                    ".per_bucket_numel/shard_0_1"))
    ++groups;
  s.pp = groups / s.tp;
  s.layers = static_cast<int>(folder.meta().items.at(kLayers + kGptOrder.layer[0]).size[0]);
  if (s.pp * s.tp != groups || s.layers % s.pp != 0) {
    return Status::InvalidInput(tag + ": no even TP x PP layout");
  }
  // The DP size is not in the chunks of a DP-1 save: the save's own record
  // of its layout (Megatron-LM's `args`; the samples' config.json) says it.
  std::ifstream in(kSaves / (tag + "_config.json"));
  std::stringstream text;
  text << in.rdbuf();
  RESHARD_ASSIGN_OR_RETURN(Value config, ParseJson(text.str(), tag + "_config.json"));
  s.dp = static_cast<int>(Find(*Find(config, "layout"), "dp")->as_int());
  return s;
}

// The parameters of one (TP, PP) rank in registration order.
Result<std::vector<ModelParam>> StageParams(Folder& folder, const SaveLayout& s, int tp_rank,
                                            int pp_rank) {
  std::vector<std::pair<std::string, int>> keys;  // key, layer
  if (pp_rank == 0) {
    for (const std::string& k : kGptOrder.first_stage) keys.push_back({k, -1});
  }
  const int per_stage = s.layers / s.pp;
  for (int l = pp_rank * per_stage; l < (pp_rank + 1) * per_stage; ++l) {
    for (const std::string& k : kGptOrder.layer) keys.push_back({kLayers + k, l});
  }
  if (pp_rank == s.pp - 1) {
    for (const std::string& k : kGptOrder.last_stage) keys.push_back({k, -1});
  }
  std::vector<ModelParam> params;
  for (const auto& [key, layer] : keys) {
    if (!folder.Has(key)) continue;
    RESHARD_ASSIGN_OR_RETURN(ModelParam p,
                             MakeParam(key, layer, folder.meta().items.at(key), s.tp, tp_rank));
    params.push_back(std::move(p));
  }
  return params;
}

// Every model tensor of the save is one kGptOrder names: a reader refuses a
// parameter whose place in the registration order it does not know.
void ExpectOrderKnowsEveryTensor(const Folder& folder) {
  std::set<std::string> known(kGptOrder.first_stage.begin(), kGptOrder.first_stage.end());
  known.insert(kGptOrder.last_stage.begin(), kGptOrder.last_stage.end());
  for (const std::string& k : kGptOrder.layer) known.insert(kLayers + k);
  for (const auto& [fqn, item] : folder.meta().items) {
    if (item.kind == DcpItem::Kind::kTensor && fqn.rfind("optimizer.", 0) != 0) {
      EXPECT_TRUE(known.count(fqn)) << fqn;
    }
  }
}

// per_bucket_numel(_unpadded) of one model-parallel group: Megatron's
// `[[{(param dtype, grad dtype): [numel per bucket]} per grad buffer]]`.
struct BufferNumels {
  std::string param_dtype, grad_dtype;
  std::vector<int64_t> numels;
};

Result<std::vector<BufferNumels>> ReadNumels(Folder& folder, int group, const std::string& which) {
  const std::string key =
      "optimizer.distributed.dp_group_idx_" + std::to_string(group) + "." + which;
  RESHARD_ASSIGN_OR_RETURN(Value v, folder.PlainObject(key + "/shard_0_1"));
  std::vector<BufferNumels> out;
  for (const Value& buffer : v.as_list().items.at(0).as_list().items) {
    const auto& [dtypes, numels] = buffer.as_dict().items.at(0);
    BufferNumels b{dtypes.as_tuple().items.at(0).as_global().name,
                   dtypes.as_tuple().items.at(1).as_global().name,
                   {}};
    for (const Value& n : numels.as_list().items) b.numels.push_back(n.as_int());
    out.push_back(std::move(b));
  }
  return out;
}

// Grad buffers in the order DDP makes them: one per param dtype, in the
// order each dtype first appears among the registered parameters.
std::vector<std::vector<const ModelParam*>> GroupByDtype(const std::vector<ModelParam>& params) {
  std::vector<DType> order;
  std::vector<std::vector<const ModelParam*>> groups;
  for (const ModelParam& p : params) {
    size_t g = std::find(order.begin(), order.end(), p.dtype) - order.begin();
    if (g == order.size()) {
      order.push_back(p.dtype);
      groups.emplace_back();
    }
    groups[g].push_back(&p);
  }
  return groups;
}

struct Tally {
  int buffers = 0, buckets = 0, params = 0;
  int64_t elements = 0;  // compared, over the three states
};

// One grad buffer of one group: the derived layout against the recorded
// numels and chunks, and every parameter's slice against the twin.
void CheckBuffer(Folder& dp, Folder& twin, const SaveLayout& s, int group, int gbuf,
                 const std::vector<const ModelParam*>& params, const BufferNumels& numel,
                 const BufferNumels& unpadded, Tally* tally) {
  const std::string what =
      "dp_group_idx_" + std::to_string(group) + ".gbuf_idx_" + std::to_string(gbuf);
  SCOPED_TRACE(what);
  ASSERT_EQ(numel.param_dtype, DTypeName(params[0]->dtype));
  std::vector<BucketParam> list;
  for (const ModelParam* p : params) list.push_back({p->key, Volume(p->local_shape)});
  Result<BucketLayout> layout = MegatronBucketLayout(list, {s.dp});
  ASSERT_TRUE(layout.ok()) << layout.status().message();
  const Status check = CheckBucketNumels(*layout, numel.numels, unpadded.numels, what);
  ASSERT_TRUE(check.ok()) << check.message();
  const DType grad = DTypeNamed(numel.grad_dtype);
  for (const char* state : kStates) {
    for (size_t b = 0; b < layout->buckets.size(); ++b) {
      const std::string key = MegatronBucketKey({group}, gbuf, params[0]->dtype, grad, b, state);
      ASSERT_TRUE(dp.Has(key)) << key;
      std::vector<std::pair<int64_t, int64_t>> chunks;
      for (const Box& c : dp.meta().items.at(key).chunks)
        chunks.push_back({c.offsets[0], c.sizes[0]});
      std::sort(chunks.begin(), chunks.end());
      EXPECT_EQ(chunks, MegatronBucketChunks(*layout, b, s.dp)) << key;
      tally->buckets += std::string(state) == "param";
    }
    for (size_t i = 0; i < params.size(); ++i) {
      const BucketSlot& slot = layout->slots[i];
      Result<Whole> flat = dp.WholeTensor(
          MegatronBucketKey({group}, gbuf, params[i]->dtype, grad, slot.bucket, state));
      Result<Whole> expected =
          twin.WholeTensor(std::string("optimizer.state.") + state + "." + params[i]->key);
      ASSERT_TRUE(flat.ok() && expected.ok());
      const std::vector<uint8_t> want = LocalBytes(*params[i], *expected);
      ASSERT_EQ(static_cast<int64_t>(want.size()), slot.numel * 4);
      EXPECT_EQ(std::memcmp(&flat->bytes[slot.offset * 4], want.data(), want.size()), 0)
          << state << " of " << params[i]->key << " layer " << params[i]->layer;
      tally->elements += slot.numel;
    }
  }
  tally->buffers += 1;
  tally->params += static_cast<int>(params.size());
}

class MegatronBucketsSavesTest : public testing::TestWithParam<const char*> {};

TEST_P(MegatronBucketsSavesTest, FlatBucketsHoldEachParametersTpPiece) {
  const std::string tag = GetParam();
  Folder dp(kSaves / (tag + "_optim_dp_reshardable"));
  Folder twin(kSaves / (tag + "_optim_fully_reshardable"));
  ExpectOrderKnowsEveryTensor(dp);
  Result<SaveLayout> s = LayoutOf(dp, tag);
  ASSERT_TRUE(s.ok()) << s.status().message();
  Tally tally;
  for (int pp_rank = 0; pp_rank < s->pp; ++pp_rank) {
    for (int tp_rank = 0; tp_rank < s->tp; ++tp_rank) {
      const int group = MegatronDpGroupIdx(tp_rank, pp_rank, s->tp);
      Result<std::vector<ModelParam>> params = StageParams(dp, *s, tp_rank, pp_rank);
      ASSERT_TRUE(params.ok()) << params.status().message();
      Result<std::vector<BufferNumels>> numel = ReadNumels(dp, group, "per_bucket_numel");
      Result<std::vector<BufferNumels>> unpadded =
          ReadNumels(dp, group, "per_bucket_numel_unpadded");
      ASSERT_TRUE(numel.ok() && unpadded.ok());
      const std::vector<std::vector<const ModelParam*>> buffers = GroupByDtype(*params);
      ASSERT_EQ(buffers.size(), numel->size());
      for (size_t g = 0; g < buffers.size(); ++g) {
        CheckBuffer(dp, twin, *s, group, static_cast<int>(g), buffers[g], (*numel)[g],
                    (*unpadded)[g], &tally);
      }
    }
  }
  // Every flat tensor of the save was derived: none is left unexplained.
  int flat = 0;
  for (const auto& [fqn, item] : dp.meta().items)
    flat += fqn.rfind("optimizer.distributed.", 0) == 0 && item.kind == DcpItem::Kind::kTensor;
  EXPECT_EQ(flat, 3 * tally.buckets);
  std::cout << "[ saves    ] " << tag << ": TP " << s->tp << " PP " << s->pp << " DP " << s->dp
            << ", " << tally.buffers << " grad buffers, " << tally.buckets << " buckets, "
            << tally.params << " parameters, " << tally.elements << " elements of 3 states equal\n";
}

INSTANTIATE_TEST_SUITE_P(Megatron019, MegatronBucketsSavesTest,
                         testing::Values("w1_tp1", "w2_pp2", "w2_tp2", "w2_tp2_swiglu",
                                         "w2_tp2_bf16"));

}  // namespace
}  // namespace reshard
