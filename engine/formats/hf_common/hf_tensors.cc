#include "formats/hf_common/hf_tensors.h"

#include <re2/re2.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "formats/hf_common/hf_rules.h"
#include "util/human.h"
#include "util/shape.h"
#include "util/strings.h"

namespace reshard {

Result<int64_t> HfSize(const std::string& size, const RuleInputs& inputs) {
  const size_t star = size.find('*');
  int64_t factor = 1;
  if (star != std::string::npos) ParseInt(size.substr(0, star), &factor);
  const MetaRef ref{{size.substr(star == std::string::npos ? 0 : star + 1)}};
  const std::optional<int64_t> n = ref.Resolve(inputs);
  if (!n) return Status::InvalidInput("the size " + size + " is " + ref.HowToGive());
  return factor * *n;
}

namespace {

constexpr char kBlock[] = "{block}";
constexpr char kExpert[] = "{expert}";

void Replace(std::string* name, const std::string& placeholder, const std::string& value) {
  for (size_t at; (at = name->find(placeholder)) != std::string::npos;) name->replace(at, placeholder.size(), value);
}

// Output elements [i, stop) of a transpose, out[c][r] = in[r][c], from the
// band `in` ([rows, width] holding columns first.. of the source) to `out`,
// with the element size known to the compiler. Whole output rows go in
// tiles of kTileRows source rows, so that the cache lines of a tile are read
// for every column they hold before they are evicted: few enough rows that
// a power-of-two row stride, which maps them all to one cache set, still
// fits the set's ways.
template <typename T>
void CopyTransposed(const uint8_t* in, int64_t width, int64_t rows, int64_t first, int64_t i, int64_t stop,
                    uint8_t* out) {
  constexpr int64_t kTileRows = 8;
  auto element = [&](int64_t r, int64_t c) { return in + (r * width + c - first) * static_cast<int64_t>(sizeof(T)); };
  auto part_of_row = [&](int64_t from, int64_t to) {  // output elements [from, to) of one output row
    const int64_t c = from / rows;
    for (int64_t k = from; k < to; ++k, out += sizeof(T)) std::memcpy(out, element(k % rows, c), sizeof(T));
  };
  const int64_t whole_from = (i + rows - 1) / rows, whole_to = stop / rows;  // whole output rows
  if (whole_from >= whole_to) {
    for (int64_t k = i; k < stop;) {
      const int64_t to = std::min(stop, (k / rows + 1) * rows);
      part_of_row(k, to);
      k = to;
    }
    return;
  }
  part_of_row(i, whole_from * rows);
  uint8_t* const whole = out;
  for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
    const int64_t r1 = std::min(rows, r0 + kTileRows);
    for (int64_t c = whole_from; c < whole_to; ++c) {
      uint8_t* o = whole + ((c - whole_from) * rows + r0) * static_cast<int64_t>(sizeof(T));
      for (int64_t r = r0; r < r1; ++r, o += sizeof(T)) std::memcpy(o, element(r, c), sizeof(T));
    }
  }
  out = whole + (whole_to - whole_from) * rows * static_cast<int64_t>(sizeof(T));
  part_of_row(whole_to * rows, stop);
}

void CopyTransposed(const uint8_t* in, int64_t width, int64_t rows, int64_t first, int64_t i, int64_t stop,
                    int element, uint8_t* out) {
  switch (element) {
    case 1: return CopyTransposed<uint8_t>(in, width, rows, first, i, stop, out);
    case 2: return CopyTransposed<uint16_t>(in, width, rows, first, i, stop, out);
    case 4: return CopyTransposed<uint32_t>(in, width, rows, first, i, stop, out);
    case 8: return CopyTransposed<uint64_t>(in, width, rows, first, i, stop, out);
    default:
      for (; i < stop; ++i, out += element) {
        std::memcpy(out, in + ((i % rows) * width + (i / rows - first)) * element, static_cast<size_t>(element));
      }
  }
}

// Rows of a [rows, cols] matrix that one read of at most `piece` bytes
// takes, and columns of it (rows of the transpose) that one band of at most
// `piece` bytes of the transpose holds: at least one of each.
int64_t StripRows(int64_t rows, int64_t cols, int element, int64_t piece) {
  return std::clamp<int64_t>(piece / std::max<int64_t>(1, cols * element), 1, std::max<int64_t>(1, rows));
}
int64_t BandColumns(int64_t rows, int64_t cols, int element, int64_t piece) {
  return StripRows(cols, rows, element, piece);
}

// The transpose of a matrix, made at the first request and held until all of
// its bytes have been produced: in memory when it is at most a piece, else
// in a scratch file, so that its memory is a few pieces whatever its size.
// Asked for again after that, it is made again. Several workers may ask at
// once; one makes it while the others wait.
class TransposeStore {
 public:
  TransposeStore(ByteProducer source, int64_t rows, int64_t cols, int element,
                 std::shared_ptr<const ScratchFolder> scratch, int64_t piece)
      : source_(std::move(source)), rows_(rows), cols_(cols), element_(element),
        scratch_(std::move(scratch)), piece_(piece) {}

