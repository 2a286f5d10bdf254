#include "formats/hf/hf_tensors.h"

#include <re2/re2.h>

#include <algorithm>
#include <cstring>
#include <list>
#include <map>
#include <memory>
#include <mutex>

#include "util/human.h"
#include "util/shape.h"
#include "util/strings.h"

namespace reshard {
namespace {

constexpr char kBlock[] = "{block}";

// A dim of an entry's `shape`: N, a path, or N*path.
Result<int64_t> DimSize(const std::string& dim, const RuleInputs& inputs) {
  const size_t star = dim.find('*');
  int64_t factor = 1;
  if (star != std::string::npos) ParseInt(dim.substr(0, star), &factor);
  const MetaRef size{{dim.substr(star == std::string::npos ? 0 : star + 1)}};
  const std::optional<int64_t> n = size.Resolve(inputs);
  if (!n) return Status::InvalidInput("the size " + dim + " is " + size.HowToGive());
  return factor * *n;
}

// The most a band read asks of the source at once: each request is a call
// through the source's producers and a release of the pages it touched.
constexpr int64_t kBandRequest = int64_t{1} << 20;
// Bands kept: each of two workers writing ranges of one file walks through its own.
constexpr size_t kKeptBands = 2;

// Columns per band of a [rows, cols] source of `element`-byte elements.
int64_t BandColumns(int64_t rows, int64_t cols, int element, int64_t band_bytes) {
  return std::max<int64_t>(1, std::min<int64_t>(cols, band_bytes / std::max<int64_t>(1, rows * element)));
}

// The source of a transpose in column bands: band b is columns
// [b * width, (b + 1) * width) of every row, row-major, read at its first
// use and dropped once all of its bytes, or its last ones, have been
// produced (or while more than kKeptBands are held). Several workers may ask
// at once, each walking forward through its own range of the output: the
// one that produces a band's last bytes has left it, and a band whose first
// bytes end another worker's range is read again when that worker gets
// there rather than held until then (measured: four 8 MiB bands held at
// once by two workers, not two).
class ColumnBands {
 public:
  ColumnBands(ByteProducer source, int64_t rows, int64_t cols, int element, int64_t band_bytes)
      : source_(std::move(source)), rows_(rows), cols_(cols), element_(element),
        width_(BandColumns(rows, cols, element, band_bytes)) {}

  int64_t width() const { return width_; }
  int64_t ColumnsOf(int64_t band) const { return std::min(width_, cols_ - band * width_); }

