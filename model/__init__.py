"""The model: its network, the files it loads from, and the executor that runs it.

    config.py             `ModelConfig` and the presets (no family's file formats)
    families/             one module per model family's files, registered in `FAMILIES`
    canonical.py          the canonical params: keys, shapes, checks, `CheckpointLayout`
    loading/              files to a model: GGUF files and HF directories -> canonical params,
                          `load_pretrained` (a name or path -> model and tokenizer, quantized),
                          meshserve's own orbax checkpoints, known models and their fetching
    gguf_reader.py        GGUF files read once: metadata, and tensors mapped from the file
    tokenizer.py          tokenizers, chat templates and streaming detokenization
    layers.py, attention.py, moe.py, transformer.py
                          the network (Flax NNX), which knows only shapes
    quant_formats.py      quantized formats and quantization on the host (numpy)
    quantized_kernel.py   the quantized kernel a `Dense` reads, and its matmul
    quantized_table.py    an embedding table (and tied LM head) kept in a file's blocks
    native_dot.py, native/
                          the quantized dot as a native CPU kernel behind XLA's FFI (opt-in)
    quantized_weights.py  a model's quantized kernels: which, quantizing, installing, storing
    executor/             running the scheduler's plans: runners, steps, sampler, layout
    length_predictor.py   the learned output-length predictor

Imports run one way: the network imports neither the executor nor the loaders nor a family,
and nothing here imports `meshserve.sharding` or `meshserve.serving` (`tests/test_layout.py`).
"""
