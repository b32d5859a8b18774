"""`python -m engine selfcheck`: one short run that proves this device serves the model correctly.

    python -m engine selfcheck [--device cuda|cpu|auto] [--model DIR] [--json PATH] [--quick]

A new machine (a GPU box above all) should run this first. In a few minutes it checks, and
prints as a PASS/FAIL table (exit code 1 on any failure):

1. device     what torch sees: versions, GPU name and memory, the default dtype
2. load       the model artifact loads into the engine (and transformers, the oracle)
3. oracle     greedy tokens equal transformers' on a few prompts, in float32 on the device (and
              on CUDA also in bfloat16). A divergence is excused only at a *near tie*: where
              transformers' own top-2 logits differ by less than a small margin, and our token is
              its runner-up. Near ties are listed, never hidden.
4. features   prefix caching (a shared system prompt hits the cache), chunked prefill (a tiny
              token budget), preemption by recompute and by swap (a tiny KV cache): each must
              happen *and* leave the greedy outputs equal to the oracle's
5. kv sizing  how many KV blocks this device would get (CUDA: from free memory after a profiling
              forward, `gpu_memory_utilization`; CPU: the configured bytes)
6. graphs     CUDA only: decode step time with and without CUDA graphs
7. bench      `bench --quick` (shrunk further with --quick), reusing engine/tools/bench/
"""

from __future__ import annotations

import datetime
import gc
import json
import platform
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from engine.tools.near_tie import TIE_MARGIN, compare_greedy, summarize

NEW_TOKENS = 16
ORACLE_KV_BLOCKS = 128
SYSTEM = (
    "You are a careful teaching assistant for a course on LLM inference systems. Answer in two or "
    "three short sentences, define every technical term you use, prefer concrete numbers over "
    "vague words, and say so plainly when you are not sure."
)
NOTES = (
    "A paged KV cache keeps the keys and values of every token in fixed-size blocks, and a block "
    "table maps each request's logical blocks to physical ones. "
)


@dataclass
class CheckResult:
    name: str
    status: str  # "PASS", "FAIL" or "SKIP"
    detail: str
    seconds: float = 0.0
    data: dict = field(default_factory=dict)


@dataclass
class SelfCheckConfig:
    model: str | None = None  # None: the embedded default artifact
    device: str = "auto"
    quick: bool = False  # a much smaller bench (for tests and impatient people)
    enforce_eager: bool = False  # True: no CUDA graphs
    new_tokens: int = NEW_TOKENS


class CheckFailed(Exception):
    """A check's verdict, with the numbers that support it."""

    def __init__(self, detail: str, data: dict | None = None):
        super().__init__(detail)
        self.data = data or {}


# ---------------------------------------------------------------------------------------------
# The oracle: greedy tokens against transformers', with the near-tie rule


def hf_greedy(hf_model, ids: list[int], n: int, device: torch.device) -> list[int]:
    """transformers' greedy continuation of `ids`, `n` tokens, ignoring EOS."""
    with torch.no_grad():
        gen = hf_model.generate(
            torch.tensor([ids], device=device),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device),
            do_sample=False,
            max_new_tokens=n,
            eos_token_id=None,
            pad_token_id=0,
        )
    return gen[0, len(ids) :].tolist()


# ---------------------------------------------------------------------------------------------
# The run


