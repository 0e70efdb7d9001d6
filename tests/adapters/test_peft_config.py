import math

import pytest

from loramux.adapters.peft_config import AdapterSpec, InvalidAdapterError, unsupported_features

Q0 = "model.layers.0.self_attn.q_proj"
V1 = "model.layers.1.self_attn.v_proj"
D1 = "model.layers.1.mlp.down_proj"


@pytest.mark.parametrize(
    "config, module, expected",
    [
        (dict(target_modules=["q_proj"]), Q0, True),
        (dict(target_modules=["q_proj"]), V1, False),
        (dict(target_modules=["proj"]), Q0, False),  # suffixes match whole dotted names only
        (dict(target_modules=[Q0]), Q0, True),
        (dict(target_modules=r".*\.1\..*v_proj"), V1, True),
        (dict(target_modules=r".*\.1\..*v_proj"), Q0, False),
        (dict(target_modules=["q_proj", "v_proj"], layers_to_transform=[1]), V1, True),
        (dict(target_modules=["q_proj", "v_proj"], layers_to_transform=[1]), Q0, False),
        (dict(target_modules=["q_proj"], layers_to_transform=0), Q0, True),
        (dict(target_modules=["q_proj"], layers_to_transform=[0], layers_pattern="layers"), Q0, True),
        (dict(target_modules=["q_proj"], layers_to_transform=[0], layers_pattern="blocks"), Q0, False),
        (dict(target_modules=["q_proj", "v_proj"], exclude_modules=["v_proj"]), V1, False),
        (dict(target_modules=["q_proj", "v_proj"], exclude_modules=r".*\.0\..*"), Q0, False),
        (dict(target_modules="all-linear"), D1, True),
    ],
)
def test_targets_follow_peft(config, module, expected):
    spec = AdapterSpec.from_dict({"r": 8, **config})
    assert spec.targets(module, all_linear=("q_proj", "v_proj", "down_proj")) is expected


@pytest.mark.parametrize(
    "config, module, rank, scaling",
    [
        (dict(r=8, lora_alpha=16), Q0, 8, 2.0),
        (dict(r=16, lora_alpha=8, use_rslora=True), Q0, 16, 8 / math.sqrt(16)),
        (dict(r=16, lora_alpha=32, rank_pattern={"v_proj": 4}), V1, 4, 8.0),
        (dict(r=16, lora_alpha=32, rank_pattern={"v_proj": 4}), Q0, 16, 2.0),
        (dict(r=16, lora_alpha=32, alpha_pattern={"q_proj": 8}), Q0, 16, 0.5),
        (dict(r=8, lora_alpha=8, rank_pattern={r"layers\.1\.mlp\.down_proj": 2}), D1, 2, 4.0),
    ],
)
def test_rank_and_scaling(config, module, rank, scaling):
    spec = AdapterSpec.from_dict({"target_modules": ["q_proj", "v_proj", "down_proj"], **config})
    assert spec.rank(module) == rank
    assert spec.scaling(module) == pytest.approx(scaling)


def test_every_unsupported_feature_is_named_in_one_error():
    config = {"r": 8, "target_modules": ["q_proj", "embed_tokens"], "use_qalora": True, "bias": "all",
              "modules_to_save": ["lm_head", "score"], "peft_type": "IA3"}
    with pytest.raises(InvalidAdapterError) as err:
        AdapterSpec.from_dict(config)
    for cause in ("QALoRA", "bias='all'", "modules_to_save=['score'] (only embed_tokens and lm_head", "IA3"):
        assert cause in str(err.value)
    assert len(unsupported_features(config)) == 4  # embedding LoRA and a saved lm_head are supported


@pytest.mark.parametrize("config, cause", [({"target_modules": ["q_proj"]}, "'r'"), ({"r": 8}, "target_modules")])
def test_malformed_config_names_the_field(config, cause):
    with pytest.raises(InvalidAdapterError, match=cause):
        AdapterSpec.from_dict(config)
