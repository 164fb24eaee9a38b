"""Policy grammar, canonical specs, layouts and errors (``lightning_ckpt.core.policy``)."""

import copy
import dataclasses
import pickle
import re

import pytest
import torch
from _torch_features import needs_compiler_budget

from lightning_ckpt.core.policy import (
    GRAMMAR,
    MODES,
    SELECTIVE_ALIASES,
    AllPolicy,
    BlocksPolicy,
    BudgetPolicy,
    EveryPolicy,
    FirstPolicy,
    GroupPolicy,
    Layout,
    ModesPolicy,
    NonePolicy,
    OffloadPolicy,
    Policy,
    SelectivePolicy,
    parse_policy,
)
from lightning_ckpt.core.units import GiB

OFF, RE = "off", "recompute"


def _present(*names):
    return tuple(n for n in names if hasattr(torch.ops.aten, n))


MM_OPS = _present(*SELECTIVE_ALIASES["mm"])
SDPA_OPS = _present(*SELECTIVE_ALIASES["sdpa"])

# --------------------------------------------------------------------------------------------- grammar

PARSED = [
    ("none", NonePolicy(), "none"),
    ("all", AllPolicy(), "all"),
    ("every:2", EveryPolicy(2), "every:2"),
    ("every:3", EveryPolicy(3), "every:3"),
    ("first:4", FirstPolicy(4), "first:4"),
    ("first:0", FirstPolicy(0), "first:0"),
    ("blocks:0-5,9", BlocksPolicy((0, 1, 2, 3, 4, 5, 9)), "blocks:0-5,9"),
    ("blocks:9,0-2,1", BlocksPolicy((0, 1, 2, 9)), "blocks:0-2,9"),  # sorted, deduplicated, re-compressed
    ("blocks:7", BlocksPolicy((7,)), "blocks:7"),
    ("group:4", GroupPolicy(4), "group:4"),
    ("group:sqrt", GroupPolicy("sqrt"), "group:sqrt"),
    ("selective", SelectivePolicy(("mm", "sdpa")), "selective"),
    ("selective:mm,sdpa", SelectivePolicy(("mm", "sdpa")), "selective"),  # the default list prints short
    ("selective:mm", SelectivePolicy(("mm",)), "selective:mm"),
    ("selective:conv,gelu", SelectivePolicy(("conv", "gelu")), "selective:conv,gelu"),
    ("offload", OffloadPolicy(), "offload"),
    ("budget:18GiB", BudgetPolicy(18 * GiB), "budget:18GiB"),  # the user's own units, not bytes
    ("budget:1MiB", BudgetPolicy(2**20), "budget:1MiB"),
    ("budget: 512 mib ", BudgetPolicy(512 * 2**20), "budget:512mib"),  # as written, one word
    ("budget:2.5GB", BudgetPolicy(2_500_000_000), "budget:2.5GB"),
    ("budget:1048576", BudgetPolicy(2**20), "budget:1048576"),
    ("budget:0.8", BudgetPolicy(0.8), "budget:0.8"),
    ("budget:1.0", BudgetPolicy(1.0), "budget:1.0"),
    ("modes:off,recompute,selective", ModesPolicy((OFF, RE, "selective")), "modes:off,recompute,selective"),
    # whitespace and the name's case are forgiven
    ("  Every : 2 ", EveryPolicy(2), "every:2"),
    ("ALL", AllPolicy(), "all"),
    ("blocks: 0 - 2 , 4", BlocksPolicy((0, 1, 2, 4)), "blocks:0-2,4"),
]


@pytest.mark.parametrize(("text", "expected", "spec"), PARSED, ids=[p[0] for p in PARSED])
def test_parse_and_canonical_spec(text, expected, spec):
    policy = parse_policy(text)
    assert policy == expected
    assert type(policy) is type(expected)
    assert policy.spec == spec
    assert str(policy) == spec