  Status Produce(int64_t offset, int64_t length, uint8_t* dst) {
    std::shared_ptr<const Made> made;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (made_ == nullptr) {
        RESHARD_ASSIGN_OR_RETURN(made_, Make());
        produced_ = 0;
      }
      made = made_;
    }
    if (made->file) {
      RESHARD_RETURN_IF_ERROR(made->file->Read(offset, length, dst));
    } else {
      std::memcpy(dst, made->bytes.data() + offset, static_cast<size_t>(length));
    }
    std::lock_guard<std::mutex> lock(mu_);
    produced_ += length;
    if (made_ == made && produced_ >= Bytes()) made_.reset();  // freed with the last reader's copy
    return Status::Ok();
  }

 private:
  struct Made {
    std::vector<uint8_t> bytes;       // in memory
    std::optional<ScratchFile> file;  // or in a file
  };

  int64_t Bytes() const { return rows_ * cols_ * element_; }

  Result<std::shared_ptr<const Made>> Make() const {
    auto made = std::make_shared<Made>();
    if (Bytes() <= piece_ || scratch_ == nullptr) {
      std::vector<uint8_t> in(static_cast<size_t>(Bytes()));
      RESHARD_RETURN_IF_ERROR(source_(0, Bytes(), in.data()));
      made->bytes.resize(in.size());
      TransposeMatrix(in.data(), rows_, cols_, element_, made->bytes.data());
    } else {
      RESHARD_ASSIGN_OR_RETURN(ScratchFile file, scratch_->NewFile());
      RESHARD_RETURN_IF_ERROR(WriteTiles(file));
      RESHARD_RETURN_IF_ERROR(OrderBands(file));
      made->file = std::move(file);
    }
    return std::shared_ptr<const Made>(std::move(made));
  }

  // The first pass: the source a strip of rows at a time, each strip cut
  // into tiles of a band's columns, transposed. Band b, the transpose's
  // rows [b * width, (b + 1) * width), takes the file's bytes from
  // b * width * rows elements on, and holds its tiles one strip after the
  // other: [strip][column][row of the strip].
  Status WriteTiles(const ScratchFile& file) const {
    const int64_t strip_rows = StripRows(rows_, cols_, element_, piece_);
    const int64_t width = BandColumns(rows_, cols_, element_, piece_), row_bytes = cols_ * element_;
    std::vector<uint8_t> strip, tile;
    for (int64_t r0 = 0; r0 < rows_; r0 += strip_rows) {
      const int64_t n = std::min(strip_rows, rows_ - r0);
      strip.resize(static_cast<size_t>(n * row_bytes));
      RESHARD_RETURN_IF_ERROR(source_(r0 * row_bytes, n * row_bytes, strip.data()));
      for (int64_t c0 = 0; c0 < cols_; c0 += width) {
        const int64_t w = std::min(width, cols_ - c0);
        tile.resize(static_cast<size_t>(w * n * element_));
        CopyTransposed(strip.data(), cols_, n, 0, c0 * n, (c0 + w) * n, element_, tile.data());
        RESHARD_RETURN_IF_ERROR(file.Write((c0 * rows_ + r0 * w) * element_, tile.data(), w * n * element_));
      }
    }
    return Status::Ok();
  }

