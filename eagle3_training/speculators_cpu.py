"""`speculators train` (0.9.0, vLLM's EAGLE3 trainer) on a machine without an accelerator.

The trainer assumes one in four places; each is redirected to the CPU here, then its own `main`
runs unchanged. CPU-safe flags are added unless given: SDPA draft attention (FlexAttention has no
CPU backward), the eager loss (fused losses are Triton kernels), no dataloader workers, and `raise`
on a missing hidden-state file (the default would call a vLLM server). Three of its CPU hot spots
(attention, argmax, the KL loss) run in cheaper exact forms (eagle3_training.document_attention,
eagle3_training.cpu_kernels); `--plain-kernels`, taken off before the trainer parses its arguments,
keeps the trainer's own.

    python -m eagle3_training.speculators_cpu [--plain-kernels] --verifier-name-or-path DIR --data-path DATA ...
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

PLAIN_KERNELS = "--plain-kernels"  # ours: the trainer's own attention, argmax and loss

CPU_DEFAULTS = {
    "--draft-attn-impl": ["sdpa"],
    "--loss-implementation": ["eager"],
    "--num-workers": ["0"],
    "--hidden-states-dtype": ["float32"],
    "--on-missing": ["raise"],
    "--mask-token-id": ["0"],  # EAGLE3 never masks; this skips loading the verifier's tokenizer
}


def with_cpu_defaults(argv: list[str]) -> list[str]:
    present = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    out = list(argv)
    for flag, value in CPU_DEFAULTS.items():
        if flag not in present:
            out += [flag, *value]
    return out


def patch_for_cpu(plain_kernels: bool = False) -> None:
    import torch

    if torch.accelerator.is_available():
        return
    torch.accelerator.synchronize = lambda *a, **k: None  # the step timer calls it every step

    import speculators.train.checkpointer as checkpointer
    import speculators.train.dataloader as dataloader
    import speculators.train.trainer as trainer

    trainer.get_local_rank = lambda: "cpu"  # used as the device: model.to(local_rank)
    checkpointer.get_current_device = lambda: "cpu"  # resume maps tensors to "cuda:0" otherwise
    original_init = trainer.Trainer.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.device_type = "cpu"  # autocast device; it falls back to "cuda" without an accelerator

    trainer.Trainer.__init__ = init
    plain_loader = dataloader.DataLoader

    def loader(*args, **kwargs):
        kwargs["pin_memory"] = False
        return plain_loader(*args, **kwargs)

    dataloader.DataLoader = loader
    record_every_validation(trainer.Trainer)
    if not plain_kernels:
        from eagle3_training import cpu_kernels, document_attention

        document_attention.install()
        cpu_kernels.install()


def build_head(verifier: Path, draft_vocab: int, seq_len: int, hidden_states_dtype: str = "float32",
               seed: int = 0, t2d=None, d2t=None):
    """The EAGLE3 head `speculators train` would build for `verifier` (the aux layers vLLM feeds it by
    default, one full attention layer), without training data: for timing its step, checking kernels against the
    trainer's, and running an exported head in torch (pass its `t2d`/`d2t`; by default the draft
    vocabulary is the first `draft_vocab` ids)."""
    import argparse

    import torch
    from speculators.model import SpeculatorModel
    from speculators.train.cli import build_draft_model, install_partial_neox_rotary
    from speculators.train.config import TrainConfig
    from transformers import AutoConfig

    from eagle3_training.hidden_states import DEFAULT_LAYERS

    argv = with_cpu_defaults(["--verifier-name-or-path", str(verifier), "--data-path", "/nonexistent",
                              "--save-path", "/nonexistent", "--target-layer-ids", *map(str, DEFAULT_LAYERS),
                              "--draft-vocab-size", str(draft_vocab), "--total-seq-len", str(seq_len),
                              "--full-attention-indices", "0", "--hidden-states-dtype", hidden_states_dtype])
    args = argparse.Namespace(**TrainConfig.resolve(argv).flatten())
    install_partial_neox_rotary()  # as the trainer does; full-rotation heads are unchanged by it
    if t2d is None:
        t2d = torch.zeros(AutoConfig.from_pretrained(str(verifier)).vocab_size, dtype=torch.bool)
        t2d[:draft_vocab] = True
        d2t = torch.zeros(draft_vocab, dtype=torch.long)
    torch.manual_seed(seed)
    return build_draft_model(args, SpeculatorModel.registry["eagle3"], t2d, d2t, draft_vocab)


def record_every_validation(trainer_class) -> None:
    """The trainer writes validation metrics only for an epoch that lowers the loss; every epoch's go
    beside its checkpoint (eagle3_training.selection.VALIDATION_FILE), so the epoch is chosen by what
    serving gets, not by the loss alone."""
    from eagle3_training.selection import VALIDATION_FILE

    original = trainer_class.val_epoch

    def val_epoch(self, epoch):
        metrics = original(self, epoch)
        if metrics is not None and isinstance(epoch, int):
            out = self.checkpointer.path / str(epoch) / VALIDATION_FILE
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(metrics, indent=1, sort_keys=True) + "\n")
        return metrics

    trainer_class.val_epoch = val_epoch


def main(argv: list[str] | None = None) -> None:
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ.setdefault(name, "1")
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE"):  # never the torch.distributed path
        os.environ.pop(name, None)
    argv = list(sys.argv[1:] if argv is None else argv)
    patch_for_cpu(plain_kernels=PLAIN_KERNELS in argv)
    from speculators.train.cli import main as train_main
    from speculators.train.config import TrainConfig

    train_main(TrainConfig.resolve(with_cpu_defaults([a for a in argv if a != PLAIN_KERNELS])))


if __name__ == "__main__":
    main()
