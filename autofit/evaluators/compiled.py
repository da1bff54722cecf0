"""torch.compile of every decoder block, as autofit runs it on the simulator's fake tensors.

What a user launches is accelerate's regional compilation (``accelerate.utils.compile_regions``,
``TorchDynamoPlugin(use_regional_compilation=True)``, which the Trainer's ``torch_compile``
enables): each repeated block goes through ``torch.compile`` with inductor, its graph taking the
block's parameters as inputs so every block runs the same compiled code. What changes for
memory is what the compiled block saves for backward: AOTAutograd traces forward and backward
into one joint graph, and inductor's min-cut partitioner (``min_cut_rematerialization_partition``
with ``compiler="inductor"``, ``torch/_functorch/partitioners.py``) chooses the saved set,
recomputing cheap pointwise ops in backward instead of keeping their outputs. What changes for
time is that inductor fuses the pointwise and reduction ops between two matmuls into one
kernel, which reads its inputs and writes its outputs once.

Dynamo compiles nothing while a ``TorchDispatchMode`` is active (FIELD-NOTES), so the simulator
cannot call ``torch.compile`` inside its traced step. :func:`apply` stands in for it: each block's
forward becomes AOTAutograd's compiled function, built once per input signature with inductor's
own decomposition table and partitioner (what torch's ``aot_eager_decomp_partition`` debug
backend runs: the same saved set as inductor to the byte, FIELD-NOTES), outside the active modes
but on the step's fake tensors. The partitioned forward and backward graphs then run op by op
under the tracker, which sees every tensor they allocate and save. Their ops run unfused (an
upper bound on what a fused kernel holds at once); :func:`fused_kernels` gives what inductor's
fusion makes of them for the time model.

Imports torch at module level; nothing from autofit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

# ops inductor leaves to a library kernel (cuBLAS, the attention kernels, custom ops) rather than
# fusing: ``torch/_inductor/lowering.py``'s fallbacks and ``kernel/mm.py``'s extern choices
_EXTERN = {"mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "convolution", "convolution_backward"}


@dataclass(frozen=True)
class Kernels:
    """What inductor's fusion makes of one partitioned graph's ops other than library kernels:
    ``count`` fused kernels moving ``nbytes`` (each reading its inputs and writing the outputs
    read outside it once)."""

    count: int
    nbytes: float


def is_extern(target: Any) -> bool:
    """Whether inductor runs this aten op as a library kernel rather than generated code."""
    packet = getattr(target, "_overloadpacket", None)
    if packet is None:
        return False
    name = packet.__name__
    return (
        name in _EXTERN or "attention" in name or target.namespace not in ("aten", "prims")
    )  # custom ops (autofit's stand-ins, bitsandbytes) are opaque to inductor


def _moves_data(node: torch.fx.Node) -> bool:
    target = node.target
    return not (getattr(target, "is_view", False) or getattr(target, "_overloadpacket", None) is None)


def _bytes(node: torch.fx.Node) -> float:
    val = node.meta.get("val")
    return float(sum(t.numel() * t.element_size() for t in tree_flatten(val)[0] if isinstance(t, torch.Tensor)))


def kernel_moves(gm: torch.fx.GraphModule) -> list[list[torch.fx.Node]]:
    """The fused kernels of a partitioned graph, each as the values it moves: its connected groups
    of ops that are not library kernels (views and metadata ops join a group and move nothing), one
    kernel each, reading the values it takes from outside and writing those anything outside reads.
    Inductor may split a group where a reduction's loop differs from its consumers'; this counts
    the fewest kernels and bytes such a graph can take (``torch/_inductor/scheduler.py`` fuses
    nodes that share reads or feed each other)."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and not is_extern(n.target)]
    parent = {n: n for n in nodes}

    def root(n):
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in nodes:
        for m in n.all_input_nodes:
            if m in parent:
                parent[root(m)] = root(n)
    groups: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for n in nodes:
        groups.setdefault(root(n), []).append(n)
    kernels = []
    for members in groups.values():
        if not any(_moves_data(n) for n in members):
            continue  # views only: no kernel
        inside = set(members)
        reads = {m for n in members for m in n.all_input_nodes if m not in inside}
        writes = {n for n in members if any(u not in inside for u in n.users)}
        kernels.append([*reads, *writes])
    return kernels


def fused_kernels(gm: torch.fx.GraphModule) -> Kernels:
    """How many fused kernels :func:`kernel_moves` finds, and the bytes they move."""
    moves = kernel_moves(gm)
    return Kernels(len(moves), sum(_bytes(v) for values in moves for v in values))


def _decompositions():
    from torch._inductor.compile_fx import select_decomp_table

    return select_decomp_table()


def _partition(gm, joint_inputs, **kwargs):
    """Inductor's own partition function (``torch/_inductor/compile_fx.py``: its joint-graph passes,
    which rewrite an eager attention's matmul-softmax-matmul into sdpa, then the min-cut
    partitioner with ``compiler="inductor"``)."""
    from torch._guards import detect_fake_mode
    from torch._inductor.compile_fx import partition_fn
    from torch._inductor.virtualized import V

    # compile_fx runs it with the trace's fake mode installed (a pass creating values reads V.fake_mode)
    with V.set_fake_mode(detect_fake_mode(joint_inputs)):
        return partition_fn(gm, joint_inputs, **kwargs)


def extern_kernels(gm: torch.fx.GraphModule) -> int:
    """The library kernels (GEMMs, attention) a partitioned graph calls."""
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and is_extern(n.target))


