"""Hypothesis strategies for typed status documents (vacancyd.core.status).

Every float is already on the grid ``/status`` rounds it to (0.1, or 0.001 for ratios), and
what the JSON leaves out is at its default (the metrics-only ``has_bytes`` and
``owner_signal``; a server's ``version`` without ``models``, its ``devices`` without
``allocator_mib``), so a document read back from its JSON can equal the original.
"""

from __future__ import annotations

from hypothesis import strategies as st

from vacancyd.core.observations import Quality
from vacancyd.core.reasons import Reason
from vacancyd.core.status import (
    CreditStatus,
    DurableStateStatus,
    HeadroomStatus,
    HolderStatus,
    HoldStatus,
    JobStatus,
    LearnedContextStatus,
    LearnedStatus,
    ListenerStatus,
    OwnerControlsStatus,
    OwnerHoldStatus,
    PoolStatus,
    PowerLimitStatus,
    PresenceStatus,
    PressureEdgeStatus,
    PressureStatus,
    PublisherStatus,
    ReachStatus,
    ReclaimStatus,
    RefusalStatus,
    ResidentModelStatus,
    ResourceStatus,
    ServerStatus,
    SharingStatus,
    StatusDocument,
    ThermalStatus,
    UpstreamStatus,
    VetoStatus,
)

names = st.sampled_from(["a", "b", "gpu0", "ram", "chat"])
text = st.text(st.characters(codec="utf-8"), max_size=12)
tenths = st.integers(0, 10**7).map(lambda i: i / 10)
thousandths = st.integers(0, 1000).map(lambda i: i / 1000)
opt = st.none().__or__
#: Ready half the time, so the rules that only look further for a ready reading are reached.
quality = st.one_of(st.just(Quality.READY), st.sampled_from(list(Quality)))
small = st.integers(0, 1000)
json_scalar = st.one_of(st.none(), st.booleans(), small, text)
json_object = st.dictionaries(names, json_scalar, max_size=3)

listeners = st.builds(
    ListenerStatus,
    address=st.sampled_from(["127.0.0.1:8001", "[::1]:9000", "nowhere", "10.0.0.2:0"]),
    bound=st.booleans(),
    error=opt(text),
    state=st.sampled_from(["unknown", "loopback_only", "listens_on_network"]),
    state_detail=text,
)
pool_listeners = st.builds(ListenerStatus, address=text, bound=st.booleans(), error=opt(text))

pressures = st.builds(
    PressureStatus,
    quality=quality,
    calibrated=st.booleans(),
    engaged=st.booleans(),
    threshold_ratio=opt(thousandths),
    owner_load_ratio=opt(thousandths),
    borrower_load_ratio=opt(thousandths),
    calibration_observed_s=tenths,
    calibration_needed_s=opt(tenths),
    release_in_s=opt(tenths),
    gpu=opt(text),
    detail=text,
    last_edge=opt(st.builds(PressureEdgeStatus, cause=text, age_s=tenths, unknown_for_s=tenths)),
)

resources = st.builds(
    ResourceStatus,
    kind=st.sampled_from(["gpu", "gpu", "ram", "cpu"]),
    enabled=st.booleans(),
    quality=quality,
    age_s=opt(tenths),
    free_mib=opt(tenths),
    total_mib=opt(tenths),
    utilization_ratio=opt(thousandths),
    used_mib=opt(tenths),
    why_not=opt(text),
    error=opt(text),
    held_by=opt(st.builds(HolderStatus, job=small, upstream=names, phase=text)),
    pressure=opt(pressures),
    lendable_mib=opt(tenths),
    state_error=opt(text),
    hold_write_error=opt(text),
    jobs=small,
    card=opt(st.sampled_from(["idle", "shared", "exclusive"])),
    temperature_c=opt(st.integers(0, 1200).map(lambda i: i / 10)),
    energy_j=opt(tenths),
    thermal=opt(
        st.builds(
            ThermalStatus,
            max_c=st.integers(50, 100).map(float),
            resume_c=st.integers(10, 49).map(float),
            hot_yield_after_s=opt(tenths),
            hot=st.booleans(),
            hot_for_s=opt(tenths),
            above_for_s=opt(tenths),
        )
    ),
    power_limit=opt(
        st.builds(
            PowerLimitStatus,
            lend_w=opt(tenths),
            original_w=opt(tenths),
            applied=st.booleans(),
            problem=opt(st.sampled_from(["no_permission", "not_supported", "out_of_range"])),
            error=opt(text),
        )
    ),
)

servers = st.builds(
    lambda **kw: ServerStatus(
        **{
            **kw,
            "version": kw["version"] if kw["models"] is not None else None,
            "devices": kw["devices"] if kw["allocator_mib"] is not None else None,
        }
    ),
    quality=quality,
    age_s=opt(tenths),
    idle=opt(st.booleans()),
    error=opt(text),
    version=opt(text),
    models=opt(
        st.lists(
            st.builds(
                ResidentModelStatus,
                name=text,
                digest=opt(text),
                context_length=opt(small),
                size_mib=opt(tenths),
                size_vram_mib=opt(tenths),
                expires_in_s=opt(tenths),
                expires_error=opt(text),
            ),
            max_size=2,
        ).map(tuple)
    ),
    allocator_mib=opt(tenths),
    devices=opt(small),
)

