"""A Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) on a paged KV cache.

Read it top to bottom like nanoGPT: embedding → N × (RMSNorm → attention → residual → RMSNorm →
SwiGLU MLP → residual) → final RMSNorm → logits from the (usually tied) embedding matrix.

Two things make it an *inference* model rather than a training one:
- the input is a flat batch of all scheduled tokens of all requests, so every linear layer runs
  once per step over all of them (the batching that makes serving efficient);
- K and V go to a paged cache and attention reads them back through block tables
  (engine/layers/attention.py), so each step only computes the new tokens.
The model decides nothing: which tokens to run, and where their K/V go, come from outside.

The same class runs in every tensor- and pipeline-parallel worker process: its linear layers
hold this rank's shard (engine/layers/linear.py: the row-parallel ones all-reduce), and a
pipeline stage holds a range of the layers, receiving its input from the stage before and
sending its output to the one after. At tensor and pipeline parallel 1 there is no difference.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
from pathlib import Path

import torch
from safetensors import safe_open

from engine import kernels as kernel_lib
from engine.kernels import huge_pages
from engine.kernels.bfloat16_tiles import BFloat16TiledWeight, tiles_available, with_tiles
from engine.kernels.float32_linear import float32_linear_backend
from engine.kernels.quant import arrange_for_kernels, storage_key, weight_nbytes
from engine.layers.attention import AttentionMetadata, paged_attention
from engine.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from engine.layers.ops import (
    CustomOp,
    RMSNorm,
    RotaryEmbedding,
    SiluAndMul,
    VocabEmbedding,
    rope_inverse_frequencies,
)
from engine.layers.sharding import ParallelContext, head_ranges, mlp_range, stage_layers
from engine.models.config import LlamaConfig

logger = logging.getLogger(__name__)


class LlamaAttention(CustomOp):
    """q/k/v in one matmul, RoPE on queries and keys, paged attention, then the output
    projection (whose all-reduce, under tensor parallel, makes this rank's partial sum whole).
    `forward_cpu`: the same kernels in one C++ call (`block`), where every step has one of ours."""

    def __init__(self, model: "LlamaModel", i: int):
        cfg, w, kernels = model.cfg, model.w, model.linear_kernels
        self.qkv = QKVParallelLinear(w[f"{i}.qkv"], w.get(f"{i}.qkv_bias"), kernels)
        self.o = RowParallelLinear(w[f"{i}.o"], None, kernels, model.all_reduce)
        self.rotary = model.rotary
        self.num_heads = cfg.num_heads  # this rank's heads under tensor parallel
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.block = None
        if fused_blocks_apply(model, self.qkv, self.o):
            bias = self.qkv.bias.float().contiguous() if self.qkv.bias is not None else None
            self.block = model.kernels.AttentionBlock(
                self.qkv.kernel,
                self.o.kernel,
                bias,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                self.scale,
            )
        super().__init__(model.kernels if self.block else None, model.dtype, model.device)
        self.kernels = model.kernels  # the unfused path's attention kernel, if any

    def forward_cpu(self, x, cos, sin, kv_cache, attn_meta: AttentionMetadata) -> torch.Tensor:
        if attn_meta.kernel_tiles is None:  # metadata for torch's attention (a graph step's)
            return self.forward_native(x, cos, sin, kv_cache, attn_meta)
        return self.block(x, cos, sin, *kv_cache, *attn_meta.kernel_work())

    def forward_native(self, x, cos, sin, kv_cache, attn_meta: AttentionMetadata) -> torch.Tensor:
        heads, kv_heads, d = self.num_heads, self.num_kv_heads, self.head_dim
        qk, v = self.qkv(x).split([(heads + kv_heads) * d, kv_heads * d], dim=-1)
        # Queries and keys are rotated alike, so all their heads are rotated in one call.
        qk = self.rotary(qk.view(-1, heads + kv_heads, d), cos, sin)
        q, k = qk.split([heads, kv_heads], dim=1)
        v = v.view(-1, kv_heads, d)
        o = paged_attention(q, k, v, kv_cache[0], kv_cache[1], attn_meta, self.scale, self.kernels)
        return self.o(o.flatten(1))


class LlamaMLP(CustomOp):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up in one matmul. `forward_cpu`: the same
    three kernels in one C++ call (`block`), where each has one of ours."""

    def __init__(self, model: "LlamaModel", i: int):
        w, kernels = model.w, model.linear_kernels
        self.gate_up = MergedColumnParallelLinear(w[f"{i}.gate_up"], None, kernels)
        self.act = SiluAndMul(model.kernels, model.dtype, model.device)
        self.down = RowParallelLinear(w[f"{i}.down"], None, kernels, model.all_reduce)
        self.block = None
        if fused_blocks_apply(model, self.gate_up, self.down):
            self.block = model.kernels.MlpBlock(self.gate_up.kernel, self.down.kernel)
        super().__init__(model.kernels if self.block else None, model.dtype, model.device)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.gate_up(x)))


