"""Tokens and samples of a batch (:mod:`lightning_ckpt.measure.tokens`): token ids or an attention mask have tokens;
image, waveform and embedding batches have samples only."""

from __future__ import annotations

import warnings
from collections import UserDict

import pytest
import torch

from lightning_ckpt.measure.tokens import count_samples, count_tokens, sequence_length

IDS = torch.randint(0, 10, (3, 5))
MASK = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])


def test_token_ids_and_masks_count_tokens():
    assert count_tokens({"input_ids": IDS, "attention_mask": MASK}) == 9
    assert count_tokens(UserDict(input_ids=IDS, attention_mask=MASK.bool())) == 9  # BatchEncoding is a UserDict
    assert count_tokens({"inputs_embeds": torch.randn(3, 5, 8), "attention_mask": MASK}) == 9  # mask, no ids
    assert count_tokens({"input_ids": IDS, "labels": IDS}) == 15
    assert count_tokens({"pixel_values": torch.randn(3, 7), "labels": IDS}) == 15  # captioning: labels are ids
    assert count_tokens((IDS, IDS)) == 15  # nanoGPT's (x, y)
    assert count_tokens([(IDS, MASK), IDS]) == 15
    assert count_tokens(IDS) == 15
    assert count_tokens({"input_ids": IDS, "attention_mask": MASK[:, None, None, :]}) == 15  # 4-D mask: ids' size
    assert count_tokens(IDS, tokens_fn=lambda b: 7) == 7
    assert isinstance(count_tokens({"input_ids": IDS, "attention_mask": MASK}), int)
    assert sequence_length((IDS, IDS)) == 5 and sequence_length({"inputs_embeds": torch.randn(3, 4, 8),
                                                                 "attention_mask": MASK[:, :4]}) == 4


@pytest.mark.parametrize("batch", [
    (torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))),  # timm / torchvision: images, class labels
    {"pixel_values": torch.randn(4, 3, 32, 32), "labels": torch.randint(0, 10, (4,))},  # Hugging Face ViT
    {"pixel_values": torch.randn(4, 3, 32, 32), "labels": torch.randint(0, 5, (4, 32, 32))},  # segmentation masks
    torch.randn(4, 16000),  # a waveform: float, no ids
    torch.randn(4, 5, 8),  # [B, T, C] embeddings without a mask: float data, not ids
    (torch.randn(4, 8) > 0, torch.randn(4, 8)),  # a bool tensor is a mask of no mapping, not ids
], ids=["timm", "vit", "segmentation", "waveform", "embeddings", "bool"])
def test_batches_without_a_sequence_dimension_have_samples_and_no_tokens(batch):
    """An image batch [B, C, H, W] once counted B × C 'tokens' (timm ViT: 90-219 'tokens/s'): it has no tokens."""
    assert count_tokens(batch) is None
    assert sequence_length(batch) is None
    assert count_samples(batch) == 4
    assert count_tokens(batch, tokens_fn=lambda b: 4 * 196) == 784  # the user's own count (ViT patches) wins


def test_samples():
    assert count_samples({"input_ids": IDS, "attention_mask": MASK}) == 3
    assert count_samples((IDS[0], IDS)) == 3  # the token ids' leading dimension, not a 1-D tensor's before them
    assert count_samples(torch.tensor(3)) == 1
    assert count_samples([]) == 0
    assert count_tokens("no tensor here") is None


@pytest.mark.gpu
def test_a_cuda_mask_is_counted_on_the_device_without_a_sync():
    ids = IDS.cuda()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tokens = count_tokens({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    assert isinstance(tokens, torch.Tensor) and tokens.device.type == "cuda" and int(tokens) == 15
    assert count_tokens((torch.randn(4, 3, 8, 8, device="cuda"), torch.zeros(4, dtype=torch.long,
                                                                             device="cuda"))) is None


def test_a_mask_nested_in_the_batch_counts_the_non_padding_tokens():
    """``({"input_ids", "attention_mask"}, labels)``: the nested mask's non-zero entries are the tokens (the old code
    counted the ids' size, 15 here, reading tokens/s 67 % high)."""
    inputs = {"input_ids": IDS, "attention_mask": MASK}
    assert count_tokens((inputs, IDS)) == int(MASK.sum()) == 9
    assert count_tokens([{"inputs": inputs}, IDS]) == 9  # deeper still
    assert count_tokens((UserDict(input_ids=IDS, attention_mask=MASK.bool()), IDS)) == 9
    assert count_tokens(({"input_ids": IDS, "attention_mask": MASK[:, None, None, :]}, IDS)) == 15  # 4-D: ids
    assert count_samples((inputs, IDS)) == 3
    assert sequence_length(({"inputs_embeds": torch.randn(3, 4, 8), "attention_mask": MASK[:, :4]}, None)) == 4
