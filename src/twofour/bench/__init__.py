"""What a user measures of twofour, in one place: ``twofour bench`` (``report.py``), the real
loop's tokens/s (``throughput.py``) and an exported model's prefill and decoding rows
(``speed.py``); all time with :mod:`twofour.timing`."""

from .report import fp8_report, fwd_bwd_step, inference_report, layer_report, run_bench
from .speed import default_vocab, exported_pair, tokens_row
from .throughput import TRAIN_BATCH, throughput_table, train_throughput

__all__ = ["run_bench", "layer_report", "fp8_report", "inference_report", "fwd_bwd_step", "exported_pair",
           "default_vocab", "tokens_row", "train_throughput", "throughput_table", "TRAIN_BATCH"]
