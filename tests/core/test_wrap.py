import copy
import gc
import io
import pickle
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as _cp
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import CheckpointError, set_checkpoint_early_stop
from torch.utils.flop_counter import FlopCounterMode

from lightning_ckpt import ForeignCheckpointingError, apply_policy, get_plan, remove_checkpointing
from lightning_ckpt.core.replay import register_replay_hook
from lightning_ckpt.demos.gpt import GPT, GPTConfig

POLICIES = ["none", "all", "every:2", "first:2", "blocks:1,3", "group:2", "group:sqrt", "selective", "offload"]


class CountingBlock(nn.Module):
    """A pre-norm Transformer-ish block that counts executions of its forward body."""

    def __init__(self, width=32, dropout=0.1):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, 4, dropout=dropout, batch_first=True)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(dropout)
        self.calls = 0

    def forward(self, x, mask=None, scale=None):
        self.calls += 1
        h = self.norm(x)
        a, _ = self.attn(h, h, h, key_padding_mask=mask, need_weights=False)
        x = x + a
        x = x + self.drop(self.fc2(F.gelu(self.fc1(x))))
        return x if scale is None else x * scale


class Stack(nn.Module):
    def __init__(self, n=4, width=32, dropout=0.1):
        super().__init__()
        self.embed = nn.Embedding(50, width)
        self.blocks = nn.ModuleList(CountingBlock(width, dropout) for _ in range(n))
        self.head = nn.Linear(width, 50)

    def forward(self, idx, mask=None):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, mask=mask)
        return self.head(x)


def _grads(model, x_idx, seed=0, mask=None):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(x_idx, mask=mask)
    loss = out.float().pow(2).mean()
    loss.backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _calls(model):
    return [b.calls for b in model.blocks]


def _reset_calls(model):
    for b in model.blocks:
        b.calls = 0


@pytest.fixture
def stack():
    torch.manual_seed(0)
    return Stack()


@pytest.fixture
def idx():
    return torch.randint(0, 50, (3, 10))


@pytest.mark.parametrize("policy", POLICIES)
def test_bitwise_equal_outputs_and_grads_with_dropout(stack, idx, policy):
    reference = copy.deepcopy(stack)
    out_ref, grads_ref = _grads(reference, idx)
    plan = apply_policy(stack, policy)
    out, grads = _grads(stack, idx)
    assert torch.equal(out, out_ref)
    assert grads.keys() == grads_ref.keys()
    for name in grads:
        assert torch.equal(grads[name], grads_ref[name]), name
    expected_calls = [2 if m in ("recompute", "selective") else 1 for m in plan.modes]
    _reset_calls(stack)
    _grads(stack, idx)
    assert _calls(stack) == expected_calls


