"""torchtitan's launcher (``torchtitan.train.main``) on the CPU, for tests and CPU checks.

    python -m torch.distributed.run --nproc-per-node 1 tests/torchtitan_cpu_launcher.py --job.config_file ...

torchtitan 0.2.2 picks CUDA whatever the machine; this points its device detection, memory monitor
and its CUDA-only barrier at the CPU before it is imported (test-only patches). One process only:
FSDP2's reduce-scatter in torchtitan uses an op gloo lacks.
"""

import torch._utils

torch._utils._get_available_device_type = lambda: "cpu"  # read once, when torchtitan is imported

import torchtitan.components.metrics as metrics  # noqa: E402
import torchtitan.distributed.utils as dist_utils  # noqa: E402


class CPUMemory:
    """torchtitan's device memory monitor, with nothing to monitor."""

    device_name = "cpu"

    def get_peak_stats(self):
        return metrics.DeviceMemStats(0.0, 0.0, 0.0, 0.0, 0, 0)

    def reset_peak_stats(self) -> None:
        pass


metrics.build_device_memory_monitor = CPUMemory
dist_utils.set_pg_timeouts = lambda *args, **kwargs: None  # its barrier names a CUDA device

if __name__ == "__main__":
    from torchtitan.train import Trainer, main

    main(Trainer)
