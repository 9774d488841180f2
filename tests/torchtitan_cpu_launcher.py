"""torchtitan's launcher (``torchtitan.train.main``) on the CPU, for tests and CPU checks, 0.2.2 or 0.3.

    python -m torch.distributed.run --nproc-per-node 1 tests/torchtitan_cpu_launcher.py --job.config_file ...  # 0.2.2
    python -m torch.distributed.run --nproc-per-node 1 tests/torchtitan_cpu_launcher.py --module M --config F  # 0.3

torchtitan picks CUDA where it finds no accelerator (0.2.2 whatever the machine); this points its device
detection, memory monitor and its CUDA-only barrier at the CPU before it is imported, and under 0.3 runs
Llama 3's attention by SDPA, as FlexAttention has no backward on the CPU (test-only patches). One process
only: FSDP2's reduce-scatter in torchtitan uses an op gloo lacks.
"""

import torch._utils

torch._utils._get_available_device_type = lambda: "cpu"  # read once, when torchtitan is imported

import torch.nn.functional as F  # noqa: E402
import torchtitan  # noqa: E402
import torchtitan.components.metrics as metrics  # noqa: E402
import torchtitan.distributed.utils as dist_utils  # noqa: E402


class CPUMemory:
    """torchtitan's device memory monitor, with nothing to monitor."""

    device_name = "cpu"

    def get_peak_stats(self):
        return metrics.DeviceMemStats(0.0, 0.0, 0.0, 0.0, 0, 0)

    def reset_peak_stats(self) -> None:
        pass


def causal_attention(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, scale=None, enable_gqa=False,
                     **kwargs):
    """Causal attention by SDPA in place of 0.3's FlexAttention (the block mask's document boundaries
    are not applied: the test data's windows are what it trains on)."""
    out = F.scaled_dot_product_attention(q_BLNH.transpose(1, 2), k_BLNH.transpose(1, 2), v_BLNH.transpose(1, 2),
                                         scale=scale, is_causal=True, enable_gqa=enable_gqa)
    return out.transpose(1, 2)


metrics.build_device_memory_monitor = CPUMemory
dist_utils.set_pg_timeouts = lambda *args, **kwargs: None  # its barrier names a CUDA device
V3 = tuple(int(x) for x in torchtitan.__version__.split(".")[:2]) >= (0, 3)
if V3:
    import torchtitan.models.common.attention as attention

    attention.FlexAttention.forward = causal_attention

if __name__ == "__main__":
    from torchtitan.train import main

    if V3:
        main()
    else:
        from torchtitan.train import Trainer

        main(Trainer)
