// reshard._reshard: the Python binding of the library (include/reshard/),
// as thin as the CLI. python/reshard/__init__.py is the module users import:
// it turns the buffers this module returns into torch tensors or numpy
// arrays, and documents each function.
//
// Every call into the engine runs without the GIL, so several Python threads
// can read or convert at once; a failure raises reshard.Error with the
// CLI's one line.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <optional>
#include <stdexcept>

#include "reshard/checkpoint.h"
#include "reshard/reshard.h"

namespace py = pybind11;

namespace {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

void Check(const reshard::Status& status) {
  if (!status.ok()) throw Error(status.message());
}

template <typename T>
T Take(reshard::Result<T> result) {
  Check(result.status());
  return std::move(*result);
}

// ---- keyword arguments -----------------------------------------------------

// The keyword arguments of one call, read into its options; a name no
// option has is a TypeError naming it.
class Kwargs {
 public:
  explicit Kwargs(const py::kwargs& kwargs) : kwargs_(kwargs) {}

  template <typename T>
  void Get(const char* name, T* field) {
    if (!kwargs_.contains(name)) return;
    py::object value = kwargs_[name];
    used_.push_back(name);
    if (!value.is_none()) *field = value.cast<T>();
  }

  // The argument `name` (None when not given), as a Python object.
  py::object Take(const char* name) {
    py::object value = py::none();
    Get(name, &value);
    return value;
  }

  void Done(const char* function) const {
    for (const auto& item : kwargs_) {
      const std::string name = py::str(item.first);
      if (std::find(used_.begin(), used_.end(), name) == used_.end()) {
        throw py::type_error(std::string(function) + "() got an unexpected keyword argument '" + name + "'");
      }
    }
  }

 private:
  const py::kwargs& kwargs_;
  std::vector<std::string> used_;
};

reshard::ReplicatedPolicy Policy(const std::string& name) {
  if (name == "check") return reshard::ReplicatedPolicy::kCheck;
  if (name == "average") return reshard::ReplicatedPolicy::kAverage;
  if (name == "first") return reshard::ReplicatedPolicy::kFirst;
  throw Error("replicated must be \"check\", \"average\" or \"first\", not \"" + name + "\"");
}

// A progress callback called from the engine's threads with each progress
// line (Progress::Line): each call takes the GIL; the first exception it raises is raised again once the engine
// returns (later lines are not reported).
class Progress {
 public:
  explicit Progress(py::object callback) : callback_(std::move(callback)) {}

  reshard::ProgressCallback Function() {
    if (callback_.is_none()) return nullptr;
    return [this](const reshard::Progress& progress) {
      py::gil_scoped_acquire gil;
      std::lock_guard<std::mutex> lock(mu_);
      if (error_) return;
      try {
        callback_(progress.Line());
      } catch (py::error_already_set& e) {
        error_.emplace(std::move(e));
      }
    };
  }

  void RaiseIfFailed() {
    if (error_) throw *error_;
  }

