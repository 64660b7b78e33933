"""Fine-tune an hf_tfm causal LM with Trainer. One script for every launcher:

    python examples/train.py --output_dir out/single
    accelerate launch --config_file examples/accelerate/ddp.yaml examples/train.py --output_dir out/ddp
    accelerate launch --config_file examples/accelerate/fsdp.yaml examples/train.py --output_dir out/fsdp  # GPUs

It trains a tiny model on synthetic token ids; replace `examples()` with your tokenized dataset and the config with
yours (or `AutoModelForCausalLM.from_pretrained(path)`). Without GPUs it runs on CPU (`use_cpu=True`), which under a
multi-process launcher is real DDP over gloo. Rank 0 writes OUTPUT_DIR/run.json describing the run.
"""

import argparse
import json
from pathlib import Path

import torch
from transformers import Trainer, TrainingArguments

from hf_tfm import TfmConfig, TfmForCausalLM
from hf_tfm.training import PadCollator


def examples(n: int = 64, vocab_size: int = 99) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(4, 17, (n,), generator=generator).tolist()
    return [{"input_ids": torch.randint(3, vocab_size, (k,), generator=generator).tolist()} for k in lengths]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_steps", type=int, default=8)
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters on q_proj/v_proj only")
    args = parser.parse_args()

    torch.manual_seed(0)
    config = TfmConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
    model = TfmForCausalLM(config)
    if args.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))

    training_args = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=4,
        max_steps=args.max_steps,
        learning_rate=3e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=examples(), data_collator=PadCollator())
    result = trainer.train()
    trainer.save_model(args.output_dir)
    if trainer.is_world_process_zero():
        summary = {
            "world_size": training_args.world_size,
            "parallel_mode": str(training_args.parallel_mode),
            "model_wrapped": type(trainer.model_wrapped).__name__,
            "fsdp": trainer.is_fsdp_enabled,
            "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
            "train_loss": result.training_loss,
        }
        (Path(args.output_dir) / "run.json").write_text(json.dumps(summary, indent=2))
    if torch.distributed.is_initialized():  # shut gloo/nccl down cleanly: left to interpreter exit, a rank can abort
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
