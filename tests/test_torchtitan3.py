"""twofour in torchtitan 0.3 (twofour.integrations.titan3) on the CPU: the converter on Llama 3's
config tree, its composition with torchtitan's float8 converter and override mechanism, and
torchtitan's own launcher training, checkpointing and resuming the debug model with 2:4 FFNs
(tests/torchtitan_cpu_launcher.py points it at the CPU). The 0.2.2 integration: test_torchtitan.py."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import twofour
from twofour.errors import TrainError

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install \"twofour[torchtitan]\")")
tt = pytest.importorskip("twofour.integrations.torchtitan")
if tt.TORCHTITAN < (0, 3):
    pytest.skip("torchtitan 0.2.2 is installed: test_torchtitan.py covers it", allow_module_level=True)

from torchtitan.config.override import OverrideConfig, apply_overrides  # noqa: E402
from torchtitan.models.common.linear import Linear  # noqa: E402
from torchtitan.models.llama3 import config_registry, model_registry  # noqa: E402

from twofour.integrations.titan3 import TwoFourLinear  # noqa: E402

from .helpers import free_port  # noqa: E402

ROOT = Path(__file__).parents[1]


def configs_of(model_config, cls):
    return {fqn: cfg for fqn, cfg, _, _ in model_config.traverse(cls)}


def test_the_ffn_linears_become_2to4_and_the_model_satisfies_torchtitans_protocol():
    config = tt.with_twofour(config_registry.llama3_debugmodel(), "s-ste", decay=None, dx="pruned-t")
    model_config = config.model_spec.model
    sparse = configs_of(model_config, TwoFourLinear.Config)
    n_layers = len(model_config.layers)
    assert sorted(sparse) == sorted(f"layers.{i}.feed_forward.w{j}" for i in range(n_layers) for j in (1, 2, 3))
    assert not any("attention" in fqn for fqn in configs_of(model_config, Linear.Config) if fqn in sparse)
    recipe = next(iter(sparse.values()))._recipe
    assert recipe.name == "s-ste" and recipe.dx == "pruned-t" and recipe.total_steps == config.training.steps
    with torch.device("meta"):
        model = model_config.build()
    model.verify_module_protocol()
    layers = [m for m in model.modules() if isinstance(m, twofour.SparseLinear)]
    assert len(layers) == 3 * n_layers and all(isinstance(m, TwoFourLinear) for m in layers)


def test_bad_sections_are_one_line_errors():
    with pytest.raises(TrainError, match="no linear matches"):
        tt.with_twofour(config_registry.llama3_debugmodel(), include=["*.nothing"])
    with pytest.raises(TrainError, match="STEPAdamW"):
        tt.with_twofour(config_registry.llama3_debugmodel(), "step")
    with pytest.raises(TrainError, match="unknown recipe options"):
        tt.with_twofour(config_registry.llama3_debugmodel(), "ste", colour="blue")
    with pytest.raises(TrainError, match="give total_steps"):  # t-sr-ste's dense fine-tune needs the run's length
        apply_overrides(OverrideConfig(imports=[("twofour.integrations.titan3.sparse_ffn", {"recipe": "t-sr-ste"})]),
                        config_registry.llama3_debugmodel())


def test_float8_keeps_the_other_linears_and_the_override_takes_the_ffn_from_the_command_line():
    """With torchtitan's float8 converter applied first, the 2:4 FFN overrules it there and float8
    keeps attention; the override (what --override.imports activates) converts the same linears."""
    pytest.importorskip("torchao")
    from torchtitan.components.quantization import Float8Linear, Float8LinearConverter

    config = config_registry.llama3_debugmodel()
    config.model_spec = model_registry("debugmodel", converters=[Float8LinearConverter.Config(emulate=True)])
    model_config = tt.with_twofour(config).model_spec.model
    sparse, fp8 = configs_of(model_config, TwoFourLinear.Config), configs_of(model_config, Float8Linear.Config)
    assert sparse and fp8 and not set(sparse) & set(fp8)
    assert all("attention" in fqn or fqn == "lm_head" for fqn in fp8), sorted(fp8)

    config = config_registry.llama3_debugmodel()
    apply_overrides(OverrideConfig(imports=[("twofour.integrations.titan3.sparse_ffn", {"recipe": "sr-ste"})]), config)
    overridden = configs_of(config.model_spec.model, TwoFourLinear.Config)
    assert sorted(overridden) == sorted(sparse)
    assert {c._recipe.name for c in overridden.values()} == {"sr-ste"}


@pytest.mark.slow
def test_torchtitans_launcher_trains_resumes_exactly_and_exports(tmp_path):
    """torchtitan's launcher with the override from its command line (S-STE, MVUE off: its draws use
    torch's RNG, which torchtitan does not save): 4 steps saving at 2 and 4, the loss falling; with
    step 4's checkpoint removed the run resumes from step 2 to the same step-4 loss, bit for bit;
    the layers' step counters are in the checkpoint; it exports to the 2:4 FFN weights."""
    data = tmp_path / "data"
    subprocess.run([sys.executable, str(ROOT / "examples/torchtitan/make_data.py"), str(data), "--records", "200"],
                   check=True, timeout=120)
    override = 'twofour.integrations.titan3.sparse_ffn={"recipe": "s-ste", "mvue": false, "total_steps": 4}'
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", str(free_port()),
           str(Path(__file__).with_name("torchtitan_cpu_launcher.py")), "--module", "llama3", "--config",
           "llama3_debugmodel", "--override.imports", override,
           "--hf_assets_path", str(ROOT / "examples/torchtitan/assets/tokenizer"),
           "--dataloader.dataset_path", str(data), "--dump_folder", str(tmp_path / "out"),
           "--training.local_batch_size", "2", "--training.seq_len", "64", "--training.steps", "4",
           "--checkpoint.enable", "--checkpoint.interval", "2"]
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1"}
    losses = []
    for run in range(2):
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
        log = re.sub(r"\x1b\[[0-9;]*m", "", res.stdout + res.stderr)
        assert res.returncode == 0, log[-3000:]
        assert "twofour.integrations.titan3.sparse_ffn" in log  # the override's own log line
        steps = dict(re.findall(r"step: +(\d+) +loss: +([0-9.]+)", log))
        losses.append(steps["4"])
        if run == 0:
            assert float(steps["4"]) < float(steps["1"])
            import torch.distributed.checkpoint as dcp

            step = torch.zeros((), dtype=torch.long)
            dcp.load({"layers.1.feed_forward.w3.step": step}, checkpoint_id=str(tmp_path / "out/checkpoint/step-4"))
            assert int(step) == 4
            names = tt.export_checkpoint(tmp_path / "out/checkpoint/step-4", tmp_path / "m.safetensors")
            assert len(names) == 3 * len(config_registry.llama3_debugmodel().model_spec.model.layers)
            shutil.rmtree(tmp_path / "out/checkpoint/step-4")
        else:
            assert "1" not in steps and "Loading the checkpoint" in log
    assert losses[0] == losses[1]



