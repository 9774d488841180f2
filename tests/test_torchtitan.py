"""twofour's torchtitan 0.2.2 converter (twofour.integrations.titan2) on torchtitan's Llama 3 debug
model, on the CPU (torchtitan 0.3: test_torchtitan3.py).

torchtitan's trainer picks CUDA unconditionally, so these tests drive its pieces the way its
trainer does (config parsing with the custom config module, the model on the meta device, the
converters, ``to_empty`` + ``init_weights``, its optimizers container with the post-step hook, its
checkpoint's ``ModelWrapper`` through torch.distributed.checkpoint). The GPU run:
benchmarks/step/torchtitan_run.sh.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import twofour
from twofour.errors import TrainError

titan = pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install \"twofour[torchtitan]\")")
if tuple(int(x) for x in titan.__version__.split(".")[:2]) >= (0, 3):
    pytest.skip("torchtitan 0.3 is installed: test_torchtitan3.py covers it", allow_module_level=True)

from torchtitan.components.checkpoint import ModelWrapper  # noqa: E402
from torchtitan.components.optimizer import build_optimizers  # noqa: E402
from torchtitan.components.quantization.utils import module_filter_fn  # noqa: E402
from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.distributed import ParallelDims  # noqa: E402
from torchtitan.models.llama3 import Transformer, llama3_args  # noqa: E402
from torchtitan.protocols.model_converter import build_model_converters  # noqa: E402

from twofour.integrations import torchtitan as tt  # noqa: E402

MODULE = "twofour.integrations.torchtitan"
FFN = ("w1", "w2", "w3")


def job(*args: str):
    """A torchtitan JobConfig parsed as its launcher does, with the twofour section merged in."""
    return ConfigManager().parse_args([f"--job.custom_config_module={MODULE}", "--training.steps=10", *args])


def dims() -> ParallelDims:
    return ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)


def build(jc, seed: int = 0, mesh=None):
    """The debug model as torchtitan's trainer builds it: meta device, converters, (FSDP2 over
    ``mesh``), to_empty, init_weights."""
    args = llama3_args["debugmodel"]
    args.update_from_config(jc)
    with torch.device("meta"):
        model = Transformer(args)
    converters = build_model_converters(jc, dims())
    converters.convert(model)
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard

        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights()
    return model, converters


def ffn_layers(model):
    return [model.layers[str(i)].feed_forward for i in range(len(model.layers))]


def train_steps(model, converters, jc, n: int, seed: int = 1):
    """``n`` steps of forward/backward/clip/step with torchtitan's optimizers and post-step hook."""
    opt = build_optimizers([model], jc.optimizer, dims())
    opt.register_step_post_hook(lambda *a, **k: converters.post_optimizer_hook([model]))
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        tokens = torch.randint(0, model.vocab_size, (2, 33), generator=gen)
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return opt


def test_converter_makes_the_ffn_linears_2to4_with_the_recipe():
    jc = job("--model.converters=twofour", "--twofour.recipe=sr-ste", "--twofour.decay=1e-4")
    model, converters = build(jc)
    for ffn in ffn_layers(model):
        for name in FFN:
            layer = getattr(ffn, name)
            assert isinstance(layer, twofour.SparseLinear)
            assert layer.recipe.name == "sr-ste" and layer.recipe.decay == 1e-4 and layer.recipe.total_steps == 10
            # the buffers were recomputed after init_weights: the mask of the initialised weight
            assert torch.equal(layer.mask, layer.pruner.mask(layer.weight.detach()))
            assert int(layer.step) == 0
    attn = model.layers["0"].attention
    assert type(attn.wq) is nn.Linear and type(model.output) is nn.Linear
    converters.converters[0].close()


def test_attention_by_pattern_and_fp8_precision():
    jc = job("--model.converters=twofour", "--twofour.precision=fp8",
             "--twofour.include=" + ",".join(tt.FFN_LINEARS + tt.ATTENTION_LINEARS))
    model, _ = build(jc)
    attn = model.layers["0"].attention
    assert all(isinstance(getattr(attn, n), twofour.SparseLinear) for n in ("wq", "wk", "wv", "wo"))
    assert attn.wq.recipe.name == twofour.DEFAULT_RECIPE and attn.wq.recipe.precision.fp8  # the default recipe


