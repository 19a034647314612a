// The communicator for the Python layer (pcie_allreduce.PcieAllReduce holds one): its options,
// the one call path's queries and its try_run (a call that returns the decline instead of running
// the fallback, for the engine adapters), stats() in the layout Python shows, the handle registry
// the torch ops use, and the transports' names and the host transport's reduce kernels.
#include "comm/communicator.h"

#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <map>
#include <optional>
#include <string>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <tuple>
#include <variant>
#include <vector>

#include "bindings/bindings.h"
#include "comm/registry.h"
#include "plan/layout.h"
#include "transport/host_reduce_isa.h"
#include "transport/host_shm.h"
#include "transport/kind.h"

namespace pcie_ar::bindings {
namespace {

using Counts = std::map<std::string, int64_t>;

py::object optional_reason(comm::Decline d) {
  if (d == comm::Decline::kNone) return py::none();
  return py::str(std::string(comm::decline_name(d)));
}

comm::Op op_from_name(const std::string& name) { return parse_or_throw(comm::kOpNames, name); }

// stats() as Python has always shown it: the all-reduce's calls and declines at the top, the
// fused call's as fused_calls / fused_declines, and collectives[name] = {calls, declines} for
// each other op (the collectives, the other fused forms) that ran at all.
py::dict stats_dict(const comm::Stats& s) {
  py::dict out;
  out["calls"] = s.of(comm::kAllReduce).calls;
  out["declines"] = s.of(comm::kAllReduce).declines;
  out["bytes_sent_per_peer"] = s.bytes_sent_per_peer;
  out["staged"] = s.staged;
  out["fused_calls"] = s.of(comm::kAllReduceAddRmsNorm).calls;
  out["fused_declines"] = s.of(comm::kAllReduceAddRmsNorm).declines;
  py::dict collectives;
  for (const comm::Op op : comm::kOpNames.values()) {
    if (op == comm::kAllReduce || op == comm::kAllReduceAddRmsNorm) continue;  // shown above
    const comm::OpStats& o = s.of(op);
    if (o.calls.empty()) continue;  // every decline is a call too
    py::dict entry;
    entry["calls"] = o.calls;
    entry["declines"] = o.declines;
    collectives[py::str(std::string(comm::op_name(op)))] = entry;
  }
  out["collectives"] = collectives;
  return out;
}

// The inverse of stats_dict(); keys it lacks count as zero. Other keys (what PcieAllReduce.stats()
// adds) are ignored.
comm::Stats stats_from_dict(const py::dict& d) {
  comm::Stats s;
  const auto counts = [&d](const char* key) {
    return d.contains(key) ? py::cast<Counts>(d[key]) : Counts{};
  };
  s.of(comm::kAllReduce) = {counts("calls"), counts("declines")};
  s.of(comm::kAllReduceAddRmsNorm) = {counts("fused_calls"), counts("fused_declines")};
  if (d.contains("collectives")) {
    for (const auto& [name, entry] : py::cast<py::dict>(d["collectives"])) {
      const auto e = py::cast<py::dict>(entry);
      comm::OpStats& o = s.of(op_from_name(py::cast<std::string>(name)));
      if (e.contains("calls")) o.calls = py::cast<Counts>(e["calls"]);
      if (e.contains("declines")) o.declines = py::cast<Counts>(e["declines"]);
    }
  }
  if (d.contains("bytes_sent_per_peer")) {
    s.bytes_sent_per_peer = py::cast<std::vector<int64_t>>(d["bytes_sent_per_peer"]);
  }
  if (d.contains("staged")) s.staged = py::cast<int64_t>(d["staged"]);
  return s;
}

// try_run's result: the decline reason, or what the op wrote (out; the fused call's (out,
// residual_out)).
using TryResult = std::variant<std::string, at::Tensor, std::tuple<at::Tensor, at::Tensor>,
                               std::tuple<at::Tensor, at::Tensor, at::Tensor>>;

// The tensors Python passed for `op` (None: not passed; an output None is the call's to allocate,
// into `out` and `residual_out`).
// The fused forms' operands beside x and the outputs.
struct FusedOperands {
  std::optional<at::Tensor> residual, weight, scale;
  double eps = 0.0;
  double weight_offset = 0.0;
};

comm::OpArgs op_args(comm::Op op, const at::Tensor& inp, at::Tensor& out, const FusedOperands& f,
                     at::Tensor& residual_out, at::Tensor& block_scale) {
  comm::OpArgs args{inp, out};
  if (comm::has_epilogue(op)) {  // run() and check() raise for a missing or extra operand
    args.residual = f.residual ? &*f.residual : nullptr;
    args.weight = f.weight ? &*f.weight : nullptr;
    args.scale = f.scale ? &*f.scale : nullptr;
    args.residual_out = &residual_out;
    args.block_scale = &block_scale;
    args.eps = f.eps;
    args.weight_offset = f.weight_offset;
  }
  return args;
}

TryResult try_run(comm::Communicator& c, const std::string& name, const at::Tensor& inp,
                  std::optional<at::Tensor> out, std::optional<at::Tensor> residual,
                  std::optional<at::Tensor> weight, double eps,
                  std::optional<at::Tensor> residual_out, std::optional<at::Tensor> scale,
                  double weight_offset, std::optional<at::Tensor> block_scale) {
  const comm::Op op = op_from_name(name);
  at::Tensor result = out.value_or(at::Tensor());
  at::Tensor result_residual = residual_out.value_or(at::Tensor());
  at::Tensor result_scale = block_scale.value_or(at::Tensor());
  const comm::OpArgs args = op_args(op, inp, result, {residual, weight, scale, eps, weight_offset},
                                    result_residual, result_scale);
  const comm::Decline d = c.run(op, args, comm::OnDecline::kReturn);
  if (d != comm::Decline::kNone) return std::string(comm::decline_name(d));
  if (comm::is_nvfp4(op)) return std::make_tuple(result, result_residual, result_scale);
  if (comm::has_epilogue(op)) return std::make_tuple(result, result_residual);
  return result;
}

void bind_options(py::module_& m) {
  py::class_<comm::Options>(m, "Options")
      .def(py::init<>())
      .def_readwrite("rank", &comm::Options::rank)
      .def_readwrite("world", &comm::Options::world)
      .def_readwrite("max_numel", &comm::Options::max_numel)
      .def_property(
          "dtypes",
          [](const comm::Options& o) {
            std::vector<std::string> names;
            for (auto d : o.dtypes) names.emplace_back(plan::dtype_name(d));
            return names;
          },
          [](comm::Options& o, const std::vector<std::string>& names) {
            o.dtypes.clear();
            for (const auto& n : names) o.dtypes.push_back(parse_or_throw(plan::kDTypeNames, n));
          })
      // A name (canonical or alias) in, the canonical name out (transport/kind.h).
      .def_property(
          "transport",
          [](const comm::Options& o) {
            return std::string(transport::kKindNames.name_of(o.transport));
          },
          [](comm::Options& o, const std::string& name) {
            o.transport = transport::kKindNames.parse(name);
          })
      .def_readwrite("device", &comm::Options::device)
      .def_readwrite("timeout_s", &comm::Options::timeout_s)
      .def_readwrite("initial_gen", &comm::Options::initial_gen)
      .def_readwrite("max_blocks", &comm::Options::max_blocks)
      .def_readwrite("topology_key", &comm::Options::topology_key)
      .def_readwrite("island_of", &comm::Options::island_of)
      .def_readwrite("table_text", &comm::Options::table_text)
      .def_readwrite("table_source", &comm::Options::table_source)
      .def_readwrite("group_name", &comm::Options::group_name)
      .def_property(
          "disabled",
          [](const comm::Options& o) { return std::string(comm::decline_name(o.disabled)); },
          [](comm::Options& o, const std::string& name) { o.disabled = comm::parse_decline(name); })
      .def_readwrite("disabled_detail", &comm::Options::disabled_detail)
      .def_readwrite("log_level", &comm::Options::log_level)
      .def_readwrite("pdl", &comm::Options::pdl)
      .def_readwrite("stream_max_numel", &comm::Options::stream_max_numel);
}

void bind_transports(py::module_& m) {
  m.def(
      "transport_names",
      [] {
        py::dict out;
        for (const auto& entry : transport::kKindNames.entries) {
          std::vector<std::string> aliases;
          for (const auto alias : transport::kKindNames.aliases_of(entry.value)) {
            aliases.emplace_back(alias);
          }
          out[py::str(std::string(entry.name))] = aliases;
        }
        return out;
      },
      "Every transport's canonical name and the aliases Options.transport also accepts.");
  // The CPU reduce kernels (transport/host_reduce_isa.h): process-wide, results identical.
  m.def("host_reduce_isa", &transport::host_reduce_isa,
        "The reduce kernels CPU all-reduces use now: scalar, avx2 or avx512.");
  m.def("host_reduce_isas", &transport::host_reduce_isas,
        "The reduce kernels this CPU and build run, narrowest first.");
  m.def(
      "set_host_reduce_isa", [](const std::string& name) { transport::set_host_reduce_isa(name); },
      py::arg("name"),
      "Chooses the reduce kernels of later CPU all-reduces in this process (ValueError when "
      "this CPU does not run them).");
  // c10d's Work.abort(), which torch does not bind: ends a gloo send or receive that a thread
  // is blocked in (its wait() returns False). The bootstrap's exit hook uses it so that no
  // thread of ours is still inside gloo when the interpreter finalizes.
  m.def(
      "abort_work", [](c10d::Work* work) { work->abort(); }, py::arg("work"),
      py::call_guard<py::gil_scoped_release>());
}

}  // namespace

void bind_communicator(py::module_& m) {
  bind_options(m);
  bind_transports(m);
  m.def(
      "operations", [] { return names_of(comm::kOpNames); },
      "Every operation the communicator runs, by the name its methods take.");

  using comm::Communicator;
  py::class_<Communicator, std::shared_ptr<Communicator>>(m, "Communicator")
      .def(py::init([](const comm::Options& options) {
        auto c = std::make_shared<Communicator>(options);
        c->set_interrupt_check(&python_signal_raised);  // Ctrl-C ends a host-transport wait
        return c;
      }))
      .def("local_token", [](const Communicator& c) { return py::bytes(c.local_token()); })
      .def("connect", &Communicator::connect)
      .def("retire_token", &Communicator::retire_token)
      .def("supports", [](const Communicator& c,
                          const at::Tensor& t) { return optional_reason(c.supports(t)); })
      .def(
          "decline_reason",
          [](Communicator& c, const std::string& op, const at::Tensor& inp,
             std::optional<at::Tensor> weight) {
            return optional_reason(
                c.decline_reason(op_from_name(op), inp, weight ? &*weight : nullptr));
          },
          py::arg("op"), py::arg("inp"), py::arg("weight") = py::none(),
          "None when the kernels would run `op` (operations()) with input `inp` (and the fused "
          "call's `weight`); else the reason.")
      .def(
          "chosen_tactic",
          [](Communicator& c, const std::string& op, const at::Tensor& inp,
             std::optional<at::Tensor> weight) {
            return c.chosen_tactic(op_from_name(op), inp, weight ? &*weight : nullptr);
          },
          py::arg("op"), py::arg("inp"), py::arg("weight") = py::none(),
          "The tactic label that would run it, or the op's fallback label (fallback, unfused).")
      .def("try_run", &try_run, py::arg("op"), py::arg("inp"), py::arg("out") = py::none(),
           py::arg("residual") = py::none(), py::arg("weight") = py::none(), py::arg("eps") = 0.0,
           py::arg("residual_out") = py::none(), py::arg("scale") = py::none(),
           py::arg("weight_offset") = 0.0, py::arg("block_scale") = py::none(),
           py::call_guard<py::gil_scoped_release>(),
           "Runs `op` on the kernels when they take it and returns what it wrote (out, or the "
           "fused call's (out, residual_out); allocated when not given); otherwise returns the "
           "decline reason, touching nothing and counting nothing (the caller runs its own "
           "path). Bad arguments raise as the torch ops do.")
      .def(
          "check",
          [](const Communicator& c, const std::string& name, const at::Tensor& inp,
             std::optional<at::Tensor> out, std::optional<at::Tensor> residual,
             std::optional<at::Tensor> weight, std::optional<at::Tensor> residual_out,
             std::optional<at::Tensor> scale, double weight_offset,
             std::optional<at::Tensor> block_scale) {
            const comm::Op op = op_from_name(name);
            at::Tensor given = out.value_or(at::Tensor());
            at::Tensor given_residual = residual_out.value_or(at::Tensor());
            at::Tensor given_scale = block_scale.value_or(at::Tensor());
            c.check(op, op_args(op, inp, given, {residual, weight, scale, 0.0, weight_offset},
                                given_residual, given_scale));
          },
          py::arg("op"), py::arg("inp"), py::arg("out") = py::none(),
          py::arg("residual") = py::none(), py::arg("weight") = py::none(),
          py::arg("residual_out") = py::none(), py::arg("scale") = py::none(),
          py::arg("weight_offset") = 0.0, py::arg("block_scale") = py::none(),
          "Raises what a call of `op` with these tensors raises before any rank talks "
          "(ValueError; RuntimeError for autograd's rules), and does nothing else. An output "
          "left None is one the call allocates.")
      .def("probe_write", &Communicator::probe_write)
      .def("probe_read", &Communicator::probe_read)
      .def("disable",
           [](Communicator& c, const std::string& reason, const std::string& detail) {
             c.disable(comm::parse_decline(reason), detail);
           })
      .def("close_peers", &Communicator::close_peers)
      .def("release", &Communicator::release)
      .def("forked", &Communicator::forked)
      .def("enabled", &Communicator::enabled)
      .def("disabled_reason",
           [](const Communicator& c) { return optional_reason(c.options().disabled); })
      .def("disabled_detail", [](const Communicator& c) { return c.options().disabled_detail; })
      .def("table_hash", &Communicator::table_hash)
      .def("table_source", &Communicator::table_source)
      .def("prepare", &Communicator::prepare)
      .def(
          "self_test",
          [](Communicator& c, bool again) {
            py::list out;
            for (const comm::SelfTestResult& r : c.self_test(again)) {
              py::dict d;
              d["op"] = std::string(comm::op_name(r.use.op));
              d["dtype"] = std::string(plan::dtype_name(r.use.dtype));
              d["tactic"] = plan::tactic_label(r.use.tactic);
              d["bytes"] = r.use.bytes.empty() ? py::object(py::none())
                                               : py::object(py::int_(r.use.bytes.front()));
              d["ran"] = r.ran;
              d["ok"] = r.ok;
              d["detail"] = r.detail;
              out.append(d);
            }
            return out;
          },
          py::arg("again") = false,
          "This rank's half of the self-test (comm/self_test.h), collective: one dict per "
          "(op, dtype, tactic) run: op, dtype, tactic, bytes, ran, ok, detail.")
      .def(
          "withdraw",
          [](Communicator& c, const std::string& op, const std::string& dtype,
             const std::string& tactic) {
            c.withdraw(op_from_name(op), parse_or_throw(plan::kDTypeNames, dtype), tactic);
          },
          py::arg("op"), py::arg("dtype"), py::arg("tactic"),
          "Sends op's dtype calls that `tactic` would run to the fallback (self_test).")
      .def(
          "set_host_mutant_for_testing",
          [](Communicator& c, const std::string& mutant) {
            auto* host = dynamic_cast<transport::HostShmWorkspace*>(c.workspace_for_testing());
            if (host == nullptr) {
              throw std::invalid_argument("the host executor's mutants need the host transport");
            }
            host->set_mutant_for_testing(
                parse_or_throw(transport::HostExecutor::kMutantNames, mutant));
          },
          py::arg("mutant"),
          "FOR TESTS ONLY: this rank's host executor runs every program mutated (none, "
          "drop_operand, reverse_operands).")
      .def("set_table", &Communicator::set_table, py::arg("text"), py::arg("source"))
      .def("layout_hash", &Communicator::layout_hash)
      .def("workspace_bytes", &Communicator::workspace_bytes)
      .def("raise_if_failed", &Communicator::raise_if_failed)
      .def("failure",
           [](const Communicator& c) -> py::object {
             auto d = c.failure();
             if (!d) return py::none();
             return diagnostic_dict(*d, plan::describe_failure(*d, c.options().timeout_s));
           })
      .def(
          "restore_stats",
          [](Communicator& c, const py::dict& earlier) {
            c.restore_stats(stats_from_dict(earlier));
          },
          py::arg("stats"),
          "Puts every counter of every op back to `stats`, a dict stats() returned.")
      .def("stats", [](const Communicator& c) { return stats_dict(c.stats()); });

  m.def("register_communicator", &comm::register_communicator);
  m.def("lookup_communicator", &comm::lookup_communicator, py::arg("handle"),
        "The communicator a torch op's handle names (ValueError once it is destroyed).");
  m.def("unregister_communicator", &comm::unregister_communicator);
}

}  // namespace pcie_ar::bindings
