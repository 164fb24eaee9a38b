"""Block discovery (``lightning_ckpt.core.blocks``): selectors, automatic detection, errors.

Hugging Face models are built from tiny configs (random weights, nothing downloaded). timm / torchvision
models are built on the ``meta`` device (structure only, no memory, no weights) and skipped when the
package is missing.
"""

import warnings
from collections import Counter

import pytest
import torch
from torch import nn

from lightning_ckpt.core.blocks import describe_blocks, find_blocks
from lightning_ckpt.demos.gpt import GPT, MLP, Block, GPTConfig


def names(found):
    return [n for n, _ in found]


def classes(found):
    return Counter(type(m).__name__ for _, m in found)


@pytest.fixture(scope="module")
def gpt():
    return GPT(GPTConfig.tiny())  # 4 Blocks at transformer.h.0 … transformer.h.3


GPT_BLOCKS = [f"transformer.h.{i}" for i in range(4)]


# --------------------------------------------------------------------------------------------- toy models


class FF(nn.Module):
    def __init__(self, d=8, mult=4):
        super().__init__()
        self.fc1 = nn.Linear(d, mult * d)
        self.fc2 = nn.Linear(mult * d, d)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Layer(nn.Module):
    def __init__(self, d=8, mult=4):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.ff = FF(d, mult)

    def forward(self, x):
        h = self.norm(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.ff(x)


class OtherLayer(Layer):
    pass


class Stack(nn.Module):
    def __init__(self, n=3, d=8, mult=4, cls=Layer):
        super().__init__()
        self.embed = nn.Embedding(10, d)
        self.layers = nn.ModuleList(cls(d, mult) for _ in range(n))
        self.head = nn.Linear(d, 10)


class Downsample(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.norm = nn.LayerNorm(4 * d)
        self.reduce = nn.Linear(4 * d, d)


class Stage(nn.Module):
    """A hierarchical-model stage: a list of blocks plus a small downsample and a position table."""

    def __init__(self, depth, d=8):
        super().__init__()
        self.pos = nn.Parameter(torch.zeros(64, d))  # held directly: not counted against the blocks
        self.blocks = nn.ModuleList(Layer(d) for _ in range(depth))
        self.downsample = Downsample(d)


class Hierarchical(nn.Module):
    def __init__(self, depths=(2, 2, 4, 2)):
        super().__init__()
        self.stages = nn.ModuleList(Stage(d) for d in depths)


class Residual(nn.Module):
    def __init__(self, fn, d=8):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fn = fn


class ResidualBlock(nn.Module):
    """A block whose own sub-layers sit in a list of one wrapper class: not a stage."""

    def __init__(self, d=8):
        super().__init__()
        self.sublayers = nn.ModuleList([Residual(nn.MultiheadAttention(d, 2), d), Residual(FF(d), d)])


class EncoderDecoder(nn.Module):
    def __init__(self, n_enc=2, n_dec=8, d=8):
        super().__init__()
        self.encoder = Stack(n_enc, d, cls=Layer)
        self.decoder = Stack(n_dec, d, cls=OtherLayer)


class Hinted(nn.Module):
    """`_no_split_modules` names a small stacked class and one that does not repeat (like ViTEmbeddings)."""

    _no_split_modules = ["FF", "Downsample", "NotInThisModel"]

    def __init__(self):
        super().__init__()
        self.stem = Downsample()
        self.big = nn.ModuleList(Layer(8, mult=16) for _ in range(2))
        self.small = nn.ModuleList(FF(8, mult=1) for _ in range(3))


class Boring(nn.Module):
    """Lightning's BoringModel shape: one Linear."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(32, 2)


# --------------------------------------------------------------------------------------------- selectors


@pytest.mark.parametrize(
    "selector",
    [
        Block,
        "Block",
        "lightning_ckpt.demos.gpt.Block",
        "transformer.h.*",
        "transformer.h",
        ["transformer.h.*"],
    ],
    ids=["class", "class-name", "qualified-name", "glob", "list-path", "list"],
)
def test_every_selector_kind_finds_the_four_blocks(gpt, selector):
    found = find_blocks(gpt, selector)
    assert names(found) == GPT_BLOCKS
    assert all(module is gpt.transformer.h[i] for i, (_, module) in enumerate(found))


def test_glob_can_pick_a_subset(gpt):
    assert names(find_blocks(gpt, "transformer.h.[02]")) == ["transformer.h.0", "transformer.h.2"]
    assert names(find_blocks(gpt, "transformer.h.3")) == ["transformer.h.3"]


def test_list_mixes_selector_kinds_in_model_order(gpt):
    found = find_blocks(gpt, ["transformer.h.3", MLP, "transformer.h.0"])
    # h.0 and h.3 swallow their own MLPs; the other MLPs stay, everything in model order
    assert names(found) == [
        "transformer.h.0",
        "transformer.h.1.mlp",
        "transformer.h.2.mlp",
        "transformer.h.3",
    ]


def test_outermost_wins_when_a_block_and_its_mlp_both_match(gpt):
    assert names(find_blocks(gpt, [MLP, Block])) == GPT_BLOCKS
    assert names(find_blocks(gpt, ["MLP", "Block"])) == GPT_BLOCKS
    # 'transformer.h.*' also matches transformer.h.0.attn, transformer.h.0.mlp.c_fc, ...
    assert names(find_blocks(gpt, "transformer.h.*")) == GPT_BLOCKS


def test_class_selector_matches_subclasses_and_names_follow_the_mro():
    model = Stack(2)
    model.layers.append(OtherLayer())
    assert names(find_blocks(model, Layer)) == ["layers.0", "layers.1", "layers.2"]
    assert names(find_blocks(model, OtherLayer)) == ["layers.2"]
    assert names(find_blocks(model, "OtherLayer")) == ["layers.2"]
    # a wrapper that re-classes a block (FSDP2 makes FSDP<Name>) keeps answering to the original name
    wrapped = type("FSDPLayer", (Layer,), {})
    model.layers[0].__class__ = wrapped
    assert names(find_blocks(model, "Layer")) == ["layers.0", "layers.1", "layers.2"]
    assert names(find_blocks(model, "FSDPLayer")) == ["layers.0"]


def test_bad_selector_types():
    model = Stack(2)
    with pytest.raises(TypeError, match=r"blocks selector 3 \(int\).*class name.*path glob"):
        find_blocks(model, 3)
    with pytest.raises(TypeError, match=r"blocks selector <class 'int'>"):
        find_blocks(model, [int])
    with pytest.raises(ValueError, match=r"blocks=\[\] selects nothing"):
        find_blocks(model, [])
    with pytest.raises(TypeError, match="needs an nn.Module, got str"):
        find_blocks("model")


# --------------------------------------------------------------------------------------------- no match


def test_no_match_names_the_selector_and_suggests_class_names(gpt):
    with pytest.raises(ValueError) as err:
        find_blocks(gpt, "Blok")
    message = str(err.value)
    assert message.startswith("blocks selector 'Blok' matched no module.")
    assert "Closest class names: ['Block'" in message
    assert "Repeated blocks in this model: ['transformer.h.* (4 × Block)']" in message
    # case-insensitive suggestion, spelled as the class is
    with pytest.raises(ValueError, match=r"'block2' matched no module\. Closest class names: \['Block'"):
        find_blocks(gpt, "block2")


def test_no_match_suggests_close_paths_for_a_glob(gpt):
    with pytest.raises(ValueError) as err:
        find_blocks(gpt, "transformer.hh.*")
    message = str(err.value)
    assert message.startswith("blocks selector 'transformer.hh.*' matched no module.")
    assert "Closest paths: ['transformer.h.*', " in message  # the container's glob first
    assert "'transformer.h.* (4 × Block)'" in message


def test_no_match_for_a_class_names_the_class(gpt):
    with pytest.raises(ValueError, match=r"^blocks selector 'TransformerEncoderLayer' matched no module"):
        find_blocks(gpt, nn.TransformerEncoderLayer)


def test_one_bad_selector_in_a_list_is_named(gpt):
    with pytest.raises(ValueError, match=r"^blocks selector 'nope\.\*' matched no module"):
        find_blocks(gpt, ["Block", "nope.*"])


# --------------------------------------------------------------------------------------------- no blocks


@pytest.mark.parametrize(
    ("model", "cls_hint", "path_hint"),
    [
        (nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)), "'Linear'", "'*'"),
        (Boring(), "'Linear'", "'layer'"),
        # two attention modules, but as plain attributes of one layer: not a stack
        (nn.TransformerDecoderLayer(8, 2), "'MultiheadAttention'", "'self_attn'"),
    ],
    ids=["mlp", "boring", "single-decoder-layer"],
)
def test_model_without_repeated_blocks_says_what_was_searched(model, cls_hint, path_hint):
    with pytest.raises(ValueError) as err:
        find_blocks(model)
    message = str(err.value)
    assert message.startswith(f"No repeated blocks found in {type(model).__name__}: searched Hugging Face")
    assert "`_no_split_modules` (not present)" in message
    assert "nn.ModuleList / nn.Sequential / nn.ModuleDict" in message
    assert f"Pass `blocks=` explicitly: a class, a class name such as {cls_hint}" in message
    assert f"a path glob such as {path_hint}" in message


def test_lightning_boring_model_has_no_repeated_blocks():
    boring_classes = pytest.importorskip("lightning.pytorch.demos.boring_classes")
    with pytest.raises(ValueError, match=r"^No repeated blocks found in BoringModel: .*Pass `blocks=`"):
        find_blocks(boring_classes.BoringModel())
    # and an explicit selector still works on it
    assert names(find_blocks(boring_classes.BoringModel(), "layer")) == ["layer"]


def test_unstacked_hint_is_reported():
    class OnlyHint(nn.Module):
        _no_split_modules = ["Layer"]

        def __init__(self):
            super().__init__()
            self.layer = Layer()

    with pytest.raises(ValueError, match=r"`_no_split_modules` \['Layer'\] \(none of them is stacked\)"):
        find_blocks(OnlyHint())


# --------------------------------------------------------------------------------------------- automatic


def test_demo_gpt(gpt):
    found = find_blocks(gpt)
    assert names(found) == GPT_BLOCKS
    assert classes(found) == {"Block": 4}


def test_torch_transformer_encoder_and_decoder():
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16), 3, enable_nested_tensor=False)
    dec = nn.TransformerDecoder(nn.TransformerDecoderLayer(8, 2, 16), 2)
    assert names(find_blocks(enc)) == ["layers.0", "layers.1", "layers.2"]
    assert names(find_blocks(dec)) == ["layers.0", "layers.1"]


def test_torch_transformer_returns_both_stacks_in_model_order():
    model = nn.Transformer(8, 2, num_encoder_layers=3, num_decoder_layers=2, dim_feedforward=16)
    found = find_blocks(model)
    assert names(found) == [f"encoder.layers.{i}" for i in range(3)] + [
        f"decoder.layers.{i}" for i in range(2)
    ]
    assert classes(found) == {"TransformerEncoderLayer": 3, "TransformerDecoderLayer": 2}


def test_results_follow_registration_order():
    class DecoderFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.decoder = Stack(2, cls=OtherLayer)
            self.encoder = Stack(3)

    assert names(find_blocks(DecoderFirst())) == [
        "decoder.layers.0",
        "decoder.layers.1",
        "encoder.layers.0",
        "encoder.layers.1",
        "encoder.layers.2",
    ]


def test_model_that_is_itself_a_sequential_of_blocks():
    assert names(find_blocks(nn.Sequential(Layer(), Layer(), nn.LayerNorm(8)))) == ["0", "1"]


def test_largest_stack_wins_and_small_unrelated_stacks_are_left_out():
    class WithHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Layer(16) for _ in range(4))
            self.heads = nn.ModuleDict({"a": FF(16, mult=1), "b": FF(16, mult=1)})  # stacked but small

    assert names(find_blocks(WithHeads())) == [f"layers.{i}" for i in range(4)]


def test_short_second_stack_of_full_size_layers_is_kept():
    # 2 encoder layers hold 20 % of the parameters of 10 decoder layers, but each is as large as a decoder
    # layer
    found = find_blocks(EncoderDecoder(n_enc=2, n_dec=10))
    assert names(found) == ["encoder.layers.0", "encoder.layers.1"] + [
        f"decoder.layers.{i}" for i in range(10)
    ]


def test_interleaved_layer_kinds_are_all_kept():
    # a hybrid stack (Jamba-style): the rare kind is small but sits in the same list
    model = Stack(0)
    for i in range(6):
        model.layers.append(Layer(8, mult=16) if i % 3 else OtherLayer(8, mult=1))
    found = find_blocks(model)
    assert names(found) == [f"layers.{i}" for i in range(6)]
    assert classes(found) == {"Layer": 4, "OtherLayer": 2}


def test_small_modules_interleaved_with_stages_are_not_blocks():
    # torchvision Swin layout: features = [stem, Sequential(blocks), PatchMerging, Sequential(blocks), ...]
    model = nn.Module()
    model.features = nn.Sequential(
        nn.Conv2d(3, 8, 1),
        nn.Sequential(Layer(), Layer()),
        Downsample(),
        nn.Sequential(Layer(), Layer()),
        Downsample(),
        nn.Sequential(Layer(), Layer()),
    )
    found = find_blocks(model)
    assert names(found) == [
        "features.1.0",
        "features.1.1",
        "features.3.0",
        "features.3.1",
        "features.5.0",
        "features.5.1",
    ]


def test_stages_are_opened_into_their_blocks():
    found = find_blocks(Hierarchical(depths=(2, 2, 4, 2)))
    assert classes(found) == {"Layer": 10}
    assert names(found)[:3] == ["stages.0.blocks.0", "stages.0.blocks.1", "stages.1.blocks.0"]
    assert names(found)[-1] == "stages.3.blocks.1"


def test_a_block_with_a_list_of_its_own_sublayers_is_not_a_stage():
    model = nn.ModuleList(ResidualBlock() for _ in range(3))
    assert classes(find_blocks(model)) == {"ResidualBlock": 3}


def test_a_block_whose_alike_sublayers_are_a_minority_is_not_a_stage():
    # MobileBERT keeps a list of FFN sub-layers inside each layer (under half of the layer's parameters)
    class Layered(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(32, 2)
            self.out = FF(32, mult=4)
            self.ffn = nn.ModuleList(Residual(FF(32, mult=1), 32) for _ in range(2))

    assert classes(find_blocks(nn.ModuleList(Layered() for _ in range(3)))) == {"Layered": 3}


def test_a_lone_instance_of_the_block_class_counts_too():
    # EfficientNet-style: the last stage holds a single block
    model = nn.Module()
    model.blocks = nn.Sequential(
        nn.Sequential(Layer(), Layer()), nn.Sequential(Layer(), Layer()), nn.Sequential(Layer())
    )
    assert names(find_blocks(model)) == ["blocks.0.0", "blocks.0.1", "blocks.1.0", "blocks.1.1", "blocks.2.0"]


def test_no_split_hint_keeps_stacked_classes_only_and_wins_over_size():
    found = find_blocks(Hinted())
    # FF is hinted and stacked → chosen although the Layer stack is larger; Downsample (hinted, single) and
    # the
    # FFs nested inside the Layers are not blocks; the Layer stack is added as a second stack by structure
    assert names(found) == ["big.0", "big.1", "small.0", "small.1", "small.2"]
    assert classes(found) == {"Layer": 2, "FF": 3}


def test_no_second_stack_is_sought_inside_a_module_the_hint_keeps_whole():
    class Backbone(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Layer(8, mult=32) for _ in range(4))  # larger than the hinted layers

    class Detector(nn.Module):
        _no_split_modules = ["Backbone", "OtherLayer"]

        def __init__(self):
            super().__init__()
            self.backbone = Backbone()
            self.decoder = Stack(3, cls=OtherLayer)

    assert names(find_blocks(Detector())) == ["decoder.layers.0", "decoder.layers.1", "decoder.layers.2"]


def test_describe_blocks(gpt):
    assert describe_blocks(find_blocks(gpt)) == "4 × Block at transformer.h.0 … transformer.h.3"
    assert describe_blocks(find_blocks(gpt, "transformer.h.1")) == "1 × Block at transformer.h.1"
    assert describe_blocks([]) == "no blocks"
    mixed = find_blocks(
        nn.Transformer(8, 2, 1, 1, 16), ["TransformerEncoderLayer", "TransformerDecoderLayer"]
    )
    assert describe_blocks(mixed) == (
        "2 × TransformerDecoderLayer/TransformerEncoderLayer at encoder.layers.0 … decoder.layers.0"
    )


# --------------------------------------------------------------------------------------------- Hugging Face

try:
    import transformers
except ImportError:  # pragma: no cover - transformers is in the [test] extras
    transformers = None

_SMALL = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=128
)
_SEQ2SEQ = dict(
    d_model=32,
    encoder_layers=3,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    vocab_size=128,
)


def _clip_config():
    return transformers.CLIPConfig(
        text_config=dict(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=128
        ),
        vision_config=dict(
            hidden_size=32,
            num_hidden_layers=3,
            num_attention_heads=4,
            intermediate_size=64,
            image_size=32,
            patch_size=8,
        ),
        projection_dim=16,
    )


def _layers(prefix, n):
    return [f"{prefix}.{i}" for i in range(n)]


HF_CASES = [
    # (model class, config factory, expected {class: count}, expected names)
    (
        "GPT2LMHeadModel",
        lambda: transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=128),
        {"GPT2Block": 2},
        _layers("transformer.h", 2),
    ),
    (
        "BertForMaskedLM",
        lambda: transformers.BertConfig(**_SMALL),
        {"BertLayer": 2},
        _layers("bert.encoder.layer", 2),
    ),
    (
        "RobertaForMaskedLM",
        lambda: transformers.RobertaConfig(**_SMALL),
        {"RobertaLayer": 2},
        _layers("roberta.encoder.layer", 2),
    ),
    (
        "DistilBertForMaskedLM",
        lambda: transformers.DistilBertConfig(dim=32, n_layers=2, n_heads=4, hidden_dim=64, vocab_size=128),
        {"TransformerBlock": 2},
        _layers("distilbert.transformer.layer", 2),
    ),
    (
        "LlamaForCausalLM",
        lambda: transformers.LlamaConfig(**_SMALL, num_key_value_heads=2),
        {"LlamaDecoderLayer": 2},
        _layers("model.layers", 2),
    ),
    (
        "MistralForCausalLM",
        lambda: transformers.MistralConfig(**_SMALL, num_key_value_heads=2),
        {"MistralDecoderLayer": 2},
        _layers("model.layers", 2),
    ),
    (
        "Qwen2ForCausalLM",
        lambda: transformers.Qwen2Config(**_SMALL, num_key_value_heads=2),
        {"Qwen2DecoderLayer": 2},
        _layers("model.layers", 2),
    ),
    (
        "MixtralForCausalLM",
        lambda: transformers.MixtralConfig(**_SMALL, num_key_value_heads=2, num_local_experts=4),
        {"MixtralDecoderLayer": 2},
        _layers("model.layers", 2),
    ),
    (
        "PhiForCausalLM",
        lambda: transformers.PhiConfig(**_SMALL),
        {"PhiDecoderLayer": 2},
        _layers("model.layers", 2),
    ),
    (
        "GPTNeoXForCausalLM",
        lambda: transformers.GPTNeoXConfig(**_SMALL),
        {"GPTNeoXLayer": 2},
        _layers("gpt_neox.layers", 2),
    ),
    (
        "OPTForCausalLM",
        lambda: transformers.OPTConfig(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            ffn_dim=64,
            vocab_size=128,
            word_embed_proj_dim=32,
        ),
        {"OPTDecoderLayer": 2},
        _layers("model.decoder.layers", 2),
    ),
    (
        "FalconForCausalLM",
        lambda: transformers.FalconConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=128
        ),
        {"FalconDecoderLayer": 2},
        _layers("transformer.h", 2),
    ),
    (
        "T5ForConditionalGeneration",
        lambda: transformers.T5Config(
            d_model=32, d_kv=8, d_ff=64, num_layers=3, num_decoder_layers=2, num_heads=4, vocab_size=128
        ),
        {"T5Block": 5},
        _layers("encoder.block", 3) + _layers("decoder.block", 2),
    ),
    (
        "BartForConditionalGeneration",
        lambda: transformers.BartConfig(**_SEQ2SEQ),
        {"BartEncoderLayer": 3, "BartDecoderLayer": 2},
        _layers("model.encoder.layers", 3) + _layers("model.decoder.layers", 2),
    ),
    (
        "WhisperForConditionalGeneration",
        lambda: transformers.WhisperConfig(
            **_SEQ2SEQ,
            num_mel_bins=8,
            max_source_positions=16,
            max_target_positions=16,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=1,
        ),
        {"WhisperEncoderLayer": 3, "WhisperDecoderLayer": 2},
        _layers("model.encoder.layers", 3) + _layers("model.decoder.layers", 2),
    ),
    (
        "ViTForImageClassification",  # also lists ViTEmbeddings in _no_split_modules: not repeated, ignored
        lambda: transformers.ViTConfig(
            **{k: v for k, v in _SMALL.items() if k != "vocab_size"}, image_size=32, patch_size=8
        ),
        {"ViTLayer": 2},
        None,
    ),
    (
        "SwinForImageClassification",  # _no_split_modules names SwinStage: opened into its SwinLayers
        lambda: transformers.SwinConfig(
            image_size=32, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=4
        ),
        {"SwinLayer": 4},
        None,
    ),
    (
        "CLIPModel",
        _clip_config,
        {"CLIPEncoderLayer": 5},
        _layers("text_model.encoder.layers", 2) + _layers("vision_model.encoder.layers", 3),
    ),
]


@pytest.mark.parametrize(
    ("model_cls", "config", "expected", "expected_names"), HF_CASES, ids=[c[0] for c in HF_CASES]
)
def test_hugging_face_models(model_cls, config, expected, expected_names):
    if transformers is None:
        pytest.skip("transformers is not installed")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = getattr(transformers, model_cls)(config())
    found = find_blocks(model)
    assert dict(classes(found)) == expected
    if expected_names is not None:
        assert names(found) == expected_names
    order = [n for n, _ in model.named_modules()]
    assert names(found) == sorted(names(found), key=order.index)


# ------------------------------------------------------------------------------------- timm / torchvision


def _meta(build):
    with torch.device("meta"):
        return build()


@pytest.mark.parametrize(
    ("name", "expected", "first", "last"),
    [
        ("vit_tiny_patch16_224", {"Block": 12}, "blocks.0", "blocks.11"),
        ("deit_tiny_patch16_224", {"Block": 12}, "blocks.0", "blocks.11"),
        (
            "swin_tiny_patch4_window7_224",
            {"SwinTransformerBlock": 12},
            "layers.0.blocks.0",
            "layers.3.blocks.1",
        ),
        ("convnext_atto", {"ConvNeXtBlock": 12}, "stages.0.blocks.0", "stages.3.blocks.1"),
    ],
)
def test_timm_models(name, expected, first, last):
    timm = pytest.importorskip("timm")
    found = find_blocks(_meta(lambda: timm.create_model(name, pretrained=False)))
    assert dict(classes(found)) == expected
    assert (found[0][0], found[-1][0]) == (first, last)


@pytest.mark.parametrize(
    ("name", "expected", "first", "last"),
    [
        (
            "vit_b_16",
            {"EncoderBlock": 12},
            "encoder.layers.encoder_layer_0",
            "encoder.layers.encoder_layer_11",
        ),
        ("swin_t", {"SwinTransformerBlock": 12}, "features.1.0", "features.7.1"),
        ("swin_b", {"SwinTransformerBlock": 24}, "features.1.0", "features.7.1"),  # PatchMerging left out
        ("maxvit_t", {"MaxVitLayer": 11}, "blocks.0.layers.0", "blocks.3.layers.1"),
    ],
)
def test_torchvision_models(name, expected, first, last):
    models = pytest.importorskip("torchvision.models")
    found = find_blocks(_meta(lambda: getattr(models, name)(weights=None)))
    assert dict(classes(found)) == expected
    assert (found[0][0], found[-1][0]) == (first, last)
