"""No shared random state (mdc/seeding.py): a model, a crop or a sampled caption is a function of its
seed, whatever other threads draw meanwhile; the library and the driver never touch torch's, numpy's
or Python's global generator."""

import ast
import threading
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mdc import registry, sampling
from mdc.config import load_config
from mdc.data.augment import draws
from mdc.data.tokenizer import CaptionTokenizer
from mdc.evaluation import compositionality as comp
from mdc.evaluation import probe
from mdc.registry import OBJECTIVES, build_model
from mdc.seeding import drawing_from

ROOT = Path(__file__).resolve().parent.parent


def weights(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_model_is_its_seed_while_other_threads_build_and_draw():
    """Two threads build models from seeds 0 and 1 at once, four times each, while a third draws from
    torch's global generator without a pause: every build has its seed's weights. (Seeding the
    global generator instead, the seeded weights came back in 0 of 6 builds.)"""
    cfg_a, cfg_b = load_config(None, []), load_config(None, ["objective.name=clip"])
    expected = {
        0: weights(build_model(cfg_a, CaptionTokenizer, seed=0)),
        1: weights(build_model(cfg_b, CaptionTokenizer, seed=1)),
    }
    assert not same(expected[0], weights(build_model(cfg_a, CaptionTokenizer, seed=1)))  # the seed matters
    stop, results = threading.Event(), {0: [], 1: []}

    def draw_globally():
        while not stop.is_set():
            torch.rand(64)
            torch.randn(8, 8)

    def build(cfg, seed):
        for _ in range(4):
            results[seed].append(same(expected[seed], weights(build_model(cfg, CaptionTokenizer, seed=seed))))

    threads = [threading.Thread(target=draw_globally)] + [
        threading.Thread(target=build, args=args) for args in ((cfg_a, 0), (cfg_b, 1))
    ]
    for thread in threads:
        thread.start()
    for thread in threads[1:]:
        thread.join()
    stop.set()
    threads[0].join()
    assert results == {0: [True] * 4, 1: [True] * 4}


def test_a_seeded_build_has_the_weights_torch_manual_seed_gave():
    """The same Mersenne Twister from the same seed: checkpoints and figures from before stay valid."""
    cfg = load_config(None, ["model.predict_length=true", "objective.image_free_prob=0.5"])
    torch.manual_seed(7)
    before = weights(OBJECTIVES["mdc"].build(cfg, CaptionTokenizer))
    assert same(before, weights(build_model(cfg, CaptionTokenizer, seed=7)))


def test_drawing_from_gives_its_generator_to_every_kind_of_draw():
    with drawing_from(3):
        drawn = [torch.rand(4), torch.randn(4), torch.randint(0, 9, (4,)), torch.randperm(5), torch.empty(4).uniform_()]
    generator = torch.Generator().manual_seed(3)
    expected = [
        torch.rand(4, generator=generator),
        torch.randn(4, generator=generator),
        torch.randint(0, 9, (4,), generator=generator),
        torch.randperm(5, generator=generator),
        torch.empty(4).uniform_(generator=generator),
    ]
    assert all(torch.equal(a, b) for a, b in zip(drawn, expected))


def dropout_p(func, args, kwargs) -> float | None:
    """The op's dropout probability, for attention kernels that draw only when it is above 0."""
    names = [a.name for a in func._schema.arguments]
    if "dropout_p" not in names:
        return None
    i = names.index("dropout_p")
    return args[i] if i < len(args) else kwargs.get("dropout_p", 0.0)


class GlobalDraws(TorchDispatchMode):
    """Records every random op that runs without a generator: a draw from torch's global one."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        seeded = torch.Tag.nondeterministic_seeded in func.tags and kwargs.get("generator") is None
        if seeded and dropout_p(func, args, kwargs) != 0.0:
            self.ops.append(str(func))
        return func(*args, **kwargs)


def test_global_draws_are_seen():
    """The positive control of the guard below."""
    with GlobalDraws() as seen:
        torch.rand(3)
        torch.nn.Linear(2, 2)
        torch.nn.functional.scaled_dot_product_attention(*torch.ones(3, 1, 2, 2), dropout_p=0.5)
        torch.nn.functional.scaled_dot_product_attention(*torch.ones(3, 1, 2, 2))  # p = 0 draws nothing
    assert seen.ops == [
        "aten.rand.default",
        "aten.uniform_.default",
        "aten.uniform_.default",
        "aten.bernoulli_.float",  # attention's dropout mask
    ]


@torch.no_grad()
def test_the_library_draws_nothing_from_the_global_generator(shapes_dir):
    """Building every objective's model, the random-init baseline, crop boxes, sampled captions
    (ancestral, temperature 1, continuous denoising) and Monte Carlo scores: no global draw."""
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with GlobalDraws() as seen:
        for name in OBJECTIVES:
            build_model(load_config(None, [f"objective.name={name}"]), CaptionTokenizer, seed=1)
        model = probe.random_init(load_config(None, []), seed=2)
        draws(4, 32, seed=5)
        generator = torch.Generator().manual_seed(0)
        sampling.sample_masked(model, images, 6, strategy="ancestral", temperature=1.0, generator=generator)
        cdlm = build_model(load_config(None, ["objective.name=cdlm"]), CaptionTokenizer)
        registry.write_captions(cdlm, images, "cdlm", 6, generator=generator)
        comp.evaluate_shapes(model, "mdc", str(shapes_dir), samples=2, limit=4)
    assert seen.ops == []


LEGACY_NUMPY = {"seed", "rand", "randn", "randint", "random", "choice", "shuffle", "permutation", "normal", "uniform"}


def global_generator_calls(source: str) -> list[str]:
    """Calls that seed or draw from a process-wide generator: torch.manual_seed / seed / fork_rng,
    numpy's legacy np.random.*, Python's random.* module functions and an unseeded random.Random()."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        if "(" in name:  # a method of an object made here (torch.Generator().manual_seed): its own state
            continue
        parts = name.split(".")
        if (
            parts[-1] in {"manual_seed", "fork_rng"}
            and parts[0] == "torch"
            or name in {"torch.seed", "torch.random.seed"}
            or parts[:2] in (["np", "random"], ["numpy", "random"])
            and parts[-1] in LEGACY_NUMPY
            or parts[0] == "random"
            and len(parts) == 2
            and parts[1] != "Random"
            or name == "random.Random"
            and not node.args
        ):
            found.append(f"{node.lineno}: {name}")
    return found


def test_no_code_seeds_or_draws_from_a_global_generator():
    """mdc/ (a library whose callers have threads) and pipelines/ (the driver runs runs at once)."""
    files = [p for folder in ("mdc", "pipelines") for p in sorted((ROOT / folder).rglob("*.py"))]
    assert [f"{p.relative_to(ROOT)}:{call}" for p in files for call in global_generator_calls(p.read_text())] == []


def test_the_scan_sees_each_kind():
    source = (
        "torch.manual_seed(0)\ntorch.random.fork_rng()\nnp.random.shuffle([])\nrandom.shuffle([])\n"
        "random.Random()\nrandom.Random(3)\nnp.random.default_rng(0)\ntorch.Generator().manual_seed(1)\n"
    )
    assert sorted(global_generator_calls(source)) == [
        "1: torch.manual_seed",
        "2: torch.random.fork_rng",
        "3: np.random.shuffle",
        "4: random.shuffle",
        "5: random.Random",
    ]


@pytest.mark.parametrize("seed", [0, 11])
def test_crops_are_their_seed_and_match_the_forked_global_generator(seed):
    """The boxes torchvision draws from our generator are the ones it drew from the global generator
    forked and seeded alike (what augment did before): resumed runs keep their crops."""
    from torchvision.transforms import RandomResizedCrop

    from mdc.data.augment import RATIO, SCALE

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        before = [
            (
                tuple(RandomResizedCrop.get_params(torch.empty(1, 32, 32), list(SCALE), list(RATIO))),
                bool(torch.rand(()) < 0.5),
            )
            for _ in range(6)
        ]
    assert draws(6, 32, seed) == before
