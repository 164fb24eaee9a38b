"""The shape of a batch and its bucket (:mod:`lightning_ckpt.decide.shapes`)."""

from __future__ import annotations

from collections import UserDict, namedtuple

import pytest
import torch

from lightning_ckpt.decide.shapes import MIN_LENGTH, Shape, bucket_of, parse_shape, resize_batch, shape_of

IDS = torch.arange(3 * 5).reshape(3, 5) % 11


def test_token_batches_have_samples_and_a_length():
    assert shape_of({"input_ids": IDS, "labels": IDS}) == Shape(3, (5,))
    assert shape_of(UserDict(input_ids=IDS, attention_mask=torch.ones(3, 5))) == Shape(3, (5,))
    assert shape_of((IDS, IDS)) == Shape(3, (5,))
    assert shape_of(IDS) == Shape(3, (5,))
    assert Shape(3, (5,)).tokens == 15 and str(Shape(3, (5,))) == "3 x 5"


def test_encoder_decoder_batches_have_a_source_and_a_target_length():
    target = torch.zeros(3, 7, dtype=torch.long)
    assert shape_of({"input_ids": IDS, "labels": target}) == Shape(3, (5, 7))  # labels of another length
    assert shape_of({"input_ids": IDS, "decoder_input_ids": target, "labels": target}) == Shape(3, (5, 7))
    same = torch.zeros(3, 5, dtype=torch.long)
    assert shape_of({"input_ids": IDS, "decoder_input_ids": same}) == Shape(3, (5, 5))  # explicit: two lengths


def test_batches_without_a_sequence_have_their_image_size_or_nothing():
    assert shape_of((torch.randn(4, 3, 32, 48), torch.tensor([1, 2, 3, 4]))) == Shape(4, (32, 48))
    assert shape_of({"pixel_values": torch.randn(2, 3, 16, 16)}) == Shape(2, (16, 16))
    assert shape_of(torch.randn(6, 10)) == Shape(6)  # flat features: samples only


def test_shape_fn_overrides_the_rule_and_is_checked():
    assert shape_of(IDS, shape_fn=lambda b: (8, 128)) == Shape(8, (128,))
    assert shape_of(IDS, shape_fn=lambda b: "2x64x32") == Shape(2, (64, 32))
    with pytest.raises(ValueError, match=r"shape_fn\(batch\)=\(0, 4\) is not a batch shape"):
        shape_of(IDS, shape_fn=lambda b: (0, 4))


@pytest.mark.parametrize("text, shape", [("4x2048", Shape(4, (2048,))), ("4 × 512 × 128", Shape(4, (512, 128))),
                                         ((8, 64), Shape(8, (64,))), ([2], Shape(2)), (None, None)])
def test_parse_shape(text, shape):
    assert parse_shape(text) == shape


@pytest.mark.parametrize("bad", ["", "4xlong", (4, -1), (2.5, 8), "0x8"])
def test_a_bad_max_shape_names_the_value_and_the_form(bad):
    with pytest.raises(ValueError, match=r"max_shape=.* is not a batch shape: pass the micro-batch and the longest "
                                         r"length, e.g. '4x2048'"):
        parse_shape(bad)


def test_buckets_are_powers_of_two_capped_by_the_longest_shape():
    assert bucket_of(Shape(3, (5,))) == Shape(4, (MIN_LENGTH,))
    assert bucket_of(Shape(4, (100,))) == Shape(4, (128,))
    assert bucket_of(Shape(4, (128,))) == Shape(4, (128,))
    assert bucket_of(Shape(4, (129, 7))) == Shape(4, (256, 8))
    cap = Shape(4, (768,))
    assert bucket_of(Shape(4, (700,)), cap) == Shape(4, (768,))  # within the cap: not 1024
    assert bucket_of(Shape(4, (800,)), cap) == Shape(4, (1024,))  # beyond it: the rule
    assert bucket_of(Shape(3, (100, 50)), cap) == Shape(4, (128, 64))  # a cap of another arity is ignored
    assert bucket_of(Shape(5, (16, 16))) == Shape(8, (16, 16))
    assert Shape(4, (128,)).covers(Shape(3, (100,))) and not Shape(4, (128,)).covers(Shape(8, (100,)))


def test_resize_batch_repeats_the_batch_to_the_bucket_and_keeps_everything_else():
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    Pair = namedtuple("Pair", "ids mask")
    batch = {"input_ids": IDS, "attention_mask": mask, "scores": torch.randn(3, 5, 5), "pair": Pair(IDS, mask),
             "name": "x", "temperature": torch.tensor(0.5)}
    out = resize_batch(batch, Shape(3, (5,)), Shape(4, (12,)))
    assert out["input_ids"].shape == (4, 12) and out["attention_mask"].shape == (4, 12)
    assert out["scores"].shape == (4, 12, 12)  # both sequence dimensions
    assert torch.equal(out["input_ids"][:3, :5], IDS) and torch.equal(out["input_ids"][:3, 5:10], IDS)
    assert torch.equal(out["input_ids"][3, :5], IDS[0])  # a repeated sample
    assert isinstance(out["pair"], Pair) and out["pair"].ids.shape == (4, 12)
    assert out["name"] == "x" and out["temperature"].shape == ()
    assert out["input_ids"].max() < 11  # still valid token ids
    assert resize_batch(batch, Shape(3, (5,)), Shape(2, (4,)))["input_ids"].shape == (2, 4)  # smaller: cropped
    with pytest.raises(ValueError, match="different lengths"):
        resize_batch(batch, Shape(3, (5,)), Shape(3, (5, 5)))


def test_an_encoder_decoder_batch_resizes_its_source_and_target_apart_even_when_they_are_equal():
    ids = torch.zeros(2, 6, dtype=torch.long)
    batch = {"input_ids": ids, "attention_mask": torch.ones(2, 6), "decoder_input_ids": ids.clone(), "labels": ids}
    shape = shape_of(batch)
    assert shape == Shape(2, (6, 6))
    out = resize_batch(batch, shape, Shape(2, (16, 4)))
    assert out["input_ids"].shape == out["attention_mask"].shape == (2, 16)
    assert out["decoder_input_ids"].shape == out["labels"].shape == (2, 4)
    assert shape_of(out) == Shape(2, (16, 4))