class SelfCheck:
    """Runs the checks in order; one that raises is a FAIL, and the others still run."""

    def __init__(
        self,
        config: SelfCheckConfig,
        log: Callable[[str], None] = print,
        after_each: Callable[[list[CheckResult]], None] | None = None,
    ):
        self.config = config
        self.log = log
        self.after_each = after_each  # called with the results so far after every check
        self.results: list[CheckResult] = []
        self.device: torch.device | None = None
        self.model_dir: Path | None = None
        self.prompts: dict[str, list[int]] = {}
        self.reference: dict[str, list[int]] = {}
        self.llm = None  # the float32 engine of the oracle, reused by later checks
        self.hf = None  # transformers' float32 model: the oracle
        self.graphs = "off"

    # -- helpers -------------------------------------------------------------------------------

    def run_check(self, name: str, fn: Callable[[], tuple[str, str, dict]]) -> CheckResult:
        self.log(f"[selfcheck] {name} ...")
        start = time.perf_counter()
        try:
            status, detail, data = fn()
        except CheckFailed as failure:
            status, detail, data = "FAIL", str(failure), failure.data
        except Exception as error:  # noqa: BLE001 — a crash is a failed check, the rest still run
            status, detail = "FAIL", f"{type(error).__name__}: {error}"
            data = {"traceback": traceback.format_exc()}
        result = CheckResult(name, status, detail, time.perf_counter() - start, data)
        self.results.append(result)
        self.log(f"[selfcheck] {name}: {status} {detail}")
        if self.after_each is not None:
            self.after_each(self.results)
        return result

    def make_llm(self, dtype: str = "float32", **kwargs):
        from engine.entrypoints.llm import LLM
        from engine.worker.cuda_graphs import configure_engine

        kwargs.setdefault("num_kv_blocks", ORACLE_KV_BLOCKS)
        kwargs.setdefault("max_model_len", 1024)
        llm = LLM(
            model=str(self.model_dir),
            device=self.device.type,
            dtype=dtype,
            enforce_eager=self.config.enforce_eager,
            **kwargs,
        )
        self.graphs = configure_engine(llm.engine)
        return llm

    def generate(self, llm, names: list[str]) -> dict[str, list[int]]:
        from engine.sampling_params import SamplingParams

        params = SamplingParams(max_tokens=self.config.new_tokens, temperature=0.0, ignore_eos=True)
        outs = llm.generate(
            prompt_token_ids=[self.prompts[n] for n in names],
            sampling_params=params,
            use_tqdm=False,
        )
        return {n: o.token_ids for n, o in zip(names, outs)}

    def compare(self, ours: dict[str, list[int]], hf=None, reference=None, dtype=torch.float32):
        hf, reference = hf or self.hf, reference or self.reference
        return summarize(
            [
                compare_greedy(hf, n, self.prompts[n], ours[n], reference[n], TIE_MARGIN[dtype])
                for n in ours
            ]
        )

    # -- 1. device ------------------------------------------------------------------------------

    def check_device(self):
        from engine.worker.worker import resolve_device, resolve_dtype

        self.device = resolve_device(self.config.device)
        data = {
            "device": self.device.type,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "default_dtype": str(resolve_dtype(None, self.device)).removeprefix("torch."),
            "python": platform.python_version(),
        }
        if self.device.type == "cuda":
            props = torch.cuda.get_device_properties(self.device)
            free, total = torch.cuda.mem_get_info(self.device)
            data.update(
                gpu=props.name,
                gpu_memory_gib=total / 2**30,
                gpu_free_gib=free / 2**30,
                capability=f"{props.major}.{props.minor}",
                bf16=torch.cuda.is_bf16_supported(),
            )
            where = (
                f"{props.name}, {total / 2**30:.1f} GiB ({free / 2**30:.1f} free), "
                f"CUDA {torch.version.cuda}"
            )
        else:
            where = f"{platform.machine()}, {torch.get_num_threads()} threads"
            data["threads"] = torch.get_num_threads()
        return (
            "PASS",
            f"{self.device.type}: {where}; torch {torch.__version__}; default dtype "
            f"{data['default_dtype']}",
            data,
        )

    # -- 2. load --------------------------------------------------------------------------------

    def check_load(self):
        from transformers import AutoModelForCausalLM

        from engine.artifact import resolve_model_path

        self.model_dir = resolve_model_path(self.config.model)
        self.llm = self.make_llm()
        self.prompts = make_prompts(self.llm.engine.tokenizer)
        torch.manual_seed(0)
        self.hf = (
            AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
            .to(self.device)
            .eval()
        )
        engine = self.llm.engine
        return (
            "PASS",
            (
                f"{self.model_dir.name}: {engine.weight_bytes() / 1e6:.1f} MB of weights on "
                f"{self.device.type}; CUDA graphs {self.graphs}"
            ),
            {
                "model": str(self.model_dir),
                "weight_bytes": engine.weight_bytes(),
                "cuda_graphs": self.graphs,
            },
        )

    # -- 3. oracle ------------------------------------------------------------------------------

    def check_oracle_float32(self):
        names = [n for n in self.prompts if n != "sys_q2"]
        self.reference = {
            n: hf_greedy(self.hf, ids, self.config.new_tokens, self.device)
            for n, ids in self.prompts.items()
        }
        ok, line, data = self.compare(self.generate(self.llm, names))
        return (
            ("PASS" if ok else "FAIL"),
            f"float32, {self.config.new_tokens} tokens each: {line}",
            data,
        )

    def check_oracle_bf16(self):
        if self.device.type != "cuda":
            return "SKIP", "bfloat16 is compared on CUDA only (the CPU default is float32)", {}
        from transformers import AutoModelForCausalLM

        hf = (
            AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.bfloat16)
            .to(self.device)
            .eval()
        )
        names = [n for n in self.prompts if n != "sys_q2"]
        reference = {
            n: hf_greedy(hf, self.prompts[n], self.config.new_tokens, self.device) for n in names
        }
        llm = self.make_llm(dtype="bfloat16")
        ok, line, data = self.compare(self.generate(llm, names), hf, reference, torch.bfloat16)
        del hf, llm
        return (
            ("PASS" if ok else "FAIL"),
            f"bfloat16 against transformers in bfloat16: {line}",
            data,
        )

    # -- 4. features ----------------------------------------------------------------------------

    def check_prefix_caching(self):
        """sys_q1 ran in the oracle batch; sys_q2 shares its system prompt and must hit."""
        ours = self.generate(self.llm, ["sys_q2"])
        hits = sum(s.num_prefix_hit_tokens for r in self.llm.step_records for s in r.scheduled)
        ok, line, data = self.compare(ours)
        data["prefix_hit_tokens"] = hits
        if hits == 0:
            raise CheckFailed(
                "the second request with the shared system prompt found nothing in the cache", data
            )
        return (
            ("PASS" if ok else "FAIL"),
            f"{hits} prompt tokens served from the cache; {line}",
            data,
        )

    def check_chunked_prefill(self):
        llm = self.make_llm(max_num_batched_tokens=16)
        names = [n for n in self.prompts if n != "sys_q2"]
        ours = self.generate(llm, names)
        chunks = sum(s.phase == "chunked_prefill" for r in llm.step_records for s in r.scheduled)
        ok, line, data = self.compare(ours)
        data["chunked_prefill_steps"] = chunks
        if chunks == 0:
            raise CheckFailed("a 16-token budget produced no chunked prefill step", data)
        return (
            ("PASS" if ok else "FAIL"),
            f"{chunks} chunked prefill shares (budget 16); {line}",
            data,
        )

    def check_preemption(self, mode: str):
        """A cache that holds the longest request but not the batch: requests must be preempted."""
        from engine.utils import cdiv

        longest = max(len(ids) for ids in self.prompts.values()) + self.config.new_tokens
        blocks = cdiv(longest, 16) + 1
        llm = self.make_llm(
            num_kv_blocks=blocks,
            max_model_len=blocks * 16,
            max_num_batched_tokens=64,
            preemption_mode=mode,
        )
        ours = self.generate(llm, [n for n in self.prompts if n != "sys_q2"])
        stats = llm.engine.stats
        ok, line, data = self.compare(ours)
        data.update(
            num_kv_blocks=blocks,
            **{
                k: stats[k]
                for k in (
                    "preemptions",
                    "recomputed_tokens",
                    "swapped_out_blocks",
                    "swapped_in_blocks",
                )
            },
        )
        if stats["preemptions"] == 0:
            raise CheckFailed(f"no preemption with {blocks} KV blocks", data)
        if mode == "swap" and stats["swapped_out_blocks"] == 0:
            raise CheckFailed("swap mode preempted without swapping any block out", data)
        how = (
            f"{stats['swapped_out_blocks']} blocks swapped out"
            if mode == "swap"
            else f"{stats['recomputed_tokens']} tokens recomputed"
        )
        return (
            ("PASS" if ok else "FAIL"),
            (f"{stats['preemptions']} preemptions in {blocks} blocks, {how}; {line}"),
            data,
        )

    # -- 5. KV-cache sizing ---------------------------------------------------------------------

    def check_kv_sizing(self):
        """The cache the default engine would get here: the device's default dtype, the model's
        full context, `gpu_memory_utilization` on CUDA (sized only: nothing is allocated)."""
        from engine.config import (
            DEFAULT_BLOCK_SIZE,
            DEFAULT_CPU_KV_CACHE_BYTES,
            DEFAULT_GPU_MEMORY_UTILIZATION,
            DEFAULT_MAX_NUM_SEQS,
        )
        from engine.worker.worker import Worker, resolve_dtype

        dtype = resolve_dtype(None, self.device)
        worker = Worker(self.model_dir, self.device, dtype, DEFAULT_BLOCK_SIZE)
        worker.load_model()  # shared with the engines of this process (engine.worker.load_model)
        max_len = worker.model.cfg.max_position_embeddings
        blocks = worker.determine_num_blocks(
            max_len, gpu_memory_utilization=DEFAULT_GPU_MEMORY_UTILIZATION
        )
        bytes_ = blocks * worker.bytes_per_block
        tokens = blocks * DEFAULT_BLOCK_SIZE
        source = (
            f"free GPU memory at gpu_memory_utilization={DEFAULT_GPU_MEMORY_UTILIZATION} after a "
            "profiling forward"
            if self.device.type == "cuda"
            else f"the CPU default: {DEFAULT_CPU_KV_CACHE_BYTES / 2**30:.0f} GiB, or less where "
            f"{DEFAULT_MAX_NUM_SEQS} requests of the full context need less"
        )
        dtype_name = str(dtype).removeprefix("torch.")
        data = {
            "num_blocks": blocks,
            "bytes": bytes_,
            "tokens": tokens,
            "bytes_per_block": worker.bytes_per_block,
            "dtype": dtype_name,
            "max_model_len": max_len,
            "requests_at_max_len": tokens // max_len,
            "source": source,
        }
        return (
            "PASS",
            (
                f"{blocks} blocks = {bytes_ / 2**30:.2f} GiB = {tokens} tokens in {dtype_name} "
                f"({tokens // max_len} requests of {max_len}); from {source}"
            ),
            data,
        )

    # -- 6. CUDA graphs -------------------------------------------------------------------------

    def check_cuda_graphs(self):
        if self.device.type != "cuda":
            return "SKIP", "CUDA graphs need CUDA (decode steps run eagerly on this device)", {}
        if self.config.enforce_eager:
            return "SKIP", "--enforce-eager: graphs are off", {}
        from engine.tools.bench.decode import probe_workload, run_steps, step_breakdown

        # A cache for a full batch of probes (32 × (64 + 32) tokens), so that no step is preempted.
        engine = self.make_llm(num_kv_blocks=256, max_model_len=256).engine
        runner = engine.executor.worker.runner
        vocab, specials = engine.model_config.vocab_size, sorted(engine.tokenizer.special_token_ids)
        batches = (1, 8 if self.config.quick else 32)
        data: dict = {}
        for batch in batches:
            tokens = {}
            for mode in ("eager", "graphs"):
                runner.enable_cuda_graphs(mode == "graphs", max_model_len=engine.max_model_len)
                work = probe_workload(batch, 64, 32, 7 + batch, vocab, specials)
                steps = run_steps(engine, work)
                data[f"batch_{batch}_{mode}"] = step_breakdown(steps, batch)
                tokens[mode] = tokens_by_request(steps)
            same = sum(a == b for a, b in zip(tokens["eager"], tokens["graphs"]))
            data[f"batch_{batch}_identical"] = same
            # float32 either way; the graph's attention sums over padded keys in another order, so
            # a random-token prompt at a near tie may flip (the oracle check is the strict one)
            if same < 0.9 * batch:
                raise CheckFailed(
                    f"batch {batch}: only {same}/{batch} requests identical with graphs", data
                )
        graphs = runner.cuda_graphs
        parts = []
        for b in batches:
            eager, graph = data[f"batch_{b}_eager"], data[f"batch_{b}_graphs"]
            parts.append(
                f"batch {b}: {eager['step_ms']:.2f} → {graph['step_ms']:.2f} ms/step, "
                f"{data[f'batch_{b}_identical']}/{b} identical"
            )
        data["captured"] = graphs.stats.captures
        return "PASS", "decode eager → graphs: " + "; ".join(parts), data

    # -- 7. bench ---------------------------------------------------------------------------------

    def check_bench(self):
        from engine.tools.bench.config import BenchConfig
        from engine.tools.bench.report import fmt
        from engine.tools.bench.run import run_benchmark

        self.release()
        if self.config.quick:  # seconds on a tiny model: every section runs, on a toy workload
            config = BenchConfig.quick_config(
                model=str(self.model_dir),
                device=self.device.type,
                num_requests=4,
                prompt_len=(8, 32),
                output_len=(4, 12),
                max_num_seqs=4,
                probe_prompt_len=16,
                probe_output_len=8,
                probe_repeats=1,
                latency_requests=3,
                latency_rate_fractions=(1.0,),
                bandwidth_bytes=16 << 20,
                matmul_size=256,
                ceiling_repeats=2,
                skip_transformers=True,
            )
        else:
            config = BenchConfig.quick_config(model=str(self.model_dir), device=self.device.type)
        r = run_benchmark(config, log=lambda msg: self.log(f"           bench {msg.strip()}"))
        off, dec, cond = r["offline"], r["decode_batch1"], r["conditions"]
        fraction = dec["fraction_of_roofline"]
        line = (
            f"{cond['dtype']}: offline {off['engine']['output_tokens_per_s']:.1f} tokens/s"
            + (f" ({off['ratio']:.2f}× transformers)" if "ratio" in off else "")
            + f"; batch-1 decode {fmt(dec['tokens_per_s'])} tokens/s = "
            f"{fmt(fraction and 100 * fraction, '.0f')}% of the roofline; "
            f"{cond['bench_seconds']:.0f} s (the bench's own engine; CUDA graphs: "
            f"{cond.get('cuda_graphs', 'off')})"
        )
        ok = off["engine"]["output_tokens_per_s"] > 0
        return ("PASS" if ok else "FAIL"), line, {"bench": r}

    def release(self) -> None:
        """Drop this run's engines and reference models: the bench sizes its cache from free
        memory."""
        self.llm = self.hf = None
        gc.collect()
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.empty_cache()

    # -- all --------------------------------------------------------------------------------------

    def run(self) -> list[CheckResult]:
        if self.run_check("device", self.check_device).status == "FAIL":
            return self.results
        if self.run_check("load", self.check_load).status == "FAIL":
            return self.results
        if self.run_check("oracle float32", self.check_oracle_float32).status != "FAIL":
            self.run_check("prefix caching", self.check_prefix_caching)
        self.run_check("oracle bfloat16", self.check_oracle_bf16)
        self.run_check("chunked prefill", self.check_chunked_prefill)
        self.run_check("preemption recompute", lambda: self.check_preemption("recompute"))
        self.run_check("preemption swap", lambda: self.check_preemption("swap"))
        self.run_check("kv cache sizing", self.check_kv_sizing)
        self.run_check("cuda graphs", self.check_cuda_graphs)
        self.run_check("bench", self.check_bench)
        return self.results


