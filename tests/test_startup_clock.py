"""The job's start-up figures (report.startup): which seconds count as preparing, loading and warming up."""

from __future__ import annotations

import pytest

from batchprefill.engine.model_runner import CAPTURING, COMPILING
from batchprefill.report import startup
from batchprefill.report.startup import StartupClock
from batchprefill.report.summary import startup_clause


def clock_at(monkeypatch, times: list[float]) -> StartupClock:
    """A clock whose successive readings are `times`."""
    readings = iter(times)
    monkeypatch.setattr(startup.time, "perf_counter", lambda: next(readings))
    return StartupClock()


def test_a_gpu_start_up_of_1_s_preparing_2_s_loading_and_2_s_of_compiles_and_captures_splits_so(monkeypatch) -> None:
    told = []
    clock = clock_at(monkeypatch, [10.0, 11.0, 11.5, 13.0, 14.5, 15.0])
    clock.building(told.append)  # 11.0
    clock("loading the model")  # 11.5
    clock(COMPILING)  # 13.0
    clock(CAPTURING)  # 14.5
    clock.engine_ready()  # 15.0
    assert told == ["loading the model", COMPILING, CAPTURING]  # the progress bar hears every phase
    assert clock.seconds() == pytest.approx({"prepare_seconds": 1.0, "load_seconds": 2.0, "warm_up_seconds": 2.0})


def test_a_cpu_build_that_names_no_phase_counts_all_of_it_as_loading(monkeypatch) -> None:
    clock = clock_at(monkeypatch, [0.0, 0.25, 1.75])
    clock.building(lambda phase: None)
    clock.engine_ready()
    assert clock.seconds() == pytest.approx({"prepare_seconds": 0.25, "load_seconds": 1.5, "warm_up_seconds": 0.0})


def test_the_summary_names_warm_up_only_where_it_ran() -> None:
    cpu = {"prepare_seconds": 0.84, "load_seconds": 1.26, "warm_up_seconds": 0.0}
    assert startup_clause(cpu) == " (0.8 s preparing the input, 1.3 s loading)"
    gpu = cpu | {"warm_up_seconds": 2.3}
    assert startup_clause(gpu) == " (0.8 s preparing the input, 1.3 s loading, 2.3 s warming up)"
    assert startup_clause({"wall_seconds": 1.0}) == ""  # a row from before these figures
