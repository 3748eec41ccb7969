"""What every HTTP listener shares: bearer-token authentication, the daemon's metric
registry and counters, and the access lines (:mod:`vacancyd.web.access`).

Below the proxy, the control layer and the API in the layer order, so each of them can
count and authenticate without importing another's internals.
"""
