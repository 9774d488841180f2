"""torchtitan 0.3's launcher (``torchtitan.train.main``) on the CPU, for tests and CPU checks.

    python -m torch.distributed.run --nproc-per-node 1 tests/torchtitan3_cpu_launcher.py --module ... --config ...

torchtitan picks CUDA where it finds no accelerator; this points its device detection and memory
monitor at the CPU before it is imported and runs Llama 3's attention by SDPA (test-only patches),
as tests/torchtitan_cpu_launcher.py does for 0.2.2.
"""

import torch._utils

torch._utils._get_available_device_type = lambda: "cpu"  # read once, when torchtitan is imported

import torch.nn.functional as F  # noqa: E402
import torchtitan.components.metrics as metrics  # noqa: E402
import torchtitan.distributed.utils as dist_utils  # noqa: E402
import torchtitan.models.common.attention as attention  # noqa: E402


class CPUMemory:
    """torchtitan's device memory monitor, with nothing to monitor."""

    device_name = "cpu"

    def get_peak_stats(self):
        return metrics.DeviceMemStats(0.0, 0.0, 0.0, 0.0, 0, 0)

    def reset_peak_stats(self) -> None:
        pass


def causal_attention(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, scale=None, enable_gqa=False,
                     **kwargs):
    """Causal attention by SDPA in place of FlexAttention, which has no backward on the CPU (the
    block mask's document boundaries are not applied: the test data's windows are what it trains on)."""
    out = F.scaled_dot_product_attention(q_BLNH.transpose(1, 2), k_BLNH.transpose(1, 2), v_BLNH.transpose(1, 2),
                                         scale=scale, is_causal=True, enable_gqa=enable_gqa)
    return out.transpose(1, 2)


metrics.build_device_memory_monitor = CPUMemory
dist_utils.set_pg_timeouts = lambda *args, **kwargs: None  # its barrier names a CUDA device
attention.FlexAttention.forward = causal_attention

if __name__ == "__main__":
    from torchtitan.train import main

    main()
