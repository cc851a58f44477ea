"""config.json parsing: both forms of DeepSeek-V2-Lite's config, derived sizes, and bad input.

Every error must be a ConfigError whose message names the file and the field at fault.
"""
import copy
import dataclasses
import json
import math
import re

import pytest
from hub_files import HUB_CONFIG_JSON
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv2_lib.core.config import DEEPSEEK_V2_LITE, TINY, ConfigError, config_from_dict, load_config


@pytest.fixture
def hub() -> dict:
    return json.loads(HUB_CONFIG_JSON)


def write(tmp_path, raw) -> str:
    """config.json from a dict (as JSON), a str (as text) or bytes (as they are)."""
    path = tmp_path / "config.json"
    if isinstance(raw, bytes):
        path.write_bytes(raw)
    else:
        path.write_text(raw if isinstance(raw, str) else json.dumps(raw))
    return str(path)


def err(path: str, *parts: str) -> str:
    """A regex matching a message that contains the file path and then every part, in order."""
    return re.escape(path) + ".*" + ".*".join(re.escape(p) for p in parts)


# ---- the two real forms of V2-Lite's config ------------------------------------------------------


def test_hub_config_parses_to_the_preset(tmp_path, hub):
    cfg = load_config(write(tmp_path, HUB_CONFIG_JSON))
    assert cfg == DEEPSEEK_V2_LITE
    # and the directory form finds config.json itself
    assert load_config(tmp_path) == DEEPSEEK_V2_LITE
    # the Hub writes ints where floats are meant; they must come out as floats
    assert isinstance(cfg.rope.factor, float) and isinstance(cfg.rope.theta, float)
    assert cfg.rope.kind == "yarn" and cfg.rope.factor == 40.0 and cfg.rope.original_max_position_embeddings == 4096
    assert cfg.eos_token_id == (100001,) and cfg.bos_token_id == 100000


def test_transformers5_form_parses_to_the_preset(tmp_path):
    d = DEEPSEEK_V2_LITE.to_hf_dict()
    assert "rope_parameters" in d and "rope_scaling" not in d
    assert load_config(write(tmp_path, d)) == DEEPSEEK_V2_LITE


def test_transformers_round_trip_parses_to_the_preset(tmp_path):
    transformers = pytest.importorskip("transformers")
    d = transformers.DeepseekV2Config(**DEEPSEEK_V2_LITE.to_hf_dict()).to_dict()
    assert load_config(write(tmp_path, d)) == DEEPSEEK_V2_LITE
    # what save_pretrained writes is the same dict; transformers also reads the Hub form
    hub_cfg = transformers.DeepseekV2Config(**json.loads(HUB_CONFIG_JSON))
    assert config_from_dict(hub_cfg.to_dict()) == DEEPSEEK_V2_LITE


def test_tiny_round_trips_through_to_hf_dict():
    assert config_from_dict(json.loads(json.dumps(TINY.to_hf_dict()))) == TINY


def test_derived_sizes_of_v2_lite():
    c = DEEPSEEK_V2_LITE
    assert c.qk_head_dim == 192
    assert c.cache_row_dim == 576
    # mscale(40, 0.707)^2 / sqrt(192): YaRN's temperature enters squared
    assert c.softmax_scale == pytest.approx(0.114721, abs=1e-6)
    plain = dataclasses.replace(c, rope=dataclasses.replace(c.rope, kind="default"))
    assert plain.softmax_scale == pytest.approx(192**-0.5)
    assert [c.is_moe_layer(i) for i in range(3)] == [False, True, True]


def test_is_moe_layer_with_first_k_dense_and_freq(hub):
    hub.update(first_k_dense_replace=3, moe_layer_freq=2, num_hidden_layers=10)
    cfg = config_from_dict(hub)
    assert [i for i in range(10) if cfg.is_moe_layer(i)] == [4, 6, 8]
    hub.update(first_k_dense_replace=0, moe_layer_freq=1)
    assert all(config_from_dict(hub).is_moe_layer(i) for i in range(10))
    hub.update(n_routed_experts=None)  # no routed experts: every layer dense
    assert not any(config_from_dict(hub).is_moe_layer(i) for i in range(10))


