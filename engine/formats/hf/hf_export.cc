#include "formats/hf/hf_export.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <optional>

#include "container/regular_file.h"
#include "container/safetensors_writer.h"
#include "formats/hf_common/hf_config.h"
#include "formats/hf_common/hf_folder.h"
#include "formats/hf_common/hf_mapping.h"
#include "formats/hf_common/hf_rules.h"
#include "formats/hf_common/hf_tensors.h"
#include "formats/state_dict.h"
#include "logical/settings.h"
#include "util/list_folder.h"
#include "util/strings.h"

namespace reshard {
namespace {

constexpr char kTokenizer[] = "tokenizer";  // the option naming a tokenizer folder

// Files of a tokenizer folder that transformers' AutoTokenizer reads; a
// model folder passed as --tokenizer keeps its config and weights to itself.
bool IsTokenizerFile(const std::string& name) {
  static const char* const kNames[] = {"special_tokens_map.json", "added_tokens.json", "vocab.json",
                                       "merges.txt", "vocab.txt", "spiece.model", "sentencepiece.bpe.model"};
  return name.rfind("tokenizer", 0) == 0 ||
         std::find(std::begin(kNames), std::end(kNames), name) != std::end(kNames);
}

// The folder a tokenizer's links may lead into: the repository of a Hugging
// Face hub cache (models--org--name/, whose snapshots/<revision>/ files are
// links into ../../blobs/), else the tokenizer folder itself.
std::filesystem::path TokenizerRepository(const std::filesystem::path& dir) {
  const std::filesystem::path parent = dir.parent_path();
  return parent.filename() == "snapshots" ? parent.parent_path() : dir;
}

// Why the tokenizer file `path` cannot be copied into an export ("" when it
// can): it must be a regular file, and one read through a link must lie in
// the tokenizer's repository, so that an export never carries a file from
// elsewhere on the machine (a link to /etc/passwd) into a folder people upload.
std::string TokenizerFileProblem(const std::filesystem::path& path, const std::filesystem::path& repository) {
  namespace fs = std::filesystem;
  Result<OpenedFile> opened = OpenRegularFile(path.string());
  if (!opened.ok()) return opened.status().message();
  ::close(opened->fd);
  std::error_code ec;
  const fs::path root = fs::canonical(repository, ec), file = fs::canonical(path, ec);
  if (ec) return "cannot resolve " + path.string() + ": " + ec.message();
  if (std::mismatch(root.begin(), root.end(), file.begin(), file.end()).first == root.end()) return "";
  return path.string() + " is a link to " + file.string() + ", outside the tokenizer's folder " + root.string() +
         "; reshard copies no file from elsewhere into an export (copy the file into the folder if it is meant)";
}

Result<std::vector<SideFile>> TokenizerFiles(const std::string& dir) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    return Status::InvalidInput("--tokenizer " + dir + " is not a folder; pass the folder the tokenizer was "
                                "saved in");
  }
  RESHARD_ASSIGN_OR_RETURN(std::vector<std::filesystem::directory_entry> entries, ListFolder(dir));
  const std::filesystem::path repository = TokenizerRepository(std::filesystem::canonical(dir, ec));
  std::vector<SideFile> files;
  for (const auto& entry : entries) {
    const std::string name = entry.path().filename().string();
    // Whatever its kind: a tokenizer file that cannot be copied is an error, never left out.
    if (!IsTokenizerFile(name) || entry.is_directory(ec)) continue;
    const std::string problem = TokenizerFileProblem(entry.path(), repository);
    if (!problem.empty()) return Status::InvalidInput("--tokenizer: cannot copy " + name + ": " + problem);
    files.push_back({name, "", entry.path().string()});
  }
  std::sort(files.begin(), files.end(), [](const SideFile& a, const SideFile& b) { return a.name < b.name; });
  if (files.empty()) {
    return Status::InvalidInput("--tokenizer " + dir + " holds no tokenizer files (tokenizer.json, "
                                "tokenizer_config.json, tokenizer.model, vocab.json and merges.txt, ...); "
                                "pass the folder the tokenizer was saved in");
  }
  return files;
}

// ---- special token ids from --tokenizer ----------------------------------------