def tokens_by_request(steps: list) -> list[list[int]]:
    """Each request's generated tokens, requests in the order they were added (req-0, req-1...)."""
    seq: dict[str, list[int]] = {}
    for _, record in steps:
        for request_id, tokens in record.new_tokens.items():
            seq.setdefault(request_id, []).extend(tokens)
    return [seq[k] for k in sorted(seq, key=lambda k: int(k.rsplit("-", 1)[-1]))]


def make_prompts(tokenizer) -> dict[str, list[int]]:
    """A few prompts of different kinds (English, Korean, code, chat, a long one first so that
    FCFS preempts the short ones), and two chats sharing a system prompt."""

    def chat(text: str, system: str | None = None) -> str:
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": text}
        ]
        return tokenizer.apply_chat_template(messages)

    long_text = "Summarize these notes in one sentence.\n\n"
    while len(tokenizer.encode(long_text)) < 120:
        long_text += NOTES
    texts = {
        "long": chat(long_text),
        "english": "The history of the printing press begins",
        "korean": "대한민국의 수도는 서울이며, 서울은",
        "code": 'def is_prime(n):\n    """Return True if n is prime."""\n',
        "chat_ko": chat("한국의 수도는 어디인가요? 짧게 답해 주세요."),
        "short": "Hi",
        "sys_q1": chat("What is a KV cache?", SYSTEM),
        "sys_q2": chat("Why does batching raise throughput?", SYSTEM),
    }
    return {name: tokenizer.encode(text) for name, text in texts.items()}