class CompiledBlocks:
    """Every given block's forward replaced by one AOTAutograd-compiled function of its
    parameters and tensor inputs (the blocks must share a structure, as regional compilation's
    do). ``region(kernels)``, where given, is entered around each run of a partitioned graph with
    what :func:`fused_kernels` made of it (the simulator's tracer prices them so)."""

    def __init__(self, blocks: Iterable[torch.nn.Module], region: Callable[[Kernels], Any] | None = None) -> None:
        self.blocks = list(blocks)
        self.region = region
        self._cache: dict[Any, Callable] = {}
        self.graphs: dict[str, list[torch.fx.GraphModule]] = {"forward": [], "backward": []}
        for block in self.blocks:
            block.forward = functools.partial(self._call, block, _undecorated(block), _structure(block))

    def remove(self) -> None:
        for block in self.blocks:
            del block.forward

    def _call(self, block: torch.nn.Module, eager: Callable, structure: tuple, *args, **kwargs):
        """The block's call with its checkpoint outside the compiled function, as transformers'
        ``GradientCheckpointingLayer`` places it (``modeling_layers.py``: the layer's forward under
        ``_gradient_checkpointing_func``, its keyword arguments bound). Where the checkpoint is inside
        the compiled region instead (accelerate compiles the wrapped block), AOTAutograd recomputes
        the same forward in the backward graph and saves the same block inputs."""
        if getattr(block, "gradient_checkpointing", False) and block.training and torch.is_grad_enabled():
            run = functools.partial(self._forward, block, eager, structure, **kwargs)
            return block._gradient_checkpointing_func(run, *args)
        return self._forward(block, eager, structure, *args, **kwargs)

    def _forward(self, block: torch.nn.Module, eager: Callable, structure: tuple, *args, **kwargs):
        state = dict(block.named_parameters())
        state.update(block.named_buffers())
        names = tuple(state)
        leaves, spec = tree_flatten((args, kwargs))
        where = tuple(i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor))
        tensors = [leaves[i] for i in where]
        key = (
            structure,
            block.training,
            names,
            spec,
            where,
            tuple(_constant(leaf) for i, leaf in enumerate(leaves) if i not in where),
            tuple(_meta(t) for t in (*state.values(), *tensors)),
            torch.is_grad_enabled(),
            _autocast_state(),
        )
        fn = self._cache.get(key)
        if fn is None:
            fn = self._cache[key] = self._compile(block, eager, names, leaves, spec, where, [*state.values(), *tensors])
        return fn(*state.values(), *tensors)

    def _compile(self, block, eager, names, leaves, spec, where, example) -> Callable:
        """AOTAutograd's compiled function for this signature, traced outside the active dispatch
        modes (the tracker must not count the trace) on the call's own fake tensors."""
        from functorch.compile import make_boxed_func
        from torch._functorch.aot_autograd import aot_function
        from torch.nn.utils.stateless import _reparametrize_module
        from torch.utils._python_dispatch import _disable_current_modes

        n = len(names)
        template = list(leaves)

        def functional(*flat):
            inputs = list(template)
            for i, t in zip(where, flat[n:]):
                inputs[i] = t
            args, kwargs = tree_unflatten(inputs, spec)
            # the block's own forward (not its __call__: no module hooks in the graph) on the inputs' parameters
            with _reparametrize_module(block, dict(zip(names, flat[:n]))):
                return eager(*args, **kwargs)

        def compiler(kind):
            def compile_graph(gm, _inputs):
                self.graphs[kind].append(gm)
                kernels = fused_kernels(gm)
                run = make_boxed_func(gm)
                if self.region is None:
                    return run

                def priced(args):
                    with self.region(kernels):
                        return run(args)

                priced._boxed_call = True
                return priced

            return compile_graph

        compiled = aot_function(
            functional,
            fw_compiler=compiler("forward"),
            bw_compiler=compiler("backward"),
            partition_fn=_partition,
            decompositions=_decompositions(),
        )
        # the first call traces the joint graph and partitions it; its outputs are dropped, and what
        # it saves goes to no enclosing checkpoint's hooks
        with _disable_current_modes(), torch.autograd.graph.saved_tensors_hooks(_same, _same):
            compiled(*example)
        return compiled


def _undecorated(block: torch.nn.Module) -> Callable:
    """The block's forward without transformers' checkpointing decorator (``functools.wraps`` keeps
    the decorated function as ``__wrapped__``), bound to the block."""
    forward = type(block).forward
    while getattr(forward, "__code__", None) is not None and forward.__code__.co_name == "forward_with_checkpointing":
        forward = forward.__wrapped__
    return forward.__get__(block)


def _same(t):
    return t


def _structure(block: torch.nn.Module) -> tuple:
    """What makes two blocks' graphs differ beyond their tensors and training mode: each module's
    class and plain attributes (a sliding window, an attention type), its layer index aside."""
    return tuple(
        (name, type(m).__name__, *sorted((k, v) for k, v in vars(m).items() if _plain(k, v)))
        for name, m in block.named_modules()
    )


def _plain(k: str, v: Any) -> bool:
    return k != "layer_idx" and not k.startswith("_") and (v is None or isinstance(v, (bool, int, float, str)))


def _meta(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.stride(), t.dtype, t.device.type, t.requires_grad)


def _constant(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return (type(value).__name__, value)
    return (type(value).__name__, id(value))


def _autocast_state() -> tuple:
    return tuple(
        (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if _has_autocast(d)
    )


@functools.cache
def _has_autocast(device: str) -> bool:
    try:
        torch.get_autocast_dtype(device)
    except (RuntimeError, AttributeError):
        return False
    return True
