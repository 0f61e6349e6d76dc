"""Orbax checkpoints: save, restore into any layout, the directory's checks, `meshserve convert`.

The fast tests use the tiny random Llama on 8 fake CPU devices; the slow one converts the real
SmolLM2-135M-Instruct and reads it back, tokenizer included.
"""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding
from tokenizers import pre_tokenizers

from meshserve.model.loading import checkpoint as ckpt
from meshserve.model.loading.checkpoint import (check_compatible, config_from_json, config_to_json,
                                        is_checkpoint, load_checkpoint, model_params,
                                        read_checkpoint_config, restore_params, save_checkpoint)
from meshserve.model.config import PRESETS, ModelConfig, RopeScaling
from meshserve.model.loading.hub import ORBAX_MARKERS
from meshserve.model.loading.pretrained import load_pretrained
from meshserve.model.gguf_vocab import (add_gguf_added_tokens, byte_level_bpe,
                                        byte_level_pre_tokenizer)
from meshserve.model.tokenizer import SpecialTokens, Tokenizer
from meshserve.model.transformer import abstract_model, model_from_params
from meshserve.serving.cli import main as cli
from meshserve.sharding.layout import device_layout
from meshserve.sharding.mesh import MeshConfig
from tests.conftest import random_params

TINY = ModelConfig.preset("tiny-llama")
GGUF_VOCABS = Path(__file__).parents[1] / "golden" / "gguf-vocab"
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")
TEXTS = ["Hello world 12345", "  two  spaces\nand a newline", "<|im_start|>user\nhi<|im_end|>",
         "caf\u00e9 \u65e5\u672c 🙂"]


@pytest.fixture(scope="module")
def tiny_model():
    return model_from_params(TINY, random_params(TINY, seed=3))


@pytest.fixture(scope="module")
def saved(tiny_model, tmp_path_factory):
    """A checkpoint of `tiny_model`, saved from one device, with no tokenizer. Do not modify."""
    return save_checkpoint(tiny_model, None, tmp_path_factory.mktemp("saved") / "ckpt")


@pytest.fixture
def copy(saved, tmp_path):
    """A private copy of `saved`, for tests that damage it."""
    return shutil.copytree(saved, tmp_path / "copy")


def host_params(model) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in model_params(model).items()}


def flat_shardings(model, mesh) -> dict[str, NamedSharding]:
    """Canonical path -> the NamedSharding `device_layout` gives that weight on `mesh`."""
    return {"/".join(map(str, path)): sharding
            for path, sharding in nnx.to_flat_state(device_layout(model, mesh).params)}


def assert_same_params(restored: dict, expected: dict[str, np.ndarray]) -> None:
    assert set(restored) == set(expected)
    for key, value in expected.items():
        got = np.asarray(restored[key])
        assert got.dtype == value.dtype, key
        np.testing.assert_array_equal(got, value, err_msg=key)