  // The second pass: each band from [strip][column][row of the strip] to
  // [column][row], in place. With one strip, or one column a band, the
  // tiles are already in that order.
  Status OrderBands(const ScratchFile& file) const {
    const int64_t strip_rows = StripRows(rows_, cols_, element_, piece_);
    const int64_t width = BandColumns(rows_, cols_, element_, piece_);
    if (strip_rows >= rows_ || width == 1) return Status::Ok();
    std::vector<uint8_t> tiles, band;
    for (int64_t c0 = 0; c0 < cols_; c0 += width) {
      const int64_t w = std::min(width, cols_ - c0), begin = c0 * rows_ * element_, bytes = w * rows_ * element_;
      tiles.resize(static_cast<size_t>(bytes));
      band.resize(static_cast<size_t>(bytes));
      RESHARD_RETURN_IF_ERROR(file.Read(begin, bytes, tiles.data()));
      for (int64_t r0 = 0; r0 < rows_; r0 += strip_rows) {
        const int64_t n = std::min(strip_rows, rows_ - r0);
        const uint8_t* tile = tiles.data() + r0 * w * element_;
        for (int64_t c = 0; c < w; ++c) {
          std::memcpy(band.data() + (c * rows_ + r0) * element_, tile + c * n * element_,
                      static_cast<size_t>(n * element_));
        }
      }
      RESHARD_RETURN_IF_ERROR(file.Write(begin, band.data(), bytes));
    }
    return Status::Ok();
  }

  const ByteProducer source_;
  const int64_t rows_, cols_;
  const int element_;
  const std::shared_ptr<const ScratchFolder> scratch_;
  const int64_t piece_;
  std::mutex mu_;
  std::shared_ptr<const Made> made_;
  int64_t produced_ = 0;  // bytes of made_ produced so far
};

// The tensor `part` of `t`, transposed when the entry says so.
Result<StateDictTensor> MakePart(const HfTensorMap& map, const ChosenTensor& t, const HfPart& part,
                                 const std::shared_ptr<const ScratchFolder>& scratch, int64_t* scratch_bytes) {
  std::vector<int64_t> shape = t.shape;
  if (!shape.empty()) shape[0] = part.rows;
  const int element = ElementSize(t.dtype);
  const int64_t row_bytes = (t.shape.empty() || t.shape[0] == 0 ? 1 : ShapeNumel(t.shape) / t.shape[0]) * element;
  std::string detail = std::string(t.master ? "fp32 master" : "weights") + " " + t.name;
  if (!part.runs.empty()) detail += ", rows reordered";
  if (map.transpose && shape.size() != 2) {
    return Status::InvalidInput("transpose (line " + std::to_string(map.line) + ") needs a matrix, and " +
                                t.name + " has shape " + ShapeString(t.shape));
  }
  StateDictTensor out{part.name, t.dtype, shape, detail, nullptr};
  if (map.transpose) {
    out.shape = {shape[1], shape[0]};
    out.detail += ", transposed";
    *scratch_bytes = std::max(*scratch_bytes, TransposeScratchBytes(shape[0], shape[1], element));
  }
  const bool transpose = map.transpose;
  out.bytes = [t, runs = part.runs, row_bytes, shape, transpose, element,
               scratch](const std::vector<FullTensor>& sources) {
    ByteProducer bytes = ChosenBytes(t, sources);
    if (!runs.empty()) bytes = GatherRows(std::move(bytes), row_bytes, runs);
    return transpose ? Transposed(std::move(bytes), shape[0], shape[1], element, scratch) : bytes;
  };
  return out;
}

// Each entry's name template, and which parameters it found.
struct Entry {
  const HfTensorMap* map;
  std::unique_ptr<HfNameTemplate> from;
  int found = 0;
};

}  // namespace

HfNameTemplate::HfNameTemplate(std::string name) : name_(std::move(name)) {
  std::string pattern;
  size_t pos = 0;
  for (size_t at = pos; (at = name_.find('{', at)) != std::string::npos; ++at) {
    const bool expert = name_.compare(at, std::strlen(kExpert), kExpert) == 0;
    if (!expert && name_.compare(at, std::strlen(kBlock), kBlock) != 0) continue;  // a literal brace
    pattern += RE2::QuoteMeta(name_.substr(pos, at - pos)) + "([0-9]+)";
    expert_group_.push_back(expert);
    pos = at + std::strlen(expert ? kExpert : kBlock);
  }
  pattern_ = std::make_unique<RE2>(pattern + RE2::QuoteMeta(name_.substr(pos)));
}

HfNameTemplate::~HfNameTemplate() = default;

bool HfNameTemplate::Match(const std::string& name, std::string* block, std::string* expert) const {
  std::vector<std::string> values(expert_group_.size());
  std::vector<RE2::Arg> args(values.size());
  std::vector<const RE2::Arg*> arg_ptrs(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    args[i] = &values[i];
    arg_ptrs[i] = &args[i];
  }
  if (!RE2::FullMatchN(name, *pattern_, arg_ptrs.data(), static_cast<int>(arg_ptrs.size()))) return false;
  block->clear();
  if (expert != nullptr) expert->clear();
  for (size_t i = 0; i < values.size(); ++i) {
    std::string* slot = expert_group_[i] ? expert : block;
    if (slot != nullptr) *slot = values[i];
  }
  return true;
}

