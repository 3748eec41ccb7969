"""Publishing lendability to Kubernetes.

``client`` is the only module that imports kubernetes_asyncio (an optional extra), and only
when a publisher starts; ``publisher`` writes desired state with backoff; ``companion`` follows
lenders over HTTP; ``host`` feeds the daemon's own state to a publisher.
"""
