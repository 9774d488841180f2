"""Spreading a run over processes: the FSDP2 policies and their options, activation
checkpointing, and the sparse layers' masks under FSDP2 (one CPU process over gloo)."""

import contextlib
import os

import pytest
import torch
import torch.distributed as dist

import twofour
from twofour.cli import build_parser
from twofour.errors import TrainError
from twofour.models import build_model
from twofour.sparse import sparse_layers
from twofour.training import TrainConfig
from twofour.training.parallel import DEFAULT_FSDP, FSDP_POLICIES, checkpoint_blocks, fsdp_policy, grad_norm, shard

from .helpers import free_port


def _train_args(*extra):
    return build_parser().parse_args(["train", *extra])


def test_fsdp_takes_a_policy_by_name():
    assert _train_args().fsdp is None
    assert _train_args("--fsdp").fsdp == DEFAULT_FSDP
    assert _train_args("--fsdp", "fp32").fsdp == "fp32"
    assert _train_args("--fsdp", "--no-fsdp").fsdp is None
    with pytest.raises(SystemExit):
        _train_args("--fsdp", "fp64")
    with pytest.raises(TrainError, match="unknown --fsdp policy 'fp64'"):
        TrainConfig(fsdp="fp64").validate()
    with pytest.raises(TrainError, match="unknown FSDP policy"):
        fsdp_policy("fp64")
    assert fsdp_policy("bf16").param_dtype == torch.bfloat16 and fsdp_policy("fp32").param_dtype is None
    assert set(FSDP_POLICIES) >= {"bf16", "bf16-keep", "fp32", "bf16-flat"}


def test_an_old_config_with_fsdp_on_reads_as_the_fp32_policy():
    """``fsdp`` was a switch; on meant float32 weights gathered, which the fp32 policy keeps."""
    saved = TrainConfig().to_dict()
    assert TrainConfig.from_dict({**saved, "fsdp": True}).fsdp == "fp32"
    assert TrainConfig.from_dict({**saved, "fsdp": False}).fsdp is None
    assert TrainConfig.from_dict({**saved, "fsdp": "bf16-keep"}).fsdp == "bf16-keep"


def test_n_layer_sets_the_number_of_blocks():
    assert len(build_model("llama-tiny", "s-ste", vocab_size=64, block_size=32, n_layer=2).h) == 2
    assert _train_args("--n-layer", "3").n_layer == 3
    with pytest.raises(TrainError, match="--n-layer must be a positive integer"):
        TrainConfig(n_layer=0).validate()


def test_activation_checkpointing_gives_the_same_loss_and_gradients():
    def run(ckpt: bool):
        torch.manual_seed(0)
        m = build_model("tiny", "s-ste", vocab_size=64, block_size=32)
        if ckpt:
            checkpoint_blocks(m)
        x = torch.randint(0, 64, (2, 33), generator=torch.Generator().manual_seed(1))
        loss = m(x[:, :-1], x[:, 1:])[1]
        loss.backward()
        return loss.detach(), {n.replace("._checkpoint_wrapped_module", ""): p.grad for n, p in m.named_parameters()}

    loss, grads = run(False)
    loss_ck, grads_ck = run(True)
    assert torch.equal(loss, loss_ck) and grads.keys() == grads_ck.keys()
    for name, g in grads.items():
        torch.testing.assert_close(grads_ck[name], g, msg=name)
    layers = [m for _, m in sparse_layers(checkpoint_blocks(build_model("tiny", "s-ste", vocab_size=64,
                                                                        block_size=32)))]
    assert layers and not any(m.compressed.keep for m in layers)  # their compressed weight: never kept