@pytest.mark.slow
def test_torchtitans_compiled_blocks_train_with_2to4_ffns(tmp_path):
    """--compile.enable: torchtitan compiles each block whole (fullgraph); the masks' refresh runs
    after the optimizer step, outside the compiled blocks, so the compiled run trains past step 1."""
    data = tmp_path / "data"
    subprocess.run([sys.executable, str(ROOT / "examples/torchtitan/make_data.py"), str(data), "--records", "100"],
                   check=True, timeout=120)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", str(free_port()),
           str(Path(__file__).with_name("torchtitan_cpu_launcher.py")), "--module", "twofour.integrations.torchtitan",
           "--config", "llama3_debugmodel_twofour", "--compile.enable",
           "--hf_assets_path", str(ROOT / "examples/torchtitan/assets/tokenizer"),
           "--dataloader.dataset_path", str(data), "--dump_folder", str(tmp_path / "out"),
           "--training.local_batch_size", "2", "--training.seq_len", "64", "--training.steps", "3"]
    res = subprocess.run(cmd, capture_output=True, text=True, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
                         timeout=600, cwd=ROOT)
    log = re.sub(r"\x1b\[[0-9;]*m", "", res.stdout + res.stderr)
    assert res.returncode == 0, log[-3000:]
    steps = dict(re.findall(r"step: +(\d+) +loss: +([0-9.]+)", log))
    assert "Compiling each TransformerBlock" in log and float(steps["3"]) < float(steps["1"])


def test_torchtitans_optimizers_advance_the_masks_and_add_srstes_decay():
    """The hooks importing the integration installs, on the optimizers torchtitan builds for the model:
    SR-STE's masked decay added to the gradients before the step, every layer one step on after it."""
    config = tt.with_twofour(config_registry.llama3_debugmodel(), "sr-ste", decay=1e-2)
    with torch.device("meta"):
        model = config.model_spec.model.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    opt = config.optimizer.build(model_parts=[model])
    layers = [m for m in model.modules() if isinstance(m, TwoFourLinear)]
    before = [(m.weight.detach().clone(), m.mask.clone()) for m in layers]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for m, (w, mask) in zip(layers, before, strict=True):
        torch.testing.assert_close(m.weight.grad, 1e-2 * w * ~mask)
        assert m.step_count == 1 and int(m.step) == 1
        assert torch.equal(m.mask, m.pruner.mask(m.weight.detach()))