std::string HfNameTemplate::With(const std::string& block, const std::string& expert) const {
  std::string name = name_;
  Replace(&name, kBlock, block);
  Replace(&name, kExpert, expert);
  return name;
}

Result<std::vector<HfPart>> HfParts(const HfTensorMap& map, const std::string& name,
                                    const std::vector<int64_t>& shape, const RuleInputs& inputs,
                                    const std::string& block, const std::string& expert) {
  const int64_t rows = shape.empty() ? 1 : shape[0];
  std::vector<HfPart> parts;
  for (const std::string& to : map.to) parts.push_back({HfNameTemplate(to).With(block, expert), {}, rows});
  if (map.split == HfTensorMap::Split::kHalves) {
    if (rows % 2 != 0) {
      return Status::InvalidInput(name + " has " + std::to_string(rows) + " rows, which split_halves "
                                  "cannot halve (line " + std::to_string(map.line) + ")");
    }
    for (int half = 0; half < 2; ++half) parts[half] = {parts[half].name, HalfRows(rows, half), rows / 2};
  }
  if (map.split != HfTensorMap::Split::kQkv) return parts;
  const std::optional<int64_t> groups = map.groups.Resolve(inputs), heads = map.heads.Resolve(inputs);
  if (!groups || !heads) {
    return Status::InvalidInput("split_qkv of " + name + " needs its " + (groups ? "head" : "group") +
                                " count, which is " + (groups ? map.heads : map.groups).HowToGive());
  }
  const int64_t units = *heads + 2 * *groups;
  if (*groups < 1 || *heads % *groups != 0 || rows % units != 0) {
    return Status::InvalidInput(name + " has " + std::to_string(rows) + " rows, not a fused QKV of " +
                                std::to_string(*groups) + " KV groups and " + std::to_string(*heads) +
                                " query heads ((heads + 2 x groups) x head_dim rows)");
  }
  std::vector<HfPart> qkv;
  for (int part = 0; part < 3; ++part) {
    qkv.push_back({"", QkvRows(*groups, *heads, rows / units, part), (part == 0 ? *heads : *groups) * (rows / units)});
  }
  if (parts.size() == 1) {  // one tensor [q; k; v]
    HfPart fused{parts[0].name, {}, rows};
    for (const HfPart& p : qkv) fused.runs.insert(fused.runs.end(), p.runs.begin(), p.runs.end());
    return std::vector<HfPart>{fused};
  }
  for (int part = 0; part < 3; ++part) qkv[part].name = parts[part].name;
  return qkv;
}

Status CheckHfShape(const HfExport& hf, const HfTensorMap& map, const std::string& name,
                    const std::vector<int64_t>& shape, const RuleInputs& inputs) {
  if (map.shape.empty()) return Status::Ok();
  std::vector<int64_t> want;
  bool same = map.shape.size() == shape.size();
  for (size_t i = 0; i < map.shape.size(); ++i) {
    // "*": any size (the vocabulary rows, which the tensors themselves give).
    const int64_t n = map.shape[i] == "*" && i < shape.size() ? shape[i] : -1;
    if (n >= 0) {
      want.push_back(n);
      continue;
    }
    RESHARD_ASSIGN_OR_RETURN(int64_t size, HfSize(map.shape[i], inputs));
    want.push_back(size);
    same = same && i < shape.size() && shape[i] == size;
  }
  if (same) return Status::Ok();
  return Status::Unsupported(hf.architecture + " needs " + name + " of shape " + ShapeString(want) + " (" +
                             Join(map.shape, ", ") + ", hf.tensors line " + std::to_string(map.line) +
                             "), and the checkpoint's is " + ShapeString(shape) +
                             "; the architecture does not compute this model");
}

std::vector<RowRun> QkvRows(int64_t groups, int64_t heads, int64_t head_dim, int part) {
  const int64_t per_group = heads / groups;  // query heads of one KV group
  const int64_t offset = part == 0 ? 0 : per_group + part - 1;
  const int64_t count = part == 0 ? per_group : 1;
  std::vector<RowRun> runs;
  for (int64_t g = 0; g < groups; ++g) runs.push_back({(g * (per_group + 2) + offset) * head_dim, count * head_dim});
  return runs;
}

std::vector<RowRun> HalfRows(int64_t rows, int half) { return {{half * rows / 2, rows / 2}}; }