def fused_blocks_apply(model: "LlamaModel", *linears) -> bool:
    """A block runs as one C++ call (engine/kernels/csrc/fused_blocks.cpp) when each of its
    steps has our kernel: a float32 model on the CPU with our attention, norms, RoPE and SwiGLU,
    its matrices on our linear kernels (quantized, in bfloat16 tiles, or float32 on the chosen
    library, called from C++), and no all-reduce between them (tensor parallel 1). The numbers
    are the Python path's, bit for bit: the same kernels in the same order; the Python between
    them (1.3 ms of a 6 ms 4-bit decode step) is what goes."""
    return (
        model.kernels is not None
        and model.dtype == torch.float32
        and model.all_reduce is None
        and all(linear.kernel is not None for linear in linears)
    )


class LayerStack:
    """All the layers as one C++ call a step (engine/kernels/csrc/fused_blocks.cpp): each
    layer's fused attention and MLP blocks and the norms between them, in the order of
    `LlamaModel.run_layers`, with no Python between the kernels (what a CUDA graph does for a
    GPU step: engine/worker/cuda_graphs.py). When every matrix is in tiles (a GGUF's), a decode
    step of up to 8 tokens runs as one team of threads in one parallel region, sharing each
    matrix's tiles and waiting at barriers, instead of starting ~150 parallel loops a step (a
    float32 model's the same with its matrices' rows, on our few-row kernel, a weight-only int8
    or int4 model's with its rows, 16 channels at a time, and bfloat16 linears' tiles where the
    AVX512-BF16 kernel multiplies them); and when the output layer is one a team can share too,
    that team runs the final norm and the output layer for the rows that sample (`runs_head`):
    the step's largest matrix is shared the same way, and the logits come out of the same
    parallel region."""

    def __init__(self, model: "LlamaModel"):
        layers = model.layers
        self.stack = model.kernels.LayerStack(
            [layer.attention.block for layer in layers],
            [layer.mlp.block for layer in layers],
            [layer.input_norm.weight for layer in layers],
            [layer.post_norm.weight for layer in layers],
            model.cfg.rms_norm_eps,
        )
        self.runs_head = self.stack.team and head_shared_by_team(model)
        if self.runs_head:
            self.stack.set_head(model.final_norm.weight, model.lm_head.kernel)

    def run(self, h, cos, sin, kv_caches, attn_meta: AttentionMetadata, logits_indices):
        """(h, mlp_out, logits): the logits where a team step ran the head, else None."""
        k_caches, v_caches = [k for k, _ in kv_caches], [v for _, v in kv_caches]
        rows = logits_indices if self.runs_head else None
        return self.stack(h, cos, sin, k_caches, v_caches, *attn_meta.kernel_work(), rows)