@pytest.mark.parametrize("text", [p[0] for p in PARSED])
def test_spec_round_trips(text):
    policy = parse_policy(text)
    again = parse_policy(policy.spec)
    assert again == policy
    assert again.spec == policy.spec
    assert hash(again) == hash(policy)


def test_budget_values_are_parsed_to_bytes_or_fraction():
    assert parse_policy("budget:18GiB").budget == 19327352832
    assert isinstance(parse_policy("budget:18GiB").budget, int)
    assert parse_policy("budget:0.8").budget == 0.8
    assert isinstance(parse_policy("budget:0.8").budget, float)
    assert parse_policy("budget:512MiB").budget == 512 * 1024**2
    assert parse_policy("budget:2.5GB").budget == 2_500_000_000


def test_policy_objects_and_none_pass_through():
    policy = EveryPolicy(3)
    assert parse_policy(policy) is policy
    assert parse_policy(None) == NonePolicy()
    assert all(isinstance(parse_policy(t), Policy) for t, _, _ in PARSED)


def test_distinct_policies_are_not_equal():
    assert NonePolicy() != AllPolicy()
    assert EveryPolicy(2) != EveryPolicy(3)
    assert GroupPolicy(4) != GroupPolicy("sqrt")
    assert len({parse_policy(t) for t in ("all", "all", "every:2", "every:2", "none")}) == 3


def test_grammar_string_lists_every_form():
    for form in (
        "none",
        "all",
        "every:N",
        "first:K",
        "blocks:0-5,9",
        "group:K",
        "group:sqrt",
        "selective",
        "selective:mm,sdpa",
        "offload",
        "budget:",
    ):
        assert form in GRAMMAR


# --------------------------------------------------------------------------------------------- frozen


@pytest.mark.parametrize(
    ("policy", "field"),
    [
        (EveryPolicy(2), "n"),
        (FirstPolicy(2), "k"),
        (BlocksPolicy((1,)), "indices"),
        (GroupPolicy(2), "k"),
        (SelectivePolicy(), "ops"),
        (BudgetPolicy(0.5), "budget"),
        (ModesPolicy((OFF,)), "modes"),
        (NonePolicy(), "anything"),
        (AllPolicy(), "anything"),
        (OffloadPolicy(), "anything"),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, Policy) else v,
)
def test_policies_are_frozen(policy, field):
    before = policy.spec
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(policy, field, 5)
    assert policy.spec == before