def test_input_gradients_bitwise_equal(stack):
    x = torch.randn(2, 6, 32, requires_grad=True)
    reference = copy.deepcopy(stack)
    torch.manual_seed(1)
    y_ref = x
    for b in reference.blocks:
        y_ref = b(y_ref)
    (g_ref,) = torch.autograd.grad(y_ref.sum(), x)
    apply_policy(stack, "all")
    torch.manual_seed(1)
    y = x
    for b in stack.blocks:
        y = b(y)
    (g,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(g, g_ref)


def test_without_rng_preservation_dropout_masks_differ(stack, idx):
    """The control that proves the bitwise test can fail."""
    reference = copy.deepcopy(stack)
    _, grads_ref = _grads(reference, idx)
    apply_policy(stack, "all", preserve_rng_state=False)
    _, grads = _grads(stack, idx)
    assert any(not torch.equal(grads[n], grads_ref[n]) for n in grads)


def test_forward_counter_training_eval_no_grad_inference(stack, idx):
    apply_policy(stack, "every:2")
    _grads(stack, idx)
    assert _calls(stack) == [2, 1, 2, 1]
    _reset_calls(stack)
    with torch.no_grad():
        stack(idx)
    with torch.inference_mode():
        stack(idx)
    stack.eval()
    out = stack(idx)
    out.sum().backward()  # eval with grad enabled: still no recompute
    assert _calls(stack) == [3, 3, 3, 3]


def _backward_flops(model, idx):
    model.zero_grad(set_to_none=True)
    out = model(idx)
    counter = FlopCounterMode(display=False)
    with counter:
        out.pow(2).mean().backward()
    return counter.get_total_flops()


def _forward_flops(model, idx):
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(idx)
    return counter.get_total_flops()


def test_backward_flops_rise_by_the_replayed_forwards(idx):
    torch.manual_seed(0)
    model = Stack(n=4, dropout=0.0)
    base = _backward_flops(model, idx)
    block_fwd = _forward_flops(model.blocks[0], model.embed(idx).detach())
    apply_policy(model, "all")
    with set_checkpoint_early_stop(False):
        full = _backward_flops(model, idx)
        apply_policy(model, "every:2")
        half = _backward_flops(model, idx)
    assert full - base == 4 * block_fwd
    assert half - base == 2 * block_fwd
    # with early stop (the default) replay ends once the tensors backward needs exist: the last matmul,
    # whose output nobody saved, is not recomputed
    apply_policy(model, "all")
    early = _backward_flops(model, idx)
    assert base + 0.5 * (full - base) < early < full
    apply_policy(model, "selective")
    selective = _backward_flops(model, idx)
    # every matmul and attention output is kept, so replay recomputes only FLOP-free pointwise ops
    assert base == selective < early


def _saved_bytes(model, idx):
    """Bytes packed by saved-tensor hooks, deduplicated by storage, parameters excluded."""
    seen, total = set(), [0]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in seen and key not in params:
            seen.add(key)
            total[0] += t.untyped_storage().nbytes()
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        out = model(idx)
    out.pow(2).mean().backward()
    return total[0]


def test_saved_bytes_decrease_strictly(idx):
    torch.manual_seed(0)
    model = Stack(n=6, dropout=0.0)
    sizes = {}
    for policy in ("none", "every:2", "all", "group:3"):
        apply_policy(model, policy)
        sizes[policy] = _saved_bytes(model, idx)
    assert sizes["none"] > sizes["every:2"] > sizes["all"] > sizes["group:3"]


def test_kwargs_none_inputs_and_masks(stack, idx):
    mask = torch.zeros(3, 10, dtype=torch.bool)
    mask[:, -2:] = True
    reference = copy.deepcopy(stack)
    out_ref, grads_ref = _grads(reference, idx, mask=mask)
    apply_policy(stack, "group:2")
    out, grads = _grads(stack, idx, mask=mask)
    assert torch.equal(out, out_ref)
    assert all(torch.equal(grads[n], grads_ref[n]) for n in grads)


class DictBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, *, extra=None, tag="t"):
        y = torch.tanh(self.lin(x))
        return {"hidden": y, "aux": None, "tag": tag}, (y.sum(), "str")


class DictStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(DictBlock() for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            out, _ = layer(x, extra=None, tag="k")
            x = out["hidden"]
        return x


@pytest.mark.parametrize("policy", ["all", "group:3", "selective"])
def test_tuple_and_dict_outputs(policy):
    torch.manual_seed(0)
    model = DictStack()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 8, requires_grad=True)
    ref(x).sum().backward()
    apply_policy(model, policy)
    model(x).sum().backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p.grad, q.grad), n


def test_frozen_embedding_still_trains_blocks(stack, idx):
    stack.embed.weight.requires_grad_(False)
    apply_policy(stack, "all")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, grads = _grads(stack, idx)
    assert "embed.weight" not in grads
    assert all(f"blocks.{i}.fc1.weight" in grads for i in range(4))


@pytest.mark.parametrize("policy", ["all", "group:2", "selective"])
def test_cpu_bf16_autocast(stack, idx, policy):
    reference = copy.deepcopy(stack)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.manual_seed(0)
        out_ref = reference(idx)
    out_ref.float().sum().backward()
    apply_policy(stack, policy)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.manual_seed(0)
        out = stack(idx)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert torch.equal(out, out_ref)
    for (n, p), (_, q) in zip(stack.named_parameters(), reference.named_parameters()):
        assert torch.equal(p.grad, q.grad), n


def test_autograd_grad_create_graph_matches():
    torch.manual_seed(0)
    model = DictStack()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 8, requires_grad=True)

    def second_order(m):
        (g,) = torch.autograd.grad(m(x).pow(2).sum(), x, create_graph=True)
        return torch.autograd.grad(g.pow(2).sum(), x)[0]

    expected = second_order(ref)
    apply_policy(model, "all")
    assert torch.equal(second_order(model), expected)


