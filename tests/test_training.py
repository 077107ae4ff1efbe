"""The training step at cluster scale, on CPU: gradient accumulation equals the big batch,
activation checkpointing and compiled blocks change nothing but speed/memory, FSDP2 keeps the
optimiser state, the EMA and the exported weights in float32."""

import warnings

import pytest
import torch

from mdc.config import ConfigError, OptimConfig, dump_config, load_config
from mdc.models.captioner import Captioner
from mdc.objectives.autoregressive import ArObjective
from mdc.objectives.masked import BertObjective, MdcObjective
from mdc.registry import compute_loss
from mdc.training import fsdp
from mdc.training.checkpoint import full_weights
from mdc.training.fsdp import apply_fsdp, compile_available, prepare_model, transformer_blocks
from mdc.training.step import EMA, build_optimizer, build_scheduler, train_step

MAX_LENGTH = 8


pytestmark = pytest.mark.usefixtures("gloo_process_group")  # FSDP2 and its gradient-sync switch need one


VOCAB = 64  # ids 60-63 are BOS, EOS, [MASK], pad: a small vocabulary keeps the test fast


def tiny_model(seed=0) -> Captioner:
    torch.manual_seed(seed)
    return Captioner(
        "tiny",
        vocab_size=VOCAB,
        bos_id=60,
        eos_id=61,
        mask_id=62,
        pad_id=63,
        max_length=MAX_LENGTH,
        image_size=32,
        decoder_layers=2,
    )


