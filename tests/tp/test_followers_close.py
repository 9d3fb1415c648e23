"""How rank 0 closes its followers: stopped between steps, its groups shut down; killed (an engine that failed to
start, or was never closed), its groups aborted, so that nothing of theirs waits for the killed ranks at exit."""

from __future__ import annotations

import subprocess

from batchgen.tp.ranks import Followers


class FakeProcess:
    pid = 4242

    def __init__(self) -> None:
        self.killed = False

    def poll(self) -> int | None:
        return -9 if self.killed else None

    def wait(self, timeout: float | None = None) -> int:
        if not self.killed:
            raise subprocess.TimeoutExpired("follower", timeout)
        return -9

    def kill(self) -> None:
        self.killed = True


class RecordingGroup:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def abort(self) -> None:
        self.calls.append("abort")

    def shutdown(self) -> None:
        self.calls.append("shutdown")


def followers_of(process: FakeProcess, group: RecordingGroup) -> Followers:
    followers = Followers.__new__(Followers)  # without starting processes
    followers.size, followers.processes, followers.group = 2, [process], group
    followers.failure, followers._closing = None, False
    return followers


def test_followers_killed_at_close_have_their_groups_aborted():
    process, group = FakeProcess(), RecordingGroup()
    followers_of(process, group).close(graceful=False)
    assert process.killed and group.calls == ["abort"]


def test_a_second_close_does_nothing():
    process, group = FakeProcess(), RecordingGroup()
    followers = followers_of(process, group)
    followers.close(graceful=False)
    followers.close(graceful=False)
    assert group.calls == ["abort"]