def _names(model):
    return (
        list(model.state_dict().keys()),
        [n for n, _ in model.named_parameters()],
        [n for n, _ in model.named_modules()],
        [n for n, _ in model.named_buffers()],
    )


def test_module_paths_never_change():
    model = GPT(GPTConfig.tiny())
    model.register_buffer("step_counter", torch.zeros(()))
    before = _names(model)
    plan = apply_policy(model, "all")
    assert _names(model) == before
    plan.retarget("every:2")
    assert _names(model) == before
    plan.set_modes(["selective", "off", "offload", "recompute"])
    assert _names(model) == before
    remove_checkpointing(model)
    assert _names(model) == before
    assert not any("_checkpoint_wrapped_module" in k for k in before[0])


def test_checkpoint_loads_strict_both_ways():
    torch.manual_seed(0)
    wrapped = GPT(GPTConfig.tiny())
    apply_policy(wrapped, "group:2")
    buffer = io.BytesIO()
    torch.save(wrapped.state_dict(), buffer)
    plain = GPT(GPTConfig.tiny())
    plain.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True), strict=True)
    for (n, p), (_, q) in zip(plain.named_parameters(), wrapped.named_parameters()):
        assert torch.equal(p, q), n
    other = GPT(GPTConfig.tiny())
    apply_policy(other, "selective")
    other.load_state_dict(plain.state_dict(), strict=True)


def test_remove_restores_plain_forward(stack, idx):
    apply_policy(stack, "all")
    remove_checkpointing(stack)
    assert get_plan(stack) is None
    assert all("forward" not in b.__dict__ for b in stack.blocks)
    _grads(stack, idx)
    assert _calls(stack) == [1, 1, 1, 1]
    remove_checkpointing(stack)  # no-op


def test_apply_twice_is_idempotent(stack, idx):
    plan = apply_policy(stack, "all")
    again = apply_policy(stack, "all")
    assert again is plan
    _grads(stack, idx)
    assert _calls(stack) == [2, 2, 2, 2]
    assert apply_policy(stack, "none", blocks="CountingBlock") is plan


def test_changing_selector_replaces_the_plan(stack):
    apply_policy(stack, "all")
    plan = apply_policy(stack, "all", blocks="blocks.0")
    assert plan.names == ("blocks.0",)
    assert "forward" not in stack.blocks[1].__dict__


def test_retarget_switches_modes_without_rewrapping(stack, idx):
    plan = apply_policy(stack, "none")
    forwards = [b.__dict__["forward"] for b in stack.blocks]
    plan.retarget("all")
    assert [b.__dict__["forward"] for b in stack.blocks] == forwards
    _grads(stack, idx)
    assert _calls(stack) == [2, 2, 2, 2]
    assert plan.num_checkpointed == 4 and plan.spec == "all"


def test_plan_state_dict_round_trip(stack):
    plan = apply_policy(stack, "every:2")
    plan.set_modes(["recompute", "recompute", "off", "off"])
    state = plan.state_dict()
    assert state == {
        "version": 1,
        "policy": "modes:recompute,recompute,off,off",
        "names": ["blocks.0", "blocks.1", "blocks.2", "blocks.3"],
        "modes": ["recompute", "recompute", "off", "off"],
    }
    fresh = Stack()
    other = apply_policy(fresh, "none").load_state_dict(state)
    assert other.modes == ("recompute", "recompute", "off", "off")


def test_summary_names_every_block(stack):
    plan = apply_policy(stack, "group:2")
    text = plan.summary()
    assert "group:2" in text and "4/4" in text
    assert all(f"blocks.{i}" in text for i in range(4))
    assert "0-1" in text and "2-3" in text


def test_deepcopy_and_pickle_keep_the_plan(stack, idx):
    apply_policy(stack, "group:2")
    for clone in (copy.deepcopy(stack), pickle.loads(pickle.dumps(stack))):
        _reset_calls(clone)
        _grads(clone, idx)
        assert _calls(clone) == [2, 2, 2, 2]
        assert get_plan(clone) is not None and get_plan(clone).blocks[0] is clone.blocks[0]


