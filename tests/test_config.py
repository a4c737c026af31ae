"""Option validation: bad input fails in the front end with one clear message."""

import json

import pytest

from vllm_subspec.config import SubSpecConfigError, SubSpecOptions


def test_defaults_and_roundtrip():
    opts = SubSpecOptions.from_dict({})
    assert (opts.bits, opts.group_size, opts.draft_temperature) == (4, 64, 0.2)
    assert opts.substitute_layers == "offloaded"
    # a k=6 tree by default; this suite runs on CPU, where the default depth is 16
    assert (opts.tree_width, opts.tree_depth, opts.num_draft_tokens) == (6, 16, 96)
    assert opts.is_tree


def test_chain_shorthand():
    opts = SubSpecOptions.from_dict({"num_speculative_tokens": 5})
    assert (opts.tree_width, opts.tree_depth, opts.num_draft_tokens) == (1, 5, 5)
    assert not opts.is_tree
    assert SubSpecOptions.from_dict(opts.to_dict()) == opts
    again = SubSpecOptions.from_dict(json.loads(json.dumps(
        SubSpecOptions.from_dict({"substitute_layers": [3, 1]}).to_dict())))
    assert again.substitute_layers == (3, 1)


@pytest.mark.parametrize("raw, fragment", [
    ({"bitz": 4}, "unknown speculative_config key(s) ['bitz']"),
    ({"bits": 5}, "bits must be one of"),
    ({"group_size": 48}, "group_size must be one of"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an integer"),
    ({"num_speculative_tokens": True}, "num_speculative_tokens must be an integer"),
    ({"tree_width": 0}, "tree_width must be an integer in [1, 16]"),
    ({"tree_depth": 65}, "tree_depth must be an integer in [1, 64]"),
    ({"tree_width": 16, "tree_depth": 64}, "at most 512"),
    ({"num_speculative_tokens": 4, "tree_depth": 8}, "num_speculative_tokens is the chain depth"),
    ({"num_speculative_tokens": 4, "tree_width": 6}, "num_speculative_tokens is the chain depth"),
    ({"draft_temperature": 0}, "draft_temperature must be a number"),
    ({"substitute_layers": "some"}, "substitute_layers must be one of"),
    ({"substitute_layers": [1, 1]}, "duplicate"),
    ({"substitute_layers": [-1]}, "non-negative"),
    ({"kernel": "int4_cpu", "bits": 3}, "needs bits=4"),
    ({"quantizer": "gptq"}, "quantizer must be one of"),
])
def test_bad_options_are_rejected(raw, fragment):
    with pytest.raises(SubSpecConfigError) as e:
        SubSpecOptions.from_dict(raw)
    assert str(e.value).startswith("vllm-subspec: ")
    assert fragment in str(e.value)


def test_several_problems_in_one_message():
    with pytest.raises(SubSpecConfigError) as e:
        SubSpecOptions.from_dict({"bits": 7, "group_size": 7})
    assert "bits" in str(e.value) and "group_size" in str(e.value)


def test_resolve_layers():
    assert SubSpecOptions.from_dict({"substitute_layers": "all"}).resolve_layers(3, []) == [0, 1, 2]
    assert SubSpecOptions.from_dict({}).resolve_layers(4, [2, 0]) == [0, 2]
    assert SubSpecOptions.from_dict({"substitute_layers": [2, 0]}).resolve_layers(3, []) == [0, 2]
    with pytest.raises(SubSpecConfigError, match="out of range"):
        SubSpecOptions.from_dict({"substitute_layers": [5]}).resolve_layers(3, [])
