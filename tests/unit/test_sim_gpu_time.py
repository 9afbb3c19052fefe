"""The simulated worker charges the profile's GPU time x the time scale, and nothing else (issue 44).

`bench run --time-scale 0.1` divides what the workers slept by 0.1, so every error in a sleep of the simulated worker
reads ten times larger in GPU time. The worker runs on uvloop, whose timers count whole milliseconds: a 0.13 ms KV
transfer returned at once and 0.35-0.48 ms decode steps ran back to back. These tests pin what a request is charged
by counting the sleeps the worker asks for (a recording sleep, no clock), and that a GPU sleep on uvloop is not
rounded (a lower bound on elapsed time: it can only fail by returning early, which is the defect).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import uvloop

from orchestrator.config import ModelConfig
from orchestrator.sim import gpu_sleep, kv_transfer
from orchestrator.sim.output import Vocabulary
from orchestrator.sim.profiles import PROFILES
from orchestrator.sim.scheduler import CONTEXT_ONLY, FULL, GENERATION_ONLY, Scheduler, SimRequest

PROFILE = PROFILES["llama3-8b-h100"]


def vocabulary() -> Vocabulary:
    return Vocabulary.from_model_dir(ModelConfig(dir="builtin:tiny-chat").resolved_dir(Path.cwd()))


class RecordingSleep:
    """A GPU sleep that records what it was asked for and passes no time."""

    def __init__(self) -> None:
        self.asked: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.asked.append(seconds)
        await asyncio.sleep(0)


async def run_until(scheduler: Scheduler, done: asyncio.Future) -> None:
    loop_task = asyncio.create_task(scheduler.run())
    try:
        await asyncio.wait_for(done, 5)
    finally:
        loop_task.cancel()


def test_a_prefill_is_charged_exactly_its_step_time_times_the_time_scale_and_no_other_wait():
    sleep = RecordingSleep()
    scheduler = Scheduler(PROFILE, "prefill", vocabulary(), time_scale=0.1, sleep=sleep)

    async def main() -> None:
        done = asyncio.get_running_loop().create_future()
        scheduler.submit(SimRequest(request_id="r", kind=CONTEXT_ONLY, prompt_len=530, key=1, max_tokens=64,
                                    on_context_done=lambda request, token: done.set_result(token)))
        await run_until(scheduler, done)

    asyncio.run(main())
    # one step, priced by the profile, scaled: no sleep before it, no batching window, no wait for a step boundary
    assert sleep.asked == [PROFILE.prefill_ms([530]) * 0.1 / 1000.0]


def test_a_decode_leg_sends_the_carried_first_token_at_admission_then_one_scaled_step_per_token():
    sleep = RecordingSleep()
    scheduler = Scheduler(PROFILE, "decode", vocabulary(), time_scale=0.1, sleep=sleep)
    sleeps_before_token: list[int] = []

    async def main() -> None:
        done = asyncio.get_running_loop().create_future()
        scheduler.submit(SimRequest(
            request_id="r", kind=GENERATION_ONLY, prompt_len=530, key=1, max_tokens=4, ignore_eos=True,
            first_gen_tokens=(42,), on_token=lambda request, token: sleeps_before_token.append(len(sleep.asked)),
            on_finish=lambda request, reason, match: done.set_result(reason)))
        await run_until(scheduler, done)

    asyncio.run(main())
    assert sleeps_before_token == [0, 1, 2, 3]  # the prefill's token goes out before any step
    assert sleep.asked == [PROFILE.decode_ms([530 + n]) * 0.1 / 1000.0 for n in (1, 2, 3)]


def test_a_whole_request_is_charged_its_prefill_step_then_its_decode_steps():
    sleep = RecordingSleep()
    scheduler = Scheduler(PROFILE, "aggregated", vocabulary(), time_scale=0.5, sleep=sleep)

    async def main() -> None:
        done = asyncio.get_running_loop().create_future()
        scheduler.submit(SimRequest(request_id="r", kind=FULL, prompt_len=100, key=1, max_tokens=3, ignore_eos=True,
                                    on_finish=lambda request, reason, match: done.set_result(reason)))
        await run_until(scheduler, done)

    asyncio.run(main())
    assert sleep.asked == [PROFILE.prefill_ms([100]) * 0.5 / 1000.0,
                           *(PROFILE.decode_ms([100 + n]) * 0.5 / 1000.0 for n in (1, 2))]


def test_a_kv_transfer_is_slept_as_gpu_time():
    sleep = RecordingSleep()
    released: list[int] = []

    async def main() -> int:
        store = kv_transfer.SessionStore(lambda blocks, rank, lease: released.append(blocks), timeout_s=None)
        store.hold(kv_transfer.HeldSession(session_id="s", blocks=17, tokens=530, prompt_digest="p", media_digest="m",
                                           opaque_state="o", first_gen_tokens=[7]))
        server = await asyncio.start_server(store.serve_connection, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            return await kv_transfer.pull("127.0.0.1", port, {"session_id": "s", "prompt": "p", "media": "m",
                                                              "first_gen_tokens": [7]},
                                          lambda tokens: PROFILE.kv_transfer_ms(tokens) * 0.1 / 1000.0, sleep)
        finally:
            server.close()

    assert asyncio.run(main()) == 530
    assert sleep.asked == [PROFILE.kv_transfer_ms(530) * 0.1 / 1000.0] and released == [17]


def test_a_sub_millisecond_gpu_sleep_on_uvloop_is_not_rounded_away():
    # uvloop rounds a timer to whole milliseconds: asyncio.sleep(0.0003) there returns in microseconds. A GPU sleep
    # lasts its time on average (it asks for its average lateness less, never below 0), so 40 of them take about
    # 12 ms; half of that is a bound only a rounded timer misses.
    async def main() -> tuple[float, float]:
        sleep = gpu_sleep.GpuSleep()
        first_started = time.monotonic()
        await sleep(0.0002)  # it knows no lateness yet: the first sleep is never short
        first = time.monotonic() - first_started
        started = time.monotonic()
        for _ in range(40):
            await sleep(0.0003)
        return first, time.monotonic() - started

    first, total = uvloop.run(main())
    assert first >= 0.0002
    assert total >= 0.5 * 40 * 0.0003


def test_one_timer_wakes_concurrent_sleepers_in_deadline_order_and_none_before_its_deadline():
    woke: list[tuple[str, float, float]] = []

    async def sleeper(name: str, deadline: float) -> None:
        await gpu_sleep.timer().sleep_until(deadline)
        woke.append((name, deadline, time.monotonic()))

    async def main() -> None:
        now = time.monotonic()
        cancelled = asyncio.create_task(sleeper("cancelled", now + 0.0002))
        tasks = [asyncio.create_task(sleeper(name, now + delay))
                 for name, delay in (("c", 0.0009), ("a", 0.0003), ("b", 0.0006))]
        await asyncio.sleep(0)
        cancelled.cancel()  # its entry stays in the heap and must not disturb the others
        await asyncio.gather(*tasks)

    uvloop.run(main())
    assert [name for name, _, _ in woke] == ["a", "b", "c"]
    assert all(at >= deadline for _, deadline, at in woke)
