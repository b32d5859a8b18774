"""The fused C++ blocks (engine/kernels/csrc/fused_blocks.cpp): a layer's attention block and MLP
block as one call each, and all layers with their norms as one call (the layer stack). They call
the same kernels as the Python path, in the same order, so the logits and the KV cache must be
equal bit for bit, in every kind of step (first prefill chunks, chunks after a cached prefix,
decodes, all mixed in one batch), for every quantized layout."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import engine.kernels.linear_precision as lp
from engine.kernels.quant import Int4TiledWeight, Int4Weight, Int8Weight, quantize_int8
from engine.layers.attention import build_attention_metadata
from engine.models import llama
from engine.models.llama import LlamaModel
from engine.worker.bfloat16_linears import with_bfloat16_linears
from engine.worker.quantization import describe, quantize_model

BLOCK = 16


def gguf_style(model: LlamaModel, head_q8: bool = True) -> LlamaModel:
    """The int4 model with its layers stored as a GGUF's Q4_1 (float16 scales and minimums,
    activations rounded to 8 bits): what the tiled kernel multiplies; with `head_q8`, its int8
    output layer (a tied one also the embedding) times rounded activations too, as a GGUF's."""
    w, styled = dict(model.w), {}
    for name, t in model.w.items():
        if id(t) not in styled:
            styled[id(t)] = t
            if isinstance(t, Int4Weight):
                styled[id(t)] = replace(
                    t, scales=t.scales.half(), mins=t.mins.half(), q8_activations=True
                )
            elif isinstance(t, Int8Weight) and head_q8:
                styled[id(t)] = replace(t, q8_activations=True)
        w[name] = styled[id(t)]
    return model.rebuilt(w=w)


def build(model_dir, layout: str, fused: bool, monkeypatch) -> LlamaModel:
    """layout: "tiles" (a GGUF's; "tiles, head in rows": its output layer not rounding the
    activations, so not in tiles), "int4", "int8", "float32" (not quantized: the float32
    library's linears, called from C++) or "bfloat16 tiles" (a float32 model's bfloat16
    linears)."""
    model = LlamaModel.from_pretrained(model_dir)
    int4 = layout.startswith("tiles") or layout == "int4"
    if layout == "bfloat16 tiles":
        monkeypatch.setattr(lp, "_choice", {"precision": "bfloat16", "library": lp.TILES})
        model = with_bfloat16_linears(model, "test")
    elif not layout.endswith("float32"):
        model = quantize_model(model, "int4" if int4 else "int8", group_size=32)
    if layout.startswith("tiles"):
        model = gguf_style(model, head_q8=layout == "tiles")
    if not fused:
        monkeypatch.setattr(llama, "fused_blocks_apply", lambda *args: False)
    model = model.with_kernels("auto")
    monkeypatch.undo()
    return model


def step(model: LlamaModel, caches, tables, query_lens, computed) -> torch.Tensor:
    """One forward of the requests with new tokens (query_lens[i] of them, computed[i] already
    in the cache; 0 new tokens: not in this step), random token ids; the logits."""
    live = [i for i, n in enumerate(query_lens) if n]
    q_lens = [query_lens[i] for i in live]
    positions = torch.cat([torch.arange(computed[i], computed[i] + query_lens[i]) for i in live])
    meta = build_attention_metadata(
        q_lens, [computed[i] for i in live], [tables[i] for i in live], BLOCK, for_kernel=True
    )
    ids = torch.randint(3, model.cfg.vocab_size, (sum(q_lens),))
    last = torch.tensor(q_lens).cumsum(0) - 1
    return model.forward(ids, positions, caches, meta, last)


