"""Training: the config (:mod:`.config`), the learning-rate schedule (:mod:`.schedule`), run
directories and checkpoints (:mod:`.runs`) and the loop for one process or ``torchrun`` DDP
(:mod:`.loop`)."""

from lssar.train.config import TrainConfig, load_config
from lssar.train.loop import lr_at, sample, sample_cli, train, train_cli
from lssar.train.runs import load_run
from lssar.train.schedule import set_lr, warmup_cosine

__all__ = [
    "TrainConfig",
    "load_config",
    "load_run",
    "lr_at",
    "sample",
    "sample_cli",
    "set_lr",
    "train",
    "train_cli",
    "warmup_cosine",
]