// A JSON file of the tokenizer folder; None when the folder lacks it.
Result<Value> TokenizerJson(const std::string& dir, const char* name) {
  const std::filesystem::path path = std::filesystem::path(dir) / name;
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return Value::None();
  return ReadJsonFile(path.string());
}

// A special token as tokenizer_config.json / special_tokens_map.json name
// it: the string, or an AddedToken dict's "content".
std::optional<std::string> TokenText(const Value& files_token) {
  if (files_token.is(Value::Kind::kString)) return files_token.as_string();
  const Value* content = Find(files_token, "content");
  if (content != nullptr && content->is(Value::Kind::kString)) return content->as_string();
  return std::nullopt;
}

// The id of token `text` in tokenizer_config.json's added_tokens_decoder.
std::optional<int64_t> DecoderId(const std::string& text, const Value& config) {
  const Value* decoder = Find(config, "added_tokens_decoder");
  if (const Items* added = decoder != nullptr ? DictItems(*decoder) : nullptr) {
    for (const auto& [id, token] : *added) {
      int64_t n = 0;
      if (TokenText(token) == text && id.is(Value::Kind::kString) && ParseInt(id.as_string(), &n)) return n;
    }
  }
  return std::nullopt;
}

// The id of token `text` in tokenizer.json's added_tokens or its model's
// vocab, or in vocab.json.
std::optional<int64_t> VocabId(const std::string& text, const Value& tokenizer, const Value& vocab) {
  if (const Value* added = Find(tokenizer, "added_tokens"); added != nullptr && added->is(Value::Kind::kList)) {
    for (const Value& token : added->as_list().items) {
      const Value* id = Find(token, "id");
      if (TokenText(token) == text && id != nullptr && id->is(Value::Kind::kInt)) return id->as_int();
    }
  }
  const Value* model = Find(tokenizer, "model");
  for (const Value* table : {model != nullptr ? Find(*model, "vocab") : nullptr, &vocab}) {
    const Value* id = table != nullptr ? Find(*table, text) : nullptr;
    if (id != nullptr && id->is(Value::Kind::kInt)) return id->as_int();
  }
  return std::nullopt;
}

// bos/eos/pad_token_id of config.json from the tokenizer's files, which
// name the tokens and give their ids; a token named without an id is
// left out and `notes` says so.
Result<std::vector<std::pair<std::string, int64_t>>> SpecialTokenIds(const std::string& dir,
                                                                    std::vector<std::string>* notes) {
  RESHARD_ASSIGN_OR_RETURN(Value config, TokenizerJson(dir, "tokenizer_config.json"));
  RESHARD_ASSIGN_OR_RETURN(Value map, TokenizerJson(dir, "special_tokens_map.json"));
  // The vocabularies (megabytes of JSON) are read only for a token the
  // small files do not give the id of.
  std::optional<std::pair<Value, Value>> vocabularies;
  std::vector<std::pair<std::string, int64_t>> ids;
  for (const std::string role : {"bos", "eos", "pad"}) {
    const Value* named = Find(config, role + "_token");
    if (named == nullptr || named->is_none()) named = Find(map, role + "_token");
    const std::optional<std::string> text = named != nullptr ? TokenText(*named) : std::nullopt;
    if (!text) continue;
    std::optional<int64_t> id = DecoderId(*text, config);
    if (!id && !vocabularies) {
      RESHARD_ASSIGN_OR_RETURN(Value tokenizer, TokenizerJson(dir, "tokenizer.json"));
      RESHARD_ASSIGN_OR_RETURN(Value vocab, TokenizerJson(dir, "vocab.json"));
      vocabularies.emplace(std::move(tokenizer), std::move(vocab));
    }
    if (!id) id = VocabId(*text, vocabularies->first, vocabularies->second);
    if (id) {
      ids.emplace_back(role + "_token_id", *id);
    } else {
      notes->push_back("hf: --tokenizer names the " + role + " token " + JsonString(*text) + " but none of its "
                       "files gives its id, so config.json has no " + role + "_token_id");
    }
  }
  return ids;
}