def batch(n: int, seed: int = 1):
    """Captions with no padding, so every micro-batch has as many tokens as every other."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 60, (n, MAX_LENGTH), generator=g)


def dense(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def optimiser_for(model, sgd=False):
    """AdamW as training uses it; SGD where parameters after a step must show the gradient itself
    (Adam's first step is lr·sign(g), which turns float rounding of near-zero gradients into lr)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5) if sgd else build_optimizer(model, OptimConfig(lr=1e-3))
    return optimizer, build_scheduler(optimizer, 0, 100)


@pytest.mark.parametrize("objective", [BertObjective(mask_ratio=1.0), ArObjective()])
@pytest.mark.parametrize("fsdp", [False, True])
def test_two_micro_batches_of_8_step_like_one_batch_of_16(objective, fsdp):
    """Objectives without noise (BERT masking every token, AR), so both see the same draws."""
    images, tokens = batch(16)
    models = [tiny_model(), tiny_model()]
    initial = {n: p.detach().clone() for n, p in models[0].named_parameters()}
    if fsdp:
        for model in models:
            apply_fsdp(model, bf16=False)
    results = []
    for model, micro in zip(models, (1, 2)):
        optimizer, scheduler = optimiser_for(model, sgd=True)
        results.append(train_step(model, optimizer, scheduler, images, tokens, objective, 1.0, micro_batches=micro))
    assert results[0]["loss"] == pytest.approx(results[1]["loss"], rel=1e-6)
    assert results[0]["grad_norm"] == pytest.approx(results[1]["grad_norm"], rel=1e-5)
    for (name, big), (_, accumulated) in zip(models[0].named_parameters(), models[1].named_parameters()):
        torch.testing.assert_close(dense(accumulated), dense(big), rtol=1e-5, atol=1e-6, msg=name)
    moved = [not torch.equal(dense(p), initial[n]) for n, p in models[0].named_parameters()]
    assert sum(moved) > 0.9 * len(moved)  # the step did something to compare


def test_a_batch_that_does_not_split_is_refused():
    model = tiny_model()
    optimizer, scheduler = optimiser_for(model)
    with pytest.raises(ValueError, match="12 does not split into 8"):
        train_step(model, optimizer, scheduler, *batch(12), MdcObjective(), 1.0, micro_batches=8)


def test_a_global_batch_is_whole_micro_batches_and_any_group_size_keeps_it():
    """The optimiser's batch is a multiple of batch_size and nothing else: any number of workers
    (a fixed 3, or whatever Ray picks in an elastic range, e.g. 15 of [8, 16]) is dealt its
    micro-batches (pipelines/data/deal.py)."""
    cfg = load_config(None, ["train.batch_size=8", "workers.count=2", "train.global_batch_size=64"])
    assert cfg.micro_batches_per_step == 8
    assert load_config(None, ["train.batch_size=8", "workers.count=2"]).global_batch == 16  # × the most
    assert load_config(None, ["train.batch_size=8", "workers.count=3", "train.global_batch_size=32"])
    elastic = load_config(None, ["train.batch_size=128", "train.global_batch_size=2048", "workers.count=[8,16]"])
    assert elastic.micro_batches_per_step == 16 and elastic.workers.elastic
    with pytest.raises(ConfigError, match=r"train.global_batch_size 60 is not a multiple of train.batch_size 8"):
        load_config(None, ["train.batch_size=8", "workers.count=2", "train.global_batch_size=60"])


def test_an_elastic_range_is_a_list_in_yaml_and_must_be_ordered(tmp_path):
    cfg = load_config(None, ["train.batch_size=4", "workers.count=[1,4]", "train.global_batch_size=48"])
    assert cfg.workers.elastic and (cfg.workers.min, cfg.workers.max) == (1, 4)
    assert load_config(None, ["workers.count=3"]).workers.elastic is False
    fixed = load_config(None, ["workers.count=[3,3]"]).workers  # one size: a fixed group, kept as written
    assert fixed.count == (3, 3) and not fixed.elastic and fixed.min == fixed.max == 3
    assert "count:\n  - 1\n  - 4\n" in dump_config(cfg)  # a list in YAML, read back the same
    (tmp_path / "run.yaml").write_text(dump_config(cfg))
    assert load_config(tmp_path / "run.yaml").workers.count == (1, 4)
    with pytest.raises(ConfigError, match=r"1 <= MIN <= MAX, got \[3, 2\]"):
        load_config(None, ["workers.count=[3,2]"])


def loss_and_grads(model, objective=MdcObjective()):
    images, tokens = batch(4)
    loss, _ = compute_loss(model, images, tokens, objective, torch.Generator().manual_seed(3))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_activation_checkpointing_gives_the_same_loss_and_gradients():
    plain, checkpointed = tiny_model(), tiny_model()
    prepare_model(checkpointed, "cpu", bf16=False, activation_checkpointing=True, shard=False)
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in checkpointed.named_parameters()]
    loss, grads = loss_and_grads(plain)
    loss_ckpt, grads_ckpt = loss_and_grads(checkpointed)
    assert float(loss_ckpt) == float(loss)
    assert grads.keys() == grads_ckpt.keys()
    for name in grads:
        torch.testing.assert_close(grads_ckpt[name], grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_compiled_blocks_train_like_eager():
    """Sharded and checkpointed as a worker runs them, every block compiled (the eager fallback
    fails this test: CI has the compiler torch.compile needs)."""
    assert compile_available("cpu") is None
    eager, compiled = tiny_model(), tiny_model()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "training uncompiled"
        prepare_model(compiled, "cpu", bf16=False, compile=True, activation_checkpointing=True)
    prepare_model(eager, "cpu", bf16=False, activation_checkpointing=True)
    blocks = transformer_blocks(compiled)
    assert blocks and all(block._compiled_call_impl is not None for block in blocks)
    assert all(block._compiled_call_impl is None for block in transformer_blocks(eager))
    images, tokens = batch(4)
    for model in (eager, compiled):
        optimizer, scheduler = optimiser_for(model)
        model.losses = [
            train_step(
                model,
                optimizer,
                scheduler,
                images,
                tokens,
                MdcObjective(),
                1.0,
                generator=torch.Generator().manual_seed(step),
            )["loss"]
            for step in range(3)
        ]
    assert compiled.losses == pytest.approx(eager.losses, rel=1e-4)
    for (name, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters()):
        torch.testing.assert_close(dense(b), dense(a), rtol=1e-3, atol=1e-5, msg=name)


def test_without_a_working_compiler_blocks_run_eagerly_and_the_warning_says_why(monkeypatch):
    monkeypatch.setattr(fsdp, "compile_available", lambda device: "CalledProcessError: no C++ compiler")
    model = tiny_model()
    with pytest.warns(UserWarning, match=r"compute.compile: .*no C\+\+ compiler.*training uncompiled"):
        prepare_model(model, "cpu", bf16=False, compile=True)
    assert all(block._compiled_call_impl is None for block in transformer_blocks(model))


def test_bf16_compute_keeps_optimiser_ema_and_export_in_float32():
    model = tiny_model()
    apply_fsdp(model, bf16=True)
    optimizer, scheduler = optimiser_for(model)
    ema = EMA(model, 0.9)
    train_step(
        model,
        optimizer,
        scheduler,
        *batch(4),
        MdcObjective(),
        1.0,
        generator=torch.Generator().manual_seed(0),
        ema=ema,
    )
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {v.dtype for s in optimizer.state.values() for v in s.values() if v.ndim} == {torch.float32}
    assert {v.dtype for v in ema.state_dict().values()} == {torch.float32}
    assert {v.dtype for v in full_weights(model, ema).values()} == {torch.float32}