  Result<std::shared_ptr<const std::vector<uint8_t>>> Get(int64_t band) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto it = kept_.begin(); it != kept_.end(); ++it) {
        if (it->band != band) continue;
        kept_.splice(kept_.begin(), kept_, it);  // most recent first
        return kept_.front().bytes;
      }
    }
    // Read outside the lock: the other worker's band may be ready first.
    auto bytes = std::make_shared<std::vector<uint8_t>>(static_cast<size_t>(rows_ * ColumnsOf(band) * element_));
    RESHARD_RETURN_IF_ERROR(Read(band, bytes->data()));
    std::lock_guard<std::mutex> lock(mu_);
    kept_.push_front({band, bytes});
    if (kept_.size() > kKeptBands) kept_.pop_back();
    return std::shared_ptr<const std::vector<uint8_t>>(bytes);
  }

  // Counts `n` bytes of band `band` produced, `to_end` when they end where
  // the band does; the band is dropped after all of its bytes or its last.
  void Produced(int64_t band, int64_t n, bool to_end) {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t& done = produced_[band];
    done += n;
    const bool all = done >= rows_ * ColumnsOf(band) * element_;
    if (all) produced_.erase(band);  // a new pass over the tensor starts again
    if (all || to_end) kept_.remove_if([band](const Kept& k) { return k.band == band; });
  }

 private:
  // Reads band `band` into `out`. A request covers the slices of as many
  // rows as fit in kBandRequest, with the bytes between them: a request per
  // row (the 4x benchmark's 39 MiB matrices in 32 MiB bands) took the export
  // from 7-12 s to 16 s, each row costing a call, a page fault and a release
  // of the pages around it. So a narrow band costs a pass over the matrix,
  // from the page cache after the first.
  Status Read(int64_t band, uint8_t* out) const {
    const int64_t row_bytes = cols_ * element_, slice = ColumnsOf(band) * element_;
    const int64_t rows_per_request = slice == row_bytes ? rows_ : std::max<int64_t>(1, kBandRequest / row_bytes);
    std::vector<uint8_t> staging;  // not thread_local: it would stay resident in every worker
    for (int64_t r = 0; r < rows_; r += rows_per_request) {
      const int64_t n = std::min(rows_per_request, rows_ - r), span = (n - 1) * row_bytes + slice;
      const int64_t from = r * row_bytes + band * width_ * element_;
      if (n == 1 || slice == row_bytes) {  // the span is the band's bytes
        RESHARD_RETURN_IF_ERROR(ReadSpan(from, span, out + r * slice));
        continue;
      }
      staging.resize(static_cast<size_t>(span));
      RESHARD_RETURN_IF_ERROR(source_(from, span, staging.data()));
      for (int64_t k = 0; k < n; ++k) std::memcpy(out + (r + k) * slice, staging.data() + k * row_bytes, slice);
    }
    return Status::Ok();
  }

  // Source bytes [from, from + n) in requests of at most kBandRequest.
  Status ReadSpan(int64_t from, int64_t n, uint8_t* out) const {
    for (int64_t at = 0; at < n; at += kBandRequest) {
      RESHARD_RETURN_IF_ERROR(source_(from + at, std::min(kBandRequest, n - at), out + at));
    }
    return Status::Ok();
  }

  struct Kept {
    int64_t band;
    std::shared_ptr<const std::vector<uint8_t>> bytes;
  };
  const ByteProducer source_;
  const int64_t rows_, cols_;
  const int element_;
  const int64_t width_;
  std::mutex mu_;
  std::list<Kept> kept_;
  std::map<int64_t, int64_t> produced_;  // bytes of each band produced so far
};

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

