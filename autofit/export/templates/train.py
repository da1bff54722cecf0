"""Train the autofit plan in this folder with the Hugging Face Trainer.

    accelerate launch --config_file accelerate_config.yaml train.py --data train.jsonl

Written by `autofit export`, the same for every plan: it reads the plan from the files beside it
(trainer_args.json: the keyword arguments of from_pretrained, peft, bitsandbytes and
TrainingArguments; plan.json: the plan and what it was expected to use). What the plan needs and
the Trainer has no switch for comes from `autofit.launch` (pip install autofit[train] on the
training machine). At the end, <output-dir>/autofit_result.json holds what the plan expected
beside what this run got. Edit it as you would any training script.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SUFFIX_FORMAT = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train the autofit plan in this folder with the Hugging Face Trainer.")
    p.add_argument("--data", required=True, help="a local .jsonl/.json/.parquet/.csv/.txt file, or a datasets hub id")
    p.add_argument("--text-field", default="text", help="the column holding each example's text (default: text)")
    p.add_argument("--output-dir", default="out", help="checkpoints, the trained model and autofit_result.json")
    p.add_argument("--max-steps", type=int, default=-1, help="optimizer steps to train (default: one epoch)")
    p.add_argument("--model", help="a hub id or a folder with the weights (default: the model autofit planned for)")
    p.add_argument("--tokenizer", help="a hub id or a folder (default: the model's)")
    return p.parse_args(argv)


def load_data(path: str, text_field: str, tokenizer, max_length: int):
    """Tokenized examples, each cut to the plan's sequence length; labels are the inputs
    (the model shifts them)."""
    from datasets import load_dataset

    local = Path(path)
    if local.exists():
        if local.suffix not in SUFFIX_FORMAT:
            sys.exit(f"train.py: --data {path}: give a {', '.join(SUFFIX_FORMAT)} file or a datasets hub id")
        data = load_dataset(SUFFIX_FORMAT[local.suffix], data_files=str(local), split="train")
    else:
        data = load_dataset(path, split="train")
    if text_field not in data.column_names:
        sys.exit(f"train.py: {path} has no column {text_field!r} (it has {', '.join(data.column_names)}): --text-field")

    def tokenize(batch):
        enc = tokenizer(batch[text_field], truncation=True, max_length=max_length)
        enc["labels"] = [list(ids) for ids in enc["input_ids"]]
        return enc

    return data.map(tokenize, batched=True, remove_columns=data.column_names)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import transformers
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, TrainingArguments

    from autofit import launch

    try:
        export = launch.load(HERE)
        model_path = launch.model_path(export, args.model)
    except launch.LaunchError as exc:
        sys.exit(f"train.py: {exc}")
    t = export.trainer_args
    training_args = TrainingArguments(
        **launch.training_arguments(export, output_dir=args.output_dir, max_steps=args.max_steps)
    )

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or model_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if t["data"].get("padding_side"):  # context parallelism drops the mask: padding after the text
        tokenizer.padding_side = t["data"]["padding_side"]
    model_kwargs = dict(t["model_kwargs"])
    if t["quantization"]:
        model_kwargs["quantization_config"] = BitsAndBytesConfig(**t["quantization"])
    model = AutoModelForCausalLM.from_pretrained(model_path, **model_kwargs)
    if t["peft"]:
        model = get_peft_model(model, LoraConfig(**t["peft"]), **t["peft_model_kwargs"])

    with training_args.main_process_first():  # rank 0 tokenizes, the others read its cache
        data = load_data(args.data, args.text_field, tokenizer, t["data"]["max_length"])
    collator_class = getattr(transformers, t["data"]["data_collator"].rsplit(".", 1)[-1])
    collator_kwargs = dict(t["data"]["data_collator_kwargs"])
    if collator_class is transformers.DataCollatorForSeq2Seq:
        collator_kwargs["tokenizer"] = tokenizer

    trainer = launch.PlanTrainer(
        model=model,
        args=training_args,
        train_dataset=data,
        data_collator=collator_class(**collator_kwargs),
        processing_class=tokenizer,
        export=export,
    )
    output = trainer.train()
    trainer.save_model()
    launch.report(trainer, output)
    launch.close()


if __name__ == "__main__":
    main()
