// The `twin` command line: inspect files, run fixtures through the twins, run the main check.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <fstream>
#include <iostream>
#include <thread>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "parity/case_cmd.h"
#include "parity/check.h"
#include "parity/diff_cmd.h"
#include "parity/cli_common.h"
#include "parity/fixture_cmd.h"
#include "parity/inspect.h"
#include "optimized/runtime/processes.h"
#include "reference/parallel.h"
#include "reference/retro/decoder_spec.h"

namespace {

int run(int argc, char** argv);

}  // namespace

// Under an MPI launch (mpirun -np N, srun) every process runs the command, each layer of N ranks
// one rank per process (optimized/runtime/processes.h); rank 0 prints, and every process exits
// with the same status (the largest of theirs).
int main(int argc, char** argv) {
  try {
    twin::rt::init_processes(&argc, &argv);
  } catch (const std::exception& e) {
    std::cerr << "error: " << twin::cli::one_line(e.what()) << "\n";
    return 2;
  }
  static std::ofstream discard;  // never opened: what ranks past 0 would print goes nowhere (outlives cout)
  if (twin::rt::process_rank() > 0) {
    std::cout.rdbuf(discard.rdbuf());
    std::cerr.rdbuf(discard.rdbuf());
  }
  const int code = run(argc, argv);
  std::cout.flush();
  return twin::rt::finish_processes(code);
}

