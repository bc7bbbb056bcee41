"""The launch's CUDA graphs: one graph of the whole iteration, graphs per layer, or none; the
NaN check they leave; and NCCL's connections where a graph holds collectives.

``choose_cuda_graphs`` decides, in order: the full-iteration graph (automatic on one GPU
without model parallelism on the fast spec, ``--fast-cuda-graphs iteration`` elsewhere),
per-layer graphs (megatron's ``--cuda-graph-impl local`` holding the fused layer, automatic
where the full-iteration graph is off and the fast spec's fused layer runs), then what the two
come to (``CUDA_GRAPH``) and the NaN check they leave (``NAN_CHECK``). ``choose_nccl_connect``
connects NCCL's peers up front where a captured collective could not connect one.
"""

from __future__ import annotations

from typing import Optional

from megagpt.errors import UserError

from . import fp8
from .layers import LayerPath
from .layout import planned_world_size
from .plan import Decision, Label, Reason, Why


class CudaGraph(Label):
    FULL_ITERATION = "full iteration"
    PER_LAYER = "per layer"
    NONE = "none"
    TRANSFORMER_ENGINE = "transformer_engine"  # megatron's TE graphs, as given

    @property
    def megatron_impl(self) -> str:
        """megatron's ``--cuda-graph-impl`` for it."""
        return {CudaGraph.FULL_ITERATION: "full_iteration", CudaGraph.PER_LAYER: "local"}.get(
            self, self.value)

    @property
    def captures(self) -> bool:
        return self in (CudaGraph.FULL_ITERATION, CudaGraph.PER_LAYER)


class NanCheck(Label):
    IN_STEP = "in step"  # megatron's checks of each loss and gradient bucket
    OFF = "off"
    GRADIENT_NORM = "gradient norm"  # every step's gradient norm, checked after the step


CUDA_GRAPH: Decision[CudaGraph] = Decision("CUDA graph", CudaGraph)
NAN_CHECK: Decision[NanCheck] = Decision("NaN check", NanCheck)
NCCL_CONNECT = "NCCL_RUNTIME_CONNECT"
NCCL_CHOICE: Decision[str] = Decision("NCCL connect", str)


def _path_name(path: LayerPath) -> str:
    return "Transformer Engine's layers" if path is LayerPath.TRANSFORMER_ENGINE else "fast path"


def _graphable(path: LayerPath) -> bool:
    return path in (LayerPath.FAST, LayerPath.TRANSFORMER_ENGINE)


# --- why a graph is off ----------------------------------------------------------------------

def recompute_granularity(args) -> Optional[str]:
    """``--recompute-granularity``, or "selective" for ``--recompute-activations`` (which
    megatron turns into it once its arguments are validated, after the plan)."""
    granularity = getattr(args, "recompute_granularity", None)
    if granularity is None and getattr(args, "recompute_activations", False):
        return "selective"
    return granularity


def graphed_recompute_conflict(args) -> Optional[str]:
    """Why megatron refuses this launch's selective recompute inside a graph of the whole
    step (None: it does not): a recomputed module that draws random numbers (dropout, MoE
    input jitter) cannot be replayed from a CUDA graph. Megatron's check, from the same
    arguments (``TransformerConfig.__post_init__``; no modules named means core attention)."""
    if recompute_granularity(args) != "selective":
        return None
    modules = getattr(args, "recompute_modules", None)
    modules = {"core_attn"} if modules is None else set(modules)
    if (getattr(args, "attention_dropout", 0.0) or 0.0) > 0.0 and "core_attn" in modules:
        return ("selective recompute of core attention with attention dropout (megatron does "
                "not recompute dropout inside a CUDA graph)")
    if (getattr(args, "hidden_dropout", 0.0) or 0.0) > 0.0 and modules & {"mlp", "moe"}:
        return ("selective recompute of the MLP with hidden dropout (megatron does not "
                "recompute dropout inside a CUDA graph)")
    if getattr(args, "moe_input_jitter_eps", None) is not None and "moe" in modules:
        return ("selective recompute of the MoE layer with --moe-input-jitter-eps (megatron "
                "does not recompute random numbers inside a CUDA graph)")
    return None