def test_optional_fields_are_read(hub):
    hub.update(
        norm_topk_prob=True,
        routed_scaling_factor=16,
        tie_word_embeddings=True,
        q_lora_rank=1536,
        topk_method="group_limited_greedy",
        n_group=8,
        topk_group=3,
        rms_norm_eps=1e-5,
        attention_bias=True,
        eos_token_id=[100001, 100002],
    )
    cfg = config_from_dict(hub)
    assert cfg.norm_topk_prob is True
    assert cfg.routed_scaling_factor == 16.0 and isinstance(cfg.routed_scaling_factor, float)
    assert cfg.tie_word_embeddings is True
    assert cfg.q_lora_rank == 1536
    assert (cfg.topk_method, cfg.n_group, cfg.topk_group) == ("group_limited_greedy", 8, 3)
    assert cfg.rms_norm_eps == 1e-5 and cfg.attention_bias is True
    assert cfg.eos_token_id == (100001, 100002)
    # and they survive the round trip through the transformers-5 form
    assert config_from_dict(json.loads(json.dumps(cfg.to_hf_dict()))) == cfg


def test_plain_rope_forms(hub):
    hub["rope_scaling"] = None
    hub["rope_theta"] = 500
    cfg = config_from_dict(hub)
    assert cfg.rope.kind == "default" and cfg.rope.theta == 500.0
    del hub["rope_scaling"], hub["rope_theta"]
    assert config_from_dict(hub).rope.theta == 10000.0
    hub["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6}
    assert config_from_dict(hub).rope == dataclasses.replace(cfg.rope, theta=1e6)


# ---- errors: each names the file and the field -----------------------------------------------------


def test_missing_required_field(tmp_path, hub):
    del hub["kv_lora_rank"]
    path = write(tmp_path, hub)
    with pytest.raises(ConfigError, match=err(path, "missing required field 'kv_lora_rank'")):
        load_config(path)


@pytest.mark.parametrize(
    "field, value, want",
    [
        ("hidden_size", "2048", "str '2048'"),
        ("hidden_size", 2048.0, "float 2048.0"),
        ("num_hidden_layers", True, "bool True"),  # a bool is not an int, though Python says it is
        ("q_lora_rank", "1536", "str"),
        ("norm_topk_prob", 0, "int 0"),
        ("routed_scaling_factor", "1.0", "str"),
        ("tie_word_embeddings", "false", "str"),
        ("n_group", 1.5, "float"),
        ("eos_token_id", "100001", "str"),
    ],
)
def test_wrong_typed_field(tmp_path, hub, field, value, want):
    hub[field] = value
    path = write(tmp_path, hub)
    with pytest.raises(ConfigError, match=err(path, f"field '{field}' must be", want)):
        load_config(path)


def test_non_positive_size(tmp_path, hub):
    hub["num_attention_heads"] = 0
    hub["num_key_value_heads"] = 0
    path = write(tmp_path, hub)
    with pytest.raises(ConfigError, match=err(path, "'num_attention_heads' must be > 0, got 0")):
        load_config(path)


@pytest.mark.parametrize("model_type", ["llama", "deepseek_v3", None])
def test_unsupported_model_type(tmp_path, hub, model_type):
    hub["model_type"] = model_type
    path = write(tmp_path, hub)
    with pytest.raises(ConfigError, match=err(path, f"unsupported model_type {model_type!r}", "deepseek_v2")):
        load_config(path)


def test_unknown_rope_type(tmp_path, hub):
    hub["rope_scaling"]["type"] = "dynamic"
    path = write(tmp_path, hub)
    with pytest.raises(ConfigError, match=err(path, "rope_scaling.type", "'dynamic'")):
        load_config(path)
    d = DEEPSEEK_V2_LITE.to_hf_dict()
    d["rope_parameters"]["rope_type"] = "longrope"
    path = write(tmp_path, d)
    with pytest.raises(ConfigError, match=err(path, "rope_parameters.type", "'longrope'")):
        load_config(path)


@pytest.mark.parametrize("bad", ["yarn", [1, 2], 40])
def test_rope_scaling_not_an_object(tmp_path, hub, bad):
    hub["rope_scaling"] = bad
    path = write(tmp_path, hub)
    with pytest.raises(ConfigError, match=err(path, "'rope_scaling' must be an object")):
        load_config(path)


@pytest.mark.parametrize("key", ["factor", "original_max_position_embeddings"])
def test_yarn_missing_field(tmp_path, hub, key):
    del hub["rope_scaling"][key]
    path = write(tmp_path, hub)
    with pytest.raises(ConfigError, match=err(path, f"YaRN needs field 'rope_scaling.{key}'")):
        load_config(path)


def test_yarn_wrong_typed_field(tmp_path, hub):
    hub["rope_scaling"]["factor"] = "40"
    path = write(tmp_path, hub)
    with pytest.raises(ConfigError, match=err(path, "'rope_scaling.factor' must be float", "'40'")):
        load_config(path)


@pytest.mark.parametrize("drop, value", [("n_group", None), ("topk_group", None), ("topk_group", 0)])
def test_group_limited_greedy_needs_groups(tmp_path, hub, drop, value):
    hub.update(topk_method="group_limited_greedy", n_group=8, topk_group=3)
    hub[drop] = value
    path = write(tmp_path, hub)
    with pytest.raises(ConfigError, match=err(path, "group_limited_greedy", "'n_group' and 'topk_group'")):
        load_config(path)


@pytest.mark.parametrize("n_group, topk_group", [(7, 3), (8, 9), (32, 2)])
def test_group_limited_greedy_inconsistent(tmp_path, hub, n_group, topk_group):
    # 64 experts: 7 groups don't divide them; 9 of 8 groups; 2 groups of 2 experts < 6 experts/token
    hub.update(topk_method="group_limited_greedy", n_group=n_group, topk_group=topk_group)
    path = write(tmp_path, hub)
    with pytest.raises(ConfigError, match=err(path, f"n_group={n_group}", f"topk_group={topk_group}")):
        load_config(path)


def test_unknown_topk_method_and_scoring(tmp_path, hub):
    bad = dict(hub, topk_method="noaux_tc")
    path = write(tmp_path, bad)
    with pytest.raises(ConfigError, match=err(path, "topk_method", "'noaux_tc'")):
        load_config(path)
    bad = dict(hub, scoring_func="sigmoid")
    path = write(tmp_path, bad)
    with pytest.raises(ConfigError, match=err(path, "scoring_func", "'sigmoid'")):
        load_config(path)
    bad = dict(hub, hidden_act="gelu")
    path = write(tmp_path, bad)
    with pytest.raises(ConfigError, match=err(path, "hidden_act", "'gelu'")):
        load_config(path)


@pytest.mark.parametrize("k", [0, 65, -1])
def test_bad_num_experts_per_tok(tmp_path, hub, k):
    hub["num_experts_per_tok"] = k
    path = write(tmp_path, hub)
    with pytest.raises(ConfigError, match=err(path, "num_experts_per_tok", "n_routed_experts=64", f"got {k}")):
        load_config(path)


def test_moe_without_expert_width(tmp_path, hub):
    del hub["moe_intermediate_size"]
    path = write(tmp_path, hub)
    with pytest.raises(ConfigError, match=err(path, "n_routed_experts=64", "'moe_intermediate_size'")):
        load_config(path)


def test_bad_moe_layer_freq(tmp_path, hub):
    hub["moe_layer_freq"] = 0
    path = write(tmp_path, hub)
    with pytest.raises(ConfigError, match=err(path, "moe_layer_freq", "got 0")):
        load_config(path)


def test_kv_heads_must_equal_heads(tmp_path, hub):
    hub["num_key_value_heads"] = 8
    path = write(tmp_path, hub)
    with pytest.raises(ConfigError, match=err(path, "num_key_value_heads", "num_attention_heads", "8 vs 16")):
        load_config(path)


@pytest.mark.parametrize("raw", ["{not json", "", "[1, 2", "\x00\x01garbage", b"\xff\xfe\x00\x89PNG\r\n garbage"],
                         ids=["broken", "empty", "truncated", "control-chars", "binary"])
def test_non_json_file(tmp_path, raw):
    path = write(tmp_path, raw)
    with pytest.raises(ConfigError, match=err(path, "not valid JSON")):
        load_config(path)


@pytest.mark.parametrize("doc", ["[]", "42", "null", '"deepseek_v2"'])
def test_json_that_is_not_an_object(tmp_path, doc):
    path = write(tmp_path, doc)
    with pytest.raises(ConfigError, match=err(path, "expected a JSON object")):
        load_config(path)


def test_missing_config_json(tmp_path):
    with pytest.raises(ConfigError, match=err(str(tmp_path / "config.json"), "no config.json")):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match=err(str(tmp_path / "nope.json"), "no config.json")):
        load_config(tmp_path / "nope.json")


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)
    with pytest.raises(ConfigError, match="my-source: missing required field 'vocab_size'"):
        config_from_dict({k: v for k, v in json.loads(HUB_CONFIG_JSON).items() if k != "vocab_size"}, where="my-source")


