"""Preemption signals: the handler only records, handlers are restored, a second SIGTERM kills."""

import os
import signal
import subprocess
import sys
import textwrap

import torch.distributed as dist

from megatron_jetrl.runtime import PreemptionSignal, any_rank


def test_sigusr1_sets_the_flag_and_handlers_are_restored():
    def previous(signum, frame):
        raise AssertionError("the preemption handler should be installed")

    old_usr1 = signal.signal(signal.SIGUSR1, previous)
    old_term = signal.getsignal(signal.SIGTERM)
    try:
        with PreemptionSignal() as pre:
            assert not pre.requested and pre.signal_name is None
            assert not pre.agreed(lambda flag: flag)
            os.kill(os.getpid(), signal.SIGUSR1)
            assert pre.requested and pre.signal_name == "SIGUSR1"
            assert pre.agreed(lambda flag: flag)
            os.kill(os.getpid(), signal.SIGUSR1)  # repeats are harmless
            assert pre.signal_name == "SIGUSR1"
        assert signal.getsignal(signal.SIGUSR1) is previous
        assert signal.getsignal(signal.SIGTERM) is old_term
    finally:
        signal.signal(signal.SIGUSR1, old_usr1)


def test_agreed_uses_the_reduction():
    with PreemptionSignal(signals=(signal.SIGUSR2,)) as pre:
        assert pre.agreed(lambda flag: True)  # another rank was signalled
        assert not pre.requested


def test_any_rank_without_a_process_group_returns_the_flag():
    assert not dist.is_initialized()
    assert any_rank(True) is True
    assert any_rank(False) is False


_CHILD = textwrap.dedent("""
    import os, signal, sys
    from megatron_jetrl.runtime import PreemptionSignal
    with PreemptionSignal() as pre:
        os.kill(os.getpid(), signal.SIGTERM)
        print("first", pre.requested, pre.signal_name, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        print("survived", flush=True)
""")


def test_second_sigterm_is_a_hard_stop():
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120)
    assert out.stdout.splitlines() == ["first True SIGTERM"], out.stderr
    assert out.returncode == -signal.SIGTERM
