"""The publisher's write rules that routing depends on, against the in-memory API fake:
no update lost to a write in flight, discovery/v1 endpoint conditions, terminating first,
a damped return to lendable, writes compared with what the server holds, retired Node
conditions removed, headroom annotations, and convergence after a storm of API failures.

The same rules against a real kube-apiserver: tests/integration/test_kube_routing.py.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import pytest

from tests.support.fake_kube import FakeKube
from vacancyd.core import conditions as c
from vacancyd.core.conditions import LenderState, Phase, UpstreamState
from vacancyd.k8s.api import K8sApiError
from vacancyd.k8s.publisher import Publisher, PublishTarget, services_for

NS = "vacancy"
GATED = "vacancyd-chat-pc-chat"
DIRECT = "vacancyd-chat-direct-pc-chat"


class RecordingKube(FakeKube):
    """The fake, also keeping every applied EndpointSlice body in order."""

    def __init__(self) -> None:
        super().__init__()
        self.applied: list[dict[str, Any]] = []

    async def apply_endpoint_slice(self, body: Mapping[str, Any], field_manager: str) -> None:
        await super().apply_endpoint_slice(body, field_manager)
        self.applied.append(copy.deepcopy(dict(body)))


def alive(lendable: bool = True, **up: Any) -> LenderState:
    return LenderState(
        Phase.ALIVE,
        lending_enabled=True,
        owner_present=not lendable,
        gpu_pressure=False,
        upstreams={
            "chat": UpstreamState(
                "chat",
                lendable=lendable,
                bound=True,
                port=11435,
                reason=None if lendable else "owner_active",
                detail="" if lendable else "the owner is here",
                **up,
            )
        },
    )


def make(kube: FakeKube, **kw: Any) -> Publisher:
    defaults: dict[str, Any] = {
        "heartbeat_s": 60.0,
        "resync_s": 60.0,
        "request_timeout_s": 2.0,
        "backoff_max_s": 0.4,
        "backoff_initial_s": 0.05,
    }
    return Publisher(
        connect=kube.connect,
        target=PublishTarget(
            lender="pc",
            namespace=NS,
            node="pc",
            address="192.0.2.10",
            services=services_for(lambda u: f"vacancyd-{u}", direct=True),
        ),
        **{**defaults, **kw},
    )


@asynccontextmanager
async def running(pub: Publisher) -> AsyncIterator[Publisher]:
    task = asyncio.get_running_loop().create_task(pub.run())
    try:
        yield pub
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> float:
    """Wait for ``predicate``; returns the seconds it took."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    async with asyncio.timeout(timeout_s):
        while not predicate():  # noqa: ASYNC110 - polls state another task changes
            await asyncio.sleep(0.005)
    return loop.time() - start


def conds(kube: FakeKube, name: str = GATED) -> dict[str, bool] | None:
    body = kube.slices.get((NS, name))
    return None if body is None else dict(body["endpoints"][0]["conditions"])


def lendable_status(kube: FakeKube) -> str | None:
    return kube.conditions("pc").get(c.LENDABLE, {}).get("status")


async def test_an_update_during_a_slow_write_is_published_within_a_second() -> None:
    """The lost wake-up: a change that arrives while a pass waits on a slow API server is
    written right after that pass, not at the next resync (60 s here)."""
    kube = RecordingKube()
    kube.add_node("pc")
    kube.delay_s = 0.15  # every API call takes 150 ms
    async with running(make(kube)) as pub:
        await until(lambda: lendable_status(kube) == "Unknown")
        pub.update(alive(False))
        await until(lambda: kube.calls.count("get_node_conditions") >= 2)  # a pass is in flight
        pub.update(alive(True))
        took = await until(lambda: (conds(kube) or {}).get("ready") is True, 3.0)
        assert took < 1.0
        await until(lambda: lendable_status(kube) == "True", 1.0)
        # and a re-read of an unchanged state wakes nothing new
        calls = len(kube.calls)
        pub.update(alive(True))
        await asyncio.sleep(0.3)
        assert len(kube.calls) == calls


async def test_endpoint_conditions_follow_discovery_v1() -> None:
    kube = RecordingKube()
    kube.add_node("pc")
    async with running(make(kube)) as pub:
        pub.update(alive(True))
        await until(lambda: conds(kube) is not None)
        assert conds(kube) == {"ready": True, "serving": True, "terminating": False}
        pub.update(alive(False))
        await until(lambda: (conds(kube) or {}).get("ready") is False)
        # serving equals ready while not terminating
        assert conds(kube) == {"ready": False, "serving": False, "terminating": False}
        assert conds(kube, DIRECT) == {"ready": True, "serving": True, "terminating": False}
        pub.update(LenderState.unreachable("gone", alive(True)))
        await until(lambda: (conds(kube, DIRECT) or {}).get("ready") is False)
        assert conds(kube, DIRECT) == {"ready": False, "serving": False, "terminating": False}


