"""Tables shown to learners are Arrow-safe: no column mixes numbers and text (Streamlit would log a
pyarrow traceback on every render and fall back to its own string conversion)."""

import math

import pandas as pd
import pyarrow as pa

from ui.experiments.common import display_frame, korean_table


def test_gaps_become_dashes_and_the_table_converts_to_arrow():
    df = pd.DataFrame(
        {
            "요청": ["r0", "r1", "r2"],
            "TTFT (ms)": [323.456, None, 12.0],
            "토큰": [3, 4, 5],
            "비율": [0.12345, math.nan, 1.5],
        }
    )
    shown = display_frame(df)
    assert shown["TTFT (ms)"].tolist() == ["323.5", "—", "12"]
    assert shown["비율"].tolist() == ["0.123", "—", "1.5"]
    assert shown["토큰"].tolist() == [3, 4, 5]  # complete numeric columns stay numeric
    pa.Table.from_pandas(shown)  # raises ArrowInvalid/ArrowTypeError on a mixed column


def test_object_columns_mixing_numbers_and_text_are_all_text():
    df = pd.DataFrame({"값": [1, "없음", 2.5]}, dtype=object)
    assert display_frame(df)["값"].tolist() == ["1", "없음", "2.5"]
    pa.Table.from_pandas(display_frame(df))


def test_korean_table_is_arrow_safe():
    df = pd.DataFrame({"request_id": ["r0", "r1"], "ttft_ms": [1.25, None]})
    pa.Table.from_pandas(korean_table(df))
