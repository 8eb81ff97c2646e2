#include "parity/check.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <filesystem>
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "parity/cli_common.h"
#include "parity/dense_run.h"
#include "parity/fixture_kinds.h"

namespace twin::cli {

const std::vector<std::string>& known_fixture_kinds() {
  static const std::vector<std::string> kinds = {"dense_layer",         "moe_layer",   "retro_decoder_layer_first",
                                                 "retro_decoder_layer", "retro_block", "layer_offset_table",
                                                 "retro_layout_table"};
  return kinds;
}

namespace {

// The embedded dense-layer configurations: small enough for the simulator (CI), and realistic
// shapes added when a GPU is present. Each runs through the reference (mirroring Megatron, and
// exactly in fp64 for the bound) and the optimized twin (GPU if present, else the simulator).
struct DenseConfig {
  const char* name;
  const char* id;  // a canonical case id; dtype / tp / sp are overridden per row
};
const DenseConfig kSimConfigs[] = {
    {"gpt-ln-gelu",
     "dense(h=64,a=4,g=4,d=16,ffn=256,norm=ln,act=gelu,glu=0,bias=1,qkv_bias=0,rope=none,rot=1,qkln=0,mask=causal,s=16,"
     "b=2,dtype=fp32,tp=1,sp=0,drop=0,seed=11)"},
    {"llama-rms-swiglu-gqa-rope",
     "dense(h=64,a=8,g=4,d=16,ffn=128,norm=rms,act=silu,glu=1,bias=0,qkv_bias=0,rope=half,rot=1,qkln=0,mask=causal,s="
     "16,b=2,dtype=fp32,tp=1,sp=0,drop=0,seed=12)"},
    {"qkln-interleaved-padding-dropout",
     "dense(h=48,a=4,g=4,d=16,ffn=96,norm=ln,act=gelu,glu=0,bias=1,qkv_bias=1,rope=interleaved,rot=0.5,qkln=1,mask="
     "padding,s=12,b=2,dtype=fp32,tp=1,sp=0,drop=0.1,seed=13)"},
};
const DenseConfig kGpuConfigs[] = {
    {"gpu-llama-gqa-512",
     "dense(h=512,a=8,g=4,d=64,ffn=1024,norm=rms,act=silu,glu=1,bias=0,qkv_bias=0,rope=half,rot=1,qkln=0,mask=causal,s="
     "256,b=2,dtype=bf16,tp=1,sp=0,drop=0,seed=21)"},
    {"gpu-gpt-1024",
     "dense(h=1024,a=16,g=16,d=64,ffn=4096,norm=ln,act=gelu,glu=0,bias=1,qkv_bias=0,rope=none,rot=1,qkln=0,mask=causal,"
     "s=128,b=2,dtype=bf16,tp=1,sp=0,drop=0,seed=22)"},
};
struct Variant {
  DType dt;
  int tp;
  bool sp;
};
const Variant kSimVariants[] = {{DType::F32, 1, false},  {DType::BF16, 1, false}, {DType::F16, 1, false},
                                {DType::BF16, 2, false}, {DType::BF16, 2, true},  {DType::F32, 4, false},
                                {DType::BF16, 4, true}};

const char* short_dtype(DType d) {
  return d == DType::F32 ? "fp32" : d == DType::BF16 ? "bf16" : d == DType::F16 ? "fp16" : dtype_name(d);
}

struct Row {
  std::string layer, dtype, backend, tp, detail;
  double max_err = 0, bound = 0, share = 0, seconds = 0;
  Status status = Status::Pass;
};

std::string fixtures_dir() {
  const std::string d = golden_dir();
  return std::filesystem::is_directory(d) ? d : "";
}

// Why mode's tensor parallelism cannot shard golden f's dense layer (the layer would refuse it,
// as Megatron does), or "": such a row is unsupported, not an error.
std::string tp_sharding_problem(const Fixture& f, const RunMode& mode) {
  if (mode.tp <= 1 || f.kind != "dense_layer") return "";
  const TransformerConfig& c = f.config;
  const std::int64_t s = f.tensor("input.hidden_states").size(0);
  const bool latent =
      !c.multi_latent_attention ||  // MLA's down projections are column parallel
      ((c.kv_lora_rank + c.qk_pos_emb_head_dim) % mode.tp == 0 && c.q_lora_rank.value_or(0) % mode.tp == 0);
  if (c.num_attention_heads % mode.tp == 0 && c.query_groups() % mode.tp == 0 && c.ffn() % mode.tp == 0 && latent &&
      !(mode.sp && s % mode.tp))
    return "";
  return fmt::format("tp {}{} does not shard this layer (heads {}, query groups {}, ffn {}{})", mode.tp,
                     mode.sp ? " + sp" : "", c.num_attention_heads, c.query_groups(), c.ffn(),
                     mode.sp ? fmt::format(", sequence {}", s) : "");
}

struct Job {
  std::string label;
  std::function<Row()> run;
};

// One dense case through both twins (parity::run_case): the output's error against its bound.
Row dense_row(const std::string& name, const parity::DenseCase& c, rt::Backend backend, const std::string& tp) {
  Row r{"dense " + name, short_dtype(c.dtype), rt::backend_name(backend), tp, ""};
  parity::RunOptions ro;
  ro.backend = backend;
  const auto res = parity::run_case(c, ro);
  r.max_err = res.output.max_abs;
  r.bound = res.output.tol.atol + res.output.tol.rtol * std::fabs(res.output.worst_expected);
  r.share = res.output.share_used;
  r.seconds = res.seconds_reference + res.seconds_optimized;
  r.status = res.pass() ? Status::Pass : Status::Fail;
  if (!res.pass()) r.detail = "rerun: twin case '" + res.id + "'";
  return r;
}

// The dense cases: each config in each variant its sizes shard, then (on a GPU) the GPU configs.
void add_dense_jobs(std::vector<Job>& jobs, bool gpu, rt::Backend be) {
  auto dense_job = [&](const DenseConfig& cfg, Variant v, rt::Backend backend) {
    parity::DenseCase c = parity::parse_case_id(cfg.id);
    c.dtype = v.dt;
    c.tp = v.tp;
    c.sp = v.sp;
    const std::string tp = std::to_string(v.tp) + (v.sp ? "+sp" : "");
    const std::string name = cfg.name;
    jobs.push_back({fmt::format("dense {} {} tp{} ({})", cfg.name, short_dtype(v.dt), tp, rt::backend_name(backend)),
                    [=]() { return dense_row(name, c, backend, tp); }});
  };
  for (const auto& cfg : kSimConfigs)
    for (const auto& v : kSimVariants) {
      parity::DenseCase c = parity::parse_case_id(cfg.id);
      if (c.groups % v.tp || c.ffn % v.tp || (v.sp && c.s % v.tp)) continue;
      // on a GPU machine the TP > 1 rows still run on simulated ranks (one device here)
      dense_job(cfg, v, v.tp == 1 ? be : rt::Backend::Sim);
    }
  if (gpu)
    for (const auto& cfg : kGpuConfigs) dense_job(cfg, Variant{DType::BF16, 1, false}, rt::Backend::Cuda);
}

// One golden fixture through one twin in one rank layout: the worst comparison (by share of its
// bound used), the first failing one named; a kind or layout the twin lacks is unsupported.
Row fixture_row(const std::string& path, TwinKind twin, const RunMode& mode, const std::string& ranks) {
  const std::string name = std::filesystem::path(path).filename().string();
  Row r{"fixture " + name, "", twin == TwinKind::Reference ? "cpu" : rt::backend_name(rt::Backend::Sim), ranks, ""};
  const auto t0 = std::chrono::steady_clock::now();
  try {
    const Fixture f = load_fixture(path);
    r.layer = f.kind + " " + f.case_name;
    if (const std::string why = tp_sharding_problem(f, mode); !why.empty()) {
      r.status = Status::Unsupported;
      r.detail = why;
      return r;
    }
    FixtureHandler h = find_fixture_handler(f.kind, twin, mode);
    if (!h) {
      r.status = Status::Unsupported;
      r.detail = std::string(twin_kind_name(twin)) + " twin has no " + f.kind + (mode.ep > 1 ? " at " + ranks : "");
      return r;
    }
    std::string routing;
    const auto cmps = compare_fixture(h, f, twin, mode, nullptr, &routing);
    r.dtype = !f.config_json.is_object() ? "-" : short_dtype(params_dtype(f.config));
    for (const auto& c : cmps) {
      if (c.share_used >= r.share) {
        r.share = c.share_used;
        r.max_err = c.max_abs;
        r.bound = c.tol.atol + c.tol.rtol * std::fabs(c.worst_expected);
      }
      if (!c.pass) {
        r.status = Status::Fail;
        if (r.detail.empty()) r.detail = "first failing: " + c.name + (c.message.empty() ? "" : " (" + c.message + ")");
      }
    }
    if (!routing.empty()) r.detail += (r.detail.empty() ? "routing " : "; routing ") + routing;
  } catch (const FixtureUnsupported& e) {
    r.status = Status::Unsupported;
    r.detail = e.what();
  } catch (const std::exception&) {
    r.status = Status::Error;
    r.detail = describe_exception(std::current_exception());
  }
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

// Every golden in `fdir` through both twins; the MoE goldens again at ep 2 and 4 and at tp 2 with
// SP, the dense ones again at tp 2 with and without SP, the Retro ones at tp 2.
void add_fixture_jobs(std::vector<Job>& jobs, const std::string& fdir) {
  std::vector<std::string> files;
  for (const auto& e : std::filesystem::directory_iterator(fdir))
    if (e.path().extension() == ".safetensors" || e.path().extension() == ".json") files.push_back(e.path().string());
  std::sort(files.begin(), files.end());
  auto fixture_job = [&](const std::string& path, TwinKind twin, RunMode mode) {
    const std::string name = std::filesystem::path(path).filename().string();
    const std::string ranks = mode.ep > 1   ? "ep" + std::to_string(mode.ep)
                              : mode.tp > 1 ? std::to_string(mode.tp) + (mode.sp ? "+sp" : "")
                                            : "1";
    jobs.push_back({fmt::format("fixture {} ({}{})", name, twin_kind_name(twin),
                                mode.ep > 1   ? " " + ranks
                                : mode.tp > 1 ? " tp" + ranks
                                              : ""),
                    [=]() { return fixture_row(path, twin, mode, ranks); }});
  };
  for (const auto& path : files) {
    for (TwinKind twin : {TwinKind::Reference, TwinKind::Optimized}) fixture_job(path, twin, RunMode{});
    // the layer's kind by the file's name (a dense multi-latent attention golden's after its "mla_";
    // the MLA MoE goldens hold the experts' linear taps, which the MoE twin records at ep 1 only)
    std::string name = std::filesystem::path(path).filename().string();
    if (name.rfind("mla_dense_", 0) == 0) name = name.substr(4);
    // The MoE goldens again with their experts split over 2 and 4 simulated expert-parallel ranks
    // (a golden whose expert count they do not divide is listed unsupported).
    if (name.rfind("moe_", 0) == 0)
      for (int ep : {2, 4}) {
        RunMode m;
        m.ep = ep;
        fixture_job(path, TwinKind::Optimized, m);
      }
    // The MoE goldens (multi-latent attention's too) again over 2 simulated tensor-parallel ranks
    // with SP, as Megatron trains MoE at tp > 1 (a golden that 2 does not shard is listed unsupported).
    if (name.rfind("moe_", 0) == 0 || name.rfind("mla_moe_", 0) == 0) {
      RunMode m;
      m.tp = 2;
      m.sp = true;
      fixture_job(path, TwinKind::Optimized, m);
    }
    // The dense goldens again sharded over 2 simulated tensor-parallel ranks, with and without
    // SP: the forward's and the backward's collectives against Megatron's unsharded gradients (a
    // golden that 2 does not shard is listed unsupported).
    if (name.rfind("dense_", 0) == 0)
      for (bool sp : {false, true}) {
        RunMode m;
        m.tp = 2;
        m.sp = sp;
        fixture_job(path, TwinKind::Optimized, m);
      }
    // The Retro goldens again over 2 simulated tensor-parallel ranks (taps and gradients gathered).
    const std::filesystem::path p(path);
    if (p.filename().string().rfind("retro_", 0) == 0 && p.extension() == ".safetensors") {
      RunMode m;
      m.tp = 2;
      fixture_job(path, TwinKind::Optimized, m);
    }
  }
}

// Runs the jobs in order, with progress on stderr; a job that throws is an error row.
std::vector<Row> run_jobs(const std::vector<Job>& jobs, std::ostream& err) {
  std::vector<Row> rows;
  for (std::size_t i = 0; i < jobs.size(); ++i) {
    err << fmt::format("[{}/{}] {} ...", i + 1, jobs.size(), jobs[i].label) << std::flush;
    Row r;
    try {
      r = jobs[i].run();
    } catch (const std::exception&) {
      r.layer = jobs[i].label;
      r.status = Status::Error;
      r.detail = describe_exception(std::current_exception());
    }
    err << " " << status_name(r.status) << fmt::format(" ({:.2f} s)\n", r.seconds);
    rows.push_back(std::move(r));
  }
  return rows;
}

// The table (or JSON) of the rows; returns the exit code: 2 on an error, 1 on a failure, else 0
// (a kind a twin lacks is listed, not a failure).
int report(const std::vector<Row>& rows, bool json, std::ostream& out) {
  int failures = 0, errors = 0;
  for (const auto& r : rows) {
    failures += r.status == Status::Fail;
    errors += r.status == Status::Error;
  }
  const int code = errors ? 2 : failures ? 1 : 0;
  if (json) {
    nlohmann::json js = nlohmann::json::array();
    for (const auto& r : rows)
      js.push_back({{"layer", r.layer},
                    {"dtype", r.dtype},
                    {"backend", r.backend},
                    {"tp", r.tp},
                    {"max_error", r.max_err},
                    {"bound", r.bound},
                    {"share", r.share},
                    {"seconds", r.seconds},
                    {"status", status_name(r.status)},
                    {"detail", r.detail}});
    out << nlohmann::json{{"command", "check"},
                          {"status", code == 0   ? "pass"
                                     : code == 1 ? "fail"
                                                 : "error"},
                          {"rows", js}}
               .dump()
        << "\n";
    return code;
  }
  out << fmt::format("{:<52} {:<5} {:<4} {:<5} {:>11} {:>11} {:>7} {:>8}  {}\n", "layer", "dtype", "back", "TP",
                     "max error", "bound", "share", "time s", "status");
  for (const auto& r : rows)
    out << fmt::format("{:<52} {:<5} {:<4} {:<5} {:>11} {:>11} {:>7} {:>8.2f}  {}{}\n", r.layer.substr(0, 52), r.dtype,
                       r.backend, r.tp, num(r.max_err), num(r.bound), num(r.share), r.seconds, status_name(r.status),
                       r.detail.empty() ? "" : "  " + r.detail);
  out << fmt::format("twin check: {} rows, {} failed, {} errors\n", rows.size(), failures, errors);
  return code;
}

}  // namespace

int run_check(const CheckOptions& opt, std::ostream& out, std::ostream& err) {
  std::string why;
  const bool gpu = rt::available(rt::Backend::Cuda, &why);
  const rt::Backend be = gpu ? rt::Backend::Cuda : rt::Backend::Sim;

  // ---- the plan: dense cases, then every golden fixture through each twin that has its kind
  std::vector<Job> jobs;
  add_dense_jobs(jobs, gpu, be);
  const std::string fdir = fixtures_dir();
  if (!fdir.empty()) {
    add_fixture_jobs(jobs, fdir);
    // Beside them, the goldens not every twin runs in full (multi-latent attention, sinkhorn):
    // the twin that lacks a feature lists its row unsupported.
    const std::filesystem::path partial = std::filesystem::path(fdir).parent_path() / "megatron-core-partial";
    if (std::filesystem::is_directory(partial)) add_fixture_jobs(jobs, partial.string());
  } else
    err << "twin check: fixtures/megatron-core not found (run from the repository root or set TWIN_SOURCE_DIR); "
           "fixture rows skipped\n";

  if (!gpu) err << "twin check: no GPU (" << why << "): the optimized twin runs on the CUDA simulator\n";
  return report(run_jobs(jobs, err), opt.json, out);
}

}  // namespace twin::cli
