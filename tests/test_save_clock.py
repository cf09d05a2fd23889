"""When a checkpoint is due by time (ddppipe.training.loop.save_clock), on a clock the test
moves."""

from ddppipe.training.loop.save_clock import SaveClock


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_due_once_the_minutes_passed_since_the_last_checkpoint() -> None:
    clock = FakeClock()
    saves = SaveClock(0.5, now=clock)  # 30 s
    clock.now += 29.9
    assert not saves.due()
    clock.now += 0.1
    assert saves.due()
    saves.restart()  # a checkpoint (by time or at an epoch's end) taken now
    clock.now += 29.0
    assert not saves.due()
    clock.now += 1.0
    assert saves.due()


def test_never_due_without_an_interval() -> None:
    clock = FakeClock()
    saves = SaveClock(None, now=clock)
    clock.now += 1e9
    assert not saves.due()