def head_shared_by_team(model: "LlamaModel") -> bool:
    """The final norm on our kernel and the output layer on one a team can share (a GGUF's in
    tiles, a float32 one, a weight-only int8 one, or bfloat16 tiles without AMX)."""
    norm, head = model.final_norm, model.lm_head
    return (
        norm is not None
        and norm.forward == norm.forward_cpu
        and head is not None
        and head.kernel is not None
        and head.kernel.shared_by_team
    )


def layer_stack(model: "LlamaModel") -> LayerStack | None:
    """The stack, when every layer's blocks are fused and its norms are our kernel."""
    layers = model.layers
    fused = all(layer.attention.block and layer.mlp.block for layer in layers)
    norms_ours = all(layer.input_norm.forward == layer.input_norm.forward_cpu for layer in layers)
    return LayerStack(model) if layers and fused and norms_ours else None


class LlamaDecoderLayer:
    """One block: RMSNorm → attention → residual → RMSNorm → MLP → residual (the residual adds
    are fused into the norms that follow them: LlamaModel.forward)."""

    def __init__(self, model: "LlamaModel", i: int):
        w, eps = model.w, model.cfg.rms_norm_eps
        kernels, dtype = model.kernels, model.dtype
        self.input_norm = RMSNorm(w[f"{i}.input_norm"], eps, kernels, dtype)
        self.attention = LlamaAttention(model, i)
        self.post_norm = RMSNorm(w[f"{i}.post_norm"], eps, kernels, dtype)
        self.mlp = LlamaMLP(model, i)


