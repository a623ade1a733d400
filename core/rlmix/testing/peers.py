"""Harnesses that drive a peer's own code (TRL) on inputs a parity test controls.

TRL computes its GRPO-family losses inside ``GRPOTrainer``; there is no module-level function to
call. These helpers build the smallest trainer that can run its loss on hand-built inputs, around
the in-process tiny model, so a plugin's parity test compares loss values and gradients with
TRL's. Import them only in tests marked ``parity`` (they need ``trl`` and ``datasets``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def trl_grpo_trainer(tmp_path: Path | None, loss_type: str, max_completion_length: int,
                     **config: Any) -> tuple[Any, Any]:
    """``(trainer, model)``: a ``GRPOTrainer`` around ``tiny-random`` on the CPU in float32,
    ready for ``trainer._compute_loss(model, inputs)``. ``config`` goes to ``GRPOConfig`` and
    overrides the defaults here (batch of 4, 4 generations, ``beta=0``); ``tmp_path`` ``None``
    writes the trainer's output folder to a fresh temporary folder."""
    import tempfile

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from rlmix.policy import tiny_random

    model, tok = tiny_random()
    output_dir = str(tmp_path) if tmp_path is not None else tempfile.mkdtemp(prefix="rlmix-trl-")
    # bf16=False: TRL autocasts to bf16 on the CPU by default, which moves log-probs by ~1e-3
    options: dict[str, Any] = {
        "output_dir": output_dir, "use_cpu": True, "bf16": False, "report_to": "none",
        "save_strategy": "no", "loss_type": loss_type, "beta": 0.0,
        "per_device_train_batch_size": 4, "num_generations": 4,
        "max_completion_length": max_completion_length}
    options.update(config)
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(
        completions), args=GRPOConfig(**options),
        train_dataset=Dataset.from_dict({"prompt": ["1+1=", "2+2="]}), processing_class=tok)
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop, which we skip
    model.train()
    return trainer, model


def trl_loss_inputs(seed: int = 0, n: int = 6, prompt_len: int = 3,
                    width: int = 7) -> tuple[dict[str, torch.Tensor], torch.Generator]:
    """Random prompt/completion ids and masks (one left-padded prompt, ragged completions) and
    advantages, in the dict form ``GRPOTrainer._compute_loss`` reads; also the generator."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(3, 200, (n, prompt_len), generator=g)
    prompt_mask = torch.ones(n, prompt_len, dtype=torch.long)
    prompt_mask[0, 0] = 0  # one left-padded prompt
    completion_ids = torch.randint(3, 200, (n, width), generator=g)
    lengths = torch.tensor([7, 3, 1, 5, 2, 6])[:n].clamp(max=width)
    completion_mask = (torch.arange(width)[None] < lengths[:, None]).long()
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
            "completion_ids": completion_ids, "completion_mask": completion_mask,
            "advantages": torch.randn(n, generator=g)}, g


def completion_logprobs(model: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-token log-probs of the completion under ``model`` at temperature 1, ``[n, width]``."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    logits = model(input_ids=ids, attention_mask=attn).logits
    width = inputs["completion_ids"].shape[1]
    logp = torch.log_softmax(logits[:, -width - 1:-1].float(), -1)
    return logp.gather(-1, inputs["completion_ids"][..., None])[..., 0]


def pop_grads(model: Any) -> dict[str, torch.Tensor]:
    """The parameters' gradients (cloned), then cleared."""
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads
