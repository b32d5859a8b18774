"""The benchmark: this machine's limits, the engine against transformers, and where the time goes.

    python -m engine bench [--json PATH] [--quick] [--model PATH]

One module per section, all run in one process, on one artifact and one dtype, in this order:

1. ceilings.py — the machine's ceilings (measured): memory read bandwidth (sum of a large tensor,
   best of N) and matmul throughput per dtype (square matmul, the best kernel, best of N). From
   them two rooflines (derived):
   - decode at batch 1 reads every weight once per token:
     tokens/s ≤ bandwidth / weight bytes
   - batched tokens cost 2 FLOP per weight (multiply + add):
     tokens/s ≤ matmul FLOP/s / (2 × weights)
   Plus the engine's own linear layer at batch 1 over all weights (matrix × vector GB/s): what the
   matmul kernel allows a decode step before anything else in it runs.
2. offline.py — offline throughput on a fixed, seeded workload (mixed prompt and output lengths,
   ignore_eos): the engine (`LLM.generate`, continuous batching) against transformers `generate`
   in padded static batches of the same maximum batch size. Both count only useful tokens: each
   request's own output tokens, never the padding or the extra tokens a static batch runs for
   its longest member. With it, bf16_linears.py: where linear_precision="auto" picks bfloat16
   linears, the same requests on that engine and on one whose KV cache holds bfloat16, each
   with its ratio to the float32 engine and its greedy agreement with it.
3. decode.py — decode at batch 1: tokens/s and its fraction of the decode roofline.
4. decode.py — engine overhead: the share of a step's wall time spent outside the model forward
   (scheduling, input preparation, sampling, output processing, bookkeeping), at batch 1 and at
   full batch. With it, structured.py: the same prompt decoded free and under a JSON schema
   (batch 1 and 4): the grammar mask's time per step, the sampler's, the allowed-token count, and
   the schema's compile time cold and cached.
5. latency.py — latency under load: Poisson arrivals at a few rates through the in-process
   AsyncLLM; TTFT, TPOT and E2E percentiles and the throughput reached.
6. kernels.py — (CPU, float32, full runs) our C++ kernels against torch's linear and attention,
   and decode steps on both paths (`--kernels auto|torch` picks the engine's path everywhere).
7. spec_decode.py — (only with `--speculative ngram`) the same requests with and without n-gram
   drafts, on a repetitive and on a random-token workload.
8. variants.py — (only with `--compare-quantization`) dtype and weight-only quantization side by
   side, and the llama.cpp peer on the same GGUF file (engine/tools/peers/llama_cpp.py).
9. parallel.py — (only with tensor or pipeline parallel > 1) tp × pp worker processes against
   tp 1 on the same requests.
10. fidelity.py — simulator fidelity (engine/tools/simulator.py): calibrate the cost model on
    another workload, then run the offline workload on the real and on the simulated engine and
    compare total time, TTFT p50/p90, TPOT p50 and throughput (calibration cached in
    bench-results/calibration.json).

run.py runs them in that order (its progress lines read [k/n]), targets.py sets the issue's goals
beside the measured values, report.py formats it all, and results.py writes the results to
`bench-results/latest.json` (or `--json PATH`) with the conditions they were measured under
(device, threads, dtype, model, workload, seed, date): a number without its conditions is not a
measurement. `results.load_latest_results()` reads it back for the app.
"""