def full_iteration_unsupported_reason(args, path: LayerPath) -> Optional[str]:
    """Why the full-iteration CUDA graph is not switched on automatically for layers of
    ``path`` (None: it is)."""
    if getattr(args, "cpu", False):
        return "CPU mode"
    if path is LayerPath.TRANSFORMER_ENGINE:
        # asked for (--fast-cuda-graphs iteration, or megatron's --cuda-graph-impl
        # full_iteration) it runs; not by default: with TE's layers at a small shape (head
        # size 16) launches under it failed where the same launch without it trained
        # (bench/notes/transformer-engine.md)
        return ("not by default for Transformer Engine's layers (--fast-cuda-graphs "
                "iteration asks for it; docs/transformer-engine-and-apex.md)")
    if path is not LayerPath.FAST:
        return "the fast spec is not used"
    if getattr(args, "cuda_graph_impl", "none") not in ("none", None):
        return f"--cuda-graph-impl {args.cuda_graph_impl} was given"
    if (conflict := graphed_recompute_conflict(args)) is not None:
        return conflict
    if planned_world_size(args) != 1:
        return "more than one GPU (full-iteration graphs are validated on one GPU only)"
    if getattr(args, "check_for_spiky_loss", False):
        return "--check-for-spiky-loss needs a host sync inside the step"
    if getattr(args, "overlap_param_gather", False):
        return ("--overlap-param-gather (megatron starts the all-gather in one step and "
                "finishes it in the next)")
    if (getattr(args, "tensor_model_parallel_size", 1) or 1) != 1 or (
        getattr(args, "pipeline_model_parallel_size", 1) or 1
    ) != 1:
        return "model parallelism"
    return None


def layer_graphs_unsupported_reason(args, path: LayerPath) -> Optional[str]:
    """Why per-layer CUDA graphs cannot hold this run's layers (None: they can).

    Checked after the full-iteration graph is decided. These are the runs where megatron's
    per-layer graphs (``--cuda-graph-impl local``) would not run or would not hold the fused
    layer; ``layer_graphs_default_off_reason`` adds the layouts where they run but stay off
    unless asked for.
    """
    if getattr(args, "cpu", False):
        return "CPU mode"
    if path is not LayerPath.FAST:
        return "the fast spec is not used"
    if not getattr(args, "fast_spec_fused_layer", True):
        return ("the fused layer is off (--fast-disable fused-layer, or --overlap-param-gather; "
                "megatron's own --cuda-graph-impl local graphs megatron's layer)")
    impl = getattr(args, "cuda_graph_impl", "none") or "none"
    if impl == "full_iteration":
        return "the full-iteration CUDA graph holds the whole step"
    if impl not in ("none", "local"):
        return f"--cuda-graph-impl {impl} was given"
    granularity = recompute_granularity(args)
    if granularity:
        # megatron: full recompute only with the full-iteration graph; the fused layer does
        # not recompute (selective recompute keeps megatron's layer) either way
        return f"--recompute-granularity {granularity}"
    if getattr(args, "cpu_offloading", False) or (
            getattr(args, "cpu_offloading_num_layers", 0) or 0) > 0:
        return "CPU offloading"
    if getattr(args, "fine_grained_activation_offloading", False):
        return "fine-grained activation offloading"
    if getattr(args, "reset_attention_mask", False):
        return "--reset-attention-mask (the fused layer needs causal attention)"
    return None


