"""A Hugging Face Trainer + PEFT LoRA script, written as its author would, on mlxdist (the lines
marked md). A tiny random Llama learns random token sequences.

    python hf_script.py OUT_DIR [--steps N] [--accum K] [--resume CHECKPOINT] [--save-steps N]
    MLXDIST_CONFIG=split.yaml mpirun -np 2 -x MLXDIST_CONFIG python hf_script.py OUT_DIR
"""

import argparse
import os

import numpy as np
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

from mlxdist.hf import Trainer  # md  (was: from transformers import Trainer)

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--steps", type=int, default=4)
p.add_argument("--batch", type=int, default=8)
p.add_argument("--accum", type=int, default=1)
p.add_argument("--save-steps", type=int, default=0)
p.add_argument("--resume")
p.add_argument("--max-grad-norm", type=float, default=0.05)
p.add_argument("--optim", default="adamw_torch")
p.add_argument("--optim-args")
p.add_argument("--lr", type=float, default=1e-2)
p.add_argument("--seed-by-rank", action="store_true")  # a model that differs per rank until broadcast
args = p.parse_args()


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=64, length=16, vocab=96):
        self.ids = torch.tensor(np.random.default_rng(0).integers(0, vocab, size=(n, length)))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


torch.manual_seed(int(os.environ.get("OMPI_COMM_WORLD_RANK", 0)) if args.seed_by_rank else 0)
config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64)
model = LlamaForCausalLM(config)
model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                                         modules_to_save=["lm_head"]))

training_args = TrainingArguments(
    output_dir=args.out, per_device_train_batch_size=args.batch, gradient_accumulation_steps=args.accum,
    max_steps=args.steps, learning_rate=args.lr, lr_scheduler_type="linear", weight_decay=0.01,
    max_grad_norm=args.max_grad_norm, optim=args.optim, optim_args=args.optim_args,
    logging_steps=1, report_to="none", seed=0,
    save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500, save_total_limit=2,
    dataloader_pin_memory=False,
)
trainer = Trainer(model=model, args=training_args, train_dataset=Tokens())
trainer.train(resume_from_checkpoint=args.resume)

if trainer.is_world_process_zero():
    logs = [e for e in trainer.state.log_history if "loss" in e]
    np.savez(f"{args.out}/final.npz", loss=np.array([e["loss"] for e in logs]),
             grad_norm=np.array([e["grad_norm"] for e in logs]),
             **{n: t.detach().cpu().float().numpy() for n, t in model.named_parameters() if t.requires_grad})
