"""Engine-driving experiments, one module per chapter beside the shared run code (no Streamlit).

    common.py  workloads, WorkloadFeeder (arrivals on the engine clock), RunResult,
               run_workload, run_lockstep (several engines stepped in turn)
    chNN.py    what chapter NN's lab computes: its default workload, its claim, its summaries
               (e.g. ch04 metric definitions and percentiles, ch07 the batching modes, ch08
               chunked prefill on/off with the same requests accepted on both sides)
    ch14_*.py  chapter 14's live server, one module per concern (server, client, load, stream)

The Streamlit side of a lab, where a page would hold too much, is ui/labs/chNN.py. Poisson
arrivals and percentiles come from engine/tools/workload.py, the one definition.

Every latency comes from engine.request.RequestMetrics on the engine clock.
"""

from ui.experiments.ch04 import METRIC_DEFINITIONS, latest_bench, percentile_table
from ui.experiments.ch05 import DtypeMeasurement, measure_dtype
from ui.experiments.ch06 import FragmentationResult, block_tables_frame, fragmentation
from ui.experiments.ch07 import (
    BATCHING_MODES,
    batch_waste,
    batching_config,
    batching_summary,
    batching_workload,
    compare_batching,
)
from ui.experiments.ch08 import (
    CHUNKED_MODES,
    ChunkedComparison,
    chunked_config,
    chunked_summary,
    compare_chunked_prefill,
    long_prompt_workload,
)
from ui.experiments.common import (
    REQUEST_COLUMNS_KO,
    RequestSpec,
    RunResult,
    Workload,
    WorkloadFeeder,
    korean_table,
    make_config,
    measurement_conditions,
    prompt_ids,
    result_of,
    run_workload,
)

__all__ = [
    "BATCHING_MODES",
    "CHUNKED_MODES",
    "ChunkedComparison",
    "DtypeMeasurement",
    "FragmentationResult",
    "METRIC_DEFINITIONS",
    "REQUEST_COLUMNS_KO",
    "RequestSpec",
    "RunResult",
    "Workload",
    "WorkloadFeeder",
    "batch_waste",
    "batching_config",
    "batching_summary",
    "batching_workload",
    "block_tables_frame",
    "chunked_config",
    "chunked_summary",
    "compare_batching",
    "compare_chunked_prefill",
    "fragmentation",
    "korean_table",
    "latest_bench",
    "long_prompt_workload",
    "make_config",
    "measure_dtype",
    "measurement_conditions",
    "percentile_table",
    "prompt_ids",
    "result_of",
    "run_workload",
]