 private:
  py::object callback_;
  std::mutex mu_;
  std::optional<py::error_already_set> error_;
};

void ReadCommon(Kwargs& kw, reshard::CommonOptions* o, Progress* progress) {
  kw.Get("rules", &o->rules);
  kw.Get("allow_class", &o->allowed_classes);
  kw.Get("set", &o->set);
  kw.Get("state_dict_prefixes", &o->state_dict_prefixes);
  kw.Get("weights_only", &o->weights_only);
  kw.Get("threads", &o->threads);
  kw.Get("check_crc", &o->check_crc);
  if (progress != nullptr) o->progress = progress->Function();
}

void ReadPreflight(Kwargs& kw, reshard::PreflightOptions* o, Progress* progress) {
  ReadCommon(kw, o, progress);
  std::string replicated = "check";
  kw.Get("replicated", &replicated);
  o->replicated = Policy(replicated);
  kw.Get("vocab_size", &o->vocab_size);
}

void ReadWrite(Kwargs& kw, reshard::WriteOptions* o, Progress* progress) {
  ReadPreflight(kw, o, progress);
  kw.Get("overwrite", &o->overwrite);
  kw.Get("dry_run", &o->dry_run);
  kw.Get("max_memory", &o->max_memory);
  kw.Get("buffer_size", &o->buffer_size);
  kw.Get("command", &o->command);
}

// The keyword argument of a target format's option: `-` written `_`, and
// `from` as `from_` (a Python keyword).
std::string KeywordOf(const std::string& option) {
  std::string name = option;
  std::replace(name.begin(), name.end(), '-', '_');
  return name == "from" ? "from_" : name;
}

// The text of an option's value as the CLI would take it: a list or tuple
// comma-separated ([5, 6, 6, 5] as "5,6,6,5"), anything else its str().
std::string OptionText(const py::object& value) {
  if (!py::isinstance<py::list>(value) && !py::isinstance<py::tuple>(value)) return py::str(value);
  std::string text;
  for (const py::handle item : value) text += (text.empty() ? "" : ",") + std::string(py::str(item));
  return text;
}

// The options the target formats declare, each given as any value (its text).
void ReadFormatOptions(Kwargs& kw, std::map<std::string, std::string>* given) {
  for (const reshard::TargetFormatInfo& target : reshard::TargetFormats()) {
    for (const reshard::FormatOptionInfo& option : target.options) {
      py::object value = kw.Take(KeywordOf(option.name).c_str());
      if (option.kind == reshard::FormatOptionInfo::Kind::kFlag) {
        if (!value.is_none() && value.cast<bool>()) (*given)[option.name] = "true";
      } else if (!value.is_none()) {
        (*given)[option.name] = OptionText(value);
      }
    }
  }
}

// What an export is told beyond the write options: the target, its layout
// and its options.
void ReadExport(Kwargs& kw, reshard::ExportOptions* o) {
  kw.Get("to", &o->to);
  kw.Get("tp", &o->tp);
  kw.Get("pp", &o->pp);
  kw.Get("dp", &o->dp);
  kw.Get("ep", &o->ep);
  ReadFormatOptions(kw, &o->format_options);
}

// ---- reports ---------------------------------------------------------------

const char* SeverityName(reshard::Finding::Severity s) {
  switch (s) {
    case reshard::Finding::Severity::kError: return "error";
    case reshard::Finding::Severity::kWarning: return "warning";
    case reshard::Finding::Severity::kInfo: return "info";
  }
  return "error";
}

py::dict LintDict(const reshard::LintReport& r) {
  py::list findings;
  for (const auto& f : r.findings) {
    findings.append(py::dict(py::arg("severity") = SeverityName(f.severity), py::arg("message") = f.message));
  }
  return py::dict(py::arg("ok") = r.ok(), py::arg("rule_set") = r.rule_set, py::arg("summary") = r.summary,
                  py::arg("findings") = findings, py::arg("notes") = r.notes);
}

py::dict ConvertDict(const reshard::ConvertReport& r) {
  return py::dict(py::arg("plan") = r.plan, py::arg("notes") = r.notes, py::arg("files") = r.files,
                  py::arg("tensor_bytes") = r.tensor_bytes, py::arg("bytes_written") = r.bytes_written,
                  py::arg("bytes_read") = r.bytes_read, py::arg("checkpoint_bytes") = r.checkpoint_bytes,
                  py::arg("memory_budget") = r.memory_budget, py::arg("memory_estimate") = r.memory_estimate,
                  py::arg("peak_memory") = r.peak_memory, py::arg("buffer_bytes") = r.buffer_bytes,
                  py::arg("threads") = r.threads, py::arg("phases") = r.phases, py::arg("seconds") = r.seconds);
}

py::dict VerifyDict(const reshard::VerifyReport& r) {
  return py::dict(py::arg("same") = r.same(), py::arg("tensors_compared") = r.tensors_compared,
                  py::arg("elements_compared") = r.elements_compared, py::arg("differences") = r.differences,
                  py::arg("notes") = r.notes);
}

py::dict ManifestDict(const reshard::ManifestReport& r) {
  return py::dict(py::arg("ok") = r.ok(), py::arg("files_checked") = r.files_checked,
                  py::arg("bytes_checked") = r.bytes_checked, py::arg("summary") = r.summary,
                  py::arg("problems") = r.problems);
}

// ---- commands --------------------------------------------------------------

py::dict Lint(const std::string& path, py::kwargs kwargs) {
  reshard::LintOptions o;
  Kwargs kw(kwargs);
  ReadPreflight(kw, &o, nullptr);
  kw.Get("tp", &o.target_tp);
  kw.Get("pp", &o.target_pp);
  kw.Get("dp", &o.target_dp);
  kw.Get("ep", &o.target_ep);
  kw.Get("to", &o.to);
  kw.Get("deep", &o.deep);
  kw.Get("max_drift_lines", &o.max_drift_lines);
  kw.Done("lint");
  reshard::Result<reshard::LintReport> r = [&] {
    py::gil_scoped_release nogil;
    return reshard::Lint(path, o);
  }();
  return LintDict(Take(std::move(r)));
}

std::string Inspect(const std::string& path, py::kwargs kwargs) {
  reshard::InspectOptions o;
  Kwargs kw(kwargs);
  ReadCommon(kw, &o, nullptr);
  kw.Done("inspect");
  py::gil_scoped_release nogil;
  return Take(reshard::Inspect(path, o));
}

// Runs a writing command without the GIL, its progress through `progress`.
template <typename F>
py::dict RunWriting(Progress* progress, F run) {
  reshard::Result<reshard::ConvertReport> r = [&] {
    py::gil_scoped_release nogil;
    return run();
  }();
  progress->RaiseIfFailed();
  return ConvertDict(Take(std::move(r)));
}

py::dict Convert(const std::string& input, const std::string& output, py::kwargs kwargs) {
  reshard::ConvertOptions o;
  Kwargs kw(kwargs);
  Progress progress(kw.Take("progress"));
  ReadWrite(kw, &o, &progress);
  kw.Get("tp", &o.target_tp);
  kw.Get("pp", &o.target_pp);
  kw.Get("dp", &o.target_dp);
  kw.Get("ep", &o.target_ep);
  kw.Get("to", &o.to);
  ReadFormatOptions(kw, &o.format_options);
  kw.Done("convert");
  return RunWriting(&progress, [&] { return reshard::Convert(input, output, o); });
}

py::dict Export(const std::string& input, const std::string& output, py::kwargs kwargs) {
  reshard::ExportOptions o;
  Kwargs kw(kwargs);
  Progress progress(kw.Take("progress"));
  ReadWrite(kw, &o, &progress);
  ReadExport(kw, &o);
  kw.Done("export");
  return RunWriting(&progress, [&] { return reshard::Export(input, output, o); });
}

py::dict Verify(const std::string& a, std::optional<std::string> b, py::kwargs kwargs) {
  reshard::VerifyOptions o;
  Kwargs kw(kwargs);
  ReadCommon(kw, &o, nullptr);
  kw.Get("rules_b", &o.rules_b);
  kw.Get("deep", &o.deep);
  std::string replicated = "first";
  kw.Get("replicated", &replicated);
  o.replicated = Policy(replicated);
  kw.Get("max_difference_lines", &o.max_difference_lines);
  kw.Get("max_memory", &o.max_memory);
  kw.Done("verify");
  if (!b) {
    reshard::Result<reshard::ManifestReport> r = [&] {
      py::gil_scoped_release nogil;
      return reshard::VerifyManifest(a, o);
    }();
    return ManifestDict(Take(std::move(r)));
  }
  reshard::Result<reshard::VerifyReport> r = [&] {
    py::gil_scoped_release nogil;
    return reshard::Verify(a, *b, o);
  }();
  return VerifyDict(Take(std::move(r)));
}

const char* KindName(reshard::FormatOptionInfo::Kind kind) {
  switch (kind) {
    case reshard::FormatOptionInfo::Kind::kCount: return "count";
    case reshard::FormatOptionInfo::Kind::kFlag: return "flag";
    case reshard::FormatOptionInfo::Kind::kText: break;
  }
  return "text";
}

py::list TargetFormats() {
  py::list out;
  for (const reshard::TargetFormatInfo& t : reshard::TargetFormats()) {
    py::list options;
    for (const reshard::FormatOptionInfo& o : t.options) {
      options.append(py::dict(py::arg("name") = KeywordOf(o.name),
                              py::arg("kind") = KindName(o.kind),
                              py::arg("help") = o.help, py::arg("choices") = o.choices,
                              py::arg("default") = o.default_value));
    }
    py::list sizes;
    if (t.tp) sizes.append("tp");
    if (t.pp) sizes.append("pp");
    if (t.dp) sizes.append("dp");
    if (t.ep) sizes.append("ep");
    out.append(py::dict(py::arg("name") = t.name, py::arg("help") = t.help, py::arg("output") = t.output,
                        py::arg("layout") = sizes, py::arg("options") = options));
  }
  return out;
}

py::list RuleSets() {
  py::list out;
  for (const auto& r : Take(reshard::ListRuleSets())) {
    out.append(py::dict(py::arg("name") = r.name, py::arg("description") = r.description,
                        py::arg("origin") = r.origin));
  }
  return out;
}

// ---- reading in place --------------------------------------------------------

// Tensors and objects are made by the Python side's factories:
// tensor(bytes, dtype, shape) and object(class_name, args, state), args and
// state None for a global reference (a class or function named, not called).
struct Factories {
  py::object tensor;
  py::object object;
};

py::object TensorObject(reshard::TensorBytes t, const Factories& f) {
  std::string dtype = t.dtype;
  std::vector<int64_t> shape = t.shape;
  return f.tensor(py::cast(std::move(t)), dtype, shape);
}

py::object TreeObject(reshard::TreeValue& v, const Factories& f) {
  using K = reshard::TreeValue::Kind;
  switch (v.kind) {
    case K::kNone: return py::none();
    case K::kBool: return py::bool_(v.boolean);
    case K::kInt: return py::int_(v.integer);
    case K::kFloat: return py::float_(v.number);
    case K::kString: return py::str(v.text);
    case K::kBytes: return py::bytes(v.text);
    case K::kTensor: return TensorObject(std::move(v.tensor), f);
    case K::kGlobal: return f.object(v.text, py::none(), py::none());
    case K::kList:
    case K::kTuple:
    case K::kObject: {
      py::list items;
      for (auto& item : v.items) items.append(TreeObject(item, f));
      if (v.kind == K::kList) return std::move(items);
      if (v.kind == K::kTuple) return py::tuple(items);
      py::dict state;
      for (auto& [key, value] : v.entries) state[TreeObject(key, f)] = TreeObject(value, f);
      return f.object(v.text, items, state);
    }
    case K::kDict: {
      py::dict out;
      for (auto& [key, value] : v.entries) out[TreeObject(key, f)] = TreeObject(value, f);
      return std::move(out);
    }
  }
  throw Error("a value of an unknown kind");
}

py::dict MetaDict(const reshard::TensorMeta& m) {
  return py::dict(py::arg("name") = m.name, py::arg("section") = m.section, py::arg("param") = m.param,
                  py::arg("state") = m.state, py::arg("dtype") = m.dtype, py::arg("shape") = py::tuple(py::cast(m.shape)),
                  py::arg("rule") = m.rule, py::arg("vocab") = m.vocab,
                  py::arg("vocab_size") = m.vocab ? py::object(py::int_(m.vocab_size)) : py::object(py::none()));
}

class PyCheckpoint {
 public:
  PyCheckpoint(const std::string& path, py::kwargs kwargs) {
    reshard::OpenOptions o;
    Kwargs kw(kwargs);
    ReadPreflight(kw, &o, nullptr);
    kw.Done("open");
    reshard::Result<std::unique_ptr<reshard::Checkpoint>> opened = [&] {
      py::gil_scoped_release nogil;
      return reshard::Checkpoint::Open(path, o);
    }();
    ckpt_ = Take(std::move(opened));
    for (size_t i = 0; i < ckpt_->tensors().size(); ++i) index_[ckpt_->tensors()[i].name] = i;
  }