def test_reentrant_is_refused(stack):
    with pytest.raises(ValueError, match="use_reentrant=True is not supported"):
        apply_policy(stack, "all", use_reentrant=True)
    assert get_plan(stack) is None


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"policy": "evry:2"}, "Did you mean 'every'"),
        ({"policy": "blocks:7"}, "valid indices 0-3"),
        ({"policy": "first:99"}, r"^policy 'first:99' asks for the first 99 blocks but the model has 4 blocks"),
        ({"policy": "budget:1MiB"}, r"^policy 'budget:1MiB' is chosen from measured activation memory"),  # as written
        ({"determinism_check": "strict"}, r"choose one of \['default', 'none'\]"),
        ({"preserve_rng_state": "yes"}, "must be True or False"),
        ({"blocks": "NoSuchBlock"}, "matched no module"),
    ],
)
def test_bad_input_errors(stack, kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        apply_policy(stack, **kwargs)
    assert all("forward" not in b.__dict__ for b in stack.blocks)


def test_foreign_checkpoint_wrapper_is_reported(stack):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    stack.blocks[0] = checkpoint_wrapper(stack.blocks[0])
    with pytest.raises(ForeignCheckpointingError, match="_checkpoint_wrapped_module"):
        apply_policy(stack, "all")


def test_foreign_composable_checkpoint_is_reported(stack):
    from torch.distributed._composable import checkpoint

    checkpoint(stack.blocks[1])
    with pytest.raises(ForeignCheckpointingError, match="_composable.checkpoint"):
        apply_policy(stack, "all")


def _tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=4, n_embd=32, n_head=4, n_positions=32, vocab_size=64, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def test_hf_gradient_checkpointing_is_refused_naming_the_installed_transformers_own_switch():
    """transformers 5.24 deprecates gradient_checkpointing_disable() (a FutureWarning, "removed in v6") for
    activation_checkpointing_disable(); 5.17 has only the old name. The refusal names the call that exists here, and
    that call, made as written, switches Hugging Face's checkpointing off without a deprecation warning."""
    model = _tiny_gpt2()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # whichever name the installed version deprecates
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with pytest.raises(ForeignCheckpointingError, match=r"'transformer' has Hugging Face gradient") as err:
        apply_policy(model, "all")
    named = next(m for m in ("activation_checkpointing_disable", "gradient_checkpointing_disable") if hasattr(model, m))
    assert f"call model.{named}() first" in str(err.value)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        getattr(model, named)()  # what the message says, as it says it
    with pytest.warns(UserWarning, match="use_cache=False"):
        assert apply_policy(model, "all").num_checkpointed == 4


class _OldHFModel(nn.Module):
    """A Hugging Face model as transformers 5.17 has it: only gradient_checkpointing_disable()."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.layers[0].gradient_checkpointing = True

    def gradient_checkpointing_disable(self):
        self.layers[0].gradient_checkpointing = False


def test_the_hf_refusal_names_what_the_model_has_on_the_module_that_has_it():
    class Wrapper(nn.Module):  # a LightningModule-like holder of the Hugging Face model
        def __init__(self):
            super().__init__()
            self.backbone = _OldHFModel()

    with pytest.raises(ForeignCheckpointingError, match=r"call model\.backbone\.gradient_checkpointing_disable\(\) "
                                                        "first"):
        apply_policy(Wrapper(), "all", blocks=nn.Linear)
    plain = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    plain[1].gradient_checkpointing = True  # no Hugging Face method at all: the flag itself
    with pytest.raises(ForeignCheckpointingError, match=r"call model\.1\.gradient_checkpointing = False first"):
        apply_policy(plain, "all", blocks=nn.Linear)


def _tiny_bert(kind="BertForMaskedLM", **overrides):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                     vocab_size=64, max_position_embeddings=32, **overrides)
    torch.manual_seed(0)
    return getattr(transformers, kind)(config)


def _tiny_roberta():
    transformers = pytest.importorskip("transformers")
    config = transformers.RobertaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=64, vocab_size=64, max_position_embeddings=40)
    return transformers.RobertaForMaskedLM(config)


@pytest.mark.parametrize("build", [_tiny_bert, lambda: _tiny_bert("BertModel"), _tiny_roberta],
                         ids=["bert-mlm", "bert-encoder", "roberta-mlm"])
def test_masked_lms_keep_use_cache_and_get_no_warning(build):
    """BERT and RoBERTa carry use_cache=True but, as encoders, never build a cache: nothing to switch off, no advice
    about generate() (the trial of 32 architectures saw the warning fire for them)."""
    model = build()
    assert model.config.use_cache is True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_policy(model, "all")
    assert [str(w.message) for w in caught if "use_cache" in str(w.message)] == []
    assert model.config.use_cache is True
    ids = torch.randint(0, 64, (2, 12))
    model.train()
    out = model(input_ids=ids)
    out[0].sum().backward()  # trains, checkpointed, with the cache flag left as the user had it


@pytest.mark.parametrize("build", [
    _tiny_gpt2,
    lambda: _tiny_bert("BertLMHeadModel", is_decoder=True),  # BERT as a decoder builds a cache
    lambda: pytest.importorskip("transformers").GPT2Model(_tiny_gpt2().config),  # a base decoder, no generate()
    lambda: pytest.importorskip("transformers").T5ForConditionalGeneration(pytest.importorskip("transformers").T5Config(
        d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8, vocab_size=64, decoder_start_token_id=0)),
], ids=["gpt2", "bert-decoder", "gpt2-base", "t5"])
def test_models_with_a_generation_cache_get_it_switched_off_warned_at_the_users_call(build):
    model = build()
    assert model.config.use_cache is True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_policy(model, "all")  # the warning points here
    ours = [w for w in caught if "use_cache=False" in str(w.message)]
    assert len(ours) == 1 and model.config.use_cache is False
    assert ours[0].filename == __file__, ours[0].filename  # the user's line, not the plugin's
    generates = callable(getattr(model, "generate", None))
    assert ("generate() takes use_cache=True" in str(ours[0].message)) == generates


def test_the_use_cache_warning_of_a_later_retarget_points_at_that_call():
    model = _tiny_gpt2()
    plan = apply_policy(model, "none")  # nothing checkpointed: the cache stays on
    assert model.config.use_cache is True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan.retarget("every:2")
    ours = [w for w in caught if "use_cache=False" in str(w.message)]
    assert len(ours) == 1 and ours[0].filename == __file__


def test_hf_gpt2_use_cache_forced_off_once_and_grads_equal():
    model = _tiny_gpt2()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2, 12))
    assert model.config.use_cache is True
    with pytest.warns(UserWarning, match="use_cache=False") as record:
        plan = apply_policy(model, "all")
    assert len([w for w in record if "use_cache" in str(w.message)]) == 1
    assert model.config.use_cache is False and plan.names[0] == "transformer.h.0"
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        plan.retarget("every:2")  # already off: no second warning
    plan.retarget("group:2")
    # like with like: the reference runs without the cache too (transformers 5.x computes the two paths
    # differently in the last bits, so a use_cache=True reference is not bitwise comparable)
    reference.config.use_cache = False
    for m in (model, reference):
        torch.manual_seed(0)
        m(input_ids=ids, labels=ids).loss.backward()
    for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(p.grad, q.grad), n


def test_remove_checkpointing_gives_use_cache_back(tmp_path):
    model = _tiny_gpt2()
    with pytest.warns(UserWarning, match="use_cache=False"):
        plan = apply_policy(model, "all")
    plan.retarget("none")
    plan.retarget("every:2")  # switched off once, remembered once
    assert model.config.use_cache is False
    remove_checkpointing(model)
    assert model.config.use_cache is True
    model.save_pretrained(tmp_path)  # what a user saves after training says what they had
    assert '"use_cache": true' in (tmp_path / "config.json").read_text()
    off = _tiny_gpt2()
    off.config.use_cache = False  # the user's own choice is left alone
    apply_policy(off, "all")
    remove_checkpointing(off)
    assert off.config.use_cache is False


class NonDeterministicBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        # reads mutable Python state: the replay draws a different shape
        rows = x[: x.shape[0] - (self.calls % 2)]
        return torch.tanh(self.lin(rows)).sum(0, keepdim=True).expand_as(x)


def test_determinism_check_catches_a_block_whose_replay_differs():
    model = nn.Sequential(NonDeterministicBlock(), NonDeterministicBlock())
    apply_policy(model, "all", blocks=NonDeterministicBlock)
    out = model(torch.randn(3, 4, requires_grad=True))
    with pytest.raises(CheckpointError):
        out.sum().backward()


def test_no_graph_leak_after_backward(stack, idx):
    apply_policy(stack, "group:2")
    alive = []
    for block in stack.blocks:
        block.fc1.register_forward_hook(lambda mod, args, out: alive.append(weakref.ref(out)))
    out = stack(idx)
    out.sum().backward()
    del out
    gc.collect()
    assert len(alive) == 8  # first forward and replay of every block
    assert all(ref() is None for ref in alive)


class Gappy(nn.Module):
    """The parent does its own saving work between blocks, and changes the hidden state."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(CountingBlock(16, 0.1) for _ in range(4))
        self.gate = nn.Parameter(torch.ones(16))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
            x = torch.sigmoid(x) * self.gate  # saves tensors outside any block
        return x


def test_group_region_with_parent_work_between_blocks():
    torch.manual_seed(0)
    model = Gappy()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 5, 16, requires_grad=True)
    for m in (reference, model):
        if m is model:
            apply_policy(m, "group:2")
        torch.manual_seed(3)
        m(x).sum().backward()
    for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(p.grad, q.grad), n
    assert [b.calls for b in model.blocks] == [2, 2, 2, 2]