namespace {

int run(int argc, char** argv) {
  using namespace twin::cli;
#if defined(__GLIBC__)
  // Buffers of 1 MiB and more straight from the OS and back to it when freed. glibc's default
  // threshold rises to the largest buffer freed, after which a layer's activation buffers come from
  // its heap and their freed holes stay resident: 20% of a 1024-hidden layer's peak memory.
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
#endif
  CLI::App app{
      "twin: a numerical twin of Megatron-Core's TransformerLayer (reference and CUDA twins, golden fixtures)"};
  app.require_subcommand(1);
  app.footer(
      "Exit codes: 0 pass, 1 mismatch (diff: a computed tensor diverges), 2 bad input, 3 unsupported fixture kind.");

  InspectOptions inspect;
  auto* inspect_cmd = app.add_subcommand("inspect",
                                         "Print metadata, parsed config and tensors (dtype, shape, min/max/mean) of "
                                         ".safetensors, .pt and fixture .json files");
  inspect_cmd->add_option("FILE", inspect.files, "Files to inspect")->required();
  inspect_cmd->add_flag("--json", inspect.json, "One JSON object per file per line");

  FixtureOptions fixture;
  auto* fixture_cmd = app.add_subcommand(
      "fixture", "Run Megatron fixture files through a twin and compare every output, tap and aux value");
  fixture_cmd->add_option("FILE", fixture.files, "Fixture files (.safetensors or .json tables)")->required();
  fixture_cmd->add_option("--twin", fixture.twin, "Which twin runs the fixtures")
      ->check(CLI::IsMember({"reference", "optimized", "both"}))
      ->capture_default_str();
  fixture_cmd->add_flag(
      "--json", fixture.json,
      "One JSON object per file and twin per line: file, kind, twin, isolated, fast, status, message, "
      "tensors[]");
  fixture_cmd->add_flag("--isolate", fixture.isolate,
                        "Run each module on the golden's own recorded input to it (the previous tap), so each row "
                        "shows the error that module introduces rather than the error it inherits (default: end "
                        "to end)");

  fixture_cmd
      ->add_option("--tp", fixture.tp,
                   "Shard the optimized twin's layer over N simulated tensor-parallel ranks (taps gathered across "
                   "them); the golden and the reference stay the unsharded layer. Default: the golden's own layout "
                   "(its config's tensor_model_parallel_size and sequence_parallel)")
      ->check(CLI::Range(1, 4096));
  fixture_cmd->add_flag("--sp", fixture.sp, "With --tp: sequence parallelism");
  fixture_cmd
      ->add_option("--ep", fixture.ep,
                   "Run the optimized twin's MoE layer over N simulated expert-parallel ranks (N divides "
                   "num_moe_experts) with the golden's token dispatcher; the golden and the reference stay the ep = 1 "
                   "layer. Default: the golden's own (its config's expert_model_parallel_size)")
      ->check(CLI::Range(1, 4096));
  fixture_cmd->add_flag("--fast", fixture.fast,
                        "The reference in fast mode: Megatron's rounding points with its GEMMs accumulated in fp32 "
                        "by a BLAS (oneDNN or OpenBLAS), as Megatron's own are; the same counted bound, several "
                        "times faster at real sizes (the report says fast mode)");
  fixture_cmd
      ->add_option("--threads", fixture.threads,
                   "Threads of the reference twin (its results are bitwise the same at any count). Default: every "
                   "core")
      ->check(CLI::Range(1, 4096));
  fixture_cmd->add_option("--megatron", fixture.megatron,
                          "Hold the goldens to this Megatron-Core commit's semantics (a known hash or a prefix of 7 "
                          "digits or more) instead of the one each golden records");

  DiffOptions diff;
  auto* diff_cmd = app.add_subcommand(
      "diff",
      "Compare two captures of one layer (golden files of one kind: two runs, TP sizes, commits, GPU and CPU) "
      "tensor by tensor in computation order (forward, then gradients), each within the bound of its rounding "
      "points; name the first that diverges");
  diff_cmd
      ->add_option("A", diff.a,
                   "The first capture (.safetensors); the reference twin runs on it for the order "
                   "and the rounding counts")
      ->required();
  diff_cmd->add_option("B", diff.b, "The second capture (.safetensors), of the same kind")->required();
  diff_cmd->add_flag("--json", diff.json,
                     "One JSON object: a, b, kind, status, message, first_divergence, differing_given, grads, "
                     "routing, exact, tensors[]");
  diff_cmd->add_flag("--exact", diff.exact,
                     "Bit for bit, every tensor (two runs that should be deterministic): name the first differing "
                     "tensor and element");

  CheckOptions check;
  auto* check_cmd =
      app.add_subcommand("check", "The main job: check the twins against their references (ci/check runs it)");
  check_cmd->add_flag("--json", check.json, "One JSON object on stdout");

  CaseOptions case_opt;
  auto* case_cmd =
      app.add_subcommand("case", "Rerun one dense-layer parity case from its id (printed by a failing property test)");
  case_cmd->add_option("ID", case_opt.id, "The case id, dense(h=...,seed=...)")->required();
  case_cmd->add_option("--backend", case_opt.backend, "Where the optimized twin runs")
      ->check(CLI::IsMember({"sim", "cuda"}))
      ->capture_default_str();
  case_cmd->add_flag("--graph", case_opt.graph, "Replay the optimized layer from a captured CUDA graph");

  int layout_num_layers = 0;
  bool layout_json = false;
  auto* layout_cmd = app.add_subcommand(
      "layout", "Print a Retro decoder block's layout: one line per layer (gpt, retro, retro_with_encoder)");
  layout_cmd->add_option("--num-layers", layout_num_layers, "Layers in the decoder block (at least 6)")->required();
  layout_cmd->add_flag("--json", layout_json, "One JSON object: num_layers, layers[]");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    std::cerr << "error: " << one_line(e.what()) << " (see twin --help)\n";
    return 2;
  }
  // Every command's reference runs on every core (its results are bitwise the same at any count);
  // `twin fixture --threads N` chooses.
  twin::reference::set_threads(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  try {
    if (*inspect_cmd) return run_inspect(inspect, std::cout, std::cerr);
    if (*fixture_cmd) return run_fixture(fixture, std::cout, std::cerr);
    if (*diff_cmd) return run_diff(diff, std::cout, std::cerr);
    if (*check_cmd) return run_check(check, std::cout, std::cerr);
    if (*case_cmd) return run_case_command(case_opt, std::cout, std::cerr);
    if (*layout_cmd) {
      namespace retro = twin::reference::retro;
      try {
        std::cout << retro::format_retro_layout(retro::get_retro_decoder_block_layout(layout_num_layers), layout_json);
        return 0;
      } catch (const twin::ConfigError& e) {
        std::cerr << "error: " << one_line(e.what()) << "\n";
        return 2;
      }
    }
  } catch (const std::exception& e) {
    std::cerr << "error: internal error: " << one_line(e.what()) << "\n";
    return 2;
  }
  return 2;
}

}  // namespace
