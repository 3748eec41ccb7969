"""vacancyd.k8s.publisher against the in-memory fake API (write rules and backoff).

The same behaviour against a real kube-apiserver is in test_kube_e2e.py (marker ``kube``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest

from tests.support.fake_kube import FakeKube
from vacancyd.core import conditions as c
from vacancyd.core.conditions import LenderState, Phase, UpstreamState
from vacancyd.k8s.api import K8sApiError
from vacancyd.k8s.publisher import Publisher, PublishTarget, services_for

NS = "vacancy"


def alive(lendable: bool = True, *, port: int = 11435, reason: str = "owner_active") -> LenderState:
    return LenderState(
        Phase.ALIVE,
        lending_enabled=True,
        owner_present=not lendable,
        gpu_pressure=False,
        upstreams={
            "ollama": UpstreamState(
                "ollama",
                lendable=lendable,
                bound=True,
                port=port,
                reason=None if lendable else reason,
                detail="" if lendable else "the owner is here",
            )
        },
    )


def make(
    kube: FakeKube,
    *,
    address: str | None = "192.0.2.10",
    node: str | None = "pc",
    heartbeat_s: float = 60.0,
    resync_s: float = 60.0,
    request_timeout_s: float = 1.0,
    wall: Callable[[], float] | None = None,
) -> Publisher:
    return Publisher(
        connect=kube.connect,
        target=PublishTarget(
            lender="pc",
            namespace=NS,
            node=node,
            address=address,
            services=services_for(lambda u: f"vacancyd-{u}", direct=True),
        ),
        heartbeat_s=heartbeat_s,
        resync_s=resync_s,
        request_timeout_s=request_timeout_s,
        backoff_max_s=0.2,
        backoff_initial_s=0.05,
        **({"wall": wall} if wall else {}),  # type: ignore[arg-type]
    )


@asynccontextmanager
async def running(pub: Publisher) -> AsyncIterator[Publisher]:
    task = asyncio.get_running_loop().create_task(pub.run())
    try:
        yield pub
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():  # noqa: ASYNC110 - polls state another task changes
            await asyncio.sleep(0.01)


def lendable_status(kube: FakeKube) -> str:
    return str(kube.conditions("pc").get(c.LENDABLE, {}).get("status"))


async def test_starts_unknown_then_follows_updates_without_touching_kubelet() -> None:
    kube = FakeKube()
    kube.add_node("pc")
    async with running(make(kube)) as pub:
        await until(lambda: c.LENDABLE in kube.conditions("pc"))
        conds = kube.conditions("pc")
        assert {conds[t]["status"] for t in c.CONDITION_TYPES} == {"Unknown"}
        assert conds["Ready"]["reason"] == "KubeletReady"
        # no upstream known yet: no EndpointSlice yet
        assert kube.slices == {}

        pub.update(alive(True))
        await until(lambda: lendable_status(kube) == "True")
        gated = kube.slice(NS, "vacancyd-ollama-pc-ollama")
        direct = kube.slice(NS, "vacancyd-ollama-direct-pc-ollama")
        assert gated["endpoints"][0]["conditions"]["ready"] is True
        assert gated["endpoints"][0]["nodeName"] == "pc"  # the lender's own Node
        assert direct["endpoints"][0]["conditions"]["ready"] is True

        pub.update(alive(False))
        await until(lambda: lendable_status(kube) == "False")
        assert kube.conditions("pc")[c.LENDABLE]["reason"] == "OwnerActive"
        assert kube.conditions("pc")["Ready"]["status"] == "True"
        await until(
            lambda: (
                kube.slice(NS, "vacancyd-ollama-pc-ollama")["endpoints"][0]["conditions"]["ready"]
                is False
            )
        )
        assert kube.slice(NS, "vacancyd-ollama-direct-pc-ollama")["endpoints"][0]["conditions"][
            "ready"
        ]


async def test_heartbeat_refreshes_heartbeat_time_but_not_transition_time() -> None:
    kube = FakeKube()
    kube.add_node("pc")
    clock = [1_764_400_000.0]
    async with running(make(kube, heartbeat_s=0.1, wall=lambda: clock[0])) as pub:
        pub.update(alive(True))
        await until(lambda: lendable_status(kube) == "True")
        first = dict(kube.conditions("pc")[c.LENDABLE])
        clock[0] += 30
        patches = len(kube.patches)
        await until(lambda: len(kube.patches) > patches + 1)
        now = kube.conditions("pc")[c.LENDABLE]
        assert now["lastTransitionTime"] == first["lastTransitionTime"]
        assert now["lastHeartbeatTime"] == c.rfc3339(clock[0])


async def test_clean_shutdown_publishes_not_lendable_and_not_ready() -> None:
    kube = FakeKube()
    kube.add_node("pc")
    pub = make(kube)
    async with running(pub):
        pub.update(alive(True))
        await until(lambda: lendable_status(kube) == "True")
    await pub.shutdown("test stops")
    conds = kube.conditions("pc")
    assert conds[c.LENDABLE]["status"] == "False"
    assert conds[c.LENDABLE]["reason"] == "Stopped"
    for name in ("vacancyd-ollama-pc-ollama", "vacancyd-ollama-direct-pc-ollama"):
        assert kube.slice(NS, name)["endpoints"][0]["conditions"] == {
            "ready": False,
            "serving": False,
            "terminating": False,
        }
    assert kube.closed == 1


@pytest.mark.parametrize(
    ("status", "needle"),
    [
        (403, "nodes/status"),
        (409, "conflicting write"),
        (None, "unreachable or slow"),
        (500, "retrying"),
    ],
)
async def test_api_errors_are_logged_once_and_retried_until_they_clear(
    status: int | None, needle: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "vacancyd")
    kube = FakeKube()
    kube.add_node("pc")
    kube.fail["patch_node_status"] = K8sApiError("patch node pc status", status, "boom")
    async with running(make(kube)) as pub:
        pub.update(alive(True))
        await until(lambda: kube.calls.count("patch_node_status") >= 3)
        assert not pub.healthy
        # EndpointSlices do not wait for the Node: they are written regardless
        assert kube.slice(NS, "vacancyd-ollama-pc-ollama")
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len([r for r in warnings if "boom" in r.getMessage()]) == 1
        assert needle in warnings[0].getMessage()
        del kube.fail["patch_node_status"]
        await until(lambda: c.LENDABLE in kube.conditions("pc"))
        await until(lambda: pub.healthy)
    assert "written again" in caplog.text


async def test_missing_node_is_reported_and_retried(caplog: pytest.LogCaptureFixture) -> None:
    kube = FakeKube()
    async with running(make(kube)) as pub:
        pub.update(alive(True))
        await until(lambda: kube.calls.count("get_node_conditions") >= 2)
        assert "not found" in caplog.text and "Node name" in caplog.text
        assert kube.slice(NS, "vacancyd-ollama-pc-ollama")  # slices unaffected
        kube.add_node("pc")
        await until(lambda: c.LENDABLE in kube.conditions("pc"))
        assert lendable_status(kube) == "True"
        assert pub.healthy


async def test_rejected_address_is_logged_with_a_hint(caplog: pytest.LogCaptureFixture) -> None:
    kube = FakeKube()
    kube.add_node("pc")
    async with running(make(kube, address="127.0.0.1")) as pub:
        pub.update(alive(True))
        await until(lambda: kube.calls.count("apply_endpoint_slice") >= 4)
        assert kube.slices == {}
        assert "loopback" in caplog.text and "set the lender's address" in caplog.text
        # Node conditions are still published
        assert lendable_status(kube) == "True"


async def test_slow_api_times_out_and_never_blocks_update() -> None:
    kube = FakeKube()
    kube.add_node("pc")
    kube.delay_s = 30.0
    pub = make(kube, request_timeout_s=0.1)
    async with running(pub):
        loop = asyncio.get_running_loop()
        started = loop.time()
        for _ in range(1000):
            pub.update(alive(True))
            pub.update(alive(False))
        assert loop.time() - started < 0.5
        await until(lambda: "no answer within" in "".join(pub.last_errors.values()))
        kube.delay_s = 0
        await until(lambda: c.LENDABLE in kube.conditions("pc"))
        await until(lambda: lendable_status(kube) == "False")


async def test_resync_repairs_outside_edits_and_removes_stale_slices() -> None:
    kube = FakeKube()
    kube.add_node("pc")
    async with running(make(kube, resync_s=0.1)) as pub:
        pub.update(alive(False))
        name = "vacancyd-ollama-pc-ollama"
        await until(lambda: (NS, name) in kube.slices)
        kube.slices[(NS, name)]["endpoints"][0]["conditions"]["ready"] = True  # outside edit
        await until(lambda: kube.slice(NS, name)["endpoints"][0]["conditions"]["ready"] is False)

        # the lender's listener moves: same names, new port
        pub.update(alive(False, port=20000))
        await until(lambda: kube.slice(NS, name)["ports"][0]["port"] == 20000)
        # the upstream disappears from the lender: its slices are deleted
        pub.update(LenderState(Phase.ALIVE, upstreams={}))
        await until(lambda: kube.slices == {})


async def test_connect_failure_is_retried() -> None:
    kube = FakeKube()
    kube.add_node("pc")
    kube.fail["connect"] = K8sApiError("load credentials", None, "no kubeconfig")
    async with running(make(kube)) as pub:
        await until(lambda: kube.calls.count("connect") >= 2)
        assert "no kubeconfig" in "".join(pub.last_errors.values())
        del kube.fail["connect"]
        await until(lambda: c.LENDABLE in kube.conditions("pc"))