async def test_a_stopping_lender_is_published_terminating_first_then_stopped() -> None:
    kube = RecordingKube()
    kube.add_node("pc")
    pub = make(kube)
    async with running(pub):
        pub.update(alive(True))
        await until(lambda: (conds(kube) or {}).get("ready") is True)
    kube.applied.clear()
    await pub.shutdown("the companion is stopping")
    gated = [b for b in kube.applied if b["metadata"]["name"] == GATED]
    assert [b["endpoints"][0]["conditions"] for b in gated] == [
        # first: terminating, not ready, still serving (kube-proxy may fall back to it)
        {"ready": False, "serving": True, "terminating": True},
        # then: stopped
        {"ready": False, "serving": False, "terminating": False},
    ]
    assert kube.conditions("pc")[c.LENDABLE]["reason"] == "Stopped"


async def test_a_daemon_that_says_it_is_stopping_is_published_terminating() -> None:
    kube = RecordingKube()
    kube.add_node("pc")
    async with running(make(kube)) as pub:
        pub.update(alive(True))
        await until(lambda: (conds(kube) or {}).get("ready") is True)
        # what /status says while the daemon shuts down: stopping, every upstream refusing
        stopping = replace(alive(False), terminating=True)
        pub.update(stopping)
        took = await until(lambda: (conds(kube) or {}).get("terminating") is True, 1.0)
        assert took < 1.0
        assert conds(kube) == {"ready": False, "serving": False, "terminating": True}
        assert conds(kube, DIRECT) == {"ready": False, "serving": True, "terminating": True}
        assert kube.conditions("pc")[c.LENDABLE]["reason"] == "Terminating"


async def test_a_publisher_that_observed_nothing_writes_no_endpoints_on_stop() -> None:
    """A restarted companion publishes nothing it has not observed: the slices the previous
    one left stay as they are until the first observation (then they are corrected)."""
    kube = RecordingKube()
    kube.add_node("pc")
    first = make(kube)
    async with running(first):
        first.update(alive(True))
        await until(lambda: (conds(kube) or {}).get("ready") is True)
    second = make(kube)
    async with running(second):
        await until(lambda: lendable_status(kube) == "Unknown")
        await asyncio.sleep(0.1)
        assert conds(kube) == {"ready": True, "serving": True, "terminating": False}
        assert kube.applied[-1]["endpoints"][0]["conditions"]["ready"] is True
        second.update(alive(False))
        await until(lambda: (conds(kube) or {}).get("ready") is False)


async def test_return_to_lendable_is_damped_but_refusal_is_immediate() -> None:
    kube = RecordingKube()
    kube.add_node("pc")
    async with running(make(kube, lendable_stable_s=0.6)) as pub:
        pub.update(alive(True))
        # the first lendable observation is not a return: published at once
        assert await until(lambda: (conds(kube) or {}).get("ready") is True, 1.0) < 0.3
        pub.update(alive(False))
        assert await until(lambda: (conds(kube) or {}).get("ready") is False, 1.0) < 0.3
        pub.update(alive(True))
        took = await until(lambda: (conds(kube) or {}).get("ready") is True, 3.0)
        assert 0.55 <= took < 1.2
        # a flap inside the stable period restarts it and costs no ready write
        pub.update(alive(False))
        await until(lambda: (conds(kube) or {}).get("ready") is False, 1.0)
        applied = len(kube.applied)
        for _ in range(4):
            pub.update(alive(True))
            await asyncio.sleep(0.1)
            pub.update(alive(False))
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.1)
        assert all(
            b["endpoints"][0]["conditions"]["ready"] is False
            for b in kube.applied[applied:]
            if b["metadata"]["name"] == GATED
        )
        assert kube.conditions("pc")[c.LENDABLE]["status"] == "False"
    settling = c.LendableDamper(5.0)
    settling.observe(alive(False), 0.0)
    settling.observe(alive(True), 1.0)
    shown, next_at = settling.apply(alive(True), 2.0)
    assert shown.upstreams["chat"].reason == "settling" and next_at == 6.0
    assert c.node_conditions(shown)[0].reason == "Settling"


