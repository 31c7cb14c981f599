"""curation.io.stop: the first SIGTERM/SIGINT only asks for a stop, polled between units; handlers are restored."""

from __future__ import annotations

import os
import signal

import pytest

from curation.io.stop import GracefulStop, StopRequested, check_stop, exit_code, stop_requested


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_is_a_request_polled_between_units(signum, capfd):
    before = signal.getsignal(signum)
    done = []
    with pytest.raises(StopRequested) as e:
        with GracefulStop(what="the part in progress") as stop:
            for unit in range(5):
                check_stop(f"after unit {unit - 1}")
                if unit == 2:
                    os.kill(os.getpid(), signum)  # delivered to the main thread before the next bytecodes
                done.append(unit)  # the unit in progress is finished
            pytest.fail("not stopped")
    assert done == [0, 1, 2] and stop.requested and stop.signum == signum
    assert e.value.signum == signum and e.value.where == "after unit 2"
    assert str(e.value) == f"stopped on {signal.Signals(signum).name} after unit 2"
    assert f"{signal.Signals(signum).name} received: finishing the part in progress, then stopping" in capfd.readouterr().err
    assert signal.getsignal(signum) is before  # restored
    assert exit_code(signum) == 128 + signum


def test_the_first_signal_resets_the_handlers_so_a_second_one_is_not_caught():
    with GracefulStop() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and stop_requested()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and signal.getsignal(signal.SIGINT) is signal.SIG_DFL


def test_outside_a_graceful_stop_polling_does_nothing():
    assert not stop_requested()
    check_stop("anywhere")
    with GracefulStop() as stop:
        assert not stop.requested and not stop_requested()
        check_stop("no signal yet")
