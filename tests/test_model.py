import pytest
import torch

from mdc.config import load_config
from mdc.data.tokenizer import CaptionTokenizer
from mdc.models.captioner import SINCOS_GAIN, Captioner
from mdc.registry import build_model

MASK, PAD = 49408, 49409


def make_model(**kwargs) -> Captioner:
    torch.manual_seed(0)
    return Captioner("tiny", max_length=8, **kwargs).eval()


@pytest.fixture(scope="module")
def model():
    return make_model()


def images(b=2, seed=0):
    return torch.randn(b, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def words(b, n, seed=1):
    return torch.randint(0, 49406, (b, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
@pytest.mark.parametrize("causal", [False, True])
def test_mask_and_pad_are_never_predicted(model, causal):
    tokens = words(2, 8)
    tokens[0, 2], tokens[1, 5:] = MASK, PAD
    logits = model(images(), tokens, causal=causal)
    assert logits.shape == (2, 8, min(MASK, PAD))  # one logit per id before [MASK] and pad, index = id
    assert logits.isfinite().all()


@torch.no_grad()
def test_pad_keys_do_not_change_real_positions(model):
    tokens = words(2, 8)
    tokens[:, 5:] = PAD
    full = model(images(), tokens)
    short = model(images(), tokens[:, :5])
    torch.testing.assert_close(full[:, :5], short, rtol=1e-5, atol=1e-5)

    other = make_model()
    with torch.no_grad():
        other.token_embed.weight[PAD] += 1.0  # what a pad key would carry
    torch.testing.assert_close(other(images(), tokens)[:, :5], full[:, :5], rtol=0, atol=0)


@torch.no_grad()
def test_causal_mode_hides_later_tokens(model):
    a = words(2, 8)
    b = a.clone()
    b[:, 5] = (b[:, 5] + 1) % 49406
    causal_a, causal_b = model(images(), a, causal=True), model(images(), b, causal=True)
    torch.testing.assert_close(causal_a[:, :5], causal_b[:, :5], rtol=0, atol=0)
    assert not torch.allclose(causal_a[:, 5:], causal_b[:, 5:])
    assert not torch.allclose(model(images(), a)[:, :5], model(images(), b)[:, :5])  # bidirectional


@torch.no_grad()
def test_causal_is_chosen_per_row(model):
    tokens = words(2, 8)
    mixed = model(images(), tokens, causal=torch.tensor([True, False]))
    torch.testing.assert_close(mixed[0], model(images(), tokens, causal=True)[0])
    torch.testing.assert_close(mixed[1], model(images(), tokens, causal=False)[1])


@torch.no_grad()
def test_where_projects_only_the_chosen_positions(model):
    tokens = words(2, 8)
    tokens[1, 6:] = PAD
    where = torch.rand(2, 8, generator=torch.Generator().manual_seed(2)) < 0.5
    picked = model(images(), tokens, where=where)
    assert picked.shape == (int(where.sum()), model.token_embed.num_embeddings - 2)
    torch.testing.assert_close(picked, model(images(), tokens)[where])


@torch.no_grad()
def test_encode_image_pools_patch_features(model):
    x = images(3)
    features = model.encode(x)
    assert features.shape == (3, 64, 128)
    pooled = model.encode_image(x)
    assert pooled.shape == (3, 128)
    torch.testing.assert_close(pooled, features.mean(1))


@torch.no_grad()
def test_time_conditioning_needs_t_and_uses_it():
    model = make_model(time_conditioning=True)
    tokens = words(2, 8)
    with pytest.raises(ValueError, match="needs t"):
        model(images(), tokens)
    t_low, t_high = torch.full((2,), 0.1), torch.full((2,), 0.9)
    # the modulation starts as the identity, so t has no effect until trained
    torch.testing.assert_close(model(images(), tokens, t=t_low), model(images(), tokens, t=t_high))
    for block in model.blocks:
        torch.nn.init.normal_(block.modulation.weight, std=0.05)
    assert not torch.allclose(model(images(), tokens, t=t_low), model(images(), tokens, t=t_high))


@torch.no_grad()
def test_concentrated_attention_hides_mask_keys():
    """A hidden [MASK] key is invisible like a pad key: turning a pad into [MASK] must leave every
    other position unchanged with concentrated attention, and change them without it."""
    model = make_model(concentrated_attention=True)
    tokens = words(2, 8)
    tokens[:, [1, 3]] = MASK
    with_pad, with_mask = tokens.clone(), tokens.clone()
    with_pad[:, 6], with_mask[:, 6] = PAD, MASK
    others = [0, 1, 2, 3, 4, 5, 7]
    torch.testing.assert_close(
        model(images(), with_pad)[:, others], model(images(), with_mask)[:, others], rtol=0, atol=0
    )
    model.concentrated_attention = False
    assert not torch.allclose(model(images(), with_pad)[:, others], model(images(), with_mask)[:, others])


@torch.no_grad()
def test_concentrated_attention_handles_all_mask_input():
    model = make_model(concentrated_attention=True)
    logits = model(images(), torch.full((2, 8), MASK))
    assert torch.isfinite(logits[..., :MASK]).all()


@pytest.mark.parametrize(
    "preset, patches, patch, dim",
    [
        ("tiny", 64, 4, 128),
        ("vit_b32", 49, 32, 768),
        ("vit_b16", 196, 16, 768),
        ("vit_l14", 256, 14, 1024),
    ],
)
def test_presets(preset, patches, patch, dim):
    with torch.device("meta"):
        model = Captioner(preset, max_length=32)
    encoder = model.encoder
    assert encoder.patch_embed.num_patches == patches
    assert encoder.patch_embed.patch_size == (patch, patch)
    assert encoder.num_prefix_tokens == 0  # patch tokens only, no class token
    assert model.dim == encoder.embed_dim == dim
    assert len(model.blocks) == (2 if preset == "tiny" else 6)
    assert model.pos_embed.shape == (1, 33, dim)


def test_encoder_positions_are_a_fixed_2d_sincos_table():
    model = make_model()
    table = model.encoder.pos_embed[0]  # (64 patches, 128): an 8 x 8 grid, row-major like the patches
    bands = 1.0 / 10_000 ** (torch.arange(32) / 32)
    y, x = 2, 5
    expected = torch.cat([(y * bands).sin(), (x * bands).sin(), (y * bands).cos(), (x * bands).cos()])
    torch.testing.assert_close(table[8 * y + x], SINCOS_GAIN * expected)
    assert "encoder.pos_embed" not in dict(model.named_parameters())  # never trained
    assert "encoder.pos_embed" not in model.state_dict()  # rebuilt, not stored
    learned = Captioner("tiny", max_length=8, encoder_pos_embed="learned")
    assert "encoder.pos_embed" in dict(learned.named_parameters())
    with pytest.raises(ValueError, match="pos_embed must be 'sincos2d' or 'learned', got 'rope'"):
        Captioner("tiny", max_length=8, encoder_pos_embed="rope")


def test_build_model_follows_the_config():
    cfg = load_config(None, ["model.image_size=16", "model.decoder_layers=1", "data.max_length=12"])
    model = build_model(cfg, CaptionTokenizer)
    assert model.image_size == 16 and model.encoder.patch_embed.num_patches == 16
    assert len(model.blocks) == 1
    assert model.pos_embed.shape[1] == 13
    assert model.token_embed.num_embeddings == CaptionTokenizer.vocab_size
    assert (model.mask_id, model.pad_id, model.bos_id, model.eos_id) == (49408, 49409, 49406, 49407)