def test_hub_dict_is_not_mutated(hub):
    before = copy.deepcopy(hub)
    config_from_dict(hub)
    assert hub == before


# ---- values out of range: each would give NaN logits or an error deep inside torch -------------

@pytest.mark.parametrize("field, value, want", [
    ("rms_norm_eps", -1e-6, "must be > 0"),
    ("rms_norm_eps", 0.0, "must be > 0"),
    ("routed_scaling_factor", float("nan"), "must be a finite number"),
    ("routed_scaling_factor", float("inf"), "must be a finite number"),
    ("routed_scaling_factor", 0, "must be > 0"),
    ("moe_intermediate_size", -4, "must be >= 0"),
    ("moe_intermediate_size", 0, "must be > 0"),
    ("n_shared_experts", -1, "must be >= 0"),
    ("n_routed_experts", -64, "must be >= 0"),
    ("first_k_dense_replace", -1, "must be >= 0"),
    ("max_position_embeddings", 0, "must be >= 1"),
    ("bos_token_id", -5, "must be >= 0"),
    ("bos_token_id", 102400, "token id in 0..102399"),
    ("eos_token_id", [100001, 102400], "token id in 0..102399"),
    ("qk_rope_head_dim", 63, "must be even"),
])
def test_out_of_range_field(tmp_path, hub, field, value, want):
    hub[field] = value
    path = write(tmp_path, hub)  # json.dumps writes NaN and Infinity, which json.loads reads back
    with pytest.raises(ConfigError, match=err(path, field, want)):
        load_config(path)