def test_float8_listed_after_twofour_skips_the_sparse_layers():
    jc = job("--model.converters=twofour,float8")
    args = llama3_args["debugmodel"]
    args.update_from_config(jc)
    with torch.device("meta"):
        model = Transformer(args)
    tt.TwoFourConverter(jc, dims()).convert(model)  # float8's own converter needs torchao and an SM89 GPU
    skip = jc.quantize.linear.float8.filter_fqns
    for i, ffn in enumerate(ffn_layers(model)):
        for name in FFN:
            assert not module_filter_fn(getattr(ffn, name), f"layers.{i}.feed_forward.{name}", skip)
    assert module_filter_fn(model.layers["0"].attention.wq, "layers.0.attention.wq", skip)


@pytest.mark.parametrize("bad, message", [
    (["--model.converters=float8,twofour"], "list 'twofour' first"),
    (["--model.converters=twofour", "--twofour.recipe=step"], "STEPAdamW"),
    (["--model.converters=twofour", "--twofour.recipe=dense", "--twofour.decay=0.1"], "takes no option decay"),
])
def test_refusals_are_one_line(bad, message):
    with pytest.raises(TrainError, match=message) as e:
        tt.TwoFourConverter(job(*bad), dims())
    assert "\n" not in str(e.value)


def test_post_optimizer_hook_advances_the_masks_and_sr_ste_decays_once_a_step():
    jc = job("--model.converters=twofour", "--twofour.recipe=sr-ste")
    model, converters = build(jc)
    layer = model.layers["0"].feed_forward.w1
    w0 = layer.weight.detach().clone()
    opt = train_steps(model, converters, jc, 3)
    assert int(layer.step) == 3 and layer.step_count == 3
    assert not torch.equal(layer.weight, w0)
    assert torch.equal(layer.mask, layer.pruner.mask(layer.weight.detach()))  # refreshed after the last step
    # the masked decay: added to the gradient right before the container's step, once
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    seen = {}
    inner = opt.optimizers[0]

    def look(optimizer, args, kwargs):
        seen["g"] = layer.weight.grad.clone()

    handle = inner.register_step_pre_hook(look)
    mask, w = layer.mask.clone(), layer.weight.detach().clone()
    opt.step()
    handle.remove()
    expected = layer.recipe.decay * w.masked_fill(mask, 0)
    torch.testing.assert_close(seen["g"], expected)
    converters.converters[0].close()


def test_checkpoint_round_trip_restores_masks_scales_and_steps(tmp_path):
    import torch.distributed.checkpoint as dcp

    jc = job("--model.converters=twofour", "--twofour.recipe=s-ste")
    model, converters = build(jc, seed=0)
    train_steps(model, converters, jc, 2)
    saved = ModelWrapper(model)
    keys = saved.state_dict().keys()
    assert {"layers.0.feed_forward.w1.mask", "layers.0.feed_forward.w1.beta", "layers.0.feed_forward.w1.step"} <= keys
    dcp.save({"model": saved}, checkpoint_id=str(tmp_path / "step-2"))

    fresh, _ = build(jc, seed=123)
    dcp.load({"model": ModelWrapper(fresh)}, checkpoint_id=str(tmp_path / "step-2"))
    for a, b in zip(ffn_layers(model), ffn_layers(fresh)):
        for name in FFN:
            la, lb = getattr(a, name), getattr(b, name)
            for buf in ("mask", "beta", "step", "weight"):
                assert torch.equal(getattr(la, buf), getattr(lb, buf)), (name, buf)
            assert lb.step_count == 2
    tokens = torch.randint(0, model.vocab_size, (1, 16))
    torch.testing.assert_close(fresh(tokens), model(tokens), rtol=0, atol=0)


def test_a_compiled_block_has_no_graph_break():
    """torchtitan compiles each block with fullgraph=True: the 2:4 FFN must trace in one graph."""
    jc = job("--model.converters=twofour")
    model, _ = build(jc)
    block = model.layers["0"]
    compiled = torch.compile(block, fullgraph=True, backend="eager")
    x = torch.randn(1, 16, 256, requires_grad=True)
    freqs = model.freqs_cis[:16]
    torch.testing.assert_close(compiled(x, freqs, None), block(x, freqs, None))
    compiled(x, freqs, None).sum().backward()
    assert x.grad is not None


