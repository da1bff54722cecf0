"""The ``train.py`` of the exported README, for a tiny random model on the CPU.

Run by test_launch.py as ``accelerate launch --config_file accelerate_config.yaml train.py``
in an export directory. It differs from the README's script only where this machine forces
it: the model is built from a local config with random weights instead of downloaded, the
data is synthetic, ``use_cpu`` is set (transformers refuses bf16 otherwise) and training
stops after two steps. Each rank writes what it ran as to ``result-<rank>.json`` (two
ranks printing to one pipe can interleave their lines).
"""

import json
import math
import sys

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

t = json.load(open("trainer_args.json"))
model_cfg = AutoConfig.from_pretrained(sys.argv[1])
model = AutoModelForCausalLM.from_config(model_cfg, **t["model_kwargs"])

args = TrainingArguments(
    output_dir="out",
    use_cpu=True,
    max_steps=2,
    report_to=[],
    save_strategy="no",
    logging_steps=1,
    **t["training_arguments"],
)
seq = 32
gen = torch.Generator().manual_seed(0)
data = [
    {"input_ids": ids, "labels": ids.clone()}
    for ids in torch.randint(0, model_cfg.vocab_size, (64, seq), generator=gen)
]
trainer = Trainer(model=model, args=args, train_dataset=data)
out = trainer.train()

acc = trainer.accelerator
engine = trainer.model_wrapped
result = {
    "rank": dist.get_rank(),
    "world_size": dist.get_world_size(),
    "distributed_type": acc.distributed_type.value,
    "num_processes": acc.num_processes,
    "mixed_precision": acc.mixed_precision,
    "engine": type(engine).__name__,
    "zero_stage": engine.zero_optimization_stage(),
    "train_batch_size": engine.train_batch_size(),
    "micro_batch": engine.train_micro_batch_size_per_gpu(),
    "grad_accum": engine.gradient_accumulation_steps(),
    "reduce_bucket_size": engine.zero_reduce_bucket_size(),
    "zero_optimizer": type(engine.optimizer).__name__,
    "inner_optimizer": type(engine.optimizer.optimizer).__name__,
    "param_dtype": str(next(engine.module.parameters()).dtype),
    "steps": out.global_step,
    "loss_finite": math.isfinite(out.training_loss),
}
with open(f"result-{result['rank']}.json", "w") as fh:
    json.dump(result, fh)
# leave the process group before the interpreter exits: on the CPU, gloo's threads can abort
# ("terminate called without an active exception") an interpreter that exits inside it
dist.barrier()
dist.destroy_process_group()
