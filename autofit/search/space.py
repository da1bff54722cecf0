"""The search space: ``SearchSpace.suggest(trial) -> Plan``, define-by-run.

The user's training semantics are fixed: the global batch is theirs, so micro-batch and
gradient accumulation are searched as factorizations of it; quality-affecting choices
(method, LoRA rank, optimizer, precision) come only from what ``Allowed`` permits. Its
default methods are full, lora and qlora: lora-8bit (LLM.int8 base weights) is searched
where ``--methods`` names it: on every model × GPU pair of
benchmarks/results/2026-12-04-lora-8bit.md the analytic screen ranks its fastest plan below
qlora's, so by default it would only lengthen the search. The
rest — checkpointing (full or op-level selective; activation offload beside full on a GPU), attention kernel,
sharding, offload, context parallelism (FSDP with sdpa, full-length rows), micro-batch,
packing, fused loss, the optimizer step in backward (one GPU, no accumulation) — is always
free.

Knobs that exist only in some branches get branch-specific names (``offload_zero3``,
``lora_rank``), so Optuna's samplers see one consistent distribution per name; the
choices offered are already filtered by the GPU and the model family, so a suggested
plan is valid by construction (``enumerate`` walks the same tree, for screening).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from autofit.errors import SpecError
from autofit.plan import (
    Attention,
    Checkpointing,
    LoraTargets,
    Method,
    Offload,
    Optimizer,
    Plan,
    Precision,
    Sharding,
    experts_in_bf16,
    plan_problems,
)
from autofit.specs import Target

MAX_MICRO_BATCH = 64


class TrialLike(Protocol):
    def suggest_categorical(self, name: str, choices: Any) -> Any: ...


def _parse_list(text: str | None, enum, name: str) -> tuple | None:
    if text is None:
        return None
    parsed = []
    for v in (v.strip() for v in str(text).split(",")):
        try:
            parsed.append(enum(v))  # our names or the tools' (``autofit.plan.ALIASES``)
        except ValueError:
            if v:  # an empty item (a trailing comma) is no choice
                raise SpecError(f"--{name} {text!r}: {v!r} is none of {enum.choices_text()}") from None
    if not parsed:
        raise SpecError(f"--{name} {text!r}: choose from {enum.choices_text()}")
    return tuple(dict.fromkeys(parsed))  # adamw,adamw_torch is one choice


@dataclass(frozen=True)
class Allowed:
    """The quality-affecting choices the user allows the search to make."""

    methods: tuple[Method, ...] = (Method.FULL, Method.LORA, Method.QLORA)
    optimizers: tuple[Optimizer, ...] = (Optimizer.ADAMW,)
    precisions: tuple[Precision, ...] = ()  # empty: the GPU's mixed precision
    lora_ranks: tuple[int, ...] = (16,)
    lora_targets: LoraTargets = LoraTargets.ALL_LINEAR
    lora_dropout: float = 0.0  # the user's, for every LoRA/QLoRA plan (never searched)

    @classmethod
    def parse(
        cls,
        methods: str | None = None,
        optimizers: str | None = None,
        precisions: str | None = None,
        lora_ranks: str | None = None,
        lora_dropout: float | None = None,
    ) -> Allowed:
        kw: dict[str, Any] = {}
        if lora_dropout is not None:
            if not 0.0 <= lora_dropout < 1.0:
                raise SpecError(f"--lora-dropout {lora_dropout!r}: give a probability in [0, 1), e.g. 0.05")
            kw["lora_dropout"] = float(lora_dropout)
        for key, text, enum in (
            ("methods", methods, Method),
            ("optimizers", optimizers, Optimizer),
            ("precisions", precisions, Precision),
        ):
            parsed = _parse_list(text, enum, key)
            if parsed is not None:
                kw[key] = parsed
        if lora_ranks is not None:
            try:
                ranks = tuple(int(r) for r in str(lora_ranks).split(",") if r.strip())
            except ValueError:
                ranks = ()
            if not ranks or min(ranks) < 1:
                raise SpecError(f"--lora-ranks {lora_ranks!r}: give positive integers, e.g. 8,16,64")
            kw["lora_ranks"] = ranks
        return cls(**kw)

    def as_dict(self) -> dict[str, Any]:
        return {
            "methods": [m.value for m in self.methods],
            "optimizers": [o.value for o in self.optimizers],
            "precisions": [p.value for p in self.precisions],
            "lora_ranks": list(self.lora_ranks),
            "lora_targets": [self.lora_targets.value],
            # left out at peft's default, so stored requests keep their keys
            **({"lora_dropout": self.lora_dropout} if self.lora_dropout else {}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Allowed:
        """The inverse of :meth:`as_dict`; reads a study's stored ``allowed`` too (values as
        sorted strings). An absent or empty list means the default, as on the command line."""
        default = cls()
        return cls(
            methods=tuple(Method(m) for m in d.get("methods") or ()) or default.methods,
            optimizers=tuple(Optimizer(o) for o in d.get("optimizers") or ()) or default.optimizers,
            precisions=tuple(Precision(p) for p in d.get("precisions") or ()),
            lora_ranks=tuple(int(r) for r in d.get("lora_ranks") or ()) or default.lora_ranks,
            lora_targets=LoraTargets((d.get("lora_targets") or [default.lora_targets.value])[0]),
            lora_dropout=float(d.get("lora_dropout") or 0.0),
        )


@dataclass(frozen=True)
class SearchSpace:
    ctx: Target
    allowed: Allowed = field(default_factory=Allowed)
    # a fused loss only where one process runs the plain model: what the measured evaluator can
    # run without Liger (the chunked loss calls the model body outside DDP/DeepSpeed/FSDP)
    fused_loss_single_rank_only: bool = False

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise SpecError("; ".join(problems))

    # -- the choices, filtered by GPU and model -------------------------------------------
    def rank_batch(self, cp: int = 1) -> int:
        """Sequences (of which a context-parallel rank holds 1/cp) per rank and step."""
        return self.ctx.workload.global_batch // (self.ctx.cluster.world_size // cp)

    def micro_batches(self, cp: int = 1) -> list[int]:
        b = self.rank_batch(cp)
        return [m for m in range(1, min(b, MAX_MICRO_BATCH) + 1) if b % m == 0]

    def context_parallel(self, sharding: Sharding) -> list[int]:
        """Context-parallel group sizes for ``sharding`` (plan._context_parallel_problems): powers
        of two dividing the GPUs, with FSDP, for causal models of full causal attention with sdpa on
        full-length rows."""
        ctx = self.ctx
        world, w = ctx.cluster.world_size, ctx.workload
        if (
            sharding is not Sharding.FSDP
            or ctx.cluster.gpu.kind != "cuda"
            or ctx.model.family.task != "causal-lm"
            or "sdpa" not in ctx.model.family.attn_impls
            or w.lengths is not None
            or ctx.model.context_parallel_refusal
        ):
            return [1]
        sizes = [1]
        cp = 2
        while cp <= world:
            if world % cp == 0 and w.seq_len % (2 * cp) == 0:
                sizes.append(cp)
            cp *= 2
        return sizes

    def precisions(self) -> list[Precision]:
        gpu = self.ctx.cluster.gpu
        chosen = self.allowed.precisions or ((Precision.BF16_MIXED,) if gpu.supports_bf16 else (Precision.FP16_MIXED,))
        ok = [p for p in chosen if gpu.supports_bf16 or p not in (Precision.BF16_MIXED, Precision.BF16_TRUE)]
        return ok

    def methods(self) -> list[Method]:
        half = any(p is not Precision.FP32 for p in self.precisions())
        return [m for m in self.allowed.methods if m is not Method.QLORA or half]

    def attentions(self, precision: Precision) -> list[Attention]:
        gpu, fam = self.ctx.cluster.gpu, self.ctx.model.family
        out = []
        for a in (Attention.SDPA, Attention.FLASH2, Attention.EAGER):
            if a.value not in fam.attn_impls:
                continue
            if a is Attention.FLASH2 and (
                not gpu.supports_flash2 or precision is Precision.FP32 or self.ctx.model.head_dim > 256
            ):
                continue
            out.append(a)
        return out

    def shardings(self) -> list[Sharding]:
        if self.ctx.cluster.world_size > 1:
            return list(Sharding)
        return [Sharding.NONE, Sharding.ZERO2, Sharding.ZERO3, Sharding.FSDP]  # these only with offload

    def offloads(self, sharding: Sharding, optimizer: Optimizer) -> list[Offload]:
        single = self.ctx.cluster.world_size == 1
        eight_bit = optimizer in (Optimizer.ADAMW_8BIT, Optimizer.PAGED_ADAMW_8BIT)
        options = {
            Sharding.NONE: [Offload.NONE],
            Sharding.ZERO1: [Offload.NONE],
            Sharding.ZERO2: [Offload.NONE, Offload.OPTIMIZER],
            Sharding.ZERO3: [Offload.NONE, Offload.OPTIMIZER, Offload.OPTIMIZER_PARAMS],
            Sharding.FSDP: [Offload.NONE, Offload.OPTIMIZER_PARAMS],
        }[sharding]
        if self.ctx.cluster.gpu.kind == "cpu":
            # the CPU target's device is the host: offloading to it moves nothing, and
            # sharding one rank without offload divides nothing
            return [Offload.NONE] if not single or sharding is Sharding.NONE else []
        if single:
            options = [o for o in options if o is not Offload.NONE] or [Offload.NONE]
        if eight_bit or (sharding is not Sharding.FSDP and optimizer is not Optimizer.ADAMW):
            options = [o for o in options if o is Offload.NONE]
        return options

    def problems(self) -> list[str]:
        p = []
        world = self.ctx.cluster.world_size
        if self.ctx.workload.global_batch % world:
            p.append(
                f"the global batch {self.ctx.workload.global_batch} must be a multiple of the {world} GPUs "
                "(every GPU trains on whole sequences)"
            )
        if not self.precisions():
            p.append(
                f"none of the allowed precisions runs on {self.ctx.cluster.gpu.name} "
                "(no bf16 before compute capability 8.0): allow fp16-mixed"
            )
        elif not self.methods():
            p.append("qlora computes in 16-bit: allow a bf16/fp16 precision or another method")
        return p

    # -- define-by-run ------------------------------------------------------------------------
    def suggest(self, trial: TrialLike) -> Plan:
        a = self.allowed
        method = Method(trial.suggest_categorical("method", [m.value for m in self.methods()]))
        kw: dict[str, Any] = {"method": method}
        if method is not Method.FULL:
            kw["lora_rank"] = int(trial.suggest_categorical("lora_rank", list(a.lora_ranks)))
            kw["lora_targets"] = a.lora_targets
            kw["lora_dropout"] = a.lora_dropout
        precs = [p for p in self.precisions() if method is not Method.QLORA or p is not Precision.FP32]
        precision = Precision(
            trial.suggest_categorical(
                "precision" if method is not Method.QLORA else "precision_qlora", [p.value for p in precs]
            )
        )
        optimizer = Optimizer(trial.suggest_categorical("optimizer", [o.value for o in a.optimizers]))
        # 8-bit optimizer states and LLM.int8 weights are not sharded by ZeRO-3 or FSDP (plan_problems)
        int8_weights = method is Method.LORA_8BIT
        shardings = [
            s
            for s in self.shardings()
            if self.offloads(s, optimizer)
            and not (
                (int8_weights or optimizer in (Optimizer.ADAMW_8BIT, Optimizer.PAGED_ADAMW_8BIT))
                and s in (Sharding.ZERO3, Sharding.FSDP)
            )
        ]
        name = f"sharding_{optimizer.value}" if len(a.optimizers) > 1 else "sharding"
        sharding = Sharding(
            trial.suggest_categorical(name + ("_lora_8bit" if int8_weights else ""), [s.value for s in shardings])
        )
        offloads = self.offloads(sharding, optimizer)
        offload = Offload.NONE
        if len(offloads) > 1:
            offload = Offload(trial.suggest_categorical(f"offload_{sharding.value}", [o.value for o in offloads]))
        elif offloads:
            offload = offloads[0]
        cp = 1
        sizes = self.context_parallel(sharding)
        if len(sizes) > 1:
            cp = int(trial.suggest_categorical("context_parallel", sizes))
        # a context-parallel rank holds more (shorter) rows: its micro-batches are another choice
        mb = int(trial.suggest_categorical("micro_batch" if cp == 1 else f"micro_batch_cp{cp}", self.micro_batches(cp)))
        # none or full, and under full op-level selective checkpointing (a switch, _switches): every
        # k-th block (--checkpoint-every) is estimated, exported and offered by the report's toggles,
        # but not searched: with it the default 8 trials simulated 7 fitting plans and the main
        # command took 34 s against its 20 s goal
        ckpt = Checkpointing(trial.suggest_categorical("checkpointing", ["none", "full"]))
        attention = Attention.SDPA  # the ring attention's kernel (plan._context_parallel_problems)
        if cp == 1:
            attention = Attention(
                trial.suggest_categorical(
                    "attention" if precision is not Precision.FP32 else "attention_fp32",
                    [x.value for x in self.attentions(precision)],
                )
            )
        packing = False
        if attention is Attention.FLASH2 and self.ctx.workload.lengths is not None:
            packing = bool(trial.suggest_categorical("packing", [False, True]))
        switches = self._switches(trial, precision, sharding, mb, ckpt, cp)
        switches["torch_compile"] = self._compile(trial, method, attention, switches, cp, (precision, sharding))
        if switches["checkpoint_ops"]:
            ckpt = Checkpointing.SELECTIVE
        return Plan(
            precision=precision,
            optimizer=optimizer,
            micro_batch=mb,
            grad_accum=self.rank_batch(cp) // mb,
            checkpointing=ckpt,
            attention=attention,
            sharding=sharding,
            offload=offload,
            packing=packing,
            context_parallel=cp,
            **switches,
            **kw,
        )

    def _switches(self, trial: TrialLike, precision, sharding, mb: int, ckpt, cp: int) -> dict[str, bool]:
        """The on/off techniques, each asked only where it can run with the knobs chosen so far."""
        # activation offload beside checkpointing (torchtune's pairing): the block inputs go to
        # the host; alone it would move every saved tensor over PCIe. A CPU target has no host
        # apart from its memory.
        # op-level selective checkpointing in place of full: every block checkpointed, its matmul and
        # attention outputs kept (plan._op_checkpointing_problems: not beside FSDP's own checkpointing,
        # MoE blocks, blocks the analytic formulas do not describe, or activation offload)
        ops = False
        model = self.ctx.model
        if (
            ckpt is Checkpointing.FULL
            and sharding is not Sharding.FSDP
            and not (model.has_experts or model.analytic_gap)
        ):
            ops = bool(trial.suggest_categorical("checkpoint_ops", [False, True]))
        offload_acts = False
        if ckpt is Checkpointing.FULL and not ops and self.ctx.cluster.gpu.kind == "cuda" and cp == 1:
            offload_acts = bool(trial.suggest_categorical("offload_activations", [False, True]))
        # the step in backward where nothing accumulates or shards (plan._in_backward_problems)
        in_bwd = False
        single = self.ctx.cluster.world_size == 1 and sharding is Sharding.NONE and self.rank_batch() == mb
        if single and precision is not Precision.FP16_MIXED:
            in_bwd = bool(trial.suggest_categorical("optimizer_in_backward", [False, True]))
        # Liger's kernels (Triton) where the block fits them and the target is a GPU
        kernels = False
        if self.ctx.model.family.fused_kernels and self.ctx.cluster.gpu.kind == "cuda":
            kernels = bool(trial.suggest_categorical("fused_kernels", [False, True]))
        fused = False
        if (cp == 1 or self.ctx.model.family.liger) and (
            not self.fused_loss_single_rank_only or (self.ctx.cluster.world_size == 1 and sharding is Sharding.NONE)
        ):
            fused = bool(trial.suggest_categorical("fused_loss", [False, True]))
        return {
            "fused_loss": fused,
            "fused_kernels": kernels,
            "offload_activations": offload_acts,
            "optimizer_in_backward": in_bwd,
            "checkpoint_ops": ops,
        }

    def _compile(
        self,
        trial: TrialLike,
        method: Method,
        attention: Attention,
        switches: dict[str, bool],
        cp: int,
        dtypes: tuple[Precision, Sharding],
    ) -> bool:
        """torch.compile of the blocks on GPU targets, where it is modelled (plan._compile_problems;
        MoE experts in bf16 only); not beside eager attention, which inductor turns into sdpa (choose
        sdpa instead)."""
        if (
            self.ctx.cluster.gpu.kind != "cuda"
            or method in (Method.QLORA, Method.LORA_8BIT)
            or (self.ctx.model.has_experts and not experts_in_bf16(dtypes[0], method, dtypes[1]))
            or attention is Attention.EAGER
            or cp > 1
            or any(switches[k] for k in ("fused_kernels", "offload_activations", "checkpoint_ops"))
        ):
            return False
        return bool(trial.suggest_categorical("torch_compile", [False, True]))

    def enumerate(self) -> Iterator[Plan]:
        """Every plan ``suggest`` can return (for screening), walking the same tree."""
        for _, plan in self.enumerate_params():
            yield plan

    def enumerate_params(self) -> Iterator[tuple[dict[str, Any], Plan]]:
        """``(params, plan)`` pairs: params are what ``study.enqueue_trial`` needs to get the plan."""
        return self._walk()

    def _walk(self) -> Iterator[tuple[dict[str, Any], Plan]]:
        # depth-first over the define-by-run tree: replay a prefix, branch on the first
        # unanswered question; a prefix that answers every question is a leaf, and its plan
        stack: list[dict[str, Any]] = [{}]
        while stack:
            params = stack.pop()
            try:
                plan = self.suggest(_Replay(params))
            except _Unanswered as q:
                for choice in reversed(q.choices):
                    stack.append({**params, q.name: choice})
                continue
            yield params, plan

    def size(self) -> int:
        return sum(1 for _ in self._walk())


class _Unanswered(Exception):
    def __init__(self, name: str, choices: list[Any]):
        self.name, self.choices = name, choices


class _Replay:
    """A trial that answers from a dict and raises at the first question it cannot answer."""

    def __init__(self, params: dict[str, Any]):
        self.params = params

    def suggest_categorical(self, name: str, choices: Any) -> Any:
        if name in self.params:
            return self.params[name]
        raise _Unanswered(name, list(choices))


def check_space(space: SearchSpace, plans: Iterator[Plan] | None = None) -> list[tuple[Plan, list[str]]]:
    """Plans of the space that validation would refuse (should be none); for tests."""
    out = []
    for plan in plans if plans is not None else space.enumerate():
        problems = plan_problems(plan, space.ctx.model, space.ctx.cluster, space.ctx.workload)
        if problems:
            out.append((plan, problems))
    return out
