"""A StepReport through the engine core's msgpack channel: every field of every output and
release comes back as it was sent."""

from __future__ import annotations

import io
from dataclasses import fields

from engines.core.core_process import pack, report_document, report_of, unpack_stream
from engines.core.engine import StepOutput
from engines.core.scheduler import Release, StepReport


def crossed(report: StepReport) -> StepReport:
    (message,) = unpack_stream(io.BufferedReader(io.BytesIO(pack(report_document(report)))))
    assert message["k"] == "step"
    return report_of(message)


def test_a_report_crosses_whole() -> None:
    report = StepReport(
        admitted=[(3, 16, 12.5), (4, 0, 12.75)],
        outputs=[
            StepOutput(3, 17, logprob=-0.25, top_logprobs=((17, -0.25), (9, -2.0))),
            StepOutput(4, 5, cached_tokens=8, drafted=3, accepted=2),
        ],
        ended=[Release(3, "eos", step_times={"all_sum": 0.5}), Release(4, "error", "lost")],
        steps=7,
        evicted_bytes=1 << 20,
    )
    assert crossed(report) == report


def test_a_report_is_named_by_its_fields_and_its_rows_by_position() -> None:
    document = report_document(StepReport(outputs=[StepOutput(1, 2)], ended=[Release(1, "eos")]))
    assert set(document) == {"k"} | {field.name for field in fields(StepReport)}
    assert document["outputs"] == [(1, 2, *(field.default for field in fields(StepOutput)[2:]))]
    assert document["ended"] == [(1, "eos", None, {})]
    assert crossed(StepReport()) == StepReport()