class EarlyExit(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(CountingBlock(16, 0.0) for _ in range(4))

    def forward(self, x, depth=4):
        for block in self.blocks[:depth]:
            x = block(x)
        return x


def test_group_region_left_open_is_closed_and_reported():
    torch.manual_seed(0)
    model = EarlyExit()
    reference = copy.deepcopy(model)
    apply_policy(model, "group:2")
    x = torch.randn(2, 5, 16)
    with pytest.warns(RuntimeWarning, match="left open"):
        out = model(x, depth=3)
    out.sum().backward()
    reference(x, depth=3).sum().backward()
    for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        if q.grad is not None:
            assert torch.equal(p.grad, q.grad), n
    # a complete pass afterwards works normally
    model.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        model(x).sum().backward()


def test_group_region_exception_inside_a_block_leaves_no_hooks_behind():
    model = EarlyExit()
    apply_policy(model, "group:4")
    with pytest.raises(RuntimeError):
        model(torch.randn(2, 5, 7))  # wrong width: the first block fails inside an open region
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    model(torch.randn(2, 5, 16)).sum().backward()


def test_group_sqrt_on_the_demo_gpt_matches_plain_training():
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny(n_layer=9, dropout=0.1))
    reference = copy.deepcopy(model)
    plan = apply_policy(model, "group:sqrt")
    assert [r for r in plan.layout.groups] == [(0, 3), (3, 6), (6, 9)]
    idx = torch.randint(0, 96, (2, 16))
    for m in (model, reference):
        torch.manual_seed(0)
        _, loss = m(idx, idx)
        loss.backward()
    for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(p.grad, q.grad), n