def toy_tokenizer() -> Tokenizer:
    """Byte-level BPE over the 256 byte symbols, a few merges, and ChatML special tokens."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = ["H e", "l l", "He ll", "Hell o", "Ġ w", "Ġw o"]
    merged = ["He", "ll", "Hell", "Hello", "Ġw", "Ġwo"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + alphabet + merged
    backend = byte_level_bpe(tokens, merges)
    backend.pre_tokenizer = byte_level_pre_tokenizer()
    add_gguf_added_tokens(backend, tokens, [3, 3, 3] + [1] * (len(tokens) - 3))
    special = SpecialTokens(bos_token_id=1, eos_token_ids=(0, 2), pad_token_id=0)
    return Tokenizer(backend, special=special, chat_template=CHAT_TEMPLATE)


# -- config JSON ---------------------------------------------------------------------------------

@pytest.mark.parametrize("config", [
    *PRESETS.values(),
    TINY.replace(name="scaled", rope_scaling=RopeScaling(rope_type="llama3", factor=8.0,
                                                         original_max_position_embeddings=4096),
                 eos_token_ids=(1, 7), bos_token_id=None, dtype="bfloat16", qkv_bias=True),
], ids=lambda c: c.name)
def test_config_json_round_trips_every_field(config):
    assert config_from_json(config_to_json(config)) == config


def test_config_json_refuses_unknown_missing_and_mistyped_fields():
    data = json.loads(config_to_json(TINY))
    with pytest.raises(ValueError, match=r"unknown \['colour'\]"):
        config_from_json(json.dumps(data | {"colour": "red"}))
    with pytest.raises(ValueError, match=r"missing \['vocab_size'\]"):
        config_from_json(json.dumps({k: v for k, v in data.items() if k != "vocab_size"}))
    with pytest.raises(ValueError, match="rope_scaling must be an object"):
        config_from_json(json.dumps(data | {"rope_scaling": "linear"}))
    with pytest.raises(ValueError, match=r"rope_scaling fields .* unknown \['scale'\]"):
        config_from_json(json.dumps(data | {"rope_scaling": {"scale": 2.0}}))
    with pytest.raises(ValueError, match=r"moe fields .* missing \['experts_per_token'"):
        config_from_json(json.dumps(data | {"moe": {"num_experts": 4}}))
    with pytest.raises(ValueError, match="wrong type"):
        config_from_json(json.dumps(data | {"num_layers": "two"}))


# What config_to_json wrote before the family switches, `moe` and LongRoPE's factors existed.
CONFIG_JSON_BEFORE_FAMILIES = """{"name": "tiny-llama", "arch": "llama", "vocab_size": 512,
"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
"head_dim": 16, "max_position_embeddings": 1024, "rope_theta": 10000.0, "rope_scaling":
{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
"original_max_position_embeddings": 8192}, "norm_eps": 1e-05, "tie_embeddings": false,
"qkv_bias": false, "dtype": "float32", "bos_token_id": null, "eos_token_ids": [1]}"""


def test_config_json_written_before_the_family_fields_loads_with_llamas_defaults():
    config = config_from_json(CONFIG_JSON_BEFORE_FAMILIES)
    assert config == TINY.replace(rope_scaling=RopeScaling(rope_type="llama3", factor=8.0))
    assert config.moe is None and not config.qk_norm and config.norm_kind == "rms"
    assert config.sliding_layers == (False, False) and config.rotary_dim == config.head_dim


# -- round trips ---------------------------------------------------------------------------------

def test_directory_layout_and_manifest(saved, tiny_model):
    assert sorted(p.name for p in saved.iterdir()) == ["meshserve.json", "model_config.json",
                                                       "params"]
    manifest = json.loads((saved / "meshserve.json").read_text())
    assert manifest["format"] == "meshserve-checkpoint" and manifest["version"] == 1
    assert (manifest["model"], manifest["dtype"], manifest["has_tokenizer"]) == (
        "tiny-llama", "float32", False)
    assert manifest["params"] == {k: list(v.shape) for k, v in host_params(tiny_model).items()}
    assert read_checkpoint_config(saved) == TINY
    assert ckpt.MANIFEST in ORBAX_MARKERS  # the hub resolves a checkpoint as kind "orbax"
    assert not list(saved.parent.glob(".*"))  # no staging directory left behind


def test_unsharded_save_restores_into_a_mesh_layout(saved, tiny_model):
    mesh = MeshConfig(data=2, model=4).make_mesh()
    shardings = flat_shardings(abstract_model(TINY), mesh)
    restored = restore_params(saved, TINY, shardings)
    assert shardings["embed/embedding"].spec == PartitionSpec("model")  # really split
    assert shardings["layers/mlp/gate/kernel"].spec == PartitionSpec("stage", None, "model")
    for key, array in restored.items():
        assert array.sharding == shardings[key], key
    assert_same_params(restored, host_params(tiny_model))


def test_save_from_one_mesh_restore_on_another_and_on_one_device(tiny_model, tmp_path):
    mesh_a = MeshConfig(data=1, model=2).make_mesh()
    shard_a = flat_shardings(tiny_model, mesh_a)
    on_a = model_from_params(TINY, {k: jax.device_put(v, shard_a[k])
                                    for k, v in model_params(tiny_model).items()})
    assert model_params(on_a)["layers/mlp/up/kernel"].sharding == shard_a["layers/mlp/up/kernel"]
    path = save_checkpoint(on_a, None, tmp_path / "from_a")
    expected = host_params(tiny_model)

    shard_b = flat_shardings(tiny_model, MeshConfig(data=2, model=4).make_mesh())
    on_b = restore_params(path, TINY, shard_b)
    assert all(on_b[k].sharding == shard_b[k] for k in on_b)
    assert_same_params(on_b, expected)

    single = restore_params(path, TINY, None)
    device = SingleDeviceSharding(jax.devices()[0])
    assert all(v.sharding == device for v in single.values())
    assert_same_params(single, expected)


def test_load_checkpoint_gives_the_model_in_the_requested_shardings(saved, tiny_model):
    shardings = flat_shardings(tiny_model, MeshConfig(model=2).make_mesh())
    config, model, tokenizer = load_checkpoint(saved, shardings=shardings)
    assert config == TINY and tokenizer is None
    restored = model_params(model)
    assert all(restored[k].sharding == shardings[k] for k in restored)
    assert_same_params(restored, host_params(tiny_model))


def test_dtype_is_cast_on_restore(saved, tiny_model, tmp_path):
    config, model, _ = load_checkpoint(saved, dtype="bfloat16")
    assert config == TINY.replace(dtype="bfloat16")
    as_bf16 = {k: np.asarray(jnp.asarray(v).astype(jnp.bfloat16))
               for k, v in host_params(tiny_model).items()}
    assert_same_params(model_params(model), as_bf16)

    bf16_path = save_checkpoint(model, None, tmp_path / "bf16")
    assert read_checkpoint_config(bf16_path).dtype == "bfloat16"
    restored = restore_params(bf16_path, TINY, None, dtype="float32")
    assert_same_params(restored, {k: v.astype(np.float32) for k, v in as_bf16.items()})


def test_tokenizer_round_trips_with_its_special_ids_and_template(tiny_model, tmp_path):
    tokenizer = toy_tokenizer()
    path = save_checkpoint(tiny_model, tokenizer, tmp_path / "with_tok")
    assert (path / "tokenizer.json").is_file() and (path / "tokenizer_config.json").is_file()
    _, _, restored = load_checkpoint(path)
    for text in TEXTS:
        assert restored.encode(text) == tokenizer.encode(text), text
        assert restored.decode(tokenizer.encode(text)) == tokenizer.decode(tokenizer.encode(text))
    assert (restored.bos_token_id, restored.eos_token_ids, restored.pad_token_id) == (1, (0, 2), 0)
    messages = [{"role": "user", "content": "Hello"}]
    assert restored.apply_chat_template(messages) == tokenizer.apply_chat_template(messages)
    plain = Tokenizer.from_file(path / "tokenizer.json")  # the HF-style pair reads on its own
    assert plain.encode(TEXTS[2]) == tokenizer.encode(TEXTS[2])
    assert plain.chat_template == CHAT_TEMPLATE


def test_a_sentencepiece_tokenizer_keeps_its_space_prefix(tiny_model, tmp_path):
    """The space SentencePiece's add_space_prefix puts in front is dropped on decode after a
    restore too."""
    tokenizer = Tokenizer.from_gguf(GGUF_VOCABS / "tiny-spm.gguf")
    path = save_checkpoint(tiny_model, tokenizer, tmp_path / "with_spm")
    _, _, restored = load_checkpoint(path)
    ids = tokenizer.encode("The capital of France is", add_special_tokens=False)
    assert restored.encode("The capital of France is", add_special_tokens=False) == ids
    assert restored.decode(ids) == tokenizer.decode(ids) == "The capital of France is"


def test_is_checkpoint(saved, tmp_path):
    assert is_checkpoint(saved)
    assert not is_checkpoint(tmp_path / "nowhere")
    assert not is_checkpoint(tmp_path)
    (tmp_path / "meshserve.json").write_text('{"format": "something-else"}')
    assert not is_checkpoint(tmp_path)


# -- saving refuses to destroy ------------------------------------------------------------------

def test_save_refuses_a_non_empty_directory_unless_forced(tiny_model, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    save_checkpoint(tiny_model, None, out)  # an empty directory is fine
    with pytest.raises(ValueError, match=f"{out} is not empty; refusing to overwrite"):
        save_checkpoint(tiny_model, None, out)
    other = model_from_params(TINY, random_params(TINY, seed=9))
    save_checkpoint(other, None, out, force=True)
    assert_same_params(restore_params(out, TINY, None), host_params(other))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing left aside
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="it is a file"):
        save_checkpoint(tiny_model, None, tmp_path / "file", force=True)


# -- errors on restore ---------------------------------------------------------------------------

def test_missing_directory(tmp_path):
    with pytest.raises(ValueError, match=f"no checkpoint at {tmp_path / 'nope'}: .*does not exist"):
        load_checkpoint(tmp_path / "nope")


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ValueError, match=f"{tmp_path} is not a meshserve checkpoint: it has no "
                                         "meshserve.json"):
        load_checkpoint(tmp_path)
    (tmp_path / "meshserve.json").write_text("{not json")
    with pytest.raises(ValueError, match="meshserve.json is not valid JSON"):
        read_checkpoint_config(tmp_path)
    (tmp_path / "meshserve.json").write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="does not declare format 'meshserve-checkpoint'"):
        read_checkpoint_config(tmp_path)


def test_unknown_format_version(copy):
    manifest = json.loads((copy / "meshserve.json").read_text())
    (copy / "meshserve.json").write_text(json.dumps(manifest | {"version": 2}))
    with pytest.raises(ValueError, match=f"checkpoint {copy} has format version 2"):
        load_checkpoint(copy)


def test_incomplete_without_orbax_data(copy):
    shutil.rmtree(copy / "params")
    with pytest.raises(ValueError, match=f"checkpoint {copy} is incomplete: its orbax data "
                                         "params/ is missing"):
        load_checkpoint(copy)


def test_incomplete_without_config(copy):
    (copy / "model_config.json").unlink()
    with pytest.raises(ValueError, match=f"checkpoint {copy} is incomplete: model_config.json "
                                         "is missing"):
        load_checkpoint(copy)


def test_incomplete_when_a_weight_is_missing_from_the_orbax_data(copy, tiny_model):
    params = model_params(tiny_model)
    del params["final_norm/scale"]
    shutil.rmtree(copy / "params")
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save((copy / "params").absolute(), params)
    with pytest.raises(ValueError, match=r"is incomplete: params/ lacks the weights "
                                         r"\['final_norm/scale'\]"):
        load_checkpoint(copy)


def test_incomplete_without_the_listed_tokenizer(tiny_model, tmp_path):
    path = save_checkpoint(tiny_model, toy_tokenizer(), tmp_path / "tok")
    (path / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match=r"incomplete: its manifest lists a tokenizer, but "
                                         r"\['tokenizer.json'\] are missing"):
        load_checkpoint(path)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_unreadable_orbax_data_names_the_directory(copy):
    for chunk in (copy / "params" / "ocdbt.process_0" / "d").iterdir():  # the array chunks
        chunk.unlink()
    with pytest.raises(ValueError, match=f"checkpoint {copy}: its orbax data in params/ cannot "
                                         "be read"):
        load_checkpoint(copy)
    (copy / "params" / "_METADATA").unlink()
    with pytest.raises(ValueError, match=f"checkpoint {copy} is incomplete: params/ has no "
                                         "readable array metadata"):
        load_checkpoint(copy)


def test_manifest_shapes_that_disagree_with_the_config(copy):
    manifest = json.loads((copy / "meshserve.json").read_text())
    manifest["params"]["embed/embedding"] = [1024, 64]
    (copy / "meshserve.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"holds another model than tiny-llama: .*has shapes "
                                         r"\['embed/embedding \(1024, 64\) \(expected "
                                         r"\(512, 64\)\)'\]"):
        load_checkpoint(copy)


def test_expected_config_from_another_model(saved):
    other = TINY.replace(num_layers=3, rope_theta=5e5)
    with pytest.raises(ValueError, match=f"checkpoint {saved} holds another model: num_layers 2 "
                                         r"\(expected 3\), rope_theta 10000.0 \(expected "
                                         r"500000.0\)"):
        check_compatible(saved, other)
    with pytest.raises(ValueError, match="holds another model: num_layers 2"):
        restore_params(saved, other, None)
    check_compatible(saved, TINY.replace(dtype="bfloat16"))  # a dtype is a cast, not a model


def test_shardings_must_name_every_weight(saved):
    shardings = dict.fromkeys(ckpt.read_manifest(saved).params, SingleDeviceSharding(
        jax.devices()[0]))
    del shardings["final_norm/scale"]
    with pytest.raises(ValueError, match=r"missing \['final_norm/scale'\]"):
        restore_params(saved, TINY, shardings)


def test_unsupported_dtype(saved):
    with pytest.raises(ValueError, match="dtype 'int8' is not supported"):
        restore_params(saved, TINY, None, dtype="int8")


# -- load_pretrained, LLM and the CLI ------------------------------------------------------------

def test_load_pretrained_reads_a_checkpoint(saved, tiny_model):
    pretrained = load_pretrained(str(saved))
    assert pretrained.config == TINY and pretrained.tokenizer is None
    assert_same_params(model_params(pretrained.model), host_params(tiny_model))
    as_bf16 = load_pretrained(str(saved), dtype="bfloat16")
    assert as_bf16.config.dtype == "bfloat16"
    assert model_params(as_bf16.model)["embed/embedding"].dtype == jnp.bfloat16


def test_llm_runs_from_a_checkpoint(tmp_path):
    from meshserve import LLM, SamplingParams

    assert cli.main(["convert", "--model", "tiny-llama", "--out", str(tmp_path / "c")]) == 0
    # tests/serving/test_engine.py's shapes: its programs, compiled once a session.
    small = dict(num_pages=64, page_size=16, max_num_seqs=4, max_num_batched_tokens=32,
                 prefill_chunk=16, max_model_len=128, max_logprobs=5, warmup=False,
                 compilation_cache=False)
    params = SamplingParams(temperature=0, max_tokens=4)
    prompt = [5, 6, 7, 8]
    [from_checkpoint] = LLM(str(tmp_path / "c"), **small).generate(prompt, params, use_tqdm=False)
    [from_preset] = LLM("tiny-llama", **small).generate(prompt, params, use_tqdm=False)
    assert from_checkpoint.outputs[0].token_ids == from_preset.outputs[0].token_ids
    assert len(from_checkpoint.outputs[0].token_ids) == 4


def test_cli_convert_writes_what_load_pretrained_reads(tmp_path, capsys):
    out = tmp_path / "tiny"
    assert cli.main(["convert", "--model", "tiny-llama", "--out", str(out)]) == 0
    assert f"to {out}" in capsys.readouterr().out
    reference = load_pretrained("tiny-llama")
    restored = load_pretrained(str(out))
    assert restored.config == reference.config
    assert_same_params(model_params(restored.model), host_params(reference.model))

    assert cli.main(["convert", "--model", "tiny-llama", "--out", str(out)]) == 2
    assert "is not empty; refusing to overwrite it" in capsys.readouterr().err
    assert cli.main(["convert", "--model", "tiny-gpt2", "--out", str(out), "--force"]) == 0
    assert read_checkpoint_config(out).name == "tiny-gpt2"


@pytest.mark.slow
def test_convert_smollm2_keeps_params_and_tokenizer(smollm2_files, smollm2_pretrained, tmp_path):
    out = tmp_path / "smollm2"
    assert cli.main(["convert", "--model", str(smollm2_files.path), "--out", str(out)]) == 0
    restored = load_pretrained(str(out))
    reference = smollm2_pretrained
    assert restored.config == reference.config
    assert_same_params(model_params(restored.model), host_params(reference.model))
    tok, ref = restored.tokenizer, reference.tokenizer
    for text in TEXTS + ["x = 1234567 +   89", "<|im_start|>system\nBe brief.<|im_end|>"]:
        assert tok.encode(text) == ref.encode(text), text
        assert tok.decode(ref.encode(text)) == ref.decode(ref.encode(text)), text
    assert (tok.bos_token_id, tok.eos_token_ids, tok.pad_token_id, tok.vocab_size) == (
        ref.bos_token_id, ref.eos_token_ids, ref.pad_token_id, ref.vocab_size)
    messages = [{"role": "user", "content": "Name three colors."}]
    assert tok.apply_chat_template(messages) == ref.apply_chat_template(messages)