def layer_graphs_default_off_layout(args) -> Optional[tuple[str, str]]:
    """(the layout, why) where per-layer graphs, which could run here, are not switched on by
    default (None: they are)."""
    if (getattr(args, "tensor_model_parallel_size", 1) or 1) != 1:
        return ("tensor parallelism", "its collectives would run inside the graphs; not yet "
                "measured on several GPUs: --fast-cuda-graphs layers asks for them")
    if (getattr(args, "pipeline_model_parallel_size", 1) or 1) != 1:
        return ("pipeline parallelism", "one set of graphs and buffers per micro-batch in "
                "flight: --fast-cuda-graphs layers asks for them")
    return None


def layer_graphs_default_off_reason(args) -> Optional[str]:
    """Why per-layer graphs, which could run here, are not switched on by default."""
    off = layer_graphs_default_off_layout(args)
    return None if off is None else f"{off[0]} ({off[1]})"


# --- the steps of the resolution -----------------------------------------------------------

def _graphs_given(p) -> str:
    """The ``--fast-cuda-graphs`` choice that turned a graph off."""
    return f"--fast-cuda-graphs {p.get('fast_cuda_graphs', 'none')}"


def _full_iteration_graph(p, path: LayerPath) -> Optional[str]:
    """``fast_cuda_graph``: default, refusal, and megatron's ``cuda_graph_impl``; returns why
    the graph is off (None: on, or not asked)."""
    asked = p.v.fast_cuda_graph
    impl = p.get("cuda_graph_impl", "none")
    off = None
    if asked is None:
        off = full_iteration_unsupported_reason(p.v, path)
        p.set("fast_cuda_graph", off is None)
        if off is not None and _graphable(path):
            if impl == "full_iteration":
                # megatron's own flag: its graph runs as asked, outside this switch's checks
                p.log("fast path: megatron's --cuda-graph-impl full_iteration as given: each "
                      "iteration's forward and backward are captured as one CUDA graph (on "
                      f"{p.world()} GPU(s); the fast path's own graph is automatic on one GPU "
                      "only)")
            else:
                p.log(f"{_path_name(path)}: full-iteration CUDA graph off: {off}")
    elif asked:
        off = _full_iteration_asked(p, impl, path)
    else:
        off = _graphs_given(p)
    full_iteration = p.v.fast_cuda_graph or impl == "full_iteration"
    if full_iteration and p.get("overlap_param_gather", False):
        # megatron launches the all-gather of the updated parameters in one step and waits
        # for it in the next forward pass: a graph captured per step holds only half of it
        # (megatron stops at the second iteration, in start_param_sync)
        raise UserError(
            "--overlap-param-gather with the full-iteration CUDA graph: megatron starts the "
            "parameter all-gather in one step and finishes it in the next, which a graph "
            "captured per step cannot hold. Leave out --overlap-param-gather, or the graph "
            "(--fast-cuda-graphs none)")
    if p.v.fast_cuda_graph:
        p.set("cuda_graph_impl", "full_iteration")
        if p.get("check_for_nan_in_loss_and_grad", False):
            p.set("check_for_nan_in_loss_and_grad", False)
            p.log("fast path: --no-check-for-nan-in-loss-and-grad (needed inside a CUDA graph; "
                  "losses are still logged)")
        p.log(f"{_path_name(path)}: forward+backward captured as one CUDA graph per "
              "iteration (--cuda-graph-impl full_iteration; --fast-cuda-graphs none turns it "
              "off)")
    return off


