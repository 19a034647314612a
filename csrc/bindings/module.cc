// pcie_allreduce._C: the pybind11 module (torch's bundled pybind11, so the ABI matches torch's
// own bindings). It exposes the Communicator to the Python layer and the plan layer (schedules,
// verifier, topology, tuning table) to the CLI and the tests.
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <exception>
#include <iterator>
#include <optional>
#include <string>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <type_traits>

#include "comm/communicator.h"
#include "plan/cost_model.h"
#include "plan/layout.h"
#include "plan/protocol.h"
#include "plan/schedule.h"
#include "plan/topology.h"
#include "plan/tuning_table.h"
#include "plan/verify.h"
#include "transport/host_reduce_isa.h"
#include "transport/kind.h"

namespace py = pybind11;

namespace pcie_ar::bindings {
namespace {

// The value `name` names in `table`, or std::invalid_argument "<what> must be a, b or c, got 'x'".
template <typename Table>
auto parse_or_throw(const Table& table, const std::string& name) {
  if (auto value = table.find(name)) return *value;
  throw std::invalid_argument(table.must_be(name));
}

plan::DType dtype_from_name(const std::string& name) {
  return parse_or_throw(plan::kDTypeNames, name);
}

py::dict diagnostic_dict(const plan::Diagnostic& d, const std::string& message) {
  py::dict out;
  const char* kinds[] = {"none", "timeout", "mismatch", "ll_timeout", "ll_mismatch", "interrupted"};
  out["kind"] = d.kind < std::size(kinds) ? kinds[d.kind] : "unknown";
  out["rank"] = d.rank;
  out["peer"] = d.peer;
  out["step"] = d.step;
  out["stage"] = d.stage;
  out["block"] = d.block;
  out["flag"] = d.flag;
  out["flag_owner"] = d.flag_owner;
  out["generation_seen"] = d.gen_seen;
  out["generation_expected"] = d.gen_expected;
  out["numel"] = d.numel;
  out["peer_numel"] = d.peer_numel;
  out["signature"] = d.signature;
  out["peer_signature"] = d.peer_signature;
  out["message"] = message;
  return out;
}

// The exception a signal handler raised inside a wait (KeyboardInterrupt for Ctrl-C), kept
// from the moment the wait asked until the call's C++ unwinding reaches the translator below.
// Raw references (a thread_local py::object would need the GIL at thread exit).
struct PendingSignal {
  PyObject* type = nullptr;
  PyObject* value = nullptr;
  PyObject* traceback = nullptr;
};
thread_local PendingSignal pending_signal;

// The host transport's interrupt check (comm::Communicator::set_interrupt_check): runs the
// interpreter's signal handlers, as time.sleep() does between its slices. Python runs them on
// its main thread only, so elsewhere this costs a GIL round and answers false. A handler that
// raises abandons the call and its exception is what the caller sees.
bool python_signal_raised() {
  if (!Py_IsInitialized() || Py_IsFinalizing()) return false;
  const py::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() == 0) return false;
  PendingSignal& p = pending_signal;
  Py_CLEAR(p.type);
  Py_CLEAR(p.value);
  Py_CLEAR(p.traceback);
  PyErr_Fetch(&p.type, &p.value, &p.traceback);
  return true;
}

// comm::Failure -> pcie_allreduce.PcieAllReduceTimeout(message, diagnostic), wherever it is
// thrown: from a method of this module or from inside a torch op. comm::Interrupted -> the
// exception the signal handler raised (KeyboardInterrupt), or KeyboardInterrupt(message).
void translate_failure(std::exception_ptr thrown) {
  try {
    if (thrown) std::rethrow_exception(thrown);
  } catch (const comm::Interrupted& e) {
    PendingSignal& p = pending_signal;
    if (p.type != nullptr) {
      PyErr_Restore(p.type, p.value, p.traceback);  // steals the references
      p = PendingSignal{};
    } else {
      PyErr_SetString(PyExc_KeyboardInterrupt, e.what());
    }
  } catch (const comm::Failure& e) {
    const py::object type =
        py::module_::import("pcie_allreduce.errors").attr("PcieAllReduceTimeout");
    const py::object error = type(e.what(), diagnostic_dict(e.diagnostic(), e.what()));
    PyErr_SetObject(type.ptr(), error.ptr());
  }
}

py::object optional_reason(comm::Decline d) {
  if (d == comm::Decline::kNone) return py::none();
  return py::str(std::string(comm::decline_name(d)));
}

py::dict step_dict(const plan::Step& s) {
  py::dict out;
  const char* kinds[] = {"reduce", "signal", "wait", "epilogue"};
  out["kind"] = kinds[static_cast<int>(s.kind)];
  out["stage"] = s.stage;
  out["text"] = plan::describe_step(s);
  if (s.kind == plan::StepKind::kReduce) {
    auto buf = [](const plan::BufRef& b) {
      py::dict d;
      const char* spaces[] = {"input", "output", "slot", "ll"};
      d["space"] = spaces[static_cast<int>(b.space)];
      d["owner"] = b.owner;
      if (b.space == plan::Space::kSlot || b.space == plan::Space::kLL) d["slot"] = b.slot;
      if (b.space == plan::Space::kLL) d["writer"] = b.writer;
      return d;
    };
    out["chunk"] = s.chunk;
    out["dst"] = buf(s.dst);
    if (s.num_dsts == 2) out["dst2"] = buf(s.dst2);
    py::list srcs;
    for (int i = 0; i < s.num_srcs; ++i) srcs.append(buf(s.srcs[i]));
    out["srcs"] = srcs;
  } else {
    out["peer"] = s.peer;
    out["flag_owner"] = s.flag_owner;
    out["flag"] = s.flag;
  }
  return out;
}

py::dict cost_dict(const plan::Cost& c) {
  py::dict out;
  out["system_fences"] = c.system_fences;
  out["peer_polls"] = c.peer_polls;
  out["local_waits"] = c.local_waits;
  out["data_polls"] = c.data_polls;
  out["fabric_hops"] = c.fabric_hops;
  out["cross_island"] = c.cross_island;
  return out;
}

// The cost model's constants and its executor assumptions by name: what Python passes as
// `constants=` / `executor=` and gets back from latency_model() / executor_model(). One list per
// struct, so a field added to the model is settable and shown at once.
template <typename F>
void for_each_field(plan::LatencyModel& l, F&& f) {
  f("launch_us", l.launch_us);
  f("local_load_us", l.local_load_us);
  f("posted_write_us", l.posted_write_us);
  f("posted_write_cross_us", l.posted_write_cross_us);
  f("peer_read_us", l.peer_read_us);
  f("peer_read_cross_us", l.peer_read_cross_us);
  f("host_read_us", l.host_read_us);
  f("host_write_us", l.host_write_us);
  f("fence_after_peer_writes_us", l.fence_after_peer_writes_us);
  f("fence_after_local_writes_us", l.fence_after_local_writes_us);
  f("gpu_link_gbps", l.gpu_link_gbps);
  f("gpu_link_fanout_gbps", l.gpu_link_fanout_gbps);
  f("socket_link_gbps", l.socket_link_gbps);
}

template <typename F>
void for_each_field(plan::ExecutorModel& e, F&& f) {
  f("first_look_group", e.first_look_group);
  f("dense_first_look_group", e.dense_first_look_group);
  f("parallel_first_look", e.parallel_first_look);
  f("parallel_relooks", e.parallel_relooks);
  f("multi_destination_copies", e.multi_destination_copies);
}

template <typename Model>
py::dict fields_dict(Model m) {
  py::dict out;
  for_each_field(m, [&](const char* name, const auto& value) { out[name] = value; });
  return out;
}

// `m` with the fields `overrides` names set; std::invalid_argument for a name it lacks.
template <typename Model>
Model with_overrides(Model m, const py::dict& overrides, const std::string& what) {
  std::string known;
  for_each_field(m, [&](const char* name, const auto&) {
    known += (known.empty() ? "" : ", ") + std::string(name);
  });
  for (const auto& [key, value] : overrides) {
    const auto name = py::cast<std::string>(key);
    bool found = false;
    for_each_field(m, [&](const char* n, auto& field) {
      if (name == n) {
        field = py::cast<std::decay_t<decltype(field)>>(value);
        found = true;
      }
    });
    if (!found) throw std::invalid_argument("unknown " + what + " '" + name + "'; known: " + known);
  }
  return m;
}

// The step-list counts, and with nbytes the modelled time of one call on a GPU transport.
py::dict schedule_cost(const plan::Schedule& s, std::optional<int64_t> nbytes,
                       const std::string& transport, const py::dict& constants,
                       const py::dict& executor) {
  const plan::Verification v = plan::verify(s);
  py::dict out = cost_dict(v.cost);
  if (!nbytes) return out;
  if (!v.ok) throw std::invalid_argument("the schedule does not verify: " + v.errors.front());
  const transport::Kind kind = parse_or_throw(transport::kKindNames, transport);
  if (kind == transport::Kind::kHostShm) {
    throw std::invalid_argument(
        "the cost model is for the GPU transports (cuda_ipc, cuda_host); host_shm is measured");
  }
  const plan::CostReport r =
      plan::model_cost(s, *nbytes,
                       kind == transport::Kind::kCudaHost ? plan::Placement::kHostMemory
                                                          : plan::Placement::kDeviceMemory,
                       with_overrides(plan::LatencyModel{}, constants, "cost-model constant"),
                       with_overrides(plan::current_executor(), executor, "executor-model field"));
  out["modelled_us"] = r.modelled_us;
  out["latency_us"] = r.latency_us;
  out["bandwidth_us"] = r.bandwidth_us;
  out["serial_round_trips"] = r.serial_round_trips;
  out["busiest_link_bytes"] = r.busiest_link_bytes;
  out["busiest_link"] = r.busiest_link;
  out["critical_path"] = r.critical_path;
  return out;
}

plan::Protocol protocol_from_name(const std::string& name) {
  return parse_or_throw(plan::kProtocolNames, name);
}

plan::Collective parse_collective_name(const std::string& name) {
  return parse_or_throw(plan::kCollectiveNames, name);
}

py::dict verification_dict(const plan::Verification& v) {
  py::dict out;
  out["ok"] = v.ok;
  out["errors"] = v.errors;
  out["num_stages"] = v.num_stages;
  out["max_steps"] = v.max_steps;
  out["max_outbound_per_stage"] = v.max_outbound_per_stage;
  out["max_inbound_per_stage"] = v.max_inbound_per_stage;
  out["cross_island_elements"] = v.cross_island_elements();
  out["cross_island_by_direction"] = std::vector<double>{v.cross_island[0], v.cross_island[1]};
  out["sent_to"] = v.sent_to;
  out["cost"] = cost_dict(v.cost);
  return out;
}

// Schedules: build, verify, cost, inspect.
void bind_schedules(py::module_& m) {
  py::class_<plan::Schedule>(m, "Schedule")
      .def_property_readonly(
          "algorithm",
          [](const plan::Schedule& s) { return std::string(plan::algorithm_name(s.algorithm)); })
      .def_property_readonly(
          "direction",
          [](const plan::Schedule& s) { return std::string(plan::direction_name(s.direction)); })
      .def_readonly("staged", &plan::Schedule::staged)
      .def_property_readonly(
          "protocol",
          [](const plan::Schedule& s) { return std::string(plan::protocol_name(s.protocol)); })
      .def("cost", &schedule_cost, py::arg("nbytes") = py::none(),
           py::arg("transport") = "cuda_ipc", py::arg("constants") = py::dict(),
           py::arg("executor") = py::dict(),
           "What the worst rank pays per call and CTA, counted from the step lists; with "
           "nbytes, also the cost model's time of one call of that many bytes on a GPU "
           "transport (plan/cost_model.h): modelled_us, serial_round_trips, "
           "busiest_link_bytes, the critical path. `constants` and `executor` override the "
           "model's constants (latency_model()) and what it assumes of the executor.")
      .def_readonly("world", &plan::Schedule::world)
      .def_readonly("num_chunks", &plan::Schedule::num_chunks)
      .def_readonly("num_stages", &plan::Schedule::num_stages)
      .def_readonly("island_of", &plan::Schedule::island_of)
      .def(
          "verify",
          [](const plan::Schedule& s, bool in_place) {
            return verification_dict(plan::verify(s, plan::VerifyOptions{in_place}));
          },
          py::arg("in_place") = false)
      .def("to_dict", [](const plan::Schedule& s) {
        py::dict out;
        out["algorithm"] = std::string(plan::algorithm_name(s.algorithm));
        out["direction"] = std::string(plan::direction_name(s.direction));
        out["staged"] = s.staged;
        out["protocol"] = std::string(plan::protocol_name(s.protocol));
        out["world"] = s.world;
        out["num_chunks"] = s.num_chunks;
        out["num_stages"] = s.num_stages;
        out["collective"] = std::string(plan::collective_name(s.collective));
        out["island_of"] = s.island_of;
        py::list programs;
        for (const auto& program : s.programs) {
          py::list steps;
          for (const auto& step : program) steps.append(step_dict(step));
          programs.append(steps);
        }
        out["programs"] = programs;
        return out;
      });

  m.def(
      "build_schedule",
      [](const std::string& algorithm, int world, const std::vector<int>& island_of,
         const std::string& direction, bool staged, const std::string& protocol,
         const std::string& collective) {
        const plan::Algorithm a = parse_or_throw(plan::kAlgorithmNames, algorithm);
        const plan::Direction d = parse_or_throw(plan::kDirectionNames, direction);
        return plan::build_schedule(a, d, staged, world, island_of, protocol_from_name(protocol),
                                    parse_collective_name(collective));
      },
      py::arg("algorithm"), py::arg("world"), py::arg("island_of"), py::arg("direction"),
      py::arg("staged"), py::arg("protocol") = "flag", py::arg("collective") = "all_reduce");
  m.def("with_epilogue", &plan::with_epilogue, py::arg("schedule"),
        "The fused schedule (plan::with_epilogue): every program plus the all-reduce + residual "
        "add + RMSNorm epilogue.");
  m.def(
      "why_unsupported",
      [](const std::string& algorithm, int world, const std::vector<int>& island_of,
         const std::string& direction, bool staged, const std::string& protocol,
         const std::string& collective) -> std::optional<std::string> {
        plan::Tactic t;
        const auto c = plan::parse_collective(collective);
        if (!c) return "unknown collective '" + collective + "'";
        const auto a = plan::parse_algorithm(algorithm);
        if (!a) return "unknown algorithm '" + algorithm + "'";
        const auto d = plan::parse_direction(direction);
        if (!d) return "unknown direction '" + direction + "'";
        t.algorithm = *a;
        t.direction = *d;
        t.staged = staged;
        t.protocol = protocol_from_name(protocol);
        return plan::why_unsupported(t, world, island_of, *c);
      },
      py::arg("algorithm"), py::arg("world"), py::arg("island_of"), py::arg("direction") = "push",
      py::arg("staged") = false, py::arg("protocol") = "flag",
      py::arg("collective") = "all_reduce");
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
  m.def(
      "buildable_tactics",
      [](int world, const std::vector<int>& island_of, const std::string& collective) {
        py::list out;
        for (const plan::Tactic& t :
             plan::buildable_tactics(world, island_of, parse_collective_name(collective))) {
          py::dict d;
          d["algorithm"] = std::string(plan::algorithm_name(t.algorithm));
          d["direction"] = std::string(plan::direction_name(t.direction));
          d["staged"] = t.staged;
          d["protocol"] = std::string(plan::protocol_name(t.protocol));
          out.append(d);
        }
        return out;
      },
      py::arg("world"), py::arg("island_of"), py::arg("collective") = "all_reduce",
      "Every (algorithm, direction, staged, protocol) the builders accept for this world, "
      "island map and collective, in the plan layer's fixed order.");
  m.def(
      "latency_model", [] { return fields_dict(plan::LatencyModel{}); },
      "The cost model's default constants (µs, GB/s), by name.");
  m.def(
      "executor_model", [] { return fields_dict(plan::current_executor()); },
      "What the cost model assumes of today's CUDA executor.");
  m.def("algorithms", [] {
    std::vector<std::string> names;
    for (const auto name : plan::kAlgorithmNames.names()) names.emplace_back(name);
    return names;
  });
  m.def("protocols", [] {
    std::vector<std::string> names;
    for (const auto name : plan::kProtocolNames.names()) names.emplace_back(name);
    return names;
  });
}

// The workspace layout, topologies and tuning tables, for the CLI and the tests.
void bind_layout_topology_tables(py::module_& m) {
  m.def(
      "layout",
      [](int64_t max_numel, int world, int elem_bytes, int max_blocks) {
        const plan::Layout l = plan::make_layout(max_numel, world, elem_bytes, max_blocks);
        py::dict out;
        out["total_bytes"] = l.total_bytes;
        out["control_bytes"] = l.control_bytes;
        out["data_offset"] = l.data_offset;
        out["slot_bytes"] = l.slot_bytes;
        out["ll_capacity_bytes"] = l.ll_capacity_bytes;
        out["num_slots"] = l.num_slots;
        out["num_flags"] = l.num_flags;
        out["max_blocks"] = l.max_blocks;
        out["hash"] = plan::layout_hash(l);
        return out;
      },
      py::arg("max_numel"), py::arg("world"), py::arg("elem_bytes"),
      py::arg("max_blocks") = plan::kDefaultMaxBlocks);

  py::class_<plan::Topology>(m, "Topology")
      .def_static("from_nvidia_smi", &plan::Topology::from_nvidia_smi)
      .def_static("from_islands", &plan::Topology::from_islands)
      .def_static("flat", [](int world) { return plan::Topology::flat(world); })
      .def_readwrite("gpu_names", &plan::Topology::gpu_names)
      .def_readonly("world", &plan::Topology::world)
      .def_readonly("numa_node", &plan::Topology::numa_node)
      .def_readonly("source", &plan::Topology::source)
      .def("link", [](const plan::Topology& t, int a,
                      int b) { return std::string(plan::link_class_name(t.link(a, b))); })
      .def("island_of", &plan::Topology::island_of)
      .def("islands", &plan::Topology::islands)
      .def("has_nvlink", &plan::Topology::has_nvlink)
      .def("nvlink_pairs", &plan::Topology::nvlink_pairs)
      .def("subset", &plan::Topology::subset, py::arg("gpus"))
      .def("why_not_two_equal_islands", &plan::Topology::why_not_two_equal_islands)
      .def("table_key", &plan::Topology::table_key)
      .def("fingerprint", &plan::Topology::fingerprint, py::arg("extra") = "")
      .def("describe", &plan::Topology::describe);

  py::class_<plan::TuningTable>(m, "TuningTable")
      .def_static("parse", &plan::TuningTable::parse, py::arg("text"), py::arg("source") = "table")
      .def_static("embedded_text", [] { return std::string(plan::TuningTable::embedded_text()); })
      .def_static(
          "canonical_key",
          [](const std::string& key) { return std::string(plan::canonical_topology_key(key)); },
          py::arg("key"),
          "The topology key as rows hold it: host_shm for host, cuda_host for hostmem.")
      .def("hash", &plan::TuningTable::hash)
      .def("canonical_text", &plan::TuningTable::canonical_text)
      .def("__len__", [](const plan::TuningTable& t) { return t.rows().size(); })
      .def("choose",
           [](const plan::TuningTable& t, const std::string& topology, int world,
              const std::string& dtype, int64_t bytes) -> py::object {
             const plan::TableChoice c =
                 t.choose(topology, world, dtype_from_name(dtype), bytes, nullptr);
             if (c.fallback) return py::str("fallback");
             return py::str(plan::tactic_label(c.tactic));
           });
}

void bind_communicator(py::module_& m) {
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
            for (const auto& n : names) o.dtypes.push_back(dtype_from_name(n));
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
      .def_readwrite("pdl", &comm::Options::pdl);

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

  py::class_<comm::Communicator, std::shared_ptr<comm::Communicator>>(m, "Communicator")
      .def(py::init([](const comm::Options& options) {
        auto c = std::make_shared<comm::Communicator>(options);
        c->set_interrupt_check(&python_signal_raised);  // Ctrl-C ends a host-transport wait
        return c;
      }))
      .def("local_token", [](const comm::Communicator& c) { return py::bytes(c.local_token()); })
      .def("connect", &comm::Communicator::connect)
      .def("retire_token", &comm::Communicator::retire_token)
      .def("supports", [](const comm::Communicator& c,
                          const at::Tensor& t) { return optional_reason(c.supports(t)); })
      .def("fused_decline_reason",
           [](comm::Communicator& c, const at::Tensor& x, const at::Tensor& residual,
              const at::Tensor& weight) {
             return optional_reason(c.fused_decline_reason(x, residual, weight));
           })
      .def("decline_reason",
           [](comm::Communicator& c, const at::Tensor& t) {
             return optional_reason(c.decline_reason(t));
           })
      .def("chosen_tactic", &comm::Communicator::chosen_tactic)
      .def("collective_decline_reason",
           [](comm::Communicator& c, const std::string& collective, const at::Tensor& t) {
             return optional_reason(
                 c.collective_decline_reason(parse_collective_name(collective), t));
           })
      .def("chosen_collective_tactic",
           [](comm::Communicator& c, const std::string& collective, const at::Tensor& t) {
             return c.chosen_collective_tactic(parse_collective_name(collective), t);
           })
      .def("probe_write", &comm::Communicator::probe_write)
      .def("probe_read", &comm::Communicator::probe_read)
      .def("disable",
           [](comm::Communicator& c, const std::string& reason, const std::string& detail) {
             c.disable(comm::parse_decline(reason), detail);
           })
      .def("close_peers", &comm::Communicator::close_peers)
      .def("release", &comm::Communicator::release)
      .def("forked", &comm::Communicator::forked)
      .def("enabled", &comm::Communicator::enabled)
      .def("disabled_reason",
           [](const comm::Communicator& c) { return optional_reason(c.options().disabled); })
      .def("disabled_detail",
           [](const comm::Communicator& c) { return c.options().disabled_detail; })
      .def("table_hash", &comm::Communicator::table_hash)
      .def("table_source", &comm::Communicator::table_source)
      .def("prepare", &comm::Communicator::prepare)
      .def("set_table", &comm::Communicator::set_table, py::arg("text"), py::arg("source"))
      .def("layout_hash", &comm::Communicator::layout_hash)
      .def("workspace_bytes", &comm::Communicator::workspace_bytes)
      .def("raise_if_failed", &comm::Communicator::raise_if_failed)
      .def("failure",
           [](const comm::Communicator& c) -> py::object {
             auto d = c.failure();
             if (!d) return py::none();
             return diagnostic_dict(*d, plan::describe_failure(*d, c.options().timeout_s));
           })
      .def("restore_stats",
           [](comm::Communicator& c, const std::map<std::string, int64_t>& calls,
              const std::map<std::string, int64_t>& declines,
              const std::vector<int64_t>& bytes_sent_per_peer, int64_t staged) {
             comm::Stats s;
             s.calls = calls;
             s.declines = declines;
             s.bytes_sent_per_peer = bytes_sent_per_peer;
             s.staged = staged;
             c.restore_stats(s);
           })
      .def("stats", [](const comm::Communicator& c) {
        const comm::Stats s = c.stats();
        py::dict out;
        out["calls"] = s.calls;
        out["declines"] = s.declines;
        out["bytes_sent_per_peer"] = s.bytes_sent_per_peer;
        out["staged"] = s.staged;
        out["fused_calls"] = s.fused_calls;
        out["fused_declines"] = s.fused_declines;
        py::dict collectives;
        for (const auto& [name, labels] : s.collective_calls) {
          py::dict entry;
          entry["calls"] = labels;
          const auto it = s.collective_declines.find(name);
          entry["declines"] =
              it == s.collective_declines.end() ? std::map<std::string, int64_t>{} : it->second;
          collectives[py::str(name)] = entry;
        }
        out["collectives"] = collectives;
        return out;
      });

  // c10d's Work.abort(), which torch does not bind: ends a gloo send or receive that a thread
  // is blocked in (its wait() returns False). The bootstrap's exit hook uses it so that no
  // thread of ours is still inside gloo when the interpreter finalizes.
  m.def(
      "abort_work", [](c10d::Work* work) { work->abort(); }, py::arg("work"),
      py::call_guard<py::gil_scoped_release>());
  m.def("register_communicator", &comm::register_communicator);
  m.def("unregister_communicator", &comm::unregister_communicator);
  py::register_exception_translator(&translate_failure);
}

}  // namespace
}  // namespace pcie_ar::bindings

PYBIND11_MODULE(_C, m) {
  m.doc() = "pcie_allreduce native module: the communicator and the plan layer";
  pcie_ar::bindings::bind_schedules(m);
  pcie_ar::bindings::bind_layout_topology_tables(m);
  pcie_ar::bindings::bind_communicator(m);
}
