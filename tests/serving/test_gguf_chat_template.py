"""A SentencePiece GGUF's own chat template (`tokenizer.chat_template`) is what `LLM.chat` and the
HTTP API render, as SmolLM2's is: the tiny Gemma-style file of the llama.cpp fixtures, copied
with Gemma's template added."""

from pathlib import Path

import gguf
import numpy as np
import pytest

from meshserve.model.gguf_reader import open_gguf
from meshserve.model.tokenizer import Tokenizer
from meshserve.serving.python_api.llm import LLM

SOURCE = Path(__file__).parents[1] / "golden" / "gguf-llama" / "tiny-gemma3.gguf"
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>"
            "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}"
            "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n"
            "{% endif %}")
MESSAGES = [{"role": "user", "content": "Hi there"}]


def _with_template(path: Path) -> Path:
    """SOURCE rewritten with every field and tensor as it is, plus the chat template."""
    source = open_gguf(SOURCE)
    writer = gguf.GGUFWriter(str(path), source.metadata["general.architecture"])
    for key, value in source.metadata.items():
        if key in ("general.architecture", "GGUF.version", "GGUF.tensor_count",
                   "GGUF.kv_count"):
            continue
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, np.ndarray) and value.dtype == np.float32:
            writer.add_array(key, value.tolist())
        elif isinstance(value, np.ndarray) and value.dtype == np.bool_:
            writer.add_array(key, [bool(v) for v in value])
        else:
            writer.add_array(key, list(value) if not isinstance(value, np.ndarray)
                             else value.tolist())
    writer.add_string("tokenizer.chat_template", TEMPLATE)
    for tensor in source.tensors.values():
        writer.add_tensor(tensor.name, np.asarray(tensor.data),
                          raw_dtype=gguf.GGMLQuantizationType(tensor.ggml_type))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def templated(tmp_path_factory) -> Path:
    return _with_template(tmp_path_factory.mktemp("gguf") / "tiny-gemma3-chat.gguf")


def test_the_files_template_renders_a_sentencepiece_conversation(templated):
    tokenizer = Tokenizer.from_gguf(templated)
    assert tokenizer.chat_template == TEMPLATE
    text = tokenizer.apply_chat_template(MESSAGES)
    assert text.endswith("<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n")


def test_llm_chat_sends_the_rendered_conversation(templated):
    llm = LLM(str(templated), max_num_seqs=2, max_model_len=128, num_pages=32, warmup=False)
    out = llm.chat(MESSAGES, use_tqdm=False)[0]
    prompt = llm.tokenizer.decode(out.prompt_token_ids)
    assert "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n" in prompt
    # The template writes bos_token and the file asks for a BOS: one, not two.
    assert out.prompt_token_ids[0] == llm.tokenizer.bos_token_id
    assert out.prompt_token_ids.count(llm.tokenizer.bos_token_id) == 1


def test_the_http_apis_chat_path_renders_it_with_one_bos(templated):
    """Messages as the HTTP API hands them to the engine (rendered at admission)."""
    from meshserve.batching.sampling import SamplingParams

    llm = LLM(str(templated), max_num_seqs=2, max_model_len=128, num_pages=32, warmup=False)
    request_id = llm.engine.add_request(MESSAGES, SamplingParams(max_tokens=2))
    done = None
    while llm.engine.has_unfinished():
        done = next((out for out in llm.engine.step()
                     if out.request_id == request_id and out.finished), done)
    assert done.prompt.endswith("<start_of_turn>model\n")
    assert done.prompt_token_ids.count(llm.tokenizer.bos_token_id) == 1