@pytest.mark.parametrize("key, value, want", [
    ("factor", 0, "must be >= 1.0"),
    ("factor", 0.5, "must be >= 1.0"),
    ("factor", float("nan"), "must be a finite number"),
    ("original_max_position_embeddings", 0, "must be > 0"),
    ("mscale", -1, "must be >= 0.0"),
    ("beta_fast", 0.5, "beta_fast > rope_scaling.beta_slow"),
])
def test_out_of_range_yarn_field(tmp_path, hub, key, value, want):
    hub["rope_scaling"][key] = value
    path = write(tmp_path, hub)
    with pytest.raises(ConfigError, match=err(path, f"rope_scaling.{key}" if "beta" not in key else "", want)):
        load_config(path)


@pytest.mark.parametrize("theta", [0, -10000.0, float("inf")])
def test_rope_theta_must_be_positive_and_finite(tmp_path, hub, theta):
    hub["rope_theta"] = theta
    path = write(tmp_path, hub)
    with pytest.raises(ConfigError, match=err(path, "rope_scaling.rope_theta")):
        load_config(path)


def test_deeply_nested_json_is_a_config_error(tmp_path):
    path = write(tmp_path, '{"model_type": "deepseek_v2", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ConfigError, match=err(path, "nested too deeply")):
        load_config(path)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(changes=st.dictionaries(st.sampled_from(sorted(json.loads(HUB_CONFIG_JSON))), JSON_VALUES, min_size=1, max_size=4),
       rope=st.dictionaries(st.sampled_from(["type", "factor", "original_max_position_embeddings", "beta_fast",
                                             "beta_slow", "mscale", "mscale_all_dim"]), JSON_VALUES, max_size=2))
def test_any_mutated_config_is_valid_or_a_config_error(hub, changes, rope):
    """Random values in random fields: the answer is a ConfigError or a config whose every number the
    engine uses is finite and in range; never another exception."""
    raw = copy.deepcopy(hub)
    raw.update(changes)
    if isinstance(raw.get("rope_scaling"), dict):
        raw["rope_scaling"].update(rope)
    try:
        cfg = config_from_dict(raw, "mutated")
    except ConfigError:
        return
    sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "max_position_embeddings")
    assert all(getattr(cfg, f) > 0 for f in sizes)
    assert cfg.n_routed_experts >= 0 and cfg.n_shared_experts >= 0 and cfg.first_k_dense_replace >= 0
    assert cfg.rms_norm_eps > 0 and cfg.routed_scaling_factor > 0 and math.isfinite(cfg.routed_scaling_factor)
    assert cfg.rope.theta > 0 and math.isfinite(cfg.rope.theta) and cfg.rope.factor >= 1
    assert math.isfinite(cfg.softmax_scale) and cfg.softmax_scale > 0
    assert all(0 <= t < cfg.vocab_size for t in cfg.eos_token_id)
    if cfg.n_routed_experts:
        assert 0 < cfg.num_experts_per_tok <= cfg.n_routed_experts and cfg.moe_intermediate_size > 0
