"""``twofour bench``: the real loop's tokens/s on the CPU (real ``twofour train`` subprocesses on the
tiny preset), the exported pair it times, its refusal without a GPU, and its reports on a GPU."""

import pytest
import torch

from twofour.bench import exported_pair, fp8_report, inference_report, layer_report, throughput
from twofour.bench.throughput import throughput_table, train_throughput
from twofour.cli import main
from twofour.inference import SparseInferenceLinear


def cpu_args(corpus):
    return ["--device", "cpu", "--data", corpus, "--eval-iters", "1"]


@pytest.mark.slow
def test_train_throughput_end_to_end(corpus, tmp_path):
    recipes = ["dense", "s-ste"]
    rows = train_throughput(["tiny"], recipes, compile_modes=(False,), repeats=2, steps=8, batch_sizes=[2],
                            seq_len=32, workdir=tmp_path, extra_args=cpu_args(corpus), progress=False)
    assert [(r["model"], r["recipe"], r["mode"]) for r in rows] == [("tiny", "dense", "eager"),
                                                                    ("tiny", "s-ste", "eager")]
    for r in rows:
        assert r["batch_size"] == 2 and r["seq_len"] == 32 and r["compile"] is False
        assert len(r["tokens_per_s"]) == 2
        assert 0 < r["min"] <= r["median"] <= r["max"]
        assert r["vs_dense"] > 0
        assert r["vs_dense_compiled"] is None  # no compiled dense was run
    assert rows[0]["vs_dense"] == 1.0
    assert rows[1]["vs_dense"] == pytest.approx(rows[1]["median"] / rows[0]["median"])
    # every run in its own folder, its checkpoint removed, its summary kept
    runs = sorted(p.name for p in tmp_path.iterdir())
    assert len(runs) == 4 and all((tmp_path / r / "summary.json").exists() for r in runs)
    assert not list(tmp_path.glob("*/ckpt.pt"))
    table = throughput_table(rows)
    assert table.count("\n") == 1 + len(rows)
    for recipe in recipes:
        assert f"| {recipe} |" in table
    assert "| 2 x 32 |" in table and "| 1.00x | n/a |" in table


def test_train_throughput_raises_on_a_failed_run(corpus):
    with pytest.raises(RuntimeError, match="twofour train failed") as info:
        train_throughput(["tiny"], ["no-such-recipe"], compile_modes=(False,), repeats=1, steps=2,
                         batch_sizes=[2], seq_len=32, extra_args=cpu_args(corpus), progress=False)
    msg = str(info.value)
    assert "exit status 2" in msg and "--recipe no-such-recipe" in msg
    assert "unknown recipe 'no-such-recipe'" in msg.splitlines()[-1]  # the run's own stderr


def test_train_throughput_compile_modes_and_the_fastest_dense(monkeypatch):
    """A string mode runs ``--compile --compile-mode`` it; the ratio to compiled dense is to the
    fastest compiled dense over the modes run (the fastest dense a user can run)."""
    speed = {("dense", "eager"): 100.0, ("dense", "default"): 200.0, ("dense", "reduce-overhead"): 250.0,
             ("s-ste", "eager"): 110.0, ("s-ste", "default"): 190.0, ("s-ste", "reduce-overhead"): 240.0}
    cmds = []

    def fake_run(cmd, out):
        cmds.append(cmd)
        mode = cmd[cmd.index("--compile-mode") + 1] if "--compile-mode" in cmd else \
            "default" if "--compile" in cmd else "eager"
        return speed[(cmd[cmd.index("--recipe") + 1], mode)]

    monkeypatch.setattr(throughput, "_train_once", fake_run)
    rows = train_throughput(["tiny"], ["dense", "s-ste"], compile_modes=(False, True, "reduce-overhead"), repeats=1,
                            steps=2, batch_sizes=[2], progress=False)
    assert [r["mode"] for r in rows[:3]] == ["eager", "compiled", "compiled (reduce-overhead)"]
    assert sum("--compile-mode" in c for c in cmds) == 2 and sum("--compile" in c for c in cmds) == 4
    by = {(r["recipe"], r["mode"]): r for r in rows}
    assert by[("s-ste", "compiled")]["vs_dense"] == pytest.approx(190 / 200)
    assert by[("s-ste", "compiled (reduce-overhead)")]["vs_dense_compiled"] == pytest.approx(240 / 250)
    assert by[("dense", "compiled")]["vs_dense_compiled"] == pytest.approx(200 / 250)
    assert by[("s-ste", "eager")]["vs_dense_compiled"] == pytest.approx(110 / 250)


def test_train_throughput_checks_its_arguments():
    with pytest.raises(ValueError, match="one per model"):
        train_throughput(["tiny", "gpt2-124m"], ["dense"], batch_sizes=[2])


def test_throughput_table_ratios():
    rows = [{"model": "m", "batch_size": 4, "seq_len": 8, "recipe": r, "mode": mode, "median": med, "min": lo,
             "max": hi, "vs_dense": vs, "vs_dense_compiled": vc}
            for r, mode, med, lo, hi, vs, vc in [("dense", "eager", 1000, 900, 1100, 1.0, 0.5),
                                                 ("dense", "compiled", 2000, 1900, 2100, 1.0, 1.0),
                                                 ("s-ste", "compiled", 2500, 2400, 2600, 1.25, 1.25)]]
    table = throughput_table(rows).splitlines()
    assert table[0].startswith("| model | micro-batch x seq | recipe | mode | tokens/s median (min-max) |")
    assert table[2] == "| m | 4 x 8 | dense | eager | 1,000 (900-1,100) | 1.00x | 0.50x |"
    assert table[4] == "| m | 4 x 8 | s-ste | compiled | 2,500 (2,400-2,600) | 1.25x | 1.25x |"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
