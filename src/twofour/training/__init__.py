"""twofour's own training: the loop (:func:`train`), its config, run folders, data, the console,
``twofour compare``, the Hugging Face Trainer callback and ``twofour export``."""

from .config import TrainConfig
from .loop import train

__all__ = ["TrainConfig", "train"]
