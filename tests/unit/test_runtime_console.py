"""Console view (plain and live modes), the step-line format, and the phase timer."""

import io
import re
import time

from rich.console import Console

from megatron_jetrl.runtime import ConsoleView, PhaseTimer, format_step_line
from megatron_jetrl.runtime.console import format_seconds, format_value

KEYS = ["reward=rollout/reward", "len=rollout/len", "kl=actor/kl", "gen=time/generate_s", "upd=time/update_s",
        "time/sync_s", "{} tok/s/gpu=perf/tok_per_s_gpu"]
METRICS = {"rollout/reward": 0.41, "rollout/len": 17.23, "actor/kl": 1e-4, "time/generate_s": 1.2,
           "time/update_s": 0.4, "time/sync_s": 0.01, "perf/tok_per_s_gpu": 5100.0}
ANSI = re.compile(r"\x1b\[")


def test_step_line_format():
    line = format_step_line(12, 100, METRICS, KEYS, eta_s=2470)
    assert line == ("step 12/100 | reward 0.41 | len 17.2 | kl 1e-4 | gen 1.2s upd 0.4s sync 0.01s"
                    " | 5.1k tok/s/gpu | eta 0:41:10")
    assert format_step_line(1, 2, {}, ["a/b"]) == "step 1/2 | b -"


def test_value_formats():
    assert [format_value(v) for v in (0.0, 0.41, -17.234, 123.4, 5123.0, 2.5e6, 1e-4, -3.2e-7, float("nan"))] == [
        "0", "0.41", "-17.2", "123", "5.12k", "2.5M", "1e-4", "-3.2e-7", "nan"]
    assert [format_seconds(s) for s in (0.0012, 1.234, 59.9, 187.0, 7500.0)] == [
        "1.2ms", "1.23s", "59.9s", "3m07s", "2h05m"]


def test_plain_mode_prints_plain_lines(capsys):
    view = ConsoleView(3, enabled=True, live=False)
    assert not view.live
    with view.phase("generate", total=4) as bar:
        bar.advance(2)
        bar.set_total(8)
    view.step_done(1, METRICS, KEYS)
    view.log("[saved] checkpoint step_00000001")
    view.step_done(3, METRICS, KEYS[:1])
    view.close()
    out = capsys.readouterr().out
    assert not ANSI.search(out)
    lines = out.splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("step 1/3 | reward 0.41 | len 17.2") and " | eta " in lines[0]
    assert lines[1] == "[saved] checkpoint step_00000001"
    assert lines[2] == "step 3/3 | reward 0.41"


def test_live_default_follows_the_terminal(capsys):
    assert not ConsoleView(3, enabled=True, console=Console(file=io.StringIO())).live
    view = ConsoleView(3, enabled=True, console=Console(file=io.StringIO(), force_terminal=True))
    assert view.live
    view.close()


def test_live_mode_renders_bars_and_lines():
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=120, color_system="truecolor")
    with ConsoleView(5, enabled=True, start_step=1, console=console) as view:
        for step in (2, 3):
            with view.phase("generate", total=4) as bar:
                for _ in range(4):
                    bar.advance()
            with view.phase("update"):
                time.sleep(0.01)
            with view.phase("update") as again:  # re-entered: same row, time adds up
                again.set_total(2)
                again.advance(2)
            view._progress.refresh()
            view.step_done(step, METRICS, KEYS)
        view.log("a [bold]message[/bold]")
    out = buf.getvalue()
    assert ANSI.search(out)  # a terminal gets colours and cursor movement
    assert "step 2/5 | reward 0.41" in out and "step 3/5 | reward 0.41" in out
    assert "generate" in out and "update" in out and "4/4" in out and "3/5" in out
    assert "a [bold]message[/bold]" in out  # printed as text, not markup


def test_disabled_view_is_silent(capsys):
    buf = io.StringIO()
    view = ConsoleView(3, enabled=False, live=True, console=Console(file=buf, force_terminal=True))
    with view.phase("generate", total=2) as bar:
        bar.advance()
    view.step_done(1, METRICS, KEYS)
    view.log("hello")
    view.close()
    assert capsys.readouterr().out == "" and buf.getvalue() == ""


def test_a_warning_shows_also_with_the_view_off(capsys):
    view = ConsoleView(3, enabled=False)
    view.warn("precision.exact: at step 2 ...")
    assert capsys.readouterr().err == "WARNING: precision.exact: at step 2 ...\n"


def test_phase_timer_accumulates_and_syncs():
    syncs = []
    timer = PhaseTimer(sync=lambda: syncs.append(1))
    with timer.phase("generate"):
        time.sleep(0.02)
    with timer.phase("update"):
        pass
    with timer.phase("generate"):
        time.sleep(0.01)
    seconds = timer.seconds
    assert list(seconds) == ["generate", "update"]
    assert seconds["generate"] >= 0.03 and seconds["update"] < seconds["generate"]
    assert len(syncs) == 6  # before each clock read
    seconds["generate"] = 0.0
    assert timer.seconds["generate"] >= 0.03  # a copy
    timer.reset()
    assert timer.seconds == {}


def test_phase_timer_counts_a_failing_phase():
    timer = PhaseTimer()
    try:
        with timer.phase("score"):
            raise RuntimeError
    except RuntimeError:
        pass
    assert "score" in timer.seconds


def test_phase_timer_counts_the_cpu_seconds_of_this_process_and_of_the_machine():
    machine = iter([100.0, 103.5, 110.0, 111.0])
    timer = PhaseTimer(machine_cpu=lambda: next(machine))
    with timer.phase("generate"):
        end = time.process_time() + 0.05
        while time.process_time() < end:  # this process busy on the CPU
            pass
    with timer.phase("generate"):
        pass
    cpu = timer.cpu_seconds
    assert cpu["generate"]["process"] >= 0.05
    assert cpu["generate"]["machine"] == 4.5  # 3.5 + 1.0: both entries add up
    cpu["generate"]["machine"] = 0.0
    assert timer.cpu_seconds["generate"]["machine"] == 4.5  # a copy
    timer.reset()
    assert timer.cpu_seconds == {}


def test_without_the_machines_counters_a_phase_counts_this_process_only():
    timer = PhaseTimer(machine_cpu=lambda: None)
    with timer.phase("update"):
        pass
    assert set(timer.cpu_seconds["update"]) == {"process"}


def test_the_machines_busy_seconds_come_from_proc_stat(tmp_path):
    import os

    from megatron_jetrl.runtime.timing import machine_cpu_seconds

    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  100 20 30 5000 70 4 6 10 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n")
    assert machine_cpu_seconds(stat) == (100 + 20 + 30 + 4 + 6 + 10) / os.sysconf("SC_CLK_TCK")
    stat.write_text("intr 1 2 3\n")
    assert machine_cpu_seconds(stat) is None
    assert machine_cpu_seconds(tmp_path / "absent") is None