@pytest.mark.parametrize("what", [[], ["--quick"], ["--fp8"], ["--inference"]])
def test_bench_needs_a_gpu(what, capsys):
    assert main(["bench", *what]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("twofour bench: error: twofour bench") and "needs a CUDA GPU" in err
    assert ("--fp8" in err, "--inference" in err) == ("--fp8" in what, "--inference" in what)


def test_exported_pair_is_one_model_twice(tmp_path):
    """The 2:4 export and its dense twin hold the same weights: the same logits."""
    sparse, dense, cfg = exported_pair("tiny", tmp_path, vocab_size=256, context=64, device="cpu")
    assert cfg["sparse_layers"] == [f"h.{i}.mlp.{n}" for i in range(4) for n in ("fc", "proj")]
    assert sum(isinstance(m, SparseInferenceLinear) for m in sparse.modules()) == 8
    assert not any(isinstance(m, SparseInferenceLinear) for m in dense.modules())
    idx = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(sparse(idx)[0].float(), dense(idx)[0].float(), atol=2e-2, rtol=2e-2)


def _gpu_rows(lines) -> list[str]:
    rows = [line for line in lines if line.startswith("| ") and not line.startswith(("| shape", "| block", "| phase"))]
    assert rows and not [r for r in rows if "error" in r], rows
    return rows


@pytest.mark.gpu
def test_gpu_layer_report_rows():
    rows = _gpu_rows(layer_report(True, shapes=[("small", 256, 1024, 2048)], swiglu=["llama-tiny"]))
    assert [r.split(" | ")[0] for r in rows] == ["| small", "| small", "| small GELU", "| llama-tiny SwiGLU"]
    assert all(r.count("x |") == (4 if i < 2 else 2) for i, r in enumerate(rows))


@pytest.mark.gpu
def test_gpu_fp8_report_rows():
    from twofour.fp8 import scaled_mm_available  # noqa: PLC0415

    if not scaled_mm_available():
        pytest.skip("needs torch._scaled_mm")
    rows = _gpu_rows(fp8_report(True, shapes=[("small", 2048, 256, 512)]))
    assert len(rows) == 8 and "| s-ste FP8 rowwise |" in rows[-1] and rows[-1].endswith("x |")


@pytest.mark.gpu
def test_gpu_inference_report_rows():
    rows = _gpu_rows(inference_report(False, "tiny", vocab_size=256, context=128, prefill_batches=(1,),
                                      decode_batches=(1, 8), prompt_len=16, decode_steps=16))
    assert [r.split(" | ")[:2] for r in rows] == [["| prefill", "1"], ["| decode", "1"], ["| decode", "8"]]


@pytest.mark.gpu
def test_gpu_inference_report_of_a_llama_with_fewer_blocks():
    """``--model llama-... --layers N``: Llama's vocabulary by default, the blocks built said in the report."""
    lines = list(inference_report(False, "llama-tiny", context=128, prefill_batches=(1,), decode_batches=(1, 16),
                                  prompt_len=16, decode_steps=16, n_layer=2))
    assert lines[0].startswith("llama-tiny, 2 of its 4 blocks (--layers), vocabulary 32000")
    assert [r.split(" | ")[:2] for r in _gpu_rows(lines)] == [["| prefill", "1"], ["| decode", "1"],
                                                              ["| decode", "16"]]


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["2:4", "dense twin"])
@torch.no_grad()
def test_gpu_graph_decoding_gives_the_eager_tokens(which, tmp_path):
    """Decoding as ``twofour bench --inference`` times it, one captured step replayed against the
    static KV cache, gives the tokens eager decoding gives."""
    model = exported_pair("tiny", tmp_path, vocab_size=256, context=128)[0 if which == "2:4" else 1]
    prompt = torch.randint(0, 256, (8, 16), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    cache = model.make_cache(8, 32)
    tok = torch.zeros(8, 1, dtype=torch.long, device="cuda")

    def step() -> None:
        tok.copy_(model(tok, cache=cache)[0][:, -1:].argmax(-1))

    def decode(run_step) -> list[torch.Tensor]:
        cache.reset()
        tok.copy_(model(prompt, cache=cache)[0][:, -1:].argmax(-1))
        tokens = []
        for _ in range(8):
            run_step()
            tokens.append(tok.clone())
        return tokens

    eager = decode(step)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    assert all(torch.equal(a, b) for a, b in zip(eager, decode(graph.replay)))


@pytest.mark.parametrize("bad", [["--model", "gpt5"], ["--layers", "0"]])
def test_bench_inference_refuses_an_unknown_preset_or_no_layers(bad, capsys):
    assert main(["bench", "--inference", *bad]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--model must be one of" in err


def test_exported_pair_takes_fewer_layers(tmp_path):
    """``twofour bench --inference --layers N``: the preset built with N blocks."""
    sparse, _, cfg = exported_pair("llama-tiny", tmp_path, vocab_size=128, context=32, device="cpu", n_layer=1)
    assert cfg["model"]["n_layer"] == 1 and cfg["architecture"] == "Llama"
    assert cfg["sparse_layers"] == ["h.0.mlp.gate_up", "h.0.mlp.down"]
