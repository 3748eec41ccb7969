"""``vacancyd k8s mark-stale | cleanup``: upkeep of what vacancyd published to Kubernetes."""

from __future__ import annotations

import argparse
import asyncio
import json

from vacancyd.cli.common import _configure_logging, _say


def cmd_k8s(args: argparse.Namespace) -> int:
    """``vacancyd k8s mark-stale`` and ``vacancyd k8s cleanup`` (vacancyd.k8s.maintenance).

    Prints one JSON line per pass ({"action", "changed", "unchanged", "errors"}). Exit 0
    when every object was handled, 1 when some failed, 2 when no API server could be used.
    ``mark-stale --every S`` repeats the pass every S seconds until SIGTERM (exit 0).
    """
    if not _configure_logging(args):
        return 2
    return asyncio.run(_k8s(args))


async def _k8s(args: argparse.Namespace) -> int:
    import signal

    from vacancyd.k8s import maintenance
    from vacancyd.k8s.api import K8sApiError
    from vacancyd.k8s.client import KubeClient

    try:
        api = await KubeClient.connect(args.kubeconfig, args.context)
    except K8sApiError as exc:
        _say(args, "ERROR", f"k8s {args.action}: {exc}")
        return 2
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        while True:
            try:
                if args.action == "cleanup":
                    outcome = await maintenance.cleanup(
                        api,
                        args.namespace,
                        args.node,
                        lenders=args.lender,
                        stand_down_s=args.stand_down_s,
                    )
                else:
                    outcome = await maintenance.mark_stale(api, args.node, args.stale_after_s)
            except K8sApiError as exc:
                _say(args, "ERROR", f"k8s {args.action}: {exc} ({exc.hint})")
                if getattr(args, "every", None) is None:
                    return 2
            else:
                print(json.dumps(maintenance.summary(args.action, outcome)), flush=True)
                for error in outcome.errors:
                    _say(args, "ERROR", f"k8s {args.action}: {error}")
                if getattr(args, "every", None) is None:
                    return 0 if outcome.ok else 1
            try:
                async with asyncio.timeout(args.every):
                    await stop.wait()
                return 0
            except TimeoutError:
                pass
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await api.close()
