"""Model configuration: read a DeepSeek-V2 ``config.json`` and derive every size the engine needs.

Two forms of ``config.json`` exist in the wild and both are accepted:

* the Hub's (DeepSeek's own release): ``rope_theta`` plus ``rope_scaling = {"type": "yarn", ...}``;
* transformers 5's (what ``save_pretrained`` writes): ``rope_parameters = {"rope_type": "yarn", "rope_theta": ...}``.

Everything is normalised into one frozen :class:`ModelConfig`. Errors name the file and the field.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config.json that cannot describe a DeepSeek-V2 model (message names file and field)."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters. ``kind`` is ``"default"`` (plain RoPE) or ``"yarn"``."""

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a DeepSeek-V2 model. Field names follow the HF ``config.json``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP width (layers below first_k_dense_replace)
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int  # width of the compressed latent c_KV that MLA caches
    q_lora_rank: int | None  # None: q = q_proj(x); else q = q_b(norm(q_a(x)))
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    topk_method: str = "greedy"  # or "group_limited_greedy"
    n_group: int | None = None
    topk_group: int | None = None
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        """Query/key width per head: 128 nope + 64 rope = 192 for V2-Lite."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_row_dim(self) -> int:
        """Values cached per token per layer: latent + k_pe (512 + 64 = 576 for V2-Lite)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """``mscale² / sqrt(qk_head_dim)``; YaRN's mscale enters squared (0.114721 for V2-Lite)."""
        scale = self.qk_head_dim**-0.5
        if self.rope.kind == "yarn" and self.rope.mscale_all_dim:
            m = yarn_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale *= m * m
        return scale

    def is_moe_layer(self, layer: int) -> bool:
        """DeepSeek's rule: MoE from ``first_k_dense_replace`` on, every ``moe_layer_freq``-th layer."""
        return (
            self.n_routed_experts > 0
            and layer >= self.first_k_dense_replace
            and layer % self.moe_layer_freq == 0
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The transformers-5 form of this config (``rope_parameters``), loadable by both engines."""
        rope: dict[str, Any] = {"rope_type": self.rope.kind, "rope_theta": self.rope.theta}
        if self.rope.kind == "yarn":
            rope.update(
                factor=self.rope.factor,
                original_max_position_embeddings=self.rope.original_max_position_embeddings,
                beta_fast=self.rope.beta_fast,
                beta_slow=self.rope.beta_slow,
                mscale=self.rope.mscale,
                mscale_all_dim=self.rope.mscale_all_dim,
            )
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("rope", "eos_token_id")}
        eos = list(self.eos_token_id)
        d.update(
            model_type="deepseek_v2",
            architectures=["DeepseekV2ForCausalLM"],
            num_key_value_heads=self.num_attention_heads,
            hidden_act="silu",
            rope_parameters=rope,
            eos_token_id=eos[0] if len(eos) == 1 else eos,
        )
        return d


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature correction ``0.1·mscale·ln(factor) + 1`` (1 when factor ≤ 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


# ---- parsing -------------------------------------------------------------------------------------

_INT, _FLOAT, _BOOL = "int", "float", "bool"
_REQUIRED = {
    "vocab_size": _INT,
    "hidden_size": _INT,
    "intermediate_size": _INT,
    "num_hidden_layers": _INT,
    "num_attention_heads": _INT,
    "kv_lora_rank": _INT,
    "qk_nope_head_dim": _INT,
    "qk_rope_head_dim": _INT,
    "v_head_dim": _INT,
}
_OPTIONAL = {
    "n_routed_experts": _INT,
    "n_shared_experts": _INT,
    "num_experts_per_tok": _INT,
    "moe_intermediate_size": _INT,
    "first_k_dense_replace": _INT,
    "moe_layer_freq": _INT,
    "n_group": _INT,
    "topk_group": _INT,
    "norm_topk_prob": _BOOL,
    "routed_scaling_factor": _FLOAT,
    "rms_norm_eps": _FLOAT,
    "max_position_embeddings": _INT,
    "tie_word_embeddings": _BOOL,
    "attention_bias": _BOOL,
    "bos_token_id": _INT,
}


def _typed(where: str, name: str, value: Any, kind: str) -> Any:
    """``value`` if it is of ``kind`` (a bool is not an int; a float must be finite), else a ConfigError."""
    ok = {
        _INT: isinstance(value, int) and not isinstance(value, bool),
        _FLOAT: isinstance(value, (int, float)) and not isinstance(value, bool),
        _BOOL: isinstance(value, bool),
    }[kind]
    if not ok:
        raise ConfigError(f"{where}: field '{name}' must be {kind}, got {type(value).__name__} {value!r}")
    if kind == _FLOAT and not math.isfinite(value):
        raise ConfigError(f"{where}: field '{name}' must be a finite number, got {value!r}")
    return float(value) if kind == _FLOAT else value


def _positive(where: str, name: str, value: int | float) -> int | float:
    if value <= 0:
        raise ConfigError(f"{where}: field '{name}' must be > 0, got {value}")
    return value


def _at_least(where: str, name: str, value: int | float, low: int | float) -> int | float:
    if value < low:
        raise ConfigError(f"{where}: field '{name}' must be >= {low}, got {value}")
    return value


# The smallest value each optional field may take (the engine divides by, takes logs of, or sizes
# tensors with them: a zero or a negative would give NaN logits or an error deep inside torch).
_MINIMUM = {
    "n_routed_experts": 0, "n_shared_experts": 0, "moe_intermediate_size": 0, "first_k_dense_replace": 0,
    "max_position_embeddings": 1, "bos_token_id": 0,
}
_POSITIVE_FLOATS = ("routed_scaling_factor", "rms_norm_eps")


def _parse_rope(raw: dict[str, Any], where: str) -> RopeConfig:
    """Both the Hub form (rope_theta + rope_scaling.type) and transformers 5's rope_parameters."""
    params = raw.get("rope_parameters")
    src = "rope_parameters" if params is not None else "rope_scaling"
    if params is None:
        params = raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{where}: field '{src}' must be an object, got {type(params).__name__}")
    if src == "rope_scaling":
        params = dict(params)
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise ConfigError(f"{where}: {src}.type must be 'default' or 'yarn', got {kind!r}")
    theta = _positive(where, f"{src}.rope_theta", _typed(where, f"{src}.rope_theta", params.get("rope_theta", 10000.0), _FLOAT))
    if kind == "default":
        return RopeConfig(theta=theta)
    for key in ("factor", "original_max_position_embeddings"):
        if params.get(key) is None:
            raise ConfigError(f"{where}: YaRN needs field '{src}.{key}'")

    def number(key: str, default: float | None, low: float) -> float:
        """A YaRN float; a missing or zero optional one takes its default, as DeepSeek's code reads them."""
        value = params[key] if default is None else params.get(key) or default
        return _at_least(where, f"{src}.{key}", _typed(where, f"{src}.{key}", value, _FLOAT), low)

    rope = RopeConfig(
        theta=theta,
        kind="yarn",
        factor=number("factor", None, 1.0),  # YaRN stretches the context: a factor below 1 has no meaning
        original_max_position_embeddings=_positive(where, f"{src}.original_max_position_embeddings", _typed(
            where, f"{src}.original_max_position_embeddings", params["original_max_position_embeddings"], _INT)),
        beta_fast=number("beta_fast", 32, 0.0),
        beta_slow=number("beta_slow", 1, 0.0),
        mscale=number("mscale", 1.0, 0.0),
        mscale_all_dim=number("mscale_all_dim", 0.0, 0.0),
    )
    if not rope.beta_fast > rope.beta_slow:
        raise ConfigError(f"{where}: YaRN needs {src}.beta_fast > {src}.beta_slow, got {rope.beta_fast} and {rope.beta_slow}")
    return rope


def config_from_dict(raw: dict[str, Any], where: str = "config") -> ModelConfig:
    """Validate a parsed ``config.json`` and build a :class:`ModelConfig`. ``where`` names the source."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    if model_type != "deepseek_v2":
        raise ConfigError(f"{where}: unsupported model_type {model_type!r}; this engine runs 'deepseek_v2'")
    kw: dict[str, Any] = {}
    for name, kind in _REQUIRED.items():
        if raw.get(name) is None:
            raise ConfigError(f"{where}: missing required field '{name}'")
        kw[name] = _positive(where, name, _typed(where, name, raw[name], kind))
    for name, kind in _OPTIONAL.items():
        if raw.get(name) is not None:
            kw[name] = _typed(where, name, raw[name], kind)
            if name in _MINIMUM:
                _at_least(where, name, kw[name], _MINIMUM[name])
            elif name in _POSITIVE_FLOATS:
                _positive(where, name, kw[name])
    if kw["qk_rope_head_dim"] % 2:
        raise ConfigError(f"{where}: field 'qk_rope_head_dim' must be even (RoPE rotates pairs), got {kw['qk_rope_head_dim']}")
    q_lora = raw.get("q_lora_rank")
    kw["q_lora_rank"] = None if q_lora is None else _positive(where, "q_lora_rank", _typed(where, "q_lora_rank", q_lora, _INT))
    kw["topk_method"] = raw.get("topk_method") or "greedy"
    if kw["topk_method"] not in ("greedy", "group_limited_greedy"):
        raise ConfigError(f"{where}: topk_method must be 'greedy' or 'group_limited_greedy', got {kw['topk_method']!r}")
    if raw.get("scoring_func", "softmax") != "softmax":
        raise ConfigError(f"{where}: scoring_func must be 'softmax' (DeepSeek-V2), got {raw['scoring_func']!r}")
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: hidden_act must be 'silu', got {raw['hidden_act']!r}")
    kvh = raw.get("num_key_value_heads")
    if kvh is not None and kvh != raw["num_attention_heads"]:
        raise ConfigError(
            f"{where}: num_key_value_heads must equal num_attention_heads for MLA, got {kvh} vs {raw['num_attention_heads']}"
        )
    eos = raw.get("eos_token_id")
    eos_list = [] if eos is None else (eos if isinstance(eos, list) else [eos])
    kw["eos_token_id"] = tuple(_typed(where, "eos_token_id", e, _INT) for e in eos_list)
    for name, ids in (("bos_token_id", [kw.get("bos_token_id", 0)]), ("eos_token_id", kw["eos_token_id"])):
        if any(not 0 <= i < kw["vocab_size"] for i in ids):
            raise ConfigError(f"{where}: field '{name}' must be a token id in 0..{kw['vocab_size'] - 1}, got {ids}")
    kw["rope"] = _parse_rope(raw, where)

    kw.setdefault("n_routed_experts", 0)
    if kw["n_routed_experts"]:
        for name in ("num_experts_per_tok", "moe_intermediate_size"):
            if kw.get(name) is None:
                raise ConfigError(f"{where}: MoE config (n_routed_experts={kw['n_routed_experts']}) needs field '{name}'")
        _positive(where, "moe_intermediate_size", kw["moe_intermediate_size"])
        if not 0 < kw["num_experts_per_tok"] <= kw["n_routed_experts"]:
            raise ConfigError(
                f"{where}: num_experts_per_tok must be in 1..n_routed_experts={kw['n_routed_experts']}, "
                f"got {kw['num_experts_per_tok']}"
            )
    kw.setdefault("n_shared_experts", 0)
    kw.setdefault("num_experts_per_tok", 0)
    kw.setdefault("moe_intermediate_size", 0)
    if kw.get("moe_layer_freq", 1) < 1:
        raise ConfigError(f"{where}: moe_layer_freq must be >= 1, got {kw['moe_layer_freq']}")
    if kw["topk_method"] == "group_limited_greedy":
        g, tg, e = kw.get("n_group"), kw.get("topk_group"), kw["n_routed_experts"]
        if not g or not tg:
            raise ConfigError(f"{where}: topk_method 'group_limited_greedy' needs fields 'n_group' and 'topk_group'")
        if e % g or not 0 < tg <= g or tg * (e // g) < kw["num_experts_per_tok"]:
            raise ConfigError(
                f"{where}: group_limited_greedy needs n_routed_experts % n_group == 0 and enough experts in "
                f"topk_group groups; got n_routed_experts={e}, n_group={g}, topk_group={tg}, "
                f"num_experts_per_tok={kw['num_experts_per_tok']}"
            )
    return ModelConfig(**kw)


def load_config(path: str | Path) -> ModelConfig:
    """Read ``path`` (a ``config.json`` or the directory holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: no config.json found")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    except RecursionError:
        raise ConfigError(f"{path}: JSON nested too deeply to parse (a config.json is a few levels deep)") from None
    return config_from_dict(raw, where=str(path))


# ---- presets -------------------------------------------------------------------------------------

DEEPSEEK_V2_LITE = ModelConfig(
    vocab_size=102400,
    hidden_size=2048,
    intermediate_size=10944,
    num_hidden_layers=27,
    num_attention_heads=16,
    kv_lora_rank=512,
    q_lora_rank=None,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=64,
    n_shared_experts=2,
    num_experts_per_tok=6,
    moe_intermediate_size=1408,
    first_k_dense_replace=1,
    moe_layer_freq=1,
    topk_method="greedy",
    n_group=1,
    topk_group=1,
    norm_topk_prob=False,
    routed_scaling_factor=1.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=163840,
    rope=RopeConfig(
        theta=10000.0,
        kind="yarn",
        factor=40.0,
        original_max_position_embeddings=4096,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=0.707,
        mscale_all_dim=0.707,
    ),
    bos_token_id=100000,
    eos_token_id=(100001,),
)
"""DeepSeek-V2-Lite(-Chat), as in its Hub ``config.json``."""

TINY = ModelConfig(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=6,
    num_attention_heads=4,
    kv_lora_rank=64,
    q_lora_rank=None,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    n_routed_experts=16,
    n_shared_experts=2,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    first_k_dense_replace=1,
    max_position_embeddings=2048,
    rope=RopeConfig(
        theta=10000.0,
        kind="yarn",
        factor=4.0,
        original_max_position_embeddings=512,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=0.707,
        mscale_all_dim=0.707,
    ),
    bos_token_id=0,
    eos_token_id=(1,),
)
"""The embedded ``"tiny"`` model: V2-Lite's architecture (dense first layer, then five MoE layers of 16
experts, top-2, 2 shared; MLA; YaRN) at 12.3 M parameters, trained on Shakespeare (appendix A)."""