def _full_iteration_asked(p, impl, path: LayerPath) -> Optional[str]:
    """--fast-cuda-graphs iteration given: where it cannot run, ignored or refused; returns
    why it was ignored (None: it runs)."""
    if p.get("cpu", False) or not _graphable(path):
        p.log("fast path: --fast-cuda-graphs iteration ignored (CPU mode, or neither the "
              "fast spec nor Transformer Engine's dense layers are used)")
        p.set("fast_cuda_graph", False)
        return ("--fast-cuda-graphs iteration ignored (CPU mode, or not the fast spec nor "
                "TE's layers)")
    if impl not in ("none", None, "full_iteration"):
        p.log(f"fast path: --fast-cuda-graphs iteration ignored: --cuda-graph-impl {impl}")
        p.set("fast_cuda_graph", False)
        return f"--fast-cuda-graphs iteration ignored: --cuda-graph-impl {impl}"
    if (conflict := graphed_recompute_conflict(p.v)) is not None:
        raise UserError(f"--fast-cuda-graphs iteration with {conflict}. Leave "
                        "out the flag, the dropout, or the module's recompute "
                        "(--recompute-modules)")
    if (p.get("pipeline_model_parallel_size", 1) or 1) != 1:
        # megatron's pipeline schedule waits on the host for its exchanges inside the step,
        # which a capture forbids (a PP=2 capture failed: bench/notes/fast-path.md,
        # "Full-iteration CUDA graph")
        raise UserError(
            "--fast-cuda-graphs iteration with pipeline parallelism: megatron's pipeline "
            "schedule synchronises with the host inside the step, which a CUDA graph capture "
            "forbids. Leave the flag out (per-layer graphs: --fast-cuda-graphs layers).")
    if p.world() != 1:
        p.log(f"fast path: full-iteration CUDA graph on {p.world()} GPUs, asked for: the "
              "data- and tensor-parallel collectives are captured inside it (not yet measured "
              "on several GPUs; NCCL connects every peer when its communicator is made, and a "
              "capture that does not finish within --fast-cuda-graph-capture-timeout stops "
              "the run naming its rank)")
    return None


def _layer_graphs(p, path: LayerPath) -> Optional[str]:
    """``fast_layer_graphs``: default, refusal, and megatron's ``cuda_graph_impl``; returns
    why per-layer graphs are off (None: on, or not decided here)."""
    asked = p.v.fast_layer_graphs
    given_local = p.get("cuda_graph_impl", "none") == "local" and asked is None
    reason = layer_graphs_unsupported_reason(p.v, path)
    off = None
    if asked is None:
        off = reason or (None if given_local else layer_graphs_default_off_reason(p.v))
        p.set("fast_layer_graphs", off is None)
        if off is not None and path is LayerPath.FAST and not p.get("cpu", False) \
                and p.get("cuda_graph_impl", "none") != "full_iteration":
            p.log(f"fast path: per-layer CUDA graphs off: {off}")
    elif asked and reason is not None:
        raise UserError(f"--fast-cuda-graphs layers: {reason}; leave the flag out")
    elif not asked:
        off = _graphs_given(p)
    if not p.v.fast_layer_graphs:
        return off
    p.set("cuda_graph_impl", "local")
    p.log("fast path: each layer's forward and backward captured as CUDA graphs, holding the "
          "compiled fused layer (megatron's --cuda-graph-impl local; --fast-cuda-graphs none "
          "turns them off)")
    if p.get("check_for_nan_in_loss_and_grad", False) and not p.get("fast_step_nan_checks",
                                                                    False):
        # each check reads a GPU value on the host: once per micro-batch (the loss) and per
        # gradient bucket; the host then has nothing queued and the GPU idles through its
        # Python, the optimizer's per-parameter loops exposed behind the last wait (figures:
        # bench/notes/fast-path.md, "Per-layer CUDA graphs")
        p.set("check_for_nan_in_loss_and_grad", False)
        p.log("fast path: megatron's in-step NaN/Inf checks off under per-layer graphs (each "
              "waits for the GPU); every step's gradient norm is checked instead "
              "(--fast-disable deferred-nan-checks keeps megatron's)")
    default_off = layer_graphs_default_off_layout(p.v)
    if default_off is not None:
        p.log(f"fast path: per-layer CUDA graphs with {default_off[0]}: asked for; not yet "
              "measured there")
    return off


