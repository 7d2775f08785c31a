"""Training: the config (:mod:`.config`), run directories and checkpoints (:mod:`.runs`) and the
loop for one process or ``torchrun`` DDP (:mod:`.loop`)."""

from lssar.train.config import TrainConfig, load_config
from lssar.train.loop import lr_at, sample, sample_cli, train, train_cli
from lssar.train.runs import load_run

__all__ = [
    "TrainConfig",
    "load_config",
    "load_run",
    "lr_at",
    "sample",
    "sample_cli",
    "train",
    "train_cli",
]