def test_layout_is_frozen():
    layout = AllPolicy().layout(3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.modes = ()


# --------------------------------------------------------------------------------------------- layouts (L=12)


def _recomputed(layout):
    return [i for i, mode in enumerate(layout.modes) if mode == RE]


@pytest.mark.parametrize(
    ("text", "indices"),
    [
        ("none", []),
        ("all", list(range(12))),
        ("every:1", list(range(12))),
        ("every:2", [0, 2, 4, 6, 8, 10]),
        ("every:3", [0, 3, 6, 9]),
        ("every:5", [0, 5, 10]),
        ("every:12", [0]),
        ("every:20", [0]),
        ("first:0", []),
        ("first:3", [0, 1, 2]),
        ("blocks:0-5,9", [0, 1, 2, 3, 4, 5, 9]),
        ("blocks:11", [11]),
    ],
)
def test_block_layouts_for_12_blocks(text, indices):
    layout = parse_policy(text).layout(12)
    assert len(layout.modes) == 12
    assert _recomputed(layout) == indices
    assert set(layout.modes) <= {OFF, RE}
    assert layout.num_checkpointed == len(indices)
    assert layout.groups == ()
    assert layout.save_ops == ()


@pytest.mark.parametrize(
    ("text", "num_blocks", "groups"),
    [
        ("group:sqrt", 12, ((0, 4), (4, 8), (8, 12))),  # ceil(sqrt(12)) = 4
        ("group:sqrt", 16, ((0, 4), (4, 8), (8, 12), (12, 16))),
        ("group:sqrt", 10, ((0, 4), (4, 8), (8, 10))),  # ceil(sqrt(10)) = 4
        ("group:sqrt", 2, ((0, 2),)),
        ("group:4", 12, ((0, 4), (4, 8), (8, 12))),
        ("group:5", 12, ((0, 5), (5, 10), (10, 12))),
        ("group:4", 13, ((0, 4), (4, 8), (8, 12))),  # block 12 alone: its own region, no group
        ("group:12", 12, ((0, 12),)),
        ("group:1", 12, ()),  # one-block groups are plain regions
        ("group:sqrt", 1, ()),
    ],
)
def test_group_layouts(text, num_blocks, groups):
    layout = parse_policy(text).layout(num_blocks)
    assert layout.modes == (RE,) * num_blocks
    assert layout.groups == groups
    assert layout.num_checkpointed == num_blocks


def test_group_size():
    assert GroupPolicy("sqrt").size(12) == 4
    assert GroupPolicy("sqrt").size(9) == 3
    assert GroupPolicy("sqrt").size(0) == 1
    assert GroupPolicy(5).size(12) == 5


def test_selective_layouts_expand_aliases_to_aten_ops():
    layout = parse_policy("selective").layout(12)
    assert layout.modes == ("selective",) * 12
    assert layout.num_checkpointed == 12
    assert layout.groups == ()
    assert layout.save_ops == MM_OPS + SDPA_OPS
    assert {"mm", "addmm", "bmm"} <= set(layout.save_ops)
    assert parse_policy("selective:mm").layout(2).save_ops == MM_OPS
    assert parse_policy("selective:sdpa,mm").layout(2).save_ops == SDPA_OPS + MM_OPS
    assert parse_policy("selective:conv,gelu").layout(2).save_ops == ("convolution", "gelu")
    assert parse_policy("selective:mm,addmm").aten_ops() == MM_OPS  # addmm already in the alias: not repeated


def test_offload_layout():
    layout = parse_policy("offload").layout(12)
    assert layout.modes == ("offload",) * 12
    assert layout.num_checkpointed == 12


def test_modes_policy_layout():
    layout = ModesPolicy((OFF, RE, "selective", "offload")).layout(4)
    assert layout.modes == (OFF, RE, "selective", "offload")
    assert layout.num_checkpointed == 3
    assert layout.save_ops == MM_OPS + SDPA_OPS  # selective blocks get the default save list
    assert ModesPolicy((OFF, RE)).layout(2).save_ops == ()
    with pytest.raises(ValueError, match=r"^3 block modes given for a model with 2 blocks\.$"):
        ModesPolicy((OFF, RE, RE)).layout(2)


def test_every_mode_is_a_known_mode():
    assert MODES == ("off", "recompute", "selective", "offload")
    for text, _, _ in PARSED:
        policy = parse_policy(text)
        if not isinstance(policy, (BudgetPolicy, ModesPolicy)):
            assert set(policy.layout(12).modes) <= set(MODES)


def test_layouts_for_zero_blocks():
    assert parse_policy("all").layout(0) == Layout(())
    assert parse_policy("every:2").layout(0) == Layout(())
    assert parse_policy("group:sqrt").layout(0) == Layout(())


def test_blocks_policy_out_of_range_fails_at_layout_time():
    policy = parse_policy("blocks:0-5,12,14")  # fine on its own
    assert policy.layout(15).num_checkpointed == 8
    with pytest.raises(ValueError) as err:
        policy.layout(12)
    assert str(err.value) == (
        "policy 'blocks:0-5,12,14' names block indices [12, 14] but the model has 12 blocks "
        "(valid indices 0-11); fix the index list."
    )


def test_first_k_beyond_the_block_count_fails_at_layout_time_like_blocks():
    policy = parse_policy("first:99")  # fine on its own: the block count is known when it is applied
    assert policy.layout(99).num_checkpointed == 99
    assert parse_policy("first:2").layout(2).num_checkpointed == 2
    with pytest.raises(ValueError) as err:
        policy.layout(2)
    assert str(err.value) == ("policy 'first:99' asks for the first 99 blocks but the model has 2 blocks; pass "
                              "'first:2' or fewer (or 'all').")


def test_budget_policy_needs_measurement():
    for text in ("budget:18GiB", "budget:0.8"):
        with pytest.raises(
            ValueError,
            match=rf"^policy '{text}' is chosen from measured activation memory, so it cannot be applied statically",
        ):
            parse_policy(text).layout(12)


def test_a_budget_echoes_the_users_units_and_computes_in_bytes():
    policy = parse_policy("budget:1MiB")
    assert policy.budget == 2**20 and isinstance(policy.budget, int)  # computing: bytes
    assert policy.spec == str(policy) == "budget:1MiB"  # showing: as written
    assert parse_policy(policy.spec) == policy == BudgetPolicy(2**20) == parse_policy("budget:1048576")
    assert hash(policy) == hash(BudgetPolicy(2**20))
    assert copy.deepcopy(policy).spec == pickle.loads(pickle.dumps(policy)).spec == "budget:1MiB"
    assert BudgetPolicy(0.5).spec == "budget:0.5" and BudgetPolicy("0.5").budget == 0.5


BUDGET_HELP = ("is not a budget: pass a positive size such as '18GiB' or '512MiB' (units B, KiB, MiB, GiB, TiB, KB, "
               "MB, GB, TB) or a fraction of capacity in (0, 1] such as 0.8.")


@pytest.mark.parametrize("value", ["-1GiB", "0", "0GiB", "0.0", "1.5", "-0.5", "18 parsecs", "nan", "inf", "GiB"])
def test_every_bad_budget_gets_the_same_words(value):
    """'budget:-1GiB' and 'budget:0' once got differently worded errors: one wording, naming the value."""
    with pytest.raises(ValueError) as err:
        parse_policy(f"budget:{value}")
    assert str(err.value) == f"Malformed policy 'budget:{value}': budget={value!r} {BUDGET_HELP} Valid policies: " \
                             f"{GRAMMAR}."
    with pytest.raises(ValueError) as err:
        BudgetPolicy(value)
    assert str(err.value) == f"budget={value!r} {BUDGET_HELP}"


# --------------------------------------------------------------------------------------------- errors


def test_unknown_name_lists_the_grammar_and_suggests():
    with pytest.raises(ValueError) as err:
        parse_policy("evry:2")
    assert str(err.value) == f"Unknown policy 'evry:2'. Did you mean 'every'? Valid policies: {GRAMMAR}."
    with pytest.raises(ValueError, match=r"^Unknown policy 'selectve'\. Did you mean 'selective'\?"):
        parse_policy("selectve")
    with pytest.raises(ValueError, match=r"^Unknown policy 'group_sqrt'\. Did you mean 'group'\?"):
        parse_policy("group_sqrt")
    with pytest.raises(ValueError) as err:
        parse_policy("zzzz")
    assert str(err.value) == f"Unknown policy 'zzzz'. Valid policies: {GRAMMAR}."
    with pytest.raises(ValueError, match=r"^Unknown policy ''\. Valid policies"):
        parse_policy("")


@pytest.mark.parametrize(
    ("text", "detail"),
    [
        ("every:x", "every:N needs an integer, got 'x' (e.g. 'every:2')."),
        ("every:2.5", "every:N needs an integer, got '2.5' (e.g. 'every:2')."),
        ("every:0", "every:N needs an integer ≥ 1, got 0 (e.g. 'every:2')."),
        ("every:-1", "every:N needs an integer ≥ 1, got -1 (e.g. 'every:2')."),
        ("first:-1", "first:K needs an integer ≥ 0, got -1 (e.g. 'first:2')."),
        ("first:two", "first:K needs an integer, got 'two' (e.g. 'first:2')."),
        ("blocks:5-2", "blocks: range '5-2' runs backwards; write it low-high, e.g. '0-5'."),
        ("blocks:1-x", "blocks:index needs an integer, got 'x' (e.g. 'blocks:2')."),
        ("blocks:,", "blocks: needs indices, e.g. 'blocks:0-5,9'."),
        ("group:0", "group:K needs an integer ≥ 1, got 0 (e.g. 'group:2')."),
        ("group:sqr", "group:K needs an integer, got 'sqr' (e.g. 'group:2')."),
        (
            "selective:notanop",
            "selective: unknown op 'notanop'; use an alias (mm, sdpa, conv) or a torch.ops.aten "
            "op name such as 'mm', 'addmm', 'gelu'.",
        ),
        ("selective:mm,notanop", "selective: unknown op 'notanop'"),
        (
            "modes:off,bogus",
            "unknown block modes ['bogus']; valid modes are ['off', 'recompute', 'selective', 'offload'] and "
            "'compiler:<fraction in [0, 1]>' (e.g. 'compiler:0.5').",
        ),
    ],
)
def test_malformed_arguments(text, detail):
    with pytest.raises(ValueError) as err:
        parse_policy(text)
    message = str(err.value)
    assert message.startswith(f"Malformed policy {text!r}: {detail}")
    assert message.endswith(f"Valid policies: {GRAMMAR}.")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("blocks:", "policy 'blocks:' needs an argument after ':'."),
        ("every", "policy 'every' needs an argument after ':'."),
        ("budget:", "policy 'budget:' needs an argument after ':'."),
        ("all:3", "policy 'all:3': 'all' takes no argument."),
        ("none:", "policy 'none:': 'none' takes no argument."),
        ("offload:cpu", "policy 'offload:cpu': 'offload' takes no argument."),
    ],
)
def test_missing_or_unexpected_arguments(text, message):
    with pytest.raises(ValueError) as err:
        parse_policy(text)
    assert str(err.value) == f"{message} Valid policies: {GRAMMAR}."