@contextlib.contextmanager
def _one_process_group():
    """A process group of this process alone (gloo), for FSDP2 on the CPU."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.mark.parametrize(("policy", "recipe", "steps", "compiled"), [
    ("fp32", "ste", 3, False), ("bf16", "ste", 3, False), ("bf16", "t-sr-ste", 4, False), ("bf16", "ste", 3, True)])
def test_fsdp2_masks_follow_the_weights_they_multiply(policy, recipe, steps, compiled):
    """Under FSDP2 a sharded layer's mask is refreshed where its weight is gathered: after each
    optimizer step the mask a state dict holds, and the one the next forward uses, is the
    recipe's mask of the weight (in the policy's gathered dtype), and the flips are counted, also
    for a mask refreshed every other step (read by the loop after the next step), and also in
    blocks checkpointed and compiled whole (``fullgraph``), as torchtitan shards them."""
    pytest.importorskip("torch.distributed.fsdp")
    with _one_process_group():
        torch.manual_seed(0)
        options = {"mask_interval": 2} if recipe == "t-sr-ste" else {}
        model = build_model("tiny", twofour.make_recipe(recipe, **options), vocab_size=64, block_size=32)
        if compiled:
            checkpoint_blocks(model)
            for i, block in enumerate(model.h):
                model.h[i] = torch.compile(block, fullgraph=True, backend="aot_eager")
        shard(model, fsdp_policy(policy))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
        twofour.attach(model, opt)
        x = torch.randint(0, 64, (4, 33), generator=torch.Generator().manual_seed(2))
        flips = 0
        for _ in range(steps):
            model(x[:, :-1], x[:, 1:])[1].backward()
            opt.step()
            opt.zero_grad()
            layers = [layer for _, layer in sparse_layers(model)]
            flips += sum(int(layer.flips) for layer in layers)
        sd = model.state_dict()  # settles the refresh the last step left for the next forward
        dt = fsdp_policy(policy).param_dtype or torch.float32
        for name, layer in sparse_layers(model):
            name = name.replace("._checkpoint_wrapped_module", "")  # as the wrapper's state dict names it
            w = sd[name + ".weight"]
            w = (w.full_tensor() if hasattr(w, "full_tensor") else w).to(dt)
            assert torch.equal(sd[name + ".mask"], layer.pruner.mask(w)), name
        assert flips > 0  # the large learning rate moves weights across the threshold


@pytest.mark.parametrize("policy", ["bf16", "bf16-flat"])
def test_fsdp2_gradient_norm_and_clip_match_torchs(policy):
    """grad_norm's sharded path gives clip_grad_norm_'s norm and clipped gradients."""
    with _one_process_group():
        torch.manual_seed(0)
        model = build_model("tiny", "s-ste", vocab_size=64, block_size=32)
        shard(model, fsdp_policy(policy))
        x = torch.randint(0, 64, (4, 33), generator=torch.Generator().manual_seed(2))
        model(x[:, :-1], x[:, 1:])[1].backward()
        grads = [p.grad for p in model.parameters()]
        want = torch.nn.utils.get_total_norm(grads).full_tensor()
        torch.testing.assert_close(grad_norm(model, 0.0), want)
        before = [g.full_tensor().clone() for g in grads]
        torch.testing.assert_close(grad_norm(model, 0.5), want)  # the norm before clipping, as torch returns
        scale = 0.5 / (want + 1e-6)
        for g, b in zip(grads, before):
            torch.testing.assert_close(g.full_tensor(), b * scale)
        torch.testing.assert_close(grad_norm(model, 0.0), torch.tensor(0.5), atol=1e-5, rtol=1e-4)


def _settle_worker(rank: int, world: int, port: int, folder: str) -> None:
    """One of ``world`` gloo processes: two FSDP2-sharded layers (rows split unevenly, one rank with
    no rows of the second), a step's refresh settled from each rank's rows; what it finds goes to
    ``folder``/RANK."""
    import sys  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    from twofour.functional import mask_24  # noqa: PLC0415

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(twofour.SparseLinear(64, 100, recipe="ste"),
                                twofour.SparseLinear(64, 2, recipe="s-ste"))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    old = [layer.mask.clone() for layer in model]
    with torch.no_grad():
        for layer in model:  # every rank moves its own rows, as an optimizer step would
            local = layer.weight.to_local()
            local.add_(torch.randn(local.shape, generator=torch.Generator().manual_seed(rank)))
    twofour.advance(model)
    found = []
    for layer, before in zip(model, old, strict=True):
        assert layer.deferred.pending
        layer.settle()
        want = mask_24(layer.weight.detach().full_tensor())
        found.append(f"{torch.equal(layer.mask, want)} {int(layer.flips) == int((want != before).sum()) > 0}")
    Path(folder, str(rank)).write_text(" ".join(found))
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown with gloo's threads alive (see test_sharded_checkpoint)


@pytest.mark.slow
def test_a_sharded_refresh_settles_from_each_ranks_rows(tmp_path):
    """FSDP2 over 3 CPU processes: a refresh settled (a checkpoint's, torchtitan's after each step)
    computes each rank's rows of the mask and gathers them: every rank holds the mask of the whole
    weight and the flips of the whole layer, with rows split unevenly and a rank holding none."""
    import torch.multiprocessing as mp  # noqa: PLC0415

    seen = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        mp.start_processes(_settle_worker, args=(3, free_port(), str(tmp_path)), nprocs=3, start_method="spawn")
    finally:
        if seen is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = seen
    assert [(tmp_path / str(r)).read_text() for r in range(3)] == ["True True True True"] * 3