@pytest.mark.gpu
def test_cuda_peak_memory_falls_with_checkpointing():
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = GPT(GPTConfig.benchmark()).to(device)
    idx = torch.randint(0, 512, (4, 512), device=device)
    peaks = {}
    for policy in ("none", "every:2", "all"):
        apply_policy(model, policy)
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        _, loss = model(idx, idx)
        loss.backward()
        torch.cuda.synchronize()
        peaks[policy] = torch.cuda.max_memory_allocated()
    assert peaks["none"] > peaks["every:2"] > peaks["all"]


@pytest.mark.gpu
def test_cuda_rng_preserved_with_dropout():
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = Stack().to(device)
    ref = copy.deepcopy(model)
    idx = torch.randint(0, 50, (3, 10), device=device)
    _, g_ref = _grads(ref, idx)
    apply_policy(model, "all")
    _, g = _grads(model, idx)
    assert all(torch.equal(g[n], g_ref[n]) for n in g)


def test_plan_state_for_other_blocks_warns_instead_of_failing(stack):
    plan = apply_policy(stack, "every:2")
    state = {"version": 1, "policy": "modes:recompute,off", "names": ["a.0", "a.1"], "modes": ["recompute", "off"]}
    with pytest.warns(RuntimeWarning, match="different blocks"):
        plan.load_state_dict(state)
    assert plan.spec == "every:2"
    with pytest.warns(RuntimeWarning, match="only its policy 'all'"):
        plan.load_state_dict(dict(state, policy="all"))
    assert plan.spec == "all"