// What config.json keeps beside what the conversion writes: an HF source's
// own config.json, and the special token ids of --tokenizer.
Result<HfConfigExtras> ConfigExtras(const SourceCheckpoint& src, const ExportOptions& options, Value* source_config,
                                    std::vector<std::string>* notes) {
  HfConfigExtras extras;
  if (IsHfFolder(src.info().tag_dir)) {
    RESHARD_ASSIGN_OR_RETURN(*source_config, ReadJsonFile((std::filesystem::path(src.info().tag_dir) / "config.json").string()));
    if (source_config->is(Value::Kind::kDict)) extras.source = source_config;
  }
  if (const std::string tokenizer = FormatOption(options, kTokenizer); !tokenizer.empty()) {
    RESHARD_ASSIGN_OR_RETURN(extras.token_ids, SpecialTokenIds(tokenizer, notes));
  }
  return extras;
}

Result<TensorChoiceOptions> ChoiceOptions(const ExportOptions& options, const std::vector<FullTensor>& all) {
  const bool masters = FormatOption(options, "from") == "masters";
  if (masters && options.weights_only) {
    return Status::InvalidInput("--from masters and --weights-only contradict each other; keep one");
  }
  if (masters && !HoldsFp32Masters(all)) {
    return Status::InvalidInput("--from masters: the checkpoint has no optimizer state, so no fp32 masters; "
                                "drop --from to export its weights");
  }
  TensorChoiceOptions choice{"hf", masters ? "" : "--from weights, the default", !masters, std::nullopt,
                             options.vocab_size};
  RESHARD_ASSIGN_OR_RETURN(choice.dtype, ExportDType(FormatOption(options, "dtype")));
  return choice;
}

Result<OutputPlan> PlanHf(const SourceCheckpoint& src, const ExportOptions& options, std::vector<std::string>* notes) {
  const RuleInputs inputs{src.info().metadata, src.info().settings};
  RESHARD_ASSIGN_OR_RETURN(const HfExport* hf, FamilyExport(src, inputs));
  std::atomic<int64_t> unused{0};  // planning reads no tensor bytes
  RESHARD_ASSIGN_OR_RETURN(std::vector<FullTensor> all, WholeTensors(src, options.replicated, options.vocab_size,
                                                                     MissingHfConfigValues(*hf, inputs), &unused));
  RESHARD_ASSIGN_OR_RETURN(TensorChoiceOptions choice, ChoiceOptions(options, all));
  if (!choice.vocab_size) choice.vocab_size = src.info().vocab_size;
  RESHARD_ASSIGN_OR_RETURN(std::vector<ChosenTensor> chosen, ChooseTensors(all, src.info().kind, choice, notes));
  StateDictLayout layout{"hf " + hf->architecture, options.replicated, FormatCount(options, kMaxShardSize),
                         FormatOption(options, kFileFormat) == "pt"};
  layout.scratch = std::make_shared<ScratchFolder>();
  RESHARD_ASSIGN_OR_RETURN(std::vector<StateDictTensor> tensors,
                           MapHfTensors(*hf, chosen, inputs, layout.scratch, &layout.scratch_bytes));
  RESHARD_ASSIGN_OR_RETURN(int64_t vocab, VocabRows(chosen, all));
  Value source_config;
  RESHARD_ASSIGN_OR_RETURN(HfConfigExtras extras, ConfigExtras(src, options, &source_config, notes));
  RESHARD_ASSIGN_OR_RETURN(std::string config, HfConfigJson(*hf, inputs, vocab, FloatingDType(chosen), extras));
  std::vector<SideFile> side = {{"config.json", config, ""}};
  if (const std::string folder = FormatOption(options, kTokenizer); !folder.empty()) {
    RESHARD_ASSIGN_OR_RETURN(std::vector<SideFile> tokenizer, TokenizerFiles(folder));
    side.insert(side.end(), tokenizer.begin(), tokenizer.end());
  } else {
    notes->push_back("hf: no --tokenizer given, so the folder has no tokenizer files; transformers and "
                     "lm-eval-harness need them beside config.json");
  }
  return PlanStateDict(src, std::move(layout), std::move(tensors), std::move(side));
}

}  // namespace

TargetFormat HfTarget() {
  TargetFormatInfo info{"hf", "a Hugging Face transformers folder: config.json and the weights",
                        "the folder to write (new, or empty)"};
  info.options = StateDictOptions("weights");
  info.options.push_back({kTokenizer, FormatOptionInfo::Kind::kText,
                          "Folder whose tokenizer files (tokenizer.json, vocab.json, ...) are copied beside the model"});
  return {std::move(info), PlanHf};
}

}  // namespace reshard
