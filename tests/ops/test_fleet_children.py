"""ops/fleet's child processes: one that stops answering is reported with where it is stuck."""

import multiprocessing
import time

import pytest

from ops.fleet.child_log import log_to
from ops.fleet.generators import Child
from ops.tool import ToolError


def stuck_in_a_call(log, control) -> None:
    log_to(log)
    control.recv()  # the command, never answered
    time.sleep(60)


def test_a_child_that_does_not_answer_is_reported_with_its_stack(tmp_path):
    child = Child(multiprocessing.get_context("fork"), stuck_in_a_call, (), tmp_path / "stuck.log")
    try:
        with pytest.raises(ToolError) as raised:
            child.ask("window", "window", timeout=0.5)
    finally:
        child.process.kill()
        child.process.join()
    assert "stuck did not answer within 0 s" in str(raised.value)
    assert "in stuck_in_a_call" in str(raised.value)