@pytest.mark.parametrize("value", [3, 2.0, True, b"all", ["all"], {"policy": "all"}, EveryPolicy])
def test_non_string_policies_are_type_errors(value):
    with pytest.raises(TypeError) as err:
        parse_policy(value)
    assert str(err.value) == (
        f"policy={value!r} must be a string such as 'every:2' or a Policy; grammar: {GRAMMAR}."
    )


@pytest.mark.parametrize(
    ("build", "error", "match"),
    [
        (lambda: EveryPolicy(0), ValueError, r"^every:N needs an integer ≥ 1, got 0"),
        (lambda: EveryPolicy(True), ValueError, r"^every:N needs an integer ≥ 1, got True"),
        (lambda: EveryPolicy(2.0), ValueError, r"^every:N needs an integer ≥ 1, got 2\.0"),
        (lambda: FirstPolicy(-2), ValueError, r"^first:K needs an integer ≥ 0, got -2"),
        (lambda: GroupPolicy("cube"), ValueError, r"^group:K needs an integer ≥ 1, got 'cube'"),
        (
            lambda: BlocksPolicy((-1,)),
            ValueError,
            r"^blocks: indices must be non-negative ints, got \(-1,\)\.$",
        ),
        (lambda: BlocksPolicy((1.0,)), ValueError, r"^blocks: indices must be non-negative ints"),
        (lambda: SelectivePolicy(()), ValueError, r"^selective: needs at least one op name"),
        (lambda: SelectivePolicy(("nope",)), ValueError, r"^selective: unknown op 'nope'"),
        (lambda: BudgetPolicy(float("nan")), ValueError, r"^budget=nan is not a budget: pass a positive size"),
        (lambda: BudgetPolicy(True), TypeError, r"^budget=True must be a size"),
        (lambda: ModesPolicy(("on",)), ValueError, r"^unknown block modes \['on'\]"),
        (lambda: ModesPolicy(("compiler:1.5",)), ValueError,
         r"^unknown block modes \['compiler:1.5'\]; valid modes are .* and 'compiler:<fraction in \[0, 1\]>'"),
    ],
)
def test_constructors_validate(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_blocks_policy_normalises_indices():
    policy = BlocksPolicy([5, 1, 1, 3])
    assert policy.indices == (1, 3, 5)
    assert policy.spec == "blocks:1,3,5"
    assert BlocksPolicy(range(4)).spec == "blocks:0-3"
    assert BlocksPolicy((0, 1, 3, 4, 5, 8)).spec == "blocks:0-1,3-5,8"


# --------------------------------------------------------------------------------------------- known issues


def test_empty_blocks_policy_is_refused_or_round_trips():
    try:
        policy = BlocksPolicy(())
    except ValueError:
        return
    assert parse_policy(policy.spec) == policy


def test_negative_block_index_error_names_the_index():
    with pytest.raises(ValueError, match=r"'-1'"):
        parse_policy("blocks:-1")


@pytest.mark.parametrize("mode, fraction", [("compiler:0", 0.0), ("compiler:0.25", 0.25), ("compiler:1", 1.0),
                                            ("compiler:1.5", None), ("compiler:-0.1", None), ("compiler:x", None),
                                            ("compiler", None), ("recompute", None)])
def test_the_compilers_budget_mode_reads_its_fraction(mode, fraction):
    from lightning_ckpt.core.policy import compiler_fraction, is_mode

    assert compiler_fraction(mode) == fraction
    assert is_mode(mode) == (fraction is not None or mode in MODES)


# ------------------------------------------------------------------------- selective and random numbers


@pytest.mark.parametrize("op", ["rand_like", "randn_like", "native_dropout", "bernoulli", "rand", "randn", "randint",
                                "randint_like", "normal", "uniform", "multinomial", "exponential", "dropout"])
def test_a_save_list_naming_an_op_that_always_draws_is_refused(op):
    with pytest.raises(ValueError) as err:
        parse_policy(f"selective:mm,{op}")
    message = str(err.value)
    assert f"drop {op!r} from the save list" in message
    assert "draws random numbers" in message and "shifted" in message
    with pytest.raises(ValueError, match=f"drop {op!r} from the save list"):
        SelectivePolicy(("mm", op))


def test_the_refusal_says_what_to_do_first():
    with pytest.raises(ValueError) as err:
        parse_policy("selective:mm,rand_like")
    assert str(err.value) == (
        "Malformed policy 'selective:mm,rand_like': selective: drop 'rand_like' from the save list "
        "(e.g. 'selective:mm,sdpa'): it draws random numbers, and a kept op is skipped when its block is replayed, "
        "so every later random op of the block would draw a shifted stream and the gradients would be wrong. "
        f"Valid policies: {GRAMMAR}."
    )


def test_an_explicit_modes_save_list_is_checked_too():
    with pytest.raises(ValueError, match=r"drop 'bernoulli' from the save list"):
        ModesPolicy(("selective", "off"), save_ops=("mm", "bernoulli"))
    with pytest.raises(ValueError, match=r"^selective: unknown op 'nope'; use a torch\.ops\.aten op name"):
        ModesPolicy(("selective", "off"), save_ops=("mm", "nope"))
    assert ModesPolicy(("selective", "off"), save_ops=["mm", "addmm"]).save_ops == ("mm", "addmm")


@pytest.mark.parametrize("spec", ["selective", "selective:sdpa", "selective:_scaled_dot_product_efficient_attention",
                                  "selective:_efficient_attention_forward", "selective:mm,gelu"])
def test_attention_ops_stay_listable(spec):
    """Every SDPA overload is tagged ``nondeterministic_seeded`` whatever its ``dropout_p``: the tag alone must not
    strip attention from ``selective``."""
    policy = parse_policy(spec)
    assert policy.layout(2).save_ops


@needs_compiler_budget
def test_a_compiler_mode_parses_and_prints_back():
    policy = parse_policy("modes:off,compiler:0.5")
    assert policy == ModesPolicy((OFF, "compiler:0.5")) and policy.spec == "modes:off,compiler:0.5"


def test_compiler_modes_are_refused_before_training_on_a_torch_without_the_regions_budget(monkeypatch):
    """torch 2.11 has no region_activation_memory_budget: ``compiler:<f>`` fails at parse time naming the version,
    the attribute and the modes to use instead (the budget then offers no compiler fractions)."""
    import torch

    from lightning_ckpt.core.policy import compiler_budget_unavailable

    monkeypatch.delattr(torch.autograd.graph, "region_activation_memory_budget", raising=False)
    assert "region_activation_memory_budget" in compiler_budget_unavailable()
    version = re.escape(torch.__version__)
    with pytest.raises(ValueError, match=r"modes \['compiler:0.5'\]: upgrade torch or choose among \['off', "
                                         rf"'recompute', 'selective', 'offload'\] .* torch {version} does not have"):
        parse_policy("modes:off,compiler:0.5")
    assert parse_policy("modes:off,recompute").spec == "modes:off,recompute"  # the other modes are untouched


# --------------------------------------------------------------------------- one grammar: ASCII digits, one case rule


@pytest.mark.parametrize("text", ["every:2_0", "first:1_0", "group:1_2", "blocks:1_0", "every:٢", "blocks:٣",
                                  "group:٢", "blocks:0-٣"])
def test_numbers_are_the_ascii_digits_only(text):
    with pytest.raises(ValueError, match=r"needs an integer written with the digits 0-9 only, got "):
        parse_policy(text)


@pytest.mark.parametrize("text", ["budget:0.0_1", "budget:٠.٥", "budget:1_0GiB"])
def test_a_budget_is_ascii_digits_only(text):
    with pytest.raises(ValueError, match=r"is not a budget"):
        parse_policy(text)


def test_a_compiler_fraction_is_ascii_digits_only():
    with pytest.raises(ValueError, match=r"unknown block modes"):
        parse_policy("modes:off,compiler:0.5_0")


@pytest.mark.parametrize("text", ["blocks:0--2", "blocks:0-", "blocks:0-2-4"])
def test_a_malformed_range_is_refused_as_such(text):
    expected = r"as low-high with one '-' between two indices ≥ 0, e\.g\. 'blocks:0-2'"
    with pytest.raises(ValueError, match=expected) as err:
        parse_policy(text)
    assert "backwards" not in str(err.value)


def test_a_repeated_op_counts_once():
    policy = parse_policy("selective:mm,mm,gelu,MM")
    assert policy.ops == ("mm", "gelu") and policy.spec == "selective:mm,gelu"
    assert SelectivePolicy(("mm", "mm")) == SelectivePolicy(("mm",))


@pytest.mark.parametrize(("text", "expected"), [
    ("ALL", AllPolicy()),
    ("Every:2", EveryPolicy(2)),
    ("GROUP:SQRT", GroupPolicy("sqrt")),
    ("modes:OFF,Recompute", ModesPolicy((OFF, RE))),
    ("selective:MM,Gelu", SelectivePolicy(("mm", "gelu"))),
    ("SELECTIVE:SDPA", SelectivePolicy(("sdpa",))),
])
def test_one_case_rule_names_modes_and_ops_are_read_lower_cased(text, expected):
    assert parse_policy(text) == expected and parse_policy(text).spec == parse_policy(text).spec.lower()


def test_a_modes_spec_carries_its_save_list():
    gelu = ModesPolicy(("selective", OFF), ("gelu",))
    assert gelu.spec == "modes:selective,off,save=gelu"
    assert parse_policy(gelu.spec) == gelu and parse_policy(gelu.spec).save_ops == ("gelu",)
    aliased = ModesPolicy(("selective",), SelectivePolicy(("gelu", "mm")).aten_ops())
    assert aliased.spec == "modes:selective,save=gelu+mm" and parse_policy(aliased.spec) == aliased
    default = ModesPolicy(("selective", OFF))
    assert default.spec == "modes:selective,off" and parse_policy(default.spec) == default
    assert ModesPolicy((OFF, RE), SelectivePolicy().aten_ops()) == ModesPolicy((OFF, RE))
    with pytest.raises(ValueError, match=r"give one 'save=' item, after the modes"):
        parse_policy("modes:save=gelu,selective")
