// The plan layer for the CLI, the tuner and the tests: schedules (build, verify, cost, inspect),
// the cost model's constants, workspace layouts, topologies and tuning tables.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <type_traits>

#include "bindings/bindings.h"
#include "plan/cost_model.h"
#include "plan/layout.h"
#include "plan/schedule.h"
#include "plan/topology.h"
#include "plan/tuning_table.h"
#include "plan/verify.h"
#include "transport/kind.h"

namespace pcie_ar::bindings {
namespace {

plan::DType dtype_from_name(const std::string& name) {
  return parse_or_throw(plan::kDTypeNames, name);
}

py::dict step_dict(const plan::Step& s) {
  py::dict out;
  out["kind"] = std::string(plan::kStepKindNames.name_of(s.kind));
  out["stage"] = s.stage;
  out["text"] = plan::describe_step(s);
  if (s.kind == plan::StepKind::kReduce) {
    auto buf = [](const plan::BufRef& b) {
      py::dict d;
      d["space"] = std::string(plan::kSpaceNames.name_of(b.space));
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
    out["split"] = s.split;  // 0: one sum; s: srcs[:s] and srcs[s:] rounded, then summed
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
  m.def("algorithms", [] { return names_of(plan::kAlgorithmNames); });
  m.def("protocols", [] { return names_of(plan::kProtocolNames); });
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
      .def(
          "choose",
          [](const plan::TuningTable& t, const std::string& topology, int world,
             const std::string& dtype, int64_t bytes, const std::string& collective) {
            const plan::TableChoice c = t.decide(topology, world, dtype_from_name(dtype), bytes,
                                                 nullptr, parse_collective_name(collective));
            return c.fallback ? std::string("fallback") : plan::tactic_label(c.tactic);
          },
          py::arg("topology"), py::arg("world"), py::arg("dtype"), py::arg("bytes"),
          py::arg("collective") = "all_reduce",
          "The tactic label that decides a call of `collective` (TuningTable::decide: a "
          "reduce-scatter or all-gather without a row of its own takes the all-reduce's choice "
          "in two-shot form), or 'fallback'; every row counts as runnable.");
}

}  // namespace

void bind_plan(py::module_& m) {
  bind_schedules(m);
  bind_layout_topology_tables(m);
}

}  // namespace pcie_ar::bindings