// The tensor `part` of `t`, transposed when the entry says so.
Result<StateDictTensor> MakePart(const HfTensorMap& map, const ChosenTensor& t, const HfPart& part,
                                 int64_t* scratch_bytes) {
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
  out.bytes = [t, runs = part.runs, row_bytes, shape, transpose, element](const std::vector<FullTensor>& sources) {
    ByteProducer bytes = ChosenBytes(t, sources);
    if (!runs.empty()) bytes = GatherRows(std::move(bytes), row_bytes, runs);
    return transpose ? Transposed(std::move(bytes), shape[0], shape[1], element) : bytes;
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
  for (size_t at; (at = name_.find(kBlock, pos)) != std::string::npos; pos = at + std::strlen(kBlock)) {
    pattern += RE2::QuoteMeta(name_.substr(pos, at - pos)) + "([0-9]+)";
  }
  pattern_ = std::make_unique<RE2>(pattern + RE2::QuoteMeta(name_.substr(pos)));
}

HfNameTemplate::~HfNameTemplate() = default;

bool HfNameTemplate::Match(const std::string& name, std::string* block) const {
  block->clear();
  return pattern_->NumberOfCapturingGroups() == 0 ? RE2::FullMatch(name, *pattern_)
                                                  : RE2::FullMatch(name, *pattern_, block);
}

std::string HfNameTemplate::With(const std::string& block) const {
  std::string name = name_;
  for (size_t at; (at = name.find(kBlock)) != std::string::npos;) name.replace(at, std::strlen(kBlock), block);
  return name;
}

Result<std::vector<HfPart>> HfParts(const HfTensorMap& map, const std::string& name,
                                    const std::vector<int64_t>& shape, const RuleInputs& inputs,
                                    const std::string& block) {
  const int64_t rows = shape.empty() ? 1 : shape[0];
  std::vector<HfPart> parts;
  for (const std::string& to : map.to) parts.push_back({HfNameTemplate(to).With(block), {}, rows});
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
  for (const std::string& dim : map.shape) {
    RESHARD_ASSIGN_OR_RETURN(int64_t n, DimSize(dim, inputs));
    want.push_back(n);
  }
  if (want == shape) return Status::Ok();
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

ByteProducer GatherRows(ByteProducer source, int64_t row_bytes, std::vector<RowRun> runs) {
  return [source = std::move(source), row_bytes, runs = std::move(runs)](int64_t offset, int64_t length,
                                                                          uint8_t* dst) {
    int64_t at = 0;  // output byte where the current run starts
    for (const RowRun& run : runs) {
      const int64_t run_bytes = run.count * row_bytes;
      const int64_t begin = std::max(offset, at), end = std::min(offset + length, at + run_bytes);
      if (begin < end) {
        RESHARD_RETURN_IF_ERROR(source(run.first * row_bytes + (begin - at), end - begin, dst + (begin - offset)));
      }
      at += run_bytes;
    }
    return Status::Ok();
  };
}

int64_t TransposeScratchBytes(int64_t rows, int64_t cols, int element, int64_t band_bytes) {
  const int64_t band = rows * BandColumns(rows, cols, element, band_bytes) * element;
  return std::min<int64_t>(rows * cols * element, (kKeptBands + 1) * band);  // kept, and one being read
}

ByteProducer Transposed(ByteProducer source, int64_t rows, int64_t cols, int element, int64_t band_bytes) {
  // Shared by the copies the writer may make of the producer.
  auto bands = std::make_shared<ColumnBands>(std::move(source), rows, cols, element, band_bytes);
  return [bands, rows, element](int64_t offset, int64_t length, uint8_t* dst) {
    const int64_t end = (offset + length) / element;  // out[c][r] = in[r][c], element by element
    for (int64_t i = offset / element; i < end;) {
      const int64_t band = i / rows / bands->width(), first = band * bands->width();
      const int64_t width = bands->ColumnsOf(band);
      RESHARD_ASSIGN_OR_RETURN(std::shared_ptr<const std::vector<uint8_t>> in, bands->Get(band));
      const int64_t band_end = (first + width) * rows, stop = std::min(end, band_end);
      CopyTransposed(in->data(), width, rows, first, i, stop, element, dst + (i * element - offset));
      bands->Produced(band, (stop - i) * element, stop == band_end);
      i = stop;
    }
    return Status::Ok();
  };
}

Result<std::vector<StateDictTensor>> MapHfTensors(const HfExport& hf, const std::vector<ChosenTensor>& chosen,
                                                  const RuleInputs& inputs, int64_t* scratch_bytes) {
  std::vector<Entry> entries;
  for (const HfTensorMap& map : hf.tensors) entries.push_back({&map, std::make_unique<HfNameTemplate>(map.from)});
  std::vector<StateDictTensor> out;
  for (const ChosenTensor& t : chosen) {
    std::string block;
    auto entry = std::find_if(entries.begin(), entries.end(),
                              [&](const Entry& e) { return e.from->Match(t.name, &block); });
    if (entry == entries.end()) {
      return Status::Unsupported("the HF export to " + hf.architecture + " has no place for " + t.name +
                                 " (no hf.tensors entry maps it); the architecture does not compute this "
                                 "model, or the rule file's hf section lacks an entry");
    }
    ++entry->found;
    RESHARD_RETURN_IF_ERROR(CheckHfShape(hf, *entry->map, t.name, t.shape, inputs));
    RESHARD_ASSIGN_OR_RETURN(std::vector<HfPart> parts, HfParts(*entry->map, t.name, t.shape, inputs, block));
    for (const HfPart& part : parts) {
      RESHARD_ASSIGN_OR_RETURN(StateDictTensor tensor, MakePart(*entry->map, t, part, scratch_bytes));
      out.push_back(std::move(tensor));
    }
  }
  for (const Entry& e : entries) {
    if (e.found > 0) continue;
    return Status::Unsupported(hf.architecture + " needs " + e.from->With("0") +
                               ", which this checkpoint does not have (hf.tensors line " +
                               std::to_string(e.map->line) + "); the architecture does not compute this model");
  }
  return out;
}

}  // namespace reshard