std::vector<RowRun> RotaryPairRows(int64_t rows, int64_t heads, bool interleaved) {
  const int64_t hd = rows / heads;
  std::vector<RowRun> runs;
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t a = 0; a < hd; ++a) {
      // Row a of the head in the order written: interleaved a = 2i + j, halves a = j hd/2 + i.
      const int64_t i = interleaved ? a / 2 : a % (hd / 2), j = interleaved ? a % 2 : a / (hd / 2);
      runs.push_back({h * hd + (interleaved ? j * hd / 2 + i : 2 * i + j), 1});
    }
  }
  return runs;
}

ByteProducer GatherRows(ByteProducer source, int64_t row_bytes, std::vector<RowRun> runs) {
  return ByteProducer::Traced([source = std::move(source), row_bytes, runs = std::move(runs)](
                                  int64_t offset, int64_t length, uint8_t* dst, const SpanSink& spans) {
    int64_t at = 0;  // output byte where the current run starts
    for (const RowRun& run : runs) {
      const int64_t run_bytes = run.count * row_bytes;
      const int64_t begin = std::max(offset, at), end = std::min(offset + length, at + run_bytes);
      if (begin < end) {
        RESHARD_RETURN_IF_ERROR(
            source(run.first * row_bytes + (begin - at), end - begin, dst + (begin - offset), spans));
      }
      at += run_bytes;
    }
    return Status::Ok();
  });
}

void TransposeMatrix(const uint8_t* in, int64_t rows, int64_t cols, int element, uint8_t* out) {
  CopyTransposed(in, cols, rows, 0, 0, rows * cols, element, out);
}

int64_t TransposeScratchBytes(int64_t rows, int64_t cols, int element, int64_t piece_bytes) {
  const int64_t matrix = rows * cols * element;
  if (matrix <= piece_bytes) return 2 * matrix;  // the source and its transpose
  const int64_t strip = StripRows(rows, cols, element, piece_bytes) * cols * element;
  const int64_t band = BandColumns(rows, cols, element, piece_bytes) * rows * element;
  return 2 * std::max(strip, band);  // a strip and its tiles, or a band and its reordering
}

ByteProducer Transposed(ByteProducer source, int64_t rows, int64_t cols, int element,
                        std::shared_ptr<const ScratchFolder> scratch, int64_t piece_bytes) {
  // Shared by the copies the writer may make of the producer.
  auto store = std::make_shared<TransposeStore>(std::move(source), rows, cols, element, std::move(scratch),
                                                piece_bytes);
  return [store](int64_t offset, int64_t length, uint8_t* dst) { return store->Produce(offset, length, dst); };
}

Result<std::vector<StateDictTensor>> MapHfTensors(const HfExport& hf, const std::vector<ChosenTensor>& chosen,
                                                  const RuleInputs& inputs,
                                                  const std::shared_ptr<const ScratchFolder>& scratch,
                                                  int64_t* scratch_bytes) {
  std::vector<Entry> entries;
  for (const HfTensorMap& map : hf.tensors) entries.push_back({&map, std::make_unique<HfNameTemplate>(map.from)});
  std::vector<StateDictTensor> out;
  for (const ChosenTensor& t : chosen) {
    std::string block, expert;
    auto entry = std::find_if(entries.begin(), entries.end(),
                              [&](const Entry& e) { return e.from->Match(t.name, &block, &expert); });
    if (entry == entries.end()) {
      return Status::Unsupported("the HF export to " + hf.architecture + " has no place for " + t.name +
                                 " (no hf.tensors entry maps it); the architecture does not compute this "
                                 "model, or the rule file's hf section lacks an entry");
    }
    ++entry->found;
    RESHARD_RETURN_IF_ERROR(CheckHfShape(hf, *entry->map, t.name, t.shape, inputs));
    RESHARD_ASSIGN_OR_RETURN(std::vector<HfPart> parts, HfParts(*entry->map, t.name, t.shape, inputs, block, expert));
    for (const HfPart& part : parts) {
      RESHARD_ASSIGN_OR_RETURN(StateDictTensor tensor, MakePart(*entry->map, t, part, scratch, scratch_bytes));
      out.push_back(std::move(tensor));
    }
  }
  for (const Entry& e : entries) {
    if (e.found > 0) continue;
    return Status::Unsupported(hf.architecture + " needs " + e.from->With("0", "0") +
                               ", which this checkpoint does not have (hf.tensors line " +
                               std::to_string(e.map->line) + "); the architecture does not compute this model");
  }
  return out;
}

}  // namespace reshard