  std::string Summary() const { return ckpt_->summary(); }

  std::vector<std::string> Keys() const {
    std::vector<std::string> keys;
    for (const auto& m : ckpt_->tensors()) keys.push_back(m.name);
    return keys;
  }

  py::dict Meta(const std::string& name) const {
    auto it = index_.find(name);
    if (it == index_.end()) throw Error("no tensor " + name + " in the checkpoint; keys() lists the canonical names");
    return MetaDict(ckpt_->tensors()[it->second]);
  }

  py::object Tensor(const std::string& name, const Factories& f) const {
    reshard::Result<reshard::TensorBytes> t = [&] {
      py::gil_scoped_release nogil;
      return ckpt_->Tensor(name);
    }();
    return TensorObject(Take(std::move(t)), f);
  }

  py::dict StateDict(const reshard::RankSpec& rank, const Factories& f) const {
    reshard::Result<std::vector<std::pair<std::string, reshard::TensorBytes>>> tensors = [&] {
      py::gil_scoped_release nogil;
      return ckpt_->StateDict(rank);
    }();
    py::dict out;
    for (auto& [key, t] : Take(std::move(tensors))) out[py::str(key)] = TensorObject(std::move(t), f);
    return out;
  }

  // {"state_dict": {key: tensor}, "texts": {name: str}, "copies": {name: bytes}}.
  py::dict Export(const Factories& f, py::kwargs kwargs) const {
    reshard::ExportOptions o;
    Kwargs kw(kwargs);
    ReadExport(kw, &o);
    kw.Done("export");
    reshard::Result<reshard::ExportedFiles> files = [&] {
      py::gil_scoped_release nogil;
      return ckpt_->Export(o);
    }();
    reshard::ExportedFiles out = Take(std::move(files));
    py::dict tensors, texts, copies;
    for (auto& [key, t] : out.tensors) tensors[py::str(key)] = TensorObject(std::move(t), f);
    for (const auto& [name, text] : out.texts) texts[py::str(name)] = py::str(text);
    for (const auto& [name, bytes] : out.copies) copies[py::str(name)] = py::bytes(bytes);
    return py::dict(py::arg("state_dict") = tensors, py::arg("texts") = texts, py::arg("copies") = copies);
  }