async def test_writes_are_compared_with_the_server_not_a_cache() -> None:
    kube = RecordingKube()
    kube.add_node("pc")
    async with running(make(kube, resync_s=0.3)) as pub:
        pub.update(alive(True))
        await until(lambda: conds(kube) == {"ready": True, "serving": True, "terminating": False})
        # a flip writes only the slice that changed (the -direct one stays ready)
        kube.applied.clear()
        pub.update(alive(False))
        await until(lambda: (conds(kube) or {}).get("ready") is False)
        await asyncio.sleep(0.05)
        assert [b["metadata"]["name"] for b in kube.applied] == [GATED]
        # a resync with nothing changed reads but writes nothing
        kube.applied.clear()
        reads = kube.calls.count("get_endpoint_slices")
        await until(lambda: kube.calls.count("get_endpoint_slices") >= reads + 2, 3.0)
        assert kube.applied == []
        # an outside edit: the server now differs from what was written; repaired
        kube.slices[(NS, GATED)]["endpoints"][0]["conditions"]["ready"] = True
        await until(lambda: (conds(kube) or {}).get("ready") is False, 2.0)
        # a deleted slice is recreated
        del kube.slices[(NS, DIRECT)]
        await until(lambda: conds(kube, DIRECT) is not None, 2.0)


async def test_retired_vacancyd_conditions_are_removed_and_others_kept() -> None:
    kube = RecordingKube()
    kube.add_node("pc")
    node = kube.nodes["pc"]["status"]["conditions"]
    node.append({"type": "VacancyOldName", "status": "True", "reason": "X", "message": ""})
    node.append({"type": "KernelDeadlock", "status": "False", "reason": "KernelHasNoDeadlock"})
    async with running(make(kube)) as pub:
        pub.update(alive(True))
        await until(lambda: lendable_status(kube) == "True")
    types = set(kube.conditions("pc"))
    assert "VacancyOldName" not in types
    assert {"Ready", "KernelDeadlock", *c.CONDITION_TYPES} <= types
    assert c.retired_conditions(list(kube.conditions("pc").values())) == []


async def test_headroom_is_annotated_on_the_gated_slice_and_in_the_condition() -> None:
    kube = RecordingKube()
    kube.add_node("pc")
    room = {"largest_model": "llama3:70b", "largest_model_mib": 40960, "headroom_mib": 41216}
    async with running(make(kube)) as pub:
        pub.update(alive(True, **room))
        await until(lambda: conds(kube) is not None and lendable_status(kube) == "True")
        meta = kube.slice(NS, GATED)["metadata"]
        assert meta["annotations"] == {
            c.LARGEST_MODEL_ANNOTATION: "llama3:70b",
            c.LARGEST_MODEL_MIB_ANNOTATION: "40960",
            c.HEADROOM_ANNOTATION: "41216",
        }
        assert "annotations" not in kube.slice(NS, DIRECT)["metadata"]
        message = kube.conditions("pc")[c.LENDABLE]["message"]
        assert "largest model llama3:70b, 40960 MiB" in message
        assert "41216 MiB to lend" in message
        # nothing fits any more: the annotations go (server-side apply drops them)
        pub.update(alive(True, headroom_mib=0))
        await until(
            lambda: (
                c.LARGEST_MODEL_ANNOTATION
                not in kube.slice(NS, GATED)["metadata"].get("annotations", {})
            )
        )
    assert c.quantize_mib(41300.7) == 41216 and c.quantize_mib(-3) == 0


@pytest.mark.parametrize("status", [409, 500, None])
async def test_a_flip_storm_during_api_failures_converges_without_a_tight_loop(
    status: int | None,
) -> None:
    kube = RecordingKube()
    kube.add_node("pc")
    async with running(make(kube, request_timeout_s=0.1)) as pub:
        pub.update(alive(True))
        await until(lambda: (conds(kube) or {}).get("ready") is True)
        error = K8sApiError("apply", status, "injected")
        if status is None:
            kube.delay_s = 0.5  # every call times out (request_timeout_s is 0.1 s)
        else:
            kube.fail["apply_endpoint_slice"] = error
            kube.fail["patch_node_status"] = error
        before = len(kube.calls)
        for i in range(40):  # 40 flips in 2 s
            pub.update(alive(i % 2 == 0))
            await asyncio.sleep(0.05)
        tried = kube.calls[before:]
        attempts = tried.count("get_endpoint_slices") + tried.count("get_node_conditions")
        # backoff (0.05 s doubling, capped at 0.4 s, jittered) bounds the attempts to about
        # ten per kind of write in 2 s, however many flips arrive: no tight retry loop
        assert attempts <= 2 * 14, tried
        pub.update(alive(False))
        kube.fail.clear()
        kube.delay_s = 0.0
        await until(lambda: (conds(kube) or {}).get("ready") is False, 3.0)
        await until(lambda: lendable_status(kube) == "False", 3.0)
        assert pub.healthy or await until(lambda: pub.healthy, 2.0) >= 0