@pytest.mark.parametrize("toml", sorted((Path(__file__).parents[1] / "examples" / "torchtitan").glob("*.toml")),
                         ids=lambda p: p.name)
def test_example_configs_parse_and_convert(toml):
    """Each example job config parses in torchtitan's launcher and its model converts (on meta)."""
    jc = ConfigManager().parse_args([f"--job.config_file={toml}"])
    assert jc.model.converters[0] == tt.NAME and jc.job.custom_config_module == MODULE
    args = llama3_args[jc.model.flavor]
    args.update_from_config(jc)
    with torch.device("meta"):
        model = Transformer(args)
    build_model_converters(jc, dims()).convert(model)
    w1 = model.layers["0"].feed_forward.w1
    assert isinstance(w1, twofour.SparseLinear) and w1.recipe.name == jc.twofour.recipe


def test_flavors_have_the_llama3_shapes():
    for flavor, (hidden, dim) in {"1B": (8192, 2048), "8B_4layers": (14336, 4096), "8B": (14336, 4096)}.items():
        with torch.device("meta"):
            model = Transformer(llama3_args[flavor])
        assert model.layers["0"].feed_forward.w1.weight.shape == (hidden, dim), flavor


def fsdp_worker(folder: str) -> None:
    """One of 2 gloo processes: FSDP2 as torchtitan applies it, 3 SR-STE steps, a DCP save and a load
    into a fresh sharded model (run by the test below through torch.distributed.run)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    jc = job("--model.converters=twofour", "--twofour.recipe=sr-ste")
    model, converters = build(jc, seed=dist.get_rank(), mesh=mesh)  # each rank inits its own shard
    layers = [getattr(f, n) for f in ffn_layers(model) for n in FFN]
    for layer in layers:  # the masks of the whole (gathered) initial weight
        assert torch.equal(layer.mask, layer.pruner.mask(layer.weight.detach().full_tensor()))
    train_steps(model, converters, jc, 3)
    for layer in layers:  # the last step's refresh waits for the next forward's gathered weight; settle() applies it
        layer.settle()
        assert int(layer.step) == 3 and torch.equal(layer.mask, layer.pruner.mask(layer.weight.detach().full_tensor()))
        masks = [torch.empty_like(layer.mask) for _ in range(dist.get_world_size())]
        dist.all_gather(masks, layer.mask.contiguous())
        assert all(torch.equal(m, masks[0]) for m in masks)  # every rank holds the same mask
    dcp.save({"model": ModelWrapper(model)}, checkpoint_id=folder)
    fresh, _ = build(jc, seed=100 + dist.get_rank(), mesh=mesh)
    dcp.load({"model": ModelWrapper(fresh)}, checkpoint_id=folder)
    for a, b in zip(layers, [getattr(f, n) for f in ffn_layers(fresh) for n in FFN]):
        assert torch.equal(a.mask, b.mask) and torch.equal(a.step, b.step) and b.step_count == 3
        assert torch.equal(a.weight.detach().full_tensor(), b.weight.detach().full_tensor())
    converters.converters[0].close()
    if dist.get_rank() == 0:
        print("FSDP2 OK")
    dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_two_processes_advance_identical_masks_and_resume(tmp_path):
    """torchtitan's FSDP2 on 2 CPU processes: masks from the gathered weights after init and after
    each step (with SR-STE's decay on the sharded gradients), equal on both ranks, and a DCP round trip."""
    from .helpers import free_port  # noqa: PLC0415 - this file also runs as torchrun's script

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           __file__, str(tmp_path / "ckpt")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0 and "FSDP2 OK" in res.stdout, res.stderr[-3000:]


@pytest.mark.slow
def test_torchtitans_launcher_trains_resumes_exactly_and_exports(tmp_path):
    """The debug example through torchtitan's launcher on the CPU: 4 steps saving at steps 2 and 4;
    with step 4's checkpoint removed, the same job resumes from step 2 (masks, scales, step counters
    from torchtitan's checkpoint) to the same step-4 loss, bit for bit; the checkpoint exports to 18
    2:4 FFN weights. (MVUE off: its random draws come from torch's RNG, which torchtitan does not save.)"""
    from .helpers import free_port  # noqa: PLC0415 - this file also runs as torchrun's script

    root = Path(__file__).parents[1]
    data = tmp_path / "data"
    subprocess.run([sys.executable, str(root / "examples/torchtitan/make_data.py"), str(data), "--records", "200"],
                   check=True, timeout=120)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", str(free_port()),
           str(Path(__file__).with_name("torchtitan_cpu_launcher.py")),
           "--job.config_file", str(root / "examples/torchtitan/debug_model.toml"),
           "--model.hf_assets_path", str(root / "examples/torchtitan/assets/tokenizer"),
           "--training.dataset_path", str(data), "--job.dump_folder", str(tmp_path / "out"),
           "--training.local_batch_size", "2", "--training.seq_len", "64", "--training.steps", "4",
           "--checkpoint.enable", "--checkpoint.interval", "2", "--twofour.mvue", "False"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    losses = []
    for run in range(2):
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=root)
        log = re.sub(r"\x1b\[[0-9;]*m", "", res.stdout + res.stderr)
        assert res.returncode == 0, log[-3000:]
        assert "sparsify(s-ste): 18 layers converted" in log
        losses.append(re.search(r"step:  4  loss: *([0-9.]+)", log).group(1))
        if run == 0:
            assert "step:  1 " in log
            import torch.distributed.checkpoint as dcp

            step = torch.zeros((), dtype=torch.long)
            dcp.load({"layers.5.feed_forward.w3.step": step}, checkpoint_id=str(tmp_path / "out/checkpoint/step-4"))
            assert int(step) == 4
            n = tt.export_checkpoint(tmp_path / "out/checkpoint/step-4", tmp_path / "m.safetensors")
            assert len(n) == 18
            shutil.rmtree(tmp_path / "out/checkpoint/step-4")
        else:
            assert "step:  1 " not in log and "Loading the checkpoint" in log
    assert losses[0] == losses[1]