  py::object OptimizerState(const reshard::RankSpec& rank, const Factories& f) const {
    reshard::Result<reshard::TreeValue> tree = [&] {
      py::gil_scoped_release nogil;
      return ckpt_->OptimizerState(rank);
    }();
    reshard::TreeValue v = Take(std::move(tree));
    return TreeObject(v, f);
  }

 private:
  std::unique_ptr<reshard::Checkpoint> ckpt_;
  std::map<std::string, size_t> index_;
};

reshard::RankSpec Rank(int tp, int pp, int dp, int ep, int tp_rank, int pp_rank, int dp_rank, int ep_rank) {
  reshard::RankSpec r;
  r.tp = tp, r.pp = pp, r.dp = dp, r.ep = ep;
  r.tp_rank = tp_rank, r.pp_rank = pp_rank, r.dp_rank = dp_rank, r.ep_rank = ep_rank;
  return r;
}

}  // namespace

PYBIND11_MODULE(_reshard, m) {
  m.doc() = "The reshard library's binding; import reshard instead.";
  py::register_exception<Error>(m, "Error");

  py::class_<reshard::TensorBytes>(m, "TensorBytes", py::buffer_protocol())
      .def_buffer([](reshard::TensorBytes& t) {
        return py::buffer_info(t.data, 1, py::format_descriptor<uint8_t>::format(), 1, {t.size}, {1});
      })
      .def_readonly("mapped", &reshard::TensorBytes::mapped);

  py::class_<Factories>(m, "Factories")
      .def(py::init<py::object, py::object>(), py::arg("tensor"), py::arg("object"));

  m.def("lint", &Lint, py::arg("checkpoint"));
  m.def("inspect", &Inspect, py::arg("checkpoint"));
  m.def("convert", &Convert, py::arg("input"), py::arg("output"));
  m.def("export", &Export, py::arg("input"), py::arg("output"));
  m.def("verify", &Verify, py::arg("a"), py::arg("b") = py::none());
  m.def("target_formats", &TargetFormats);
  m.def("rule_sets", &RuleSets);

  py::class_<PyCheckpoint>(m, "Checkpoint")
      .def(py::init<const std::string&, py::kwargs>(), py::arg("path"))
      .def("summary", &PyCheckpoint::Summary)
      .def("keys", &PyCheckpoint::Keys)
      .def("meta", &PyCheckpoint::Meta, py::arg("name"))
      .def("tensor", &PyCheckpoint::Tensor, py::arg("name"), py::arg("factories"))
      .def(
          "state_dict",
          [](const PyCheckpoint& c, const Factories& f, int tp, int pp, int ep, int tp_rank, int pp_rank,
             int ep_rank) { return c.StateDict(Rank(tp, pp, 1, ep, tp_rank, pp_rank, 0, ep_rank), f); },
          py::arg("factories"), py::arg("tp"), py::arg("pp"), py::arg("ep"), py::arg("tp_rank"), py::arg("pp_rank"),
          py::arg("ep_rank"))
      .def(
          "optimizer_state",
          [](const PyCheckpoint& c, const Factories& f, int tp, int pp, int dp, int ep, int tp_rank, int pp_rank,
             int dp_rank, int ep_rank) {
            return c.OptimizerState(Rank(tp, pp, dp, ep, tp_rank, pp_rank, dp_rank, ep_rank), f);
          },
          py::arg("factories"), py::arg("tp"), py::arg("pp"), py::arg("dp"), py::arg("ep"), py::arg("tp_rank"),
          py::arg("pp_rank"), py::arg("dp_rank"), py::arg("ep_rank"))
      .def("export", &PyCheckpoint::Export, py::arg("factories"));
}
