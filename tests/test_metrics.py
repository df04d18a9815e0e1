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