if __name__ == "__main__":
    import gc

    fsdp_worker(sys.argv[1])
    # the sharded models' cycles hold gloo's process group: free it now, not in the interpreter's
    # final collection, where gloo's worker threads abort the process waiting for the GIL
    gc.collect()


def test_export_gives_a_plain_llama3_the_2to4_weights(tmp_path):
    """A checkpoint in torchtitan's layout (model keys flat beside the other states) -> safetensors
    that torchtitan's plain Llama 3 loads strictly, computing what the sparse model computed, and whose
    FFN weights twofour.sparsify_for_inference takes as 2:4."""
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open
    from safetensors.torch import load_file

    jc = job("--model.converters=twofour", "--twofour.recipe=s-ste")
    model, converters = build(jc)
    train_steps(model, converters, jc, 2)
    dcp.save({**ModelWrapper(model).state_dict(), "train_state": {"step": torch.tensor(2)}},
             checkpoint_id=str(tmp_path / "step-2"))
    out = tmp_path / "model.safetensors"
    names = tt.export_checkpoint(tmp_path / "step-2", out)
    assert names == sorted(f"layers.{i}.feed_forward.{n}" for i in range(len(model.layers)) for n in FFN)
    with safe_open(str(out), "pt") as f:
        assert f.metadata()["twofour_sparse_layers"].split(",") == names

    plain = Transformer(llama3_args["debugmodel"])
    missing, unexpected = plain.load_state_dict(load_file(str(out)), strict=False)
    assert not unexpected and set(missing) <= {"freqs_cis"}
    tokens = torch.randint(0, model.vocab_size, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(plain(tokens), model(tokens), rtol=1e-5, atol=1e-5)
    twofour.sparsify_for_inference(plain, layers=names)
    assert isinstance(plain.layers["0"].feed_forward.w1, twofour.SparseInferenceLinear)


def test_export_refuses_a_checkpoint_without_2to4_layers(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"w.weight": torch.ones(4, 4)}, checkpoint_id=str(tmp_path / "c"))
    with pytest.raises(TrainError, match="no 2:4 layer"):
        tt.export_checkpoint(tmp_path / "c", tmp_path / "x.safetensors")
