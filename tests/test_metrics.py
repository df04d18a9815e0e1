"""Metrics land in JSONL and in TensorBoard event files that an independent reader can parse."""

import glob
import struct

import numpy as np
from tensorboardX.proto import event_pb2

from agentgym_jax.train.metrics import MetricsLogger, read_metrics, to_scalars


def _read_events(path):
    """TFRecord framing: u64 length, u32 crc, payload, u32 crc."""
    events = []
    with open(path, "rb") as f:
        while header := f.read(12):
            (length,) = struct.unpack("<Q", header[:8])
            payload = f.read(length)
            f.read(4)
            event = event_pb2.Event()
            event.ParseFromString(payload)
            events.append(event)
    return events


def test_metrics_go_to_jsonl_and_tensorboard(tmp_path):
    logger = MetricsLogger(str(tmp_path), total_steps=3, console=False)
    logger.log(1, {"loss": np.float32(0.5), "status": {"success": 3, "infra_error": 1}})
    logger.log(2, {"loss": 0.25, "kl": float("nan")})
    logger.close()
    records = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert records[0] == {"step": 1, "loss": 0.5, "status/success": 3.0, "status/infra_error": 1.0}
    assert records[1]["loss"] == 0.25 and np.isnan(records[1]["kl"])
    (event_file,) = glob.glob(str(tmp_path / "tensorboard" / "events.*"))
    scalars = {
        (e.step, v.tag): v.simple_value for e in _read_events(event_file) for v in e.summary.value
    }
    assert scalars[(1, "loss")] == 0.5 and scalars[(2, "loss")] == 0.25
    assert scalars[(1, "status/infra_error")] == 1.0
    assert (2, "kl") not in scalars  # non-finite values stay out of the curves


def test_appending_after_a_restart_keeps_earlier_records(tmp_path):
    for step in (1, 2):
        logger = MetricsLogger(str(tmp_path), total_steps=2, start_step=step - 1, console=False)
        logger.log(step, {"loss": step})
        logger.close()
    assert [r["step"] for r in read_metrics(str(tmp_path / "metrics.jsonl"))] == [1, 2]


def test_to_scalars_flattens_nested_dicts():
    assert to_scalars({"a": {"b": {"c": 1}}, "d": np.array(2.0)}) == {"a/b/c": 1.0, "d": 2.0}


def _tensorboard_scalars(logdir, tag):
    """(step, value) of `tag` as TensorBoard shows it: event files in the order they were written
    (by their first event's wall time: names written in one second carry a process-wide counter,
    which does not sort as text), and a file's SessionLog START at step s discards what earlier
    files logged at steps >= s."""
    points = {}
    paths = glob.glob(str(logdir / "tensorboard" / "events.*"))
    for path in sorted(paths, key=lambda path: next(iter(_read_events(path))).wall_time):
        for e in _read_events(path):
            if e.HasField("session_log") and e.session_log.status == event_pb2.SessionLog.START:
                points = {s: v for s, v in points.items() if s < e.step}
            for v in e.summary.value:
                if v.tag == tag:
                    points[e.step] = v.simple_value
    return sorted(points.items())


def test_resume_cuts_metrics_and_tensorboard_back_to_the_restored_step(tmp_path):
    logger = MetricsLogger(str(tmp_path), total_steps=4, console=False)
    for step in (1, 2, 3):  # checkpointed at 2, killed after logging 3
        logger.log(step, {"loss": step})
    logger.close()
    resumed = MetricsLogger(str(tmp_path), total_steps=4, start_step=2, console=False)
    assert [r["step"] for r in read_metrics(str(tmp_path / "metrics.jsonl"))] == [1, 2]
    for step in (3, 4):  # replayed with other values
        resumed.log(step, {"loss": 10 * step})
    resumed.close()
    records = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert [(r["step"], r["loss"]) for r in records] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
    assert _tensorboard_scalars(tmp_path, "loss") == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]


def test_a_logger_that_does_not_write_leaves_no_files(tmp_path):
    logger = MetricsLogger(str(tmp_path / "run"), total_steps=2, console=False, write=False)
    assert logger.log(1, {"loss": np.float32(0.5)}) == {"loss": 0.5}
    logger.close()
    assert not (tmp_path / "run").exists()
