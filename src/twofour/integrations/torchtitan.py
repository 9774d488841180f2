"""twofour in torchtitan, for the torchtitan installed (``pip install "twofour[torchtitan]"``).

torchtitan 0.3 (:mod:`~twofour.integrations.titan3`): a model-config converter and trainer
configs with it, run by torchtitan's own launcher::

    torchrun --nproc-per-node 8 -m torchtitan.train --module twofour.integrations.torchtitan \\
        --config llama3_8b_twofour

torchtitan 0.2.2 (:mod:`~twofour.integrations.titan2`): a model converter turned on from a job's
toml (``job.custom_config_module = "twofour.integrations.torchtitan"``, ``model.converters =
["twofour"]``, a ``[twofour]`` section). Either way a checkpoint exports to 2:4 weights:
``python -m twofour.integrations.torchtitan CHECKPOINT OUT.safetensors``
(:func:`~twofour.integrations.titan_common.export_checkpoint`). docs/torchtitan.md has the rest.
"""

from importlib.metadata import PackageNotFoundError, version


def _installed() -> tuple[int, int]:
    """torchtitan's (major, minor) version; ImportError saying how to install it when it is missing."""
    try:
        major, minor = version("torchtitan").split(".")[:2]
    except PackageNotFoundError:
        raise ImportError("twofour.integrations.torchtitan needs torchtitan: pip install \"twofour[torchtitan]\"") \
            from None
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


#: The installed torchtitan's (major, minor) version, which picks the integration.
TORCHTITAN = _installed()

if TORCHTITAN >= (0, 3):
    from .titan3 import *  # noqa: F403
    from .titan3 import __all__ as _names
else:
    from .titan2 import *  # noqa: F403
    from .titan2 import __all__ as _names
from .titan_common import export_checkpoint, main  # noqa: E402

__all__ = ["TORCHTITAN", *_names, "export_checkpoint"]

if __name__ == "__main__":
    main()