def test_an_instance_forward_set_by_someone_else_keeps_running_and_comes_back(stack, idx):
    """A bound method (accelerate-style hooks) is called with the block; a plain callable, as nn.Module calls an
    instance attribute (torch.compile's wrapper forward), without it; remove_checkpointing gives each back."""
    reference = copy.deepcopy(stack)
    seen = []
    plain = stack.blocks[0]

    def plain_forward(x, mask=None):  # nn.Module calls an instance attribute as block.forward(x, mask=...)
        seen.append("plain")
        return type(plain).forward(plain, x, mask=mask)

    def method(self, x, mask=None):
        seen.append("bound")
        return type(self).forward(self, x, mask=mask)

    plain.forward = plain_forward
    stack.blocks[1].forward = method.__get__(stack.blocks[1])
    apply_policy(stack, "all")
    out, grads = _grads(stack, idx)
    expected, expected_grads = _grads(reference, idx)
    assert seen == ["plain", "bound", "bound", "plain"]  # forward, then the replays in backward (last block first)
    torch.testing.assert_close(out, expected)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, msg=name)
    remove_checkpointing(stack)
    assert stack.blocks[0].forward is plain_forward
    assert stack.blocks[1].forward.__func__ is method and stack.blocks[1].forward.__self__ is stack.blocks[1]


# ------------------------------------------------------------------ RNG of every device a block receives


class KeywordBlock(nn.Module):
    """Receives every tensor by keyword, one nested in a dict of tuples; ``debug`` is also a ``checkpoint`` keyword."""

    def __init__(self, width=16):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.drop = nn.Dropout(0.2)
        self.calls = 0
        self.counting = True

    def forward(self, *, x, extras=None, debug=False):
        if self.counting:  # a side effect torch.compile cannot trace inside a checkpoint
            self.calls += 1
        y = self.drop(torch.tanh(self.lin(x)))
        if extras is not None:
            y = y * extras["scale"][0]
        return x + y if not debug else x + 2 * y


class KeywordStack(nn.Module):
    def __init__(self, n=4, width=16):
        super().__init__()
        self.blocks = nn.ModuleList(KeywordBlock(width) for _ in range(n))

    def forward(self, h, scale=None):
        extras = None if scale is None else {"scale": (scale,)}
        for block in self.blocks:
            h = block(x=h, extras=extras, debug=True)
        return h


@pytest.fixture
def device_collection(monkeypatch):
    """The ids of the tensors ``checkpoint`` hands to its device-state collection, one set per checkpoint frame.

    ``_infer_device_type`` picks the device module whose RNG states ``get_device_states`` then saves, from the same
    arguments; on the CPU it is the part of that collection that runs (no accelerator is initialised)."""
    seen = []
    original = _cp._infer_device_type

    def record(*args):
        seen.append({id(t) for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)})
        return original(*args)

    monkeypatch.setattr(_cp, "_infer_device_type", record)
    return seen


def _block_inputs(model):
    inputs = []
    for block in model.blocks:
        block.register_forward_pre_hook(lambda m, args, kwargs: inputs.append(kwargs["x"]), with_kwargs=True)
    return inputs


@pytest.mark.parametrize("policy, frames", [("all", [0, 1, 2, 3]), ("selective", [0, 1, 2, 3]), ("group:2", [0, 2])])
def test_keyword_tensors_reach_checkpoints_device_state_collection(device_collection, policy, frames):
    torch.manual_seed(0)
    model = KeywordStack()
    apply_policy(model, policy)
    inputs = _block_inputs(model)
    scale = torch.full((16,), 0.5)
    out = model(torch.randn(2, 3, 16), scale)
    assert len(device_collection) == len(frames)
    for seen, block in zip(device_collection, frames):
        assert id(inputs[block]) in seen, f"block {block}'s keyword input is not among the device-state inputs"
        assert id(scale) in seen  # nested in a dict of tuples
    out.sum().backward()