def _graph_choice(p, full_off: Optional[str], layers_off: Optional[str]) -> CudaGraph:
    """What the two graph decisions come to, with its reason."""
    impl = p.get("cuda_graph_impl", "none") or "none"
    given_impl = getattr(p.args, "cuda_graph_impl", "none")
    if impl == "full_iteration":
        if getattr(p.args, "fast_cuda_graph", None):
            reason = Reason(Why.GIVEN, "--fast-cuda-graphs iteration")
        elif p.v.fast_cuda_graph:
            reason = Reason(Why.DEFAULT, "one GPU, no model parallelism: launches are the "
                            "step's cost")
        else:
            reason = Reason(Why.GIVEN, "--cuda-graph-impl full_iteration as given")
        graph = CudaGraph.FULL_ITERATION
    elif impl == "local":
        if getattr(p.args, "fast_layer_graphs", None):
            reason = Reason(Why.GIVEN, "--fast-cuda-graphs layers")
        elif given_impl == "local":
            reason = Reason(Why.GIVEN, "--cuda-graph-impl local as given")
        else:
            reason = Reason(Why.CONFLICT, f"full-iteration graph off: {full_off}")
        graph = CudaGraph.PER_LAYER
    else:
        reason = Reason(Why.CONFLICT, f"full iteration: {full_off or 'off'}; per layer: "
                        f"{layers_off or 'off'}")
        graph = CudaGraph(impl)
    p.choose(CUDA_GRAPH, graph, reason)
    return graph


def _nan_check(p, graph: CudaGraph) -> None:
    """The NaN check the graphs leave."""
    if p.get("check_for_nan_in_loss_and_grad", False):
        p.choose(NAN_CHECK, NanCheck.IN_STEP, Reason(
            Why.DEFAULT, "megatron's checks of each loss and gradient bucket"))
    elif not getattr(p.args, "check_for_nan_in_loss_and_grad", False):
        p.choose(NAN_CHECK, NanCheck.OFF, Reason(
            Why.GIVEN, "megatron's --no-check-for-nan-in-loss-and-grad"))
    elif graph is CudaGraph.FULL_ITERATION:
        p.choose(NAN_CHECK, NanCheck.GRADIENT_NORM, Reason(
            Why.CONFLICT, "a check inside a CUDA graph cannot sync"))
    else:
        p.choose(NAN_CHECK, NanCheck.GRADIENT_NORM, Reason(
            Why.CONFLICT, "each in-step check waits for the GPU under per-layer graphs "
            "(--fast-disable deferred-nan-checks keeps them)"))


def choose_cuda_graphs(p) -> None:
    """The full-iteration graph, then per-layer graphs, what they come to and the NaN check
    they leave."""
    path = p.layers()[0]
    full_off = _full_iteration_graph(p, path)
    layers_off = _layer_graphs(p, path)
    graph = _graph_choice(p, full_off, layers_off)
    fp8.refuse_a_graph_before_any_amax(p, graph.captures)
    _nan_check(p, graph)


def choose_nccl_connect(p) -> None:
    # NCCL (2.22+) connects peers lazily, on a collective's first use of them; inside a
    # capture that cannot happen (a DP=2 capture hung: bench/notes/fast-path.md,
    # "Full-iteration CUDA graph"). 0 connects them when each communicator is made, after this
    # point.
    full_iteration = p.get("cuda_graph_impl", "none") == "full_iteration"
    current = p.environ.get(NCCL_CONNECT)
    if not (full_iteration and p.world() != 1):
        p.choose(NCCL_CHOICE, current or "unset", Reason(
            Why.LAYOUT, "no NCCL collective is captured in a graph"))
    elif current is not None:
        p.choose(NCCL_CHOICE, current, Reason(Why.ENVIRONMENT, "as set in the environment"))
    else:
        p.set_env(NCCL_CONNECT, "0")
        p.log("fast path: NCCL_RUNTIME_CONNECT=0 (every NCCL peer connected up front, as a "
              "captured collective cannot connect one)")
        p.choose(NCCL_CHOICE, "0", Reason(Why.LAYOUT, "a captured collective cannot connect "
                                          "a peer"))