def run_steps(model: LlamaModel) -> tuple[list[torch.Tensor], list]:
    """Three steps over three requests: two first chunks; then a decode, a chunk after a cached
    prefix and a new first chunk together; then three decodes. Logits of every step, and the
    cache."""
    torch.manual_seed(0)
    caches = model.allocate_kv_cache(16, BLOCK)
    tables = [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    steps = [  # (query_lens, num_computed) per request; 0 new tokens: not in this step
        ([5, 20, 0], [0, 0, 0]),
        ([1, 9, 3], [5, 20, 0]),
        ([1, 1, 1], [6, 29, 3]),
    ]
    logits = [step(model, caches, tables, query_lens, computed) for query_lens, computed in steps]
    return logits, caches


def assert_same_steps(first: LlamaModel, second: LlamaModel) -> None:
    """`run_steps` on both models: every step's logits and the KV cache equal bit for bit."""
    first_logits, first_cache = run_steps(first)
    second_logits, second_cache = run_steps(second)
    for a, b in zip(first_logits, second_logits, strict=True):
        assert torch.equal(a, b)
    for (k1, v1), (k2, v2) in zip(first_cache, second_cache, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


@pytest.mark.parametrize(
    "layout", ["tiles", "int4", "int8", "qwen2 int8", "float32", "qwen2 float32"]
)
def test_fused_blocks_equal_the_python_path_bit_for_bit(ext, request, monkeypatch, layout):
    """ "qwen2 ...": the tiny Qwen2, whose q/k/v projections have biases."""
    model_dir = request.getfixturevalue("tiny_qwen2_dir" if "qwen2" in layout else "tiny_model_dir")
    fused = build(model_dir, layout, True, monkeypatch)
    python = build(model_dir, layout, False, monkeypatch)
    attention, mlp = fused.layers[0].attention, fused.layers[0].mlp
    assert attention.block is not None and mlp.block is not None
    assert attention.forward == attention.forward_cpu and mlp.forward == mlp.forward_cpu
    assert python.layers[0].attention.forward == python.layers[0].attention.forward_native
    assert fused.stack is not None and python.stack is None  # all layers in one call, or none
    assert "layers in one C++ call" in describe(fused) and "layers in Python" in describe(python)
    if layout == "tiles" and "int4" in ext.q8_tile_formats():
        assert isinstance(fused.w["0.qkv"], Int4TiledWeight)
    assert_same_steps(fused, python)


def run_decodes(model: LlamaModel, kv_dtype: torch.dtype) -> tuple[list[torch.Tensor], list]:
    """Two requests prefilled (150 and 20 tokens), then decode steps: the long one alone, then
    both together. Logits of every step, and the cache."""
    torch.manual_seed(1)
    caches = model.allocate_kv_cache(16, BLOCK, kv_dtype)
    tables = [list(range(11)), [11, 12]]
    computed, logits = [0, 0], []
    for query_lens in [[150, 20]] + [[1, 0]] * 3 + [[1, 1]] * 4:
        logits.append(step(model, caches, tables, query_lens, computed))
        computed = [c + n for c, n in zip(computed, query_lens, strict=True)]
    return logits, caches


@pytest.mark.parametrize(
    "model, threads, kv_dtype, layout",
    [("llama", t, kv, "tiles") for t in (1, 2, 3) for kv in ("float32", "bfloat16")]
    + [("qwen2", 2, "float32", "tiles"), ("llama", 2, "float32", "tiles, head in rows")]
    + [("llama", t, "float32", "float32") for t in (1, 2, 3)]
    + [("qwen2", 2, "bfloat16", "float32")]
    + [("llama", t, "float32", layout) for t in (1, 2, 3) for layout in ("int8", "int4")]
    + [("qwen2", 2, "bfloat16", "int8"), ("llama", 2, "float32", "int4, head apart")]
    + [("llama", t, "float32", "bfloat16 tiles") for t in (1, 2, 3)]
    + [("qwen2", 2, "float32", "bfloat16 tiles")],
)
def test_decode_steps_run_as_one_team_bit_for_bit(
    ext, request, monkeypatch, model, threads, kv_dtype, layout
):
    """A decode step of a model in tiles runs as one team of threads, one parallel region for
    all the layers (fused_blocks.cpp: LayerStack::run_team), with the long context's keys cut into
    ranges that the team merges, and, with its output layer in tiles too, the final norm and the
    output layer for the rows that sample. Its logits and cache equal the Python path's bit for
    bit, at any number of threads, with a bfloat16 cache too (whose first chunks, before this
    test, attended to unrounded keys in the fused block), with Qwen2's q/k/v biases (and its
    untied output layer), and with the output layer in rows (a weight-only int8 matrix: the team
    runs it too); the prefill keeps the kernels' loops. A float32 model's decode steps run as a
    team too (the matrices' rows shared 16 at a time, the output layer with them), and so do a
    weight-only int8 or int4 model's, and a float32 model's bfloat16 linears in tiles where the
    AVX512-BF16 kernel multiplies them. "head apart": the team stops after the layers and the
    model runs the final norm and the output layer."""
    if layout.startswith("tiles") and "int4" not in ext.q8_tile_formats():
        pytest.skip("this build has no vector code for int4 tiles, so the model is not tiled")
    if layout == "bfloat16 tiles" and ext.bf16_tiles_kernel() != "AVX512-BF16":
        pytest.skip("a team shares bfloat16 tiles where the AVX512-BF16 kernel multiplies")
    model_dir = request.getfixturevalue("tiny_qwen2_dir" if model == "qwen2" else "tiny_model_dir")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        head_apart = layout.endswith("head apart")
        if head_apart:
            monkeypatch.setattr(llama, "head_shared_by_team", lambda model: False)
        fused = build(model_dir, layout.removesuffix(", head apart"), True, monkeypatch)
        python = build(model_dir, layout.removesuffix(", head apart"), False, monkeypatch)
        tiles_without_int8 = layout == "tiles" and "int8" not in ext.q8_tile_formats()
        assert fused.stack.runs_head == (not head_apart and not tiles_without_int8)
        fused_logits, fused_cache = run_decodes(fused, getattr(torch, kv_dtype))
        python_logits, python_cache = run_decodes(python, getattr(torch, kv_dtype))
    finally:
        torch.set_num_threads(before)
    assert fused.stack.stack.team_steps == 7  # every decode step, not the prefill
    assert "decode steps as one team of threads" in describe(fused)
    for a, b in zip(fused_logits, python_logits, strict=True):
        assert torch.equal(a, b)
    for (k1, v1), (k2, v2) in zip(fused_cache, python_cache, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_team_barriers_that_sleep_keep_the_numbers(ext, tiny_model_dir, monkeypatch):
    """The team's barriers spin, then sleep until the last member wakes them (fused_blocks.cpp
    SpinBarrier). With no spin at all before each step every wait sleeps: the logits and the
    cache are still the Python path's bit for bit, and the spin grew from zero only because
    waits slept (a wait that ends while spinning doubles it, and 2 x 0 is 0)."""
    if "int4" not in ext.q8_tile_formats():
        pytest.skip("this build has no vector code for int4 tiles, so the model is not tiled")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        fused = build(tiny_model_dir, "tiles", True, monkeypatch)
        python = build(tiny_model_dir, "tiles", False, monkeypatch)
        stack, run = fused.stack.stack, fused.stack.run

        def run_without_spin(*args):
            stack.barrier_spin = 0
            return run(*args)

        monkeypatch.setattr(fused.stack, "run", run_without_spin)
        fused_logits, fused_cache = run_decodes(fused, torch.float32)
        python_logits, python_cache = run_decodes(python, torch.float32)
    finally:
        torch.set_num_threads(before)
    assert stack.team_steps == 7 and stack.barrier_spin > 0
    for a, b in zip(fused_logits, python_logits, strict=True):
        assert torch.equal(a, b)
    for (k1, v1), (k2, v2) in zip(fused_cache, python_cache, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_a_team_refuses_logits_rows_outside_its_step(ext, tiny_model_dir, monkeypatch):
    """The rows whose logits the team computes are checked before its parallel region starts:
    a row past the step's tokens is a clear error, not a read past the buffer."""
    if not {"int4", "int8"} <= set(ext.q8_tile_formats()):
        pytest.skip("this build has no vector code for int4 and int8 tiles, so nothing is tiled")
    model = build(tiny_model_dir, "tiles", True, monkeypatch)
    caches = model.allocate_kv_cache(4, BLOCK)
    step(model, caches, [[0]], [3], [0])  # a prefill, then one decode row
    meta = build_attention_metadata([1], [3], [[0]], BLOCK, for_kernel=True)
    with pytest.raises(RuntimeError, match="logits row 1 is not a row of this step"):
        model.forward(torch.tensor([5]), torch.tensor([3]), caches, meta, torch.tensor([1]))


def test_bfloat16_tiles_fused_equal_the_python_path_bit_for_bit(ext, tiny_model_dir, monkeypatch):
    """A float32 model's bfloat16 linears in tiles run on our kernel, so their layers fuse
    too (engine/kernels/bfloat16_tiles.py)."""
    from engine.kernels.bfloat16_tiles import BFloat16TiledWeight

    if not ext.bf16_tiles_available():
        pytest.skip("this CPU (or build) has neither AMX nor AVX512-BF16")
    monkeypatch.setattr(lp, "_choice", {"precision": "bfloat16", "library": lp.TILES})
    tiled = with_bfloat16_linears(LlamaModel.from_pretrained(tiny_model_dir), "test")
    assert isinstance(tiled.w["0.down"], BFloat16TiledWeight)
    fused = tiled.with_kernels("auto")
    with monkeypatch.context() as patch:
        patch.setattr(llama, "fused_blocks_apply", lambda *args: False)
        python = tiled.with_kernels("auto")
    assert fused.stack is not None and python.stack is None
    assert python.layers[0].mlp.down.kernel is not None  # the same kernel, called from Python
    assert_same_steps(fused, python)


def test_blocks_are_used_only_where_every_step_has_our_kernel(ext, tiny_model_dir):
    """The torch path and a bfloat16 model keep the Python blocks; float32 weights on our
    kernels (the library's matmul called from C++) do not."""
    plain = LlamaModel.from_pretrained(tiny_model_dir)
    assert plain.with_kernels("torch").layers[0].attention.block is None
    fused = plain.with_kernels("auto")
    assert fused.layers[0].attention.block is not None and fused.stack is not None
    quantized = quantize_model(LlamaModel.from_pretrained(tiny_model_dir), "int8")
    assert quantized.with_kernels("torch").layers[0].mlp.block is None
    bf16 = quantize_model(LlamaModel.from_pretrained(tiny_model_dir, dtype=torch.bfloat16), "int8")
    assert bf16.with_kernels("auto").layers[0].attention.block is None


def test_quant_linear_refuses_what_it_cannot_run(ext):
    with pytest.raises(RuntimeError, match="unknown kind"):
        ext.QuantLinear("int3", [torch.zeros(1)], 0)
    with pytest.raises(RuntimeError, match="takes 3 tensors"):
        ext.QuantLinear("int4", [torch.zeros(1)], 32)
    # a tiled matrix's addresses are read once, when it is made: its tensors are checked then
    with pytest.raises(RuntimeError, match="contiguous uint8"):
        ext.QuantLinear("int4_tiles", [torch.zeros(2, 18, 320)], 0)
    tiles = torch.zeros(2, 18, 512, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="scales are contiguous float32"):
        ext.QuantLinear("int8_tiles", [tiles, torch.zeros(31)], 0)
    ext.QuantLinear("int8_tiles", [tiles, torch.zeros(32)], 0)  # 2 tiles of 16 channels
    # a float32 matrix and its packed copy: float32 [out, in] only, the copy [out, in rounded up
    # to 16], and x must fit it
    for bad in (torch.zeros(4, 4, dtype=torch.bfloat16), torch.zeros(4)):
        with pytest.raises(RuntimeError, match=r"float32 matrix \[out, in\]"):
            ext.QuantLinear("float32_mkl", [bad, torch.zeros(4, 16)], 0)
    with pytest.raises(RuntimeError, match="takes 2 tensors"):
        ext.QuantLinear("float32_mkl", [torch.zeros(4, 4)], 0)
    with pytest.raises(RuntimeError, match=r"packed copy \(f32_pack\) is float32 \[out, 16\]"):
        ext.QuantLinear("float32_mkl", [torch.zeros(4, 4), torch.zeros(4, 4)], 0)
    with pytest.raises(RuntimeError, match=r"x \[\.\.\., in\]"):
        ext.QuantLinear("float32_onednn", [torch.zeros(256, 64), torch.zeros(256, 64)], 0)(
            torch.zeros(1, 32)
        )


def test_the_blocks_let_other_python_threads_run(ext):
    """A step's layers run in one C++ call for milliseconds (a long prefill: hundreds); the
    server's event loop, in another thread, must go on streaming meanwhile, so the calls run
    without the GIL. A ticker thread counts while one long matmul runs: with the GIL held it
    could not tick at all during the call."""
    import threading
    import time

    torch.manual_seed(0)
    weight = quantize_int8(torch.randn(4096, 4096))
    linear = ext.QuantLinear("int8", list(weight.tensors()), 0)
    x = torch.randn(192, 4096)
    ticks, stop = [0], threading.Event()

    def ticker():
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.001)

    thread = threading.Thread(target=ticker)
    thread.start()
    try:
        time.sleep(0.01)
        before, start = ticks[0], time.perf_counter()
        linear(x)
        during, seconds = ticks[0] - before, time.perf_counter() - start
    finally:
        stop.set()
        thread.join()
    assert seconds > 0.02  # long enough for a thread that can run to tick several times
    assert during >= 3, f"{during} ticks in {seconds * 1e3:.0f} ms"


def test_tiles_and_rows_give_the_same_model_bit_for_bit(ext, tiny_model_dir, monkeypatch):
    """The load-time repack into tiles changes no number: the GGUF-style model with its layers in
    tiles and in their file's rows gives the same logits and KV cache in every kind of step, since
    both kernels sum in one order (engine/kernels/csrc/q8.h)."""
    tiled = build(tiny_model_dir, "tiles", True, monkeypatch)
    monkeypatch.setattr(llama, "arrange_for_kernels", lambda w, kernels: w)  # rows, as loaded
    rows = build(tiny_model_dir, "tiles", True, monkeypatch)
    if "int4" in ext.q8_tile_formats():
        assert isinstance(tiled.w["0.qkv"], Int4TiledWeight)
    assert isinstance(rows.w["0.qkv"], Int4Weight)
    assert_same_steps(tiled, rows)
