#include "parity/fixture_cmd.h"

#include <algorithm>
#include <filesystem>
#include <fmt/format.h>
#include <unistd.h>

#include <nlohmann/json.hpp>
#include <optional>

#include "fixtures/fixture.h"
#include "parity/cli_common.h"
#include "parity/fixture_kinds.h"
#include "parity/report.h"
#include "parity/terminal_progress.h"
#include "reference/fast/fast_gemm.h"
#include "reference/parallel.h"

namespace twin::cli {
namespace {

using json = nlohmann::json;

struct Result {
  std::string file;
  std::optional<std::string> kind;  // unknown when the file could not be loaded
  std::string twin;
  bool isolated = false;
  bool fast = false;  // the reference in fast mode (fp32 GEMMs)
  int tp = 1;         // the twin's tensor-parallel size (the reference: always 1)
  bool sp = false;
  int ep = 1;  // the twin's expert-parallel size (the reference: always 1)
  Status status = Status::Error;
  std::string message;
  std::vector<Comparison> rows;
  int first_failure = -1;  // index into rows
  std::string grads;       // what happened to the golden's grad.* tensors (compare_fixture)
  std::string routing;     // where the twin's routing map differs from the golden's ("" when not)
  std::string megatron;    // the Megatron-Core semantics the golden was held to ("" when unknown)
};

Result run_one(const FixtureOptions& opt, const Fixture& fx, TwinKind twin) {
  Result r;
  r.file = fx.path;
  r.kind = fx.kind;
  r.megatron = fx.megatron ? fx.megatron->name : "";
  r.twin = twin_kind_name(twin);
  r.isolated = opt.isolate;
  r.fast = opt.fast && twin == TwinKind::Reference;
  // --tp / --sp shard the optimized twin; a golden is the unsharded layer, which the reference is.
  const bool sharded = twin == TwinKind::Optimized;
  // Without --tp / --ep, the golden's own layout (a capture of a multi-rank job records it).
  const bool golden_layout = opt.tp == 0;
  r.tp = !sharded ? 1 : golden_layout ? std::max(1, fx.config.tensor_model_parallel_size) : opt.tp;
  r.sp = sharded && (golden_layout ? fx.config.sequence_parallel && r.tp > 1 : opt.sp);
  r.ep = !sharded ? 1 : opt.ep == 0 ? std::max(1, fx.config.expert_model_parallel_size) : opt.ep;
  RunMode mode{opt.isolate, r.tp, r.sp, r.ep};
  mode.fast = r.fast;
  const FixtureHandler handler = opt.lookup(fx.kind, twin, mode);
  if (!handler) {
    r.status = Status::Unsupported;
    if (opt.isolate && opt.lookup(fx.kind, twin, RunMode{}))
      r.message = fmt::format("the {} twin does not run fixture kind '{}' isolated yet", r.twin, fx.kind);
    else if (r.tp > 1 && opt.lookup(fx.kind, twin, RunMode{opt.isolate}))
      r.message = fmt::format("the {} twin does not run fixture kind '{}' at tp > 1 yet", r.twin, fx.kind);
    else if (r.ep > 1 && opt.lookup(fx.kind, twin, RunMode{opt.isolate, r.tp, r.sp}))
      r.message = fmt::format("the {} twin does not run fixture kind '{}' at ep > 1", r.twin, fx.kind);
    else
      r.message = fmt::format("the {} twin does not support fixture kind '{}' yet", r.twin, fx.kind);
    return r;
  }
  try {
    r.rows = compare_fixture(handler, fx, twin, mode, &r.grads, &r.routing);
  } catch (const FixtureUnsupported& e) {
    r.status = Status::Unsupported;
    r.message = e.what();
    r.rows.clear();
    r.grads = {};
    r.routing = {};
    return r;
  } catch (...) {
    r.status = Status::Error;
    r.message = describe_exception(std::current_exception());
    r.rows.clear();
    return r;
  }
  int failures = 0;
  for (std::size_t i = 0; i < r.rows.size(); ++i)
    if (!r.rows[i].pass) {
      if (r.first_failure < 0) r.first_failure = static_cast<int>(i);
      ++failures;
    }
  if (r.rows.empty()) {
    // A handler that compares nothing has checked nothing: that is not a pass.
    r.status = Status::Fail;
    r.message = "the handler compared no tensor";
  } else if (failures) {
    const Comparison& c = r.rows[r.first_failure];
    r.status = Status::Fail;
    r.message = fmt::format("{} of {} tensors out of tolerance; first: {}", failures, r.rows.size(), c.name);
    if (!c.message.empty()) r.message += " (" + c.message + ")";
  } else {
    r.status = Status::Pass;
    r.message = fmt::format("{} tensors within tolerance", r.rows.size());
    if (r.grads.rfind("not compared", 0) == 0) r.message += "; gradients " + r.grads;
  }
  if (!r.routing.empty()) r.message += "; routing " + r.routing;
  return r;
}

json to_json(const Result& r) {
  return {{"file", r.file},
          {"kind", r.kind ? json(*r.kind) : json(nullptr)},
          {"twin", r.twin},
          {"isolated", r.isolated},
          {"fast", r.fast},
          {"tp", r.tp},
          {"sp", r.sp},
          {"ep", r.ep},
          {"megatron", r.megatron.empty() ? json(nullptr) : json(r.megatron)},
          {"status", status_name(r.status)},
          {"message", r.message},
          {"grads", r.grads.empty() ? json(nullptr) : json(r.grads)},
          {"routing", r.routing.empty() ? json(nullptr) : json(r.routing)},
          {"tensors", rows_json(r.rows)}};
}

void print_text(const Result& r, std::ostream& out, std::ostream& err) {
  if (r.status == Status::Error) {
    // which file, when the message does not say (JSON has it in "file")
    err << "error: " << (r.message.find(r.file) == std::string::npos ? r.file + ": " : "") << r.message << "\n";
    return;
  }
  if (r.status == Status::Unsupported) {
    out << fmt::format("{}: unsupported: {}\n", r.file, r.message);
    return;
  }
  out << fmt::format("{}  [kind {}, {} twin{}{}{}{}, Megatron-Core {}]\n", r.file, r.kind.value_or("?"), r.twin,
                     r.fast ? " (fast mode: fp32 GEMMs)" : "",
                     r.tp > 1 ? fmt::format(", tp {}{}", r.tp, r.sp ? "+sp" : "") : "",
                     r.ep > 1 ? fmt::format(", ep {}", r.ep) : "", r.isolated ? ", isolated" : "", r.megatron);
  print_rows(out, r.rows, r.first_failure);
  if (!r.grads.empty()) out << fmt::format("  gradients: {}\n", r.grads);
  if (!r.routing.empty()) out << fmt::format("  routing: {}\n", r.routing);
  out << fmt::format("  {}: {}\n", r.status == Status::Pass ? "PASS" : "FAIL", r.message);
}

}  // namespace

int run_fixture(const FixtureOptions& opt, std::ostream& out, std::ostream& err) {
  std::vector<TwinKind> twins;
  if (opt.twin == "reference" || opt.twin == "both") twins.push_back(TwinKind::Reference);
  if (opt.twin == "optimized" || opt.twin == "both") twins.push_back(TwinKind::Optimized);
  if (twins.empty()) {
    err << "error: --twin must be reference, optimized or both, not '" << opt.twin << "'\n";
    return 2;
  }
  if (opt.tp < 0 || (opt.sp && opt.tp <= 1)) {
    err << "error: --tp must be >= 1, and --sp needs --tp > 1 (Megatron rejects sequence parallelism without "
           "tensor parallelism)\n";
    return 2;
  }
  if ((opt.tp > 1 || opt.sp) && opt.twin == "reference") {
    err << "error: --tp / --sp shard the optimized twin; the reference is the unsharded layer (use --twin optimized "
           "or both)\n";
    return 2;
  }
  if (opt.ep < 0 || (opt.ep > 1 && opt.twin == "reference")) {
    err << "error: --ep must be >= 1 and runs the optimized twin's experts over N ranks; the reference is the "
           "ep = 1 layer (use --twin optimized or both)\n";
    return 2;
  }
  if (opt.fast && opt.twin == "optimized") {
    err << "error: --fast is a mode of the reference twin (use --twin reference or both)\n";
    return 2;
  }
  if (opt.threads > 0) {
    reference::set_threads(opt.threads);
    reference::set_gemm_threads(opt.threads);  // fast mode's BLAS
  }
  const MegatronSemantics* megatron = opt.megatron.empty() ? nullptr : find_megatron_semantics(opt.megatron);
  if (!opt.megatron.empty() && !megatron) {
    err << "error: --megatron: " << unknown_megatron_commit(opt.megatron) << "\n";
    return 2;
  }
  // A folder stands for the fixtures under it (subfolders too, sorted): `twin fixture DIR`.
  std::vector<std::string> files;
  for (const std::string& path : opt.files) {
    std::error_code ec;
    if (!std::filesystem::is_directory(path, ec)) {
      files.push_back(path);
      continue;
    }
    std::vector<std::string> found;
    for (const auto& e : std::filesystem::recursive_directory_iterator(path, ec)) {
      const std::string f = e.path().string();
      if (e.is_regular_file() && (ends_with(f, ".safetensors") || ends_with(f, ".json"))) found.push_back(f);
    }
    std::sort(found.begin(), found.end());
    files.insert(files.end(), found.begin(), found.end());
  }
  // Progress only for people watching a terminal; pipes, tests and --json see the results alone.
  const int columns = opt.json ? 0 : terminal_columns(STDERR_FILENO);
  const bool progress = columns > 0;
  int code = -1;
  int counts[4] = {0, 0, 0, 0};
  auto emit = [&](const Result& r) {
    if (progress) err << "\r\033[K" << std::flush;
    if (opt.json)
      out << to_json(r).dump() << "\n";
    else
      print_text(r, out, err);
    out.flush();
    ++counts[static_cast<int>(r.status)];
    code = code < 0 ? exit_code(r.status) : combine_exit_codes(code, exit_code(r.status));
  };
  for (std::size_t i = 0; i < files.size(); ++i) {
    const std::string& path = files[i];
    const std::string label = files.size() > 1 ? fmt::format("[{}/{}] {}", i + 1, files.size(), path) : path;
    if (progress) err << "\r\033[K" << label << std::flush;
    if (!ends_with(path, ".safetensors") && !ends_with(path, ".json")) {
      // Not a fixture at all (a README beside the fixtures, say): nothing any twin can run.
      Result r;
      r.file = path;
      r.twin = opt.twin;
      r.isolated = opt.isolate;
      r.status = Status::Unsupported;
      r.message = "not a fixture file: fixtures are .safetensors files or .json tables";
      emit(r);
      continue;
    }
    std::optional<Fixture> fx;
    try {
      fx = load_fixture(path);
    } catch (...) {
      // The file itself is bad: one result, whichever twins were asked for.
      Result r;
      r.file = path;
      r.twin = opt.twin;
      r.isolated = opt.isolate;
      r.status = Status::Error;
      r.message = describe_exception(std::current_exception());
      emit(r);
      continue;
    }
    if (megatron) fx->hold_to(megatron);
    for (TwinKind t : twins) {
      std::optional<TerminalProgress> shown;  // each module as the twin runs it
      if (progress) shown.emplace(err, label + " · " + twin_kind_name(t), columns);
      Result r = run_one(opt, *fx, t);
      shown.reset();
      emit(r);
    }
  }
  if (!opt.json && counts[0] + counts[1] + counts[2] + counts[3] > 1)
    out << fmt::format("{} pass, {} fail, {} unsupported, {} error\n", counts[0], counts[1], counts[2], counts[3]);
  return code < 0 ? 0 : code;
}

}  // namespace twin::cli
