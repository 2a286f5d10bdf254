#include "formats/hf_common/torchtitan_rules.h"

#include <cstdlib>

#include "formats/hf_common/hf_rules.h"

namespace reshard {
namespace {

const std::vector<std::string> kTorchtitanFields = {"config", "tensors", "ignore"};
const std::vector<std::string> kTorchtitanTensorFields = {"hf", "key", "interleaved_heads", "tp"};
const std::vector<std::string> kTorchtitanTpFields = {"dim", "blocks"};

class TorchtitanSectionParser : RuleReader {
 public:
  explicit TorchtitanSectionParser(const RuleReader& in) : RuleReader(in) {}

  std::shared_ptr<const RuleSection> Parse(const Field& f, const RuleSet& so_far) {
    auto fields = ReadFields(f, "torchtitan", kTorchtitanFields);
    if (!fields) return nullptr;
    if (so_far.section<HfExport>() == nullptr) {
      Fail(f, "torchtitan maps the tensors of the hf section, which this file lacks; add an hf section");
      return nullptr;
    }
    TorchtitanLayout layout;
    layout.line = f.line;
    if (const Field* c = Get(*fields, "config")) layout.config = ParseTorchtitanConfig(*c);
    if (const Field* i = Get(*fields, "ignore")) layout.ignore = ReadStringList(*i, "torchtitan.ignore");
    const Field* t = Get(*fields, "tensors");
    if (t == nullptr || !t->node.IsSequence() || t->node.size() == 0) {
      Fail(t ? *t : f, "torchtitan.tensors must be a non-empty list of {hf: <hf tensor name>, key: <torchtitan key or "
                       "list of alternatives>}");
      return nullptr;
    }
    for (const Field& item : Items(*t)) {
      if (std::optional<TorchtitanTensor> tensor = ParseTorchtitanTensor(item)) layout.tensors.push_back(std::move(*tensor));
    }
    return std::make_shared<const TorchtitanLayout>(std::move(layout));
  }

 private:
  // config.json key -> a number (a literal) or a size expression.
  std::vector<std::pair<std::string, std::string>> ParseTorchtitanConfig(const Field& f) {
    std::vector<std::pair<std::string, std::string>> out;
    if (!f.node.IsMap()) {
      Fail(f, "torchtitan.config must be a mapping of config.json key -> number or size (e.g. tok_embeddings.weight[1])");
      return out;
    }
    for (const auto& kv : f.node) {
      const Field value{kv.second, LineOf(kv.first, f.line)};
      const std::string key = kv.first.IsScalar() ? kv.first.Scalar() : "?";
      auto text = ReadString(value, "torchtitan.config." + key);
      if (!text) continue;
      if (!IsNumber(*text)) CheckSize(value, *text);
      out.emplace_back(key, *text);
    }
    return out;
  }

  static bool IsNumber(const std::string& text) {
    char* end = nullptr;
    std::strtod(text.c_str(), &end);
    return !text.empty() && *end == '\0';
  }

  std::optional<TorchtitanTensor> ParseTorchtitanTensor(const Field& f) {
    const size_t errors_before = error_count();
    auto fields = ReadFields(f, "a torchtitan.tensors entry", kTorchtitanTensorFields);
    if (!fields) return std::nullopt;
    TorchtitanTensor t;
    t.line = f.line;
    const Field* hf = Get(*fields, "hf");
    const Field* key = Get(*fields, "key");
    if (hf == nullptr || key == nullptr) {
      Fail(f, "a torchtitan.tensors entry needs hf: <hf tensor name> and key: <torchtitan key or list of alternatives>");
      return std::nullopt;
    }
    t.hf = ReadString(*hf, "torchtitan.tensors hf").value_or("");
    const std::string block = HfPlaceholders(*hf, t.hf, false, this);
    t.keys = key->node.IsSequence() ? ReadStringList(*key, "torchtitan.tensors key")
                                    : std::vector<std::string>{ReadString(*key, "torchtitan.tensors key").value_or("")};
    for (const std::string& k : t.keys) {
      if (HfPlaceholders(*key, k, false, this) != block) {
        Fail(*key, "torchtitan key '" + k + "' and hf name '" + t.hf + "' must both have {block} or neither");
      }
    }
    if (const Field* heads = Get(*fields, "interleaved_heads")) {
      t.interleaved_heads = ReadString(*heads, "torchtitan.tensors interleaved_heads").value_or("");
      CheckSize(*heads, t.interleaved_heads);
    }
    if (const Field* tp = Get(*fields, "tp")) ParseTorchtitanTp(*tp, &t);
    if (error_count() != errors_before) return std::nullopt;
    return t;
  }

  // `tp: {dim: D, blocks: SIZE}`: the tensor is Shard(D) on the TP mesh.
  void ParseTorchtitanTp(const Field& f, TorchtitanTensor* t) {
    auto fields = ReadFields(f, "torchtitan.tensors tp", kTorchtitanTpFields);
    if (!fields) return;
    const Field* d = Get(*fields, "dim");
    std::optional<int64_t> dim = d ? ReadInt(*d, "torchtitan.tensors tp.dim") : std::nullopt;
    if (d == nullptr || (dim && (*dim < 0 || *dim > 1))) {
      Fail(d ? *d : f, "torchtitan.tensors tp needs dim: 0 (rows: ColwiseParallel, an Embedding) or 1 (columns: "
                       "RowwiseParallel); leave tp out for a tensor replicated on the TP mesh");
      return;
    }
    if (dim) t->tp_dim = static_cast<int>(*dim);
    if (const Field* b = Get(*fields, "blocks")) {
      t->tp_blocks = ReadString(*b, "torchtitan.tensors tp.blocks").value_or("");
      CheckSize(*b, t->tp_blocks);
    }
  }
};

}  // namespace

std::shared_ptr<const RuleSection> ParseTorchtitanSection(const Field& section, const RuleSet& so_far, RuleReader* in) {
  return TorchtitanSectionParser(*in).Parse(section, so_far);
}

}  // namespace reshard