# ---------------------------------------------------------------------------------------------
# Report


def format_table(results: list[CheckResult]) -> str:
    lines = [f"{'check':<22}{'result':<8}{'seconds':>8}  detail", "-" * 100]
    for r in results:
        lines.append(f"{r.name:<22}{r.status:<8}{r.seconds:8.1f}  {r.detail}")
    failed = [r.name for r in results if r.status == "FAIL"]
    lines.append("-" * 100)
    lines.append("ALL PASSED" if not failed else f"FAILED: {', '.join(failed)}")
    return "\n".join(lines)


def to_json(config: SelfCheckConfig, results: list[CheckResult], seconds: float) -> dict:
    return {
        "schema": 1,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "config": asdict(config),
        "passed": not any(r.status == "FAIL" for r in results),
        "seconds": seconds,
        "checks": [asdict(r) for r in results],
    }


def main(args) -> int:
    """Entry point for `python -m engine selfcheck` (args from engine/entrypoints/cli.py)."""
    config = SelfCheckConfig(
        model=args.model, device=args.device, quick=args.quick, enforce_eager=args.enforce_eager
    )
    start = time.perf_counter()

    def write_json(results: list[CheckResult]) -> None:
        """The file after every check, not only at the end: a run stopped by a time limit (a
        lent GPU's minutes, docs/scripts/gpu_check.sh) keeps the checks it finished."""
        if args.json:
            path = Path(args.json)
            path.parent.mkdir(parents=True, exist_ok=True)
            report = to_json(config, results, time.perf_counter() - start)
            path.write_text(json.dumps(report, indent=2, ensure_ascii=False, default=str))

    log = lambda msg: print(msg, flush=True)  # noqa: E731
    results = SelfCheck(config, log=log, after_each=write_json).run()
    seconds = time.perf_counter() - start
    print()
    print(format_table(results))
    print(f"selfcheck took {seconds:.0f} s")
    if args.json:  # written after the last check already
        print(f"results written to {args.json}")
    return 1 if any(r.status == "FAIL" for r in results) else 0
