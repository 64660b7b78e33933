"""Training with transformers' `Trainer`: the helpers for your own scripts, and the steps behind `hf-tfm`'s training
commands, each usable on its own.

- For any script: `PadCollator` (a batch without a tokenizer, `collator.py`) and `FreeCoreThreads` (torch's threads
  follow the free cores, `threads.py`).
- The trainers: `pretrain_causal_lm` (`causal_lm.py`), `finetune_classifier` (`classifier.py`, full or LoRA:
  `lora.py`), `train_seq2seq` and `seq2seq_from_causal_lm` (`seq2seq.py`); what they share, `TrainSettings` and the
  `Trainer` run, is `trainer.py`.
- What a run reports: `metrics.py`, `generation.py` (held-out answers, and the fresh-process check of a saved
  folder), `plots.py` (loss curves), `model_card.py` (the folder's README).
- The output folder: `check_output_dir` (`output_dir.py`), and `training_job` (`job.py`): stage the folder, train,
  write the card and the metrics, swap it into place. Every folder is written under a hidden temporary name next to
  its target and renamed into place only when complete (`hf_tfm.checkpoint.staged_folder`).
"""

from .causal_lm import load_causal_lm, pretrain_causal_lm
from .classifier import finetune_classifier
from .collator import PadCollator
from .generation import generate_in_fresh_process, generate_texts
from .job import training_job
from .metrics import score_texts, word_f1
from .model_card import architecture_summary, write_model_card
from .output_dir import OutputDirError, check_output_dir
from .plots import plot_loss_curves
from .seq2seq import seq2seq_from_causal_lm, train_seq2seq
from .threads import CpuSample, FreeCoreThreads, cpu_sample, free_cores
from .trainer import TrainSettings, loss_history, pack_texts

__all__ = [
    "CpuSample",
    "FreeCoreThreads",
    "OutputDirError",
    "PadCollator",
    "TrainSettings",
    "architecture_summary",
    "check_output_dir",
    "cpu_sample",
    "finetune_classifier",
    "free_cores",
    "generate_in_fresh_process",
    "generate_texts",
    "load_causal_lm",
    "loss_history",
    "pack_texts",
    "plot_loss_curves",
    "pretrain_causal_lm",
    "score_texts",
    "seq2seq_from_causal_lm",
    "train_seq2seq",
    "training_job",
    "word_f1",
    "write_model_card",
]