jobs = st.builds(
    JobStatus,
    job=small,
    phase=text,
    model=opt(text),
    age_s=tenths,
    charged_mib=opt(small),
    residency=opt(
        st.builds(CreditStatus, applied=st.booleans(), why=text, code=text, added_mib=opt(tenths))
    ),
    hold=opt(st.builds(HoldStatus, reason=text, release_by=text, for_s=tenths, detail=text)),
    borrower=text,
)

reclaims = st.builds(
    ReclaimStatus,
    phase=text,
    policy=text,
    trigger=text,
    resource=opt(text),
    edges_age_s=st.lists(tenths, max_size=3).map(tuple),
    edge_triggers=st.lists(text, max_size=3).map(tuple),
    deadline_in_s=opt(tenths),
    outcome=opt(text),
)

upstreams = st.builds(
    UpstreamStatus,
    adapter=text,
    resource=names,
    also_requires=st.lists(names, max_size=2).map(tuple),
    owner_scope=st.sampled_from(["host", "resource"]),
    listener=opt(listeners),
    refusal=opt(
        st.builds(
            RefusalStatus,
            reason=st.sampled_from([r.value for r in Reason]),
            retry_after_s=tenths,
            detail=text,
        )
    ),
    busy=st.booleans(),
    server=opt(servers),
    unseen_gpu_work=opt(text),
    active_work=st.lists(jobs, max_size=2).map(tuple),
    reclaim=opt(reclaims),
    sharing=opt(
        st.builds(
            SharingStatus,
            max_concurrent=small,
            jobs=small,
            waiting=small,
            exclusive_of=st.lists(names, max_size=2).map(tuple),
            excluded_by=st.lists(names, max_size=2).map(tuple),
            card=text,
        )
    ),
    headroom=opt(
        st.builds(
            HeadroomStatus,
            lendable_mib=opt(tenths),
            largest_model=opt(text),
            largest_model_mib=opt(small),
        )
    ),
    footprint_priors_mib=st.dictionaries(text, small, max_size=2),
    learned_contexts=opt(
        st.builds(
            LearnedStatus,
            contexts=st.lists(
                st.builds(
                    LearnedContextStatus,
                    digest=text,
                    num_ctx=opt(small),
                    dialect=text,
                    loads=small,
                ),
                max_size=2,
            ).map(tuple),
            modelfile_num_ctx=st.dictionaries(text, opt(small), max_size=2),
        )
    ),
    sleep=opt(json_object),
    reachable=opt(st.builds(ReachStatus, ok=st.booleans(), age_s=tenths, error=opt(text))),
)

presences = st.builds(
    PresenceStatus,
    source=text,
    sampled=st.booleans(),
    age_s=opt(tenths),
    evidence_complete=st.booleans(),
    refuses=st.booleans(),
    veto=st.builds(VetoStatus, active=st.booleans(), release_in_s=opt(tenths)),
    detail=text,
    sessions=st.lists(json_object, max_size=2).map(tuple),
    session_counts=st.dictionaries(text, small, max_size=2),
    exempt_upstreams=st.lists(names, max_size=2).map(tuple),
)

documents = st.builds(
    StatusDocument,
    version=text,
    uptime_s=opt(tenths),
    ready=st.booleans(),
    not_ready=st.lists(text, max_size=2).map(tuple),
    lending_enabled=st.booleans(),
    presence=presences,
    resources=st.dictionaries(names, resources, max_size=3),
    upstreams=st.dictionaries(names, upstreams, max_size=3),
    pools=st.dictionaries(
        names,
        st.builds(
            PoolStatus,
            members=st.lists(names, max_size=3).map(tuple),
            listener=opt(pool_listeners),
            lendable=st.booleans(),
        ),
        max_size=2,
    ),
    stopping=st.booleans(),
    durable_state=st.builds(
        DurableStateStatus,
        write_errors=st.dictionaries(text, text, max_size=2),
        usage_ledger_error=opt(text),
    ),
    owner_controls=opt(
        st.builds(
            OwnerControlsStatus,
            controls=json_object.filter(lambda d: "holds" not in d),
            holds=st.lists(
                st.builds(
                    OwnerHoldStatus,
                    kind=text,
                    detail=text,
                    resources=opt(st.lists(names, max_size=2).map(tuple)),
                    until=opt(tenths),
                    ends_in_s=opt(tenths),
                ),
                max_size=2,
            ).map(tuple),
        )
    ),
    kubernetes=opt(
        st.builds(
            PublisherStatus,
            lender=text,
            namespace=text,
            node=opt(text),
            address=opt(text),
            writes_ok=st.booleans(),
            errors=st.dictionaries(text, text, max_size=2),
        )
    ),
)