class LlamaModel:
    """The weights (`w`, by name: this rank's shard) and the layers built from them; plain
    Python objects, no nn.Module machinery is needed to infer."""

    def __init__(
        self,
        cfg: LlamaConfig,
        weights: dict[str, torch.Tensor],
        device: torch.device,
        dtype: torch.dtype,
        parallel: ParallelContext | None = None,
    ):
        self.cfg = cfg  # this rank's part: its layers, heads and MLP width
        self.device = device
        self.dtype = dtype
        if any(isinstance(t, torch.Tensor) and t.requires_grad for t in weights.values()):
            raise ValueError("inference weights must not require gradients (forward records none)")
        self.w = weights
        self.parallel = parallel or ParallelContext()
        self.inv_freq = rope_inverse_frequencies(cfg).to(device)
        if device.type == "cpu" and dtype == torch.float32:  # time MKL and oneDNN on them now
            float32_linear_backend([t for k, t in weights.items() if is_layer_matrix(k, t)])
        self.kernel_path = "torch"  # which attention runs: "torch" (reference) or "cpu" (C++)
        self.kernels = None  # the compiled extension when kernel_path == "cpu"
        # The same for the weight-only int8/int4 linears (they also take bfloat16 activations).
        self.linear_kernel_path = "torch"
        self.linear_kernels = None
        self.build_layers()

    def build_layers(self) -> None:
        """The layers, from the weights and the kernel choice: each op picks its
        implementation here, once."""
        w, cfg, stage = self.w, self.cfg, self.parallel
        comm = stage.comm if stage.tp > 1 else None
        self.all_reduce = comm.all_reduce if comm is not None else None
        self.rotary = RotaryEmbedding(self.inv_freq, self.kernels, self.dtype)
        self.embed = None
        if stage.is_first_stage:
            self.embed = VocabEmbedding(w["embed"], self.dtype, self.linear_kernels)
        self.layers = [LlamaDecoderLayer(self, i) for i in range(cfg.num_layers)]
        self.final_norm = self.lm_head = None
        if stage.is_last_stage:
            self.final_norm = RMSNorm(w["final_norm"], cfg.rms_norm_eps, self.kernels, self.dtype)
            self.lm_head = ReplicatedLinear(w["lm_head"], None, self.linear_kernels)
        self.stack = layer_stack(self)  # every layer as one C++ call, where each block is one

    def rebuilt(self, **changes) -> "LlamaModel":
        """A copy (the same weight tensors unless `changes` replaces them) with `changes` set and
        its layers built again: engines sharing one set of weights may each choose their
        kernels, a quantized model replaces some weights."""
        model = copy.copy(self)
        for name, value in changes.items():
            setattr(model, name, value)
        model.build_layers()
        return model

    def with_kernels(self, mode: str) -> "LlamaModel":
        """This model (same weight tensors, no copy) with its attention, norms, RoPE and SwiGLU
        and its quantized linears on our C++ kernels (mode "auto", when they build and apply:
        CPU; float32 for the attention) or on the torch reference ("torch"); a bfloat16 model's
        linears on our bfloat16 kernel where this CPU has AMX or AVX512-BF16 (its matrices cut
        into tiles, once per process); a float32 model's linears on our C++ linear (up to 8
        rows on our own kernel, more rows on the float32 library: float32_linear.py)."""
        path = kernel_lib.resolve(mode, self.device, self.dtype)
        logger.info("kernels=%r: %s", mode, kernel_lib.describe(path))
        linear_path = "torch"  # float weights: no quantized linear (nothing to build for bf16)
        w = self.w
        if getattr(self, "quantization", None):  # set by quantization.py quantize_model
            linear_path = kernel_lib.resolve_linear(mode, self.device, self.dtype)
            w = arrange_for_kernels(w, kernel_lib.load() if linear_path == "cpu" else None)
            logger.info("kernels=%r: quantized linears on %s", mode, linear_path)
        elif any(isinstance(t, BFloat16TiledWeight) for t in w.values()):  # bfloat16 linears
            linear_path = kernel_lib.resolve_linear(mode, self.device, self.dtype)
        elif self.dtype == torch.bfloat16:  # its matrices in tiles, where our kernel runs them
            linear_path = kernel_lib.resolve_linear(mode, self.device, self.dtype)
            if linear_path == "cpu" and tiles_available(kernel_lib.load()):
                w = with_tiles(
                    w, [n for n, t in w.items() if is_layer_matrix(n, t) or n == "lm_head"]
                )
            else:
                linear_path = "torch"
        elif self.dtype == torch.float32:  # the float32 library, one row's channels split
            linear_path = kernel_lib.resolve_linear(mode, self.device, self.dtype)
        return self.rebuilt(
            w=w,
            kernel_path=path,
            kernels=kernel_lib.load() if path == "cpu" else None,
            linear_kernel_path=linear_path,
            linear_kernels=kernel_lib.load() if linear_path == "cpu" else None,
        )

    # -- loading -----------------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls, model_dir: str | Path, device="cpu", dtype=torch.float32, parallel=None
    ) -> "LlamaModel":
        """Load by tensor name from model.safetensors. Q/K/V are concatenated into one matrix and
        gate/up into another, so each layer runs 4 matmuls instead of 7 (vLLM does the same).
        Under tensor or pipeline parallel (`parallel`), keep only this rank's shard."""
        model_dir = Path(model_dir)
        cfg = LlamaConfig.from_model_dir(model_dir)
        device = torch.device(device)
        weights = _read_weights(model_dir, cfg, device, dtype)
        parallel = parallel or ParallelContext()
        if (parallel.tp, parallel.pp) != (1, 1):
            p = parallel
            cfg, weights = shard_weights(cfg, weights, p.tp, p.tp_rank, p.pp, p.pp_rank)
        return cls(cfg, weights, device, dtype, parallel)

    def distinct_weights(self) -> list:
        """Every weight once (a tied lm_head shares the embedding's storage); a weight-only
        quantized matrix (engine/kernels/quant.py, engine/worker/quantization.py) or a bfloat16
        one prepacked for oneDNN or cut into tiles (engine/kernels/linear_precision.py)
        counts as one."""
        seen, weights = set(), []
        for t in self.w.values():
            key = storage_key(t)
            if key not in seen:
                seen.add(key)
                weights.append(t)
        return weights

    def num_parameters(self) -> int:
        return sum(math.prod(t.shape) for t in self.distinct_weights())

    def weight_bytes(self) -> int:
        """Bytes the weights occupy on the device (what a decode step reads); a quantized
        matrix counts its packed values, scales and minimums."""
        return sum(weight_nbytes(t) for t in self.distinct_weights())

    # -- forward -----------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] all scheduled tokens of the step, flattened
        positions: torch.Tensor,  # [num_tokens] each token's position in its own request
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (K blocks, V blocks)
        attn_meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # rows whose next token is wanted (the runner passes the last
        #                                token of each request that samples this step)
    ) -> torch.Tensor | None:
        """Return logits [len(logits_indices), vocab]: the output layer runs only on those rows.
        None on a rank that computes no logits (an earlier pipeline stage, or a tensor-parallel
        peer of the output rank). No `torch.inference_mode()` around it: no weight requires a
        gradient (checked at construction), so autograd records nothing anyway, and entering
        the mode cost ~15 µs a step in the cold cache a decode step runs in
        (docs/performance.md)."""
        cos, sin = self.rotary.cos_sin(positions)
        h = self.embed(input_ids) if self.embed is not None else self.receive(input_ids.shape[0])
        if self.stack is not None and attn_meta.kernel_tiles is not None:  # run_layers in C++
            h, mlp_out, logits = self.stack.run(h, cos, sin, kv_caches, attn_meta, logits_indices)
            if logits is not None:  # a team step ran the final norm and the output layer too
                return logits
        else:
            h, mlp_out = self.run_layers(h, cos, sin, kv_caches, attn_meta)
        if self.final_norm is None:  # an earlier pipeline stage: the next one goes on from here
            self.parallel.comm.send(h + mlp_out)
            return None
        if not self.parallel.is_output_rank:
            return None
        _, x = self.final_norm(mlp_out, residual=h)
        return self.lm_head(x[logits_indices]).float()

    def run_layers(self, h, cos, sin, kv_caches, attn_meta) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer on the residual stream `h`; returns it with the last MLP's output, not yet
        added (the final norm adds it)."""
        x = self.layers[0].input_norm(h)  # h: the residual stream; x: its normed copy
        for i, layer in enumerate(self.layers):
            # Each sublayer adds to the residual stream, and the next norm reads the sum (one
            # fused call: add, then norm).
            attn_out = layer.attention(x, cos, sin, kv_caches[i], attn_meta)
            h, x = layer.post_norm(attn_out, residual=h)
            mlp_out = layer.mlp(x)
            if i + 1 < len(self.layers):
                h, x = self.layers[i + 1].input_norm(mlp_out, residual=h)
        return h, mlp_out

    def receive(self, num_tokens: int) -> torch.Tensor:
        """A later pipeline stage's input: the hidden states the previous stage sent."""
        shape = (num_tokens, self.cfg.hidden_size)
        return self.parallel.comm.recv(shape, self.dtype, self.device)

    def allocate_kv_cache(
        self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, K and V block tensors [num_blocks, block_size, kv_heads, head_dim], of
        `dtype` (EngineConfig.kv_cache_dtype; None: the model's)."""
        shape = (num_blocks, block_size, self.cfg.num_kv_heads, self.cfg.head_dim)
        dtype = dtype or self.dtype
        if self.device.type == "cpu":  # attention reads blocks scattered over the whole cache
            arena = huge_pages.Arena()
            return [
                (arena.zeros(shape, dtype), arena.zeros(shape, dtype))
                for _ in range(self.cfg.num_layers)
            ]
        return [
            (
                torch.zeros(shape, dtype=dtype, device=self.device),
                torch.zeros(shape, dtype=dtype, device=self.device),
            )
            for _ in range(self.cfg.num_layers)
        ]


def is_layer_matrix(name: str, t) -> bool:
    """A layer's linear matrix ("{i}.qkv", "{i}.o", "{i}.gate_up", "{i}.down"), not a norm or a
    bias (nor a quantized matrix)."""
    return name.split(".")[0].isdigit() and isinstance(t, torch.Tensor) and t.dim() == 2


def _read_weights(model_dir: Path, cfg: LlamaConfig, device, dtype) -> dict[str, torch.Tensor]:
    """Every weight by the model's names ("embed", "{i}.qkv", ..., "lm_head"), fused."""
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    arena = huge_pages.Arena()  # on the CPU, each weight goes to huge pages as it is read

    def read(name: str) -> torch.Tensor:
        if name not in tensors:
            raise KeyError(f"weight {name!r} not found in {model_dir}")
        return tensors.pop(name).to(device=device, dtype=dtype).contiguous()

    def take(name: str) -> torch.Tensor:
        return arena.copy(read(name))

    def fused(*names: str) -> torch.Tensor:
        return arena.copy(torch.cat([read(name) for name in names]))

    weights = {"embed": take("model.embed_tokens.weight")}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        weights[f"{i}.input_norm"] = take(p + "input_layernorm.weight")
        weights[f"{i}.qkv"] = fused(*(p + f"self_attn.{x}_proj.weight" for x in "qkv"))
        if cfg.attention_bias:
            weights[f"{i}.qkv_bias"] = fused(*(p + f"self_attn.{x}_proj.bias" for x in "qkv"))
        weights[f"{i}.o"] = take(p + "self_attn.o_proj.weight")
        weights[f"{i}.post_norm"] = take(p + "post_attention_layernorm.weight")
        weights[f"{i}.gate_up"] = fused(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
        weights[f"{i}.down"] = take(p + "mlp.down_proj.weight")
    weights["final_norm"] = take("model.norm.weight")
    # tied: the output layer reuses the embedding
    weights["lm_head"] = weights["embed"] if cfg.tie_word_embeddings else take("lm_head.weight")
    return weights


def shard_weights(
    cfg: LlamaConfig, weights: dict[str, torch.Tensor], tp: int, tp_rank: int, pp: int, pp_rank: int
) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """This rank's slice of the weight dict (the model's names, its stage's layers renumbered
    from 0), each matrix cut by its layer class, and the config that describes the slice (its
    layers, heads and MLP width). The embedding, lm_head and the norms are replicated."""
    layers = stage_layers(cfg.num_layers, pp)[pp_rank]
    q_heads, kv_heads = head_ranges(cfg, tp, tp_rank)
    columns = mlp_range(cfg, tp, tp_rank)
    out: dict[str, torch.Tensor] = {}
    if pp_rank == 0:
        out["embed"] = weights["embed"]
    for local, i in enumerate(layers):
        out[f"{local}.input_norm"] = weights[f"{i}.input_norm"]
        out[f"{local}.qkv"] = QKVParallelLinear.shard(weights[f"{i}.qkv"], cfg, tp, tp_rank)
        if f"{i}.qkv_bias" in weights:
            bias = weights[f"{i}.qkv_bias"]
            out[f"{local}.qkv_bias"] = QKVParallelLinear.shard(bias, cfg, tp, tp_rank)
        q_columns = range(q_heads.start * cfg.head_dim, q_heads.stop * cfg.head_dim)
        out[f"{local}.o"] = RowParallelLinear.shard(weights[f"{i}.o"], q_columns)
        out[f"{local}.post_norm"] = weights[f"{i}.post_norm"]
        gate_up = weights[f"{i}.gate_up"]
        out[f"{local}.gate_up"] = MergedColumnParallelLinear.shard(gate_up, cfg, tp, tp_rank)
        out[f"{local}.down"] = RowParallelLinear.shard(weights[f"{i}.down"], columns)
    if pp_rank == pp - 1:
        out["final_norm"] = weights["final_norm"]
        out["lm_head"] = weights["lm_head"]  # tied: the same tensor as embed
    local_cfg = dataclasses.replace(
        cfg,
        num_layers=len(layers),
        num_heads=len(q_heads),
        num_kv_heads=len(kv_heads),
        intermediate_size=len(columns),
    )
    return local_cfg, out
