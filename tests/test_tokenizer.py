import numpy as np
import open_clip
import pytest
import torch

from mdc.data.tokenizer import CaptionTokenizer

CAPTIONS = [
    "a small red circle to the left of a large blue square",
    "A Dog, running on the BEACH!",
    "two  cats   sleeping on a sofa",
    "the year 2023 was café-hot",
]


@pytest.fixture(scope="module")
def tok():
    return CaptionTokenizer(max_length=16)


def open_clip_ids(caption: str) -> list[int]:
    """open_clip's ids without its BOS, EOS and zero padding."""
    row = open_clip.tokenize([caption], context_length=77)[0].tolist()
    return [i for i in row if i not in (0, CaptionTokenizer.bos_id, CaptionTokenizer.eos_id)]


def test_special_ids_follow_clip_vocabulary(tok):
    assert len(tok._tok) == 49408
    assert (tok.bos_id, tok.eos_id, tok.mask_id, tok.pad_id) == (49406, 49407, 49408, 49409)
    assert tok.vocab_size == 49408 + 2
    assert tok._tok.convert_ids_to_tokens([49406, 49407]) == ["<|startoftext|>", "<|endoftext|>"]


def test_ids_agree_with_open_clip(tok):
    ids = tok.encode(CAPTIONS)
    assert ids.shape == (len(CAPTIONS), 16) and ids.dtype == np.int64
    for row, caption in zip(ids, CAPTIONS):
        expected = open_clip_ids(caption)
        assert len(expected) < 16
        assert row[: len(expected)].tolist() == expected
        assert (row[len(expected) :] == tok.pad_id).all()


def test_truncates_at_max_length(tok):
    caption = " ".join(["red blue green"] * 10)
    ids = tok.encode([caption])[0]
    assert ids.tolist() == open_clip_ids(caption)[:16]
    assert tok.pad_id not in ids.tolist()


def test_encode_has_no_special_tokens(tok):
    ids = tok.encode(["", "x"])
    assert (ids[0] == tok.pad_id).all()
    assert not np.isin(ids, [tok.bos_id, tok.eos_id, tok.mask_id]).any()


def test_decode_round_trips_simple_captions(tok):
    captions = [
        c.lower()
        for c in [
            "a small red circle to the left of a large blue square",
            "Two cats sleeping on a sofa",
            "a photo of 3 dogs",
        ]
    ]
    assert tok.decode(tok.encode(captions)) == captions
    assert tok.decode(torch.from_numpy(tok.encode(captions))) == captions


def test_decode_stops_at_eos_and_drops_mask_and_bos(tok):
    red, cat, dog = tok.encode(["red cat dog"])[0][:3].tolist()
    rows = [[tok.bos_id, red, tok.mask_id, cat, tok.eos_id, dog], [red, cat, tok.pad_id, dog, dog, dog]]
    assert tok.decode(np.array(rows)) == ["red cat", "red cat"]