@pytest.mark.parametrize("policy", ["all", "selective", "group:2", "group:4"])
def test_keyword_only_blocks_train_bitwise_and_replay_once(policy):
    torch.manual_seed(0)
    model = KeywordStack()
    reference = copy.deepcopy(model)
    x, scale = torch.randn(2, 3, 16, requires_grad=True), torch.full((16,), 0.5, requires_grad=True)
    results = []
    for m in (reference, model):
        if m is model:
            apply_policy(m, policy)
        _reset_calls(m)
        torch.manual_seed(3)
        m(x, scale).pow(2).mean().backward()
        results.append(({n: p.grad.clone() for n, p in m.named_parameters()}, x.grad.clone(), scale.grad.clone()))
        x.grad = scale.grad = None
    (grads_ref, x_ref, s_ref), (grads, x_grad, s_grad) = results
    assert torch.equal(x_grad, x_ref) and torch.equal(s_grad, s_ref)
    assert all(torch.equal(grads[n], grads_ref[n]) for n in grads)
    assert _calls(model) == [2, 2, 2, 2]


@pytest.mark.parametrize("policy", ["all", "group:2"])
def test_replay_hooks_still_see_the_keyword_arguments(policy):
    torch.manual_seed(0)
    model = KeywordStack()
    apply_policy(model, policy)
    seen = []

    def hook(owner, fn, args, kwargs):
        seen.append((args, sorted(kwargs)))
        return fn(*args, **kwargs)

    with register_replay_hook(hook):
        model(torch.randn(2, 3, 16), torch.ones(16)).sum().backward()
    assert seen and all(entry == ((), ["debug", "extras", "x"]) for entry in seen)


@pytest.mark.parametrize("policy", ["all", "selective"])
def test_keyword_only_blocks_compile_into_one_graph(policy):
    torch.manual_seed(0)
    model = KeywordStack()
    for block in model.blocks:
        block.counting, block.drop.p = False, 0.0
    reference = copy.deepcopy(model)
    apply_policy(model, policy)
    x, scale = torch.randn(2, 3, 16), torch.full((16,), 0.5)
    reference(x, scale).pow(2).mean().backward()
    torch.compile(model, backend="aot_eager", fullgraph=True)(x, scale).pow(2).mean().backward()
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["all", "group:2"])
def test_cuda_rng_preserved_for_keyword_only_inputs(policy):
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = KeywordStack(width=64).to(device)
    reference = copy.deepcopy(model)
    x = torch.randn(4, 32, 64, device=device)
    grads = []
    for m in (reference, model):
        if m is model:
            apply_policy(m, policy)
        torch.manual_seed(5)
        m(x).pow(2).mean().backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
    assert all(torch.equal(grads[1][n], grads[0][n]) for n in grads[0])


EVERY_POLICY = POLICIES + ["selective:mm", "selective:gelu,mm", "group:3", "modes:selective,off,recompute,offload"]


@pytest.mark.parametrize("policy", EVERY_POLICY)
def test_torch_save_pickle_and_deepcopy_under_every_policy(stack, idx, policy):
    plan = apply_policy(stack, policy)
    reference = copy.deepcopy(stack)
    remove_checkpointing(reference)
    _, expected = _grads(reference, idx)
    buffer = io.BytesIO()
    torch.save(stack, buffer)
    buffer.seek(0)
    clones = [copy.deepcopy(stack), pickle.loads(pickle.dumps(stack)), torch.load(buffer, weights_only=False)]
    for clone in clones:
        cloned = get_plan(clone)
        assert cloned.spec == plan.spec and cloned.modes == plan.modes
        assert cloned.layout.save_ops == plan.layout.save_ops and cloned.shared.save_ops == plan.shared.save_ops
        _, grads = _grads(clone, idx)
        for name in expected:
            assert torch.equal(grads[name], expected[name]), (policy, name)


@pytest.mark.parametrize("policy", EVERY_POLICY)
def test_every_plans_state_round_trips_spec_modes_and_save_list(stack, policy):
    plan = apply_policy(stack, policy)
    if policy.startswith("selective"):
        plan.set_modes(["selective", "off", "selective", "recompute"])
    state = torch.load(_saved(plan.state_dict()), weights_only=True)
    fresh = apply_policy(Stack(), "none").load_state_dict(state)
    assert fresh.spec == plan.spec and fresh.modes == plan.modes and fresh.layout == plan.layout
    assert fresh.policy == plan.policy


def _saved(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return buffer
